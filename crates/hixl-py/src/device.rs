//! Device memory of Python objects, found without importing torch or CuPy: the CUDA Array
//! Interface (`__cuda_array_interface__`: torch CUDA tensors, CuPy, Numba, ...), torch tensors
//! by `data_ptr()`, and DLPack (`__dlpack_device__` = kDLCUDA, then the capsule of
//! `__dlpack__()`). The range found here is then checked by the engine (through the CUDA
//! driver, loaded at run time) like any other registration; without CUDA that check raises
//! `Unsupported` saying CUDA was not found.

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::errors;
use crate::keep::{Exported, KeepAlive};

/// DLPack's device type of CUDA device memory.
const KDL_CUDA: i64 = 2;

/// Device memory of an object, or None when the object does not say it is device memory.
pub fn export(obj: &Bound<'_, PyAny>) -> PyResult<Option<Exported>> {
    if let Ok(cai) = obj.getattr("__cuda_array_interface__") {
        let (addr, len, ro) = from_cai(&cai)?;
        let domain = torch_ordinal(obj).map(hixl_core::Domain::Cuda).unwrap_or(hixl_core::Domain::Device);
        let keep = KeepAlive::Object(obj.clone().unbind());
        return Ok(Some(Exported { addr, len, keep, read_only: ro, domain }));
    }
    if obj.hasattr("data_ptr")? && obj.hasattr("untyped_storage")? {
        let device = obj.getattr("device")?;
        let kind: String = device.getattr("type")?.extract()?;
        if kind == "cpu" {
            return Ok(None);
        }
        if kind != "cuda" {
            return Err(errors::to_py(hixl_core::Error::new(
                hixl_core::Status::Unsupported,
                format!("tensor on device {kind:?}: hixl registers CPU and CUDA tensors only"),
            )));
        }
        if !obj.call_method0("is_contiguous")?.extract::<bool>()? {
            return Err(errors::param("tensor is not contiguous: call .contiguous() first"));
        }
        let addr: u64 = obj.call_method0("data_ptr")?.extract()?;
        let numel: u64 = obj.call_method0("numel")?.extract()?;
        let esize: u64 = obj.call_method0("element_size")?.extract()?;
        let domain = torch_ordinal(obj).map(hixl_core::Domain::Cuda).unwrap_or(hixl_core::Domain::Device);
        let keep = KeepAlive::Object(obj.clone().unbind());
        return Ok(Some(Exported { addr, len: numel * esize, keep, read_only: false, domain }));
    }
    if let Ok(dev) = obj.call_method0("__dlpack_device__") {
        let (kind, id): (i64, i64) = dev.extract()?;
        if kind != KDL_CUDA {
            return Ok(None);
        }
        let capsule = obj.call_method0("__dlpack__")?;
        let (addr, len) = from_dlpack(&capsule)?;
        let domain = u8::try_from(id).map(hixl_core::Domain::Cuda).unwrap_or(hixl_core::Domain::Device);
        // The capsule holds the producer's tensor: kept, it keeps the memory alive; dropped
        // unconsumed, its own destructor releases the tensor.
        let keep = KeepAlive::Object(capsule.unbind());
        return Ok(Some(Exported { addr, len, keep, read_only: false, domain }));
    }
    Ok(None)
}

/// The CUDA device index of a torch tensor (or CuPy array: `.device.id`), when it says one.
fn torch_ordinal(obj: &Bound<'_, PyAny>) -> Option<u8> {
    let dev = obj.getattr("device").ok()?;
    let idx = dev.getattr("index").or_else(|_| dev.getattr("id")).ok()?;
    idx.extract::<u8>().ok()
}

/// Bytes per element of an array-interface type string ("<f4", "|u1", "<c16").
pub fn itemsize(typestr: &str) -> Option<u64> {
    let digits = typestr.get(2..)?;
    digits.parse::<u64>().ok().filter(|n| *n > 0)
}

/// Whether `strides` (bytes) are those of a C-contiguous array of `shape` and `itemsize`
/// (dimensions of length 1 may have any stride).
pub fn c_contiguous(shape: &[u64], strides: &[i64], itemsize: u64) -> bool {
    if shape.len() != strides.len() {
        return false;
    }
    let mut expect = itemsize as i64;
    for (n, s) in shape.iter().zip(strides).rev() {
        if *n != 1 && *s != expect {
            return false;
        }
        expect = expect.saturating_mul(*n as i64);
    }
    true
}

/// `(addr, len, read_only)` of a CUDA Array Interface dict (version 2 or 3).
fn from_cai(cai: &Bound<'_, PyAny>) -> PyResult<(u64, u64, bool)> {
    let d = cai.downcast::<PyDict>().map_err(|_| errors::param("__cuda_array_interface__ is not a dict"))?;
    let get = |k: &str| -> PyResult<Bound<'_, PyAny>> {
        d.get_item(k)?.ok_or_else(|| errors::param(format!("__cuda_array_interface__ has no {k:?}")))
    };
    let data = get("data")?;
    let data = data
        .downcast::<PyTuple>()
        .map_err(|_| errors::param("__cuda_array_interface__['data'] is not a (ptr, read_only) tuple"))?;
    let addr: u64 = data.get_item(0)?.extract()?;
    let read_only: bool = data.get_item(1)?.extract()?;
    let shape: Vec<u64> = get("shape")?.extract()?;
    let typestr: String = get("typestr")?.extract()?;
    let size = itemsize(&typestr).ok_or_else(|| {
        errors::param(format!("__cuda_array_interface__ typestr {typestr:?} has no item size"))
    })?;
    if let Some(strides) = d.get_item("strides")?.filter(|s| !s.is_none()) {
        let strides: Vec<i64> = strides.extract()?;
        if !c_contiguous(&shape, &strides, size) {
            return Err(errors::param(format!(
                "device array of shape {shape:?} with strides {strides:?} is not C-contiguous: call .contiguous() first"
            )));
        }
    }
    if d.get_item("mask")?.is_some_and(|m| !m.is_none()) {
        return Err(errors::param("a masked device array cannot be registered"));
    }
    let len = shape.iter().try_fold(size, |a, n| a.checked_mul(*n));
    let len = len.ok_or_else(|| errors::param(format!("device array of shape {shape:?} is too large")))?;
    Ok((addr, len, read_only))
}

/// DLPack's `DLTensor` (ABI of DLPack 0.x and 1.x alike for this legacy, unversioned capsule).
#[repr(C)]
struct DLTensor {
    data: *mut std::ffi::c_void,
    device_type: i32,
    device_id: i32,
    ndim: i32,
    dtype_code: u8,
    dtype_bits: u8,
    dtype_lanes: u16,
    shape: *const i64,
    strides: *const i64,
    byte_offset: u64,
}

/// `(addr, len)` of a `"dltensor"` capsule, which is read and left unconsumed.
fn from_dlpack(capsule: &Bound<'_, PyAny>) -> PyResult<(u64, u64)> {
    // SAFETY: PyCapsule_GetPointer checks the object is a capsule named "dltensor" (else NULL
    // with an exception set) and returns its pointer; we hold the GIL and a reference.
    let p = unsafe { ffi::PyCapsule_GetPointer(capsule.as_ptr(), c"dltensor".as_ptr()) };
    if p.is_null() {
        let why = PyErr::take(capsule.py()).map(|e| e.to_string()).unwrap_or_default();
        return Err(errors::param(format!("__dlpack__() did not return a \"dltensor\" capsule ({why})")));
    }
    // SAFETY: a "dltensor" capsule points to a DLManagedTensor, whose first member is the
    // DLTensor; it stays valid while the capsule lives (we hold it).
    let t = unsafe { &*(p as *const DLTensor) };
    let ndim = usize::try_from(t.ndim).map_err(|_| errors::param("DLPack tensor with negative ndim"))?;
    // SAFETY: shape (and strides, unless NULL) point to `ndim` int64 values owned by the tensor.
    let shape: Vec<i64> =
        if ndim == 0 { vec![] } else { unsafe { std::slice::from_raw_parts(t.shape, ndim) }.to_vec() };
    let shape: Vec<u64> = shape.iter().map(|n| (*n).max(0) as u64).collect();
    let bits = t.dtype_bits as u64 * t.dtype_lanes.max(1) as u64;
    if bits % 8 != 0 {
        return Err(errors::param(format!("DLPack element of {bits} bits is not whole bytes")));
    }
    let size = bits / 8;
    if !t.strides.is_null() && ndim > 0 {
        // SAFETY: see above; DLPack strides count elements.
        let st: Vec<i64> = unsafe { std::slice::from_raw_parts(t.strides, ndim) }.to_vec();
        let bytes: Vec<i64> = st.iter().map(|s| s.saturating_mul(size as i64)).collect();
        if !c_contiguous(&shape, &bytes, size) {
            return Err(errors::param(format!(
                "DLPack tensor of shape {shape:?} with strides {st:?} is not C-contiguous"
            )));
        }
    }
    let len = shape.iter().try_fold(size, |a, n| a.checked_mul(*n));
    let len = len.ok_or_else(|| errors::param(format!("DLPack tensor of shape {shape:?} is too large")))?;
    Ok((t.data as u64 + t.byte_offset, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn item_sizes_and_contiguity() {
        assert_eq!(itemsize("<f4"), Some(4));
        assert_eq!(itemsize("|u1"), Some(1));
        assert_eq!(itemsize("<c16"), Some(16));
        assert_eq!(itemsize("<f"), None);
        assert_eq!(itemsize("<f0"), None);
        assert!(c_contiguous(&[2, 3], &[12, 4], 4));
        assert!(c_contiguous(&[1, 3], &[999, 4], 4));
        assert!(!c_contiguous(&[2, 3], &[4, 8], 4));
        assert!(!c_contiguous(&[2, 3], &[12], 4));
    }
}

/// What this process can do with CUDA, as a dict: `available` (bool), `reason` (why not, e.g.
/// "CUDA was not found: libcuda.so.1 could not be loaded (...)"), `driver_version` (int, 12040
/// for 12.4; 0 without CUDA), `devices` (a list of dicts: `ordinal`, `name`, `total_mem`,
/// `pci_bus_id`, `compute_capability` as (major, minor), `unified_addressing`). Loads the
/// driver on first use; never raises for a missing CUDA.
#[pyfunction]
pub fn cuda_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let i = py.allow_threads(hixl_core::cuda_info);
    let d = PyDict::new(py);
    d.set_item("available", i.available)?;
    d.set_item("reason", i.reason)?;
    d.set_item("driver_version", i.driver_version)?;
    let devices = pyo3::types::PyList::empty(py);
    for g in i.devices {
        let x = PyDict::new(py);
        x.set_item("ordinal", g.ordinal)?;
        x.set_item("name", g.name)?;
        x.set_item("total_mem", g.total_mem)?;
        x.set_item("pci_bus_id", g.pci_bus_id)?;
        x.set_item("compute_capability", g.compute_capability)?;
        x.set_item("unified_addressing", g.unified_addressing)?;
        devices.append(x)?;
    }
    d.set_item("devices", devices)?;
    Ok(d)
}

/// Device memory allocated by hixl itself (`cuMemAlloc`), for tools and tests that have no
/// torch or CuPy: `hixl.cuda_alloc(size, device=0, fill=0)` returns one. It implements the CUDA
/// Array Interface (a 1-D uint8 array), so `Hixl.register` takes it and so do torch
/// (`torch.as_tensor(buf, device="cuda")`) and CuPy. `read` and `write` copy synchronously
/// between it and host bytes. Freed when the last reference goes (a registration keeps one).
#[pyclass(frozen, module = "hixl._hixl")]
pub struct DeviceBuffer {
    buf: hixl_core::DeviceBuffer,
}

#[pymethods]
impl DeviceBuffer {
    /// Start address (a device pointer).
    #[getter]
    fn addr(&self) -> u64 {
        self.buf.addr()
    }

    /// The CUDA device ordinal.
    #[getter]
    fn device(&self) -> u8 {
        self.buf.ordinal()
    }

    /// Length in bytes.
    fn __len__(&self) -> usize {
        self.buf.len() as usize
    }

    /// The CUDA Array Interface (version 3) of a 1-D uint8 array over the whole buffer.
    #[getter]
    fn __cuda_array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.buf.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.buf.addr(), false))?;
        d.set_item("strides", py.None())?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// Copies `n` bytes from `offset` to host memory and returns them (GIL released).
    fn read<'py>(
        &self,
        py: Python<'py>,
        offset: u64,
        n: usize,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let mut out = vec![0u8; n];
        py.allow_threads(|| self.buf.read_at(offset, &mut out)).map_err(errors::to_py)?;
        Ok(pyo3::types::PyBytes::new(py, &out))
    }

    /// Copies `data` (any bytes-like object) to `offset` (GIL released while copying).
    fn write(&self, py: Python<'_>, offset: u64, data: &[u8]) -> PyResult<()> {
        let data = data.to_vec();
        py.allow_threads(|| self.buf.write_at(offset, &data)).map_err(errors::to_py)
    }

    fn __repr__(&self) -> String {
        format!(
            "DeviceBuffer(cuda:{}, addr=0x{:x}, len={})",
            self.buf.ordinal(),
            self.buf.addr(),
            self.buf.len()
        )
    }
}

/// Allocates `size` bytes (at least 1) of memory on CUDA device `device`, every byte set to
/// `fill`, as a `DeviceBuffer`. Raises `Unsupported` (saying CUDA was not found) without CUDA,
/// `ParamInvalid` for a size of 0 or a device that does not exist, `ResourceExhausted` when the
/// device is out of memory. The GIL is released while it allocates.
#[pyfunction]
#[pyo3(signature = (size, device = 0, fill = 0))]
pub fn cuda_alloc(py: Python<'_>, size: u64, device: u8, fill: u8) -> PyResult<DeviceBuffer> {
    let buf = py.allow_threads(|| hixl_core::DeviceBuffer::new(device, size, fill)).map_err(errors::to_py)?;
    Ok(DeviceBuffer { buf })
}
