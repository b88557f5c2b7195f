"""A target for the amplification tests: one 8 MiB read-write region, filled with a known
pattern, registered with an engine that serves TCP.

Start: python _amplify_target.py OPTIONS_JSON. Prints "READY <engine> <addr> <len>".
Commands: "dump PATH" writes the region to PATH -> OK; "exit" -> OK.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import hixl

REGION = 8 << 20


def pattern(n: int = REGION) -> np.ndarray:
    return (np.arange(n, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)


def main() -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", json.loads(sys.argv[1]) if len(sys.argv) > 1 else None)
    buf = hixl.aligned_empty(REGION)
    buf[:] = pattern()
    e.register(buf)
    print(f"READY {e.local_engine} {buf.ctypes.data} {REGION}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "dump":
            buf.tofile(args[0])
        elif cmd == "exit":
            e.finalize()
            print("OK", flush=True)
            return
        print("OK", flush=True)


if __name__ == "__main__":
    main()
