"""Rank tables (version 1.2, as Ascend writes them) in hixl's terms: each rank's address.

A device entry names ``device_ip`` (and ``host_ip``, here or on its server) but usually no
port: on Ascend the NPU's HCCL port is implied. hixl derives it: ``device_port`` (or
``port``) where the entry has one, else ``base + device_id``, the base being the option
``llm.hixlDevicePortBase`` (default ``DEFAULT_DEVICE_PORT_BASE``, HCCL's device port). The IP
is ``device_ip``, else ``host_ip`` of the entry or of its server.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ._status import LLMStatusCode, fail

#: Where rank ``device_id`` listens when its entry has no ``device_port``: this + device_id.
DEFAULT_DEVICE_PORT_BASE = 16666
#: The option (LLMConfig / init options) that moves that base.
PORT_BASE_OPTION = "llm.hixlDevicePortBase"


def port_base(options: Mapping[str, str]) -> int:
    """The base of derived ports from ``options``; ``LLM_PARAM_INVALID`` naming a bad one."""
    raw = options.get(PORT_BASE_OPTION)
    if raw is None or str(raw) == "":
        return DEFAULT_DEVICE_PORT_BASE
    s = str(raw).strip()
    if not s.isdigit() or not 1 <= int(s) <= 65535:
        raise fail(LLMStatusCode.LLM_PARAM_INVALID, f"{PORT_BASE_OPTION}={raw!r} is not 1..65535")
    return int(s)


Entry = tuple[Mapping[str, Any], Mapping[str, Any]]


def address(entry: Entry, base: int) -> str:
    """The "ip:port" a rank's device entry (with its server) says it listens at."""
    dev, server = entry
    rank = dev.get("rank_id")
    ip = dev.get("device_ip") or dev.get("host_ip") or server.get("host_ip")
    if not ip:
        raise fail(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"rank {rank}: the rank table gives neither device_ip nor host_ip",
        )
    port = dev.get("device_port", dev.get("port"))
    if port is None or str(port) == "":
        dev_id = str(dev.get("device_id", "")).strip()
        if not dev_id.isdigit():
            raise fail(
                LLMStatusCode.LLM_PARAM_INVALID,
                f"rank {rank}: no device_port and device_id={dev.get('device_id')!r} is not a "
                "number to derive one from",
            )
        port = base + int(dev_id)
    s = str(port).strip()
    if not s.isdigit() or not 1 <= int(s) <= 65535:
        raise fail(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"rank {rank}: port {port!r} is not 1..65535 ({PORT_BASE_OPTION}={base})",
        )
    ip = str(ip)
    return f"[{ip}]:{int(s)}" if ":" in ip else f"{ip}:{int(s)}"


def entries(rank_table: str) -> dict[int, Entry]:
    """rank_id -> (device entry, its server) of ``rank_table`` (a JSON text)."""
    try:
        table = json.loads(rank_table)
        return {int(d["rank_id"]): (d, s) for s in table["server_list"] for d in s["device"]}
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise fail(LLMStatusCode.LLM_PARAM_INVALID, f"rank_table is malformed: {exc!r}") from None
