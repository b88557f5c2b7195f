//! The backend seam: what a backend is, and how one is chosen for a peer.
//!
//! A backend has a name, the (local, remote) memory-domain pairs it serves, a registration
//! hook whose opaque key travels in the region table (and a deregistration hook), the
//! capability it advertises in Welcome, and `connect`, which opens a [`DataPath`] over a
//! link's control channel. The engine asks the backends of `hixl.backends`, in that order, for
//! a data path to a peer, skipping those the peer does not offer; the first that opens carries
//! the link's data, and the INFO log says which was chosen and why the ones before it were not.
//!
//! Adding a backend means one module under `transport/backends/` implementing [`Backend`] (and
//! [`DataPath`]) and one line in the table (`backends::TABLE`); nothing in the engine or the
//! completer changes.

use std::any::Any;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result, Status};
use crate::options::Options;
use crate::registry::Access;
use crate::transport::backends::shm::shared_mem::SharedMem;
use crate::transport::control::channel::ControlChannel;
use crate::transport::streams::ConnectParams;
use crate::transport::DataPath;
use crate::wire::{Capability, Domain};

/// Host memory on both sides: the one pair today's backends serve.
pub(crate) const HOST_TO_HOST: &[(Domain, Domain)] = &[(Domain::Host, Domain::Host)];

/// Memory being registered, as a registration hook sees it, and the proof that it may be
/// handed to a device: a value of this type says that `[addr, addr + len)` is memory of this
/// process of its domain that stays valid until the engine has run the backends'
/// deregistration hooks for the region registered with it (or released the keys of a failed
/// registration). A hook may therefore register the range with a device (a NIC) that reads and
/// writes it on its own, provided its deregistration hook (or the failed registration's
/// release) undoes that.
///
/// Made only by [`MemorySpan::new`] (unsafe: the caller promises that, as the callers of
/// `Engine::register_mem` do) and [`MemorySpan::engine_owned`] (memory the engine allocated
/// and keeps until the region is deregistered). Deregistration hooks get a [`ReleasedSpan`]
/// instead, which cannot register anything.
pub struct MemorySpan {
    addr: u64,
    len: u64,
    domain: Domain,
    /// The engine's own memory (its sealed memfd travels in the `shm` key), held while this
    /// value lives.
    shared: Option<Arc<SharedMem>>,
    access: Access,
}

impl MemorySpan {
    /// The span of `[addr, addr + len)` of `domain`, which peers may use as `access` says.
    ///
    /// # Safety
    ///
    /// The contract of `Engine::register_mem`: the range is memory of this process of
    /// `domain`, mapped, and stays valid until the engine has run the deregistration hooks of
    /// the region registered with this span (it is deregistered, or the engine finalized) or
    /// released a failed registration's keys; peers, this engine's transfers and the devices
    /// the backends register it with may read and write it at any time until then,
    /// concurrently with the caller.
    pub(crate) unsafe fn new(addr: u64, len: u64, domain: Domain, access: Access) -> MemorySpan {
        MemorySpan { addr, len, domain, shared: None, access }
    }

    /// The span of memory the engine allocated (`Engine::alloc`), peers may READ and WRITE it.
    /// Safe: the span holds `mem` while it lives, and the engine keeps it (its `allocated`
    /// table) until the region's deregistration hooks have run.
    pub(crate) fn engine_owned(mem: &Arc<SharedMem>) -> MemorySpan {
        MemorySpan {
            addr: mem.addr(),
            len: mem.len(),
            domain: Domain::Host,
            shared: Some(mem.clone()),
            access: Access::ReadWrite,
        }
    }

    /// Start address.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Its memory domain (device memory: the device that holds it, once resolved).
    pub fn domain(&self) -> Domain {
        self.domain
    }

    /// The sealed memfd the memory is a mapping of, when the engine allocated it.
    pub fn memfd(&self) -> Option<RawFd> {
        self.shared.as_ref().map(|m| m.fd())
    }

    /// What peers may do with it (a backend whose device enforces access registers it so).
    pub fn access(&self) -> Access {
        self.access
    }

    /// Gives device memory the domain of the device that holds it (`device` becomes `cuda:N`),
    /// as the driver says (`cuda::resolve`); an error leaves the domain as it was.
    pub(crate) fn resolve_device(&mut self) -> Result<()> {
        self.domain = crate::cuda::resolve(self.addr, self.len, self.domain)?.domain;
        Ok(())
    }

    /// What the deregistration hooks of this span's registration see.
    pub(crate) fn released(&self) -> ReleasedSpan {
        ReleasedSpan { addr: self.addr }
    }
}

/// Memory being deregistered, as a deregistration hook sees it: a plain description (what the
/// hooks need to find what they registered), which cannot register anything.
#[derive(Clone, Copy, Debug)]
pub struct ReleasedSpan {
    /// Start address.
    pub addr: u64,
}

/// What a backend may use to open a data path.
pub struct OpenCtx<'a> {
    /// The engine's options.
    pub opts: &'a Options,
    /// The peer's address.
    pub addr: SocketAddr,
    /// How the control channel was connected (a backend that opens TCP streams of its own
    /// starts from these).
    pub params: &'a ConnectParams,
    /// This machine's identity (a hint: a peer that claims another host is not tried).
    pub host: &'a str,
    /// The connect deadline.
    pub timeout: Duration,
    /// The engine's stager, which a path that moves host memory only runs its requests that
    /// touch device memory through (`tcp`, see `transport::staging`).
    pub(crate) stager: &'a Arc<crate::transport::staging::Stager>,
}

/// A way to move a link's data.
pub trait Backend: Send + Sync {
    /// Its name, as `hixl.backends`, capabilities and `stats()` spell it.
    fn name(&self) -> &'static str;

    /// The (local, remote) memory-domain pairs it moves data between.
    fn domains(&self) -> &'static [(Domain, Domain)];

    /// Why it does not serve `domain` memory here although it could elsewhere (the engine adds
    /// this to the UNSUPPORTED of a registration no backend serves); `None`: it serves it, or
    /// never does.
    fn unserved(&self, domain: Domain) -> Option<String> {
        let _ = domain;
        None
    }

    /// What this engine advertises for it in Welcome; `None` when it cannot be offered here.
    /// `local_socket` is the name of this engine's same-host socket (empty: none).
    fn capability(&self, local_socket: &str) -> Option<Capability> {
        let _ = local_socket;
        Some(Capability {
            backend: self.name().into(),
            domains: self.domains().to_vec(),
            param: String::new(),
        })
    }

    /// Registration hook: the key peers need to reach this memory through this backend
    /// (`None`: none needed). An error fails the registration.
    fn register(&self, mem: &MemorySpan) -> Result<Option<Vec<u8>>> {
        let _ = mem;
        Ok(None)
    }

    /// Deregistration hook: releases what `register` set up for `key`.
    fn deregister(&self, mem: &ReleasedSpan, key: &[u8]) {
        let _ = (mem, key);
    }

    /// Opens a data path to the peer at the other end of `control`, which offered `offer`; Err
    /// says why this backend cannot serve that peer (the engine then tries the next).
    fn connect(
        &self,
        ctx: &OpenCtx<'_>,
        control: &Arc<dyn ControlChannel>,
        offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String>;

    /// The target's side of a `connect` that needs one (`ControlChannel::open_backend`): answers the
    /// initiator's BackendOpen payload on a served control link from `from` (the initiator's
    /// address, for per-source caps). `state` is this backend's state for that link, kept
    /// until the link ends (then dropped). The default refuses.
    fn accept(
        &self,
        from: std::net::IpAddr,
        payload: &[u8],
        state: &mut Option<Box<dyn Any + Send>>,
    ) -> Result<Vec<u8>> {
        let _ = (from, payload, state);
        Err(Error::new(Status::Unsupported, format!("backend {} opens nothing on the target", self.name())))
    }
}

/// Per-link target state of the backends that `accept`ed (dropped when the link ends).
pub(crate) type Accepted = Vec<(String, Option<Box<dyn Any + Send>>)>;

/// Answers a BackendOpen frame on a served stream: only on a control link (never a data-path
/// stream), only for a backend this engine has.
pub(crate) fn answer_open(
    backends: &[Arc<dyn Backend>],
    control_link: bool,
    from: std::net::IpAddr,
    backend: &str,
    payload: &[u8],
    accepted: &mut Accepted,
) -> crate::wire::Frame {
    let res = match backends.iter().find(|b| b.name() == backend) {
        _ if !control_link => Err(Error::param("BackendOpen is answered on a control channel only")),
        None => Err(Error::new(Status::Unsupported, format!("this engine has no backend {backend:?}"))),
        Some(b) => {
            let at = match accepted.iter().position(|(n, _)| n == backend) {
                Some(i) => i,
                None => {
                    accepted.push((backend.to_string(), None));
                    accepted.len() - 1
                }
            };
            b.accept(from, payload, &mut accepted[at].1)
        }
    };
    match res {
        Ok(payload) => crate::wire::Frame::BackendOpened { status: 0, message: String::new(), payload },
        Err(e) => crate::wire::Frame::BackendOpened { status: e.code(), message: e.message, payload: vec![] },
    }
}

/// The capability of a backend that needs the same-host socket, if this engine has one.
pub(crate) fn with_local_socket(b: &dyn Backend, local_socket: &str) -> Option<Capability> {
    (!local_socket.is_empty()).then(|| Capability {
        backend: b.name().into(),
        domains: b.domains().to_vec(),
        param: local_socket.into(),
    })
}
