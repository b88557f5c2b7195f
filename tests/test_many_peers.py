"""Many peers: an engine's threads do not grow with its peers, as initiator or as target, and
every peer's bytes arrive. The peers are many engines per helper process; every engine forces
`hixl.backends=tcp`, so the TCP I/O workers carry everything."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hixl

TCP = {"hixl.backends": "tcp", "hixl.tcp.io_threads": "2"}
PEER = {"hixl.backends": "tcp", "hixl.tcp.io_threads": "1"}

# A helper process: `count` listening engines, each with a 64 KiB buffer named "buf" filled with
# its index; prints them as JSON, then on "check" prints each buffer's blake2 digest; exits at EOF.
HOST_PEERS = textwrap.dedent(
    """
    import hashlib, json, sys
    import numpy as np
    import hixl
    count, opts = int(sys.argv[1]), json.loads(sys.argv[2])
    engines, bufs = [], []
    for i in range(count):
        e = hixl.Hixl()
        e.initialize("127.0.0.1:0", opts)
        b = np.full(65536, i % 251, np.uint8)
        e.register(b, name="buf")
        engines.append(e)
        bufs.append(b)
    print(json.dumps([[e.local_engine, b.ctypes.data] for e, b in zip(engines, bufs)]), flush=True)
    for line in sys.stdin:
        print(json.dumps([hashlib.blake2b(bytes(b)).hexdigest() for b in bufs]), flush=True)
    for e in engines:
        e.finalize()
    """
)

# A helper process: `count` client engines connected to a target, idle; READY, then exits at EOF.
HOST_INITIATORS = textwrap.dedent(
    """
    import json, sys
    import hixl
    count, target, opts = int(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    engines = []
    for _ in range(count):
        e = hixl.Hixl()
        e.initialize("127.0.0.1", opts)
        e.connect(target, timeout_ms=60000)
        engines.append(e)
    print("READY", flush=True)
    sys.stdin.read()
    for e in engines:
        e.finalize()
    """
)


def hixl_threads() -> list[str]:
    """Names of this process's threads that hixl started (hixl-*)."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(n for n in names if n.startswith("hixl"))


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def settle(want: int, deadline_s: float = 10.0) -> list[str]:
    """The hixl threads once at most `want` remain (handshake threads end after their handshake)."""
    end = time.monotonic() + deadline_s
    names = hixl_threads()
    while len(names) > want and time.monotonic() < end:
        time.sleep(0.05)
        names = hixl_threads()
    return names


@pytest.mark.timeout(240)
def test_an_initiator_with_64_peers_runs_a_fixed_set_of_threads() -> None:
    peers: list[tuple[str, int]] = []
    e = hixl.Hixl()
    procs = [spawn(HOST_PEERS, "32", json.dumps(PEER)) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout is not None
            peers += [(eid, addr) for eid, addr in json.loads(p.stdout.readline())]
        before = hixl_threads()
        e.initialize("127.0.0.1", TCP)
        src = np.arange(65536, dtype=np.uint32).astype(np.uint8)
        e.register(src)
        after_init = hixl_threads()
        for eid, _ in peers:
            e.connect_async(eid)
        end = time.monotonic() + 60
        for eid, _ in peers:
            while e.get_async_connect_status(eid) != hixl.AsyncConnectStatus.CONNECTED:
                assert time.monotonic() < end, f"{eid} did not connect"
                time.sleep(0.005)
        # Every peer gets different bytes (a window of the source at its own offset).
        reqs = []
        for i, (eid, addr) in enumerate(peers):
            n = 4096 + 512 * i
            reqs.append(
                e.transfer_async(
                    eid, hixl.TransferOp.WRITE, [hixl.TransferOpDesc(src.ctypes.data + i, addr, n)]
                )
            )
        for r in reqs:
            assert r.wait(30_000) == hixl.TransferStatus.COMPLETED
        # connect_async's own threads end with their connects.
        names = settle(len(after_init))
        # Two I/O workers and the timer, whatever the number of peers; the old code ran about
        # seven threads per peer.
        started = len(names) - len(before)
        assert started <= 4, f"{started} threads for 64 peers: {names}"
        for p in procs:
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("check\n")
            p.stdin.flush()
        digests = []
        for p in procs:
            assert p.stdout is not None
            digests += json.loads(p.stdout.readline())
        for i, d in enumerate(digests):
            want = np.full(65536, (i % 32) % 251, np.uint8)  # each helper counts from 0
            n = 4096 + 512 * i
            want[:n] = src[i : i + n]
            assert d == hashlib.blake2b(bytes(want)).hexdigest(), f"peer {i} holds other bytes"
    finally:
        e.finalize()
        for p in procs:
            if p.stdin and not p.stdin.closed:
                p.stdin.close()
            p.wait(timeout=60)


@pytest.mark.timeout(240)
def test_a_target_with_200_idle_initiators_runs_a_fixed_set_of_threads() -> None:
    before = hixl_threads()
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", TCP)
    dst = np.zeros(4096, np.uint8)
    e.register(dst)
    time.sleep(0.2)
    base = hixl_threads()
    procs = [spawn(HOST_INITIATORS, "50", e.local_engine, json.dumps(PEER)) for _ in range(4)]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "READY"
        # 200 links of three streams each are served; handshake threads end with their
        # handshakes, and what stays is the engine's fixed set.
        names = settle(len(base))
        assert len(names) <= len(base), (
            f"{len(names) - len(base)} more threads with 200 initiators: {names}"
        )
        # Two I/O workers, the timer and the same-host proof listener.
        assert len(names) - len(before) <= 4, f"the target runs {names} (before it: {before})"
        # A newcomer still connects and transfers at once.
        c = hixl.Hixl()
        c.initialize("127.0.0.1", TCP)
        src = np.full(4096, 7, np.uint8)
        c.register(src)
        t0 = time.monotonic()
        c.connect(e.local_engine, timeout_ms=10_000)
        c.put(e.local_engine, src.ctypes.data, dst.ctypes.data, 4096, timeout_ms=10_000)
        took = time.monotonic() - t0
        assert bytes(dst) == bytes(src)
        assert took < 5, f"a new initiator took {took:.1f} s beside 200 idle ones"
        c.finalize()
    finally:
        for p in procs:
            assert p.stdin is not None
            p.stdin.close()
        for p in procs:
            p.wait(timeout=120)
        e.finalize()
