"""The attacks of the security review (issue 11), each performed against real processes: raw
sockets, hostile targets and relays written in Python (tests/_wire.py, tests/_sec_*.py), and
real engines. One test per finding; docs/RELIABILITY.md cites them by name.

HIXL_WIRE_VERSION=2 runs the same attacks with protocol-v2 layouts against an engine built
before v3 (options that v2 did not know are then left out), to show that they succeed there.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import select
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _wire as w
import numpy as np
import pytest
from _lineproc import LineProc

import hixl

HERE = Path(__file__).parent
SECRET = "ecb744c4b13d88c04355e296f7c39ff9f9e24cd978b032b31269a5243ef04641"
V3 = w.VERSION >= 3
MiB = 1 << 20


def opts(options: dict[str, str]) -> dict[str, str]:
    """Engine options; against a v2 build the keys it does not know are left out."""
    if V3:
        return options
    known = {k for k, _, _ in hixl.option_keys()}
    return {k: v for k, v in options.items() if k in known}


class Proc(LineProc):
    """A helper process driven by lines on stdin/stdout; its first line starts with `ready`."""


@pytest.fixture
def procs() -> Iterator[Callable[..., Proc]]:
    started: list[Proc] = []

    def start(*args: object, ready: str = "READY") -> Proc:
        p = Proc(list(args), ready)
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.close()


class Target:
    """tests/_hostile_target.py: [guard | rw region | guard | read-only region | guard], only
    the two regions registered, all filled with a known pattern."""

    def __init__(self, start: Callable[..., Proc], options: dict[str, str] | None = None) -> None:
        self.proc = start(HERE / "_hostile_target.py", json.dumps(opts(options or {})))
        _, self.engine, rw, ro, region, guard = self.proc.words
        self.rw, self.ro, self.region, self.guard = int(rw), int(ro), int(region), int(guard)
        host, port = self.engine.rsplit(":", 1)
        self.addr = (host, int(port))
        sys.path.insert(0, str(HERE))
        from _hostile_target import pattern

        self.expected = pattern()

    def dump(self, tmp: Path) -> np.ndarray:
        path = tmp / "dump.bin"
        assert self.proc.cmd("dump", path) == "OK"
        return np.fromfile(path, np.uint8)

    def unchanged(self, tmp: Path, what: str) -> None:
        bad = np.flatnonzero(self.dump(tmp) != self.expected)
        assert bad.size == 0, f"{what}: {bad.size} bytes of the target changed (first at {bad[0]})"


class Engine:
    """tests/_sec_engine.py: a target engine with a 64 KiB read-write buffer."""

    def __init__(self, start: Callable[..., Proc], options: dict[str, str] | None = None) -> None:
        self.proc = start(HERE / "_sec_engine.py", json.dumps(opts(options or {})))
        _, self.engine, buf = self.proc.words
        self.buf = int(buf)
        host, port = self.engine.rsplit(":", 1)
        self.addr = (host, int(port))
        self.pid = self.proc.p.pid

    def status(self, field: str) -> int:
        """A number from /proc/PID/status (VmRSS in KiB, Threads)."""
        with open(f"/proc/{self.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)


class Hostile:
    """tests/_sec_hostile.py in one of its modes."""

    def __init__(self, start: Callable[..., Proc], *args: object) -> None:
        self.proc = start(HERE / "_sec_hostile.py", *args)
        _, self.engine, pid, buf, n = self.proc.words
        self.pid, self.buf, self.len = int(pid), int(buf), int(n)

    def dump(self, tmp: Path) -> bytes:
        path = tmp / "hostile.bin"
        assert self.proc.cmd("dump", path) == "OK"
        return path.read_bytes()


def ended(st: w.Stream, says: str = "") -> str:
    """How the listener ended the stream: "closed" at once, or "Error ..." (naming `says`) and
    then closed; anything else ("open: ...") means it kept the stream or acted on the frame."""
    st.sock.settimeout(5)
    try:
        kind, _, _, payload = st.recv()
    except TimeoutError:
        return "open: no answer within 5 s"
    except (ConnectionError, OSError, w.MacError) as e:
        return f"closed ({e!r})"
    if kind != w.ERROR:
        return f"open: the listener acted on the frame, it answered kind {kind}"
    _, message = w.status_of(payload)
    if says not in message:
        return f"open: an Error that does not say {says!r}: {message!r}"
    try:
        st.recv()
    except TimeoutError:
        return f"open after Error {message!r}"
    except (ConnectionError, OSError, w.MacError):
        return f"Error {message!r}, then closed"
    return f"open: a frame after Error {message!r}"


def assert_ended(how: str) -> None:
    print(how)
    assert not how.startswith("open"), how


# --- finding 1 -----------------------------------------------------------------------------


def test_same_host_imposter(procs: Callable[..., Proc], tmp_path: Path) -> None:
    """A peer that names another same-host process (V) as itself, with a region table over
    V's read-only region and unregistered guard pages, must not make a real initiator write
    into V: the same-host proof fails (V does not hold the initiator's stream), so auto uses
    TCP to the imposter and shm is refused with UNSUPPORTED."""
    v = Target(procs)
    lo, hi = v.rw - v.guard, v.ro + v.region + v.guard
    m = Hostile(procs, "imposter", v.engine, lo, hi)
    junk = np.full(4096, 0xEE, np.uint8)
    outcome: dict[str, Any] = {}
    for transport in ("auto", "shm"):
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", opts({"hixl.backends": transport, "hixl.heartbeat_ms": "0"}))
            a.register(junk)
            try:
                a.connect(m.engine, timeout_ms=5000)
            except hixl.HixlError as e:
                outcome[transport] = e
                continue
            outcome[transport] = a.stats()[m.engine]["backend"]
            # The read-only region, then each unregistered guard page.
            for addr in (v.ro, v.rw - v.guard, v.ro - v.guard, v.ro + v.region):
                with contextlib.suppress(hixl.HixlError):
                    a.put(m.engine, junk.ctypes.data, addr, 4096, timeout_ms=3000)
    v.unchanged(tmp_path, f"the imposter made the initiator write into the victim ({outcome})")
    print(outcome)
    assert outcome["auto"] == "tcp", outcome
    assert isinstance(outcome["shm"], hixl.Unsupported), outcome


def test_claimed_same_process_is_refused(procs: Callable[..., Proc]) -> None:
    """The `self` backend (two engines of one process, memcpy) must be proven, not claimed: an
    imposter in another process whose Welcome names the same-host socket of an engine V of
    the initiator's own process, with a table over V's memory, gets TCP; V is untouched."""
    with hixl.Hixl() as v:
        v.initialize("127.0.0.1:0")
        victim = np.full(3 * 4096, 0x5A, np.uint8)
        v.register(victim[4096 : 2 * 4096], access="r")
        lo, hi = victim.ctypes.data, victim.ctypes.data + victim.size
        m = Hostile(procs, "imposter", v.local_engine, lo, hi)
        junk = np.full(4096, 0xEE, np.uint8)
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", opts({"hixl.backends": "auto", "hixl.heartbeat_ms": "0"}))
            a.register(junk)
            a.connect(m.engine, timeout_ms=5000)
            backend = a.stats()[m.engine]["backend"]
            for addr in (lo, lo + 4096, lo + 2 * 4096):
                with contextlib.suppress(hixl.HixlError):
                    a.put(m.engine, junk.ctypes.data, addr, 4096, timeout_ms=3000)
        assert backend == "tcp", backend
        assert (victim == 0x5A).all(), "the imposter made the initiator write into its own process"


# --- finding 2 -----------------------------------------------------------------------------


def test_relay_refused(procs: Callable[..., Proc]) -> None:
    """A relay without the secret forwards a member's handshake to the target. Unchanged, the
    target sees that the member dialled another address and refuses (naming both); with the
    Hello's `dialled` rewritten, the member rejects the target's proof. Either way no Welcome
    goes through, and the relay's own Read on the stream gets nothing."""
    t = Target(procs, {"hixl.secret": SECRET})
    seen: dict[str, Any] = {}
    for mode in ("hijack", "rewrite"):
        r = procs(HERE / "_sec_relay.py", t.engine, mode, t.rw, 64)
        relay = r.words[1]
        with hixl.Hixl() as a:
            member = {"hixl.backends": "tcp", "hixl.secret": SECRET, "hixl.heartbeat_ms": "0"}
            a.initialize("127.0.0.1", opts(member))
            err: hixl.HixlError | None = None
            try:
                a.connect(relay, timeout_ms=5000)
            except hixl.HixlError as e:
                err = e
            report = json.loads(r.cmd("report"))
        seen[mode] = (relay, err, report)
        print(f"{mode}: {err}; relay: {report}")
        assert report, f"{mode}: the relay saw no connection"
        stolen = [x for x in report if x["stolen"]]
        assert not stolen, f"{mode}: the relay read the target's memory: {report}"
        assert not any(x["welcome"] for x in report), f"{mode}: a Welcome went through: {report}"
        assert err is not None, f"{mode}: the member connected through the relay"
    relay, err, _ = seen["hijack"]
    assert relay in str(err) and t.engine in str(err), f"the refusal names both addresses: {err}"


def test_injected_frame_closes(procs: Callable[..., Proc], tmp_path: Path) -> None:
    """A client that knows the secret does the v3 handshake and one good sealed Read. On a
    fresh authenticated stream each, a frame with a wrong MAC, a replayed sealed frame and a
    sealed frame with one payload byte altered each end the stream before the target acts on
    them: its memory never changes. With data MACs on, altered bulk bytes fail the write and
    end the stream."""
    t = Target(procs, {"hixl.secret": SECRET})
    off = 4096
    here = t.rw + off
    orig = t.expected[t.guard + off : t.guard + off + 256].tobytes()
    evil = bytes(255 - b for b in orig)  # differs from the target's bytes everywhere

    def session(flags: int = 0) -> w.Stream:
        st, _ = w.connect(t.addr, secret=SECRET, engine="raw-member", flags=flags)
        assert st.sealed or not V3
        return st

    with session() as st:
        st.send(w.READ, w.segs([(here, 256)]), tag=1)
        status, _, data = st.answer(w.READ_RESP)
        assert status == 0 and data == orig, "the good sealed read"

    with session() as st:  # (a) a frame whose MAC the injector had to guess
        forged = w.frame(w.WRITE, w.segs([(here, 256)]), tag=2, bulk=256)
        st.sock.sendall(forged + (os.urandom(w.MAC_LEN) if st.sealed else b"") + evil)
        how = ended(st)
        t.unchanged(tmp_path, "a frame with a wrong MAC was acted on")
        assert_ended(how)

    with session() as st:  # (b) a correctly sealed frame, replayed later on its stream
        first = st.encode(w.WRITE, w.segs([(here, 256)]), tag=3, bulk=evil)
        st.sock.sendall(first)
        assert st.answer(w.ACK)[0] == 0
        st.send(w.WRITE, w.segs([(here, 256)]), tag=4, bulk=orig)
        assert st.answer(w.ACK)[0] == 0
        t.unchanged(tmp_path, "the two good writes")
        st.sock.sendall(first)
        how = ended(st)
        t.unchanged(tmp_path, "a replayed frame was acted on")
        assert_ended(how)

    with session() as st:  # (c) a sealed frame with one payload byte altered
        good = st.seal(w.WRITE, w.segs([(here, 256)]), tag=5, bulk_len=256)
        altered = bytearray(good)
        altered[24 + 4] ^= 0x40  # the segment address moves by 64 bytes, still in the region
        st.sock.sendall(bytes(altered) + evil)
        how = ended(st)
        t.unchanged(tmp_path, "an altered frame was acted on")
        assert_ended(how)

    if V3:  # (d) with data MACs (Hello flag 1): bulk bytes altered on the way
        with session(w.FLAG_DATA_MAC) as st:
            st.send(w.WRITE, w.segs([(here, 256)]), tag=6, bulk=orig)
            assert st.answer(w.ACK)[0] == 0, "a write with a good data MAC"
            tampered = bytearray(st.encode(w.WRITE, w.segs([(here, 256)]), tag=7, bulk=evil))
            tampered[-w.MAC_LEN - 1] ^= 1  # the last bulk byte
            st.sock.sendall(bytes(tampered))
            # The bytes land before the data MAC can be checked: the write fails, the stream ends.
            status, message, _ = st.answer(w.ACK)
            assert status == hixl.Status.FAILED, (status, message)
            assert_ended(ended(st))
        with session() as st:
            st.send(w.WRITE, w.segs([(here, 256)]), tag=8, bulk=orig)
            assert st.answer(w.ACK)[0] == 0
        t.unchanged(tmp_path, "restored after the tampered write")

    with session() as st:  # the target still serves members
        st.send(w.READ, w.segs([(here, 256)]), tag=9)
        assert st.answer(w.READ_RESP)[2] == orig


# --- findings 3 and 4 ----------------------------------------------------------------------


def test_unsealed_memfd_refused(procs: Callable[..., Proc], tmp_path: Path) -> None:
    """A same-host target that really holds the stream (it passes the same-host proof) offers
    as its region's memfd (a) an unsealed memfd named "hixl", (b) a regular file. The
    initiator must not map either (direct_parts stays 0): it copies by cross-memory attach into
    the target's private buffer, and the regular file is never written."""
    regular = tmp_path / "regular.bin"
    content = np.random.default_rng(3).integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes()
    regular.write_bytes(content)
    for kind in ("unsealed", "regular"):
        h = Hostile(procs, "memfd", kind, regular)
        data = np.random.default_rng(len(kind)).integers(0, 256, h.len, dtype=np.uint8)
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", {"hixl.backends": "auto"})
            a.register(data)
            a.connect(h.engine, timeout_ms=5000)
            a.put(h.engine, data.ctypes.data, h.buf, h.len, timeout_ms=5000)
            st = a.stats()[h.engine]
        assert st["direct_parts"] == 0, f"{kind}: the initiator mapped the offered descriptor"
        assert st["backend"] == "shm", f"{kind}: the hostile target should pass the proof: {st}"
        assert h.dump(tmp_path) == data.tobytes(), f"{kind}: the bytes went by CMA to its buffer"
    assert regular.read_bytes() == content, "the regular file was written"


@pytest.mark.skipif(os.geteuid() != 0, reason="the race is against a root initiator")
def test_memfd_swap_race_as_root(procs: Callable[..., Proc], tmp_path: Path) -> None:
    """A same-host target swaps its region's descriptor, in a tight loop, between a sealed
    memfd and an O_PATH descriptor of a root-only file; it binds its Unix socket after it
    drops to its uid. Run as uid 65534, a root initiator takes no direct path to it at all
    (exec after proof: only to a root peer) and the put goes by TCP. Run as root, the root
    initiator connects and puts again and again for 3 s (a fresh link each time, since a link
    maps a region once), over `shm`, mapping the memfd on some links: the root-only file never
    changes."""
    secret_file = tmp_path / "root-only.bin"
    content = np.random.default_rng(4).integers(0, 256, 64 * 1024, dtype=np.uint8).tobytes()
    secret_file.write_bytes(content)
    os.chmod(secret_file, 0o600)
    data = np.full(4096, 0xEE, np.uint8)
    for uid in ("65534", "keep"):
        h = Hostile(procs, "memfd", "swap", secret_file, uid)
        with open(f"/proc/{h.pid}/status") as f:
            now = next(line.split()[1] for line in f if line.startswith("Uid:"))
        assert now == ("0" if uid == "keep" else uid), f"the hostile target runs as {now}"
        attempts = mapped = 0
        backends: set[str] = set()
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", opts({"hixl.backends": "auto", "hixl.heartbeat_ms": "0"}))
            a.register(data)
            deadline = time.monotonic() + (3 if uid == "keep" else 0.5)
            while time.monotonic() < deadline:
                attempts += 1
                try:
                    a.connect(h.engine, timeout_ms=3000)
                    a.put(h.engine, data.ctypes.data, h.buf, 4096, timeout_ms=3000)
                    st = a.stats()[h.engine]
                    backends.add(st["backend"])
                    mapped += st["direct_parts"] > 0
                except hixl.HixlError:
                    pass
                with contextlib.suppress(hixl.HixlError):
                    a.disconnect(h.engine)
                if secret_file.read_bytes() != content:
                    break
        print(f"uid {uid}: {attempts} links over {backends}, {mapped} mapped the sealed memfd")
        assert secret_file.read_bytes() == content, f"the root-only file was written ({uid})"
        assert attempts >= 3
        if uid == "keep":
            assert backends == {"shm"} and mapped > 0, "the race must reach the direct path"
            assert attempts >= 10
        else:
            assert backends == {"tcp"} and mapped == 0, "no direct path to a non-root peer"


def test_shrink_cannot_sigbus(procs: Callable[..., Proc]) -> None:
    """A same-host target shrinks the memfd it offered (ftruncate 0) after the initiator's
    first put. The initiator's next puts must not kill it with SIGBUS: an unsealed memfd is
    never mapped, a sealed one cannot shrink."""
    for kind in ("unsealed", "sealed"):
        h = Hostile(procs, "memfd", kind)
        a = procs(HERE / "_sec_put.py", h.engine, h.buf, 4096, ready="PUT1")
        shrink = h.proc.cmd("shrink")
        a.send("go")
        done = a.line(60)
        rc = a.p.wait(30)
        print(f"{kind}: first put {a.words}, shrink {shrink!r}, then {done!r}, exit code {rc}")
        assert rc == 0, f"{kind}: the initiator died with {rc} (-7 is SIGBUS); {a.words}, {shrink}"
        assert done.startswith("DONE"), done
        if kind == "sealed":
            assert shrink.startswith("ERR"), "a sealed memfd cannot shrink"


def test_grown_region_never_copies_past_the_mapping(procs: Callable[..., Proc]) -> None:
    """A same-host target offers a sealed 64 KiB memfd, lets the initiator map it (one put),
    then claims in a delta that the same region id is 64 MiB long. A read 1 MiB into the
    'grown' region must not go through the 64 KiB mapping (that would copy the initiator's
    own memory, or crash it): it goes by cross-memory attach, which the kernel checks."""
    h = Hostile(procs, "memfd", "sealed")
    a = hixl.Hixl()
    a.initialize("127.0.0.1", {"hixl.backends": "shm"})
    try:
        src = np.full(1 << 16, 0x5A, np.uint8)
        a.register(src)
        a.connect(h.engine, timeout_ms=5000)
        a.put(h.engine, src.ctypes.data, h.buf, 4096, timeout_ms=5000)
        mapped = a.stats()[h.engine]["direct_parts"]
        assert mapped == 1, "the first put went through the mapping"
        assert h.proc.cmd("grow", 64 << 20) == "OK"
        deadline = time.monotonic() + 5
        while a.remote_regions(h.engine)[0].len != 64 << 20:
            assert time.monotonic() < deadline, "the delta never arrived"
            time.sleep(0.01)
        dst = np.zeros(4096, np.uint8)
        a.register(dst)
        with contextlib.suppress(hixl.HixlError):  # the kernel may refuse the range (EFAULT)
            a.get(h.engine, dst.ctypes.data, h.buf + (1 << 20), 4096, timeout_ms=5000)
        st = a.stats()[h.engine]
        print(f"direct copies before the lie {mapped}, after the read {st['direct_parts']}")
        assert st["direct_parts"] == mapped, "the read went through the 64 KiB mapping"
    finally:
        a.finalize()


# --- finding 5 -----------------------------------------------------------------------------


def test_slow_connections_capped(procs: Callable[..., Proc]) -> None:
    """1,000 connections from 1,000 source addresses that send a partial Hello slowly, or
    nothing: the target's RSS grows by under 50 MiB, its thread count stays bounded (under 400),
    and a
    good peer still connects and moves 4 KiB each way within 1 s. A Hello header declaring a
    4 MiB payload is refused at once, without memory set aside for it; a client that drips a
    Hello one byte per 100 ms is closed by the whole-handshake deadline."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(8192, hard), hard))
    t = Engine(procs)
    rss0, threads0 = t.status("VmRSS"), t.status("Threads")
    partial = w.hello(engine="slow", dialled=t.engine)[:40]
    socks: list[socket.socket] = []
    try:
        for i in range(1000):
            s = socket.socket()
            s.setblocking(False)
            s.bind((f"127.0.{i // 250}.{i % 250 + 1}", 0))
            s.connect_ex(t.addr)
            socks.append(s)
        rss, threads = rss0, threads0
        good_s: float | None = None
        sent = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3:
            if sent < len(partial):  # every other connection drips its Hello, a byte a round
                for s in socks[1::2]:
                    with contextlib.suppress(OSError):
                        s.send(partial[sent : sent + 1])
                sent += 1
            time.sleep(0.1)
            rss, threads = max(rss, t.status("VmRSS")), max(threads, t.status("Threads"))
            if good_s is None and time.monotonic() - t0 > 1.5:
                good_s = good_peer_seconds(t)
        print(f"RSS +{(rss - rss0) / 1024:.1f} MiB, threads {threads0} -> {threads}")
        assert (rss - rss0) * 1024 < 50 * MiB, f"RSS grew by {(rss - rss0) / 1024:.0f} MiB"
        # 256 pending handshakes (the default cap), the engine's own threads, and evicted
        # streams whose threads are still on their way out; uncapped, this reached 771-949.
        assert threads < 400, f"{threads} threads"
        assert good_s is not None and good_s < 1.0, f"the good peer took {good_s} s"
    finally:
        for s in socks:
            s.close()

    # A Hello header that declares 4 MiB: refused on the header, before any allocation.
    time.sleep(0.5)
    rss0 = t.status("VmRSS")
    big = []
    for i in range(20):
        s = socket.socket()
        s.bind((f"127.0.9.{i + 1}", 0))
        s.settimeout(2)
        s.connect(t.addr)
        s.sendall(w.header(w.HELLO, 4 * MiB))
        big.append(s)
    t0 = time.monotonic()
    time.sleep(0.3)
    grew = (t.status("VmRSS") - rss0) * 1024
    try:
        for s in big:
            s.settimeout(max(0.01, t0 + 1.0 - time.monotonic()))
            with pytest.raises((ConnectionError, OSError)) as e:
                while True:
                    kind, _, _, payload = w.read_frame(s)
                    assert kind == w.ERROR and "payload_len" in w.status_of(payload)[1]
            assert not isinstance(e.value, TimeoutError), "a 4 MiB Hello header was not refused"
    finally:
        for s in big:
            s.close()
    print(f"20 Hello headers declaring 4 MiB: RSS +{grew / MiB:.1f} MiB")
    assert grew < 10 * MiB, f"RSS grew by {grew / MiB:.0f} MiB for 20 Hello headers"

    # One byte of Hello per 100 ms: the per-read timeout never fires, the deadline does.
    t2 = Engine(procs, {"hixl.handshake_timeout_ms": "1000"})
    hello = w.hello(engine="drip", dialled=t2.engine)
    with socket.create_connection(t2.addr) as s:
        t0 = time.monotonic()
        closed_after, got = None, b""
        i = 0
        while closed_after is None and time.monotonic() - t0 < 4:
            if i < len(hello):
                try:
                    s.send(hello[i : i + 1])
                except OSError:
                    closed_after = time.monotonic() - t0
                    break
                i += 1
            if select.select([s], [], [], 0.1)[0]:
                try:
                    chunk = s.recv(65536)
                except OSError:
                    chunk = b""
                got += chunk
                if not chunk:
                    closed_after = time.monotonic() - t0
        assert got[3:4] != bytes([w.WELCOME]), "the dripping client got a Welcome"
        print(f"the dripping client was closed after {closed_after} s, having got {got[:64]!r}")
        assert closed_after is not None and closed_after < 1.5, (
            f"a Hello dripped at 10 bytes/s was not cut off by the 1 s deadline ({closed_after})"
        )


def good_peer_seconds(t: Engine) -> float:
    """Seconds a good engine takes to connect and put and get 4 KiB (already initialized)."""
    data = np.arange(4096, dtype=np.uint32).astype(np.uint8)
    back = np.zeros(4096, np.uint8)
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        e.register(data)
        e.register(back)
        t0 = time.monotonic()
        e.connect(t.engine, timeout_ms=5000)
        e.put(t.engine, data.ctypes.data, t.buf, 4096, timeout_ms=5000)
        e.get(t.engine, back.ctypes.data, t.buf, 4096, timeout_ms=5000)
        took = time.monotonic() - t0
    assert (back == data).all()
    return took


# --- finding 6 -----------------------------------------------------------------------------


def notify_until_refused(st: w.Stream, n: int, name: str = "n", msg: str = "x") -> tuple[int, int]:
    """Sends up to n notifies; (how many were accepted, status of the first refusal or 0)."""
    for i in range(n):
        st.send(w.NOTIFY, w.text(name) + w.text(msg), tag=i + 1)
        status = st.answer(w.ACK)[0]
        if status != 0:
            return i, status
    return n, 0


def test_notify_quota_per_connection(procs: Callable[..., Proc]) -> None:
    """Notification quotas are per connection and in total, with a byte budget: a client
    squatting on a real peer's engine id is refused at its own quota and the real peer's
    notify still succeeds; rotating ids over new connections is bounded by the total cap; and
    512 KiB notifies against a 1 MiB budget are refused at the third."""
    exhausted = int(hixl.Status.RESOURCE_EXHAUSTED)
    t = Engine(
        procs,
        {
            "hixl.max_notifies": "64",
            "hixl.max_notifies_total": "256",
            "hixl.max_notify_bytes": str(MiB),
        },
    )
    with hixl.Hixl() as a:
        a.initialize("127.0.0.1", {"hixl.backends": "tcp"})
        st, _ = w.connect(t.addr, engine=a.local_engine)  # claims the real peer's id
        with st:
            accepted, status = notify_until_refused(st, 200)
            print(f"the squatter got {accepted} notifies in, then status {status}")
            assert accepted <= 64 and status == exhausted, (accepted, status)
            a.connect(t.engine, timeout_ms=5000)
            a.send_notify(t.engine, hixl.NotifyDesc("real", "from the real peer"), timeout_ms=3000)
    got = json.loads(t.proc.cmd("notifies"))
    assert ["real", len("from the real peer")] in got

    accepted = 0
    for i in range(8):  # a fresh engine id on every connection
        st, _ = w.connect(t.addr, engine=f"rotating-{i}")
        with st:
            accepted += notify_until_refused(st, 64)[0]
    print(f"rotating ids over 8 connections: {accepted} accepted")
    assert accepted <= 256, f"{accepted} notifications pending, over the total cap"
    assert len(json.loads(t.proc.cmd("notifies"))) == accepted

    big = "x" * (512 * 1024 - 256)
    st, _ = w.connect(t.addr, engine="bytes")
    with st:
        accepted, status = notify_until_refused(st, 3, "big", big)
    print(f"512 KiB notifies: {accepted} accepted, then status {status}")
    assert (accepted, status) == (2, exhausted), "the byte budget refuses the third"


# --- finding 7 -----------------------------------------------------------------------------


def test_register_never_blocks_on_stalled_peer(procs: Callable[..., Proc]) -> None:
    """A peer completes the handshake and never reads again; the target registers 20,000
    regions one by one, each under a 250-byte name (each publishing a region-table delta of
    about 300 bytes, 6 MB in all: soon the stalled socket and the kernel's buffers, 4 MiB at
    most, take no more). Every register call returns within 1 s, and the target drops the
    stalled stream once it has owed an update for the bound (hixl.deregister_timeout_ms,
    here 1 s)."""
    t = Engine(procs, {"hixl.deregister_timeout_ms": "1000"})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(5)
    sock.connect(t.addr)
    st, _ = w.handshake(sock, engine="stalled", index=0)
    with st:
        out = t.proc.cmd("register_many", 20000, 0, 250, timeout=90)
        print(out)
        assert out.startswith("DONE"), f"register blocked on the stalled peer: {out!r}"
        worst = float(out.split()[2])
        assert worst < 1.0, f"the slowest register took {worst} s"
        time.sleep(2)  # past the bound, still without reading
        # Read what the target had queued: the stream must end (EOF or reset), not go quiet.
        # A window of 4 KiB, below loopback's segment size, leaves the sender probing the
        # window with exponential back-off, which can trickle megabytes for minutes: the
        # drop was decided above, so open the window before draining.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
        sock.settimeout(3)
        closed = False
        try:
            while sock.recv(1 << 20):
                pass
            closed = True
        except TimeoutError:
            pass
        except OSError:
            closed = True
        assert closed, "the target kept the stalled stream open"


# --- finding 8 -----------------------------------------------------------------------------


def test_claimed_host_cannot_fail_deregister(procs: Callable[..., Proc]) -> None:
    """A remote client claims the target's host id (learned from a Welcome) and never
    confirms a region update: the target's deregister still succeeds at once."""
    t = Engine(procs, {"hixl.deregister_timeout_ms": "3000"})
    st, welcome = w.connect(t.addr, engine="peek")
    st.close()
    st, _ = w.connect(t.addr, engine="liar", host=welcome["host"], index=0)
    with st:
        out = t.proc.cmd("deregister", timeout=30)
        print(out)
    assert out.startswith("OK"), f"deregister failed: {out}"
    assert float(out.split()[1]) < 1.0, f"deregister waited for the liar: {out}"


# --- finding 9 -----------------------------------------------------------------------------


def test_read_response_for_write_closes(procs: Callable[..., Proc]) -> None:
    """A malicious target answers a WRITE with a ReadResp (status 0) carrying bytes: the put
    fails, its source buffer is unchanged, and the link is closed."""
    m = Hostile(procs, "readresp")
    src = np.random.default_rng(9).integers(0, 256, 4096, dtype=np.uint8)
    keep = src.copy()
    with hixl.Hixl() as a:
        a.initialize("127.0.0.1", opts({"hixl.backends": "tcp", "hixl.heartbeat_ms": "0"}))
        a.register(src)
        a.connect(m.engine, timeout_ms=5000)
        err: hixl.HixlError | None = None
        try:
            a.put(m.engine, src.ctypes.data, m.buf, 4096, timeout_ms=3000)
        except hixl.HixlError as e:
            err = e
        assert np.array_equal(src, keep), "the target's bytes overwrote the source of the write"
        assert err is not None, "the put succeeded"
        deadline = time.monotonic() + 3
        while a.stats()[m.engine]["alive"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not a.stats()[m.engine]["alive"], "the link survived a wrong answer"


# --- finding 10 ----------------------------------------------------------------------------


def test_weak_secret_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A secret shorter than 32 hex characters (or not hex) is refused with PARAM_INVALID,
    from the options or from HIXL_SECRET; the error points to `hixl secret`."""
    for weak in ("summer2024", "3f" * 15 + "a", "g" * 40):
        with pytest.raises(hixl.ParamInvalid, match="hixl secret"):
            hixl.Hixl().initialize("127.0.0.1", {"hixl.secret": weak})
    monkeypatch.setenv("HIXL_SECRET", "summer2024")
    with pytest.raises(hixl.ParamInvalid):
        hixl.Hixl().initialize("127.0.0.1")
    monkeypatch.setenv("HIXL_SECRET", SECRET)
    e = hixl.Hixl()
    e.initialize("127.0.0.1")
    e.finalize()


def test_failed_auth_rate_limited(procs: Callable[..., Proc]) -> None:
    """Handshakes in a row with a wrong AuthResponse from one source address: the first 8
    get their challenge at once; after that the address is throttled, each of its challenges
    (a proof to guess against) comes at least 1 s late, so guesses from it are rate-limited;
    it is slowed, never refused (an honest peer behind the same NAT still connects), and
    another source address is challenged at once."""
    t = Target(procs, {"hixl.secret": SECRET})

    def attempt(source: str) -> float:
        """One guess from `source`; seconds until the target's challenge."""
        with socket.socket() as s:
            s.bind((source, 0))
            s.settimeout(4)
            s.connect(t.addr)
            t0 = time.monotonic()
            s.sendall(w.hello(engine="guesser", auth_nonce=os.urandom(32), dialled=w.dialled_of(s)))
            try:
                kind, _, _, _ = w.read_frame(s)
            except TimeoutError:
                pytest.fail("the target neither challenged nor closed")
            waited = time.monotonic() - t0
            assert kind == w.AUTH_CHALLENGE, kind
            s.sendall(w.frame(w.AUTH_RESPONSE, os.urandom(32)))
            with contextlib.suppress(ConnectionError, OSError):
                while True:
                    w.read_frame(s)
            return waited

    first = [attempt("127.0.0.7") for _ in range(8)]
    assert max(first) < 0.5, first
    later = [attempt("127.0.0.7") for _ in range(3)]
    print(f"challenge delays: first 8 {max(first):.3f} s at most, then {later}")
    assert min(later) >= 0.9, f"a throttled address got its challenge after {min(later):.3f} s"
    assert attempt("127.0.0.2") < 0.5, "another source address is challenged at once"


# --- same-host proof: who may ask -------------------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a client as another user")
def test_unprivileged_local_cannot_fail_deregister(procs: Callable[..., Proc]) -> None:
    """A process of another user on the same host (uid 65534; the target runs as root) does
    the handshake and asks for the same-host proof about its own stream, truthfully, with its
    socket attached, then never confirms a region update. It may not access the target's
    memory, so it gets NO and stays a TCP peer: the target registers a region and deregisters
    one at once. Control: a root client doing the same gets OK and then holds deregister for
    the whole hixl.deregister_timeout_ms, which fails (what the other user could do before the
    uid check)."""
    options = {"hixl.deregister_timeout_ms": "3000"}
    t = Engine(procs, options)
    u = procs(HERE / "_sec_unpriv.py", t.engine, 65534, ready="ANSWER")
    answer = " ".join(u.words[2:])
    print(f"uid {u.words[1]}: {answer!r}")
    assert u.words[1] == "65534", u.words
    registered = t.proc.cmd("register_many", 1, timeout=10)
    out = t.proc.cmd("deregister", timeout=10)
    print(f"{registered}; deregister: {out}")
    assert answer.startswith("NO"), f"the other user passed the same-host proof: {answer!r}"
    assert registered.startswith("DONE"), registered
    assert out.startswith("OK"), f"deregister failed: {out}"
    assert float(out.split()[1]) < 1.0, f"deregister waited for the other user: {out}"

    t2 = Engine(procs, options)
    root = procs(HERE / "_sec_unpriv.py", t2.engine, "keep", ready="ANSWER")
    out = t2.proc.cmd("deregister", timeout=10)
    print(f"control, uid {root.words[1]}: {' '.join(root.words[2:])!r}; deregister: {out}")
    assert root.words[2] == "OK", f"the control (root) should pass the proof: {root.words}"
    assert out.startswith("ERR") and float(out.split()[1]) >= 2.5, out


@pytest.mark.skipif(os.geteuid() != 0, reason="reads another process's memory via /proc/PID/mem")
def test_forked_listener_bystander_untouched(procs: Callable[..., Proc], tmp_path: Path) -> None:
    """A same-host target H whose abstract Unix listener was created by a forked child B (the
    bystander) before H accepted any connection: B bound and listened, handed the listener to
    H and sleeps, holding a copy of H's memory (H's private buffer at the same address). H
    answers the proof truthfully: OK, with the number of its own descriptor of the stream.

    The kernel names B as the socket's creator (SO_PEERCRED / SO_PEERPIDFD record the process
    that called listen()), and B runs as the same user, but B does not hold the TCP stream:
    pidfd_getfd(B, fd) gives no descriptor, or one whose ends are not the stream reversed, so
    the initiator refuses the same-host path. A real initiator (auto) then puts 4 KiB by TCP
    into H's buffer, and B's copy stays byte-for-byte as it was; under shm the connect fails
    UNSUPPORTED. Before ad2bfd7 the initiator only read a probe token at the address H named
    (H answers a request without a descriptor that way), in the process the kernel named: B
    holds the same token at the same address, so the proof passed and the initiator copied by
    cross-memory attach into the bystander, while H's buffer never got the bytes."""
    h = Hostile(procs, "bystander")
    child = int(h.proc.cmd("bystander"))
    assert child > 0 and child != h.pid, child

    def bystander_buf() -> bytes:
        with open(f"/proc/{child}/mem", "rb") as f:
            f.seek(h.buf)
            return f.read(h.len)

    before = bystander_buf()
    data = np.random.default_rng(11).integers(0, 256, 4096, dtype=np.uint8)
    outcome: dict[str, Any] = {}
    for transport in ("auto", "shm"):
        with hixl.Hixl() as a:
            a.initialize("127.0.0.1", {"hixl.backends": transport, "hixl.heartbeat_ms": "0"})
            a.register(data)
            try:
                a.connect(h.engine, timeout_ms=5000)
            except hixl.HixlError as e:
                outcome[transport] = e
                continue
            outcome[transport] = a.stats()[h.engine]["backend"]
            a.put(h.engine, data.ctypes.data, h.buf, 4096, timeout_ms=5000)
    answers = json.loads(h.proc.cmd("answers"))
    print(f"bystander pid {child}, H pid {h.pid}; H answered {answers}; {outcome}")
    assert bystander_buf() == before, "the initiator wrote into the bystander's memory"
    assert answers and all(x.startswith("OK") for x in answers), f"H must pass the proof: {answers}"
    assert outcome["auto"] == "tcp", outcome
    assert isinstance(outcome["shm"], hixl.Unsupported), outcome
    assert str(child) in str(outcome["shm"]), f"the refusal names the bystander: {outcome['shm']}"
    assert h.dump(tmp_path)[:4096] == data.tobytes(), "H's buffer got the bytes"
