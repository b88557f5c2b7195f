"""One engine and many peers: its threads, memory, idle CPU, connect time and bandwidth.

    python benches/many_peers.py                      # N = 1, 16, 64, 256 peers
    python benches/many_peers.py --peers 1,16 --idle 1
    python benches/many_peers.py --initiators 1000    # also: one target, 1000 idle initiators
    python benches/many_peers.py --json out.json

The engine under test lives in this process and is the only engine here; its peers are many
engines per helper process (1,000 Python processes do not fit a small machine). Every engine
uses `hixl.backends=tcp`, so the rows measure the I/O workers (same-host peers would use
shared memory). For each N it reports, after connecting to all N (`connect_async` to all, then
wait) and one 4 KiB put to each:

- threads: the engine's threads (named hixl-*) and all of this process's;
- RSS of this process, and its CPU while idle (no transfer for `--idle` seconds);
- connect: milliseconds until all N links are up;
- burst: every peer is written 1 MiB at once; aggregate GB/s and the spread of completion
  times (slowest / fastest);
- raw: the same burst over plain sockets, N clients driven by one epoll loop in this process
  against a sink process that answers each 1 MiB with one byte (an "ack"), measured in the
  same run as the baseline.

With `--initiators M`, the engine is a target instead: M client engines (in helper processes)
connect to it and stay idle; it reports the target's threads and the memory they cost, then
how long a new initiator takes to connect and complete a 4 KiB put.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import time

import numpy as np

import hixl

MIB = 1 << 20
TCP = {"hixl.backends": "tcp"}
# Peers stay light: one I/O worker each (the engine under test keeps its defaults).
PEER = {**TCP, "hixl.tcp.io_threads": "1"}
PER_PROCESS = 32


def raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def threads() -> tuple[int, int]:
    """(threads named hixl-*, all threads) of this process."""
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sum(n.startswith("hixl") for n in names), len(names)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_seconds() -> float:
    return time.process_time()


# ---------------------------------------------------------------- helper processes


def host_peers(count: int) -> None:
    """Runs `count` listening engines, each with a 1 MiB buffer; prints them; waits for EOF."""
    raise_fd_limit()
    engines, out, bufs = [], [], []
    for _ in range(count):
        e = hixl.Hixl()
        e.initialize("127.0.0.1:0", PEER)
        b = np.zeros(MIB, np.uint8)
        e.register(b, name="buf")
        engines.append(e)
        bufs.append(b)
        out.append([e.local_engine, b.ctypes.data])
    print(json.dumps(out), flush=True)
    sys.stdin.read()
    for e in engines:
        e.finalize()


def host_initiators(count: int, target: str) -> None:
    """Runs `count` client engines connected to `target`; prints READY; waits for EOF."""
    raise_fd_limit()
    engines = []
    for _ in range(count):
        e = hixl.Hixl()
        e.initialize("127.0.0.1", PEER)
        e.connect(target, timeout_ms=60_000)
        engines.append(e)
    print("READY", flush=True)
    sys.stdin.read()
    for e in engines:
        e.finalize()


def sink() -> None:
    """Raw baseline's far side: accepts connections on one epoll loop and answers every 1 MiB
    received on a connection with one byte."""
    raise_fd_limit()
    ls = socket.socket()
    ls.bind(("127.0.0.1", 0))
    ls.listen(4096)
    ls.setblocking(False)
    print(ls.getsockname()[1], flush=True)
    sel = selectors.DefaultSelector()
    sel.register(ls, selectors.EVENT_READ)
    sel.register(sys.stdin, selectors.EVENT_READ)
    got: dict[socket.socket, int] = {}
    buf = bytearray(1 << 18)
    while True:
        for key, _ in sel.select():
            obj = key.fileobj
            if obj is sys.stdin:
                return
            if obj is ls:
                while True:
                    try:
                        c, _ = ls.accept()
                    except BlockingIOError:
                        break
                    c.setblocking(False)
                    got[c] = 0
                    sel.register(c, selectors.EVENT_READ)
                continue
            assert isinstance(obj, socket.socket)
            try:
                n = obj.recv_into(buf)
            except BlockingIOError:
                continue
            if n == 0:
                sel.unregister(obj)
                obj.close()
                continue
            got[obj] += n
            while got[obj] >= MIB:
                got[obj] -= MIB
                obj.send(b"k")


def spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, __file__, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        assert p.stdin is not None
        p.stdin.close()
    for p in procs:
        p.wait(timeout=120)


# ---------------------------------------------------------------- measurements


def raw_burst(n: int) -> dict:
    """N plain sockets, one epoll loop here, 1 MiB each at once; each ends with the sink's ack."""
    proc = spawn("--sink")
    assert proc.stdout is not None
    port = int(proc.stdout.readline())
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        s.setblocking(False)
        socks.append(s)
    payload = memoryview(np.ones(MIB, np.uint8).tobytes())
    sel = selectors.DefaultSelector()
    sent = {s: 0 for s in socks}
    done: dict[socket.socket, float] = {}
    t0 = time.perf_counter()
    for s in socks:
        sel.register(s, selectors.EVENT_WRITE | selectors.EVENT_READ)
    while len(done) < n:
        for key, ev in sel.select():
            s = key.fileobj
            assert isinstance(s, socket.socket)
            if ev & selectors.EVENT_WRITE and sent[s] < MIB:
                try:
                    sent[s] += s.send(payload[sent[s] :])
                except BlockingIOError:
                    pass
                if sent[s] >= MIB:
                    sel.modify(s, selectors.EVENT_READ)
            if ev & selectors.EVENT_READ:
                if s.recv(1):
                    done[s] = time.perf_counter() - t0
                    sel.unregister(s)
    times = sorted(done.values())
    for s in socks:
        s.close()
    stop([proc])
    return {"GBps": n * MIB / times[-1] / 1e9, "spread": times[-1] / times[0]}


def initiator_rows(n: int, idle: float) -> dict:
    procs = [spawn("--host-peers", str(min(PER_PROCESS, n - i))) for i in range(0, n, PER_PROCESS)]
    peers: list[tuple[str, int]] = []
    for p in procs:
        assert p.stdout is not None
        peers += [(eid, addr) for eid, addr in json.loads(p.stdout.readline())]
    hixl_before, _ = threads()
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", TCP)
    src = np.ones(MIB, np.uint8)
    e.register(src)
    t0 = time.perf_counter()
    for eid, _ in peers:
        e.connect_async(eid)
    ok = hixl.AsyncConnectStatus.CONNECTED
    waiting = [eid for eid, _ in peers]
    while waiting:
        waiting = [eid for eid in waiting if e.get_async_connect_status(eid) != ok]
        if waiting:
            time.sleep(0.0005)
    connect_ms = (time.perf_counter() - t0) * 1e3
    for eid, addr in peers:
        e.put(eid, src.ctypes.data, addr, 4096)
    hixl_threads, all_threads = threads()
    c0, w0 = cpu_seconds(), time.perf_counter()
    time.sleep(idle)
    idle_cpu = (cpu_seconds() - c0) / (time.perf_counter() - w0) * 100
    w = hixl.TransferOp.WRITE
    reqs = [
        e.transfer_async(eid, w, [hixl.TransferOpDesc(src.ctypes.data, addr, MIB)])
        for eid, addr in peers
    ]
    tel = []
    for r in reqs:
        r.wait()
        r.result()
        tel.append(r.telemetry())
    # Completion times from the request telemetry (submission + duration), measured from the
    # first submission: waiting here never delays what is measured.
    start = min(t["start_unix_us"] for t in tel)
    times = sorted(t["start_unix_us"] + t["duration_us"] - start for t in tel)
    row = {
        "peers": n,
        "hixl_threads": hixl_threads - hixl_before,
        "process_threads": all_threads,
        "rss_MiB": rss_mib(),
        "idle_cpu_pct": idle_cpu,
        "connect_ms": connect_ms,
        "burst_GBps": n * MIB / times[-1] / 1e3,
        "burst_spread": times[-1] / times[0],
    }
    e.finalize()
    stop(procs)
    raw = raw_burst(n)
    row["raw_burst_GBps"] = raw["GBps"]
    row["raw_burst_spread"] = raw["spread"]
    row["burst_x_raw"] = row["burst_GBps"] / raw["GBps"]
    return row


def target_rows(m: int) -> dict:
    e = hixl.Hixl()
    # Every initiator comes from 127.0.0.1: lift the per-source cap on handshakes under way
    # (which guards against floods from one address) so that 32 processes may connect at once.
    caps = {"hixl.max_pending_per_source": "4096", "hixl.max_pending_handshakes": "4096"}
    e.initialize("127.0.0.1:0", {**TCP, **caps})
    dst = np.zeros(MIB, np.uint8)
    e.register(dst)
    hixl_before, _ = threads()
    rss_before = rss_mib()
    t0 = time.perf_counter()
    procs = [
        spawn("--host-initiators", str(min(PER_PROCESS, m - i)), e.local_engine)
        for i in range(0, m, PER_PROCESS)
    ]
    for p in procs:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "READY"
    connect_all_s = time.perf_counter() - t0
    time.sleep(1)
    hixl_threads, all_threads = threads()
    row = {
        "initiators": m,
        "target_hixl_threads": hixl_threads,
        "target_rss_added_MiB": rss_mib() - rss_before,
        "connect_all_s": connect_all_s,
    }
    newcomer = hixl.Hixl()
    newcomer.initialize("127.0.0.1", TCP)
    src = np.ones(4096, np.uint8)
    newcomer.register(src)
    t0 = time.perf_counter()
    newcomer.connect(e.local_engine)
    newcomer.put(e.local_engine, src.ctypes.data, dst.ctypes.data, 4096)
    row["newcomer_connect_put_ms"] = (time.perf_counter() - t0) * 1e3
    assert bytes(dst[:4096]) == bytes(src)
    newcomer.finalize()
    stop(procs)
    e.finalize()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--peers", default="1,16,64,256", help="comma-separated peer counts")
    ap.add_argument("--idle", type=float, default=2.0, help="seconds of idle CPU measurement")
    ap.add_argument(
        "--initiators", type=int, default=0, help="also run the target test with M initiators"
    )
    ap.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--host-peers", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--host-initiators", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--sink", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.host_peers:
        return host_peers(a.host_peers)
    if a.host_initiators:
        return host_initiators(int(a.host_initiators[0]), a.host_initiators[1])
    if a.sink:
        return sink()
    raise_fd_limit()
    rows = []
    print(
        f"{'peers':>5} {'threads':>7} {'proc thr':>8} {'RSS MiB':>8} {'idle CPU%':>9} "
        f"{'connect ms':>10} {'burst GB/s':>10} {'raw GB/s':>8} {'x raw':>6} "
        f"{'spread':>6} {'raw spr':>7}"
    )
    for n in [int(x) for x in a.peers.split(",")]:
        r = initiator_rows(n, a.idle)
        rows.append(r)
        print(
            f"{n:5d} {r['hixl_threads']:7d} {r['process_threads']:8d} {r['rss_MiB']:8.0f} "
            f"{r['idle_cpu_pct']:9.2f} {r['connect_ms']:10.1f} {r['burst_GBps']:10.2f} "
            f"{r['raw_burst_GBps']:8.2f} {r['burst_x_raw']:6.2f} {r['burst_spread']:6.1f} "
            f"{r['raw_burst_spread']:7.1f}",
            flush=True,
        )
    if a.initiators:
        t = target_rows(a.initiators)
        rows.append(t)
        print(
            f"target with {t['initiators']} idle initiators: "
            f"{t['target_hixl_threads']} hixl threads, "
            f"+{t['target_rss_added_MiB']:.0f} MiB RSS; a new initiator connected and put 4 KiB in "
            f"{t['newcomer_connect_put_ms']:.1f} ms"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
