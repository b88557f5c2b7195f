"""HixlConnector's scheduler side: which requests load their KV from a prefill and into
which blocks, which finished prefill requests keep their blocks for a decode, and the
kv_transfer_params a prefill returns. No hixl engine here: the workers move the bytes."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from ._params import Handshake, ParamsError, Settings, parse_remote, produced

log = logging.getLogger("hixl.vllm")

#: The request states in which a prefill's blocks are worth keeping for a decode.
DONE_STATES = ("FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED")


@dataclass
class Load:
    """One decode request's load, for the worker: read remote blocks `src` of the prefill
    into local blocks `dst` (runs merged by hixl.kv), then tell the prefill. `error` set: no
    read, the blocks are reported failed (vLLM then recomputes or fails the request)."""

    request_id: str
    dst: list[int]
    src: list[int] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    #: the request's leading blocks vLLM found in its own prefix cache (not read)
    hits: int = 0


@dataclass
class Meta:
    """What the scheduler hands its workers each step (vLLM's connector metadata)."""

    loads: list[Load] = field(default_factory=list)
    #: finished prefill requests whose blocks are kept for a decode: request id -> lease (s)
    holds: dict[str, float] = field(default_factory=dict)


class Scheduler:
    """The scheduler-side half; `tp_size` and `block_size` are this engine's."""

    def __init__(self, settings: Settings, engine_id: str, tp_size: int, block_size: int) -> None:
        self.settings = settings
        self.engine_id = engine_id
        self.tp_size = tp_size
        self.block_size = block_size
        self.ranks: dict[int, Handshake] = {}
        self._loads: list[Load] = []
        self._holds: dict[str, float] = {}

    def set_handshakes(self, by_tp_rank: dict[int, Any]) -> None:
        """The workers' Handshake metadata (vLLM gathers it once their caches are up)."""
        self.ranks = {int(k): v for k, v in by_tp_rank.items() if isinstance(v, Handshake)}

    def matched(self, request: Any, num_computed: int) -> tuple[int, bool]:
        """How many prompt tokens beyond the `num_computed` ones found locally (vLLM's prefix
        cache) this decode request loads from its prefill, and that it loads them
        asynchronously. Params that cannot be used still claim the prompt, so that the
        worker reports the blocks failed and vLLM's kv_load_failure_policy decides."""
        params = getattr(request, "kv_transfer_params", None)
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        total = request.num_prompt_tokens
        try:
            total = min(parse_remote(params).num_tokens, total)
        except ParamsError:
            pass  # reported by update_state_after_alloc's Load
        count = total - num_computed
        return (count, True) if count > 0 else (0, False)

    def after_alloc(self, request: Any, blocks: Any, num_external: int) -> None:
        """Plans the load of a request `matched` claimed tokens for: the blocks vLLM just
        allocated beyond its prefix-cache hits, paired with the prefill's blocks at the same
        positions. Runs once per request (do_remote_prefill is cleared)."""
        params = getattr(request, "kv_transfer_params", None)
        if not params or not params.get("do_remote_prefill"):
            return
        params["do_remote_prefill"] = False
        rid = request.request_id
        dst = list(blocks.get_unhashed_block_ids()) if num_external > 0 else []
        hits = len(blocks.get_block_ids()[0]) - len(dst)  # blocks vLLM found locally
        try:
            remote = parse_remote(params)
            src = list(remote.block_ids[hits : hits + len(dst)])
            if len(src) != len(dst):
                raise ParamsError(
                    f"kv_transfer_params field remote_block_ids has {len(remote.block_ids)} "
                    f"blocks; this prompt needs {hits + len(dst)} ({hits} found locally)"
                )
        except ParamsError as exc:
            if num_external > 0:
                self._loads.append(Load(rid, dst, error=str(exc)))
            else:
                log.error("request %s: %s", rid, exc)
            return
        # with nothing to read (a full local hit) the prefill is still told to let go
        self._loads.append(Load(rid, dst, src, dict(params), hits=hits))

    def build_meta(self) -> Meta:
        meta = Meta(self._loads, self._holds)
        self._loads, self._holds = [], {}
        return meta

    def finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill request (do_remote_decode) that ended normally keeps its blocks for its
        decode (True: freed when the worker reports it sent, or after lease_s) and returns
        the kv_transfer_params its decode request carries."""
        params = getattr(request, "kv_transfer_params", None)
        if not params or not params.get("do_remote_decode"):
            return False, None
        if getattr(request.status, "name", "") not in DONE_STATES or not block_ids:
            return False, None
        if len(self.ranks) != self.tp_size:
            log.error(
                "request %s: %d of %d workers published their hixl address; its blocks are "
                "freed now",
                request.request_id,
                len(self.ranks),
                self.tp_size,
            )
            return False, None
        lease = self.settings.lease_s
        self._holds[request.request_id] = lease
        ranks = [self.ranks[i] for i in range(self.tp_size)]
        return True, produced(
            request.request_id,
            self.engine_id,
            list(block_ids),
            request.num_computed_tokens,
            self.tp_size,
            ranks,
            lease,
        )
