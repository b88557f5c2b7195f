"""What HixlConnector reads and writes without vLLM: its extra-config keys, the
``kv_transfer_params`` a prefill hands to its decode (checked field by field), and the
handshake that picks the prefill rank a decode rank reads from."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .._errors import ParamInvalid
from .._peertext import shown

#: Version of the hixl fields in kv_transfer_params; a decode refuses another one.
PARAMS_VERSION = 1
#: The name each rank's pool of vLLM's per-layer KV tensors is registered under.
CACHE_NAME = "hixl.vllm.kv"
#: The notification a decode rank sends its prefill rank once it has read a request's blocks.
DONE_NOTIFY = "hixl.vllm.read"

#: extra-config key -> (default, meaning); the README's table lists the same keys.
EXTRA_KEYS: dict[str, tuple[Any, str]] = {
    "listen": ("127.0.0.1:0", "host:port of each worker's hixl engine (port+tp_rank, 0: any)"),
    "secret": (None, "hixl.secret (else HIXL_SECRET)"),
    "backends": ("auto", "hixl.backends"),
    "lease_s": (120.0, "how long prefill keeps a request's blocks for its decode"),
    "load_timeout_s": (30.0, "longest a decode load (link and read) may take"),
    "cluster_id": (None, "this engine's first hixl rank (default: random)"),
}


class ParamsError(ParamInvalid):
    """kv_transfer_params that a decode cannot use; the message names the field."""


@dataclass(frozen=True)
class Settings:
    """The connector's kv_connector_extra_config, checked."""

    listen: str = "127.0.0.1:0"
    secret: str | None = None
    backends: str = "auto"
    lease_s: float = 120.0
    load_timeout_s: float = 30.0
    cluster_id: int | None = None

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> Settings:
        """The settings in `extra`; ParamInvalid naming an unknown key or a bad value."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(EXTRA_KEYS))
        if unknown:
            raise ParamInvalid(
                f"kv_connector_extra_config key {unknown[0]!r} is not one of HixlConnector's: "
                f"{', '.join(EXTRA_KEYS)}"
            )
        listen = str(extra.get("listen", cls.listen))
        host, sep, port = listen.rpartition(":")
        if not sep or not host or not port.isdigit() or int(port) > 65535:
            raise ParamInvalid(f"kv_connector_extra_config listen={listen!r} is not HOST:PORT")
        out: dict[str, Any] = {"listen": listen}
        for key in ("lease_s", "load_timeout_s"):
            v = extra.get(key, getattr(cls, key))
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < math.inf:
                raise ParamInvalid(f"kv_connector_extra_config {key}={v!r} must be seconds > 0")
            out[key] = float(v)
        cid = extra.get("cluster_id")
        if cid is not None and (isinstance(cid, bool) or not isinstance(cid, int) or cid < 0):
            raise ParamInvalid(f"kv_connector_extra_config cluster_id={cid!r} must be an int >= 0")
        for key in ("secret", "backends"):
            v = extra.get(key, getattr(cls, key))
            if v is not None and not isinstance(v, str):
                raise ParamInvalid(f"kv_connector_extra_config {key} must be a string")
            out[key] = v
        return cls(cluster_id=cid, **out)

    def listen_for(self, tp_rank: int) -> str:
        """Where TP rank `tp_rank`'s engine listens: the port plus the rank (0 stays 0)."""
        host, _, port = self.listen.rpartition(":")
        p = int(port)
        return f"{host}:{p + tp_rank if p else 0}"

    def options(self) -> dict[str, str]:
        """The hixl engine options these settings give (the secret only when set here:
        otherwise the engine reads HIXL_SECRET itself)."""
        opts = {"hixl.backends": self.backends}
        if self.secret:
            opts["hixl.secret"] = self.secret
        return opts


@dataclass(frozen=True)
class Handshake:
    """What one prefill worker publishes through vLLM's handshake metadata: its hixl
    engine's address and rank, and the name of its pool."""

    tp_rank: int
    address: str
    rank: int
    cache: str = CACHE_NAME


@dataclass(frozen=True)
class Remote:
    """A prefill's kv_transfer_params, checked: where its blocks are and how many tokens
    they hold."""

    request_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    num_tokens: int
    tp_size: int
    addresses: tuple[str, ...]
    ranks: tuple[int, ...]
    cache: str
    expires: float


def produced(
    request_id: str,
    engine_id: str,
    block_ids: list[int],
    num_tokens: int,
    tp_size: int,
    ranks: list[Handshake],
    lease_s: float,
) -> dict[str, Any]:
    """The kv_transfer_params a prefill returns for its decode (vLLM's standard fields and
    hixl's own, all JSON)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_request_id": request_id,
        "remote_engine_id": engine_id,
        "remote_block_ids": list(block_ids),
        "remote_num_tokens": num_tokens,
        "tp_size": tp_size,
        "hixl_version": PARAMS_VERSION,
        "hixl_addresses": [h.address for h in ranks],
        "hixl_ranks": [h.rank for h in ranks],
        "hixl_cache": ranks[0].cache if ranks else CACHE_NAME,
        "hixl_expires": time.time() + lease_s,
    }


def _field(params: Mapping[str, Any], key: str, kind: type | tuple[type, ...]) -> Any:
    if key not in params:
        raise ParamsError(f"kv_transfer_params has no field {key!r} (not a hixl prefill's)")
    v = params[key]
    if isinstance(v, bool) or not isinstance(v, kind):
        raise ParamsError(f"kv_transfer_params field {key}={shown(v)} is not of the right type")
    return v


def _ints(params: Mapping[str, Any], key: str) -> tuple[int, ...]:
    v = _field(params, key, list)
    if any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in v):
        raise ParamsError(f"kv_transfer_params field {key}={shown(v)} is not a list of ints >= 0")
    return tuple(v)


def parse_remote(params: Mapping[str, Any], now: float | None = None) -> Remote:
    """The checked fields of a prefill's kv_transfer_params; ParamsError naming the first
    field that is missing, of the wrong type, inconsistent, or stale (hixl_expires past:
    the prefill has released those blocks)."""
    if not isinstance(params, Mapping):
        raise ParamsError(f"kv_transfer_params={shown(params)} is not an object")
    version = _field(params, "hixl_version", int)
    if version != PARAMS_VERSION:
        raise ParamsError(
            f"kv_transfer_params field hixl_version={version} is not {PARAMS_VERSION}: "
            "prefill and decode run different hixl versions"
        )
    tp = _field(params, "tp_size", int)
    addresses = tuple(_field(params, "hixl_addresses", list))
    if any(not isinstance(a, str) or ":" not in a for a in addresses):
        raise ParamsError(f"kv_transfer_params field hixl_addresses={shown(addresses)} is bad")
    ranks = _ints(params, "hixl_ranks")
    if tp < 1 or len(addresses) != tp or len(ranks) != tp:
        raise ParamsError(
            f"kv_transfer_params fields hixl_addresses ({len(addresses)}) and hixl_ranks "
            f"({len(ranks)}) must have tp_size={tp} entries"
        )
    num_tokens = _field(params, "remote_num_tokens", int)
    if num_tokens < 0:
        raise ParamsError(f"kv_transfer_params field remote_num_tokens={num_tokens} is < 0")
    expires = _field(params, "hixl_expires", (int, float))
    if (time.time() if now is None else now) >= expires:
        raise ParamsError(
            f"kv_transfer_params field hixl_expires={expires} is past: the prefill has "
            "released these blocks (stale kv_transfer_params, or a lease_s too short)"
        )
    return Remote(
        str(_field(params, "remote_request_id", str)),
        str(_field(params, "remote_engine_id", str)),
        _ints(params, "remote_block_ids"),
        num_tokens,
        tp,
        addresses,
        ranks,
        str(_field(params, "hixl_cache", str)),
        float(expires),
    )


def handshake(remote: Remote, tp_size: int, tp_rank: int) -> tuple[str, int]:
    """The (address, hixl rank) of the prefill rank that TP rank `tp_rank` of a decode of
    `tp_size` ranks reads from: rank i from rank i. ParamsError naming both sizes when the
    two engines' tensor-parallel sizes differ (each rank holds another slice of the heads)."""
    if remote.tp_size != tp_size:
        raise ParamsError(
            f"tensor-parallel sizes differ: the prefill has tp_size={remote.tp_size}, this "
            f"decode tp_size={tp_size}; HixlConnector reads rank i from rank i, so both "
            "engines must run the same tensor_parallel_size"
        )
    return remote.addresses[tp_rank], remote.ranks[tp_rank]
