"""A target engine for tests/test_security.py, driven over stdin/stdout.

Start: python _sec_engine.py OPTIONS_JSON. Listens on 127.0.0.1:0, registers a 64 KiB
read-write buffer and prints "READY <engine> <buf_addr>". Commands, one line each, answered
by one line:
  register_many N [PAUSE_MS [NAME_BYTES]]
                    registers N more 4 KiB regions one by one (PAUSE_MS apart; each named
                    with a unique name NAME_BYTES long when given, so that each region-table
                    delta carries that many bytes more) and prints
                    "DONE N MAX_S" (the slowest call, in seconds); a call that takes over 5 s
                    prints "STUCK I SECONDS" and the process exits
  deregister        deregisters the first buffer: "OK SECONDS" or "ERR SECONDS MESSAGE"
  notifies          get_notifies() as JSON [[name, len(msg)], ...]
  exit              -> OK
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import numpy as np

import hixl


def register_many(e: hixl.Hixl, n: int, pause_s: float, name_bytes: int, keep: list[object]) -> str:
    block = hixl.aligned_empty(n * 4096)
    keep.append(block)
    state = {"i": 0, "t0": time.monotonic(), "done": False}

    def watchdog() -> None:
        while not state["done"]:
            time.sleep(0.2)
            took = time.monotonic() - float(state["t0"])
            if not state["done"] and took > 5:
                print(f"STUCK {state['i']} {took:.1f}", flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    worst = 0.0
    for i in range(n):
        state["i"], state["t0"] = i, time.monotonic()
        name = f"{len(keep)}-{i}".ljust(name_bytes, "x") if name_bytes else None
        keep.append(e.register(block[i * 4096 : (i + 1) * 4096], name=name))
        worst = max(worst, time.monotonic() - float(state["t0"]))
        if pause_s:
            time.sleep(pause_s)
    state["done"] = True
    return f"DONE {n} {worst:.3f}"


def main() -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", json.loads(sys.argv[1]) if len(sys.argv) > 1 else None)
    buf = np.zeros(64 * 1024, np.uint8)
    handle = e.register(buf)
    keep: list[object] = []
    print(f"READY {e.local_engine} {buf.ctypes.data}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "register_many":
            pause_s = float(args[1]) / 1000 if len(args) > 1 else 0.0
            name_bytes = int(args[2]) if len(args) > 2 else 0
            print(register_many(e, int(args[0]), pause_s, name_bytes, keep), flush=True)
        elif cmd == "deregister":
            t0 = time.monotonic()
            try:
                e.deregister_mem(handle)
                print(f"OK {time.monotonic() - t0:.3f}", flush=True)
            except hixl.HixlError as x:
                print(f"ERR {time.monotonic() - t0:.3f} {x}", flush=True)
        elif cmd == "notifies":
            print(json.dumps([[n.name, len(n.msg)] for n in e.get_notifies()]), flush=True)
        elif cmd == "exit":
            e.finalize()
            print("OK", flush=True)
            return


if __name__ == "__main__":
    main()
