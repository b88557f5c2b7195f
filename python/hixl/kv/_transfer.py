"""Cache and block transfers: TransferConfig, tasks and their results."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import HixlError, ParamInvalid, Status
from .._errors import Timeout as HixlTimeout
from .._hixl import NotifyDesc, TransferOp
from .._kvcore._plan import block_runs, descs, run_bytes, split
from .._kvcore._window import Window
from .._wakers import Wakers
from ._cache import Cache, CacheInfo
from ._context import Context, context
from ._errors import LLM_SUCCESS, LLM_TOO_LARGE, LLMError


@dataclass(frozen=True)
class TransferConfig:
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
    error: LLMError | None = None

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


def as_llm_error(exc: BaseException, what: str) -> LLMError:
    if isinstance(exc, LLMError):
        return exc
    if isinstance(exc, HixlError):
        return LLMError.from_engine(exc, what)
    raise exc


class TransferTask:
    """A running or finished cache transfer. ``wait()`` returns its TransferResult or raises
    its LLMError (the result is on the error as ``.result``)."""

    def __init__(
        self, body: Callable[[TransferTask], None], ranks: Iterable[int], run_async: bool
    ) -> None:
        self.result = TransferResult(per_rank={r: TransferResult() for r in ranks})
        self.layer_times: dict[str, dict[int, float]] = {}
        self._done = threading.Event()
        self._wakers = Wakers()  # asyncio waiters (`await task`)
        self._body = body
        self._t0 = time.perf_counter()
        if run_async:
            threading.Thread(target=self._run, name="hixl-kv-task", daemon=True).start()
        else:
            self._run()

    def _run(self) -> None:
        try:
            self._body(self)
        except BaseException as exc:  # noqa: BLE001 - kept for wait(), never swallowed
            try:
                self.fail(as_llm_error(exc, "cache transfer"))
            except BaseException as other:  # not a hixl error: keep it as is
                self.result.error = LLMError(str(int(Status.FAILED)), repr(other), Status.FAILED)
                self.result.error.__cause__ = other
                self.result.status_code = self.result.error.status_code
        finally:
            self.result.elapsed_s = time.perf_counter() - self._t0
            for r in self.result.per_rank.values():
                r.elapsed_s = r.elapsed_s or self.result.elapsed_s
            self._done.set()
            self._wakers.wake(lambda: None)

    def _raise_if_sync(self, cfg: TransferConfig) -> TransferTask:
        """A synchronous call has already run the body: it raises the error right away."""
        if not cfg.async_enable:
            self.wait()
        return self

    def fail(self, err: LLMError, rank: int | None = None) -> None:
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
        """``await task``: waits on the running asyncio loop (the task's own thread wakes it)
        and returns its TransferResult or raises its LLMError, like ``wait()``."""
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
        LLMError."""
        if not self._done.wait(None if timeout_ms is None else timeout_ms / 1000):
            raise HixlTimeout(f"the transfer task is still running after {timeout_ms} ms")
        err = self.result.error
        if err is not None:
            err.result = self.result  # type: ignore[attr-defined]
            raise err
        return self.result


class Pipeline:
    """The requests of one task in flight, on the KV core's window: at most
    cfg.max_concurrent at a time, reaped in submission order, their bytes counted per rank.
    A rank whose request fails is recorded on the task and gets no more requests; the other
    ranks go on."""

    def __init__(
        self,
        ctx: Context,
        task: TransferTask,
        cfg: TransferConfig,
        on_done: Callable[[Request], None] | None = None,
    ) -> None:
        self.ctx, self.task, self.cfg, self.on_done = ctx, task, cfg, on_done
        self.window: Window[Request] = Window(
            ctx.engine, cfg.max_concurrent, cfg.timeout_ms, self._done, self._fail
        )
        self.failed: set[int] = set()

    @property
    def inflight(self) -> int:
        """How many requests are in flight."""
        return len(self.window.inflight)

    def _fail(self, r: Request, exc: HixlError) -> None:
        self.failed.add(r.rank)
        self.task.fail(LLMError.from_engine(exc, f"transfer with rank {r.rank}"), r.rank)

    def _done(self, r: Request) -> None:
        self.task.result.bytes += r.nbytes
        pr = self.task.result.per_rank.get(r.rank)
        if pr is not None:
            pr.bytes += r.nbytes
            pr.elapsed_s = time.perf_counter() - self.task._t0
        if self.on_done is not None:
            self.on_done(r)

    def submit(self, r: Request) -> None:
        """Submits `r` unless its rank has failed already."""
        if r.rank in self.failed:
            return
        stuck = f"request to rank {r.rank} still waiting after its timeout"
        self.window.submit(r, r.address, r.op, r.descs, r.notify, stuck)

    def reap(self, block: bool = True) -> bool:
        """Ends the oldest request (waiting for it unless `block` is False); False if there
        was none to end."""
        return self.window.reap(block)

    def drain(self) -> None:
        """Ends every request in flight."""
        self.window.drain()


def run_requests(
    ctx: Context,
    task: TransferTask,
    reqs: Iterable[Request],
    cfg: TransferConfig,
    on_done: Callable[[Request], None] | None = None,
) -> None:
    """Submits `reqs` in order through a Pipeline and waits for all of them."""
    pipe = Pipeline(ctx, task, cfg, on_done)
    for r in reqs:
        pipe.submit(r)
    pipe.drain()


def same_geometry(a: CacheInfo, b: CacheInfo) -> bool:
    return (a.shape, a.dtype, a.layer_axis) == (b.shape, b.dtype, b.layer_axis)


def check_fits(src: CacheInfo, dst: CacheInfo, src_where: str, dst_where: str) -> None:
    if src.nbytes > dst.nbytes:
        raise LLMError(
            LLM_TOO_LARGE,
            f"cache {src.name!r} on {src_where} is {src.nbytes} bytes, "
            f"larger than the registered destination {dst.name!r} on {dst_where} "
            f"({dst.nbytes} bytes)",
        )


def layer_pairs(local: CacheInfo, remote: CacheInfo, layer: int) -> list[tuple[int, int, int]]:
    return [(local.addr + off, remote.addr + off, n) for off, n in local.layer_ranges(layer)]


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
            descs([(local.addr + o, remote.addr + o, min(chunk, n - o))]),
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
    local_cache: Cache,
    transfer_config: TransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Copies the remote rank's cache called `remote_name` (default: local_cache's name) into
    local_cache."""
    ctx, cfg = context(), transfer_config or TransferConfig()

    def body(task: TransferTask) -> None:
        peer, remote = ctx.remote_cache(remote_rank, remote_name or local_cache.name)
        check_fits(remote, local_cache.info, f"rank {remote_rank}", f"rank {ctx.rank}")
        reqs = whole_requests(local_cache.info, remote, remote_rank, peer.address, TransferOp.READ)
        run_requests(ctx, task, reqs, cfg)

    return TransferTask(body, [remote_rank], cfg.async_enable)._raise_if_sync(cfg)


def push_cache(
    remote_ranks: int | Iterable[int],
    src: Cache,
    transfer_config: TransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Writes `src` into the cache of that name (or `remote_name`) on every listed rank, all
    ranks in parallel from the one source buffer."""
    ctx, cfg, ranks = context(), transfer_config or TransferConfig(), _ranks(remote_ranks)

    def body(task: TransferTask) -> None:
        per_rank: list[list[Request]] = []
        for r in ranks:
            try:
                peer, remote = ctx.remote_cache(r, remote_name or src.name)
                check_fits(src.info, remote, f"rank {ctx.rank}", f"rank {r}")
            except LLMError as err:
                task.fail(err, r)
                continue
            per_rank.append(whole_requests(src.info, remote, r, peer.address, TransferOp.WRITE))
        # Interleave the ranks (layer 0 to every rank, then layer 1, ...) so all progress.
        longest = max((len(x) for x in per_rank), default=0)
        reqs = [rs[i] for i in range(longest) for rs in per_rank if i < len(rs)]
        run_requests(ctx, task, reqs, cfg)

    return TransferTask(body, ranks, cfg.async_enable)._raise_if_sync(cfg)


def _block_ids(local_blocks: Any, remote_blocks: Any) -> tuple[list[int], list[int]]:
    """The block id lists as ints, checked to be of one length (before any link is used)."""
    lb = [int(b) for b in np.asarray(local_blocks).ravel()]
    rb = [int(b) for b in np.asarray(remote_blocks).ravel()]
    if len(lb) != len(rb):
        raise ParamInvalid(f"{len(rb)} remote block ids but {len(lb)} local ones")
    return lb, rb


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
    for side, info, ids in (("local", local, lb), ("remote", remote, rb)):
        n = info.num_blocks
        bad = [b for b in ids if not 0 <= b < n]
        if bad:
            raise ParamInvalid(
                f"{side} block id {bad[0]} is out of range 0..{n - 1} (cache {info.name!r})"
            )
    if (local.block_bytes, local.block_pieces()) != (remote.block_bytes, remote.block_pieces()):
        raise ParamInvalid(
            f"blocks differ: local {local.name!r} has {local.block_pieces()} x "
            f"{local.block_bytes} bytes per block, remote {remote.name!r} "
            f"{remote.block_pieces()} x {remote.block_bytes}"
        )
    bb, runs = local.block_bytes, block_runs(lb, rb)  # (local start, remote start, count)
    pairs = [
        x
        for p in range(local.block_pieces())
        for x in run_bytes(
            runs,
            bb,
            local.addr + p * local.num_blocks * bb,
            remote.addr + p * remote.num_blocks * bb,
        )
    ]
    return [
        Request(rank, address, op, descs(chunk), sum(x[2] for x in chunk))
        for chunk in split(pairs, parts)
    ]


def pull_blocks(
    remote_rank: int,
    local_cache: Cache,
    src_blocks: Any,
    dst_blocks: Any,
    transfer_config: TransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Copies the remote cache's blocks `src_blocks` into local blocks `dst_blocks`, across
    all layers, K and V; runs of consecutive ids on both sides move as one segment."""
    ctx, cfg = context(), transfer_config or TransferConfig()
    _check_lengths("pull_blocks", dst_blocks, src_blocks)
    _check_lengths("pull_blocks", dst_blocks, src_blocks)

    def body(task: TransferTask) -> None:
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
        run_requests(ctx, task, reqs, cfg)

    return TransferTask(body, [remote_rank], cfg.async_enable)._raise_if_sync(cfg)


def push_blocks(
    remote_ranks: int | Iterable[int],
    src_cache: Cache,
    src_blocks: Any,
    dst_blocks: Any,
    transfer_config: TransferConfig | None = None,
    remote_name: str | None = None,
) -> TransferTask:
    """Writes local blocks `src_blocks` into blocks `dst_blocks` of the cache of that name on
    every listed rank."""
    ctx, cfg, ranks = context(), transfer_config or TransferConfig(), _ranks(remote_ranks)
    _check_lengths("push_blocks", src_blocks, dst_blocks)

    def body(task: TransferTask) -> None:
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
        run_requests(ctx, task, reqs, cfg)

    return TransferTask(body, ranks, cfg.async_enable)._raise_if_sync(cfg)
