"""Each rank's directory: its rank, role and caches, published in a registered buffer.

Peers read it one-sidedly (a hixl READ; the owner runs no code for it) at link time and
again whenever they look for a cache they do not know yet. A sequence number makes the read
consistent: the owner makes it odd while it rewrites the buffer and even again afterwards; a
reader that sees an odd or changed number reads again.

How a peer finds the directory: it is the owner's region named DIR_NAME (region names are
unique within an engine, and only the owner registers its regions, so no peer can publish
a region under that name for it). Its header holds the magic number, the layout version and
the owner's rank: a region of that name that is not a directory, or that names another rank,
is an error, never a fallback. Everything read is untrusted: anything malformed is an
KVError naming the peer.

Peers may only READ a directory: it is registered with access="r", so a peer (even one with
the cluster secret) cannot rewrite it to send other ranks to the wrong regions; a region of
that name that peers may write is refused. The reader's scratch buffer is read-only for
peers too (a READ into local memory needs only the local registration).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _peertext as pt
from .._errors import HixlError, ParamInvalid
from .._hixl import Hixl
from .._layout import aligned_empty
from ._cache import CacheInfo
from ._errors import LLM_NOT_LINKED, KVError

#: The name a rank's directory is registered under; peers look it up by this name.
DIR_NAME = "hixl.kv.directory"
#: Registered length of a directory.
DIR_BYTES = (1 << 20) + 4096
MAGIC = 0x5249444C5849480A  # "\nHXLDIR": a hixl directory
VERSION = 2  # 2: found by its name (1: by a scan of the peer's regions)
HEADER = 64
# Header words (uint64, little endian): the magic number, the sequence number, the body's
# length, the owner's rank, the layout version.
W_MAGIC, W_SEQ, W_LEN, W_RANK, W_VERSION = range(5)


@dataclass
class Directory:
    """This rank's own directory, registered with its engine."""

    engine: Hixl
    rank: int
    role: str
    caches: dict[str, CacheInfo] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: Anything else a layer on top publishes for its peers (JSON values; hixl.llm_datadist
    #: keeps its caches and keys here). Peers get it as PeerDirectory.extra, unchecked.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.buf = aligned_empty(DIR_BYTES, np.uint8)
        self.buf[:] = 0
        self.words = self.buf[:HEADER].view(np.uint64)
        self.words[W_SEQ] = 1  # odd until the first publish
        self.words[W_RANK] = self.rank
        self.words[W_VERSION] = VERSION
        self.words[W_MAGIC] = MAGIC
        # Peers may only read it, and find it by its name.
        self.handle = self.engine.register(self.buf, access="r", name=DIR_NAME)
        self.publish()

    def publish(self) -> None:
        doc = {
            "rank": self.rank,
            "role": self.role,
            "caches": [c.to_json() for c in self.caches.values()],
        }
        if self.extra:
            doc["extra"] = self.extra
        body = json.dumps(doc, separators=(",", ":")).encode()
        if len(body) > DIR_BYTES - HEADER:
            raise ParamInvalid(
                f"too many caches: the directory needs {len(body)} bytes, "
                f"holds {DIR_BYTES - HEADER}"
            )
        with self.lock:
            self.words[W_SEQ] |= 1  # odd: being rewritten
            self.buf[HEADER : HEADER + len(body)] = np.frombuffer(body, np.uint8)
            self.words[W_LEN] = len(body)
            self.words[W_SEQ] += 1  # even: stable

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
    #: The peer's Directory.extra, as published (untrusted: check before use).
    extra: dict[str, Any] = field(default_factory=dict)


class DirectoryReader:
    """Reads peers' directories through one local registered scratch buffer."""

    def __init__(self, engine: Hixl) -> None:
        self.engine = engine
        self.buf = aligned_empty(DIR_BYTES, np.uint8)
        # Only this engine's GETs land here; peers have no reason to write it.
        self.handle = engine.register(self.buf, access="r")
        self.lock = threading.Lock()

    def _get(self, address: str, offset: int, remote: int, n: int) -> None:
        """One READ into the scratch (the caller holds the lock); engine errors become
        KVErrors naming the peer."""
        try:
            self.engine.get(address, self.buf.ctypes.data + offset, remote, n, 5000)
        except HixlError as exc:
            raise KVError.from_engine(exc, f"reading the directory of {address}") from exc

    def locate(self, address: str, rank: int, deadline: float) -> int:
        """The address of `rank`'s directory: the region of `address` named DIR_NAME, its
        length, access and header checked. Waits until `deadline` (time.monotonic()) while
        there is none: a rank starting at this moment listens a little before it registers
        its directory."""
        while True:
            try:
                region = self.engine.remote_region(address, DIR_NAME)
                break
            except ParamInvalid:
                pass  # no region of that name (yet)
            except HixlError as exc:
                raise KVError.from_engine(exc, f"link to {address}") from exc
            if time.monotonic() >= deadline:
                raise KVError(
                    LLM_NOT_LINKED,
                    f"{address} publishes no hixl KV-cache directory (no region named "
                    f"{DIR_NAME!r}: is it a hixl.kv.init() process?)",
                )
            time.sleep(0.01)
        if region.len != DIR_BYTES or region.writable:
            raise KVError(
                LLM_NOT_LINKED,
                f"{address} publishes a malformed KV-cache directory (region {DIR_NAME!r} is "
                f"{region.len} bytes{', writable by peers' if region.writable else ''}; a "
                f"directory is {DIR_BYTES} bytes, read-only)",
            )
        with self.lock:
            self._get(address, 0, region.addr, HEADER)
            w = [int(x) for x in self.buf[:HEADER].view(np.uint64)]
        if (w[W_MAGIC], w[W_VERSION]) != (MAGIC, VERSION):
            raise KVError(
                LLM_NOT_LINKED,
                f"{address} publishes a malformed KV-cache directory (region {DIR_NAME!r} "
                f"holds magic {w[W_MAGIC]:#x} version {w[W_VERSION]}, expected {MAGIC:#x} "
                f"version {VERSION})",
            )
        if w[W_RANK] != rank:
            raise KVError(LLM_NOT_LINKED, f"{address} is rank {w[W_RANK]}, not cluster_id={rank}")
        return int(region.addr)

    def read(self, address: str, dir_addr: int, rank: int, timeout_s: float = 5.0) -> bytes:
        """The directory's JSON body, read consistently (see the sequence number above)."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            while True:
                self._get(address, 0, dir_addr, HEADER)
                w = [int(x) for x in self.buf[:HEADER].view(np.uint64)]
                if (w[W_MAGIC], w[W_RANK]) != (MAGIC, rank):
                    raise KVError(
                        LLM_NOT_LINKED,
                        f"{address} no longer publishes the KV-cache directory of rank {rank} "
                        f"at {dir_addr:#x}",
                    )
                seq, n = w[W_SEQ], w[W_LEN]
                if seq % 2 == 0:
                    if not 0 < n <= DIR_BYTES - HEADER:
                        raise KVError(
                            LLM_NOT_LINKED,
                            f"{address} publishes a malformed KV-cache directory "
                            f"(body length {n}, at most {DIR_BYTES - HEADER})",
                        )
                    self._get(address, HEADER, dir_addr + HEADER, n)
                    body = self.buf[HEADER : HEADER + n].tobytes()
                    self._get(address, 0, dir_addr, HEADER)
                    if int(self.buf[:HEADER].view(np.uint64)[W_SEQ]) == seq:
                        return body
                if time.monotonic() > deadline:
                    raise KVError(
                        LLM_NOT_LINKED,
                        f"the KV-cache directory of {address} kept changing for {timeout_s} s",
                    )
                time.sleep(0.001)

    def fetch(
        self, address: str, rank: int, dir_addr: int | None = None, deadline: float | None = None
    ) -> PeerDirectory:
        """`rank`'s directory at `address` (found first when `dir_addr` is None)."""
        if dir_addr is None:
            dir_addr = self.locate(
                address, rank, time.monotonic() if deadline is None else deadline
            )
        peer = parse(address, dir_addr, self.read(address, dir_addr, rank))
        if peer.rank != rank:
            raise KVError(
                LLM_NOT_LINKED,
                f"{address} publishes a malformed KV-cache directory (its header says rank "
                f"{rank}, its body rank {peer.rank})",
            )
        return peer


def parse(address: str, dir_addr: int, body: bytes) -> PeerDirectory:
    """A peer's directory from its JSON body. The peer wrote it, so nothing in it is trusted:
    anything malformed is an KVError naming the peer, never a stray exception. (Addresses
    in it need no check here: the engine checks every transfer against the peer's regions.)"""
    try:
        doc = pt.obj(pt.loads(body, "directory", DIR_BYTES), "directory")
        rank = pt.integer(doc.get("rank"), "rank", 0, (1 << 63) - 1)
        role = pt.text(doc.get("role"), "role", 64)
        extra = dict(pt.obj(doc.get("extra", {}), "extra"))
        caches = {}
        for c in pt.array(doc.get("caches"), "caches", 1 << 16):
            info = cache_info(c)
            caches[info.name] = info
    except pt.Malformed as exc:
        raise KVError(
            LLM_NOT_LINKED,
            f"{address} publishes a malformed KV-cache directory ({pt.shown(str(exc))})",
        ) from None
    return PeerDirectory(address, rank, role, dir_addr, caches, extra)


def cache_info(c: Any) -> CacheInfo:
    """One cache of a peer's directory, every field checked; Malformed naming the first one
    that is wrong."""
    c = pt.obj(c, "cache")
    name = pt.text(c.get("name"), "cache name", 1024)
    big = (1 << 63) - 1
    shape = tuple(pt.integer(x, "shape", 0, big) for x in pt.array(c.get("shape"), "shape", 64))
    dtype = pt.text(c.get("dtype"), "dtype", 32)
    try:
        np.dtype(dtype)
    except (TypeError, ValueError):
        raise pt.Malformed(f"cache {name!r}: dtype {dtype!r} is not a numpy dtype") from None
    block = c.get("block_axis")
    layers = tuple(
        pt.integer(a, "layer address", 0, (1 << 64) - 1)
        for a in pt.array(c.get("layer_addrs", []), "layer_addrs", 1 << 16)
    )
    info = CacheInfo(
        name,
        shape,
        dtype,
        pt.integer(c.get("addr"), "addr", 0, (1 << 64) - 1),
        pt.integer(c.get("nbytes"), "nbytes", 0, big),
        pt.integer(c.get("layer_axis"), "layer_axis", 0, 63),
        None if block is None else pt.integer(block, "block_axis", 0, 63),
        layers,
    )
    if layers and (
        info.layer_axis != 0 or info.shape[:1] != (len(layers),) or info.nbytes % len(layers)
    ):
        raise pt.Malformed(
            f"cache {name!r}: {len(layers)} layer addresses for shape {info.shape}, "
            f"layer_axis {info.layer_axis}, {info.nbytes} bytes"
        )
    axes = [info.layer_axis] + ([] if info.block_axis is None else [info.block_axis])
    if not all(a < len(info.shape) for a in axes):
        raise pt.Malformed(f"cache {name!r} has axes out of range of its shape")
    return info
