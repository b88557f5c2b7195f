//! GPU memory on RDMA (GPUDirect RDMA): how the `rdma` backend registers `cuda:N` memory with
//! the NIC, chosen at run time from what this machine has:
//!
//! - `dmabuf`: the driver exports the range as a dma-buf (`cuMemGetHandleForAddressRange`,
//!   CUDA >= 11.7, on a device whose `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED` is 1) and the NIC
//!   registers that (`ibv_reg_dmabuf_mr`, rdma-core >= 34). The descriptor is closed once the
//!   region is registered: the region holds its own reference.
//! - `peermem`: `ibv_reg_mr` on the device pointer itself, which the kernel resolves through the
//!   `nvidia_peermem` module (or the legacy `nv_peer_mem`).
//! - neither: UNSUPPORTED, naming every missing piece.
//!
//! The choice is made when the engine starts (without the device attribute: reading it would
//! initialise CUDA in a process that may never touch a GPU) and made again, with the attribute
//! of the region's device, at each registration of device memory.
//!
//! The chooser is pure and unit-tested; the registration paths are built but have never run on
//! a machine with both a GPU and an RDMA NIC (docs/RDMA.md, "GPU memory (GPUDirect)").

use std::path::Path as FsPath;

use super::nic::Nic;
use super::rails::Rails;
use super::verbs::Verbs;
use crate::cuda::{dmabuf, driver};
use crate::error::Result;
use crate::transport::backend::MemorySpan;
use crate::wire::Domain;

/// One thing GPUDirect needs: `Ok` when present, else what is missing.
pub type Piece = std::result::Result<(), String>;

/// Where the kernel lists loaded modules.
pub const SYS_MODULE: &str = "/sys/module";
/// The kernel modules that let `ibv_reg_mr` pin GPU memory (the current name, then the
/// legacy one of Mellanox's package).
pub const PEERMEM_MODULES: [&str; 2] = ["nvidia_peermem", "nv_peer_mem"];

/// What this machine has for GPUDirect RDMA.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Present {
    /// The CUDA driver library loads (`libcuda.so.1`).
    pub cuda: Piece,
    /// The verbs provider registers dma-bufs of GPU memory (`ibv_reg_dmabuf_mr`).
    pub verbs_dmabuf: Piece,
    /// The driver exports dma-bufs (`cuMemGetHandleForAddressRange`).
    pub driver_dmabuf: Piece,
    /// The device's `CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED`; `None`: not asked yet (taken as
    /// present until a registration asks).
    pub device_dmabuf: Option<Piece>,
    /// `nvidia_peermem` (or `nv_peer_mem`) is loaded and the provider is a real NIC's.
    pub peermem: Piece,
}

/// How device memory is registered.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Path {
    /// `cuMemGetHandleForAddressRange` + `ibv_reg_dmabuf_mr`.
    DmaBuf,
    /// `ibv_reg_mr` on the device pointer (nvidia-peermem).
    PeerMem,
    /// Neither: the message names what is missing.
    Unsupported(String),
}

impl Path {
    /// Whether neither path is there.
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Path::Unsupported(_))
    }

    /// The `hixl info` word: "dmabuf", "peermem" or "no (missing: ...)".
    pub fn describe(&self) -> String {
        match self {
            Path::DmaBuf => "dmabuf".into(),
            Path::PeerMem => "peermem".into(),
            Path::Unsupported(m) => format!("no ({m})"),
        }
    }
}

/// The registration path `p` allows: dma-buf when every piece of it is there (the preferred
/// one: no out-of-tree module, and the driver's own export), else nvidia-peermem, else
/// UNSUPPORTED with every missing piece named once.
pub fn choose(p: &Present) -> Path {
    let device = p.device_dmabuf.clone().unwrap_or(Ok(()));
    if p.cuda.is_ok() && p.verbs_dmabuf.is_ok() && p.driver_dmabuf.is_ok() && device.is_ok() {
        return Path::DmaBuf;
    }
    if p.cuda.is_ok() && p.peermem.is_ok() {
        return Path::PeerMem;
    }
    let mut missing: Vec<String> = Vec::new();
    for piece in [&p.cuda, &p.driver_dmabuf, &device, &p.verbs_dmabuf, &p.peermem] {
        if let Err(m) = piece {
            if !missing.contains(m) {
                missing.push(m.clone());
            }
        }
    }
    Path::Unsupported(format!("missing: {}", missing.join("; ")))
}

/// Whether a peer-memory module is loaded, looking under `sys_module` ([`SYS_MODULE`]).
pub fn peermem_loaded(sys_module: &FsPath) -> Piece {
    if PEERMEM_MODULES.iter().any(|m| sys_module.join(m).exists()) {
        return Ok(());
    }
    Err(format!(
        "the {} kernel module is not loaded (no {}/{}; modprobe {0}, or the legacy {})",
        PEERMEM_MODULES[0],
        sys_module.display(),
        PEERMEM_MODULES[0],
        PEERMEM_MODULES[1]
    ))
}

/// What is present with the provider `verbs`, without initialising CUDA (the device attribute
/// is left unasked).
pub fn probe(verbs: &dyn Verbs) -> Present {
    let cuda = driver::Driver::loadable();
    let driver_dmabuf = driver::get_handle_for_address_range().map(|_| ());
    let peermem = if verbs.provider() == "verbs" {
        peermem_loaded(FsPath::new(SYS_MODULE))
    } else {
        Err(format!("ibv_reg_mr on GPU memory needs a NIC's provider (verbs), not {}", verbs.provider()))
    };
    Present { cuda, verbs_dmabuf: verbs.gpu_dmabuf(), driver_dmabuf, device_dmabuf: None, peermem }
}

/// The device attribute of `cuda:ordinal` as a piece (this initialises CUDA).
pub fn device_piece(ordinal: u8) -> Piece {
    match dmabuf::supported(ordinal) {
        Ok(true) => Ok(()),
        Ok(false) => Err(format!("cuda:{ordinal} reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0")),
        Err(why) => Err(format!("cuda:{ordinal}'s CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED: {why}")),
    }
}

/// Registers the span `mem` of `cuda:ordinal` with every rail by the path `start` (what was
/// present when the engine started) allows once the device's attribute is known. Returns the
/// rkeys; UNSUPPORTED naming what is missing when neither path is there.
pub(super) fn register(rails: &Rails, start: &Present, ordinal: u8, mem: &MemorySpan) -> Result<Vec<u32>> {
    let mut p = start.clone();
    p.device_dmabuf = Some(device_piece(ordinal));
    match choose(&p) {
        Path::DmaBuf => {
            let buf = dmabuf::export(ordinal, mem.addr(), mem.len())?;
            // Each rail's region takes its own reference to the dma-buf; ours is closed when
            // `buf` drops, at the end of this arm, after every rail registered.
            rails.register_with(mem.addr(), |nic| nic.register_dmabuf(mem, &buf))
        }
        Path::PeerMem => rails.register(mem),
        Path::Unsupported(m) => Err(super::unsupported(format!(
            "GPU memory (cuda:{ordinal}) cannot be registered for RDMA here: {m}"
        ))),
    }
}

/// The `rdma` backend's GPUDirect: what its device had when the engine started and the path
/// that allowed (None: no device).
pub(super) struct Gpu(Option<(Present, Path)>);

impl Gpu {
    /// Probes `nic`'s provider and this machine (none: no device, no GPU path).
    pub(super) fn probe(nic: Option<&Nic>) -> Gpu {
        Gpu(nic.map(|n| {
            let present = probe(&**n.verbs());
            let path = choose(&present);
            tracing::debug!("RDMA GPUDirect: {}", path.describe());
            (present, path)
        }))
    }

    /// The domain pairs served with a GPU path: GPU memory both ways over the wire, the same
    /// pairs as tcp's staging serves. None: host memory only.
    pub(super) fn domains(&self) -> Option<&'static [(Domain, Domain)]> {
        match &self.0 {
            Some((_, p)) if !p.is_unsupported() => Some(crate::transport::staging::TCP_PAIRS),
            _ => None,
        }
    }

    /// Why device memory is not served, when a device is there but no GPU path.
    pub(super) fn unserved(&self) -> Option<String> {
        match &self.0 {
            Some((_, Path::Unsupported(m))) => Some(format!("GPUDirect RDMA: {m}")),
            _ => None,
        }
    }

    /// Registers `mem` when it is GPU memory this backend offers (None: not its business:
    /// host memory, or no GPU path, when another backend may serve it).
    pub(super) fn register(&self, rails: &Rails, mem: &MemorySpan) -> Option<Result<Vec<u32>>> {
        let (Domain::Cuda(n), Some((present, start))) = (mem.domain(), &self.0) else { return None };
        if start.is_unsupported() {
            return None;
        }
        Some(register(rails, present, n, mem))
    }
}

/// The `hixl info` line for the provider `hixl.rdma.provider` names: the path a registration
/// on `cuda:0` would take, "dmabuf", "peermem" or "no (missing: ...)" (this initialises CUDA,
/// as `hixl info` does anyway). A provider that does not load is one missing piece more.
pub fn describe(provider_name: &str) -> Result<String> {
    let verbs = super::provider(crate::options::rdma::provider("provider", provider_name)?);
    Ok(match verbs {
        Ok(v) => describe_with(&*v),
        Err(e) => Path::Unsupported(format!("missing: {}", e.message)).describe(),
    })
}

fn describe_with(verbs: &dyn Verbs) -> String {
    let mut p = probe(verbs);
    if p.cuda.is_ok() {
        p.device_dmabuf = Some(device_piece(0));
    }
    choose(&p).describe()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all() -> Present {
        Present {
            cuda: Ok(()),
            verbs_dmabuf: Ok(()),
            driver_dmabuf: Ok(()),
            device_dmabuf: None,
            peermem: Ok(()),
        }
    }

    fn miss(what: &str) -> Piece {
        Err(what.to_string())
    }

    #[test]
    fn dmabuf_is_preferred_when_every_piece_of_it_is_there() {
        assert_eq!(choose(&all()), Path::DmaBuf, "the attribute not asked yet counts as present");
        let p = Present { device_dmabuf: Some(Ok(())), peermem: miss("no peermem"), ..all() };
        assert_eq!(choose(&p), Path::DmaBuf, "no module needed");
    }

    #[test]
    fn peermem_serves_when_a_dmabuf_piece_is_missing() {
        for p in [
            Present { verbs_dmabuf: miss("libibverbs.so.1 has no ibv_reg_dmabuf_mr"), ..all() },
            Present { driver_dmabuf: miss("libcuda.so.1 has no cuMemGetHandleForAddressRange"), ..all() },
            Present { device_dmabuf: Some(miss("DMA_BUF_SUPPORTED = 0")), ..all() },
        ] {
            assert_eq!(choose(&p), Path::PeerMem, "{p:?}");
        }
    }

    #[test]
    fn neither_path_names_every_missing_piece_once() {
        let p = Present {
            verbs_dmabuf: miss("libibverbs.so.1 has no ibv_reg_dmabuf_mr"),
            device_dmabuf: Some(miss("cuda:0 reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0")),
            peermem: miss("the nvidia_peermem kernel module is not loaded"),
            ..all()
        };
        let Path::Unsupported(m) = choose(&p) else { panic!("{p:?}") };
        assert_eq!(
            m,
            "missing: cuda:0 reports CU_DEVICE_ATTRIBUTE_DMA_BUF_SUPPORTED = 0; libibverbs.so.1 has no \
             ibv_reg_dmabuf_mr; the nvidia_peermem kernel module is not loaded"
        );
        assert!(Path::Unsupported(m).describe().starts_with("no (missing: cuda:0 reports"));
    }

    #[test]
    fn without_the_cuda_driver_nothing_serves_and_its_absence_is_named_once() {
        let no_cuda = "CUDA was not found: libcuda.so.1 could not be loaded";
        let p = Present {
            cuda: miss(no_cuda),
            driver_dmabuf: miss(no_cuda),
            peermem: miss("the nvidia_peermem kernel module is not loaded"),
            ..all()
        };
        let Path::Unsupported(m) = choose(&p) else { panic!("{p:?}") };
        assert_eq!(m.matches("CUDA was not found").count(), 1, "{m}");
        assert!(m.contains("nvidia_peermem"), "{m}");
        // Even with peermem loaded: the pointer is CUDA's.
        let p = Present { cuda: miss(no_cuda), driver_dmabuf: miss(no_cuda), ..all() };
        assert_eq!(choose(&p), Path::Unsupported(format!("missing: {no_cuda}")));
        assert_eq!(Path::DmaBuf.describe(), "dmabuf");
        assert_eq!(Path::PeerMem.describe(), "peermem");
    }

    #[test]
    fn peermem_is_found_under_either_module_name() {
        let dir = std::env::temp_dir().join(format!("hixl-sysmod-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let e = peermem_loaded(&dir).unwrap_err();
        assert!(e.contains("nvidia_peermem") && e.contains("nv_peer_mem"), "{e}");
        for m in PEERMEM_MODULES {
            std::fs::create_dir(dir.join(m)).unwrap();
            assert_eq!(peermem_loaded(&dir), Ok(()), "{m}");
            std::fs::remove_dir(dir.join(m)).unwrap();
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_soft_provider_offers_no_gpu_path() {
        let v = crate::transport::backends::rdma::verbs::soft::SoftVerbs::new();
        let p = probe(&v);
        assert!(p.verbs_dmabuf.as_ref().unwrap_err().contains("soft"), "{p:?}");
        assert!(p.peermem.as_ref().unwrap_err().contains("soft"), "{p:?}");
        let Path::Unsupported(m) = choose(&p) else { panic!("{p:?}") };
        assert!(m.contains("soft provider's reg_dmabuf_mr") && m.contains("not soft"), "{m}");
    }
}
