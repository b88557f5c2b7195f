"""A CUDA target engine in its own process, driven over stdin/stdout by tests/test_cuda.py and
scripts/gpu_check.py (needs a GPU).

Start: python _cuda_peer.py SIZE [OPTIONS_JSON]. It registers three regions of SIZE bytes,
all zeroed: "dev" (device memory from hixl.cuda_alloc on cuda:0), "pinnable" (host memory
from Hixl.alloc: a memfd that device memory may reach) and "plain" (a numpy array: host memory
that only host memory may reach), then prints one JSON line
{"engine": ..., "dev": addr, "pinnable": addr, "plain": addr}. Commands, one line each, each
answered by one line:
  fill REGION SEED       random bytes (numpy default_rng(SEED)) into the region   -> OK
  save REGION PATH       the region's bytes into PATH                            -> OK
  deregister REGION      deregister it (waits for same-host peers to confirm)   -> OK | ERR msg
  exit                   finalize and exit                                       -> OK
"""

from __future__ import annotations

import json
import sys

import numpy as np

import hixl


def main() -> None:
    size = int(sys.argv[1])
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    e = hixl.Hixl()
    e.initialize("127.0.0.1:0", options)
    dev = hixl.cuda_alloc(size, 0)
    handles = {"dev": e.register(dev, name="dev")}
    pinnable = e.alloc(size, name="pinnable")[:size]
    plain = np.zeros(size, np.uint8)
    e.register(plain, name="plain")
    host = {"pinnable": pinnable, "plain": plain}
    addrs = {
        "dev": dev.addr,
        "pinnable": int(pinnable.ctypes.data),
        "plain": int(plain.ctypes.data),
    }
    print(json.dumps({"engine": e.local_engine, **addrs}), flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "fill":
            data = np.random.default_rng(int(args[1])).integers(0, 256, size, dtype=np.uint8)
            if args[0] == "dev":
                dev.write(0, data.tobytes())
            else:
                host[args[0]][:] = data
        elif cmd == "save":
            raw = dev.read(0, size) if args[0] == "dev" else host[args[0]].tobytes()
            with open(args[1], "wb") as f:
                f.write(raw)
        elif cmd == "deregister":
            try:
                e.deregister_mem(handles.pop(args[0]))
            except hixl.HixlError as x:
                print(f"ERR {x}", flush=True)
                continue
        elif cmd == "exit":
            e.finalize()
            print("OK", flush=True)
            return
        print("OK", flush=True)


if __name__ == "__main__":
    main()
