"""Each rank's directory: its rank, role and caches, published in a registered buffer.

Peers read it one-sidedly (a hixl READ; the owner runs no code for it) at link time and
again whenever they look for a cache they do not know yet. A sequence number makes the read
consistent: the owner makes it odd while it rewrites the buffer and even again afterwards; a
reader that sees an odd or changed number reads again.

Peers may only READ a directory: it is registered with access="r", so a peer (even one with
the cluster secret) cannot rewrite it to send other ranks to the wrong regions. The reader's
scratch buffer is read-only for peers too (a READ into local memory needs only the local
registration), and its length differs from a directory's, so that a peer looking for this
rank's directory never mistakes a copy of another directory in the scratch for it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._errors import HixlError, ParamInvalid
from .._hixl import Hixl
from .._layout import aligned_empty
from ._cache import CacheInfo
from ._errors import LLM_CACHE_NOT_FOUND, LLM_NOT_LINKED, LLMError

#: Registered length of a directory; peers find the directory among a rank's regions by this
#: length and the magic number.
DIR_BYTES = (1 << 20) + 4096
#: Registered length of a reader's scratch buffer: anything but DIR_BYTES (see above).
SCRATCH_BYTES = DIR_BYTES + 4096
MAGIC = 0x5249444C5849480A  # "\nHXLDIR": a hixl directory
HEADER = 64


@dataclass
class Directory:
    """This rank's own directory, registered with its engine."""

    engine: Hixl
    rank: int
    role: str
    caches: dict[str, CacheInfo] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.buf = aligned_empty(DIR_BYTES, np.uint8)
        self.buf[:] = 0
        self.words = self.buf[:HEADER].view(np.uint64)
        self.handle = self.engine.register(self.buf, access="r")  # peers may only read it
        self.publish()

    def publish(self) -> None:
        doc = {
            "rank": self.rank,
            "role": self.role,
            "caches": [c.to_json() for c in self.caches.values()],
        }
        body = json.dumps(doc, separators=(",", ":")).encode()
        if len(body) > DIR_BYTES - HEADER:
            raise ParamInvalid(
                f"too many caches: the directory needs {len(body)} bytes, "
                f"holds {DIR_BYTES - HEADER}"
            )
        with self.lock:
            self.words[1] += 1  # odd: being rewritten
            self.buf[HEADER : HEADER + len(body)] = np.frombuffer(body, np.uint8)
            self.words[2] = len(body)
            self.words[0] = MAGIC
            self.words[1] += 1  # even: stable

    def add(self, info: CacheInfo) -> None:
        if info.name in self.caches:
            raise ParamInvalid(
                f"a cache named {info.name!r} is already allocated on rank {self.rank}"
            )
        self.caches[info.name] = info
        self.publish()

    def remove(self, name: str) -> None:
        self.caches.pop(name, None)
        self.publish()


@dataclass
class PeerDirectory:
    """What this rank knows of a linked peer."""

    address: str
    rank: int
    role: str
    dir_addr: int
    caches: dict[str, CacheInfo]


class DirectoryReader:
    """Reads peers' directories through one local registered scratch buffer."""

    def __init__(self, engine: Hixl) -> None:
        self.engine = engine
        self.buf = aligned_empty(SCRATCH_BYTES, np.uint8)
        # Only this engine's GETs land here; peers have no reason to write it.
        self.handle = engine.register(self.buf, access="r")
        self.lock = threading.Lock()

    def locate(self, address: str) -> int:
        candidates = [m.addr for m in self.engine.remote_mems(address) if m.len == DIR_BYTES]
        for addr in candidates:
            with self.lock:
                self.engine.get(address, self.buf.ctypes.data, addr, HEADER, 5000)
                if int(self.buf[:HEADER].view(np.uint64)[0]) == MAGIC:
                    return addr
        raise LLMError(
            LLM_CACHE_NOT_FOUND,
            f"{address} publishes no hixl KV-cache directory (is it a hixl.init() process?)",
        )

    def read(self, address: str, dir_addr: int, timeout_s: float = 5.0) -> bytes:
        """The directory's JSON body, read consistently (see the sequence number above)."""
        base = self.buf.ctypes.data
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                self.engine.get(address, base, dir_addr, HEADER, 5000)
                w = self.buf[:HEADER].view(np.uint64)
                seq, n = int(w[1]), int(w[2])
                if seq % 2 == 0 and 0 < n <= DIR_BYTES - HEADER:
                    self.engine.get(address, base + HEADER, dir_addr + HEADER, n, 5000)
                    body = self.buf[HEADER : HEADER + n].tobytes()
                    self.engine.get(address, base, dir_addr, HEADER, 5000)
                    if int(self.buf[:HEADER].view(np.uint64)[1]) == seq:
                        return body
                if time.monotonic() > deadline:
                    raise HixlError(f"the directory of {address} kept changing for {timeout_s} s")
                time.sleep(0.001)

    def fetch(self, address: str, dir_addr: int | None = None) -> PeerDirectory:
        if dir_addr is None:
            dir_addr = self.locate(address)
        return parse(address, dir_addr, self.read(address, dir_addr))


def parse(address: str, dir_addr: int, body: bytes) -> PeerDirectory:
    """A peer's directory from its JSON body. The peer wrote it, so nothing in it is trusted:
    anything malformed is an LLMError naming the peer, never a stray exception. (Addresses
    in it need no check here: the engine checks every transfer against the peer's regions.)"""
    try:
        doc: dict[str, Any] = json.loads(body)
        rank, role = int(doc["rank"]), str(doc["role"])
        caches = {}
        for c in doc["caches"]:
            info = CacheInfo.from_json(c)
            np.dtype(info.dtype)
            axes = [info.layer_axis] + ([] if info.block_axis is None else [info.block_axis])
            if not all(0 <= a < len(info.shape) for a in axes) or min(info.shape, default=0) < 0:
                raise ValueError(f"cache {info.name!r} has axes or a shape out of range")
            caches[info.name] = info
    except (ValueError, KeyError, TypeError, IndexError, AttributeError, RecursionError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise LLMError(
            LLM_NOT_LINKED,
            f"{address} publishes a malformed KV-cache directory ({why[:200]})",
        ) from None
    return PeerDirectory(address, rank, role, dir_addr, caches)
