"""hixl as a guest in a busy process: its threads run where hixl puts them (not where the
thread that called first happened to be pinned), a starved process does not declare live peers
dead, and a peer known dead fails transfers at once."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest
from _lineproc import LineProc
from conftest import proc_state

import hixl


class Guest(LineProc):
    """An initiator engine in a child process (tests/_guest.py), connected to one peer; every
    answer is waited for with a deadline (LineProc)."""

    def __init__(self, peer, size: int, options: dict[str, str] | None = None) -> None:
        super().__init__(["_guest.py", peer.engine, peer.addr, size, json.dumps(options or {})])
        self.proc = self.p

    def close(self, wait_s: float = 10) -> None:
        """Resumes it if the test left it stopped, then asks it to exit (killed after `wait_s`)."""
        if self.p.poll() is None:
            os.kill(self.p.pid, signal.SIGCONT)
        super().close(wait_s)


@pytest.fixture
def make_guest():
    guests: list[Guest] = []

    def make(peer, size: int, options: dict[str, str] | None = None) -> Guest:
        g = Guest(peer, size, options)
        guests.append(g)
        return g

    yield make
    for g in guests:
        g.close()


def test_a_process_stopped_for_a_second_keeps_its_link_to_a_live_peer(
    make_peer, make_guest
) -> None:
    # The peer checks no liveness of its own (heartbeat 0): it never closes the link, so only
    # the stopped process's verdict on it is tested.
    peer = make_peer(1 << 20, {"hixl.heartbeat_ms": "0"})
    g = make_guest(peer, 1 << 20, {"hixl.heartbeat_ms": "100"})
    assert g.cmd("put") == "OK"
    for _ in range(5):
        os.kill(g.proc.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        while proc_state(g.proc.pid) != "T":
            assert time.monotonic() - t0 < 10
            time.sleep(0.001)
        time.sleep(1.0)  # ten heartbeat intervals without this process running
        os.kill(g.proc.pid, signal.SIGCONT)
        # Several intervals after it runs again: a live peer answers each heartbeat.
        for _ in range(5):
            assert g.cmd("put") == "OK"
            time.sleep(0.1)
        assert g.cmd("alive") == "True"


class ThreadStop:
    """Stops single threads of a child process with ptrace (PTRACE_SEIZE + PTRACE_INTERRUPT;
    the rest of the process runs on) and resumes them (PTRACE_DETACH)."""

    SEIZE, INTERRUPT, DETACH = 0x4206, 0x4207, 17
    WALL = 0x40000000

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.stopped: list[int] = []

    def _call(self, req: int, tid: int) -> None:
        if self.libc.ptrace(req, tid, None, None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"ptrace({req:#x}, {tid}): {os.strerror(err)}")

    def stop(self, tid: int) -> None:
        self._call(self.SEIZE, tid)
        self.stopped.append(tid)
        self._call(self.INTERRUPT, tid)
        os.waitpid(tid, self.WALL)  # the thread is in its ptrace stop

    def resume_all(self) -> None:
        while self.stopped:
            self._call(self.DETACH, self.stopped.pop())


def test_a_process_whose_io_threads_starve_keeps_its_link_to_a_live_peer(
    make_peer, make_guest
) -> None:
    # This process's I/O threads are stopped for a second in the middle of a big write (not
    # scheduled: what a pinned, busy engine does to them), while its heartbeat timer runs on:
    # the rest of the write waits in this process, unsent. The peer is alive and checks no
    # liveness of its own. Nothing of this process reaches the peer, so nothing comes back;
    # but the link must live, since the silence is this process's own doing (before, it died
    # after three intervals: "no progress for 300 ms").
    size = 64 << 20
    peer = make_peer(size, {"hixl.heartbeat_ms": "0"})
    g = make_guest(peer, size, {"hixl.heartbeat_ms": "100"})
    # The peer's pages are touched in small writes first: a 64 MiB write into fresh pages can
    # keep a peer on a loaded machine from reading for three intervals, which is its lateness.
    assert g.cmd("warm") == "OK"
    threads = json.loads(g.cmd("threads"))
    io = [int(k.split()[0]) for k in threads if k.split()[1].startswith("hixl-io")]
    assert io, threads
    ts = ThreadStop()
    for attempt in range(5):  # noqa: B007 (reported below)
        try:
            assert g.cmd("start") == "OK"
            for tid in io:
                ts.stop(tid)
            # The write must still be under way for the test to say anything (on a slow
            # machine it is; a fast one may finish it first: then again).
            under_way = g.cmd("status") == "WAITING"
            if under_way:
                time.sleep(1.0)  # ten heartbeat intervals of the timer, without I/O
        finally:
            ts.resume_all()
        assert g.cmd("finish") == "OK"
        assert g.cmd("alive") == "True"
        if under_way:
            break
    else:
        pytest.skip("the write ended before its I/O threads were stopped, five times")
    print(f"guest: I/O threads stopped 1 s mid-write (attempt {attempt + 1}), link alive")
    assert g.cmd("put") == "OK"


ALLOWED = sorted(os.sched_getaffinity(0))


def cpu_list(cpus: list[int]) -> str:
    """The kernel's Cpus_allowed_list text of a set (ascending runs: "0-3,6")."""
    runs: list[list[int]] = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
@pytest.mark.parametrize("cpus", [None, "0"])
def test_hixl_threads_run_on_the_initialize_set_when_the_caller_pins_itself_later(
    make_peer, make_guest, cpus: str | None
) -> None:
    # As vLLM does: the main thread pins itself to the last CPU after initialize, then the
    # first transfers start the lazy threads (same-host copy threads, connect threads).
    opts = {"hixl.backends": "shm"} | ({"hixl.cpus": cpus} if cpus else {})
    # 16 MiB: more than a synchronous caller copies itself, so the copy threads start.
    peer = make_peer(16 << 20)
    g = make_guest(peer, 16 << 20, opts)
    want = cpu_list(ALLOWED) if cpus is None else cpus
    assert json.loads(g.cmd("cpus")) == (ALLOWED if cpus is None else [0])
    assert g.cmd("pin", ALLOWED[-1]) == "OK"
    for _ in range(3):
        assert g.cmd("put") == "OK"
    threads = json.loads(g.cmd("threads"))
    names = {k.split(" ", 1)[1] for k in threads}
    assert {"hixl-io0", "hixl-timer", "hixl-copy0"} <= names, names
    wrong = {k: v for k, v in threads.items() if v != want}
    assert not wrong, f"hixl threads not on {want}: {wrong}"
    py = json.loads(g.cmd("pythreads"))
    assert any("hixl-metrics" in k for k in py), py
    wrong = {k: v for k, v in py.items() if v != want}
    assert not wrong, f"hixl's Python threads not on {want}: {wrong}"


@pytest.mark.parametrize(("cpus", "why"), [("0-x", "not a CPU list"), ("4096", "not a CPU list")])
def test_a_bad_cpu_list_is_refused_naming_it(cpus: str, why: str) -> None:
    e = hixl.Hixl()
    with pytest.raises(hixl.ParamInvalid, match=f'hixl.cpus="{cpus}" is {why}'):
        e.initialize("127.0.0.1", {"hixl.cpus": cpus})


def test_cpus_the_process_may_not_use_are_refused(monkeypatch) -> None:
    outside = max(ALLOWED) + 1
    e = hixl.Hixl()
    with pytest.raises(hixl.ParamInvalid, match=f"may not run on \\({outside}\\)"):
        e.initialize("127.0.0.1", {"hixl.cpus": str(outside)})
    monkeypatch.setenv("HIXL_CPUS", str(outside))
    with pytest.raises(hixl.ParamInvalid, match=f'HIXL_CPUS="{outside}"'):
        hixl.Hixl().initialize("127.0.0.1")
    monkeypatch.setenv("HIXL_CPUS", str(ALLOWED[0]))
    e = hixl.Hixl()
    e.initialize("127.0.0.1")
    try:
        assert e.cpus() == {ALLOWED[0]}
    finally:
        e.finalize()


def test_a_process_pinned_to_one_busy_core_keeps_its_links(make_peer, make_guest) -> None:
    # The guest runs on one CPU beside two busy threads of its own: one holds the GIL in a
    # Python loop, one hashes (GIL released); 5 s of transfers, heartbeat 100 ms.
    peer = make_peer(160 << 10)
    g = make_guest(peer, 160 << 10, {"hixl.heartbeat_ms": "100", "hixl.cpus": str(ALLOWED[0])})
    assert g.cmd("busy", ALLOWED[0]) == "OK"
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < 5:
        assert g.cmd("put") == "OK"
        n += 1
    assert g.cmd("alive") == "True"
    print(f"guest: one busy core, {n} transfers of 160 KiB in 5 s, link alive")


def test_a_peer_known_dead_fails_at_once_until_a_connect_succeeds(make_peer, free_port) -> None:
    addr = f"127.0.0.1:{free_port}"
    peer = make_peer(1 << 20, env={"HIXL_TEST_LISTEN": addr})
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp"})
    try:
        src = np.ones(1 << 20, np.uint8)
        e.register(src)
        e.connect(peer.engine, timeout_ms=5000)
        desc = [(src.ctypes.data, peer.addr, 4096)]
        e.transfer_sync(peer.engine, hixl.TransferOp.WRITE, desc, 30_000)
        peer.proc.kill()
        peer.proc.wait()
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(hixl.NotConnected):
                e.transfer_sync(peer.engine, hixl.TransferOp.WRITE, desc, 30_000)
            took.append(time.monotonic() - t0)
        print(f"guest: transfers to a killed peer failed after {max(took):.3f} s at most")
        assert max(took) < 5, took  # the timeout passed is 30 s
        again = make_peer(1 << 20, env={"HIXL_TEST_LISTEN": addr})
        e.connect(again.engine, timeout_ms=5000)
        desc = [(src.ctypes.data, again.addr, 4096)]
        e.transfer_sync(again.engine, hixl.TransferOp.WRITE, desc, 30_000)
        assert (again.read(0, 4096) == 1).all()
    finally:
        e.finalize()


def test_a_short_sync_transfer_keeps_the_gil_from_a_busy_python_thread(make_peer) -> None:
    # transfer_sync waits its first millisecond with the GIL held. A same-host batch is copied
    # on the calling thread while it is submitted, so it never lets a GIL-holding Python thread
    # in: taking the GIL back from such a thread costs a switch interval (here 1 s; 5 ms by
    # default, more on a core shared with busy threads). Before, every call let it in.
    peer = make_peer(8 << 20, {"hixl.backends": "shm"})
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "shm"})
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    try:
        # 4 MiB: a copy long enough (about a millisecond) for a thread waiting for the GIL to
        # take it whenever the call lets go of it.
        src = np.ones(4 << 20, np.uint8)
        e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        desc = [(src.ctypes.data, peer.addr, src.nbytes)]
        e.transfer_sync(peer.engine, hixl.TransferOp.WRITE, desc, 30_000)
        was = sys.getswitchinterval()
        sys.setswitchinterval(1.0)
        busy = threading.Thread(target=spin, daemon=True)
        try:
            busy.start()
            kept = 0
            for _ in range(30):
                before = count[0]
                e.transfer_sync(peer.engine, hixl.TransferOp.WRITE, desc, 30_000)
                kept += count[0] == before
        finally:
            stop.set()
            sys.setswitchinterval(was)
            busy.join(30)
        print(f"guest: {kept} of 30 synchronous transfers ran without letting the busy thread in")
        # The busy thread, let in by nothing, asks for the GIL only after waiting a second: the
        # 30 calls (a copy of about a millisecond each) are over long before.
        assert kept == 30, kept
        assert (peer.read(0, src.nbytes) == 1).all()
    finally:
        e.finalize()
