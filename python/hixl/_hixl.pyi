# Type stubs of the compiled module hixl._hixl (kept honest by mypy.stubtest in CI).

from collections.abc import Mapping, Sequence
from typing import Any, Literal, Self, TypeAlias, final, overload

import numpy as np
import numpy.typing as npt
from typing_extensions import disjoint_base

__version__: str
__all__ = [
    "AsyncConnectStatus",
    "Hixl",
    "MemDesc",
    "MemHandle",
    "MemType",
    "NotifyDesc",
    "RemoteRegion",
    "ShmBuffer",
    "StridedDesc",
    "TransferOp",
    "TransferOpDesc",
    "TransferReq",
    "TransferStatus",
    "__version__",
    "_host_identity",
    "_raw_cma",
    "_raw_memcpy",
    "_raw_tcp_send",
    "_raw_tcp_sink",
    "get_log_level",
    "option_keys",
    "hixl_option_keys",
    "set_log_level",
    "status_codes",
    "transfer_states",
]

@final
class MemType:
    HOST: MemType
    DEVICE: MemType
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...

@final
class TransferOp:
    READ: TransferOp
    WRITE: TransferOp
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...

@final
class TransferStatus:
    WAITING: TransferStatus
    COMPLETED: TransferStatus
    TIMEOUT: TransferStatus
    FAILED: TransferStatus
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...

@final
class AsyncConnectStatus:
    NOT_CONNECT: AsyncConnectStatus
    CONNECTING: AsyncConnectStatus
    CONNECTED: AsyncConnectStatus
    CONNECT_FAILED: AsyncConnectStatus
    def __int__(self) -> int: ...
    @property
    def name(self) -> str: ...

@final
class MemDesc:
    def __new__(cls, addr: int, length: int) -> MemDesc: ...
    @property
    def addr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def length(self) -> int: ...

@final
class TransferOpDesc:
    def __new__(cls, local_addr: int, remote_addr: int, length: int) -> TransferOpDesc: ...
    @property
    def local_addr(self) -> int: ...
    @property
    def remote_addr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def length(self) -> int: ...

@final
class NotifyDesc:
    def __new__(cls, name: str, msg: str = ...) -> NotifyDesc: ...
    @property
    def name(self) -> str: ...
    @property
    def msg(self) -> str: ...

@final
class StridedDesc:
    def __new__(
        cls, count: int, size: int, stride: int, remote_stride: int | None = None
    ) -> StridedDesc: ...
    @property
    def count(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def remote_stride(self) -> int | None: ...
    @property
    def nbytes(self) -> int: ...

@final
class MemHandle:
    @property
    def addr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def id(self) -> int: ...
    @property
    def mem_type(self) -> MemType: ...
    @property
    def name(self) -> str: ...

@final
class RemoteRegion:
    @property
    def addr(self) -> int: ...
    @property
    def len(self) -> int: ...
    @property
    def length(self) -> int: ...
    @property
    def name(self) -> str: ...
    @property
    def mem_type(self) -> MemType: ...
    @property
    def writable(self) -> bool: ...

@final
class TransferReq:
    def wait(self, timeout_ms: float | None = None) -> TransferStatus: ...
    def status(self) -> TransferStatus: ...
    def result(self) -> None: ...
    @property
    def user_data(self) -> Any: ...
    @property
    def id(self) -> int: ...
    @property
    def nbytes(self) -> int: ...

@final
class ShmBuffer:  # exports the buffer protocol (a writable 1-D byte buffer)
    @property
    def addr(self) -> int: ...
    def __len__(self) -> int: ...

_Descs: TypeAlias = Sequence[TransferOpDesc | tuple[int, int, int]] | npt.NDArray[Any]

@disjoint_base
class Hixl:
    def __new__(cls) -> Self: ...
    def initialize(
        self, local_engine: str, options: Mapping[str, str | int | bool] | None = None
    ) -> None: ...
    @property
    def local_engine(self) -> str: ...
    def finalize(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *_args: object) -> Literal[False]: ...
    def register_mem(
        self,
        desc: MemDesc,
        mem_type: MemType = ...,
        access: str = "rw",
        name: str | None = None,
    ) -> MemHandle: ...
    def register(
        self, obj: Any, mem_type: MemType = ..., access: str = "rw", name: str | None = None
    ) -> MemHandle: ...
    def alloc(self, size: int, name: str | None = None) -> npt.NDArray[np.uint8]: ...
    def deregister_mem(self, handle: MemHandle) -> None: ...
    def connect(self, remote: str, timeout_ms: float | None = None) -> None: ...
    def disconnect(self, remote: str, timeout_ms: float | None = None) -> None: ...
    def connect_async(self, remote: str) -> None: ...
    def get_async_connect_status(self, remote: str) -> AsyncConnectStatus: ...
    def remote_mems(self, remote: str) -> list[MemDesc]: ...
    def remote_regions(self, remote: str) -> list[RemoteRegion]: ...
    def remote_region(self, remote: str, name: str) -> RemoteRegion: ...
    def transfer_sync(
        self, remote: str, op: TransferOp, descs: _Descs, timeout_ms: float | None = None
    ) -> None: ...
    def transfer_async(
        self,
        remote: str,
        op: TransferOp,
        descs: _Descs,
        user_data: Any = None,
        notify: NotifyDesc | None = None,
        timeout_ms: float | None = None,
    ) -> TransferReq: ...
    @overload
    def get_transfer_status(self, req: TransferReq) -> TransferStatus: ...
    @overload
    def get_transfer_status(self, req: Sequence[TransferReq]) -> list[TransferStatus]: ...
    @overload
    def get_transfer_status(self, req: None = None) -> list[tuple[Any, TransferStatus]]: ...
    def put(
        self,
        remote: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        timeout_ms: float | None = None,
    ) -> None: ...
    def get(
        self,
        remote: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        timeout_ms: float | None = None,
    ) -> None: ...
    def put_async(
        self,
        remote: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        user_data: Any = None,
        timeout_ms: float | None = None,
    ) -> TransferReq: ...
    def get_async(
        self,
        remote: str,
        local_addr: int,
        remote_addr: int,
        length: int,
        user_data: Any = None,
        timeout_ms: float | None = None,
    ) -> TransferReq: ...
    def put_strided(
        self,
        remote: str,
        local_base: int,
        remote_base: int,
        desc: StridedDesc,
        timeout_ms: float | None = None,
    ) -> None: ...
    def get_strided(
        self,
        remote: str,
        local_base: int,
        remote_base: int,
        desc: StridedDesc,
        timeout_ms: float | None = None,
    ) -> None: ...
    def put_strided_async(
        self,
        remote: str,
        local_base: int,
        remote_base: int,
        desc: StridedDesc,
        user_data: Any = None,
        notify: NotifyDesc | None = None,
        timeout_ms: float | None = None,
    ) -> TransferReq: ...
    def get_strided_async(
        self,
        remote: str,
        local_base: int,
        remote_base: int,
        desc: StridedDesc,
        user_data: Any = None,
        notify: NotifyDesc | None = None,
        timeout_ms: float | None = None,
    ) -> TransferReq: ...
    def send_notify(
        self, remote: str, notify: NotifyDesc, timeout_ms: float | None = None
    ) -> None: ...
    def wait_notifies(self, timeout_ms: float, name: str | None = None) -> list[NotifyDesc]: ...
    def get_notifies(self) -> list[NotifyDesc]: ...
    def stats(self) -> dict[str, dict[str, Any]]: ...

def set_log_level(level: str) -> None: ...
def get_log_level() -> str: ...
def option_keys() -> list[tuple[str, str, str]]: ...
def hixl_option_keys() -> list[tuple[str, str]]: ...
def status_codes() -> list[tuple[str, int]]: ...
def transfer_states() -> list[tuple[str, int]]: ...
def _raw_tcp_sink(listen: str) -> str: ...
def _raw_tcp_send(addr: str, size: int, iters: int, streams: int = 1) -> list[float]: ...
def _raw_cma(pid: int, write: bool, descs: _Descs, iters: int) -> list[float]: ...
def _raw_memcpy(block: int, count: int, iters: int) -> list[float]: ...
def _host_identity() -> str: ...
