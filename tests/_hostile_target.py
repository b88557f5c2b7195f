"""A target for the hostile-client tests: one buffer laid out as
[guard | read-write region | guard | read-only region | guard], all filled with a known
pattern; only the two regions are registered (the second with access="r").

Start: python _hostile_target.py OPTIONS_JSON. Prints "READY <engine> <rw_addr> <ro_addr>
<region_len> <guard_len>". Commands: "dump PATH" writes the whole buffer to PATH -> OK;
"exit" -> OK.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import hixl

GUARD = 4096
REGION = 64 * 1024


def pattern() -> np.ndarray:
    return (np.arange(3 * GUARD + 2 * REGION, dtype=np.uint64) * 2654435761 >> 13).astype(np.uint8)


def main() -> None:
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", json.loads(sys.argv[1]) if len(sys.argv) > 1 else None)
    buf = hixl.aligned_empty(3 * GUARD + 2 * REGION)
    buf[:] = pattern()
    rw = buf[GUARD : GUARD + REGION]
    ro = buf[2 * GUARD + REGION : 2 * GUARD + 2 * REGION]
    e.register(rw)
    e.register(ro, access="r")
    print(f"READY {e.local_engine} {rw.ctypes.data} {ro.ctypes.data} {REGION} {GUARD}", flush=True)
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
