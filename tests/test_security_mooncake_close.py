"""The Mooncake face's close() against a peer that still WRITEs (security review issue 46,
item 5): a managed buffer must stay alive while any peer can reach it. The target is a real
process (tests/_sec_mc_close.py) whose engine pauses at the entry of finalize, so that the
peer's WRITE lands exactly in the window where the buffers used to be freed already."""

from __future__ import annotations

import ctypes
import hashlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from _lineproc import LineProc

from hixl.mooncake import TransferEngine

HERE = Path(__file__).parent
SIZE = 64 << 10  # under malloc's mmap threshold: a freed buffer's block is handed out again
ZEROS = hashlib.sha256(bytes(SIZE)).hexdigest()


@pytest.fixture
def peer() -> Iterator[tuple[TransferEngine, int, str]]:
    """An engine here with SIZE registered bytes of a pattern: (engine, address, its sha)."""
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    buf = ctypes.create_string_buffer(bytes(range(256)) * (SIZE // 256), SIZE)
    assert te.register_memory(ctypes.addressof(buf), SIZE) == 0
    yield te, ctypes.addressof(buf), hashlib.sha256(buf.raw).hexdigest()
    te.close()
    del buf


def test_mooncake_close_keeps_managed_buffers_until_finalized(peer):
    """close() with a peer WRITE to a managed buffer at the entry of finalize: the buffer is
    still alive then, the WRITE lands in it (bytes compared) and never in a fresh allocation
    (before the fix: the buffer was already freed, and the acked WRITE landed in a new
    bytearray that had taken its block)."""
    te, local, want = peer
    target = LineProc([HERE / "_sec_mc_close.py", "ok", SIZE])
    try:
        session, remote = f"127.0.0.1:{target.words[1]}", int(target.words[2])
        assert te.transfer_sync_write(session, local, remote, 16) == 0  # linked
        target.send("close")
        paused = target.line(60)
        assert paused.startswith("FINALIZING"), paused
        rc = te.transfer_sync_write(session, local, remote, SIZE)
        target.send("go")
        after = target.line(60).split()
        done = target.line(60)
        shown = f"at finalize's entry: {paused}; the peer's WRITE returned {rc}; then {after}"
        print(f"mooncake close: {shown}")
        assert "alive=1" in paused, f"managed buffer freed before finalize: {shown}"
        assert after[1] == ZEROS, f"the peer's WRITE landed in freed memory: {shown}"
        assert rc == 0 and after[3] == want, shown
        assert done == "CLOSED", done
    finally:
        target.close()


def test_mooncake_close_leaks_managed_buffers_when_finalize_fails(peer):
    """When finalize fails the engine may still be reachable: close() raises, the managed
    buffer is kept (alive after a garbage collection, its block not handed out again) and a
    peer's WRITE after the failed close lands in it, bytes compared."""
    te, local, want = peer
    target = LineProc([HERE / "_sec_mc_close.py", "fail", SIZE])
    try:
        session, remote = f"127.0.0.1:{target.words[1]}", int(target.words[2])
        assert te.transfer_sync_write(session, local, remote, 16) == 0
        target.send("close")
        paused = target.line(60)
        assert "alive=1" in paused, f"managed buffer freed before finalize: {paused}"
        target.send("go")
        target.line(60)
        assert target.line(60) == "CLOSE-FAILED"
        kept = target.cmd("gc")
        assert kept == "alive=1 reused=0", f"after a failed finalize: {kept}"
        assert te.transfer_sync_write(session, local, remote, SIZE) == 0
        assert target.cmd("dump") == want
    finally:
        target.close()
