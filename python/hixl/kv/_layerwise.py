"""Layer-by-layer transfers: the consumer starts on layer k as soon as it has arrived, the
producer starts sending layer k as soon as it has computed it."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .._errors import HixlError, ParamInvalid
from .._errors import Timeout as HixlTimeout
from .._hixl import NotifyDesc, TransferOp
from .._kvcore._executor import executor
from .._peertext import Malformed, shown
from .._wakers import Wakers
from ._cache import CacheInfo, RegisteredCache
from ._context import context
from ._errors import KVError
from ._handoff import check_handoff, layer_groups
from ._notes import LAYER_NOTIFY, note_text, parse_note, request_text
from ._notes import MAX_INDEX as MAX_INDEX  # the notification text's names, where they were
from ._notes import MAX_LAYER_TEXT as MAX_LAYER_TEXT
from ._notes import parse_layer as parse_layer
from ._sender import rank_address, same_engine
from ._transfer import (
    CacheTransferConfig,
    Pipeline,
    Request,
    TransferTask,
    as_llm_error,
    check_fits,
    descs,
    layer_pairs,
    layer_request,
    same_geometry,
    start,
)

#: How long after a receive's gap deadline its timer looks once more (a clock's rounding).
GAP_SLACK_S = 0.001

log = logging.getLogger("hixl.kv")


def _for_later(ctx: Any) -> Callable[[NotifyDesc], bool]:
    """Whether a layer notification that no running receive takes could be taken by a later
    one: well formed, naming a layer of a cache registered here, and sent by the engine of
    the rank it names (any engine with an id while no address is known for that rank, as
    receive_cache_async takes the first one then). The router drops the others at once."""

    def keep(n: NotifyDesc) -> bool:
        try:
            note = parse_note(n.msg)
        except Malformed:
            return False
        cache = ctx.caches.get(note.cache)
        if cache is None or note.layer >= cache.num_layers:
            return False
        want = rank_address(ctx, note.rank)
        if want is None:
            return bool(n.peer) and not n.peer.startswith("?")
        return same_engine(n.peer, want)

    return keep


class LayerTracker:
    """Tracks which layers of a cache are present (consumer) or computed (producer).

    ``get_current_layer()`` is the index of the newest layer present (every layer before it
    is present too); before the first layer has arrived it waits for it, at most
    ``timeout_ms``, so a loop that uses that layer never reads an absent one.
    ``get_layer_count()`` is the number of layers present. ``wait_sync()`` blocks until the
    next ``sync_interval`` layers are present; ``layer_ready(k)`` is the producer's call after
    computing layer k.

    ``total_layers`` may be fewer than the cache's layers (its layer axis) if it divides
    them: each synchronizer layer is then that many consecutive cache layers (a (8192, 8192)
    cache described as 32 layers moves in 32 pieces of 256 rows)."""

    def __init__(
        self, total_layers: int, sync_interval: int = 1, timeout_ms: float | None = 30_000
    ) -> None:
        for name, v in (("total_layers", total_layers), ("sync_interval", sync_interval)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParamInvalid(f"{name}={v!r} must be an integer >= 1")
        if timeout_ms is not None and not timeout_ms > 0:
            raise ParamInvalid(f"timeout_ms={timeout_ms!r} must be > 0 (or None: no limit)")
        self.total_layers = total_layers
        self.sync_interval = sync_interval
        self.timeout_ms = timeout_ms
        self._cond = threading.Condition()
        self._present = [False] * total_layers
        self._current = 0
        self._synced = 0
        self._ready: deque[int] = deque()
        self._error: BaseException | None = None
        #: monotonic times per event ("ready", "arrived") and layer, for timelines.
        self.times: dict[str, dict[int, float]] = {"ready": {}, "arrived": {}}
        self._wakers = Wakers()  # asyncio waiters (wait_sync_async, wait_layer_async)
        #: Called (outside the lock) after each layer_ready: a push task's wake-up.
        self._on_ready: list[Callable[[], None]] = []

    def get_current_layer(self) -> int:
        """The index of the newest layer present, counted from layer 0 without a gap. Before
        any layer is present it waits for layer 0 (raising hixl.Timeout after the
        synchronizer's timeout_ms, or the transfer's error if it failed)."""
        return self._wait_for(1, self.timeout_ms) - 1

    def get_layer_count(self) -> int:
        """How many layers are present, counted from layer 0 without a gap (at once)."""
        with self._cond:
            return self._current

    def _wait_for(self, count: int, timeout_ms: float | None) -> int:
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000
        with self._cond:
            while self._current < count:
                if self._error is not None:
                    raise self._error
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise HixlTimeout(
                        f"{self._current} of {self.total_layers} layers present "
                        f"after {timeout_ms} ms, waiting for {count}"
                    )
                self._cond.wait(left)
            return self._current

    def wait_sync(self, timeout_ms: float | None = None) -> int:
        """Blocks until `sync_interval` more layers than at the last wait_sync are present (or
        all of them) and returns the count. Raises the transfer's error if it failed, and
        hixl.Timeout after `timeout_ms` (None: the synchronizer's timeout_ms)."""
        with self._cond:
            target = min(self.total_layers, self._synced + self.sync_interval)
        got = self._wait_for(target, self.timeout_ms if timeout_ms is None else timeout_ms)
        with self._cond:
            self._synced = max(self._synced, got)
        return got

    async def _wait_for_async(self, count: int, timeout_ms: float | None) -> int:
        fut = self._wakers.add(lambda: self._current >= count)
        with self._cond:
            self._wakers.wake(lambda: self._current, self._error)  # it may hold already
        try:
            limit = None if timeout_ms is None else timeout_ms / 1000
            return int(await asyncio.wait_for(fut, limit))
        except TimeoutError:
            raise HixlTimeout(
                f"{self.get_layer_count()} of {self.total_layers} layers present "
                f"after {timeout_ms} ms, waiting for {count}"
            ) from None

    async def wait_sync_async(self, timeout_ms: float | None = None) -> int:
        """``wait_sync`` for an asyncio event loop: awaits without blocking the loop (the
        thread that records the layers wakes it)."""
        with self._cond:
            target = min(self.total_layers, self._synced + self.sync_interval)
        got = await self._wait_for_async(
            target, self.timeout_ms if timeout_ms is None else timeout_ms
        )
        with self._cond:
            self._synced = max(self._synced, got)
        return got

    async def wait_layer_async(self, layer: int, timeout_ms: float | None = None) -> None:
        """``wait_layer`` for an asyncio event loop."""
        if not 0 <= layer < self.total_layers:
            raise ParamInvalid(f"layer={layer} is out of range 0..{self.total_layers - 1}")
        await self._wait_for_async(layer + 1, self.timeout_ms if timeout_ms is None else timeout_ms)

    def wait_layer(self, layer: int, timeout_ms: float | None = None) -> None:
        """Blocks until layer `layer` (and every one before it) is present (at most
        `timeout_ms`; None: the synchronizer's timeout_ms)."""
        if not 0 <= layer < self.total_layers:
            raise ParamInvalid(f"layer={layer} is out of range 0..{self.total_layers - 1}")
        self._wait_for(layer + 1, self.timeout_ms if timeout_ms is None else timeout_ms)

    def layer_ready(self, layer: int) -> None:
        """Producer: layer `layer` is computed; a push task sends it at once."""
        if not isinstance(layer, int) or not 0 <= layer < self.total_layers:
            raise ParamInvalid(f"layer={layer!r} is out of range 0..{self.total_layers - 1}")
        with self._cond:
            if self._present[layer]:
                raise ParamInvalid(f"layer {layer} was already marked ready")
            self._mark(layer, "ready")
            self._ready.append(layer)
            listeners = list(self._on_ready)
        for fn in listeners:
            fn()

    def _mark(self, layer: int, event: str) -> None:
        self._present[layer] = True
        self.times[event][layer] = time.monotonic()
        while self._current < self.total_layers and self._present[self._current]:
            self._current += 1
        self._cond.notify_all()
        self._wakers.wake(lambda: self._current)

    def _arrive(self, layer: int) -> None:
        with self._cond:
            if not self._present[layer]:
                self._mark(layer, "arrived")

    def _fail(self, err: BaseException) -> None:
        with self._cond:
            self._error = err
            self._cond.notify_all()
        self._wakers.wake(lambda: None, err)

    def _take_ready(self) -> int | None:
        """The oldest layer marked ready and not taken yet, or None (at once)."""
        with self._cond:
            return self._ready.popleft() if self._ready else None


def _check_layers(cache: RegisteredCache, syncer: LayerTracker) -> int:
    """How many cache layers make one synchronizer layer."""
    if cache.num_layers % syncer.total_layers:
        raise ParamInvalid(
            f"synchronizer has total_layers={syncer.total_layers}, cache "
            f"{cache.name!r} has {cache.num_layers} layers (not a multiple)"
        )
    return cache.num_layers // syncer.total_layers


def _group_request(
    local: CacheInfo,
    remote: CacheInfo,
    rank: int,
    address: str,
    op: TransferOp,
    group: int,
    per: int,
    notify: NotifyDesc | None = None,
) -> Request:
    """The request moving synchronizer layer `group`: cache layers group*per .. +per-1."""
    if per == 1:
        return layer_request(local, remote, rank, address, op, group, notify)
    p = [x for k in range(group * per, (group + 1) * per) for x in layer_pairs(local, remote, k)]
    p.sort()
    merged: list[tuple[int, int, int]] = []
    for lo, ro, n in p:  # consecutive layers of a layer-major cache: one piece
        if merged and merged[-1][0] + merged[-1][2] == lo and merged[-1][1] + merged[-1][2] == ro:
            merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + n)
        else:
            merged.append((lo, ro, n))
    return Request(rank, address, op, descs(merged), sum(x[2] for x in merged), group, notify)


def transfer_cache_async(
    remote_rank: int,
    local_cache: RegisteredCache,
    synchronizer: LayerTracker,
    mode: str = "pull",
    transfer_config: CacheTransferConfig | None = None,
    remote_name: str | None = None,
    *,
    src_blocks: Any = None,
    dst_blocks: Any = None,
    request_id: str | None = None,
) -> TransferTask:
    """Moves a cache layer by layer in the background and returns the task at once.

    pull: reads the remote cache's layers in order; the synchronizer counts arrivals.
    push: sends layer k as soon as ``synchronizer.layer_ready(k)`` is called, each followed by
    a notification that the receiver's ``receive_cache_async`` counts.

    With `src_blocks` and `dst_blocks` (lists of block ids of one length), only those blocks
    move, every layer, K and V: block ``src_blocks[i]`` of the source (local for a push, the
    remote cache for a pull) into block ``dst_blocks[i]`` of the destination, runs of
    consecutive ids one descriptor each; the two caches may have different numbers of
    blocks. Ids outside either cache, or lists that are not ints or differ in length, are a
    KVError (PARAM_INVALID) naming the value before any byte moves. With `request_id` (a
    push), each layer's notification names the request, so that a receiver's
    ``receive_cache_async(..., request_id=)`` counts only its own request's layers."""
    if mode not in ("pull", "push"):
        raise ParamInvalid(f"mode={mode!r} must be 'pull' or 'push'")
    per = _check_layers(local_cache, synchronizer)
    ctx, cfg = context(), transfer_config or CacheTransferConfig()
    name = remote_name or local_cache.name
    hand = check_handoff(mode, local_cache, src_blocks, dst_blocks, request_id)
    blocks = hand is not None and bool(hand.local)
    rid = None if hand is None else hand.request_id

    def requests(
        remote: CacheInfo, address: str, op: TransferOp
    ) -> Callable[[int, Callable[[int], NotifyDesc] | None], Request]:
        """How synchronizer layer g's request is made (its notify from its byte count)."""
        if not blocks:
            if not same_geometry(local_cache.info, remote):
                raise ParamInvalid(
                    f"layerwise {mode} needs equal shapes: local {local_cache.shape}, "
                    f"remote {remote.shape} on rank {remote_rank}"
                )

            def whole(g: int, note: Callable[[int], NotifyDesc] | None) -> Request:
                r = _group_request(local_cache.info, remote, remote_rank, address, op, g, per)
                r.notify = None if note is None else note(r.nbytes)
                return r

            return whole
        assert hand is not None
        total = synchronizer.total_layers
        groups = layer_groups(local_cache.info, remote, hand, total, per, mode == "push")

        def some(g: int, note: Callable[[int], NotifyDesc] | None) -> Request:
            n = sum(x[2] for x in groups[g])
            notify = None if note is None else note(n)
            return Request(remote_rank, address, op, descs(groups[g]), n, g, notify)

        return some

    def pull(task: TransferTask) -> tuple[list[Request], Callable[[Request], None]]:
        peer, remote = ctx.remote_cache(remote_rank, name)
        make = requests(remote, peer.address, TransferOp.READ)
        reqs = [make(g, None) for g in range(synchronizer.total_layers)]

        def arrived(r: Request) -> None:
            assert r.layer is not None
            synchronizer._arrive(r.layer)

        return reqs, arrived

    def push(task: TransferTask) -> None:
        """On the executor: sends each layer as layer_ready marks it, until all are sent, a
        request fails, or no layer is marked ready for cfg.timeout_ms."""
        peer, remote = ctx.remote_cache(remote_rank, name)
        if not blocks:
            check_fits(local_cache.info, remote, f"rank {ctx.rank}", f"rank {remote_rank}")
        make = requests(remote, peer.address, TransferOp.WRITE)
        ex, total, gap_s = executor(), synchronizer.total_layers, cfg.timeout_ms / 1000
        sent, gap_deadline = [0], [time.monotonic() + gap_s]

        def pump() -> None:
            if task.is_done() or pipe.then is not None:
                return
            while sent[0] < total and not pipe.failed:
                k = synchronizer._take_ready()
                if k is None:
                    return
                task.mark("submitted", k)
                pipe.add(make(k, notice(k)))
                sent[0] += 1
                gap_deadline[0] = time.monotonic() + gap_s
            stop()
            pipe.close(task._end)

        def notice(k: int) -> Callable[[int], NotifyDesc]:
            """Layer k's notification, from the bytes its request moves."""
            return lambda n: NotifyDesc(LAYER_NOTIFY, note_text(ctx.rank, name, k, rid, n))

        def gap() -> None:
            if task.is_done() or pipe.then is not None:
                return
            if time.monotonic() < gap_deadline[0]:
                ex.call_at(gap_deadline[0], gap)
                return
            stop()
            pipe.abandon()
            task._end(
                HixlTimeout(
                    f"no layer was marked ready for {cfg.timeout_ms} ms ({sent[0]} of {total} sent)"
                ),
                what,
            )

        def wake() -> None:
            ex.post(pump)

        def stop() -> None:
            with synchronizer._cond:
                if wake in synchronizer._on_ready:
                    synchronizer._on_ready.remove(wake)

        def marked(r: Request) -> None:
            task.mark("sent", r.layer or 0)

        pipe = Pipeline(ctx, task, cfg, on_done=marked, run_async=True, after=pump)
        with synchronizer._cond:
            synchronizer._on_ready.append(wake)
        pump()
        ex.call_at(gap_deadline[0], gap)

    what = f"layerwise {mode} with rank {remote_rank}"

    def failed(task: TransferTask) -> None:
        if task.result.error is not None and mode == "pull":
            synchronizer._fail(task.result.error)

    if mode == "pull":
        return start(ctx, replace(cfg, async_enable=True), [remote_rank], pull, what, [failed])
    task = TransferTask(None, [remote_rank])

    def begin() -> None:
        try:
            push(task)
        except BaseException as exc:  # noqa: BLE001 - kept for wait()
            task._end(exc, what)

    executor().post(begin)
    return task


def receive_cache_async(
    remote_rank: int,
    local_cache: RegisteredCache,
    synchronizer: LayerTracker,
    transfer_config: CacheTransferConfig | None = None,
    *,
    request_id: str | None = None,
) -> TransferTask:
    """Follows a producer's layerwise push into `local_cache`: each layer counts as present
    when its notification arrives, which the producer's engine sends only after that layer's
    bytes are visible here. Fails with a timeout when no layer arrives for timeout_ms.

    With `request_id`, only the layer notifications of the push with that request id count
    (and the bytes each says its layer moved), so that receives of several requests into
    one pool run at once, each ending when its own layers have come; without, only those of
    pushes without a request id.

    A layer counts only when its notification came from the engine of `remote_rank` (the
    connection it arrived on, never its text): the address of the rank's link, else the one
    ``peers=`` or discovery gave. When none is known, the first engine that announces a layer
    of this cache for that rank is taken as it for the rest of the receive. Others are dropped
    and logged."""
    _check_layers(local_cache, synchronizer)
    ctx, cfg = context(), transfer_config or CacheTransferConfig()
    try:
        rid = None if request_id is None else request_text(request_id)
    except ParamInvalid as exc:
        raise as_llm_error(exc, f"receiving cache {local_cache.name!r}") from exc
    want_rank, want_name = int(remote_rank), local_cache.name
    first: list[str] = []  # the sender taken as the rank when no address is known
    keep = _for_later(ctx)

    def match(n: NotifyDesc) -> bool:
        try:
            note = parse_note(n.msg)
        except Malformed:
            return False
        return (note.rank, note.cache, note.request) == (want_rank, want_name, rid)

    def from_rank(n: NotifyDesc) -> bool:
        want = rank_address(ctx, remote_rank)
        if want is None and not first and n.peer and not n.peer.startswith("?"):
            first.append(n.peer)
            log.info(
                "no address is known for rank %d: taking %r, the first engine to announce a "
                "layer of cache %r, as it",
                remote_rank,
                n.peer,
                local_cache.name,
            )
        if want is None and first:
            want = first[0]
        if want is not None and same_engine(n.peer, want):
            return True
        log.warning(
            "dropped a layer notification %s for rank %d from %r: rank %d is %r",
            shown(n.msg),
            remote_rank,
            n.peer,
            remote_rank,
            want,
        )
        return False

    total, layer_bytes = synchronizer.total_layers, local_cache.nbytes // synchronizer.total_layers
    gap_s, got = cfg.timeout_ms / 1000, [0]
    gap_deadline = [time.monotonic() + gap_s]
    ex = executor()
    task = TransferTask(None, [remote_rank])

    def take() -> None:
        """The layers' notifications that have come (on the executor thread, each time the
        engine's notification descriptor wakes it, and at the gap's deadline)."""
        if task.is_done():
            return
        try:
            if synchronizer.get_layer_count() >= total:
                task._end()
                return
            notes = [n for n in ctx.mailbox.take(LAYER_NOTIFY, match, keep) if from_rank(n)]
            for n in notes:
                note = parse_note(n.msg)
                k, nbytes = note.layer, layer_bytes if note.nbytes is None else note.nbytes
                if not k < total:
                    raise ParamInvalid(
                        f"rank {remote_rank} announced layer {k} of a {total}-layer cache"
                    )
                if nbytes > layer_bytes:
                    raise ParamInvalid(
                        f"rank {remote_rank} announced {nbytes} bytes in layer {k} of cache "
                        f"{want_name!r}, whose layers hold {layer_bytes}"
                    )
                synchronizer._arrive(k)
                task.mark("arrived", k)
                task.result.bytes += nbytes
                task.result.per_rank[remote_rank].bytes += nbytes
                got[0] += 1
            if notes:
                gap_deadline[0] = time.monotonic() + gap_s
            elif time.monotonic() > gap_deadline[0]:
                raise KVError(
                    str(int(HixlTimeout.status)),
                    f"no layer of cache {local_cache.name!r} arrived from rank "
                    f"{remote_rank} for {cfg.timeout_ms} ms ({got[0]} of {total})",
                    HixlTimeout.status,
                )
            if synchronizer.get_layer_count() >= total:
                task._end()
                return
        except (HixlError, ValueError) as exc:
            err = as_llm_error(exc, f"receiving cache {local_cache.name!r}")
            synchronizer._fail(err)
            task._end(err)
            return
        except BaseException as exc:  # noqa: BLE001 - kept for wait()
            task._end(exc)
            return

    stop: list[Callable[[], None]] = []
    gap_timer: list[Any] = [None]  # the one timer at the gap's deadline, while it is set

    def turn() -> None:
        """Takes what came; then stops watching once the task ended, or makes sure a timer
        waits for the gap's deadline (a timer that finds the deadline moved sets another)."""
        take()
        if task.is_done():
            for s in stop:
                s()
            if gap_timer[0] is not None:
                gap_timer[0].cancel()
            return
        if gap_timer[0] is None:
            gap_timer[0] = ex.call_at(gap_deadline[0] + GAP_SLACK_S, at_gap)

    def at_gap() -> None:
        gap_timer[0] = None
        turn()

    def begin() -> None:
        """Watches the engine's notification descriptor, then looks at what is pending
        (what came before the descriptor was made does not wake it)."""
        try:
            fd = ctx.engine._notify_fd()
        except HixlError as exc:
            err = as_llm_error(exc, f"receiving cache {local_cache.name!r}")
            synchronizer._fail(err)
            task._end(err)
            return
        stop.append(ex.watch(fd, turn))
        turn()

    ex.post(begin)
    return task
