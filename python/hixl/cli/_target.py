"""The passive side of ``hixl bench``: an engine with one registered buffer, and a stats cell.

The target runs no code per transfer. Besides the data buffer it registers a 4 KiB *cell* that
it refreshes every few milliseconds with its own CPU time, so an initiator on any host can read
the target's CPU cost one-sidedly; the cell also names the target's pid, host and the port of a
raw TCP sink (native code) used by ``--baseline``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import Hixl, aligned_empty
from .._hixl import _raw_tcp_sink, cuda_alloc
from ._machine import host_hash
from ._sizes import human

CELL_BYTES = 4096
MAGIC = 0x48494C5842454E43  # "CNEBXLIH": a hixl bench cell
_REFRESH_S = 0.005


@dataclass(frozen=True)
class Cell:
    """The decoded stats cell of a target."""

    cpu_s: float
    pid: int
    sink_port: int
    host_hash: int
    data_len: int

    @classmethod
    def decode(cls, words: np.ndarray) -> Cell:
        if int(words[0]) != MAGIC:
            raise ValueError(f"not a hixl bench target (cell magic 0x{int(words[0]):x})")
        return cls(int(words[1]) / 1e9, int(words[2]), int(words[3]), int(words[4]), int(words[5]))


def serve(
    listen: str,
    mem_bytes: int,
    options: dict[str, str],
    until_stdin_closes: bool,
    mem: str = "host",
) -> int:
    """Serves until stdin closes (when started by a local bench) or SIGINT/SIGTERM. `mem`:
    "host", or "cuda:N" for a data buffer in that device's memory."""
    # Never the cell's length: initiators tell the two regions apart by it.
    mem_bytes = max(mem_bytes, 2 * CELL_BYTES)
    e = Hixl()
    e.initialize(listen, options)
    cell = aligned_empty(CELL_BYTES // 8, np.uint64)
    cell[:] = 0
    data: Any
    if mem == "host":
        data = aligned_empty(mem_bytes, np.uint8, alignment=2 << 20)
        data[:] = 1  # touch every page before anything is timed
    else:
        data = cuda_alloc(mem_bytes, int(mem[5:]), fill=1)
    e.register(cell)
    e.register(data)
    host = listen.rsplit(":", 1)[0]
    sink_port = int(_raw_tcp_sink(f"{host}:0").rsplit(":", 1)[1])
    cell[1:6] = [time.process_time_ns(), os.getpid(), sink_port, host_hash(), mem_bytes]
    cell[0] = MAGIC
    stop = threading.Event()
    print(f"READY {e.local_engine}", flush=True)
    if until_stdin_closes:

        def wait_for_eof() -> None:
            sys.stdin.read()
            stop.set()

        threading.Thread(target=wait_for_eof, daemon=True).start()
    else:
        print(
            f"hixl bench target on {e.local_engine}: {human(mem_bytes)} registered; "
            f"run 'hixl bench --role initiator --remote {e.local_engine}' elsewhere; "
            "Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(_REFRESH_S):
            cell[1] = time.process_time_ns()
    except KeyboardInterrupt:
        pass
    e.finalize()
    return 0
