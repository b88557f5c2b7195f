"""Hostile clients speaking raw bytes to a listener. After every attack the listener must
still serve a good peer, and the bytes around and inside every registered region must be
exactly what they were (or what the good peer wrote)."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import _wire as w
import numpy as np
import pytest

import hixl

HERE = Path(__file__).parent


class Target:
    def __init__(self, options: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "_hostile_target.py"), json.dumps(options or {})],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        tag, self.engine, rw, ro, region, guard = self.proc.stdout.readline().split()
        assert tag == "READY"
        self.rw, self.ro, self.region, self.guard = int(rw), int(ro), int(region), int(guard)
        host, port = self.engine.rsplit(":", 1)
        self.addr = (host, int(port))
        sys.path.insert(0, str(HERE))
        from _hostile_target import pattern

        self.expected = pattern()

    def cmd(self, line: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self.proc.stdout.readline().strip()

    def dump(self, tmp: Path) -> np.ndarray:
        path = tmp / "dump.bin"
        assert self.cmd(f"dump {path}") == "OK"
        return np.fromfile(path, np.uint8)

    def raw(self, timeout: float = 5.0) -> socket.socket:
        return socket.create_connection(self.addr, timeout=timeout)

    def close(self) -> None:
        try:
            self.cmd("exit")
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def target() -> Iterator[Target]:
    t = Target({"hixl.handshake_timeout_ms": "500"})
    yield t
    t.close()


def good_peer_works(t: Target, tmp: Path, seed: int) -> None:
    """A real engine writes and reads back 4 KiB in the read-write region; then every byte of
    the target's buffer must be the pattern except exactly those 4 KiB."""
    data = np.random.default_rng(seed).integers(0, 256, 4096, dtype=np.uint8)
    back = np.zeros(4096, np.uint8)
    off = (seed * 4096) % (t.region - 4096)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        e.register(data)
        e.register(back)
        e.connect(t.engine, timeout_ms=5000)
        e.put(t.engine, data.ctypes.data, t.rw + off, 4096, timeout_ms=5000)
        e.get(t.engine, back.ctypes.data, t.rw + off, 4096, timeout_ms=5000)
    assert (back == data).all()
    t.expected[t.guard + off : t.guard + off + 4096] = data
    got = t.dump(tmp)
    bad = np.flatnonzero(got != t.expected)
    assert bad.size == 0, f"{bad.size} bytes changed, first at buffer offset {bad[0]}"


def closed_or_error(sock: socket.socket, says: str = "") -> None:
    """The listener answered with an Error frame (naming `says`) and/or closed the stream."""
    try:
        kind, _, _, payload = w.read_frame(sock)
    except (ConnectionError, OSError):
        return  # closed without a word: fine too
    assert kind == w.ERROR, f"expected an Error frame, got kind {kind}"
    _, message = w.status_of(payload)
    assert says in message, message
    with pytest.raises((ConnectionError, OSError)):
        w.read_frame(sock)


def handshake(t: Target) -> socket.socket:
    s = t.raw()
    s.sendall(w.hello(dialled=w.dialled_of(s)))
    kind, _, _, _ = w.read_frame(s)
    assert kind == w.WELCOME
    return s


def answer(s: socket.socket, want: int) -> tuple[int, str]:
    """Status and message of the next Ack/ReadResp, skipping unsolicited region-table changes
    (RegionsUpdate, RegionsDelta)."""
    while True:
        kind, _, bulk, payload = w.read_frame(s)
        if kind in w.TABLE_CHANGES:
            continue
        assert kind == want, kind
        status, message = w.status_of(payload)
        if bulk:
            w.recv_exact(s, bulk)
        return status, message


# Each attack gets the target and a raw socket; it asserts how the listener answered.
ATTACKS: dict[str, Callable[[Target], None]] = {}


def attack(fn: Callable[[Target], None]) -> Callable[[Target], None]:
    ATTACKS[fn.__name__] = fn
    return fn


@attack
def random_bytes(t: Target) -> None:
    with t.raw() as s:
        s.sendall(np.random.default_rng(1).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes())
        closed_or_error(s)


@attack
def bad_magic(t: Target) -> None:
    with t.raw() as s:
        s.sendall(w.header(w.HELLO, 0, magic=b"GET"[:2]) + b"x" * 100)
        closed_or_error(s, "magic")


@attack
def wrong_version(t: Target) -> None:
    with t.raw() as s:
        s.sendall(w.header(w.HELLO, 0, version=99))
        closed_or_error(s, "protocol version 99")


@attack
def truncated_frame(t: Target) -> None:
    with t.raw() as s:
        whole = w.hello()
        s.sendall(whole[: len(whole) // 2])
        s.shutdown(socket.SHUT_WR)
        closed_or_error(s)


@attack
def payload_length_overflow(t: Target) -> None:
    with t.raw() as s:
        s.sendall(w.header(w.HELLO, 0xFFFFFFFF))
        closed_or_error(s, "payload_len")


@attack
def data_before_handshake(t: Target) -> None:
    with t.raw() as s:
        s.sendall(w.frame(w.WRITE, w.segs([(t.rw, 16)]), bulk=16) + b"\xee" * 16)
        closed_or_error(s, "expected Hello")


@attack
def too_many_descriptors(t: Target) -> None:
    with handshake(t) as s:
        n = w.MAX_DESCS + 1
        # v3 caps each kind's payload on the header: this one is refused before it is read,
        # and the listener may close while the rest is still being sent.
        with contextlib.suppress(ConnectionError):
            s.sendall(w.header(w.WRITE, 4 + 16 * n, bulk=n) + w.segs([(t.rw, 1)] * n) + b"\xee" * n)
        closed_or_error(s, "payload_len" if w.VERSION >= 3 else "segment count")


@attack
def address_outside_regions(t: Target) -> None:
    with handshake(t) as s:
        for addr in (t.rw - 64, t.rw + t.region - 8, t.ro + t.region, 4096):  # guards, null page
            s.sendall(w.frame(w.WRITE, w.segs([(addr, 16)]), tag=1, bulk=16) + b"\xee" * 16)
            status, message = answer(s, w.ACK)
            assert status == hixl.Status.PARAM_INVALID and "not inside a region" in message
        s.sendall(w.frame(w.READ, w.segs([(t.rw + t.region - 8, 16)]), tag=2))
        status, _ = answer(s, w.READ_RESP)
        assert status == hixl.Status.PARAM_INVALID
        # The stream stays usable for a valid request.
        s.sendall(w.frame(w.READ, w.segs([(t.rw, 64)]), tag=3))
        assert answer(s, w.READ_RESP)[0] == 0


@attack
def write_to_read_only_region(t: Target) -> None:
    with handshake(t) as s:
        s.sendall(w.frame(w.WRITE, w.segs([(t.ro, 64)]), tag=1, bulk=64) + b"\xee" * 64)
        status, message = answer(s, w.ACK)
        assert status == hixl.Status.PARAM_INVALID and "read-only" in message
        st = w.strided(t.ro, 4, 64, 128)
        s.sendall(w.frame(w.WRITE_STRIDED, st, tag=2, bulk=256) + b"\xee" * 256)
        assert answer(s, w.ACK)[0] == hixl.Status.PARAM_INVALID
        s.sendall(w.frame(w.READ, w.segs([(t.ro, 64)]), tag=3))  # reading it is allowed
        assert answer(s, w.READ_RESP)[0] == 0


@attack
def segment_wraps_address_space(t: Target) -> None:
    with handshake(t) as s:
        s.sendall(w.frame(w.READ, w.segs([(2**64 - 8, 16)])))
        closed_or_error(s, "segment addr")


@attack
def strided_overflow(t: Target) -> None:
    with handshake(t) as s:
        s.sendall(w.frame(w.READ_STRIDED, w.strided(t.rw, 2**40, 2**30, 2**30)))
        closed_or_error(s, "strided")


@attack
def bulk_length_lies(t: Target) -> None:
    with handshake(t) as s:
        s.sendall(w.frame(w.WRITE, w.segs([(t.rw, 16)]), bulk=10**12) + b"\xee" * 16)
        closed_or_error(s, "bulk_len")


@attack
def huge_string_length(t: Target) -> None:
    with t.raw() as s:
        payload = w.text("x")[:0] + (2**31).to_bytes(4, "little") + b"x" * 64
        s.sendall(w.frame(w.HELLO, payload))
        closed_or_error(s, "engine_id")


@attack
def silent_connections(t: Target) -> None:
    socks = [t.raw(timeout=5) for _ in range(20)]
    t0 = time.monotonic()
    for s in socks:
        with s:
            with pytest.raises((ConnectionError, OSError)):
                w.read_frame(s)  # the listener drops them after hixl.handshake_timeout_ms
    assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_leaves_listener_and_memory_intact(
    target: Target, tmp_path: Path, name: str
) -> None:
    ATTACKS[name](target)
    good_peer_works(target, tmp_path, seed=len(name))


def test_every_attack_in_a_row(target: Target, tmp_path: Path) -> None:
    for i, name in enumerate(sorted(ATTACKS)):
        ATTACKS[name](target)
        if i % 4 == 0:
            good_peer_works(target, tmp_path, seed=i)
    good_peer_works(target, tmp_path, seed=99)


# Cluster secrets as `hixl secret` makes them (engines refuse fewer than 32 hex characters).
RIGHT = "a6ecd3c553ab30e6a6981c666e50cef28382cb21c3af07cb01d83d73562e5f77"
WRONG = "07a6215d3917a8e4467443797057e32d2770dc6a4d9943d78c733b09bb48f85d"


def test_wrong_secret_gets_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    t = Target({"hixl.secret": RIGHT})
    try:
        # Raw: a Hello with no valid proof gets a challenge, then an Error; never a Welcome.
        with t.raw() as s:
            s.sendall(w.hello(auth_nonce=os.urandom(32), dialled=w.dialled_of(s)))
            kind, _, _, payload = w.read_frame(s)
            assert kind == w.AUTH_CHALLENGE
            nonce, proof, _ = w.decode_challenge(payload)
            assert len(nonce) == len(proof) == 32
            s.sendall(w.frame(w.AUTH_RESPONSE, os.urandom(32)))
            kind, _, _, payload = w.read_frame(s)
            assert kind == w.ERROR
            assert "authentication failed" in w.status_of(payload)[1]
            with pytest.raises((ConnectionError, OSError)):
                w.read_frame(s)
        # Engines: no secret, or the wrong one, get a clear NotConnected.
        for options, says in (
            ({}, "requires a cluster secret"),
            ({"hixl.secret": WRONG}, "does not know"),
        ):
            with hixl.Hixl() as e:
                e.initialize("127.0.0.1", {"hixl.backends": "tcp", **options})
                with pytest.raises(hixl.NotConnected, match=says) as err:
                    e.connect(t.engine, timeout_ms=3000)
                assert RIGHT not in str(err.value) and WRONG not in str(err.value)
        # The right secret, from the environment, works.
        monkeypatch.setenv("HIXL_SECRET", RIGHT)
        data = np.arange(4096, dtype=np.uint8)
        with hixl.Hixl() as e:
            e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
            e.register(data)
            e.connect(t.engine, timeout_ms=3000)
            e.put(t.engine, data.ctypes.data, t.rw, 4096)
            assert RIGHT not in json.dumps(e.stats())
        t.expected[t.guard : t.guard + 4096] = data
        assert (t.dump(tmp_path) == t.expected).all()
    finally:
        t.close()
