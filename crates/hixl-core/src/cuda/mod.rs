//! CUDA device memory: the driver loaded at run time (`driver`), what a process's GPUs are
//! (`info`), and the checks a device range passes before it is registered (`resolve`). The
//! pure pieces that need no GPU (the IPC key, the open-handle cache, stream and chunk
//! planning) are in their own modules and unit-tested on any machine.
//!
//! Without `libcuda.so.1` (or without a device) everything here answers `UNSUPPORTED` with a
//! message that says CUDA was not found; nothing panics.

pub(crate) mod cache;
pub(crate) mod dmabuf;
pub(crate) mod driver;
pub(crate) mod hold;
pub(crate) mod key;
pub(crate) mod plan;
pub(crate) mod stage_plan;

pub(crate) use driver::owned::CtxGuard;
pub(crate) use driver::{handles, runtime};

use std::ffi::{c_int, c_uint};

use crate::error::{Error, Result, Status};
use crate::wire::Domain;
use driver::owned::{DeviceAlloc, IpcMapping};
use driver::{CuDevicePtr, Driver};
use handles::PointerAttr;

/// One GPU as the driver describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDevice {
    /// Its ordinal in this process (`cuda:N`; after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: u8,
    /// Its name ("NVIDIA H100 80GB HBM3").
    pub name: String,
    /// Its memory in bytes.
    pub total_mem: u64,
    /// Its PCI address ("0000:3b:00.0").
    pub pci_bus_id: String,
    /// Compute capability (major, minor).
    pub compute_capability: (i32, i32),
    /// Whether it shares one virtual address space with the host (needed by hixl).
    pub unified_addressing: bool,
}

/// What this process can do with CUDA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaInfo {
    /// Whether the driver loaded and sees at least one device.
    pub available: bool,
    /// Why not, when it is not ("CUDA was not found: ...").
    pub reason: String,
    /// The driver's version (e.g. 12040 for 12.4), 0 when unavailable.
    pub driver_version: i32,
    /// The devices.
    pub devices: Vec<CudaDevice>,
}

/// The loaded driver, or `UNSUPPORTED` saying why CUDA cannot be used.
pub(crate) fn driver() -> Result<&'static Driver> {
    Driver::get().map_err(|why| Error::new(Status::Unsupported, why))
}

/// A driver call's result as an [`Error`] with `status`.
pub(crate) fn check(d: &Driver, rc: driver::CuResult, what: &str, status: Status) -> Result<()> {
    d.check(rc, what).map_err(|m| Error::new(status, m))
}

/// Asks the driver about this process's GPUs. Never fails: without CUDA it says why.
pub fn info() -> CudaInfo {
    let d = match Driver::get() {
        Ok(d) => d,
        Err(reason) => return CudaInfo { available: false, reason, driver_version: 0, devices: vec![] },
    };
    let version = d.version();
    let devices = (0..Driver::device_count().min(Domain::MAX_CUDA_ORDINAL as i32 + 1))
        .filter_map(|i| describe(d, i).ok())
        .collect();
    CudaInfo { available: true, reason: String::new(), driver_version: version, devices }
}

fn describe(d: &Driver, ordinal: i32) -> std::result::Result<CudaDevice, String> {
    let dev = d.check_res(d.device(ordinal), "cuDeviceGet")?;
    let name = d.check_res(d.device_name(dev), "cuDeviceGetName")?;
    let attr = |a: c_int| d.device_attribute(a, dev).unwrap_or(-1);
    let total = d.device_total_mem(dev);
    Ok(CudaDevice {
        ordinal: ordinal as u8,
        name,
        total_mem: total as u64,
        pci_bus_id: format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(driver::ATTR_PCI_DOMAIN_ID),
            attr(driver::ATTR_PCI_BUS_ID),
            attr(driver::ATTR_PCI_DEVICE_ID)
        ),
        compute_capability: (attr(driver::ATTR_CC_MAJOR), attr(driver::ATTR_CC_MINOR)),
        unified_addressing: attr(driver::ATTR_UNIFIED_ADDRESSING) == 1,
    })
}

/// Allocations of other processes opened here by IPC handle, with their length as the driver
/// reports it and how many users each has: a handle can be opened only once per process, and
/// several links (a reconnect, two engines) may need the same one.
static IPC_OPEN: std::sync::Mutex<Vec<OpenedIpc>> = std::sync::Mutex::new(Vec::new());

/// One opened allocation: (handle, its mapping here, length the driver reports, users).
type OpenedIpc = ([u8; 64], IpcMapping, u64, usize);

/// Opens (or takes one more use of) the allocation of a peer's IPC handle: its base address
/// here and its length as the driver reports it (`cuMemGetAddressRange`; the length in the
/// peer's key is only the peer's word). The caller has a context current; `ipc_release` gives
/// the use back.
pub(crate) fn ipc_open(
    d: &'static Driver,
    handle: &[u8; 64],
) -> std::result::Result<(CuDevicePtr, u64), String> {
    let mut open = IPC_OPEN.lock().unwrap();
    if let Some(e) = open.iter_mut().find(|e| e.0 == *handle) {
        e.3 += 1;
        return Ok((e.1.addr(), e.2));
    }
    let mapping = IpcMapping::open(d, handle)?;
    let p = mapping.addr();
    // `p` was just mapped in the current context; on an error the mapping, used by nothing
    // yet, is closed as it drops.
    let (base, size) = d.check_res(d.address_range(p), "cuMemGetAddressRange")?;
    // The mapping from `p` on: what a key's offset and length must fit in.
    let len = (base + size as u64).saturating_sub(p);
    open.push((*handle, mapping, len, 1));
    Ok((p, len))
}

/// Gives back one use of an opened allocation; the last closes it (no copy may use it then).
pub(crate) fn ipc_release(handle: &[u8; 64]) {
    let mut open = IPC_OPEN.lock().unwrap();
    if let Some(i) = open.iter().position(|e| e.0 == *handle) {
        open[i].3 -= 1;
        if open[i].3 == 0 {
            // Its last user is done with it: the mapping closes as it drops.
            drop(open.swap_remove(i));
        }
    }
}

/// A device range checked for registration: its device and the allocation it lies in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DeviceRange {
    /// `cuda:N` of the device that holds it.
    pub domain: Domain,
    /// Start of the allocation (`cuMemGetAddressRange`).
    pub alloc_base: u64,
    /// Length of the allocation.
    pub alloc_len: u64,
    /// Whether a legacy IPC handle can export it (false for VMM / pool allocations).
    pub ipc_capable: bool,
}

/// Checks `[addr, addr+len)` as device memory of `domain` (`Device`: whichever device holds
/// it; `Cuda(n)`: that one): it must be device memory (not host, not managed), lie in one
/// allocation, and belong to the named device. UNSUPPORTED when CUDA is not usable here.
pub(crate) fn resolve(addr: u64, len: u64, domain: Domain) -> Result<DeviceRange> {
    let d = driver()?;
    if addr == 0 || len == 0 || addr.checked_add(len).is_none() {
        return Err(Error::param(format!("device range 0x{addr:x}+{len} is empty, null or wraps around")));
    }
    // Pointer queries need a current context (any: addresses are unified); a thread without
    // one (no torch on it) gets the named device's, or cuda:0's, for the checks.
    let _probe = match (!d.has_current_context(), domain) {
        (true, Domain::Cuda(n)) => Some(CtxGuard::enter(d, n)?),
        (true, _) => Some(CtxGuard::enter(d, 0)?),
        _ => None,
    };
    let attr_u32 = |a: PointerAttr, what: &str| -> Result<c_uint> {
        d.check_res(d.pointer_attribute(a, addr), what).map_err(Error::param)
    };
    let kind = attr_u32(PointerAttr::MemoryType, "cuPointerGetAttribute(MEMORY_TYPE)").map_err(|e| {
        Error::param(format!(
            "0x{addr:x} is not memory CUDA knows (register host memory as host): {}",
            e.message
        ))
    })?;
    if kind != driver::MEMORYTYPE_DEVICE {
        return Err(Error::param(format!(
            "0x{addr:x} is CUDA {} memory, not device memory: register it as host memory",
            if kind == driver::MEMORYTYPE_HOST { "pinned host" } else { "non-device" }
        )));
    }
    if attr_u32(PointerAttr::IsManaged, "cuPointerGetAttribute(IS_MANAGED)")? != 0 {
        return Err(Error::new(
            Status::Unsupported,
            format!("0x{addr:x} is CUDA managed (unified) memory, which hixl cannot export; use cudaMalloc'd memory"),
        ));
    }
    let ordinal = attr_u32(PointerAttr::DeviceOrdinal, "cuPointerGetAttribute(DEVICE_ORDINAL)")?;
    let ordinal = u8::try_from(ordinal).ok().filter(|o| *o <= Domain::MAX_CUDA_ORDINAL).ok_or_else(|| {
        Error::new(Status::Unsupported, format!("device ordinal {ordinal} is above cuda:127"))
    })?;
    if let Domain::Cuda(n) = domain {
        if n != ordinal {
            return Err(Error::param(format!(
                "0x{addr:x} lies on cuda:{ordinal}, not on the cuda:{n} it was registered as"
            )));
        }
    }
    let _ctx = CtxGuard::enter(d, ordinal)?;
    // The context of the pointer's device is current.
    let (base, size) = d.check_res(d.address_range(addr), "cuMemGetAddressRange").map_err(Error::param)?;
    let end = base.saturating_add(size as u64);
    if addr + len > end {
        return Err(Error::param(format!(
            "device range 0x{addr:x}+{len} runs past the end of its CUDA allocation (0x{base:x}+{size}) by {} bytes",
            addr + len - end
        )));
    }
    let ipc_capable = attr_u32(PointerAttr::IsLegacyIpcCapable, "IS_LEGACY_CUDA_IPC_CAPABLE")
        .map(|v| v != 0)
        .unwrap_or(true);
    Ok(DeviceRange { domain: Domain::Cuda(ordinal), alloc_base: base, alloc_len: size as u64, ipc_capable })
}

/// Device memory allocated with `cuMemAlloc` (for tools and tests that have no torch or CuPy:
/// `hixl bench --mem cuda:N`, the GPU checks), freed on drop.
pub struct DeviceBuffer {
    mem: DeviceAlloc,
    len: u64,
    ordinal: u8,
}

impl DeviceBuffer {
    /// `len` bytes (at least 1) on device `ordinal`, filled with byte `fill`. UNSUPPORTED when
    /// CUDA is not usable here.
    pub fn new(ordinal: u8, len: u64, fill: u8) -> Result<DeviceBuffer> {
        let d = driver()?;
        if len == 0 {
            return Err(Error::param("a device buffer of 0 bytes"));
        }
        let _ctx = CtxGuard::enter(d, ordinal)?;
        let mem = DeviceAlloc::new(d, ordinal, len)?;
        // Set on the null stream, which is then waited for; on an error `mem` is freed.
        mem.fill(fill)?;
        Ok(DeviceBuffer { mem, len, ordinal })
    }

    /// Start address (a device pointer).
    pub fn addr(&self) -> u64 {
        self.mem.addr()
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty (never: a buffer has at least one byte).
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device.
    pub fn ordinal(&self) -> u8 {
        self.ordinal
    }

    /// Copies `data` to offset `at` (synchronously).
    pub fn write_at(&self, at: u64, data: &[u8]) -> Result<()> {
        self.mem.write_at(at, data)
    }

    /// Copies `out.len()` bytes from offset `at` into `out` (synchronously).
    pub fn read_at(&self, at: u64, out: &mut [u8]) -> Result<()> {
        self.mem.read_at(at, out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_cuda_info_and_resolve_say_why() {
        let i = info();
        if i.available {
            assert!(!i.devices.is_empty());
            return;
        }
        assert!(i.reason.contains("CUDA was"), "{}", i.reason);
        let e = resolve(0x7000_0000_0000, 4096, Domain::Cuda(0)).unwrap_err();
        assert_eq!(e.status, Status::Unsupported);
        let e = DeviceBuffer::new(0, 4096, 0).err().expect("no CUDA here");
        assert_eq!(e.status, Status::Unsupported);
        assert!(e.message.contains("CUDA was"), "{}", e.message);
    }
}
