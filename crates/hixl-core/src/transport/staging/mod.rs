//! Staging CUDA device memory over TCP: the seam between the `tcp` backend and CUDA.
//!
//! TCP moves bytes between sockets and host memory, and a socket cannot read or write device
//! memory, so device bytes go through pinned host bounce buffers in chunks
//! (`hixl.cuda.stage_chunk` bytes, `hixl.cuda.stage_depth` of them per request):
//!
//! - **Initiator** (`path.rs`, `initiator.rs`): the `tcp` backend's path is a [`StagedPath`],
//!   chosen at connect time: it hands the parts of a request with device memory on either
//!   side to the engine's [`Stager`] and every other part to the link. The stager's workers
//!   cut the request into chunks (`cuda::stage_plan`) and run them as a pipeline: for a WRITE
//!   from device memory the copy of chunk k+1 into its slot runs while chunk k is on the wire;
//!   for a READ into device memory chunk k+1 arrives while chunk k is copied out. Each chunk
//!   is an ordinary host transfer on the same `TcpLink` (zero-copy from the slot), so the TCP
//!   code never sees device memory, and host-to-host requests never reach the stager.
//! - **Target** (`target.rs`): a WRITE or READ frame whose ranges lie in device regions of the
//!   target's registry is received into (or sent from) a pinned buffer, with the copy to (or
//!   from) the device in between; the served streams call it through their `TargetStaging`
//!   hook. The pinned bytes lent at once are capped per engine and per peer (`budget.rs`).
//!
//! Where CUDA is not usable, every entry point answers `UNSUPPORTED` with "CUDA was not
//! found: ..." (nothing panics).

pub(crate) mod budget;
mod initiator;
mod path;
pub(crate) mod target;

pub(crate) use crate::cuda::driver::owned::{CopyStream, PinnedBuf};
pub(crate) use initiator::Stager;
pub(crate) use path::StagedPath;

use crate::cuda::driver as loaded_driver;
use crate::error::{Error, Status};
use crate::wire::Domain;

/// The (local, remote) domain pairs the `tcp` backend serves: host memory directly, device
/// memory (`Cuda(0)` stands for every `cuda:N`) by staging on the side that owns it.
pub(crate) const TCP_PAIRS: &[(Domain, Domain)] = &[
    (Domain::Host, Domain::Host),
    (Domain::Cuda(0), Domain::Host),
    (Domain::Host, Domain::Cuda(0)),
    (Domain::Cuda(0), Domain::Cuda(0)),
];

/// The device of a staged request's local memory: the first pinned region in device memory.
fn device_of(pins: &[crate::registry::Pin]) -> Option<u8> {
    pins.iter().find_map(|p| match p.region().mem_type {
        Domain::Cuda(n) => Some(n),
        Domain::Device => Some(0),
        Domain::Host => None,
    })
}

/// Why device memory cannot be staged here ("CUDA was not found: ..."), as UNSUPPORTED.
pub(crate) fn unsupported_here(what: &str) -> Option<Error> {
    loaded_driver().err().map(|e| Error::new(Status::Unsupported, format!("{what}: {}", e.message)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::Options;

    #[test]
    fn staging_defaults_to_four_slots_of_four_mib_and_is_bounded() {
        let map = |kv: &[(&str, &str)]| kv.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        let o = Options::default();
        assert_eq!((o.stage_chunk, o.stage_depth), (4 << 20, 4));
        let o = Options::parse(&map(&[("hixl.cuda.stage_chunk", "65536"), ("hixl.cuda.stage_depth", "16")]))
            .unwrap();
        assert_eq!((o.stage_chunk, o.stage_depth), (65536, 16));
        for (k, bad) in [
            ("hixl.cuda.stage_chunk", "65535"),
            ("hixl.cuda.stage_chunk", "67108865"),
            ("hixl.cuda.stage_depth", "1"),
            ("hixl.cuda.stage_depth", "17"),
        ] {
            let e = Options::parse(&map(&[(k, bad)])).unwrap_err();
            assert!(e.message.contains(k), "{e}");
        }
    }

    #[test]
    fn without_cuda_staging_says_cuda_was_not_found() {
        if crate::cuda::info().available {
            return;
        }
        let e = unsupported_here("staging device memory over TCP").expect("no CUDA here");
        assert_eq!(e.status, Status::Unsupported);
        assert!(e.message.starts_with("staging device memory over TCP: CUDA was"), "{}", e.message);
        let e = PinnedBuf::new(4096).err().expect("no CUDA here");
        assert_eq!(e.status, Status::Unsupported);
        let e = CopyStream::new(0, 2).err().expect("no CUDA here");
        assert!(e.message.contains("CUDA was"), "{}", e.message);
    }
}
