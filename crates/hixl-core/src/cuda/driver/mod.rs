//! The CUDA driver API, loaded at run time: `libcuda.so.1` is opened with `dlopen` and the
//! handful of entry points hixl uses are looked up with `dlsym`. Nothing links against CUDA,
//! so a build and a process without it work; every use first asks [`Driver::get`], which says
//! why CUDA cannot be used (no library, a library without a symbol, no device) instead of
//! panicking.
//!
//! The function pointers here are called only in this folder, the crate's CUDA FFI layer,
//! each inside `unsafe` with the argument contract of the CUDA driver API documentation:
//! `handles` wraps the query calls as safe methods, `owned` holds every handle hixl makes as
//! a value that frees it on drop, and `runtime` is an engine's streams, events and completion
//! thread. The code above it (`cuda/mod.rs`, `dmabuf`, the staging and `cuda_ipc` code) has no
//! `unsafe` block.

pub(crate) mod handles;
pub(crate) mod owned;
pub(crate) mod runtime;

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::sync::OnceLock;

/// `CUresult`: 0 is success.
pub type CuResult = c_int;
/// `CUdevice`: a device ordinal after `cuDeviceGet`.
pub type CuDevice = c_int;
/// `CUdeviceptr`: a device address (64-bit).
pub type CuDevicePtr = u64;
/// `CUcontext`, `CUstream`, `CUevent`: opaque handles.
pub type CuHandle = *mut c_void;

/// `CUDA_SUCCESS`.
pub const SUCCESS: CuResult = 0;
/// `CUDA_ERROR_NO_DEVICE`.
pub const ERROR_NO_DEVICE: CuResult = 100;
/// `CUDA_ERROR_NOT_READY`: an event or stream has work pending.
pub const ERROR_NOT_READY: CuResult = 600;

/// `CU_POINTER_ATTRIBUTE_MEMORY_TYPE` (an unsigned int: `CU_MEMORYTYPE_*`).
pub const POINTER_ATTRIBUTE_MEMORY_TYPE: c_int = 2;
/// `CU_POINTER_ATTRIBUTE_IS_MANAGED` (a bool as unsigned int).
pub const POINTER_ATTRIBUTE_IS_MANAGED: c_int = 8;
/// `CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL` (an int).
pub const POINTER_ATTRIBUTE_DEVICE_ORDINAL: c_int = 9;
/// `CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE` (a bool as unsigned int).
pub const POINTER_ATTRIBUTE_IS_LEGACY_IPC_CAPABLE: c_int = 10;
/// `CU_MEMORYTYPE_HOST`.
pub const MEMORYTYPE_HOST: c_uint = 1;
/// `CU_MEMORYTYPE_DEVICE`.
pub const MEMORYTYPE_DEVICE: c_uint = 2;

/// `CU_DEVICE_ATTRIBUTE_PCI_BUS_ID`.
pub const ATTR_PCI_BUS_ID: c_int = 33;
/// `CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID`.
pub const ATTR_PCI_DEVICE_ID: c_int = 34;
/// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
pub const ATTR_UNIFIED_ADDRESSING: c_int = 41;
/// `CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID`.
pub const ATTR_PCI_DOMAIN_ID: c_int = 50;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR`.
pub const ATTR_CC_MAJOR: c_int = 75;
/// `CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR`.
pub const ATTR_CC_MINOR: c_int = 76;

/// `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`: 1 when the device exports its memory as dma-bufs.
/// Value from CUDA's `cuda.h` (`CUdevice_attribute`: "CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED =
/// 124, Device supports buffer sharing with dma_buf mechanism"), the same in NCCL's
/// `src/include/cudawrap.h` fallback for headers older than CUDA 11.7.
pub const ATTR_DMA_BUF_SUPPORTED: c_int = 124;
/// `CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD` (`CUmemRangeHandleType`): ask
/// `cuMemGetHandleForAddressRange` for a dma-buf file descriptor. Value from CUDA's `cuda.h`
/// (`CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD = 0x1`), as in NCCL's `cudawrap.h`.
pub const MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD: c_int = 1;
/// The optional entry point that exports device memory as a dma-buf (CUDA 11.7 and later).
pub const GET_HANDLE_FOR_ADDRESS_RANGE: &str = "cuMemGetHandleForAddressRange";

/// `cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr, size_t size,
/// CUmemRangeHandleType handleType, unsigned long long flags)` (`cuda.h`; NCCL's
/// `PFN_cuMemGetHandleForAddressRange_v11070`). For a dma-buf, `handle` points at an int.
pub type GetHandleForAddressRange =
    unsafe extern "C" fn(*mut c_void, CuDevicePtr, usize, c_int, std::ffi::c_ulonglong) -> CuResult;

/// `CU_STREAM_NON_BLOCKING`: no implicit synchronisation with the legacy default stream.
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// `CU_EVENT_DISABLE_TIMING`: the cheapest event, for completion only.
pub const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`.
pub const IPC_MEM_LAZY_ENABLE_PEER_ACCESS: c_uint = 1;
/// `CU_MEMHOSTREGISTER_PORTABLE`: pinned for every context.
pub const MEMHOSTREGISTER_PORTABLE: c_uint = 1;

/// `CU_MEMHOSTALLOC_PORTABLE`: pinned host memory usable from every context.
pub const MEMHOSTALLOC_PORTABLE: c_uint = 1;

/// `CUipcMemHandle`: 64 opaque bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcMemHandle {
    /// The handle's bytes.
    pub reserved: [u8; 64],
}

/// The library's file name (the driver's ABI-stable soname).
pub const LIBRARY: &str = "libcuda.so.1";

macro_rules! driver_table {
    ($( $field:ident = $sym:literal : fn($($arg:ty),*); )*) => {
        /// The driver entry points hixl uses.
        pub struct Driver {
            $( #[doc = concat!("`", $sym, "`")] pub $field: unsafe extern "C" fn($($arg),*) -> CuResult, )*
        }

        impl Driver {
            /// Looks every entry point up in the library `lib`.
            ///
            /// # Safety
            /// `lib` must be a live handle from `dlopen` of a CUDA driver library, never closed.
            unsafe fn resolve(lib: *mut c_void) -> Result<Driver, String> {
                $(
                    // SAFETY: `lib` is a live dlopen handle (caller's contract); the name is a
                    // NUL-terminated literal.
                    let p = unsafe { libc::dlsym(lib, concat!($sym, "\0").as_ptr().cast()) };
                    if p.is_null() {
                        return Err(format!("{} has no symbol {} (a driver too old for hixl?)", LIBRARY, $sym));
                    }
                    // SAFETY: the symbol is the driver's C function of this exact signature (the
                    // CUDA driver API's, for the versioned name we looked up).
                    let $field = unsafe {
                        std::mem::transmute::<*mut c_void, unsafe extern "C" fn($($arg),*) -> CuResult>(p)
                    };
                )*
                Ok(Driver { $( $field, )* })
            }
        }
    };
}

driver_table! {
    init = "cuInit": fn(c_uint);
    driver_get_version = "cuDriverGetVersion": fn(*mut c_int);
    get_error_string = "cuGetErrorString": fn(CuResult, *mut *const c_char);
    get_error_name = "cuGetErrorName": fn(CuResult, *mut *const c_char);
    device_get_count = "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet": fn(*mut CuDevice, c_int);
    device_get_name = "cuDeviceGetName": fn(*mut c_char, c_int, CuDevice);
    device_get_attribute = "cuDeviceGetAttribute": fn(*mut c_int, c_int, CuDevice);
    device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, CuDevice);
    primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut CuHandle, CuDevice);
    ctx_get_current = "cuCtxGetCurrent": fn(*mut CuHandle);
    ctx_set_current = "cuCtxSetCurrent": fn(CuHandle);
    pointer_get_attribute = "cuPointerGetAttribute": fn(*mut c_void, c_int, CuDevicePtr);
    mem_get_address_range = "cuMemGetAddressRange_v2": fn(*mut CuDevicePtr, *mut usize, CuDevicePtr);
    ipc_get_mem_handle = "cuIpcGetMemHandle": fn(*mut IpcMemHandle, CuDevicePtr);
    ipc_open_mem_handle = "cuIpcOpenMemHandle_v2": fn(*mut CuDevicePtr, IpcMemHandle, c_uint);
    ipc_close_mem_handle = "cuIpcCloseMemHandle": fn(CuDevicePtr);
    stream_create = "cuStreamCreate": fn(*mut CuHandle, c_uint);
    stream_destroy = "cuStreamDestroy_v2": fn(CuHandle);
    stream_synchronize = "cuStreamSynchronize": fn(CuHandle);
    memcpy_async = "cuMemcpyAsync": fn(CuDevicePtr, CuDevicePtr, usize, CuHandle);
    event_create = "cuEventCreate": fn(*mut CuHandle, c_uint);
    event_record = "cuEventRecord": fn(CuHandle, CuHandle);
    event_query = "cuEventQuery": fn(CuHandle);
    event_destroy = "cuEventDestroy_v2": fn(CuHandle);
    mem_host_register = "cuMemHostRegister_v2": fn(*mut c_void, usize, c_uint);
    mem_host_unregister = "cuMemHostUnregister": fn(*mut c_void);
    mem_alloc = "cuMemAlloc_v2": fn(*mut CuDevicePtr, usize);
    mem_free = "cuMemFree_v2": fn(CuDevicePtr);
    memset_d8 = "cuMemsetD8_v2": fn(CuDevicePtr, u8, usize);
    mem_host_alloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint);
    mem_free_host = "cuMemFreeHost": fn(*mut c_void);
    event_synchronize = "cuEventSynchronize": fn(CuHandle);
}

/// The loaded driver with its device count, or why there is none.
static LOADED: OnceLock<Result<(Driver, i32), String>> = OnceLock::new();

impl Driver {
    /// The process's driver, loaded and initialised on first use: Err says why CUDA cannot be
    /// used ("CUDA was not found: ..."); the answer is the same for the life of the process.
    pub fn get() -> Result<&'static Driver, String> {
        match LOADED.get_or_init(|| load(LIBRARY)) {
            Ok((d, _)) => Ok(d),
            Err(e) => Err(e.clone()),
        }
    }

    /// Whether the library loads here, without initialising CUDA (`cuInit` is left for the
    /// first use that needs a device: a process that only moves host memory must not have
    /// initialised CUDA, or its forked children could not use it). Err: why not.
    pub fn loadable() -> Result<(), String> {
        static OPENED: OnceLock<Result<(), String>> = OnceLock::new();
        if let Some(Ok(_)) = LOADED.get() {
            return Ok(());
        }
        OPENED.get_or_init(|| open(LIBRARY).map(|_| ())).clone()
    }

    /// How many devices the driver sees (0 when CUDA is not usable).
    pub fn device_count() -> i32 {
        match LOADED.get_or_init(|| load(LIBRARY)) {
            Ok((_, n)) => *n,
            Err(_) => 0,
        }
    }

    /// The driver's name and text for a result code ("CUDA_ERROR_INVALID_VALUE: invalid argument").
    pub fn error_text(&self, rc: CuResult) -> String {
        let mut name: *const c_char = std::ptr::null();
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: both calls only write a pointer to a static string of the driver (or leave it
        // null for an unknown code).
        unsafe {
            (self.get_error_name)(rc, &mut name);
            (self.get_error_string)(rc, &mut text);
        }
        let s = |p: *const c_char| {
            // SAFETY: a non-null result is a NUL-terminated static string of the driver.
            (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
        };
        match (s(name), s(text)) {
            (Some(n), Some(t)) => format!("{n}: {t}"),
            _ => format!("CUDA error {rc}"),
        }
    }

    /// Ok for success, else the error text naming `what`.
    pub fn check(&self, rc: CuResult, what: &str) -> Result<(), String> {
        if rc == SUCCESS {
            Ok(())
        } else {
            Err(format!("{what} failed: {}", self.error_text(rc)))
        }
    }
}

/// The driver's `cuMemGetHandleForAddressRange`, looked up without initialising CUDA (a
/// symbol lookup only); Err says why there is none: no driver library, or one older than
/// CUDA 11.7. The answer is the same for the life of the process.
pub fn get_handle_for_address_range() -> Result<GetHandleForAddressRange, String> {
    /// The entry point (as an address: function pointers are not `Sync` in a OnceLock<Result>).
    static FOUND: OnceLock<Result<usize, String>> = OnceLock::new();
    let found = FOUND.get_or_init(|| {
        let lib = open(LIBRARY)?;
        // SAFETY: `lib` is a live dlopen handle (never closed); the name is NUL-terminated.
        let p = unsafe { libc::dlsym(lib, c"cuMemGetHandleForAddressRange".as_ptr()) };
        if p.is_null() {
            return Err(format!(
                "{LIBRARY} has no {GET_HANDLE_FOR_ADDRESS_RANGE} (CUDA 11.7 or later has it)"
            ));
        }
        Ok(p as usize)
    });
    // SAFETY: the address is the driver's function of the signature the type spells (cuda.h).
    found.clone().map(|p| unsafe { std::mem::transmute::<usize, GetHandleForAddressRange>(p) })
}

/// Opens `path`, resolves the entry points and initialises the driver. Err starts with
/// "CUDA was not found" when there is no usable library, or names the missing symbol, or says
/// there is no device.
pub(crate) fn load(path: &str) -> Result<(Driver, i32), String> {
    let lib = open(path)?;
    // SAFETY: `lib` comes from dlopen and is never closed (the driver stays loaded for the
    // life of the process, as CUDA requires).
    let d = unsafe { Driver::resolve(lib) }?;
    // SAFETY: cuInit(0) is the documented first call; it takes no pointers.
    let rc = unsafe { (d.init)(0) };
    if rc == ERROR_NO_DEVICE {
        return Err(format!("CUDA was found ({path}) but it sees no device (CUDA_ERROR_NO_DEVICE)"));
    }
    d.check(rc, "cuInit")
        .map_err(|e| format!("CUDA was found ({path}) but could not be initialised: {e}"))?;
    let mut n: c_int = 0;
    // SAFETY: `n` is a valid out-parameter.
    d.check(unsafe { (d.device_get_count)(&mut n) }, "cuDeviceGetCount")?;
    if n <= 0 {
        return Err(format!("CUDA was found ({path}) but it sees no device"));
    }
    Ok((d, n))
}

/// `dlopen`s `path` (RTLD_NOW | RTLD_LOCAL); Err carries dlerror's text.
fn open(path: &str) -> Result<*mut c_void, String> {
    let c = CString::new(path).map_err(|_| format!("CUDA was not found: bad library path {path:?}"))?;
    // SAFETY: a NUL-terminated path; dlopen has no other precondition.
    let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if lib.is_null() {
        // SAFETY: dlerror returns NULL or a NUL-terminated string valid until the next dl call
        // on this thread; it is copied at once.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            "unknown reason".to_string()
        } else {
            // SAFETY: see above.
            unsafe { CStr::from_ptr(why) }.to_string_lossy().into_owned()
        };
        return Err(format!("CUDA was not found: {path} could not be loaded ({why})"));
    }
    Ok(lib)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_says_cuda_was_not_found() {
        let e = load("libhixl-no-such-cuda.so.1").err().expect("no such library");
        assert!(e.starts_with("CUDA was not found"), "{e}");
        assert!(e.contains("libhixl-no-such-cuda.so.1"), "{e}");
    }

    #[test]
    fn a_library_without_the_symbols_is_named_with_the_missing_one() {
        // libc is a real shared object that lacks every CUDA entry point.
        let e = load("libc.so.6").err().expect("libc is no CUDA driver");
        assert!(e.contains("has no symbol cuInit"), "{e}");
    }

    #[test]
    fn this_machine_either_has_cuda_or_says_why_not() {
        match Driver::get() {
            Ok(_) => assert!(Driver::device_count() > 0),
            Err(e) => {
                assert!(e.contains("CUDA was"), "{e}");
                assert_eq!(Driver::device_count(), 0);
                // Without the library, the check that does not initialise CUDA agrees.
                if e.starts_with("CUDA was not found") {
                    assert_eq!(Driver::loadable().unwrap_err(), e);
                }
            }
        }
    }
}
