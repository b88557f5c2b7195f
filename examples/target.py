"""The target side of the README's basic flow: registers a buffer named "kv" and waits.

It runs no code per transfer: initiator.py reads and writes "kv" one-sidedly. The target only
waits for notifications until one named "done" arrives, whose message is the sha256 the
initiator expects "kv" to hold; the target checks its own bytes against it.

    python examples/target.py --listen 127.0.0.1:18001 &
    python examples/initiator.py --remote 127.0.0.1:18001

Prints "READY ip:port" once it listens (port 0 picks a free one), one line per
notification, and exits 0 when the bytes match, 1 when they do not or nothing came in time.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time

import hixl


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--listen", default="127.0.0.1:0", help="ip:port to listen on (port 0: any)")
    p.add_argument("--size", type=int, default=16 << 20, help="bytes of the region 'kv'")
    p.add_argument("--timeout-s", type=float, default=60.0, help="longest wait for 'done'")
    args = p.parse_args()

    with hixl.Hixl() as t:  # finalized on exit
        t.initialize(args.listen)  # "ip:port" listens
        kv = hixl.aligned_empty(args.size)  # strided transfers need 64-byte aligned bases
        kv[:] = 0
        h = t.register(kv, name="kv")  # any writable C-contiguous buffer or torch CPU tensor
        print(f"registered 'kv': {h.len} bytes at {h.addr:#x}")
        print(f"READY {t.local_engine}", flush=True)

        # Wait for "done", printing every notification on the way: wait_notifies blocks (GIL
        # released, Ctrl-C honoured) until some are pending and returns them; with name="done"
        # it would wait for that one alone and leave the others pending.
        deadline = time.monotonic() + args.timeout_s
        done = None
        while done is None:
            left_ms = max(0.0, deadline - time.monotonic()) * 1000
            try:
                arrived = t.wait_notifies(timeout_ms=left_ms)
            except hixl.Timeout:
                print(f"no 'done' notification within {args.timeout_s} s", file=sys.stderr)
                return 1
            for n in arrived:
                print(f"notify {n.name}: {n.msg}", flush=True)
                if n.name == "done":
                    done = n.msg

        have = hashlib.sha256(kv.tobytes()).hexdigest()
        if have != done:
            print(f"'kv' holds sha256 {have}, the initiator expected {done}", file=sys.stderr)
            return 1
        print(f"'kv' holds what the initiator wrote (sha256 {have[:16]}...)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
