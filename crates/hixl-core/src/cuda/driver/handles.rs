//! Safe wrappers of the CUDA driver's query calls: each takes and returns plain values, and
//! the driver answers a bad device, attribute or address with an error code (never by
//! touching memory the caller named), so the calls are memory-safe whatever their arguments.
//! The rest of the CUDA code calls these instead of the raw entry points of `driver`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::os::fd::{FromRawFd, OwnedFd};

use super::{self as driver, CuDevice, CuDevicePtr, CuHandle, CuResult, Driver, IpcMemHandle};

/// A pointer attribute whose value is a 4-byte (unsigned) int, the only kinds hixl asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PointerAttr {
    /// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (`CU_MEMORYTYPE_*`).
    MemoryType,
    /// `CU_POINTER_ATTRIBUTE_IS_MANAGED`.
    IsManaged,
    /// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL`.
    DeviceOrdinal,
    /// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE`.
    IsLegacyIpcCapable,
}

impl PointerAttr {
    fn code(self) -> c_int {
        match self {
            PointerAttr::MemoryType => driver::POINTER_ATTRIBUTE_MEMORY_TYPE,
            PointerAttr::IsManaged => driver::POINTER_ATTRIBUTE_IS_MANAGED,
            PointerAttr::DeviceOrdinal => driver::POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            PointerAttr::IsLegacyIpcCapable => driver::POINTER_ATTRIBUTE_IS_LEGACY_IPC_CAPABLE,
        }
    }
}

impl Driver {
    /// `cuDriverGetVersion` (0 when the call fails).
    pub(crate) fn version(&self) -> c_int {
        let mut v: c_int = 0;
        // SAFETY: a valid out-parameter.
        unsafe { (self.driver_get_version)(&mut v) };
        v
    }

    /// `cuDeviceGet`: the device of `ordinal` (an error code for one that does not exist).
    pub(crate) fn device(&self, ordinal: c_int) -> Result<CuDevice, CuResult> {
        let mut dev: CuDevice = 0;
        // SAFETY: a valid out-parameter; a bad ordinal is refused with an error code.
        let rc = unsafe { (self.device_get)(&mut dev, ordinal) };
        if rc == driver::SUCCESS {
            Ok(dev)
        } else {
            Err(rc)
        }
    }

    /// `cuDeviceGetName`.
    pub(crate) fn device_name(&self, dev: CuDevice) -> Result<String, CuResult> {
        let mut name = [0 as c_char; 256];
        // SAFETY: the buffer holds 256 bytes and the driver writes at most 255, NUL included.
        let rc = unsafe { (self.device_get_name)(name.as_mut_ptr(), 255, dev) };
        if rc != driver::SUCCESS {
            return Err(rc);
        }
        // SAFETY: NUL-terminated by the driver (and the last byte is never written).
        Ok(unsafe { CStr::from_ptr(name.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// `cuDeviceGetAttribute`: an int attribute of `dev`.
    pub(crate) fn device_attribute(&self, attr: c_int, dev: CuDevice) -> Result<c_int, CuResult> {
        let mut v: c_int = 0;
        // SAFETY: every device attribute is an int, written to a valid out-parameter; an
        // unknown attribute or device is refused with an error code.
        let rc = unsafe { (self.device_get_attribute)(&mut v, attr, dev) };
        if rc == driver::SUCCESS {
            Ok(v)
        } else {
            Err(rc)
        }
    }

    /// `cuDeviceTotalMem` (0 when the call fails).
    pub(crate) fn device_total_mem(&self, dev: CuDevice) -> usize {
        let mut total: usize = 0;
        // SAFETY: a valid out-parameter.
        unsafe { (self.device_total_mem)(&mut total, dev) };
        total
    }

    /// `cuPointerGetAttribute` of `addr` (needs a current context): an address CUDA does not
    /// know is an error code, not a fault (the driver only looks the address up).
    pub(crate) fn pointer_attribute(&self, attr: PointerAttr, addr: CuDevicePtr) -> Result<c_uint, CuResult> {
        let mut v: c_uint = 0;
        // SAFETY: every `PointerAttr` is a 4-byte int, written to a valid out-parameter.
        let rc = unsafe {
            (self.pointer_get_attribute)((&mut v as *mut c_uint).cast::<c_void>(), attr.code(), addr)
        };
        if rc == driver::SUCCESS {
            Ok(v)
        } else {
            Err(rc)
        }
    }

    /// `cuMemGetAddressRange`: the allocation `addr` lies in, (base, size).
    pub(crate) fn address_range(&self, addr: CuDevicePtr) -> Result<(CuDevicePtr, usize), CuResult> {
        let (mut base, mut size): (CuDevicePtr, usize) = (0, 0);
        // SAFETY: valid out-parameters; the driver only looks the address up.
        let rc = unsafe { (self.mem_get_address_range)(&mut base, &mut size, addr) };
        if rc == driver::SUCCESS {
            Ok((base, size))
        } else {
            Err(rc)
        }
    }

    /// `cuIpcGetMemHandle` of the allocation at `base` (needs its device's context current).
    pub(crate) fn ipc_mem_handle(&self, base: CuDevicePtr) -> Result<IpcMemHandle, CuResult> {
        let mut h = IpcMemHandle { reserved: [0; 64] };
        // SAFETY: a valid out-parameter; a base that is no device allocation is refused.
        let rc = unsafe { (self.ipc_get_mem_handle)(&mut h, base) };
        if rc == driver::SUCCESS {
            Ok(h)
        } else {
            Err(rc)
        }
    }

    /// Whether this thread has a CUDA context current (`cuCtxGetCurrent`).
    pub(crate) fn has_current_context(&self) -> bool {
        let mut current: CuHandle = std::ptr::null_mut();
        // SAFETY: a valid out-parameter.
        unsafe { (self.ctx_get_current)(&mut current) };
        !current.is_null()
    }

    /// A result code as Ok/Err with the text naming `what` (see [`Driver::check`]).
    pub(crate) fn check_res<T>(&self, r: Result<T, CuResult>, what: &str) -> Result<T, String> {
        r.map_err(|rc| self.check(rc, what).expect_err("an error code"))
    }
}

/// Exports `[base, base + size)` of device memory as a dma-buf through `get` (the driver's
/// `cuMemGetHandleForAddressRange`, see [`driver::get_handle_for_address_range`]): the owned
/// descriptor, or the result code (`what` names the call in the caller's error). The driver
/// only looks the range up and answers a bad one with an error code; the caller has the
/// device's context current.
pub(crate) fn export_dmabuf(
    get: driver::GetHandleForAddressRange,
    base: CuDevicePtr,
    size: usize,
) -> Result<Option<OwnedFd>, CuResult> {
    let mut fd: c_int = -1;
    // SAFETY: `handle` points at an int, as the dma-buf handle type requires.
    let rc = unsafe {
        get((&mut fd as *mut c_int).cast(), base, size, driver::MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0)
    };
    if rc != driver::SUCCESS {
        return Err(rc);
    }
    // SAFETY: a non-negative descriptor is a fresh one the driver made for us; we own it
    // from here on.
    Ok((fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd) }))
}
