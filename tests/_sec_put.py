"""An initiator in its own process, for tests/test_security.py (a crash here must not take the
test runner with it).

python _sec_put.py PEER REMOTE_ADDR LEN: connects (hixl.backends=auto), puts LEN bytes at
REMOTE_ADDR and prints "PUT1 <backend> <direct_parts>"; then waits for a line "go" on stdin,
puts 20 more times (errors are counted, not fatal) and prints "DONE <ok> <errors>".
"""

from __future__ import annotations

import sys

import numpy as np

import hixl


def main() -> None:
    peer, raddr, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with hixl.Hixl() as e:
        e.initialize("127.0.0.1", {"hixl.backends": "auto"})
        src = np.full(n, 0x5A, np.uint8)
        e.register(src)
        e.connect(peer, timeout_ms=5000)
        e.put(peer, src.ctypes.data, raddr, n, timeout_ms=5000)
        st = e.stats()[peer]
        print(f"PUT1 {st['backend']} {st['direct_parts']}", flush=True)
        sys.stdin.readline()
        ok = errors = 0
        for _ in range(20):
            try:
                e.put(peer, src.ctypes.data, raddr, n, timeout_ms=2000)
                ok += 1
            except hixl.HixlError:
                errors += 1
        print(f"DONE {ok} {errors}", flush=True)


if __name__ == "__main__":
    main()
