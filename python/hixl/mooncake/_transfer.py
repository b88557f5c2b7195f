"""The transfer calls of ``TransferEngine``: sessions, sync and async batches, notifications.

A session ``"host:rpc_port"`` is a hixl engine address; the first call to it links to it (up
to ``HIXL_MOONCAKE_CONNECT_TIMEOUT_S``), a link that died is made again by the next call. A
batch is one hixl request whose descriptors are one ``(N, 3)`` ``uint64`` array; a single
transfer is one ``put`` / ``get``. Every wait is bounded: by the connect timeout, and by the
request's deadline (``hixl.transfer_timeout_ms``, 10 s by default).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .._errors import AlreadyConnected, HixlError, NotConnected, ParamInvalid
from .._hixl import AsyncConnectStatus, NotifyDesc, TransferReq, TransferStatus
from . import _protocol
from ._codes import (
    CHECK_COMPLETED,
    CHECK_FAILED,
    CHECK_PENDING,
    CHECK_TIMEOUT,
    ERR_INVALID_ARGUMENT,
    OK,
)
from ._protocol import log
from ._types import TransferNotify, TransferOpcode

#: How long a connect to a session linked before may take: a live session that restarted
#: answers within it; a dead one is reported at once (the first contact waits
#: ``HIXL_MOONCAKE_CONNECT_TIMEOUT_S`` for the peer to come up).
_RELINK_MS = 300

if TYPE_CHECKING:
    from .._hixl import Hixl

_OPS = {TransferOpcode.Read: "READ", TransferOpcode.Write: "WRITE"}
#: A batch that failed before anything was sent (its status says -1 once asked).
_FAILED: None = None


def _op(opcode: Any) -> str:
    try:
        return _OPS[TransferOpcode(int(opcode))]
    except (ValueError, TypeError):
        raise TypeError(
            f"opcode must be a TransferOpcode (Read or Write), not {opcode!r}"
        ) from None


def _notify(notify: Any) -> NotifyDesc | None:
    if notify is None:
        return None
    if not isinstance(notify, TransferNotify):
        raise TypeError(f"notify must be a TransferNotify or None, not {notify!r}")
    return NotifyDesc(str(notify.name), str(notify.msg))


def _descs(
    buffers: Sequence[int], peers: Sequence[int], lengths: Sequence[int]
) -> np.ndarray[Any, Any] | None:
    """The batch as an ``(N, 3)`` uint64 array without zero-length rows; None (logged) when
    the three lists differ in length or hold a value that is not a non-negative int."""
    n = len(buffers)
    if len(peers) != n or len(lengths) != n:
        log.error(
            "batch: buffers, peer_buffer_addresses and lengths differ in length (%d, %d, %d)",
            n,
            len(peers),
            len(lengths),
        )
        return None
    arr = np.empty((n, 3), np.uint64)
    try:
        arr[:, 0] = buffers
        arr[:, 1] = peers
        arr[:, 2] = lengths
    except (OverflowError, ValueError, TypeError) as e:
        log.error("batch: a buffer, peer address or length is not a non-negative int (%s)", e)
        return None
    if n and not arr[:, 2].all():
        arr = arr[arr[:, 2] != 0]
    return arr


def _bad_ints(local: Any, remote: Any, n: Any) -> None:
    raise TypeError(
        "buffer, peer_buffer_address and length must be non-negative ints, "
        f"not {local!r}, {remote!r}, {n!r}"
    ) from None


class _Transfers:
    """Sessions and transfers of ``TransferEngine`` (a mixin: the engine is ``_engine``)."""

    _engine: Hixl | None
    #: The engine's put and get, bound once (the single-transfer fast path).

    def _init_batches(self) -> None:
        self._linked: dict[str, str] = {}
        # hixl addresses linked once: a session whose link died since is probed briefly
        # (_RELINK_MS) and reported dead at once, as Mooncake reports a refused connection.
        self._was_linked: set[str] = set()
        self._connect_locks: dict[str, threading.Lock] = {}
        self._batches: dict[int, Any] = {}  # TransferReq, _DONE or _FAILED
        self._ids = itertools.count(1)
        self._state = threading.Lock()

    # -- sessions -----------------------------------------------------------------------------

    def _connected(self, session: str, call: str) -> str | None:
        """The hixl address of ``session`` once linked; None (logged) when it cannot be."""
        addr = self._linked.get(session)
        if addr is not None:
            return addr
        engine = self._engine
        if engine is None:
            log.error("%s: the engine is not initialized (call initialize first)", call)
            return None
        if not isinstance(session, str):
            raise TypeError(f"target_hostname must be a str, not {type(session).__name__}")
        try:
            addr = _protocol.session_addr(session)
        except ValueError as e:
            log.error("%s: session %r: %s", call, session, e)
            return None
        with self._state:
            lock = self._connect_locks.setdefault(addr, threading.Lock())
        with lock:
            if session in self._linked:
                return addr
            try:
                status = engine.get_async_connect_status(addr)
                if status != AsyncConnectStatus.CONNECTED:
                    if status == AsyncConnectStatus.CONNECT_FAILED:
                        self._drop(engine, addr)
                    wait_s = _protocol.connect_timeout_s()
                    if addr in self._was_linked:
                        wait_s = _RELINK_MS / 1000
                    try:
                        engine.connect(addr, timeout_ms=wait_s * 1000)
                    except AlreadyConnected:
                        pass
            except HixlError as e:
                log.error("%s: session %r (%s) unreachable: %s", call, session, addr, e.message)
                return None
            self._linked[session] = addr
            self._was_linked.add(addr)
        return addr

    @staticmethod
    def _drop(engine: Hixl, addr: str) -> None:
        try:
            engine.disconnect(addr, timeout_ms=0)
        except HixlError:
            pass

    def _failed(self, session: str, call: str, e: HixlError) -> int:
        """Logs a failed transfer and forgets a dead link (the next call makes a new one).
        An argument of the wrong type raises ``TypeError`` instead, as Mooncake's does."""
        if isinstance(e, ParamInvalid) and "must be an int" in e.message:
            raise TypeError(f"{call}: {e.message}") from None
        log.error("%s to %r failed: %s", call, session, e)
        if isinstance(e, NotConnected):
            self._linked.pop(session, None)
        return ERR_INVALID_ARGUMENT

    # -- sync ---------------------------------------------------------------------------------

    def _one(self, session: str, write: bool, local: int, remote: int, n: int) -> int:
        addr = self._linked.get(session) or self._connected(session, "transfer")
        engine = self._engine
        if addr is None or engine is None:
            return ERR_INVALID_ARGUMENT
        if n == 0:
            return OK
        try:
            if write:
                engine.put(addr, local, remote, n)
            else:
                engine.get(addr, local, remote, n)
        except HixlError as e:
            return self._failed(session, "transfer_sync_" + ("write" if write else "read"), e)
        except OverflowError:
            _bad_ints(local, remote, n)
        return OK

    def transfer_sync_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Copies ``length`` bytes at ``buffer`` here to ``peer_buffer_address`` at session
        ``target_hostname`` and waits: 0, or -1 (logged) when it failed. GIL released."""
        return self._one(target_hostname, True, buffer, peer_buffer_address, length)

    def transfer_sync_read(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Copies ``length`` bytes at ``peer_buffer_address`` of the session to ``buffer`` here
        and waits: 0 or -1. GIL released."""
        return self._one(target_hostname, False, buffer, peer_buffer_address, length)

    def transfer_sync(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """One transfer in direction ``opcode``; with ``notify`` the peer receives it after
        the bytes. 0 or -1. GIL released."""
        return self.batch_transfer_sync(
            target_hostname, [buffer], [peer_buffer_address], [length], opcode, notify
        )

    def _batch_sync(
        self,
        session: str,
        op: str,
        buffers: Sequence[int],
        peers: Sequence[int],
        lengths: Sequence[int],
        notify: NotifyDesc | None,
    ) -> int:
        call = "batch_transfer_sync_" + op.lower()
        descs = _descs(buffers, peers, lengths)
        if descs is None:
            return ERR_INVALID_ARGUMENT
        addr = self._linked.get(session) or self._connected(session, call)
        engine = self._engine
        if addr is None or engine is None:
            return ERR_INVALID_ARGUMENT
        if len(descs) == 0 and notify is None:
            return OK
        try:
            if notify is None:
                engine.transfer_sync(addr, op, descs)
            elif len(descs) == 0:
                engine.send_notify(addr, notify)
            else:
                req = engine.transfer_async(addr, op, descs, notify=notify)
                req.wait()  # returns at the request's deadline at the latest
                req.result()  # raises what went wrong
        except HixlError as e:
            return self._failed(session, call, e)
        return OK

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """Copies each ``(buffers[i], lengths[i])`` here to ``peer_buffer_addresses[i]`` at the
        session as one batch and waits: 0, or -1 when any part failed. GIL released."""
        return self._batch_sync(
            target_hostname, "WRITE", buffers, peer_buffer_addresses, lengths, None
        )

    def batch_transfer_sync_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """The READ of ``batch_transfer_sync_write``: 0 or -1. GIL released."""
        return self._batch_sync(
            target_hostname, "READ", buffers, peer_buffer_addresses, lengths, None
        )

    def batch_transfer_sync(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
        notify: TransferNotify | None = None,
        transport_hint: str = "",
    ) -> int:
        """A batch in direction ``opcode``, with an optional notification after its bytes:
        0 or -1. GIL released."""
        return self._batch_sync(
            target_hostname, _op(opcode), buffers, peer_buffer_addresses, lengths, _notify(notify)
        )

    # -- async --------------------------------------------------------------------------------

    def _submit(
        self,
        session: str,
        op: str,
        buffers: Sequence[int],
        peers: Sequence[int],
        lengths: Sequence[int],
    ) -> int:
        """Queues a batch and returns its id (a positive int). As in Mooncake 0.3.13, lists
        of different lengths and a session that cannot be reached return 0 (no batch); a
        batch the peer's table refuses (a bad range) gets an id whose status is failed."""
        call = "batch_transfer_async_" + op.lower()
        descs = _descs(buffers, peers, lengths)
        if descs is None:
            return 0
        addr = self._linked.get(session) or self._connected(session, call)
        engine = self._engine
        if addr is None or engine is None:
            return 0
        entry: Any = _DONE  # nothing to send: complete at once
        if len(descs):
            try:
                entry = engine.transfer_async(addr, op, descs)
            except HixlError as e:
                self._failed(session, call, e)
                entry = _FAILED
        with self._state:
            bid = next(self._ids)
            self._batches[bid] = entry
        return bid

    def batch_transfer_async_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """Queues a WRITE batch and returns its batch id at once; wait for it with
        ``get_batch_transfer_status([id])``. GIL released while it submits."""
        return self._submit(target_hostname, "WRITE", buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async_read(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        transport_hint: str = "",
    ) -> int:
        """Queues a READ batch and returns its batch id at once."""
        return self._submit(target_hostname, "READ", buffers, peer_buffer_addresses, lengths)

    def batch_transfer_async(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        opcode: TransferOpcode,
        transport_hint: str = "",
    ) -> int:
        """Queues a batch in direction ``opcode`` and returns its batch id at once."""
        return self._submit(target_hostname, _op(opcode), buffers, peer_buffer_addresses, lengths)

    def transfer_submit_write(
        self,
        target_hostname: str,
        buffer: int,
        peer_buffer_address: int,
        length: int,
        transport_hint: str = "",
    ) -> int:
        """Queues one WRITE and returns its id at once; poll ``transfer_check_status(id)``."""
        return self._submit(target_hostname, "WRITE", [buffer], [peer_buffer_address], [length])

    def get_batch_transfer_status(self, batch_ids: list[int]) -> int:
        """Waits until every batch of ``batch_ids`` has ended: 0 when all succeeded, -1 when
        any failed, timed out or is not a known id. The ids are forgotten afterwards. Each
        wait ends at its request's deadline at the latest; GIL released while waiting."""
        rc = OK
        for bid in list(batch_ids):
            with self._state:
                known = bid in self._batches
                req = self._batches.pop(bid, None)
            if not known:
                log.error("get_batch_transfer_status: unknown batch id %r", bid)
                rc = ERR_INVALID_ARGUMENT
            elif req is _DONE:
                continue
            elif req is None:
                rc = ERR_INVALID_ARGUMENT
            elif req.wait() != TransferStatus.COMPLETED:
                log.error("batch %d ended %s: %s", bid, req.status().name, _why(req))
                rc = ERR_INVALID_ARGUMENT
        return rc

    def transfer_check_status(self, batch_id: int) -> int:
        """The state of a submitted transfer or batch, without waiting: 0 in flight, 1
        completed, -1 failed (or an unknown id), -2 timed out; the id is forgotten once it
        has ended."""
        with self._state:
            known = batch_id in self._batches
            req = self._batches.get(batch_id)
        if not known:
            log.error("transfer_check_status: unknown batch id %r", batch_id)
            return CHECK_FAILED
        if req is _DONE:
            code = CHECK_COMPLETED
        elif req is None:
            code = CHECK_FAILED
        else:
            status = req.status()
            if status == TransferStatus.WAITING:
                return CHECK_PENDING
            code = {
                TransferStatus.COMPLETED: CHECK_COMPLETED,
                TransferStatus.TIMEOUT: CHECK_TIMEOUT,
            }.get(status, CHECK_FAILED)
            if code != CHECK_COMPLETED:
                log.error("batch %d ended %s: %s", batch_id, status.name, _why(req))
        with self._state:
            self._batches.pop(batch_id, None)
        return code

    # -- notifications ------------------------------------------------------------------------

    def get_notifies(self) -> list[TransferNotify]:
        """The notifications received since the last call (each once), oldest first; each
        carries hixl's ``peer`` (the sender's authenticated engine address) too."""
        engine = self._engine
        if engine is None:
            return []
        return [TransferNotify(n.name, n.msg, peer=n.peer) for n in engine.get_notifies()]


class _Done:
    """The marker of a batch that had nothing to send (it completed at once)."""


_DONE: Any = _Done()


def _why(req: TransferReq) -> str:
    try:
        req.result()
    except HixlError as e:
        return e.message
    return "no reason given"
