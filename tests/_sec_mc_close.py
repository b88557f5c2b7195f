"""A hixl.mooncake TransferEngine with one managed buffer whose ``close()`` pauses at the entry
of its engine's finalize, for tests/test_security_mooncake_close.py.

python _sec_mc_close.py MODE SIZE        (MODE: ok, or fail: the probe's finalize then raises)

Prints ``READY <rpc port> <managed buffer address>``, then answers, one line each:
``close`` -> calls close(); at finalize's entry prints ``FINALIZING alive=<0|1> reused=<0|1>``
(whether the managed buffer is still alive, and whether a fresh bytearray of its size took its
address), waits for a line (the peer WRITEs meanwhile), prints ``FRESH <sha256 of that
bytearray> MANAGED <sha256 of the managed buffer, or freed>``, finalizes (or raises, in fail
mode) and prints ``CLOSED`` or ``CLOSE-FAILED``;
``gc`` -> collects garbage and prints ``alive=<0|1> reused=<0|1>`` as above;
``dump`` -> the SHA-256 of the managed buffer (``freed`` when it is not alive); ``exit``.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import sys
import weakref
from typing import Any

from hixl.mooncake import TransferEngine

KEEP: list[bytearray] = []


def sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def main() -> None:
    mode, size = sys.argv[1], int(sys.argv[2])
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    addr = te.allocate_managed_buffer(size)
    ref = weakref.ref(te._managed[addr][0])
    real = te._engine

    def probe() -> str:
        fresh = bytearray(size)  # takes the buffer's block if that was freed
        KEEP.append(fresh)
        at = ctypes.addressof((ctypes.c_char * size).from_buffer(fresh))
        return f"alive={int(ref() is not None)} reused={int(at == addr)}"

    class Paused:
        """The engine, with a pause at the entry of finalize."""

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def finalize(self) -> None:
            print("FINALIZING", probe(), flush=True)
            sys.stdin.readline()
            managed = sha(ctypes.string_at(addr, size)) if ref() is not None else "freed"
            print("FRESH", sha(bytes(KEEP[-1])), "MANAGED", managed, flush=True)
            if mode == "fail":
                raise RuntimeError("probe: finalize failed")
            assert real is not None
            real.finalize()

    te._engine = Paused()  # type: ignore[assignment]
    print(f"READY {te.get_rpc_port()} {addr}", flush=True)
    for line in sys.stdin:
        word = line.strip()
        if word == "close":
            try:
                te.close()
                print("CLOSED", flush=True)
            except RuntimeError:
                print("CLOSE-FAILED", flush=True)
        elif word == "gc":
            gc.collect()
            print(probe(), flush=True)
        elif word == "dump":
            print(sha(ctypes.string_at(addr, size)) if ref() is not None else "freed", flush=True)
        elif word == "exit":
            break


if __name__ == "__main__":
    main()
