//! Keeping Python objects alive while their memory is registered: buffer-protocol exports
//! (numpy, bytearray, memoryview, mmap), torch CPU tensors, and device memory (`device.rs`).

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors;

/// What a registration keeps alive until deregistration.
pub enum KeepAlive {
    /// A buffer-protocol export, released (under the GIL) on drop.
    Buffer(#[allow(dead_code)] BufferView),
    /// An object without the buffer protocol: a strong reference.
    Object(#[allow(dead_code)] Py<PyAny>),
    /// A torch tensor: the tensor and its storage (see [`TensorKeep`]).
    Tensor(TensorKeep),
}

/// What a registered torch tensor keeps: the tensor and its storage, so that the memory
/// outlives the tensor being dropped or re-pointed (`t.set_(...)`, `t.data = ...`), and the
/// storage's address and length when it was registered. torch cannot be told not to resize a
/// storage, and a `resize_()` that grows it reallocates it and frees the registered memory:
/// [`TensorKeep::moved`] finds that (the engine checks it at each transfer and deregistration).
pub struct TensorKeep {
    _tensor: Py<PyAny>,
    storage: Py<PyAny>,
    /// The storage's `(data_ptr(), nbytes())` at registration, when it has both (real torch).
    at: Option<(u64, u64)>,
}

impl TensorKeep {
    /// Whether this keep can tell a resize (its storage reports its address and length).
    pub fn checked(&self) -> bool {
        self.at.is_some()
    }

    /// A clone of the storage and what it held at registration, to check without a lock held.
    pub fn probe(&self, py: Python<'_>) -> Option<(Py<PyAny>, u64, u64)> {
        self.at.map(|(a, n)| (self.storage.clone_ref(py), a, n))
    }
}

/// Why the storage `probe` took no longer holds the registered memory, or None.
pub fn moved(py: Python<'_>, storage: &Py<PyAny>, addr: u64, len: u64) -> PyResult<Option<String>> {
    let s = storage.bind(py);
    let now: u64 = s.call_method0("data_ptr")?.extract()?;
    let n: u64 = s.call_method0("nbytes")?.extract()?;
    if now == addr && n >= len {
        return Ok(None);
    }
    Ok(Some(format!(
        "a registered torch tensor was resized: its storage held {len} bytes at {addr:#x} when it \
         was registered and now holds {n} bytes at {now:#x}, so the registered memory may be freed; \
         deregister a tensor before resize_(), then register it again"
    )))
}

/// The storage of a torch tensor and, when it reports them, its address and length.
fn tensor_keep(obj: &Bound<'_, PyAny>) -> PyResult<TensorKeep> {
    let storage = obj.call_method0("untyped_storage")?;
    let at = if storage.hasattr("data_ptr")? && storage.hasattr("nbytes")? {
        let a: Option<u64> = storage.call_method0("data_ptr").and_then(|v| v.extract()).ok();
        let n: Option<u64> = storage.call_method0("nbytes").and_then(|v| v.extract()).ok();
        a.zip(n)
    } else {
        None
    };
    Ok(TensorKeep { _tensor: obj.clone().unbind(), storage: storage.unbind(), at })
}

/// An exported `Py_buffer`.
pub struct BufferView(Box<ffi::Py_buffer>);

// SAFETY: the view is only created, read and released while holding the GIL (Drop attaches to
// the interpreter); the pointer it carries is plain memory that the engine registers.
unsafe impl Send for BufferView {}
// SAFETY: see above; no interior mutation happens outside the GIL.
unsafe impl Sync for BufferView {}

impl Drop for BufferView {
    fn drop(&mut self) {
        Python::with_gil(|_| {
            // SAFETY: the view was filled by a successful PyObject_GetBuffer and is released
            // exactly once, here, with the GIL held.
            unsafe { ffi::PyBuffer_Release(&mut *self.0) };
        });
    }
}

/// The memory of an object, as `export` finds it.
pub struct Exported {
    /// Start address.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
    /// What keeps it alive while registered.
    pub keep: KeepAlive,
    /// Whether the object says nothing may write it.
    pub read_only: bool,
    /// Host memory, or the device memory it says it is (`Device`: the engine finds which).
    pub domain: hixl_core::Domain,
}

/// Finds the memory of `obj`. `writable`: the memory must be writable (a read-write
/// registration: peers and local READs write into it); otherwise a read-only buffer (`bytes`,
/// a read-only numpy array) is accepted too, and `read_only` says that it is one. Device memory
/// (CUDA Array Interface, torch CUDA tensors, DLPack kDLCUDA) is found by `device::export`.
pub fn export(obj: &Bound<'_, PyAny>, writable: bool) -> PyResult<Exported> {
    let py = obj.py();
    // SAFETY: Py_buffer is a plain C struct; zeroed is the documented initial state.
    let mut view: Box<ffi::Py_buffer> = Box::new(unsafe { std::mem::zeroed() });
    let flags = if writable { ffi::PyBUF_WRITABLE } else { 0 } | ffi::PyBUF_C_CONTIGUOUS;
    // SAFETY: obj is a live object (we hold the GIL and a reference); view is writable.
    let rc = unsafe { ffi::PyObject_GetBuffer(obj.as_ptr(), &mut *view, flags) };
    if rc == 0 {
        let (addr, len, read_only) = (view.buf as u64, view.len as u64, view.readonly != 0);
        let keep = KeepAlive::Buffer(BufferView(view));
        return Ok(Exported { addr, len, keep, read_only, domain: hixl_core::Domain::Host });
    }
    let buf_err = PyErr::take(py);
    if let Some(dev) = crate::device::export(obj)? {
        if writable && dev.read_only {
            return Err(errors::param(
                "the device array is read-only: register it with access=\"r\"".to_string(),
            ));
        }
        return Ok(dev);
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("untyped_storage")? {
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(errors::param("tensor is not contiguous: call .contiguous() first"));
        }
        let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
        let numel: u64 = obj.call_method0("numel")?.extract()?;
        let esize: u64 = obj.call_method0("element_size")?.extract()?;
        let keep = KeepAlive::Tensor(tensor_keep(obj)?);
        return Ok(Exported {
            addr,
            len: numel * esize,
            keep,
            read_only: false,
            domain: hixl_core::Domain::Host,
        });
    }
    let why = buf_err.map(|e| e.to_string()).unwrap_or_default();
    let tname = obj.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into());
    if writable && is_read_only_buffer(obj) {
        return Err(errors::param(format!(
            "object of type {tname} is a read-only buffer: register it with access=\"r\" (peers may \
             then READ it, and nothing writes into it)"
        )));
    }
    Err(errors::param(format!(
        "object of type {tname} is not a writable C-contiguous buffer, a torch tensor or CUDA device memory ({why})"
    )))
}

/// Whether `obj` exports a C-contiguous buffer when writability is not asked for.
fn is_read_only_buffer(obj: &Bound<'_, PyAny>) -> bool {
    // SAFETY: as in `export`: a zeroed view, filled by CPython and released right away.
    unsafe {
        let mut view: ffi::Py_buffer = std::mem::zeroed();
        if ffi::PyObject_GetBuffer(obj.as_ptr(), &mut view, ffi::PyBUF_C_CONTIGUOUS) == 0 {
            ffi::PyBuffer_Release(&mut view);
            true
        } else {
            ffi::PyErr_Clear();
            false
        }
    }
}

/// Engine-allocated shared memory as a Python buffer: what `Hixl.alloc` returns (wrapped in a
/// numpy uint8 array, or bare when numpy is missing). It exports a writable 1-D byte buffer;
/// `addr` is its start address and `len()` its length (a multiple of 2 MiB). Every export holds
/// a reference, so the mapping outlives deregistration while any array still uses it.
#[pyclass(frozen, module = "hixl._hixl")]
pub struct ShmBuffer {
    pub mem: std::sync::Arc<hixl_core::SharedMem>,
}

#[pymethods]
impl ShmBuffer {
    /// Exports the mapping as a writable 1-D byte buffer.
    ///
    /// # Safety
    /// Called by CPython with a valid `view` to fill.
    unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: std::os::raw::c_int,
    ) -> PyResult<()> {
        let mem = &slf.get().mem;
        // SAFETY: `view` is valid (CPython's contract); the mapping lives as long as `slf`,
        // which FillInfo stores (with a new reference) in view.obj.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                mem.addr() as *mut std::os::raw::c_void,
                mem.len() as ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    /// Nothing to release: the view's reference to this object keeps the mapping alive.
    ///
    /// # Safety
    /// Called by CPython with the view it got from `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    /// Start address.
    #[getter]
    fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// Length in bytes.
    fn __len__(&self) -> usize {
        self.mem.len() as usize
    }
}
