"""Small synchronous TCP requests are carried end to end by the thread that waits for them: its
writer runs on the submitting thread and the answer is read by the waiting thread, so the
engine's I/O workers do not wake up per request. Measured from the kernel's own count of each
thread's context switches, with a real target process."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
from conftest import random_bytes

import hixl


def io_worker_switches() -> int:
    """Voluntary context switches of this process's hixl-io* threads so far."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if not f.read().startswith("hixl-io"):
                    continue
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches"):
                        total += int(line.split()[1])
        except FileNotFoundError:
            continue
    return total


def test_small_sync_requests_do_not_wake_the_io_workers(make_peer) -> None:
    peer = make_peer(1 << 20)
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.tcp.io_threads": "2"})
    try:
        src = random_bytes(1 << 20, 7)
        back = np.zeros(1 << 20, np.uint8)
        e.register(src)
        e.register(back)
        e.connect(peer.engine, timeout_ms=10_000)
        W, R = hixl.TransferOp.WRITE, hixl.TransferOp.READ
        e.transfer_sync(peer.engine, W, [(src.ctypes.data, peer.addr, 4096)])  # warm up
        n = 400
        before = io_worker_switches()
        for i in range(n):
            off = (i % 256) * 4096
            e.transfer_sync(peer.engine, W, [(src.ctypes.data + off, peer.addr + off, 4096)])
            e.transfer_sync(peer.engine, R, [(back.ctypes.data + off, peer.addr + off, 4096)])
        woke = io_worker_switches() - before
        # Every byte made the round trip.
        assert np.array_equal(peer.read(0, 1 << 20), src)
        assert np.array_equal(back, src)
        # Handing each answer to a worker would cost at least one wake-up per request (800);
        # what remains are heartbeat answers and the odd request whose reader a worker held.
        assert woke < n // 4, f"I/O workers woke {woke} times for {2 * n} requests"
    finally:
        e.finalize()


def test_busy_poll_mode_moves_bytes_and_stops_spinning_when_idle(make_peer) -> None:
    peer = make_peer(1 << 20, {"hixl.tcp.busy_poll_us": "2000"})
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", "hixl.tcp.busy_poll_us": "2000"})
    try:
        src = random_bytes(1 << 20, 11)
        e.register(src)
        e.connect(peer.engine, timeout_ms=10_000)
        for i in range(200):
            off = (i % 256) * 4096
            e.transfer_sync(
                peer.engine, hixl.TransferOp.WRITE, [(src.ctypes.data + off, peer.addr + off, 4096)]
            )
        assert np.array_equal(peer.read(0, 200 * 4096), src[: 200 * 4096])
        # The workers poll for 2 ms after activity, then sleep: an idle second costs next to
        # nothing (a heartbeat and its 2 ms of polling at most).
        t0, c0 = time.perf_counter(), sum(os.times()[:2])
        time.sleep(1.0)
        used = (sum(os.times()[:2]) - c0) / (time.perf_counter() - t0)
        assert used < 0.05, f"an idle busy-poll engine used {used:.0%} of a core"
    finally:
        e.finalize()


def test_busy_poll_option_is_bounded() -> None:
    with pytest.raises(hixl.ParamInvalid, match="hixl.tcp.busy_poll_us"):
        hixl.Hixl().initialize("127.0.0.1", {"hixl.tcp.busy_poll_us": "20000"})


IDLE_SCRIPT = """
import os, time, numpy as np, hixl, hixl._logging

def switches(tid):
    with open(f"/proc/self/task/{tid}/status") as f:
        for line in f:
            if line.startswith("voluntary_ctxt_switches"):
                return int(line.split()[1])

def hixl_threads():
    out = {hixl._logging._drainer.native_id: "hixl-log"}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            name = f.read().strip()
        if name.startswith("hixl-"):
            out[int(tid)] = name
    return out

opts = {"hixl.backends": "tcp", "hixl.heartbeat_ms": "0"}
t, i = hixl.Hixl(), hixl.Hixl()
t.initialize("127.0.0.1:0", opts)
i.initialize("127.0.0.1", opts)
buf = np.ones(1 << 16, np.uint8)
t.register(buf)
i.register(buf)
i.connect(t.local_engine, timeout_ms=10_000)
i.put(t.local_engine, buf.ctypes.data, buf.ctypes.data, 4096, timeout_ms=10_000)
time.sleep(0.5)
names = hixl_threads()
before = {tid: switches(tid) for tid in names}
time.sleep(3)
for tid, name in names.items():
    print(name, switches(tid) - before[tid])
i.finalize()
t.finalize()
"""


def test_an_idle_engine_pair_does_not_wake_without_heartbeats() -> None:
    """Two connected engines, heartbeats off, nothing moving: none of hixl's threads (I/O
    workers, timer, log drain) wakes up in 3 s. The region-update retry timer used to run
    4 times a second on every engine and the log drain thread twice a second."""
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-c", IDLE_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0, r.stderr
    woke = {}
    for line in r.stdout.splitlines():
        name, n = line.rsplit(" ", 1)
        woke[name] = woke.get(name, 0) + int(n)
    assert "hixl-timer" in woke and "hixl-log" in woke, r.stdout
    # One stray wake-up is allowed (a reactor thread finishing the put's aftermath).
    assert sum(woke.values()) <= 2, f"idle threads woke: {woke}"
