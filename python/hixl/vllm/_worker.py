"""HixlConnector's worker side: registers vLLM's per-layer KV tensors with hixl.kv as one
pool, reads a decode request's blocks from its prefill (one-sided READs, layer by layer,
runs of blocks merged), tells the prefill when it has them, and lets a prefill request's
blocks go when its decode has read them or its lease ran out."""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .. import kv
from .._errors import HixlError
from .._hixl import NotifyDesc
from ._params import CACHE_NAME, DONE_NOTIFY, Handshake, Settings, handshake, parse_remote
from ._scheduler import Load, Meta

log = logging.getLogger("hixl.vllm")

#: Most "read" notifications kept for holds not announced yet (the oldest go first).
MAX_EARLY = 4096


def block_axis(shape: tuple[int, ...], num_blocks: int) -> int:
    """The axis of a layer's tensor that counts blocks: the first of `num_blocks` entries;
    ValueError naming the shape when there is none."""
    for i, n in enumerate(shape):
        if n == num_blocks:
            return i
    raise ValueError(f"no axis of a KV tensor of shape {shape} has the {num_blocks} blocks")


class Worker:
    """One TP rank's half of the connector; `role` is hixl.kv's ("prompt", "decoder",
    "mix")."""

    def __init__(
        self, settings: Settings, role: str, tp_rank: int, tp_size: int, num_blocks: int
    ) -> None:
        self.settings = settings
        self.role = role
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.num_blocks = num_blocks
        self.me: Handshake | None = None
        self.pool: Any = None
        self.layers = 0
        self._pool_threads = ThreadPoolExecutor(4, thread_name_prefix="hixl-vllm-load")
        self._results: queue.Queue[tuple[str, list[int], bool]] = queue.Queue()
        self._failed: set[int] = set()
        self._holds: dict[str, float] = {}  # request id -> monotonic deadline
        self._early: dict[str, None] = {}  # read notifications before their hold
        self._linked: dict[int, str] = {}  # hixl rank -> the address it was linked at
        self._lock = threading.Lock()

    # -- setup -----------------------------------------------------------------------

    def register(self, kv_caches: dict[str, Any]) -> None:
        """Starts this rank's hixl engine and registers vLLM's KV tensors (one a layer,
        those shared by several layers once) as one cache of per-layer tensors."""
        import torch  # type: ignore[import-not-found]  # vLLM's; needed only here

        layers, seen = [], set()
        for t in kv_caches.values():
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                # as bytes: numpy and the CUDA array interface know no bfloat16 (the last
                # axis grows by the item size; the block axis stays where it was)
                layers.append(t.view(torch.uint8) if t.is_contiguous() else t)
        if not layers:
            raise ValueError("HixlConnector: vLLM registered no KV-cache tensors")
        shape = tuple(layers[0].shape)
        if not all(t.is_contiguous() for t in layers):
            raise ValueError(
                f"HixlConnector needs each layer's KV tensor contiguous (got shape {shape}, "
                f"strides {tuple(layers[0].stride())}): a KV-cache layout with layers "
                "outermost"
            )
        axis = block_axis(shape, self.num_blocks)
        device = getattr(layers[0].device, "type", "cpu") == "cuda"
        rank = self.settings.cluster_id
        rank = secrets.randbits(31) if rank is None else rank + self.tp_rank
        me = kv.init(
            cluster_id=rank,
            role=self.role,
            listen=self.settings.listen_for(self.tp_rank),
            device_id=(layers[0].device.index or 0) if device else 0,
            options=self.settings.options(),
        )
        self.pool = kv.allocate_cache(
            layers, "device" if device else "host", name=CACHE_NAME, block_axis=axis
        )
        self.layers = len(layers)
        self.me = Handshake(self.tp_rank, str(me.address), rank, CACHE_NAME)
        log.info(
            "TP rank %d is hixl rank %d at %s; %d layers of %s, block axis %d",
            self.tp_rank,
            rank,
            me.address,
            len(layers),
            shape,
            axis,
        )

    # -- a step ----------------------------------------------------------------------

    def start(self, meta: Meta) -> None:
        """Takes the step's metadata: new loads start in the background, new holds count
        from now."""
        now = time.monotonic()
        with self._lock:
            for rid, lease in meta.holds.items():
                self._holds[rid] = now + lease
        for ld in meta.loads:
            self._pool_threads.submit(self._load, ld)

    def _load(self, ld: Load) -> None:
        """Links to the prefill rank if needed, reads the blocks, tells the prefill; on any
        failure the load's blocks are reported failed (never a hang: everything is bounded
        by load_timeout_s)."""
        t0 = time.monotonic()
        ok, addr = False, None
        try:
            if ld.error is not None:
                raise ValueError(ld.error)
            remote = parse_remote(ld.params)
            addr, rank = handshake(remote, self.tp_size, self.tp_rank)
            limit_ms = int(self.settings.load_timeout_s * 1000)
            self._link(rank, addr, limit_ms)
            if ld.src:
                left = max(1, limit_ms - int((time.monotonic() - t0) * 1000))
                task = kv.transfer_cache_async(
                    rank,
                    self.pool,
                    kv.LayerTracker(self.layers, timeout_ms=left),
                    "pull",
                    kv.CacheTransferConfig(timeout_ms=left),
                    remote_name=remote.cache,
                    src_blocks=ld.src,
                    dst_blocks=ld.dst,
                )
                task.wait(timeout_ms=left)
            if time.time() >= remote.expires:
                raise ValueError(
                    f"the read ended after hixl_expires={remote.expires}: the prefill may have "
                    "reused the blocks (raise lease_s)"
                )
            ok = True
            log.info(
                "request %s read %d blocks from %s (%d found locally) in %.1f ms",
                ld.request_id,
                len(ld.src),
                addr,
                ld.hits,
                (time.monotonic() - t0) * 1000,
            )
        except Exception as exc:  # noqa: BLE001 - every failure is reported to vLLM
            log.error(
                "request %s could not load its KV cache (%d blocks): %s: %s",
                ld.request_id,
                len(ld.dst),
                type(exc).__name__,
                exc,
            )
        if ld.dst:  # a full local hit never waited for a load: nothing to report to vLLM
            self._results.put((ld.request_id, ld.dst, ok))
        if addr is not None:
            self._tell(addr, str(ld.params.get("remote_request_id")))

    def _link(self, rank: int, addr: str, timeout_ms: int) -> None:
        """Links to hixl rank `rank` at `addr`; a rank linked at another address before (a
        prefill restarted elsewhere with that rank) is unlinked first, so that its blocks are
        never read from the engine that had it."""
        with self._lock:
            was = self._linked.get(rank)
        if was is not None and was != addr:
            kv.unlink([rank])
        kv.link([kv.PeerRank(rank, None, addr)], timeout_ms=timeout_ms)
        with self._lock:
            self._linked[rank] = addr

    def _tell(self, addr: str, remote_request_id: str) -> None:
        """Tells the prefill that its request's blocks may go (best effort: a prefill that
        is gone lets them go at its lease's end)."""
        msg = json.dumps({"request": remote_request_id})
        try:
            kv.engine().send_notify(addr, NotifyDesc(DONE_NOTIFY, msg), 5000)
        except HixlError as exc:
            log.warning("could not tell %s that %s was read: %s", addr, msg, exc)

    def finished(self) -> tuple[set[str], set[str], set[str]]:
        """(prefill requests whose blocks may go now, decode requests whose load ended,
        those of them whose load failed)."""
        sent: set[str] = set()
        self._take_reads()
        now = time.monotonic()
        with self._lock:
            for rid in [r for r in self._holds if r in self._early]:
                del self._early[rid], self._holds[rid]
                sent.add(rid)
            for rid, deadline in list(self._holds.items()):
                if now >= deadline:
                    del self._holds[rid]
                    sent.add(rid)
                    log.warning(
                        "request %s: no decode read its blocks within lease_s=%s; freed",
                        rid,
                        self.settings.lease_s,
                    )
        recvd: set[str] = set()
        failed: set[str] = set()
        while True:
            try:
                rid, dst, ok = self._results.get_nowait()
            except queue.Empty:
                break
            recvd.add(rid)
            if not ok:
                failed.add(rid)
                self._failed.update(dst)
        return sent, recvd, failed

    def _take_reads(self) -> None:
        if self.pool is None:
            return
        try:
            notes = kv.engine().wait_notifies(0, name=DONE_NOTIFY)
        except HixlError:
            return  # none pending (Timeout), or the engine is gone
        with self._lock:
            for n in notes:
                try:
                    rid = json.loads(n.msg)["request"]
                except (ValueError, KeyError, TypeError):
                    log.warning("dropped a malformed %r from %s", DONE_NOTIFY, n.peer)
                    continue
                self._early[str(rid)] = None
            while len(self._early) > MAX_EARLY:
                del self._early[next(iter(self._early))]

    def load_errors(self) -> set[int]:
        """The local blocks of loads that failed since the last call."""
        out, self._failed = self._failed, set()
        return out

    def shutdown(self) -> None:
        self._pool_threads.shutdown(wait=False, cancel_futures=True)
        if self.pool is not None:
            self.pool = None
            kv.finalize()
