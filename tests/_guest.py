"""An initiator engine in its own process, driven over stdin/stdout by tests/test_guest.py
(so that the test can SIGSTOP it, pin it, or load it).

Start: python _guest.py PEER_ENGINE PEER_ADDR SIZE [OPTIONS_JSON]. It initializes (127.0.0.1),
registers a SIZE-byte buffer, connects to the peer, and prints "READY". Commands (one per line),
each answered by one line:
  put                 one SIZE-byte write to the peer (30 s timeout)  -> OK | ERR <type> <msg>
  warm                writes the buffer to the peer in 4 MiB pieces, one at a time (so that
                      the peer's pages are touched before a test's big write) -> OK | ERR ...
  start               submits one SIZE-byte write to the peer and returns at once (30 s
                      timeout)                                        -> OK | ERR <type> <msg>
  finish              waits for the write `start` submitted           -> OK | ERR <type> <msg>
  status              the status of the write `start` submitted       -> WAITING | COMPLETED | ...
  alive               whether the link to the peer is alive           -> True | False
  pin CPU             pins the main thread to CPU (sched_setaffinity) -> OK
  threads             this process's hixl threads and where they may run, as JSON
                      {"<tid> <name>": "<Cpus_allowed_list>"}          -> JSON
  busy CPU            pins every thread of the process to CPU and starts two busy threads
                      there: one holds the GIL in a Python loop, one hashes (GIL released)
                                                                      -> OK
  cpus                the engine's CPU set (Hixl.cpus())               -> JSON
  pythreads           starts hixl's metrics server, then lists hixl's Python threads (named
                      hixl-*) and where they may run, as JSON like `threads` -> JSON
  exit                finalize and exit                               -> OK
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import numpy as np

import hixl
import hixl.metrics


def hixl_threads() -> dict[str, str]:
    """Every thread of this process whose name starts with 'hixl' and its allowed CPUs."""
    out = {}
    for task in Path("/proc/self/task").iterdir():
        try:
            status = (task / "status").read_text()
        except OSError:
            continue  # ended meanwhile
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        name = fields.get("Name", "").strip()
        if name.startswith("hixl"):
            out[f"{task.name} {name}"] = fields["Cpus_allowed_list"].strip()
    return out


def spin_python(cpu: set[int]) -> None:
    os.sched_setaffinity(0, cpu)
    n = 0
    while True:
        n += 1


def spin_hash(cpu: set[int]) -> None:
    os.sched_setaffinity(0, cpu)
    data = bytes(1 << 20)
    while True:
        hashlib.sha256(data).digest()


def main() -> None:
    peer, addr, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    e = hixl.Hixl()
    e.initialize("127.0.0.1", {"hixl.backends": "tcp", **options})  # options may say shm
    buf = np.random.default_rng(7).integers(0, 256, size, dtype=np.uint8)
    e.register(buf)
    e.connect(peer, timeout_ms=10_000)
    servers: list[hixl.metrics.MetricsServer] = []
    print("READY", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "put":
            try:
                e.transfer_sync(
                    peer, hixl.TransferOp.WRITE, [(buf.ctypes.data, addr, size)], 30_000
                )
                print("OK", flush=True)
            except hixl.HixlError as x:
                print(f"ERR {type(x).__name__} {x}".replace("\n", " "), flush=True)
        elif cmd == "warm":
            try:
                step = 4 << 20
                for off in range(0, size, step):
                    n = min(step, size - off)
                    desc = [(buf.ctypes.data + off, addr + off, n)]
                    e.transfer_sync(peer, hixl.TransferOp.WRITE, desc, 30_000)
                print("OK", flush=True)
            except hixl.HixlError as x:
                print(f"ERR {type(x).__name__} {x}".replace("\n", " "), flush=True)
        elif cmd == "start":
            try:
                desc = [(buf.ctypes.data, addr, size)]
                started = e.transfer_async(peer, hixl.TransferOp.WRITE, desc, timeout_ms=30_000)
                print("OK", flush=True)
            except hixl.HixlError as x:
                print(f"ERR {type(x).__name__} {x}".replace("\n", " "), flush=True)
        elif cmd == "finish":
            try:
                started.wait(timeout_ms=30_000)
                started.result()
                print("OK", flush=True)
            except hixl.HixlError as x:
                print(f"ERR {type(x).__name__} {x}".replace("\n", " "), flush=True)
        elif cmd == "status":
            print(started.status().name, flush=True)
        elif cmd == "alive":
            print(e.stats()[peer]["alive"], flush=True)
        elif cmd == "pin":
            os.sched_setaffinity(0, {int(args[0])})
            print("OK", flush=True)
        elif cmd == "threads":
            print(json.dumps(hixl_threads()), flush=True)
        elif cmd == "pythreads":
            servers.append(hixl.metrics.serve(e))
            out = {}
            for t in threading.enumerate():
                if t.name.startswith("hixl") and t.native_id is not None:
                    status = Path(f"/proc/self/task/{t.native_id}/status").read_text()
                    line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
                    out[f"{t.native_id} {t.name}"] = line.split(":", 1)[1].strip()
            print(json.dumps(out), flush=True)
        elif cmd == "busy":
            cpu = {int(args[0])}
            for task in Path("/proc/self/task").iterdir():
                os.sched_setaffinity(int(task.name), cpu)
            for target in (spin_python, spin_hash):
                threading.Thread(target=target, args=(cpu,), daemon=True).start()
            print("OK", flush=True)
        elif cmd == "cpus":
            print(json.dumps(sorted(e.cpus())), flush=True)
        elif cmd == "exit":
            for m in servers:
                m.close()
            e.finalize()
            print("OK", flush=True)
            return


if __name__ == "__main__":
    main()
