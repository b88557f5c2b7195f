//! What a registration keeps alive until deregistration, and the memory an object exports: a
//! leaf that `buffer.rs` (host memory) and `device.rs` (device memory) both build and the engine
//! reads, so neither of those two imports the other's types.

use pyo3::ffi;
use pyo3::prelude::*;

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
pub fn tensor_keep(obj: &Bound<'_, PyAny>) -> PyResult<TensorKeep> {
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

impl BufferView {
    /// Takes a view to release on drop.
    ///
    /// # Safety
    /// `view` was filled by a successful `PyObject_GetBuffer` and is not released elsewhere.
    pub unsafe fn from_filled(view: Box<ffi::Py_buffer>) -> BufferView {
        BufferView(view)
    }
}

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
