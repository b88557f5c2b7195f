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
#: The option naming this process's device_ip in the rank table: init then listens at once
#: at its derived address (device_ip, base + ge.exec.deviceId), so that no other process can
#: take that port before link().
DEVICE_IP_OPTION = "llm.hixlDeviceIp"


def own_address(options: Mapping[str, str]) -> str | None:
    """The derived address init listens at when ``llm.hixlDeviceIp`` is given (None when it
    is not): that IP and port base + the first ``ge.exec.deviceId`` (default 0);
    ``LLM_PARAM_INVALID`` naming a bad value."""
    ip = str(options.get(DEVICE_IP_OPTION) or "").strip().strip("[]")
    if not ip:
        return None
    dev = str(options.get("ge.exec.deviceId", "0")).split(";")[0].strip() or "0"
    if not dev.isdigit():
        raise fail(
            LLMStatusCode.LLM_PARAM_INVALID,
            f"ge.exec.deviceId={options.get('ge.exec.deviceId')!r} is not a device number to "
            f"derive the port of {DEVICE_IP_OPTION}={ip!r} from",
        )
    entry = {"device_ip": ip, "device_id": dev, "rank_id": "(this process)"}
    return address((entry, {}), port_base(options))


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
