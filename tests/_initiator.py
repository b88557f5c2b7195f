"""An initiator in its own process (run by the tests with reduced privileges).

python _initiator.py PEER REMOTE_ADDR SIZE: connects under hixl.backends=auto and =shm and
prints one JSON object: the backend chosen under auto, whether the bytes written under auto
arrived (read back), and the exception raised under forced shm.
"""

from __future__ import annotations

import json
import sys

import numpy as np

import hixl


def main() -> None:
    peer, raddr, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    out: dict[str, object] = {}
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "auto"})
        src = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
        back = np.zeros(size, np.uint8)
        e.register(src)
        e.register(back)
        e.connect(peer, timeout_ms=5000)
        out["auto_backend"] = e.stats()[peer]["backend"]
        e.transfer_sync(peer, hixl.TransferOp.WRITE, [(src.ctypes.data, raddr, size)], 10_000)
        e.transfer_sync(peer, hixl.TransferOp.READ, [(back.ctypes.data, raddr, size)], 10_000)
        out["auto_bytes_ok"] = bool(np.array_equal(src, back))
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "shm"})
        try:
            e.connect(peer, timeout_ms=5000)
            out["shm_error"] = None
        except hixl.HixlError as x:
            out["shm_error"] = [type(x).__name__, x.code, str(x)]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
