//! Finding the memory of a Python object to register: buffer-protocol exports (numpy,
//! bytearray, memoryview, mmap), torch CPU tensors, and device memory (`device.rs`); and the
//! engine-allocated shared memory as a buffer (`ShmBuffer`). What a registration keeps alive is
//! in `keep.rs`.

use pyo3::ffi;
use pyo3::prelude::*;

use crate::errors;
use crate::keep::{tensor_keep, BufferView, Exported, KeepAlive};

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
        // SAFETY: `view` was just filled by a successful PyObject_GetBuffer; the BufferView is
        // its one owner and releases it once.
        let keep = KeepAlive::Buffer(unsafe { BufferView::from_filled(view) });
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
