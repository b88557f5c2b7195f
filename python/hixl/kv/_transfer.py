"""Cache and block transfers: CacheTransferConfig, tasks and their results."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import HixlError, ParamInvalid, Status
from .._errors import Timeout as HixlTimeout
from .._hixl import NotifyDesc, TransferOp
from .._kvcore._executor import Flight, executor
from .._kvcore._plan import descs, split
from .._kvcore._window import Window
from .._wakers import Wakers
from ._blocks import _block_ids, block_pieces
from ._cache import CacheInfo, RegisteredCache, addr_pairs
from ._context import Context, context
from ._errors import LLM_SUCCESS, LLM_TOO_LARGE, KVError

log = logging.getLogger("hixl.kv")


@dataclass(frozen=True)
class CacheTransferConfig:
    """How a cache transfer runs: requests in flight, each request's deadline, and whether
    the call returns at once (``async_enable=True``) or waits for the end."""

    max_concurrent: int = 4
    timeout_ms: int = 5000
    async_enable: bool = False

    def __post_init__(self) -> None:
        # timeout_ms takes 0 as the engine's timeout_ms does: no time at all (each request ends
        # TIMEOUT unless it completed while it was submitted).
        for name, low in (("max_concurrent", 1), ("timeout_ms", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ParamInvalid(f"{name}={v!r} must be an integer >= {low}")


@dataclass
class TransferResult:
    """The outcome of a task: ``status_code`` ("LLM_SUCCESS" or the error's), bytes moved,
    seconds from start to end, and one result per remote rank."""

    status_code: str = LLM_SUCCESS
    bytes: int = 0
    elapsed_s: float = 0.0
    per_rank: dict[int, TransferResult] = field(default_factory=dict)
    error: KVError | None = None

    @property
    def gbps(self) -> float:
        return self.bytes / self.elapsed_s / 1e9 if self.elapsed_s > 0 else 0.0


@dataclass
class Request:
    """One engine request of a task: which rank, op, descriptors, and an optional notify
    that the peer receives after the bytes (layerwise push)."""

    rank: int
    address: str
    op: TransferOp
    descs: np.ndarray
    nbytes: int
    layer: int | None = None
    notify: NotifyDesc | None = None


def as_llm_error(exc: BaseException, what: str) -> KVError:
    if isinstance(exc, KVError):
        return exc
    if isinstance(exc, HixlError):
        return KVError.from_engine(exc, what)
    raise exc


class TransferTask:
    """A running or finished cache transfer. ``wait()`` returns its TransferResult or raises
    its KVError (the result is on the error as ``.result``).

    A synchronous call runs its body in the caller's thread before it returns the task; an
    asynchronous one (``start``) runs on the KV core's executor, whose one thread completes
    the requests of every task."""

    def __init__(
        self,
        body: Callable[[TransferTask], None] | None,
        ranks: Iterable[int],
        run_async: bool = False,
    ) -> None:
        self.result = TransferResult(per_rank={r: TransferResult() for r in ranks})
        self.layer_times: dict[str, dict[int, float]] = {}
        self._done = threading.Event()
        self._wakers = Wakers()  # asyncio waiters (`await task`)
        self._t0 = time.perf_counter()
        #: Called once with the task when it ends (before its waiters wake).
        self.on_end: list[Callable[[TransferTask], None]] = []
        if body is None:
            return
        if run_async:
            executor().post(lambda: self._run(body))
        else:
            self._run(body)

    def _run(self, body: Callable[[TransferTask], None]) -> None:
        """Runs `body` to the task's end."""
        try:
            body(self)
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), never swallowed
            self._end(exc)
        else:
            self._end()

    def _end(self, exc: BaseException | None = None, what: str = "cache transfer") -> None:
        """Ends the task (once; later calls do nothing), with `exc` as its error if given
        (a hixl error becomes an KVError saying `what` failed)."""
        if self._done.is_set():
            return
        if exc is not None:
            try:
                self.fail(as_llm_error(exc, what))
            except BaseException as other:  # not a hixl error: keep it as is
                self.result.error = KVError(str(int(Status.FAILED)), repr(other), Status.FAILED)
                self.result.error.__cause__ = other
                self.result.status_code = self.result.error.status_code
        self.result.elapsed_s = time.perf_counter() - self._t0
        for r in self.result.per_rank.values():
            r.elapsed_s = r.elapsed_s or self.result.elapsed_s
        for hook in self.on_end:
            try:
                hook(self)
            except Exception:  # noqa: BLE001 - a hook must not keep the task from ending
                log.exception("a transfer task's end hook failed")
        self._done.set()
        self._wakers.wake(lambda: None)

    def _raise_if_sync(self, cfg: CacheTransferConfig) -> TransferTask:
        """A synchronous call has already run the body: it raises the error right away."""
        if not cfg.async_enable:
            self.wait()
        return self

    def fail(self, err: KVError, rank: int | None = None) -> None:
        if rank is not None and rank in self.result.per_rank:
            pr = self.result.per_rank[rank]
            if pr.error is None:
                pr.error, pr.status_code = err, err.status_code
        if self.result.error is None:
            self.result.error, self.result.status_code = err, err.status_code

    def mark(self, event: str, layer: int) -> None:
        self.layer_times.setdefault(event, {})[layer] = time.monotonic()

    def is_done(self) -> bool:
        return self._done.is_set()

    def __await__(self) -> Generator[Any, None, TransferResult]:
        """``await task``: waits on the running asyncio loop (the executor thread wakes it)
        and returns its TransferResult or raises its KVError, like ``wait()``."""
        return self._wait_async().__await__()

    async def _wait_async(self) -> TransferResult:
        fut = self._wakers.add(self._done.is_set)
        if self._done.is_set():
            self._wakers.wake(lambda: None)
        await fut
        return self.wait(0)

    def wait(self, timeout_ms: float | None = None) -> TransferResult:
        """Waits for the end (at most `timeout_ms`; the task's own requests always end within
        their timeout). Raises hixl.Timeout if the task is still running then, or the task's
        KVError."""
        if not self._done.wait(None if timeout_ms is None else timeout_ms / 1000):
            raise HixlTimeout(f"the transfer task is still running after {timeout_ms} ms")
        err = self.result.error
        if err is not None:
            err.result = self.result  # type: ignore[attr-defined]
            raise err
        return self.result


class Pipeline:
    """The requests of one task in flight, on the KV core's window: at most
    cfg.max_concurrent at a time, ended in submission order, their bytes counted per rank.
    A rank whose request fails is recorded on the task and gets no more requests; the other
    ranks go on. Blocking (``submit`` / ``drain`` in the caller's thread) unless
    `run_async`: then the requests are completed on the executor (``add``, then ``close``
    with what to do once all have ended), and every method is the executor thread's."""

    def __init__(
        self,
        ctx: Context,
        task: TransferTask,
        cfg: CacheTransferConfig,
        on_done: Callable[[Request], None] | None = None,
        run_async: bool = False,
        after: Callable[[], None] | None = None,
    ) -> None:
        self.ctx, self.task, self.cfg, self.on_done = ctx, task, cfg, on_done
        #: Called after each request ends (asynchronous only), once its result is recorded.
        self.after = after
        self.failed: set[int] = set()
        self.window: Window[Request] | None = None
        self.flight: Flight[Request] | None = None
        self.then: Callable[[], None] | None = None
        if run_async:
            self.flight = Flight(
                ctx.engine,
                cfg.max_concurrent,
                cfg.timeout_ms,
                self._done,
                self._fail,
                self._idle,
                skip=lambda r: r.rank in self.failed,
            )
        else:
            self.window = Window(
                ctx.engine, cfg.max_concurrent, cfg.timeout_ms, self._done, self._fail
            )

    @property
    def inflight(self) -> int:
        """How many requests are in flight."""
        if self.flight is not None:
            return len(self.flight.inflight)
        assert self.window is not None
        return len(self.window.inflight)

    def _fail(self, r: Request, exc: HixlError) -> None:
        self.failed.add(r.rank)
        self.task.fail(KVError.from_engine(exc, f"transfer with rank {r.rank}"), r.rank)
        if self.after is not None:
            self.after()

    def _done(self, r: Request) -> None:
        self.task.result.bytes += r.nbytes
        pr = self.task.result.per_rank.get(r.rank)
        if pr is not None:
            pr.bytes += r.nbytes
            pr.elapsed_s = time.perf_counter() - self.task._t0
        if self.on_done is not None:
            self.on_done(r)
        if self.after is not None:
            self.after()

    def _idle(self) -> None:
        if self.then is not None:
            then, self.then = self.then, None
            then()

    @staticmethod
    def _stuck(r: Request) -> str:
        return f"request to rank {r.rank} still waiting after its timeout"

    def submit(self, r: Request) -> None:
        """Submits `r` unless its rank has failed already (blocking: waits for room)."""
        if r.rank in self.failed:
            return
        assert self.window is not None
        self.window.submit(r, r.address, r.op, r.descs, r.notify, self._stuck(r))

    def add(self, r: Request) -> None:
        """Queues `r` on the executor's window (asynchronous); skipped when its rank has
        failed by its turn."""
        assert self.flight is not None
        self.flight.submit(r, r.address, r.op, r.descs, r.notify, self._stuck(r))

    def close(self, then: Callable[[], None]) -> None:
        """No more requests: `then()` once every one has ended (at once when none is left)."""
        assert self.flight is not None
        self.then = then
        if self.flight.idle():
            self._idle()

    def abandon(self) -> None:
        """Stops: no more submissions or callbacks (asynchronous; requests in flight still
        end in the engine, within their timeout)."""
        assert self.flight is not None
        self.then = None
        self.flight.abandon()

    def reap(self, block: bool = True) -> bool:
        """Ends the oldest request (waiting for it unless `block` is False); False if there
        was none to end."""
        assert self.window is not None
        return self.window.reap(block)

    def drain(self) -> None:
        """Ends every request in flight."""
        assert self.window is not None
        self.window.drain()


def run_requests(
    ctx: Context,
    task: TransferTask,
    reqs: Iterable[Request],
    cfg: CacheTransferConfig,
    on_done: Callable[[Request], None] | None = None,
) -> None:
    """Submits `reqs` in order through a Pipeline and waits for all of them."""
    pipe = Pipeline(ctx, task, cfg, on_done)
    for r in reqs:
        pipe.submit(r)
    pipe.drain()


#: A task's plan: its requests (and what follows each one that completes), made once the
#: task runs (in the caller's thread, or on the executor).
Plan = Callable[[TransferTask], tuple[list[Request], Callable[[Request], None] | None]]


def start(
    ctx: Context,
    cfg: CacheTransferConfig,
    ranks: Iterable[int],
    plan: Plan,
    what: str = "cache transfer",
    on_end: list[Callable[[TransferTask], None]] | None = None,
) -> TransferTask:
    """A task that runs `plan` and its requests: in the caller's thread before it returns
    (cfg.async_enable False; its error raised), or on the executor (returned at once).
    `what` names the task in its errors; `on_end` are its end hooks."""
    task = TransferTask(None, ranks)
    task.on_end += on_end or []
    if not cfg.async_enable:
        try:
            reqs, on_done = plan(task)
            run_requests(ctx, task, reqs, cfg, on_done)
        except BaseException as exc:  # noqa: BLE001 - raised by _raise_if_sync
            task._end(exc, what)
        else:
            task._end()
        return task._raise_if_sync(cfg)

    def begin() -> None:
        try:
            reqs, on_done = plan(task)
            pipe = Pipeline(ctx, task, cfg, on_done, run_async=True)
            for r in reqs:
                pipe.add(r)
            pipe.close(task._end)
        except BaseException as exc:  # noqa: BLE001 - kept for wait()
            task._end(exc, what)

    executor().post(begin)
    return task


def same_geometry(a: CacheInfo, b: CacheInfo) -> bool:
    return (a.shape, a.dtype, a.layer_axis) == (b.shape, b.dtype, b.layer_axis)


def check_fits(src: CacheInfo, dst: CacheInfo, src_where: str, dst_where: str) -> None:
    if src.nbytes > dst.nbytes:
        raise KVError(
            LLM_TOO_LARGE,
            f"cache {src.name!r} on {src_where} is {src.nbytes} bytes, "
            f"larger than the registered destination {dst.name!r} on {dst_where} "
            f"({dst.nbytes} bytes)",
        )


def layer_pairs(local: CacheInfo, remote: CacheInfo, layer: int) -> list[tuple[int, int, int]]:
    return addr_pairs(local, remote, [(off, off, n) for off, n in local.layer_ranges(layer)])


def layer_request(
    local: CacheInfo,
    remote: CacheInfo,
    rank: int,
    address: str,
    op: TransferOp,
    layer: int,
    notify: NotifyDesc | None = None,
) -> Request:
    """The request moving one layer between two caches of the same geometry."""
    p = layer_pairs(local, remote, layer)
    return Request(rank, address, op, descs(p), sum(x[2] for x in p), layer, notify)


def whole_requests(
    local: CacheInfo,
    remote: CacheInfo,
    rank: int,
    address: str,
    op: TransferOp,
    chunk: int = 16 << 20,
) -> list[Request]:
    """Requests moving the source's bytes: one per layer when both caches have the same
    geometry, 16 MiB pieces of the byte range otherwise."""
    if same_geometry(local, remote):
        return [layer_request(local, remote, rank, address, op, k) for k in range(local.num_layers)]
    n = remote.nbytes if op == TransferOp.READ else local.nbytes
    return [
        Request(
            rank,
            address,
            op,
            descs(addr_pairs(local, remote, [(o, o, min(chunk, n - o))])),
            min(chunk, n - o),
        )
        for o in range(0, n, chunk)
    ]


def _ranks(remote_ranks: int | Iterable[int]) -> list[int]:
    ranks = [remote_ranks] if isinstance(remote_ranks, int) else [int(r) for r in remote_ranks]
    if not ranks:
        raise ParamInvalid("remote_ranks is empty")
    if len(set(ranks)) != len(ranks):
        raise ParamInvalid(f"remote_ranks={ranks} lists a rank twice")
    return ranks


def pull_cache(
    remote_rank: int,
    local_cache: RegisteredCache,
    transfer_config: CacheTransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Copies the remote rank's cache called `remote_name` (default: local_cache's name) into
    local_cache."""
    ctx, cfg = context(), transfer_config or CacheTransferConfig()

    def plan(task: TransferTask) -> tuple[list[Request], None]:
        peer, remote = ctx.remote_cache(remote_rank, remote_name or local_cache.name)
        check_fits(remote, local_cache.info, f"rank {remote_rank}", f"rank {ctx.rank}")
        op = TransferOp.READ
        return whole_requests(local_cache.info, remote, remote_rank, peer.address, op), None

    return start(ctx, cfg, [remote_rank], plan)


def push_cache(
    remote_ranks: int | Iterable[int],
    src: RegisteredCache,
    transfer_config: CacheTransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Writes `src` into the cache of that name (or `remote_name`) on every listed rank, all
    ranks in parallel from the one source buffer."""
    ctx, cfg, ranks = context(), transfer_config or CacheTransferConfig(), _ranks(remote_ranks)

    def plan(task: TransferTask) -> tuple[list[Request], None]:
        per_rank: list[list[Request]] = []
        for r in ranks:
            try:
                peer, remote = ctx.remote_cache(r, remote_name or src.name)
                check_fits(src.info, remote, f"rank {ctx.rank}", f"rank {r}")
            except KVError as err:
                task.fail(err, r)
                continue
            per_rank.append(whole_requests(src.info, remote, r, peer.address, TransferOp.WRITE))
        # Interleave the ranks (layer 0 to every rank, then layer 1, ...) so all progress.
        longest = max((len(x) for x in per_rank), default=0)
        return [rs[i] for i in range(longest) for rs in per_rank if i < len(rs)], None

    return start(ctx, cfg, ranks, plan)


def _check_lengths(what: str, local_blocks: Any, remote_blocks: Any) -> None:
    """Arguments before link state: a length error is not hidden by "not linked"."""
    try:
        _block_ids(local_blocks, remote_blocks)
    except HixlError as exc:
        raise as_llm_error(exc, what) from exc


def _block_requests(
    local: CacheInfo,
    remote: CacheInfo,
    local_blocks: Any,
    remote_blocks: Any,
    rank: int,
    address: str,
    op: TransferOp,
    parts: int,
) -> list[Request]:
    lb, rb = _block_ids(local_blocks, remote_blocks)
    pieces = block_pieces(local, remote, lb, rb)
    pairs = addr_pairs(local, remote, [x for p in pieces for x in p])
    return [
        Request(rank, address, op, descs(chunk), sum(x[2] for x in chunk))
        for chunk in split(pairs, parts)
    ]


def pull_blocks(
    remote_rank: int,
    local_cache: RegisteredCache,
    src_blocks: Any,
    dst_blocks: Any,
    transfer_config: CacheTransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Copies the remote cache's blocks `src_blocks` into local blocks `dst_blocks`, across
    all layers, K and V; runs of consecutive ids on both sides move as one segment."""
    ctx, cfg = context(), transfer_config or CacheTransferConfig()
    _check_lengths("pull_blocks", dst_blocks, src_blocks)

    def plan(task: TransferTask) -> tuple[list[Request], None]:
        peer, remote = ctx.remote_cache(remote_rank, remote_name or local_cache.name)
        reqs = _block_requests(
            local_cache.info,
            remote,
            dst_blocks,
            src_blocks,
            remote_rank,
            peer.address,
            TransferOp.READ,
            cfg.max_concurrent,
        )
        return reqs, None

    return start(ctx, cfg, [remote_rank], plan)


def push_blocks(
    remote_ranks: int | Iterable[int],
    src_cache: RegisteredCache,
    src_blocks: Any,
    dst_blocks: Any,
    transfer_config: CacheTransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Writes local blocks `src_blocks` into blocks `dst_blocks` of the cache of that name on
    every listed rank."""
    ctx, cfg, ranks = context(), transfer_config or CacheTransferConfig(), _ranks(remote_ranks)
    _check_lengths("push_blocks", src_blocks, dst_blocks)

    def plan(task: TransferTask) -> tuple[list[Request], None]:
        reqs: list[Request] = []
        for r in ranks:
            peer, remote = ctx.remote_cache(r, remote_name or src_cache.name)
            reqs += _block_requests(
                src_cache.info,
                remote,
                src_blocks,
                dst_blocks,
                r,
                peer.address,
                TransferOp.WRITE,
                cfg.max_concurrent,
            )
        return reqs, None

    return start(ctx, cfg, ranks, plan)
