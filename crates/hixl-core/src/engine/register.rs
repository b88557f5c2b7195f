//! Registration: the backends' hooks, the registry, and telling the peers.

use std::sync::Arc;

use super::Running;
use crate::error::{Error, Result, Status};
use crate::registry::{Access, Region, RegionSpec};
use crate::transport::backend::{MemorySpan, ReleasedSpan};
use crate::wire::{BackendKey, Domain};

/// Registers a region: every backend's registration hook first (its key travels in the region
/// table), then the registry, then the peers are told. A domain no backend serves is
/// UNSUPPORTED; a failed registration releases the keys already made.
pub(super) fn register_region(
    r: &Running,
    mut span: MemorySpan,
    access: Access,
    name: &str,
) -> Result<Arc<Region>> {
    let served =
        |d: Domain| r.backends.iter().any(|b| b.domains().iter().any(|(local, _)| local.same_kind(d)));
    if span.domain().is_device() {
        // Device memory is checked by the driver (UNSUPPORTED when CUDA is not found here) and
        // takes the domain of the device that holds it (`device` becomes `cuda:N`). When no
        // backend would serve it anyway, the error says that too, with each backend's reason.
        let device_served = served(Domain::Cuda(0));
        match span.resolve_device() {
            Ok(()) => {}
            Err(e) if !device_served => {
                return Err(Error::new(e.status, format!("{}; {}", e.message, unserved(r, span.domain()))))
            }
            Err(e) => return Err(e),
        }
    }
    if !served(span.domain()) {
        return Err(Error::new(Status::Unsupported, unserved(r, span.domain())));
    }
    if span.domain() == Domain::Host && span.addr() != 0 && span.len() != 0 {
        check_mapped(span.addr(), span.len())?;
    }
    let released = span.released();
    let mut keys: Vec<BackendKey> = Vec::new();
    let release = |keys: &[BackendKey]| {
        for k in keys {
            if let Some(b) = r.backends.iter().find(|b| b.name() == k.backend) {
                b.deregister(&released, &k.key);
            }
        }
    };
    for b in &r.backends {
        match b.register(&span) {
            Ok(Some(key)) => keys.push(BackendKey { backend: b.name().into(), key }),
            Ok(None) => {}
            Err(e) => {
                release(&keys);
                return Err(e);
            }
        }
    }
    let spec = RegionSpec {
        addr: span.addr(),
        len: span.len(),
        mem_type: span.domain(),
        access,
        name: name.to_string(),
        keys: keys.clone(),
    };
    let (region, created) = match r.registry.register_spec(spec) {
        Ok(x) => x,
        Err(e) => {
            release(&keys);
            return Err(e);
        }
    };
    if !created {
        // The same range again: the existing region keeps its own keys.
        release(&keys);
        return Ok(region);
    }
    if let Some(s) = &r.server {
        s.publish_regions(None)?;
    }
    Ok(region)
}

/// "memory domain D (MemType.X) is served by no backend of hixl.backends=... (this build has:
/// ...)", then each backend's reason for not serving it here (`Backend::unserved`).
fn unserved(r: &Running, domain: Domain) -> String {
    let why: Vec<String> =
        r.backends.iter().filter_map(|b| b.unserved(domain).map(|w| format!("{}: {w}", b.name()))).collect();
    format!(
        "memory domain {} (MemType.{}) is served by no backend of hixl.backends={} (this build has: {}){}",
        domain,
        if domain.is_device() { "DEVICE" } else { "HOST" },
        r.opts.backends.join(","),
        crate::transport::backends::BUILT.join(", "),
        if why.is_empty() { String::new() } else { format!("; {}", why.join("; ")) }
    )
}

/// Runs the backends' deregistration hooks for a region that left the registry.
pub(super) fn run_deregister_hooks(r: &Running, region: &Region) {
    let span = ReleasedSpan { addr: region.addr };
    for k in &region.keys {
        if let Some(b) = r.backends.iter().find(|b| b.name() == k.backend) {
            b.deregister(&span, &k.key);
        }
    }
}

/// Whether `[addr, addr+len)` is mapped memory of this process: a peer's write into an
/// unmapped range would fail at the target with EFAULT, so such a range is refused here.
fn check_mapped(addr: u64, len: u64) -> Result<()> {
    if addr.checked_add(len).is_some() && !crate::transport::io::is_mapped(addr, len) {
        return Err(Error::param(format!(
            "range 0x{addr:x}+{len} is not (entirely) mapped memory of this process: registering it \
             would let peers fail on it"
        )));
    }
    Ok(())
}
