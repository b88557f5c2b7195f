"""A target engine in its own process, driven over stdin/stdout by the tests.

Start: python _peer.py SIZE [OPTIONS_JSON] (listening on $HIXL_TEST_LISTEN, default
127.0.0.1:0). It registers a zeroed SIZE-byte buffer and prints
"READY <engine> <buf_addr>". Commands (one per line), each answered by one line:
  save OFF LEN PATH   write buf[OFF:OFF+LEN] to PATH            -> OK
  fill SEED           fill the buffer with random bytes          -> OK
  zero                zero the buffer                            -> OK
  notifies            get_notifies() as JSON [[name, msg], ...]  -> JSON
  register_named NAME SIZE
                      register a fresh zeroed SIZE-byte buffer under NAME
                                                                 -> <addr> | ERR <message>
  save_named NAME PATH  write that buffer to PATH                -> OK
  deregister_named NAME deregister it (the buffer stays alive)   -> OK
  map_named NAME SIZE   mmap a fresh SIZE-byte anonymous mapping and register it under NAME
                                                                 -> <addr>
  unmap_named NAME      munmap it, leaving it registered          -> OK
  protect_named NAME    mprotect it PROT_NONE, leaving it registered -> OK
  exit                finalize and exit                          -> OK
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

import numpy as np

import hixl


def main() -> None:
    if os.environ.get("HIXL_TEST_NONDUMPABLE") == "1":
        # Only processes with CAP_SYS_PTRACE may now read or write this one's memory.
        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    size = int(sys.argv[1])
    options = json.loads(sys.argv[2]) if len(sys.argv) > 2 else None
    e = hixl.Hixl()
    e.initialize(os.environ.get("HIXL_TEST_LISTEN", "127.0.0.1:0"), options)
    buf = np.zeros(size, np.uint8)
    e.register(buf)
    named: dict[str, tuple[np.ndarray, hixl.MemHandle]] = {}
    kept: list[np.ndarray] = []  # deregistered buffers stay alive
    mapped: dict[str, tuple[int, int]] = {}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, *[ctypes.c_int] * 3, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    print(f"READY {e.local_engine} {buf.ctypes.data}", flush=True)
    for line in sys.stdin:
        cmd, *args = line.split()
        if cmd == "save":
            off, n, path = int(args[0]), int(args[1]), args[2]
            buf[off : off + n].tofile(path)
            print("OK", flush=True)
        elif cmd == "fill":
            buf[:] = np.random.default_rng(int(args[0])).integers(0, 256, size, dtype=np.uint8)
            print("OK", flush=True)
        elif cmd == "zero":
            buf[:] = 0
            print("OK", flush=True)
        elif cmd == "notifies":
            print(json.dumps([[n.name, n.msg] for n in e.get_notifies()]), flush=True)
        elif cmd == "register_named":
            b = np.zeros(int(args[1]), np.uint8)
            try:
                named[args[0]] = (b, e.register(b, name=args[0]))
                print(b.ctypes.data, flush=True)
            except hixl.HixlError as x:
                print(f"ERR {x}", flush=True)
        elif cmd == "save_named":
            named[args[0]][0].tofile(args[1])
            print("OK", flush=True)
        elif cmd == "deregister_named":
            b, h = named.pop(args[0])
            e.deregister_mem(h)
            kept.append(b)
            print("OK", flush=True)
        elif cmd == "map_named":
            n = int(args[1])
            addr = libc.mmap(None, n, 3, 0x22, -1, 0)  # PROT_READ|WRITE, MAP_PRIVATE|ANONYMOUS
            e.register_mem(hixl.MemDesc(addr, n), name=args[0])
            mapped[args[0]] = (addr, n)
            print(addr, flush=True)
        elif cmd in ("unmap_named", "protect_named"):
            addr, n = mapped[args[0]]
            rc = libc.munmap(addr, n) if cmd == "unmap_named" else libc.mprotect(addr, n, 0)
            print("OK" if rc == 0 else f"ERR errno {ctypes.get_errno()}", flush=True)
        elif cmd == "exit":
            e.finalize()
            print("OK", flush=True)
            return


if __name__ == "__main__":
    main()
