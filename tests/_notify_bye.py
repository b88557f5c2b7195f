"""A target that finalizes the moment it has a notification, round after round.

Start: python _notify_bye.py; it prints "READY". For each line "round" on stdin it starts an
engine and prints "ENGINE <engine>", waits (30 s at most) for a notification named "bye",
calls finalize at once, and prints "GOT <how many it got>" (or "ERR <message>").
"""

from __future__ import annotations

import sys

import hixl


def main() -> None:
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "round":
            break
        e = hixl.Hixl()
        e.initialize("127.0.0.1:0")
        print(f"ENGINE {e.local_engine}", flush=True)
        try:
            got = e.wait_notifies(30_000, "bye")
        except hixl.HixlError as x:
            e.finalize()
            print(f"ERR {x}", flush=True)
            continue
        e.finalize()
        print(f"GOT {len(got)}", flush=True)


if __name__ == "__main__":
    main()
