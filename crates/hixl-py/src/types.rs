//! Enums and descriptor classes, mirroring hixl-core's types.

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyInt, PyString};

use crate::args::shown;
use crate::errors;

/// Reads a non-negative integer argument, naming it in the error.
pub fn uint(name: &str, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    uint_named(|| name.to_string(), v)
}

/// [`uint`], with the name made only for an error message (per-descriptor names in a hot loop
/// cost an allocation each otherwise).
pub fn uint_named(name: impl Fn() -> String, v: &Bound<'_, PyAny>) -> PyResult<u64> {
    if v.is_instance_of::<PyInt>() {
        // `unsigned long` is 64 bits on the platforms hixl builds for, and CPython converts it
        // digit by digit, where the `unsigned long long` path (pyo3's u64) goes through a
        // byte-array conversion: a third of a descriptor's parsing time.
        const _: () = assert!(std::mem::size_of::<std::ffi::c_ulong>() == 8);
        // SAFETY: `v` is a live int object and we hold the GIL (the Bound proves both).
        let x = unsafe { pyo3::ffi::PyLong_AsUnsignedLong(v.as_ptr()) };
        if x != std::ffi::c_ulong::MAX {
            return Ok(x as u64);
        }
        // u64::MAX itself, or an error (negative, too large): cleared and handled below.
        // SAFETY: as above.
        if unsafe { pyo3::ffi::PyErr_Occurred() }.is_null() {
            return Ok(u64::MAX);
        }
        drop(PyErr::take(v.py()));
    }
    // Python ints, and integer scalars that say they are one (numpy's, via __index__).
    let v = if v.is_instance_of::<PyInt>() {
        v.clone()
    } else if let Ok(i) = v.call_method0("__index__") {
        i
    } else {
        let t = v.get_type().name().map(|n| n.to_string()).unwrap_or_default();
        return Err(errors::param(format!("{} must be an int, got {t} {v}", name())));
    };
    match v.extract::<u64>() {
        Ok(x) => Ok(x),
        Err(_) => {
            let name = name();
            Err(errors::param(format!("{name}={v} is out of range: expected 0 <= {name} < 2**64")))
        }
    }
}

/// Where memory lives: `MemType.HOST` (this process's memory, the default) or `MemType.DEVICE`
/// (CUDA device memory: the engine finds the device, `MemHandle.domain` says "cuda:N"; without
/// CUDA, registering it raises `Unsupported` saying CUDA was not found).
#[pyclass(eq, eq_int, frozen, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum MemType {
    HOST = 0,
    DEVICE = 1,
}

impl From<MemType> for hixl_core::MemType {
    fn from(m: MemType) -> Self {
        match m {
            MemType::HOST => hixl_core::MemType::Host,
            MemType::DEVICE => hixl_core::MemType::Device,
        }
    }
}

impl From<hixl_core::MemType> for MemType {
    fn from(m: hixl_core::MemType) -> Self {
        match m {
            hixl_core::MemType::Host => MemType::HOST,
            hixl_core::MemType::Device | hixl_core::MemType::Cuda(_) => MemType::DEVICE,
        }
    }
}

/// Direction of a transfer: `TransferOp.READ` copies remote -> local, `TransferOp.WRITE`
/// local -> remote. Both are one-sided: the peer runs no application code.
#[pyclass(eq, eq_int, frozen, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms)]
pub enum TransferOp {
    READ = 0,
    WRITE = 1,
}

impl From<TransferOp> for hixl_core::TransferOp {
    fn from(o: TransferOp) -> Self {
        match o {
            TransferOp::READ => hixl_core::TransferOp::Read,
            TransferOp::WRITE => hixl_core::TransferOp::Write,
        }
    }
}

/// State of a transfer request: `WAITING` (0, in flight), `COMPLETED` (1, every byte is at its
/// destination, and a notify attached to it delivered), `TIMEOUT` (2, its deadline passed) or
/// `FAILED` (3, see `TransferReq.result()`). The numbers are HIXL's and the same in Rust.
#[pyclass(eq, eq_int, frozen, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
#[allow(clippy::upper_case_acronyms)]
pub enum TransferStatus {
    WAITING = hixl_core::TransferStatus::Waiting as isize,
    COMPLETED = hixl_core::TransferStatus::Completed as isize,
    TIMEOUT = hixl_core::TransferStatus::Timeout as isize,
    FAILED = hixl_core::TransferStatus::Failed as isize,
}

impl From<hixl_core::TransferStatus> for TransferStatus {
    fn from(s: hixl_core::TransferStatus) -> Self {
        match s {
            hixl_core::TransferStatus::Waiting => TransferStatus::WAITING,
            hixl_core::TransferStatus::Completed => TransferStatus::COMPLETED,
            hixl_core::TransferStatus::Timeout => TransferStatus::TIMEOUT,
            hixl_core::TransferStatus::Failed => TransferStatus::FAILED,
        }
    }
}

/// State of a link, as `Hixl.get_async_connect_status` reports it: `NOT_CONNECT` (none:
/// never connected, disconnected, or a synchronous connect failed), `CONNECTING`, `CONNECTED`
/// (linked and alive) or `CONNECT_FAILED` (a `connect_async` failed, or the link died).
#[pyclass(eq, eq_int, frozen, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
#[allow(clippy::upper_case_acronyms, non_camel_case_types)]
pub enum AsyncConnectStatus {
    NOT_CONNECT = 0,
    CONNECTING = 1,
    CONNECTED = 2,
    CONNECT_FAILED = 3,
}

impl From<hixl_core::ConnectStatus> for AsyncConnectStatus {
    fn from(s: hixl_core::ConnectStatus) -> Self {
        match s {
            hixl_core::ConnectStatus::NotConnect => AsyncConnectStatus::NOT_CONNECT,
            hixl_core::ConnectStatus::Connecting => AsyncConnectStatus::CONNECTING,
            hixl_core::ConnectStatus::Connected => AsyncConnectStatus::CONNECTED,
            hixl_core::ConnectStatus::ConnectFailed => AsyncConnectStatus::CONNECT_FAILED,
        }
    }
}

/// A memory range: `MemDesc(addr, length)`, both ints >= 0 (`ParamInvalid`
/// otherwise). What `Hixl.register_mem` takes and `Hixl.remote_mems` returns (there: a range
/// in the peer's address space). Attributes `addr`, `len` and `length` (the same as `len`).
#[pyclass(frozen, eq, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct MemDesc {
    /// Start address.
    #[pyo3(get)]
    pub addr: u64,
    /// Length in bytes.
    #[pyo3(get)]
    pub len: u64,
}

#[pymethods]
impl MemDesc {
    #[new]
    fn py_new(addr: &Bound<'_, PyAny>, length: &Bound<'_, PyAny>) -> PyResult<Self> {
        Ok(MemDesc { addr: uint("addr", addr)?, len: uint("length", length)? })
    }
    /// Same as `len`.
    #[getter]
    fn length(&self) -> u64 {
        self.len
    }
    fn __repr__(&self) -> String {
        format!("MemDesc(addr=0x{:x}, length={})", self.addr, self.len)
    }
}

/// A region a peer registered, as `Hixl.remote_regions` and `Hixl.remote_region` return it:
/// `addr` and `len` (also `length`) in the peer's address space, `name` ("": none),
/// `mem_type`, and `writable` (False: registered read-only, so this engine may only READ it).
#[pyclass(frozen, eq, hash, module = "hixl._hixl")]
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct RemoteRegion {
    /// Start address in the peer's address space.
    #[pyo3(get)]
    pub addr: u64,
    /// Length in bytes.
    #[pyo3(get)]
    pub len: u64,
    /// The name it was registered under (empty: none).
    #[pyo3(get)]
    pub name: String,
    /// Its memory type (domain).
    #[pyo3(get)]
    pub mem_type: MemType,
    /// Whether this engine may WRITE it (False: the peer registered it read-only).
    #[pyo3(get)]
    pub writable: bool,
    /// Its memory domain, as the peer's table says ("host", "cuda:N").
    pub domain: hixl_core::Domain,
}

impl From<hixl_core::RemoteRegion> for RemoteRegion {
    fn from(r: hixl_core::RemoteRegion) -> Self {
        RemoteRegion {
            addr: r.addr,
            len: r.len,
            name: r.name,
            mem_type: r.mem_type.into(),
            writable: r.writable,
            domain: r.mem_type,
        }
    }
}

#[pymethods]
impl RemoteRegion {
    /// The memory domain: "host", or "cuda:N" for memory of the peer's CUDA device N.
    #[getter]
    fn domain(&self) -> String {
        self.domain.to_string()
    }

    /// Same as `len`.
    #[getter]
    fn length(&self) -> u64 {
        self.len
    }
    fn __repr__(&self) -> String {
        format!(
            "RemoteRegion(addr=0x{:x}, length={}, name={:?}, mem_type=MemType.{}, writable={})",
            self.addr,
            self.len,
            self.name,
            hixl_core::MemType::from(self.mem_type).as_str().to_uppercase(),
            if self.writable { "True" } else { "False" }
        )
    }
}

/// One descriptor of a batch: `TransferOpDesc(local_addr, remote_addr, length)`, all ints >= 0
/// (`ParamInvalid` otherwise): `length` bytes between `local_addr` (inside a region registered
/// on this engine) and `remote_addr` (inside a region the peer registered). A plain
/// `(local_addr, remote_addr, length)` tuple or an (N, 3) numpy array works as well. Attributes
/// `local_addr`, `remote_addr`, `len` and `length` (the same as `len`).
#[pyclass(frozen, eq, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TransferOpDesc {
    /// Address in this engine's registered memory.
    #[pyo3(get)]
    pub local_addr: u64,
    /// Address in the peer's registered memory.
    #[pyo3(get)]
    pub remote_addr: u64,
    /// Length in bytes.
    #[pyo3(get)]
    pub len: u64,
}

#[pymethods]
impl TransferOpDesc {
    #[new]
    fn py_new(
        local_addr: &Bound<'_, PyAny>,
        remote_addr: &Bound<'_, PyAny>,
        length: &Bound<'_, PyAny>,
    ) -> PyResult<Self> {
        Ok(TransferOpDesc {
            local_addr: uint("local_addr", local_addr)?,
            remote_addr: uint("remote_addr", remote_addr)?,
            len: uint("length", length)?,
        })
    }
    /// Same as `len`.
    #[getter]
    fn length(&self) -> u64 {
        self.len
    }
    fn __repr__(&self) -> String {
        format!(
            "TransferOpDesc(local_addr=0x{:x}, remote_addr=0x{:x}, length={})",
            self.local_addr, self.remote_addr, self.len
        )
    }
}

impl From<TransferOpDesc> for hixl_core::TransferOpDesc {
    fn from(d: TransferOpDesc) -> Self {
        hixl_core::TransferOpDesc { local_addr: d.local_addr, remote_addr: d.remote_addr, len: d.len }
    }
}

/// A notification: `NotifyDesc(name, msg="")`. `name` (str, at most 1,024 bytes) says what it
/// is about, `msg` (str, at most 1 MiB) carries the message. Sent with `Hixl.send_notify` or
/// attached to an async transfer (`notify=`), received with `Hixl.get_notifies` or
/// `Hixl.wait_notifies`; a received one's `peer` is the engine id of the connection it came on.
/// Equality and hash compare `name` and `msg` only.
#[pyclass(frozen, eq, hash, module = "hixl._hixl")]
#[derive(Clone)]
pub struct NotifyDesc {
    /// What it is about (receivers can wait for a name: `Hixl.wait_notifies(.., name=)`).
    #[pyo3(get)]
    pub name: String,
    /// The message ("" by default).
    #[pyo3(get)]
    pub msg: String,
    /// Who sent it: for a received notification the engine id ("ip:port", "ip#pid") of the
    /// connection it arrived on, as that connection's handshake established it (with a cluster
    /// secret, only a member can have sent it); "" for one built here.
    #[pyo3(get)]
    pub peer: String,
}

impl PartialEq for NotifyDesc {
    fn eq(&self, other: &Self) -> bool {
        (&self.name, &self.msg) == (&other.name, &other.msg)
    }
}

impl Eq for NotifyDesc {}

impl std::hash::Hash for NotifyDesc {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        (&self.name, &self.msg).hash(h)
    }
}

#[pymethods]
impl NotifyDesc {
    #[new]
    #[pyo3(signature = (name, msg = crate::args::Text(String::new())))]
    fn py_new(name: crate::args::Text, msg: crate::args::Text) -> Self {
        NotifyDesc { name: name.0, msg: msg.0, peer: String::new() }
    }
    fn __repr__(&self) -> String {
        if self.peer.is_empty() {
            format!("NotifyDesc(name={:?}, msg={:?})", self.name, self.msg)
        } else {
            format!("NotifyDesc(name={:?}, msg={:?}, peer={:?})", self.name, self.msg, self.peer)
        }
    }
}

impl From<NotifyDesc> for hixl_core::NotifyDesc {
    fn from(n: NotifyDesc) -> Self {
        hixl_core::NotifyDesc::new(n.name, n.msg)
    }
}

impl From<hixl_core::NotifyDesc> for NotifyDesc {
    fn from(n: hixl_core::NotifyDesc) -> Self {
        NotifyDesc { name: n.name, msg: n.msg, peer: n.peer }
    }
}

/// A strided descriptor: `StridedDesc(count, size, stride, remote_stride=None)`, `count`
/// elements of `size` bytes; element i is at `base + i * stride` locally and at
/// `remote_base + i * remote_stride` at the peer (`remote_stride` None: `stride`), so a
/// different `remote_stride` re-packs the layout on the way. All ints >= 0 (`ParamInvalid`
/// otherwise). The transfer calls check the rules: count >= 1, size >= 1, strides >= size,
/// bases and strides multiples of 64 bytes unless `hixl.strict_alignment=0`, and each side's
/// whole range inside one registered region. `nbytes` is `count * size`.
#[pyclass(frozen, eq, hash, module = "hixl._hixl")]
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct StridedDesc {
    /// Number of elements.
    #[pyo3(get)]
    pub count: u64,
    /// Bytes per element.
    #[pyo3(get)]
    pub size: u64,
    /// Bytes from one element to the next, locally.
    #[pyo3(get)]
    pub stride: u64,
    /// Bytes from one element to the next at the peer (None: `stride`).
    #[pyo3(get)]
    pub remote_stride: Option<u64>,
}

#[pymethods]
impl StridedDesc {
    #[new]
    #[pyo3(signature = (count, size, stride, remote_stride = None))]
    fn py_new(
        count: &Bound<'_, PyAny>,
        size: &Bound<'_, PyAny>,
        stride: &Bound<'_, PyAny>,
        remote_stride: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        Ok(StridedDesc {
            count: uint("count", count)?,
            size: uint("size", size)?,
            stride: uint("stride", stride)?,
            remote_stride: remote_stride.map(|r| uint("remote_stride", r)).transpose()?,
        })
    }
    /// Bytes moved (`count * size`).
    #[getter]
    fn nbytes(&self) -> u64 {
        self.count.saturating_mul(self.size)
    }
    fn __repr__(&self) -> String {
        format!(
            "StridedDesc(count={}, size={}, stride={}, remote_stride={})",
            self.count,
            self.size,
            self.stride,
            self.remote_stride.map_or("None".into(), |r| r.to_string())
        )
    }
}

impl From<StridedDesc> for hixl_core::StridedDesc {
    fn from(d: StridedDesc) -> Self {
        hixl_core::StridedDesc {
            count: d.count,
            size: d.size,
            stride: d.stride,
            remote_stride: d.remote_stride,
        }
    }
}

/// The `(key, value)` pairs of an `options` argument: a dict or another mapping (None: none);
/// anything else is ParamInvalid naming it.
pub(crate) fn option_items<'py>(
    options: Option<&Bound<'py, PyAny>>,
) -> PyResult<Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)>> {
    let Some(o) = options else { return Ok(Vec::new()) };
    if let Ok(d) = o.downcast::<pyo3::types::PyDict>() {
        return Ok(d.iter().collect());
    }
    if let Ok(m) = o.downcast::<pyo3::types::PyMapping>() {
        return m.items()?.iter().map(|kv| kv.extract()).collect();
    }
    Err(crate::errors::param(format!(
        "options={} ({}) is not a dict: pass {{key: value}}, e.g. {{\"hixl.tcp.streams\": 4}}",
        o.repr()?,
        o.get_type().name()?
    )))
}

/// An option value as the engine takes it: str as it is, bool as "1"/"0", int in decimal;
/// anything else is ParamInvalid naming the key and the type.
pub(crate) fn option_text(key: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    if let Ok(s) = v.downcast::<pyo3::types::PyString>() {
        return Ok(s.to_str()?.to_string());
    }
    if let Ok(b) = v.downcast::<pyo3::types::PyBool>() {
        return Ok(if b.is_true() { "1" } else { "0" }.to_string());
    }
    if v.downcast::<pyo3::types::PyInt>().is_ok() {
        return Ok(v.str()?.to_str()?.to_string());
    }
    Err(crate::errors::param(format!(
        "option {key}={} has type {}: expected str, int or bool",
        v.repr()?,
        v.get_type().name()?
    )))
}

/// `.name`, as Python's enums have it: the member's name.
macro_rules! member_names {
    ($($ty:ident { $($member:ident),* })*) => {$(
        #[pymethods]
        impl $ty {
            /// The member's name, as Python enums have it (`"COMPLETED"`).
            #[getter]
            fn name(&self) -> &'static str {
                match self {
                    $($ty::$member => stringify!($member),)*
                }
            }
        }
    )*};
}

member_names! {
    MemType { HOST, DEVICE }
    TransferOp { READ, WRITE }
    TransferStatus { WAITING, COMPLETED, TIMEOUT, FAILED }
    AsyncConnectStatus { NOT_CONNECT, CONNECTING, CONNECTED, CONNECT_FAILED }
}

/// A transfer direction: `TransferOp.READ` / `TransferOp.WRITE`, or its name as a str in any
/// case (`"WRITE"`, `"write"`), as `TransferOp.WRITE.name` gives it.
#[derive(Clone, Copy)]
pub struct OpArg(pub TransferOp);

impl<'py> FromPyObject<'py> for OpArg {
    fn extract_bound(ob: &Bound<'py, PyAny>) -> PyResult<Self> {
        if let Ok(op) = ob.downcast::<TransferOp>() {
            return Ok(OpArg(*op.get()));
        }
        if let Ok(s) = ob.downcast::<PyString>() {
            let s = s.to_str()?;
            if s.eq_ignore_ascii_case("READ") {
                return Ok(OpArg(TransferOp::READ));
            }
            if s.eq_ignore_ascii_case("WRITE") {
                return Ok(OpArg(TransferOp::WRITE));
            }
        }
        Err(PyTypeError::new_err(format!(
            "{} is not a TransferOp: pass TransferOp.READ or TransferOp.WRITE, or the name \"READ\" \
             or \"WRITE\" (any case)",
            shown(ob)
        )))
    }
}

impl From<OpArg> for hixl_core::TransferOp {
    fn from(o: OpArg) -> Self {
        o.0.into()
    }
}
