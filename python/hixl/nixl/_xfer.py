"""Transfers of ``nixl_agent`` (``prep_xfer_dlist``, ``make_prepped_xfer``,
``initialize_xfer``, ``transfer``, ``check_xfer_state``, ...) and their handles
(``nixl_prepped_dlist_handle``, ``nixl_xfer_handle``).

A transfer is one batched ``transfer_async`` call on the hixl engine, with the descriptors as
one ``(N, 3)`` ``uint64`` array (local address, remote address, length).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from .._errors import HixlError, NotConnected
from .._hixl import AsyncConnectStatus, NotifyDesc, TransferOp, TransferReq, TransferStatus
from .._peertext import shown
from ._bindings import (
    NIXL_INIT_AGENT,
    from_hixl,
    nixlInvalidParamError,
    nixlNotFoundError,
    nixlNotPostedError,
    nixlRepostActiveError,
    nixlXferTelemetry,
)
from ._common import U64, _first_outside, _msg, _name, log
from ._metadata import _Metadata, _Remote


class nixl_prepped_dlist_handle:
    """A descriptor list prepared by ``prep_xfer_dlist`` (local, remote or loopback)."""

    __slots__ = ("_agent", "remote", "addrs", "lens", "_released")

    def __init__(self, agent: _Transfers, remote: str | None, addrs: U64, lens: U64) -> None:
        self._agent, self.remote, self.addrs, self.lens = agent, remote, addrs, lens
        self._released = False

    @property
    def count(self) -> int:
        """Descriptors in the list (no __len__: an empty list's handle must stay truthy)."""
        return int(self.addrs.shape[0])

    def release(self) -> None:
        self._released = True

    def __repr__(self) -> str:
        side = "local" if self.remote is None else f"remote {self.remote!r}"
        n = self.count
        return f"nixl_prepped_dlist_handle({side}, {n} descriptors, released={self._released})"


class nixl_xfer_handle:
    """A transfer request from ``initialize_xfer`` or ``make_prepped_xfer``."""

    __slots__ = (
        "_agent",
        "op",
        "remote",
        "descs",
        "notif",
        "req",
        "error",
        "_post_ns",
        "_posted_ns",
        "_done_ns",
        "_start_us",
        "_released",
        "__weakref__",
    )

    def __init__(
        self, agent: _Transfers, op: TransferOp, remote: str, descs: U64, notif: bytes
    ) -> None:
        self._agent, self.op, self.remote, self.descs, self.notif = agent, op, remote, descs, notif
        self.req: TransferReq | None = None
        self.error: str | None = None
        self._post_ns = self._posted_ns = self._done_ns = 0
        self._start_us = 0
        self._released = False

    @property
    def nbytes(self) -> int:
        return int(self.descs[:, 2].sum()) if self.descs.shape[0] else 0

    def release(self) -> None:
        self._agent.release_xfer_handle(self)

    def __repr__(self) -> str:
        return (
            f"nixl_xfer_handle({self.op!r} {self.remote!r}, {self.descs.shape[0]} descriptors, "
            f"released={self._released})"
        )


class _Transfers(_Metadata):
    """Transfers and their handles: the part of ``nixl_agent`` that moves data."""

    nixl_ops: dict[str, TransferOp]
    _rate: dict[str, float]  # bytes per microsecond, per remote agent

    # --- transfers ----------------------------------------------------------------------------

    def _check_inside(self, d: Any, r: _Remote | None, what: str) -> None:
        addrs, lens = d.arr[:, 0], d.arr[:, 1]
        if d.descCount() and not lens.all():
            raise nixlInvalidParamError(f"{what}: descriptor {int(np.argmin(lens))} has length 0")
        if r is None or r.name == self.name:
            bad = _first_outside(addrs, lens, self._lstarts, self._lends)
            where = "this agent's registered memory"
        else:
            bad = _first_outside(addrs, lens, r.starts, r.ends)
            if bad >= 0 and self._engine.get_async_connect_status(r.engine) == (
                AsyncConnectStatus.CONNECTED
            ):
                try:  # the peer may have registered more since its metadata was taken
                    fresh = self._engine.remote_regions(r.engine, refresh=True)
                    table = [(x.addr, x.len) for x in fresh]
                    r.starts = r.ends = np.zeros(0, np.uint64)
                    r.add_regions(table)  # the live table replaces what the metadata said
                except HixlError:
                    pass
                bad = _first_outside(addrs, lens, r.starts, r.ends)
            where = f"memory agent {r.name!r} registered (as its metadata says)"
        if bad >= 0:
            raise nixlNotFoundError(
                f"{what}: descriptor {bad} (0x{int(addrs[bad]):x}+{int(lens[bad])}) is not inside "
                f"{where}"
            )

    def prep_xfer_dlist(
        self,
        agent_name: Any,
        xfer_list: Any,
        mem_type: str | None = None,
        backends: Any = None,
        is_sorted: Any = None,
    ) -> nixl_prepped_dlist_handle:
        if isinstance(backends, bool):  # older NIXL order: (..., mem_type, is_sorted, backends)
            backends, is_sorted = is_sorted, backends
        self._check_backends(backends)
        self._need_backend()
        d = self.get_xfer_descs(xfer_list, mem_type)
        self._dram_only(d.getType(), "prep_xfer_dlist")
        name = _name(agent_name)
        if name in ("NIXL_INIT_AGENT", NIXL_INIT_AGENT):
            self._check_inside(d, None, "prep_xfer_dlist (local)")
            remote = None
        else:
            r = self._remote(name)
            self._check_inside(d, r, f"prep_xfer_dlist ({name!r})")
            remote = name
        addrs = np.ascontiguousarray(d.arr[:, 0])
        lens = np.ascontiguousarray(d.arr[:, 1])
        return nixl_prepped_dlist_handle(self, remote, addrs, lens)

    def _need_backend(self) -> None:
        if not self.backends:
            raise nixlNotFoundError("no backend was created on this agent (create_backend)")

    def make_prepped_xfer(
        self,
        operation: str,
        local_xfer_side: nixl_prepped_dlist_handle,
        local_indices: Any,
        remote_xfer_side: nixl_prepped_dlist_handle,
        remote_indices: Any,
        notif_msg: Any = b"",
        backends: Any = None,
        skip_desc_merge: bool = False,
    ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        self._check_backends(backends)
        loc, rem = local_xfer_side, remote_xfer_side
        for h, side in ((loc, "local"), (rem, "remote")):
            if not isinstance(h, nixl_prepped_dlist_handle) or h._agent is not self:
                raise nixlInvalidParamError(f"{side} side is not a list prepared by this agent")
            if h._released:
                raise nixlInvalidParamError(f"{side} side list was released")
        if loc.remote is not None:
            raise nixlInvalidParamError("local side must be prepared with NIXL_INIT_AGENT")
        if rem.remote is None:
            raise nixlInvalidParamError("remote side must be prepared with a remote agent's name")
        li = np.asarray(local_indices, dtype=np.int64).reshape(-1)
        ri = np.asarray(remote_indices, dtype=np.int64).reshape(-1)
        if li.shape[0] != ri.shape[0]:
            raise nixlInvalidParamError(
                f"{li.shape[0]} local and {ri.shape[0]} remote indices: counts differ"
            )
        for idx, h, side in ((li, loc, "local"), (ri, rem, "remote")):
            if idx.shape[0] and (int(idx.min()) < 0 or int(idx.max()) >= h.count):
                raise nixlInvalidParamError(
                    f"{side} index out of range (list has {h.count} descriptors)"
                )
        lens = loc.lens[li]
        rlens = rem.lens[ri]
        if not np.array_equal(lens, rlens):
            i = int(np.argmax(lens != rlens))
            raise nixlInvalidParamError(
                f"descriptor {i}: local length {int(lens[i])} != remote length {int(rlens[i])}"
            )
        descs = np.empty((li.shape[0], 3), np.uint64)
        descs[:, 0] = loc.addrs[li]
        descs[:, 1] = rem.addrs[ri]
        descs[:, 2] = lens
        return nixl_xfer_handle(self, op, rem.remote, descs, _msg(notif_msg))

    def initialize_xfer(
        self,
        operation: str,
        local_descs: Any,
        remote_descs: Any,
        remote_agent: Any,
        notif_msg: Any = b"",
        backends: Any = None,
    ) -> nixl_xfer_handle:
        op = self.nixl_ops[operation]
        self._check_backends(backends)
        self._need_backend()
        loc = self.get_xfer_descs(local_descs, "DRAM")
        rem = self.get_xfer_descs(remote_descs, "DRAM")
        self._dram_only(loc.getType(), "initialize_xfer (local)")
        self._dram_only(rem.getType(), "initialize_xfer (remote)")
        if loc.descCount() != rem.descCount():
            raise nixlInvalidParamError(
                f"{loc.descCount()} local and {rem.descCount()} remote descriptors: counts differ"
            )
        name = _name(remote_agent)
        r = self._remote(name)
        self._check_inside(loc, None, "initialize_xfer (local)")
        self._check_inside(rem, r, f"initialize_xfer ({name!r})")
        if not np.array_equal(loc.arr[:, 1], rem.arr[:, 1]):
            i = int(np.argmax(loc.arr[:, 1] != rem.arr[:, 1]))
            raise nixlInvalidParamError(
                f"descriptor {i}: local length {int(loc.arr[i, 1])} != remote length "
                f"{int(rem.arr[i, 1])}"
            )
        descs = np.empty((loc.descCount(), 3), np.uint64)
        descs[:, 0] = loc.arr[:, 0]
        descs[:, 1] = rem.arr[:, 0]
        descs[:, 2] = loc.arr[:, 1]
        return nixl_xfer_handle(self, op, name, descs, _msg(notif_msg))

    def _live(self, handle: Any) -> nixl_xfer_handle:
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a transfer handle of this agent")
        if handle._released:
            raise nixlInvalidParamError("the transfer handle was released")
        return handle

    def transfer(self, handle: nixl_xfer_handle, notif_msg: Any = b"") -> str:
        h = self._live(handle)
        if h.req is not None and h.req.status() == TransferStatus.WAITING:
            raise nixlRepostActiveError("the transfer is still in progress")
        msg = _msg(notif_msg)
        if msg:
            h.notif = msg
        r = self._remote(h.remote)
        self._ready(r)
        notify = NotifyDesc(self._notif_name, h.notif.decode("latin-1")) if h.notif else None
        h.error, h._done_ns = None, 0
        h._start_us = time.time_ns() // 1000
        h._post_ns = time.perf_counter_ns()
        try:
            if h.descs.shape[0] == 0:
                if notify is not None:
                    self._engine.send_notify(r.engine, notify)
                h.req = None
                h._posted_ns = h._done_ns = time.perf_counter_ns()
                return "DONE"
            h.req = self._engine.transfer_async(r.engine, h.op, h.descs, notify=notify)
        except HixlError as e:
            h.error = str(e)
            if isinstance(e, NotConnected):
                r.ready = False
            raise from_hixl(e, f"posting a {h.descs.shape[0]}-descriptor transfer") from e
        h._posted_ns = time.perf_counter_ns()
        return self._state(h)

    def _state(self, h: nixl_xfer_handle) -> str:
        req = h.req
        if req is None:
            if h._done_ns:
                return "DONE"
            raise nixlNotPostedError("the transfer was not posted (call transfer first)")
        st = req.status()
        if st == TransferStatus.WAITING:
            return "PROC"
        if st == TransferStatus.COMPLETED:
            if not h._done_ns:
                h._done_ns = time.perf_counter_ns()
                us = max((h._done_ns - h._post_ns) / 1000, 1.0)
                self._rate[h.remote] = h.nbytes / us
            return "DONE"
        if h.error is None:
            try:
                req.result()
                h.error = f"transfer {st}"
            except HixlError as e:
                h.error = str(e)
                if isinstance(e, NotConnected):
                    rr = self._remotes.get(h.remote)
                    if rr is not None:
                        rr.ready = False
            log.warning(
                "hixl.nixl agent %r: transfer to %r failed: %s", self.name, h.remote, shown(h.error)
            )
        return "ERR"

    def check_xfer_state(self, handle: nixl_xfer_handle) -> str:
        return self._state(self._live(handle))

    def get_xfer_telemetry(self, handle: nixl_xfer_handle) -> nixlXferTelemetry:
        h = self._live(handle)
        if not h._post_ns:
            from ._bindings import nixlNoTelemetryError

            raise nixlNoTelemetryError("the transfer was not posted yet")
        end = h._done_ns or time.perf_counter_ns()
        return nixlXferTelemetry(
            h._start_us,
            (h._posted_ns - h._post_ns) // 1000,
            (end - h._post_ns) // 1000,
            h.nbytes,
            int(h.descs.shape[0]),
        )

    def estimate_xfer_cost(self, req_handle: nixl_xfer_handle) -> tuple[int, int, str]:
        """(duration us, error margin us, method) from the rate last measured to that agent;
        1 GB/s with a 100 % margin before any transfer completed."""
        h = self._live(req_handle)
        rate = self._rate.get(h.remote)
        if rate is None:
            d = h.nbytes // 1000 + 1
            return d, d, "ANALYTICAL_BACKEND"
        d = int(h.nbytes / rate) + 1
        return d, d // 5 + 1, "ANALYTICAL_BACKEND"

    def query_xfer_backend(self, handle: nixl_xfer_handle) -> str:
        self._live(handle)
        self._need_backend()
        return next(iter(self.backends))

    def release_xfer_handle(self, handle: nixl_xfer_handle) -> None:
        """Frees the handle. hixl cannot cancel a posted request: one still in progress is
        waited for (up to its deadline) first."""
        if not isinstance(handle, nixl_xfer_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a transfer handle of this agent")
        if handle._released:
            return
        if handle.req is not None and handle.req.status() == TransferStatus.WAITING:
            handle.req.wait()
        handle._released = True
        handle.req = None

    def release_dlist_handle(self, handle: nixl_prepped_dlist_handle) -> None:
        if not isinstance(handle, nixl_prepped_dlist_handle) or handle._agent is not self:
            raise nixlInvalidParamError("not a prepared list of this agent")
        handle.release()
