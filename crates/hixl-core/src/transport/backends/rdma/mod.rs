//! The `rdma` backend: one-sided RDMA READ and WRITE over RC queue pairs.
//!
//! - Rails: `hixl.rdma.device` names one device, several (a comma list) or `all`; each is a
//!   rail with its own PD, CQ and channel (`rails`, `nic`), all drained by one poller thread.
//! - Registration: `ibv_reg_mr` per registered region on every rail, with remote write only
//!   for writable regions (the NIC then refuses what the TCP target refuses); the region's key
//!   in the region table is its rkeys, one per rail (`wire::rdma::encode_rkeys`).
//! - Connection: the initiator creates `hixl.rdma.qps` QPs on each rail and sends their
//!   addresses (GID, LID, QPN, PSN, MTU, rail) in a BackendOpen frame over the authenticated
//!   control channel; the target (`accept`) creates as many, each on its rail of the same index
//!   modulo its own rail count, connects them and answers with theirs (and their rails); its
//!   QPs live as long as that control link. A target makes at most `hixl.rdma.max_qps` QPs for initiators in all
//!   and `hixl.rdma.max_qps_per_source` for one source address (see `source_caps`); a
//!   BackendOpen over a cap is answered `RESOURCE_EXHAUSTED` naming it, and nothing is made.
//! - Data path: `link` (work-request chains, one doorbell per batch, one poller per engine in
//!   `nic`), bookkeeping in `book`, request building in `wrs`.
//! - Providers: `verbs` (libibverbs loaded at run time, `verbs::ibverbs`) and `soft` (a
//!   software RC NIC, for tests, `verbs::soft`); both behind the one-to-one `verbs::Verbs`
//!   interface, and with it the whole FFI layer, in `verbs`.

mod book;
mod decl;
pub mod gpudirect;
mod limits;
mod link;
mod nic;
mod rails;
pub mod verbs;
mod wrs;

use std::any::Any;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result, Status};
use crate::options::rdma::{Provider, RdmaOptions};
use crate::options::Options;
use crate::transport::backend::{Backend, MemorySpan, OpenCtx, ReleasedSpan, HOST_TO_HOST};
use crate::transport::control::channel::ControlChannel;
use crate::transport::target_side::source_caps::{Cap, Counted, SourceCaps};
use crate::transport::DataPath;
use crate::wire::rdma::{decode_rkeys, encode_rkeys, QpAddr, RdmaOpen, MAX_QPN, MAX_QPS};
use crate::wire::{Capability, Domain};
pub(crate) use decl::DECL;
pub use link::RdmaLink;
use nic::{Nic, RailQp};
use rails::Rails;
use verbs::{access, Context, QpCaps, QpTransition, Verbs};

/// The backend's name, as `hixl.backends` and `stats()` spell it.
pub(crate) const NAME: &str = "rdma";

/// Local ACK timeout of our QPs: 4.096 us * 2^16 = 268 ms per try.
const ACK_TIMEOUT: u8 = 16;
/// Retries before a request fails with RETRY_EXC_ERR (7 is the most the verbs allow).
const RETRY_COUNT: u8 = 7;
/// Most QPs the target side of one link may hold (its own plus those it retired lazily).
const MAX_TARGET_QPS: usize = 2 * MAX_QPS;

/// What `hixl info` tells of `rdma` here, with libibverbs: usable when a device has an active
/// port; the note is [`describe`]'s line ("not loadable: ...", "no device ..." or "devices: ...").
fn host_facts() -> crate::options::HostFacts {
    let note = describe("verbs").unwrap_or_else(|e| e.message);
    crate::options::HostFacts { usable: Some(note.starts_with("devices:") && note.contains("active")), note }
}

pub(crate) fn unsupported(message: impl Into<String>) -> Error {
    Error::new(Status::Unsupported, message)
}

/// The provider a `hixl.rdma.provider` names.
pub fn provider(p: Provider) -> Result<Arc<dyn Verbs>> {
    match p {
        Provider::Soft => Ok(Arc::new(verbs::soft::SoftVerbs::new())),
        Provider::Verbs => Ok(Arc::new(verbs::ibverbs::LibVerbs::load()?)),
    }
}

/// Bytes of inline data an initiator QP asks for: WRITEs up to the QP's `max_inline_data` (it
/// may get more) are posted inline, the device copying their bytes at post time instead of
/// reading them by DMA afterwards (a round trip on the PCIe bus less for a small WRITE).
const WANT_INLINE: u32 = 128;

/// A QP made and moved to INIT, with its address (destroyed when dropped).
struct Opened {
    qp: RailQp,
    addr: QpAddr,
    /// The peer QP it is connected to and the peer's rail it is on (set once connected).
    remote_qpn: u32,
    remote_rail: u8,
}

/// Creates `n` RC QPs on the rail's CQ and moves them to INIT with `remote_access` (none
/// for an initiator's: nothing may reach into its memory through them).
fn open_qps(nic: &Nic, n: usize, remote_access: u32) -> Result<Vec<Opened>> {
    let initiator = remote_access == 0;
    let mut out: Vec<Opened> = Vec::with_capacity(n);
    // Destroys the QPs made so far, in order (each gives its send-queue slots back).
    let fail = |out: &mut Vec<Opened>, e: Error| {
        out.clear();
        Err(e)
    };
    for _ in 0..n {
        let slots = if initiator {
            match nic.reserve_send_slots() {
                Ok(s) => Some(s),
                Err(e) => return fail(&mut out, e),
            }
        } else {
            None
        };
        let caps = QpCaps {
            max_send_wr: nic.limits.sq_depth,
            max_recv_wr: 1,
            max_send_sge: nic.limits.sge_write,
            max_recv_sge: 1,
            // Initiator QPs post small WRITEs inline (`RdmaLink::post_now`); targets never send.
            max_inline_data: if initiator { WANT_INLINE } else { 0 },
        };
        // Unmade, its slots are given back as `create_qp` drops them.
        let qp = match nic.create_qp(caps, slots) {
            Ok(q) => q,
            Err(e) => return fail(&mut out, e),
        };
        let mut rnd = [0u8; 4];
        if let Err(e) = crate::auth::random_bytes(&mut rnd) {
            drop(qp);
            return fail(&mut out, e);
        }
        let psn = u32::from_le_bytes(rnd) & MAX_QPN;
        let (gid, lid, qpn, mtu, rail) = (nic.gid, nic.attr.lid, qp.qpn(), nic.attr.active_mtu, nic.rail);
        // The READ depths this QP may have, as the device allows (the pair's smaller one is set
        // when it is connected: `connect_qps`).
        let (reads_out, reads_in) = (nic.limits.rd_atomic_init, nic.limits.rd_atomic_dest);
        let addr = QpAddr { gid, lid, qpn, psn, mtu, rail, reads_out, reads_in };
        out.push(Opened { qp, addr, remote_qpn: 0, remote_rail: 0 });
        let init = QpTransition::Init { port: nic.port, access: remote_access };
        if let Err(e) = out.last().expect("just pushed").qp.modify(&init) {
            return fail(&mut out, e);
        }
    }
    Ok(out)
}

/// Moves our INIT QPs (each on the rail its address names) to RTR (towards the peer's QP of the
/// same index) and, for QPs that send (`send`: the initiator's), to RTS. A target's QPs only
/// answer: RTR is enough. READ depths come from the pair: a QP answers at most as many READs
/// as its peer keeps outstanding, and keeps outstanding at most as many as its peer answers.
fn connect_qps(nics: &[Arc<Nic>], ours: &[Opened], theirs: &[QpAddr], send: bool) -> Result<()> {
    if ours.len() != theirs.len() {
        return Err(Error::not_connected(format!(
            "the peer answered with {} RDMA QP addresses for {} QPs",
            theirs.len(),
            ours.len()
        )));
    }
    for (o, t) in ours.iter().zip(theirs) {
        let nic = &nics[o.addr.rail as usize];
        let rtr = QpTransition::Rtr {
            remote: *t,
            mtu: o.addr.mtu.min(t.mtu),
            port: nic.port,
            gid_index: nic.gid_index,
            traffic_class: nic.traffic_class,
            sl: nic.sl,
            rd_atomic: o.addr.reads_in.min(t.reads_out),
        };
        o.qp.modify(&rtr)?;
        if !send {
            continue;
        }
        let rts = QpTransition::Rts {
            psn: o.addr.psn,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            rd_atomic: o.addr.reads_out.min(t.reads_in),
        };
        o.qp.modify(&rts)?;
    }
    Ok(())
}

/// Sends our QP addresses to the peer over the control channel and returns its answer.
fn exchange(control: &dyn ControlChannel, open: &RdmaOpen, timeout: Duration) -> Result<RdmaOpen> {
    let answer = control.open_backend(NAME, open.encode(), timeout)?;
    RdmaOpen::decode(&answer).map_err(|e| {
        Error::not_connected(format!("{} answered RDMA QP addresses that do not decode: {e}", control.peer()))
    })
}

/// The `rdma` backend of one engine: its devices (opened when the engine starts), or why there
/// are none.
pub struct Rdma {
    rails: std::result::Result<Arc<Rails>, String>,
    opts: RdmaOptions,
    provider: &'static str,
    /// `hixl.backends` is `rdma` alone: a registration the NIC refuses fails (with other
    /// backends it only leaves the region without an rdma key).
    only: bool,
    /// The QPs this engine made for initiators, under `hixl.rdma.max_qps(_per_source)`.
    target_qps: Arc<SourceCaps>,
    /// GPU memory on this device (GPUDirect), as found when the engine started.
    gpu: gpudirect::Gpu,
}

impl Rdma {
    /// Opens the devices `opts` names with its provider; without them the backend is built but
    /// offers nothing, registers nothing and cannot connect (the reason is kept).
    pub fn new(opts: &Options) -> Rdma {
        let o = opts.rdma.clone();
        let rails = provider(o.provider).and_then(|v| Rails::open(v, &o)).map_err(|e| e.message);
        if let Err(why) = &rails {
            if opts.backends.len() == 1 {
                tracing::warn!(provider = o.provider.as_str(), "RDMA is not usable: {why}");
            } else {
                tracing::debug!(provider = o.provider.as_str(), "RDMA is not usable: {why}");
            }
        }
        for n in rails.iter().flat_map(|r| &r.nics) {
            tracing::info!(provider = n.verbs().provider(), device = %n.device, rail = n.rail, port = n.port, "RDMA device opened");
        }
        let gpu = gpudirect::Gpu::probe(rails.as_ref().ok().and_then(|r| r.nics.first()).map(|n| &**n));
        let only = opts.backends.iter().all(|b| b == NAME);
        let counted = Counted {
            what: "RDMA queue pairs",
            holder: "this engine",
            total_key: "hixl.rdma.max_qps",
            per_source_key: "hixl.rdma.max_qps_per_source",
        };
        let (total, per_source) = (Cap::Fixed(o.max_qps), Cap::Fixed(o.max_qps_per_source));
        let target_qps = Arc::new(SourceCaps::new(counted, total, per_source));
        Rdma { rails, provider: o.provider.as_str(), opts: o, only, target_qps, gpu }
    }

    fn rails(&self) -> std::result::Result<&Arc<Rails>, String> {
        self.rails
            .as_ref()
            .map_err(|why| format!("RDMA is not usable here ({} provider): {why}", self.provider))
    }
}

impl Drop for Rdma {
    fn drop(&mut self) {
        if let Ok(rails) = &self.rails {
            rails.stop_poller();
        }
    }
}

/// The target side of one control link: the QPs it made for that initiator (at `from`), with
/// their rails and numbers, each counted in the engine's `caps` until destroyed.
struct TargetQps {
    /// Held so that the rails outlive the QPs (destroyed in `drop`, before this field goes).
    _rails: Arc<Rails>,
    qps: Vec<(u8, RailQp, u32)>,
    caps: Arc<SourceCaps>,
    from: IpAddr,
}

impl Drop for TargetQps {
    fn drop(&mut self) {
        self.caps.release(self.from, self.qps.len());
        // Destroyed in order, before the rails they were made on can go.
        self.qps.clear();
    }
}

impl Backend for Rdma {
    fn name(&self) -> &'static str {
        NAME
    }

    fn domains(&self) -> &'static [(Domain, Domain)] {
        self.gpu.domains().unwrap_or(HOST_TO_HOST)
    }

    fn unserved(&self, domain: Domain) -> Option<String> {
        domain.is_device().then(|| self.rails().err().or_else(|| self.gpu.unserved()))?
    }

    fn capability(&self, _local_socket: &str) -> Option<Capability> {
        let nic = &self.rails.as_ref().ok()?.nics[0];
        // The param names the provider and the link layer: a soft NIC cannot reach a real one,
        // nor InfiniBand a RoCE port.
        Some(Capability {
            backend: self.name().into(),
            domains: self.domains().to_vec(),
            param: format!("{}/{}", self.provider, nic.attr.link_layer),
        })
    }

    fn register(&self, mem: &MemorySpan) -> Result<Option<Vec<u8>>> {
        let Ok(rails) = &self.rails else { return Ok(None) };
        if let Some(r) = self.gpu.register(rails, mem) {
            return r.map(|rkeys| Some(encode_rkeys(&rkeys))).or_else(|e| refused_registration(e, self.only));
        }
        if mem.domain() != Domain::Host {
            return Ok(None);
        }
        match rails.register(mem) {
            Ok(rkeys) => Ok(Some(encode_rkeys(&rkeys))),
            Err(e) => refused_registration(e, self.only),
        }
    }

    fn deregister(&self, mem: &ReleasedSpan, key: &[u8]) {
        if let (Ok(rails), Ok(rkeys)) = (&self.rails, decode_rkeys(key)) {
            rails.deregister(mem.addr, &rkeys);
        }
    }

    fn connect(
        &self,
        ctx: &OpenCtx<'_>,
        control: &Arc<dyn ControlChannel>,
        offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String> {
        let rails = self.rails()?;
        let nic = &rails.nics[0];
        if ctx.opts.data_mac {
            // RDMA moves bytes NIC to NIC with no MAC: the promise of hixl.data_mac cannot hold.
            return Err(
                "hixl.data_mac=1 asks for a MAC on every transfer's bytes, and RDMA carries none".into()
            );
        }
        let ours = format!("{}/{}", self.provider, nic.attr.link_layer);
        if offer.param != ours {
            return Err(format!(
                "the peer's RDMA is {:?}, ours is {ours:?} (provider/link layer)",
                offer.param
            ));
        }
        let total = rails.nics.len() * self.opts.qps;
        if total > MAX_QPS {
            return Err(format!(
                "hixl.rdma.qps={} on each of {} rails is {total} QPs per peer, more than one BackendOpen \
                 carries ({MAX_QPS}): lower hixl.rdma.qps or name fewer devices",
                self.opts.qps,
                rails.nics.len()
            ));
        }
        let mut qps: Vec<Opened> = Vec::new();
        for nic in &rails.nics {
            match open_qps(nic, self.opts.qps, 0) {
                Ok(mut q) => qps.append(&mut q),
                Err(e) => {
                    drop(qps);
                    return Err(e.message);
                }
            }
        }
        let open = RdmaOpen { retire: vec![], qps: qps.iter().map(|o| o.addr).collect() };
        let connected = exchange(control.as_ref(), &open, ctx.timeout).and_then(|answer| {
            check_answer_rails(&qps, &answer.qps, control.peer())?;
            connect_qps(&rails.nics, &qps, &answer.qps, true)?;
            Ok(answer)
        });
        let answer = match connected {
            Ok(a) => a,
            Err(e) => {
                drop(qps);
                return Err(e.message);
            }
        };
        let qps: Vec<Opened> = qps
            .into_iter()
            .zip(&answer.qps)
            .map(|(o, t)| Opened { remote_qpn: t.qpn, remote_rail: t.rail, ..o })
            .collect();
        let (depth, timeout, per_rail) = (ctx.opts.queue_depth, ctx.timeout, self.opts.qps);
        let busy = self.opts.busy_poll;
        let link = rails
            .add_link(|id| {
                Arc::new(
                    RdmaLink::new(id, rails.clone(), control.clone(), qps, per_rail, depth, timeout)
                        .with_busy_poll(busy),
                )
            })
            .map_err(|e| e.message)?;
        // A dead control channel (heartbeats missed, the peer's host gone) ends this link's
        // requests at once: a device need not report a peer that vanished (rdma_rxe does not).
        // Closed on a thread of its own: it waits for the QPs' flush.
        let weak = Arc::downgrade(&link);
        control.on_close(Box::new(move |why| {
            let Some(l) = weak.upgrade() else { return };
            let on_thread = l.clone();
            let why2 = why.clone();
            let spawned = crate::place::spawn("hixl-rdma-close".into(), move || {
                crate::transport::DataPath::close(&*on_thread, why2)
            });
            if spawned.is_err() {
                // No thread to spare: close here (it blocks this thread up to the flush wait).
                crate::transport::DataPath::close(&*l, why);
            }
        }));
        Ok(link)
    }

    fn accept(
        &self,
        from: IpAddr,
        payload: &[u8],
        state: &mut Option<Box<dyn Any + Send>>,
    ) -> Result<Vec<u8>> {
        let rails = self.rails().map_err(unsupported)?;
        let open = RdmaOpen::decode(payload).map_err(|e| Error::param(format!("RDMA QP addresses: {e}")))?;
        let caps = &self.target_qps;
        let st = state.get_or_insert_with(|| {
            Box::new(TargetQps { _rails: rails.clone(), qps: Vec::new(), caps: caps.clone(), from })
        });
        let target =
            st.downcast_mut::<TargetQps>().ok_or_else(|| Error::failed("rdma: foreign link state"))?;
        // Only QPs of this very link may be retired.
        for r in &open.retire {
            if let Some(i) = target.qps.iter().position(|(rail, _, n)| *n == r.qpn && *rail == r.rail) {
                drop(target.qps.swap_remove(i));
                caps.release(target.from, 1);
            }
        }
        if target.qps.len() + open.qps.len() > MAX_TARGET_QPS {
            return Err(Error::new(
                Status::ResourceExhausted,
                format!("this link already holds {} RDMA QPs (at most {MAX_TARGET_QPS})", target.qps.len()),
            ));
        }
        let n = open.qps.len();
        caps.admit(target.from, n).map_err(|m| Error::new(Status::ResourceExhausted, m))?;
        let made = open_for(rails, &open.qps).and_then(|mut ours| {
            // Each QP answers as many READs as its initiator keeps outstanding, and says so.
            for (o, t) in ours.iter_mut().zip(&open.qps) {
                o.addr.reads_in = o.addr.reads_in.min(t.reads_out);
            }
            match connect_qps(&rails.nics, &ours, &open.qps, false) {
                Ok(()) => Ok(ours),
                Err(e) => {
                    drop(ours);
                    Err(e)
                }
            }
        });
        let ours = made.inspect_err(|_| caps.release(target.from, n))?;
        let answer = RdmaOpen { retire: vec![], qps: ours.iter().map(|o| o.addr).collect() };
        target.qps.extend(ours.into_iter().map(|o| {
            let qpn = o.qp.qpn();
            (o.addr.rail, o.qp, qpn)
        }));
        Ok(answer.encode())
    }
}

/// The target's QPs for an initiator's `theirs`: each on our rail of the same index modulo our
/// rail count (an initiator of one rail, or of before rails, asks for rail 0 only).
fn open_for(rails: &Rails, theirs: &[QpAddr]) -> Result<Vec<Opened>> {
    let mut out: Vec<Opened> = Vec::with_capacity(theirs.len());
    for t in theirs {
        let nic = &rails.nics[t.rail as usize % rails.nics.len()];
        match open_qps(nic, 1, access::REMOTE_READ | access::REMOTE_WRITE) {
            Ok(mut q) => out.append(&mut q),
            Err(e) => {
                drop(out);
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// The peer's answer puts every QP of one of our rails on one rail of its own (the rkey a work
/// request carries is chosen by the peer's rail, per rail of ours).
fn check_answer_rails(ours: &[Opened], theirs: &[QpAddr], peer: &str) -> Result<()> {
    for (o, t) in ours.iter().zip(theirs) {
        let first = ours.iter().zip(theirs).find(|(p, _)| p.addr.rail == o.addr.rail).map(|(_, t)| t.rail);
        if first != Some(t.rail) {
            return Err(Error::not_connected(format!(
                "{peer} answered QPs of our rail {} on more than one of its rails",
                o.addr.rail
            )));
        }
    }
    Ok(())
}

/// A registration the NIC refused (most often ENOMEM: the locked-memory limit). With other
/// backends in `hixl.backends` the region is registered without an rdma key (transfers to it
/// over rdma then fail naming that; the other backends are unaffected) and a WARN says why;
/// with `rdma` alone the registration fails.
fn refused_registration(e: Error, only: bool) -> Result<Option<Vec<u8>>> {
    let hint = if e.message.contains("Cannot allocate memory") {
        " (registrations pin memory: raise the locked-memory limit, ulimit -l / LimitMEMLOCK)"
    } else {
        ""
    };
    if only {
        return Err(Error::new(e.status, format!("{}{hint}", e.message)));
    }
    tracing::warn!(
        "the RDMA device refused a registration, so the region has no rdma key: {}{hint}",
        e.message
    );
    Ok(None)
}

/// What `hixl info` reports about RDMA with the provider `hixl.rdma.provider` names ("verbs"
/// or "soft"): "not loadable: ...", "no device ..." or "devices: NAME (port 1 active; device
/// max_cqe ...; hixl uses CQ ...), ...": each device's limits and the queue sizes used on it.
pub fn describe(provider_name: &str) -> Result<String> {
    let p = crate::options::rdma::provider("provider", provider_name)?;
    Ok(describe_with(p))
}

fn describe_with(p: Provider) -> String {
    let verbs = match provider(p) {
        Ok(v) => v,
        Err(e) => return format!("not loadable: {}", e.message),
    };
    match verbs.get_device_list() {
        Err(e) => format!("no device: {}", e.message),
        Ok(names) if names.is_empty() => "no device".to_string(),
        Ok(names) => {
            let mut usable = Vec::new();
            for n in &names {
                let state = match Context::open(&verbs, n) {
                    Ok(ctx) => {
                        let s = match ctx.query_port(1) {
                            Ok(a) if a.state == verbs::PORT_ACTIVE => {
                                let sizes = ctx
                                    .query_device()
                                    .and_then(|d| limits::Limits::derive(&d, &a).map(|l| l.describe(&d, &a)));
                                match sizes {
                                    Ok(s) => format!("port 1 active; {s}"),
                                    Err(e) => format!("port 1 active; not usable: {}", e.message),
                                }
                            }
                            Ok(a) => format!("port 1 state {}", a.state),
                            Err(e) => e.message,
                        };
                        drop(ctx); // opened for this report only
                        s
                    }
                    Err(e) => e.message,
                };
                usable.push(format!("{n} ({state})"));
            }
            format!("devices: {}", usable.join(", "))
        }
    }
}

#[cfg(test)]
mod tests;
