"""The names NIXL's compiled module (``nixl._bindings``) gives Python programs, in hixl's terms.

Exceptions carry NIXL's status name and meaning, plus hixl's status code in the message
(``NIXL_ERR_NOT_FOUND: ... [hixl PARAM_INVALID 103900]``). Descriptor lists keep their
descriptors in an ``(N, 3)`` numpy ``uint64`` array (address, length, device id), so lists of
thousands of entries cost one array, not thousands of Python tuples.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .._errors import HixlError, Status

NIXL_INIT_AGENT = ""
DEFAULT_COMM_PORT = 8888

# Memory segment types (values are hixl's own; only the names are NIXL's).
DRAM_SEG = 0
VRAM_SEG = 1
BLK_SEG = 2
OBJ_SEG = 3
FILE_SEG = 4
MEM_NAMES = {DRAM_SEG: "DRAM", VRAM_SEG: "VRAM", BLK_SEG: "BLOCK", OBJ_SEG: "OBJ", FILE_SEG: "FILE"}
MEM_TYPES = {
    "DRAM": DRAM_SEG,
    "cpu": DRAM_SEG,
    "VRAM": VRAM_SEG,
    "cuda": VRAM_SEG,
    "BLOCK": BLK_SEG,
    "BLK": BLK_SEG,
    "OBJ": OBJ_SEG,
    "FILE": FILE_SEG,
}

NIXL_READ = 0
NIXL_WRITE = 1

# Status values and thread-sync modes, with NIXL's numbers.
NIXL_IN_PROG = 1
NIXL_SUCCESS = 0
NIXL_ERR_NOT_POSTED = -1
NIXL_ERR_INVALID_PARAM = -2
NIXL_ERR_BACKEND = -3
NIXL_ERR_NOT_FOUND = -4
NIXL_ERR_MISMATCH = -5
NIXL_ERR_NOT_ALLOWED = -6
NIXL_ERR_REPOST_ACTIVE = -7
NIXL_ERR_UNKNOWN = -8
NIXL_ERR_NOT_SUPPORTED = -9
NIXL_COST_ANALYTICAL_BACKEND = 0
NIXL_THREAD_SYNC_NONE = 0
NIXL_THREAD_SYNC_STRICT = 1
NIXL_THREAD_SYNC_RW = 2
NIXL_THREAD_SYNC_DEFAULT = 0
HAVE_UCX_GPU_DEVICE_API = False


class nixlError(RuntimeError):
    """Base of the NIXL-named errors; ``nixl_status`` is NIXL's status name and ``hixl_code``
    the hixl status code that goes with it (``__cause__`` is hixl's own error when there is
    one)."""

    nixl_status = "NIXL_ERR_UNKNOWN"
    hixl_status: Status = Status.FAILED

    def __init__(self, message: str = "", hixl_status: Status | None = None) -> None:
        if hixl_status is not None:
            self.hixl_status = hixl_status
        self.detail = message
        super().__init__(
            f"{self.nixl_status}: {message} [hixl {self.hixl_status.name} {int(self.hixl_status)}]"
        )

    @property
    def hixl_code(self) -> int:
        return int(self.hixl_status)


class nixlNotPostedError(nixlError):
    nixl_status = "NIXL_ERR_NOT_POSTED"


class nixlInvalidParamError(nixlError):
    nixl_status = "NIXL_ERR_INVALID_PARAM"
    hixl_status = Status.PARAM_INVALID


class nixlBackendError(nixlError):
    nixl_status = "NIXL_ERR_BACKEND"


class nixlNotFoundError(nixlError):
    nixl_status = "NIXL_ERR_NOT_FOUND"
    hixl_status = Status.PARAM_INVALID


class nixlMismatchError(nixlError):
    nixl_status = "NIXL_ERR_MISMATCH"
    hixl_status = Status.PARAM_INVALID


class nixlNotAllowedError(nixlError):
    nixl_status = "NIXL_ERR_NOT_ALLOWED"
    hixl_status = Status.PARAM_INVALID


class nixlRepostActiveError(nixlError):
    nixl_status = "NIXL_ERR_REPOST_ACTIVE"
    hixl_status = Status.PARAM_INVALID


class nixlUnknownError(nixlError):
    nixl_status = "NIXL_ERR_UNKNOWN"


class nixlNotSupportedError(nixlError):
    nixl_status = "NIXL_ERR_NOT_SUPPORTED"
    hixl_status = Status.UNSUPPORTED


class nixlRemoteDisconnectError(nixlError):
    nixl_status = "NIXL_ERR_REMOTE_DISCONNECT"
    hixl_status = Status.NOT_CONNECTED


class nixlCancelledError(nixlError):
    nixl_status = "NIXL_ERR_CANCELED"


class nixlNoTelemetryError(nixlError):
    nixl_status = "NIXL_ERR_NO_TELEMETRY"


_BY_HIXL: dict[Status, type[nixlError]] = {
    Status.PARAM_INVALID: nixlInvalidParamError,
    Status.TIMEOUT: nixlBackendError,
    Status.NOT_CONNECTED: nixlRemoteDisconnectError,
    Status.ALREADY_CONNECTED: nixlNotAllowedError,
    Status.NOTIFY_FAILED: nixlBackendError,
    Status.UNSUPPORTED: nixlNotSupportedError,
    Status.RESOURCE_EXHAUSTED: nixlBackendError,
    Status.FAILED: nixlBackendError,
}


def from_hixl(err: HixlError, what: str, cls: type[nixlError] | None = None) -> nixlError:
    """The NIXL-named error for hixl's `err` (raise it ``from err``)."""
    c = cls or _BY_HIXL.get(err.status, nixlBackendError)
    return c(f"{what}: {err.message}", err.status)


class nixlXferTelemetry:
    """Telemetry of one transfer: times in microseconds, ``totalBytes`` and ``descCount``."""

    __slots__ = ("startTime", "postDuration", "xferDuration", "totalBytes", "descCount")

    def __init__(
        self, start_us: int, post_us: int, xfer_us: int, total_bytes: int, desc_count: int
    ) -> None:
        self.startTime = start_us
        self.postDuration = post_us
        self.xferDuration = xfer_us
        self.totalBytes = total_bytes
        self.descCount = desc_count

    def __getitem__(self, key: str) -> int:  # dict-style access, as some callers use
        return int(getattr(self, key))

    def __repr__(self) -> str:
        return (
            f"nixlXferTelemetry(startTime={self.startTime}, postDuration={self.postDuration}, "
            f"xferDuration={self.xferDuration}, totalBytes={self.totalBytes}, "
            f"descCount={self.descCount})"
        )


def mem_seg(mem_type: Any) -> int:
    """A memory type given as NIXL's name ("DRAM", "cpu", ...) or segment number."""
    if isinstance(mem_type, str):
        if mem_type not in MEM_TYPES:
            raise nixlInvalidParamError(f"unknown memory type {mem_type!r}")
        return MEM_TYPES[mem_type]
    if isinstance(mem_type, int) and mem_type in MEM_NAMES:
        return int(mem_type)
    raise nixlInvalidParamError(f"unknown memory type {mem_type!r}")


def _desc_array(descs: Any, width: int) -> npt.NDArray[np.uint64]:
    if isinstance(descs, np.ndarray):
        if descs.ndim != 2 or descs.shape[1] != 3:
            raise nixlInvalidParamError(f"descriptors must be an Nx3 array, not {descs.shape}")
        if descs.dtype.kind not in "iu":
            raise nixlInvalidParamError(f"descriptors must be integers, not {descs.dtype}")
        if descs.dtype.kind == "i" and descs.size and int(descs.min()) < 0:
            raise nixlInvalidParamError("descriptors must not be negative")
        return np.ascontiguousarray(descs, dtype=np.uint64)
    rows = descs if isinstance(descs, list) else list(descs)
    first = rows[0] if rows else None
    if width == 3 and isinstance(first, (tuple, list)) and len(first) == 3:
        try:  # the fast path: numpy reads the integers in C (no pass over the tuples first)
            flat = itertools.chain.from_iterable(rows)
            fast = np.fromiter(flat, np.uint64, 3 * len(rows)).reshape(-1, 3)
            if next(flat, None) is None:  # not more numbers than 3 a row
                return fast
        except (OverflowError, ValueError, TypeError):
            pass  # the loop below names the bad descriptor
    out = np.empty((len(rows), 3), np.uint64)
    for i, d in enumerate(rows):
        if not isinstance(d, (tuple, list)) or len(d) != width:
            raise nixlInvalidParamError(
                f"descriptor {i} must be a tuple of {width} elements, not {d!r}"
            )
        try:
            out[i] = (int(d[0]), int(d[1]), int(d[2]))
        except (OverflowError, ValueError, TypeError) as e:
            raise nixlInvalidParamError(f"descriptor {i} {d!r}: {e}") from None
    return out


class _DList:
    """Common part of the two descriptor lists."""

    _width = 3
    # The buffers (arrays, tensors) the descriptors were made of, when they were: registering
    # them through the engine keeps them alive while registered.
    _hixl_objs: list[Any] | None = None

    def __init__(self, type: Any, descs: Any = 0) -> None:  # noqa: A002 (NIXL's name)
        self._seg = mem_seg(type)
        if isinstance(descs, int):
            self.arr = np.zeros((descs, 3), np.uint64)
        else:
            self.arr = _desc_array(descs, self._width)

    def getType(self) -> int:
        return self._seg

    @property
    def mem_type(self) -> str:
        return MEM_NAMES[self._seg]

    def descCount(self) -> int:
        return int(self.arr.shape[0])

    def __len__(self) -> int:
        return int(self.arr.shape[0])

    def isEmpty(self) -> bool:
        return self.arr.shape[0] == 0

    def clear(self) -> None:
        self.arr = np.zeros((0, 3), np.uint64)

    def print(self) -> None:
        print(repr(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({MEM_NAMES[self._seg]}, {self.descCount()} descriptors)"


class nixlXferDList(_DList):
    """Transfer descriptors: (address, length, device id) each."""

    def __getitem__(self, i: int) -> tuple[int, int, int]:
        a, n, d = self.arr[i]
        return int(a), int(n), int(d)

    def __setitem__(self, i: int, desc: Sequence[int]) -> None:
        self.arr[i] = (int(desc[0]), int(desc[1]), int(desc[2]))

    def addDesc(self, desc: Sequence[int]) -> None:
        row = np.array([[int(desc[0]), int(desc[1]), int(desc[2])]], np.uint64)
        self.arr = np.concatenate([self.arr, row])

    append = addDesc

    def remDesc(self, i: int) -> None:
        self.arr = np.delete(self.arr, i, axis=0)

    def index(self, desc: Sequence[int]) -> int:
        hit = np.flatnonzero((self.arr == np.array(desc[:3], np.uint64)).all(axis=1))
        if hit.size == 0:
            raise nixlNotFoundError(f"descriptor {tuple(desc)} is not in the list")
        return int(hit[0])

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, nixlXferDList)
            and self._seg == other._seg
            and np.array_equal(self.arr, other.arr)
        )

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, ("x", self._seg, self.arr.tobytes(), None))


class nixlRegDList(_DList):
    """Registration descriptors: (address, length, device id, meta info) each."""

    _width = 4

    def __init__(self, type: Any, descs: Any = 0) -> None:  # noqa: A002
        super().__init__(type, descs)
        if isinstance(descs, (int, np.ndarray)):
            self.meta: list[bytes] = [b""] * self.descCount()
        else:
            self.meta = [_meta_bytes(d[3]) for d in descs]

    def __getitem__(self, i: int) -> tuple[int, int, int, bytes]:
        a, n, d = self.arr[i]
        return int(a), int(n), int(d), self.meta[i]

    def __setitem__(self, i: int, desc: Sequence[Any]) -> None:
        self.arr[i] = (int(desc[0]), int(desc[1]), int(desc[2]))
        self.meta[i] = _meta_bytes(desc[3] if len(desc) > 3 else b"")

    def addDesc(self, desc: Sequence[Any]) -> None:
        row = np.array([[int(desc[0]), int(desc[1]), int(desc[2])]], np.uint64)
        self.arr = np.concatenate([self.arr, row])
        self.meta.append(_meta_bytes(desc[3] if len(desc) > 3 else b""))

    append = addDesc

    def remDesc(self, i: int) -> None:
        self.arr = np.delete(self.arr, i, axis=0)
        del self.meta[i]

    def clear(self) -> None:
        super().clear()
        self.meta = []

    def index(self, desc: Sequence[Any]) -> int:
        hit = np.flatnonzero((self.arr == np.array(desc[:3], np.uint64)).all(axis=1))
        if hit.size == 0:
            raise nixlNotFoundError(f"descriptor {tuple(desc)} is not in the list")
        return int(hit[0])

    def trim(self) -> nixlXferDList:
        """The same descriptors as a transfer list (without meta info)."""
        x = nixlXferDList(self._seg)
        x.arr = self.arr.copy()
        return x

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, nixlRegDList)
            and self._seg == other._seg
            and np.array_equal(self.arr, other.arr)
            and self.meta == other.meta
        )

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, ("r", self._seg, self.arr.tobytes(), list(self.meta)))


class nixlRemoteDList(_DList):
    """Remote descriptors: (address, length, device id, remote agent name) each; only for
    NIXL's device memory views, which hixl refuses (prep_mem_view)."""

    _width = 4

    def __init__(self, type: Any, descs: Any = 0) -> None:  # noqa: A002
        super().__init__(type, descs)
        n = self.descCount()
        self.agents: list[str] = [""] * n if isinstance(descs, int) else [str(d[3]) for d in descs]

    def __getitem__(self, i: int) -> tuple[int, int, int, str]:
        a, n, d = self.arr[i]
        return int(a), int(n), int(d), self.agents[i]


def _meta_bytes(m: Any) -> bytes:
    if isinstance(m, bytes):
        return m
    if isinstance(m, str):
        return m.encode()
    raise nixlInvalidParamError(f"meta info must be str or bytes, not {type(m).__name__}")


def _rebuild(kind: str, seg: int, raw: bytes, meta: list[bytes] | None) -> _DList:
    arr = np.frombuffer(raw, np.uint64).reshape(-1, 3).copy()
    out: _DList
    if kind == "r":
        r = nixlRegDList(seg)
        r.arr, r.meta = arr, list(meta or [b""] * arr.shape[0])
        out = r
    else:
        out = nixlXferDList(seg)
        out.arr = arr
    return out


# get_serialized_descs / deserialize_descs: a format of our own (never pickle, so that bytes
# from a peer cannot run code): magic, kind, segment, count, the array, then meta strings.
_SER_MAGIC = b"HIXLDL1\0"
_SER_HEAD = struct.Struct("<8scBQ")


def serialize(d: _DList) -> bytes:
    kind = b"r" if isinstance(d, nixlRegDList) else b"x"
    parts = [_SER_HEAD.pack(_SER_MAGIC, kind, d.getType(), d.descCount()), d.arr.tobytes()]
    if isinstance(d, nixlRegDList):
        for m in d.meta:
            parts += [struct.pack("<I", len(m)), m]
    return b"".join(parts)


def deserialize(data: bytes) -> _DList:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise nixlInvalidParamError(f"serialized descriptors must be bytes, not {type(data)}")
    data = bytes(data)
    if len(data) < _SER_HEAD.size or not data.startswith(_SER_MAGIC):
        raise nixlInvalidParamError(
            "these bytes are not descriptors serialized by hixl.nixl (NIXL's own pickled "
            "lists cannot be read by hixl)"
        )
    _, kind, seg, n = _SER_HEAD.unpack_from(data)
    if kind not in (b"r", b"x") or seg not in MEM_NAMES:
        raise nixlInvalidParamError("serialized descriptors: bad header")
    end = _SER_HEAD.size + 24 * n
    if len(data) < end:
        raise nixlInvalidParamError(f"serialized descriptors: truncated ({len(data)} bytes)")
    arr = np.frombuffer(data, np.uint64, 3 * n, _SER_HEAD.size).reshape(n, 3).copy()
    if kind == b"x":
        if len(data) != end:
            raise nixlInvalidParamError("serialized descriptors: trailing bytes")
        x = nixlXferDList(seg)
        x.arr = arr
        return x
    meta, off = [], end
    for _ in range(n):
        if off + 4 > len(data):
            raise nixlInvalidParamError("serialized descriptors: truncated meta info")
        (k,) = struct.unpack_from("<I", data, off)
        if off + 4 + k > len(data):
            raise nixlInvalidParamError("serialized descriptors: truncated meta info")
        meta.append(data[off + 4 : off + 4 + k])
        off += 4 + k
    if off != len(data):
        raise nixlInvalidParamError("serialized descriptors: trailing bytes")
    r = nixlRegDList(seg)
    r.arr, r.meta = arr, meta
    return r
