"""Peer-sized work at a target (issue 34, High 2 and Medium 3), performed against a real target
process over real sockets: frames a peer that finished the handshake can send, which must
never make the target set aside memory in proportion to a number in the frame.

- One 56-byte ReadStrided/WriteStrided naming count = region size, size 1, stride 1 made the
  target build one 16-byte iovec per element (+128 MiB per frame on an 8 MiB region).
- A 24-byte header of a kind an initiator never sends (Welcome, 16 MiB), or of an allowed kind
  whose payload never comes, made the target's reader allocate the whole payload at once.

Each test reads the target's peak resident memory (VmHWM in /proc/PID/status) before and
after, checks how the target answered (docs/PROTOCOL.md), compares bytes, and checks that a
good peer still transfers correctly afterwards (a strided transfer over the per-frame element
cap included).
"""

from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import _wire as w
import numpy as np
import pytest

import hixl

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from _amplify_target import pattern  # noqa: E402

# docs/PROTOCOL.md: most elements of a strided frame that are not contiguous (stride > size).
MAX_STRIDED_ELEMS = 1 << 16
PARAM_INVALID = 103900
MiB = 1 << 20
# How much the target's peak resident memory may grow over one test: its own buffers, the
# Python side, page-cache noise. Today's code grows by 128 MiB per strided frame and by
# 16 MiB per pre-sized header.
BOUND = 8 * MiB


class Target:
    def __init__(self, options: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_amplify_target.py"), json.dumps(options or {})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        tag, self.engine, addr, size = self.proc.stdout.readline().split()
        assert tag == "READY"
        self.addr, self.size = int(addr), int(size)
        host, port = self.engine.rsplit(":", 1)
        self.sockaddr = (host, int(port))
        self.expected = pattern(self.size)

    def cmd(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def dump(self, tmp: Path) -> np.ndarray:
        path = tmp / "dump.bin"
        assert self.cmd(f"dump {path}") == "OK"
        return np.fromfile(path, np.uint8)

    def reset_peak(self) -> int:
        """Resets the target's peak resident memory (VmHWM) to its current resident memory
        (proc(5), clear_refs "5") and returns that."""
        Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        return self.memory()[1]

    def memory(self) -> tuple[int, int]:
        """(VmRSS, VmHWM) of the target process, in bytes."""
        got = {}
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                got[key] = int(value.split()[0]) * 1024
        return got["VmRSS"], got["VmHWM"]

    def handshake(self) -> socket.socket:
        s = socket.create_connection(self.sockaddr, timeout=60)
        s.sendall(w.hello(dialled=w.dialled_of(s)))
        kind, _, _, _ = w.read_frame(s)
        assert kind == w.WELCOME
        return s

    def close(self) -> None:
        try:
            self.cmd("exit")
            self.proc.wait(30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(30)


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target()
    yield t
    t.close()


def answer(s: socket.socket, want: int) -> tuple[int, str, bytes]:
    """Status, message and bulk of the next Ack/ReadResp (skipping region-table changes)."""
    while True:
        kind, _, bulk, payload = w.read_frame(s)
        if kind in w.TABLE_CHANGES:
            continue
        assert kind == want, kind
        status, message = w.status_of(payload)
        return status, message, w.recv_exact(s, bulk) if bulk else b""


def good_peer_works(t: Target, tmp: Path, seed: int) -> None:
    """A real engine writes and reads 4 KiB, then a strided transfer of more elements than
    one frame may name (MAX_STRIDED_ELEMS), both ways, bytes compared; then every byte of the
    target's region must be what it was except exactly what the good peer wrote."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, 4096, dtype=np.uint8)
    back = np.zeros(4096, np.uint8)
    count, size, stride = MAX_STRIDED_ELEMS + 4464, 8, 64  # 70000 elements, 4.48 MB span
    src = hixl.aligned_empty(count * stride)
    src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
    sback = hixl.aligned_empty(count * stride)
    sback[:] = 0
    base = t.addr + 4096
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        for b in (data, back, src, sback):
            e.register(b)
        e.connect(t.engine, timeout_ms=30_000)
        e.put(t.engine, data.ctypes.data, t.addr, 4096, timeout_ms=30_000)
        e.get(t.engine, back.ctypes.data, t.addr, 4096, timeout_ms=30_000)
        d = hixl.StridedDesc(count, size, stride)
        e.put_strided(t.engine, src.ctypes.data, base, d, timeout_ms=60_000)
        e.get_strided(t.engine, sback.ctypes.data, base, d, timeout_ms=60_000)
    assert (back == data).all()
    elems = src.reshape(count, stride)[:, :size]
    assert np.array_equal(sback.reshape(count, stride)[:, :size], elems), "strided get"
    assert not sback.reshape(count, stride)[:, size:].any(), "padding untouched by the get"
    t.expected[:4096] = data
    t.expected[4096 : 4096 + count * stride].reshape(count, stride)[:, :size] = elems
    got = t.dump(tmp)
    bad = np.flatnonzero(got != t.expected)
    assert bad.size == 0, f"{bad.size} bytes changed, first at region offset {bad[0]}"


def test_strided_frames_never_expand_at_the_target(target: Target, tmp_path: Path) -> None:
    t = target
    good_peer_works(t, tmp_path, 1)  # warm: threads, buffers, the reactor
    before = t.reset_peak()
    s = t.handshake()
    # count = region size, size 1, stride 1: one contiguous range, served as such.
    for i in range(3):
        s.sendall(w.frame(w.READ_STRIDED, w.strided(t.addr, t.size, 1, 1), tag=10 + i))
        status, message, got = answer(s, w.READ_RESP)
        assert status == 0, message
        assert got == t.expected.tobytes(), "the whole region, byte for byte"
        data = np.random.default_rng(i).integers(0, 256, t.size, dtype=np.uint8)
        payload = w.strided(t.addr, t.size, 1, 1)
        s.sendall(w.frame(w.WRITE_STRIDED, payload, tag=20 + i, bulk=t.size) + data.tobytes())
        status, message, _ = answer(s, w.ACK)
        assert status == 0, message
        t.expected[:] = data
    _, peak = t.memory()
    assert peak - before < BOUND, (
        f"the target's peak resident memory grew by {(peak - before) / MiB:.1f} MiB over 6 "
        f"strided frames of {t.size} one-byte elements"
    )
    # Not contiguous (stride 2) and over the cap: refused, naming the count and the cap.
    count = t.size // 2
    s.sendall(w.frame(w.READ_STRIDED, w.strided(t.addr, count, 1, 2), tag=30))
    status, message, got = answer(s, w.READ_RESP)
    assert status == PARAM_INVALID and got == b"", (status, message)
    assert str(count) in message and str(MAX_STRIDED_ELEMS) in message, message
    bulk = np.random.default_rng(9).integers(0, 256, count, dtype=np.uint8).tobytes()
    s.sendall(w.frame(w.WRITE_STRIDED, w.strided(t.addr, count, 1, 2), tag=31, bulk=count) + bulk)
    status, message, _ = answer(s, w.ACK)
    assert status == PARAM_INVALID, (status, message)
    assert str(count) in message and str(MAX_STRIDED_ELEMS) in message, message
    # The stream still serves: a read of 4 KiB.
    s.sendall(w.frame(w.READ, w.segs([(t.addr + 100, 4096)]), tag=32))
    status, message, got = answer(s, w.READ_RESP)
    assert status == 0 and got == t.expected[100:4196].tobytes(), message
    _, peak = t.memory()
    assert peak - before < BOUND, f"peak grew by {(peak - before) / MiB:.1f} MiB"
    s.close()
    assert np.array_equal(t.dump(tmp_path), t.expected), "refused frames wrote nothing"
    good_peer_works(t, tmp_path, 2)


def closed_or_error(s: socket.socket, says: str) -> None:
    """The target answered with an Error frame naming `says` and closed, or just closed."""
    try:
        kind, _, _, payload = w.read_frame(s)
    except (ConnectionError, OSError):
        return
    assert kind == w.ERROR, f"expected an Error frame, got kind {kind}"
    _, message = w.status_of(payload)
    assert says in message, message
    with pytest.raises((ConnectionError, OSError)):
        w.read_frame(s)


def test_headers_never_presize_the_targets_buffers(target: Target, tmp_path: Path) -> None:
    t = target
    good_peer_works(t, tmp_path, 3)
    before = t.reset_peak()
    # 20 streams: a Welcome header (a kind only a target sends) declaring 16 MiB.
    wrong = [t.handshake() for _ in range(20)]
    for s in wrong:
        s.sendall(w.header(w.WELCOME, w.MAX_TABLE_PAYLOAD))
    # 20 streams: a Write header declaring the largest descriptor table, whose payload never
    # comes (4 bytes of it do).
    slow = [t.handshake() for _ in range(20)]
    plen = 4 + 16 * w.MAX_DESCS
    for s in slow:
        s.sendall(w.header(w.WRITE, plen, tag=1, bulk=w.MAX_DESCS) + struct.pack("<I", w.MAX_DESCS))
    time.sleep(2.0)  # the target's workers have read every header by now
    _, peak = t.memory()
    assert peak - before < BOUND, (
        f"the target's peak resident memory grew by {(peak - before) / MiB:.1f} MiB for 40 "
        "headers whose payloads never came"
    )
    for s in wrong:
        closed_or_error(s, "Welcome")
        s.close()
    for s in slow:
        s.close()
    good_peer_works(t, tmp_path, 4)
    _, peak = t.memory()
    assert peak - before < BOUND, f"peak grew by {(peak - before) / MiB:.1f} MiB"
