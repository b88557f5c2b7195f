//! The `rdma` backend: one-sided RDMA READ and WRITE over RC queue pairs.
//!
//! - Registration: `ibv_reg_mr` per registered region, with remote write only for writable
//!   regions (the NIC then refuses what the TCP target refuses); the rkey is the region's key
//!   in the region table.
//! - Connection: the initiator creates `hixl.rdma.qps` QPs and sends their addresses (GID, LID,
//!   QPN, PSN, MTU) in a BackendOpen frame over the authenticated control channel; the target
//!   (`accept`) creates as many, connects them and answers with theirs; its QPs live as long as
//!   that control link. A target makes at most `hixl.rdma.max_qps` QPs for initiators in all
//!   and `hixl.rdma.max_qps_per_source` for one source address (see `source_caps`); a
//!   BackendOpen over a cap is answered `RESOURCE_EXHAUSTED` naming it, and nothing is made.
//! - Data path: `link` (work-request chains, one doorbell per batch, one poller per engine in
//!   `nic`), bookkeeping in `book`, request building in `wrs`.
//! - Providers: `verbs` (libibverbs loaded at run time, `ffi`) and `soft` (a software RC NIC,
//!   for tests); both behind the one-to-one `verbs::Verbs` interface.

mod book;
pub mod ffi;
pub mod gpudirect;
mod limits;
mod link;
mod nic;
pub mod soft;
pub mod verbs;
mod wrs;

use std::any::Any;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result, Status};
use crate::options::rdma::{Provider, RdmaOptions};
use crate::options::Options;
use crate::transport::backend::{Backend, MemorySpan, OpenCtx, HOST_TO_HOST};
use crate::transport::source_caps::{Cap, Counted, SourceCaps};
use crate::transport::tcp::TcpLink;
use crate::transport::DataPath;
use crate::wire::rdma::{decode_rkey, encode_rkey, QpAddr, RdmaOpen, MAX_QPN, MAX_QPS};
use crate::wire::{Capability, Domain};
pub use link::RdmaLink;
use nic::Nic;
use verbs::{access, QpCaps, QpCreated, QpTransition, Verbs};

/// Local ACK timeout of our QPs: 4.096 us * 2^16 = 268 ms per try.
const ACK_TIMEOUT: u8 = 16;
/// Retries before a request fails with RETRY_EXC_ERR (7 is the most the verbs allow).
const RETRY_COUNT: u8 = 7;
/// Most QPs the target side of one link may hold (its own plus those it retired lazily).
const MAX_TARGET_QPS: usize = 2 * MAX_QPS;

pub(crate) fn unsupported(message: impl Into<String>) -> Error {
    Error::new(Status::Unsupported, message)
}

/// The provider a `hixl.rdma.provider` names.
pub fn provider(p: Provider) -> Result<Arc<dyn Verbs>> {
    match p {
        Provider::Soft => Ok(Arc::new(soft::SoftVerbs::new())),
        Provider::Verbs => Ok(Arc::new(ffi::LibVerbs::load()?)),
    }
}

/// A QP made and moved to INIT, with its address.
struct Opened {
    created: QpCreated,
    addr: QpAddr,
    /// The peer QP it is connected to (set once connected).
    remote_qpn: u32,
}

/// Creates `n` RC QPs on the engine's CQ and moves them to INIT with `remote_access` (none
/// for an initiator's: nothing may reach into its memory through them).
fn open_qps(nic: &Nic, n: usize, remote_access: u32) -> Result<Vec<Opened>> {
    let initiator = remote_access == 0;
    let sq = nic.limits.sq_depth as usize;
    let mut out: Vec<Opened> = Vec::with_capacity(n);
    let fail = |out: &mut Vec<Opened>, e: Error| {
        for o in out.drain(..) {
            nic.destroy_qp(o.created.qp, initiator);
        }
        Err(e)
    };
    for _ in 0..n {
        if initiator {
            let used = nic.sq_slots.fetch_add(sq, Ordering::AcqRel) + sq;
            if used > nic.limits.cq_depth as usize {
                nic.sq_slots.fetch_sub(sq, Ordering::AcqRel);
                let e = Error::new(
                    Status::ResourceExhausted,
                    format!(
                        "the engine's RDMA completion queue ({} entries, the device's limit) serves at \
                         most {} QPs of {} work requests (fewer peers, or a smaller hixl.rdma.qps)",
                        nic.limits.cq_depth,
                        nic.limits.max_initiator_qps(),
                        sq
                    ),
                );
                return fail(&mut out, e);
            }
        }
        let caps = QpCaps {
            max_send_wr: nic.limits.sq_depth,
            max_recv_wr: 1,
            max_send_sge: nic.limits.sge_write,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let created = match nic.verbs.create_qp(nic.pd, nic.cq, caps) {
            Ok(c) => c,
            Err(e) => {
                if initiator {
                    nic.sq_slots.fetch_sub(sq, Ordering::AcqRel);
                }
                return fail(&mut out, e);
            }
        };
        let mut rnd = [0u8; 4];
        if let Err(e) = crate::auth::random_bytes(&mut rnd) {
            nic.destroy_qp(created.qp, initiator);
            return fail(&mut out, e);
        }
        let psn = u32::from_le_bytes(rnd) & MAX_QPN;
        let addr =
            QpAddr { gid: nic.gid, lid: nic.attr.lid, qpn: created.qpn, psn, mtu: nic.attr.active_mtu };
        out.push(Opened { created, addr, remote_qpn: 0 });
        let init = QpTransition::Init { port: nic.port, access: remote_access };
        if let Err(e) = nic.verbs.modify_qp(created.qp, &init) {
            return fail(&mut out, e);
        }
    }
    Ok(out)
}

/// Moves our INIT QPs to RTR (towards the peer's QP of the same index) and, for QPs that send
/// (`send`: the initiator's), to RTS. A target's QPs only answer: RTR is enough.
fn connect_qps(nic: &Nic, ours: &[Opened], theirs: &[QpAddr], send: bool) -> Result<()> {
    if ours.len() != theirs.len() {
        return Err(Error::not_connected(format!(
            "the peer answered with {} RDMA QP addresses for {} QPs",
            theirs.len(),
            ours.len()
        )));
    }
    for (o, t) in ours.iter().zip(theirs) {
        let rtr = QpTransition::Rtr {
            remote: *t,
            mtu: o.addr.mtu.min(t.mtu),
            port: nic.port,
            gid_index: nic.gid_index,
            traffic_class: nic.traffic_class,
            sl: nic.sl,
            rd_atomic: nic.limits.rd_atomic_dest,
        };
        nic.verbs.modify_qp(o.created.qp, &rtr)?;
        if !send {
            continue;
        }
        let rts = QpTransition::Rts {
            psn: o.addr.psn,
            timeout: ACK_TIMEOUT,
            retry_cnt: RETRY_COUNT,
            rd_atomic: nic.limits.rd_atomic_init,
        };
        nic.verbs.modify_qp(o.created.qp, &rts)?;
    }
    Ok(())
}

/// Sends our QP addresses to the peer over the control channel and returns its answer.
fn exchange(control: &TcpLink, open: &RdmaOpen, timeout: Duration) -> Result<RdmaOpen> {
    let answer = control.open_backend("rdma", open.encode(), timeout)?;
    RdmaOpen::decode(&answer).map_err(|e| {
        Error::not_connected(format!("{} answered RDMA QP addresses that do not decode: {e}", control.peer()))
    })
}

/// The `rdma` backend of one engine: its device (opened when the engine starts), or why there
/// is none.
pub struct Rdma {
    nic: std::result::Result<Arc<Nic>, String>,
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
    /// Opens the device `opts` names with its provider; without one the backend is built but
    /// offers nothing, registers nothing and cannot connect (the reason is kept).
    pub fn new(opts: &Options) -> Rdma {
        let o = opts.rdma.clone();
        let nic = provider(o.provider).and_then(|v| Nic::open(v, &o)).map_err(|e| e.message);
        if let Err(why) = &nic {
            if opts.backends.len() == 1 {
                tracing::warn!(provider = o.provider.as_str(), "RDMA is not usable: {why}");
            } else {
                tracing::debug!(provider = o.provider.as_str(), "RDMA is not usable: {why}");
            }
        }
        if let Ok(n) = &nic {
            tracing::info!(provider = n.verbs.provider(), device = %n.device, port = n.port, "RDMA device opened");
        }
        let gpu = gpudirect::Gpu::probe(nic.as_deref().ok());
        let only = opts.backends.iter().all(|b| b == "rdma");
        let counted = Counted {
            what: "RDMA queue pairs",
            holder: "this engine",
            total_key: "hixl.rdma.max_qps",
            per_source_key: "hixl.rdma.max_qps_per_source",
        };
        let (total, per_source) = (Cap::Fixed(o.max_qps), Cap::Fixed(o.max_qps_per_source));
        let target_qps = Arc::new(SourceCaps::new(counted, total, per_source));
        Rdma { nic, provider: o.provider.as_str(), opts: o, only, target_qps, gpu }
    }

    fn nic(&self) -> std::result::Result<&Arc<Nic>, String> {
        self.nic
            .as_ref()
            .map_err(|why| format!("RDMA is not usable here ({} provider): {why}", self.provider))
    }
}

impl Drop for Rdma {
    fn drop(&mut self) {
        if let Ok(nic) = &self.nic {
            nic.stop_poller();
        }
    }
}

/// The target side of one control link: the QPs it made for that initiator (at `from`),
/// each counted in the engine's `caps` until destroyed.
struct TargetQps {
    nic: Arc<Nic>,
    qps: Vec<(verbs::Qp, u32)>,
    caps: Arc<SourceCaps>,
    from: IpAddr,
}

impl Drop for TargetQps {
    fn drop(&mut self) {
        self.caps.release(self.from, self.qps.len());
        for (qp, _) in self.qps.drain(..) {
            self.nic.destroy_qp(qp, false);
        }
    }
}

impl Backend for Rdma {
    fn name(&self) -> &'static str {
        "rdma"
    }

    fn domains(&self) -> &'static [(Domain, Domain)] {
        self.gpu.domains().unwrap_or(HOST_TO_HOST)
    }

    fn unserved(&self, domain: Domain) -> Option<String> {
        domain.is_device().then(|| self.nic().err().or_else(|| self.gpu.unserved()))?
    }

    fn capability(&self, _local_socket: &str) -> Option<Capability> {
        let nic = self.nic.as_ref().ok()?;
        // The param names the provider and the link layer: a soft NIC cannot reach a real one,
        // nor InfiniBand a RoCE port.
        Some(Capability {
            backend: self.name().into(),
            domains: self.domains().to_vec(),
            param: format!("{}/{}", self.provider, nic.attr.link_layer),
        })
    }

    fn register(&self, mem: &MemorySpan) -> Result<Option<Vec<u8>>> {
        let Ok(nic) = &self.nic else { return Ok(None) };
        if let Some(r) = self.gpu.register(nic, mem) {
            return r.map(|rkey| Some(encode_rkey(rkey))).or_else(|e| refused_registration(e, self.only));
        }
        if mem.domain != Domain::Host {
            return Ok(None);
        }
        match nic.register(mem.addr, mem.len, mem.access) {
            Ok(rkey) => Ok(Some(encode_rkey(rkey))),
            Err(e) => refused_registration(e, self.only),
        }
    }

    fn deregister(&self, mem: &MemorySpan, key: &[u8]) {
        if let (Ok(nic), Ok(rkey)) = (&self.nic, decode_rkey(key)) {
            nic.deregister(mem.addr, rkey);
        }
    }

    fn connect(
        &self,
        ctx: &OpenCtx<'_>,
        control: &Arc<TcpLink>,
        offer: &Capability,
    ) -> std::result::Result<Arc<dyn DataPath>, String> {
        let nic = self.nic()?;
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
        let qps = open_qps(nic, self.opts.qps, 0).map_err(|e| e.message)?;
        let open = RdmaOpen { retire: vec![], qps: qps.iter().map(|o| o.addr).collect() };
        let connected = exchange(control, &open, ctx.timeout).and_then(|answer| {
            connect_qps(nic, &qps, &answer.qps, true)?;
            Ok(answer)
        });
        let answer = match connected {
            Ok(a) => a,
            Err(e) => {
                for o in qps {
                    nic.destroy_qp(o.created.qp, true);
                }
                return Err(e.message);
            }
        };
        let qps: Vec<Opened> =
            qps.into_iter().zip(&answer.qps).map(|(o, t)| Opened { remote_qpn: t.qpn, ..o }).collect();
        let (depth, timeout, busy) = (ctx.opts.queue_depth, ctx.timeout, self.opts.busy_poll);
        let link = nic
            .add_link(|id| {
                Arc::new(RdmaLink::new(id, nic.clone(), control.clone(), qps, depth, timeout, busy))
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
            let spawned = std::thread::Builder::new()
                .name("hixl-rdma-close".into())
                .spawn(move || crate::transport::DataPath::close(&*on_thread, why2));
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
        let nic = self.nic().map_err(unsupported)?;
        let open = RdmaOpen::decode(payload).map_err(|e| Error::param(format!("RDMA QP addresses: {e}")))?;
        let caps = &self.target_qps;
        let st = state.get_or_insert_with(|| {
            Box::new(TargetQps { nic: nic.clone(), qps: Vec::new(), caps: caps.clone(), from })
        });
        let target =
            st.downcast_mut::<TargetQps>().ok_or_else(|| Error::failed("rdma: foreign link state"))?;
        // Only QPs of this very link may be retired.
        for qpn in &open.retire {
            if let Some(i) = target.qps.iter().position(|(_, n)| n == qpn) {
                let (qp, _) = target.qps.swap_remove(i);
                nic.destroy_qp(qp, false);
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
        let made = open_qps(nic, n, access::REMOTE_READ | access::REMOTE_WRITE).and_then(|ours| {
            match connect_qps(nic, &ours, &open.qps, false) {
                Ok(()) => Ok(ours),
                Err(e) => {
                    for o in ours {
                        nic.destroy_qp(o.created.qp, false);
                    }
                    Err(e)
                }
            }
        });
        let ours = made.inspect_err(|_| caps.release(target.from, n))?;
        let answer = RdmaOpen { retire: vec![], qps: ours.iter().map(|o| o.addr).collect() };
        target.qps.extend(ours.iter().map(|o| (o.created.qp, o.created.qpn)));
        Ok(answer.encode())
    }
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
                let state = match verbs.open_device(n) {
                    Ok(ctx) => {
                        let s = match verbs.query_port(ctx, 1) {
                            Ok(a) if a.state == verbs::PORT_ACTIVE => {
                                let sizes = verbs
                                    .query_device(ctx)
                                    .and_then(|d| limits::Limits::derive(&d, &a).map(|l| l.describe(&d, &a)));
                                match sizes {
                                    Ok(s) => format!("port 1 active; {s}"),
                                    Err(e) => format!("port 1 active; not usable: {}", e.message),
                                }
                            }
                            Ok(a) => format!("port 1 state {}", a.state),
                            Err(e) => e.message,
                        };
                        verbs.close_device(ctx);
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
mod tests {
    use super::*;

    #[test]
    fn a_refused_registration_fails_only_when_rdma_is_the_one_backend() {
        let enomem = || Error::failed("ibv_reg_mr(0x1000+4096) failed: Cannot allocate memory (os error 12)");
        let e = refused_registration(enomem(), true).unwrap_err();
        assert!(e.message.contains("ulimit -l") && e.message.contains("0x1000"), "{e}");
        assert_eq!(refused_registration(enomem(), false).unwrap(), None, "left without an rdma key");
        let e = refused_registration(Error::failed("ibv_reg_mr failed: Bad address"), true).unwrap_err();
        assert!(!e.message.contains("ulimit"), "{e}");
    }

    const LOCAL: IpAddr = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);

    fn soft_backend_with(extra: &[(&str, &str)]) -> Arc<dyn Backend> {
        let kv = [("hixl.backends", "rdma"), ("hixl.rdma.provider", "soft")];
        let map = kv.iter().chain(extra).map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Arc::new(Rdma::new(&Options::parse(&map).unwrap()))
    }

    fn soft_backend() -> Arc<dyn Backend> {
        soft_backend_with(&[])
    }

    /// QPs are capped per source and per engine, across links; a link's end gives its back.
    #[test]
    fn target_qps_are_capped_per_source_and_per_engine() {
        use crate::transport::backend::{answer_open, Accepted};
        let backends =
            vec![soft_backend_with(&[("hixl.rdma.max_qps", "6"), ("hixl.rdma.max_qps_per_source", "4")])];
        let q = |qpn| QpAddr { gid: [0xfe; 16], lid: 0, qpn, psn: 7, mtu: 5 };
        let ask = |n: u32| RdmaOpen { retire: vec![], qps: (0..n).map(|i| q(0x40 + i)).collect() }.encode();
        let other = IpAddr::V4(std::net::Ipv4Addr::new(10, 0, 0, 2));
        let (mut a, mut b, mut c) = (Accepted::new(), Accepted::new(), Accepted::new());
        assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &ask(3), &mut a)).0, 0);
        let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &ask(2), &mut b));
        assert_eq!(Status::from_code(status), Status::ResourceExhausted, "{msg}");
        assert!(msg.contains("hixl.rdma.max_qps_per_source = 4") && msg.contains("127.0.0.1"), "{msg}");
        assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &ask(1), &mut b)).0, 0);
        let (status, msg, _) = opened(answer_open(&backends, true, other, "rdma", &ask(3), &mut c));
        assert_eq!(Status::from_code(status), Status::ResourceExhausted, "{msg}");
        assert!(msg.contains("hixl.rdma.max_qps = 6"), "{msg}");
        drop(a);
        assert_eq!(opened(answer_open(&backends, true, other, "rdma", &ask(3), &mut c)).0, 0);
        assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &ask(2), &mut b)).0, 0);
    }

    fn opened(f: crate::wire::Frame) -> (u32, String, Vec<u8>) {
        match f {
            crate::wire::Frame::BackendOpened { status, message, payload } => (status, message, payload),
            other => panic!("not an answer: {other:?}"),
        }
    }

    /// The target's side of BackendOpen: hostile payloads are refused naming the problem,
    /// only a control link may open, QPs are made per link (and retired only from it), and a
    /// link cannot make more than its share.
    #[test]
    fn the_target_answers_backend_open_and_bounds_what_a_link_makes() {
        use crate::transport::backend::{answer_open, Accepted};
        let backends = vec![soft_backend()];
        let mut link = Accepted::new();
        let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &[1, 2, 3], &mut link));
        assert_eq!(Status::from_code(status), Status::ParamInvalid, "{msg}");
        assert!(msg.contains("RDMA QP addresses"), "{msg}");
        let q = |qpn| QpAddr { gid: [0xfe; 16], lid: 0, qpn, psn: 7, mtu: 5 };
        let ask = RdmaOpen { retire: vec![], qps: vec![q(0x41), q(0x42)] }.encode();
        let (status, msg, _) = opened(answer_open(&backends, false, LOCAL, "rdma", &ask, &mut link));
        assert_eq!(Status::from_code(status), Status::ParamInvalid, "a data-path stream: {msg}");
        let (status, _, _) = opened(answer_open(&backends, true, LOCAL, "gpu", &ask, &mut link));
        assert_eq!(Status::from_code(status), Status::Unsupported);
        let (status, msg, payload) = opened(answer_open(&backends, true, LOCAL, "rdma", &ask, &mut link));
        assert_eq!(status, 0, "{msg}");
        let ours = RdmaOpen::decode(&payload).unwrap();
        assert_eq!(ours.qps.len(), 2, "one target QP per initiator QP");
        let held = |link: &mut Accepted| {
            let st = link[0].1.as_mut().unwrap().downcast_mut::<TargetQps>().unwrap();
            st.qps.iter().map(|(_, n)| *n).collect::<Vec<u32>>()
        };
        assert_eq!(held(&mut link), ours.qps.iter().map(|a| a.qpn).collect::<Vec<_>>());
        // A replacement retires one of this link's QPs; an unknown number is ignored.
        let again = RdmaOpen { retire: vec![ours.qps[0].qpn, 0x7777], qps: vec![q(0x43)] }.encode();
        let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &again, &mut link));
        assert_eq!(status, 0, "{msg}");
        assert_eq!(held(&mut link).len(), 2);
        assert!(!held(&mut link).contains(&ours.qps[0].qpn));
        // At most MAX_TARGET_QPS per link.
        let many =
            RdmaOpen { retire: vec![], qps: (0..MAX_QPS as u32).map(|i| q(0x100 + i)).collect() }.encode();
        assert_eq!(opened(answer_open(&backends, true, LOCAL, "rdma", &many, &mut link)).0, 0);
        let (status, msg, _) = opened(answer_open(&backends, true, LOCAL, "rdma", &many, &mut link));
        assert_eq!(Status::from_code(status), Status::ResourceExhausted, "{msg}");
        assert_eq!(held(&mut link).len(), 2 + MAX_QPS);
    }
}
