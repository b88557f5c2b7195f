//! The responder half of the soft NIC: the device's socket, and one thread per connected peer
//! QP that checks each request the way an RC responder does (its QP's state and remote access,
//! then the rkey, the bounds and the region's access) and moves the bytes straight between the
//! socket and the registered memory. The target process's application takes no part.
//!
//! Between soft NICs: a Hello `{magic, dst_qpn, src_qpn, psn, src_gid}` once per connection,
//! then per request a 32-byte header `{op, rkey, addr, len, depth}` (WRITE: followed by its
//! bytes), answered by 8 bytes `{status}` (READ, on success: followed by its bytes). Little
//! endian. A READ's `depth` is how many READs its QP has outstanding with it (a NIC's responder
//! counts them by PSN): over the responder QP's `max_dest_rd_atomic` it is refused.

use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::fault;
use super::{socket_name, Device};
use crate::sys::sockio;
use crate::transport::backends::rdma::verbs::access;
use crate::transport::io::{self, iov};

/// RDMA WRITE.
pub(super) const OP_WRITE: u8 = 1;
/// RDMA READ.
pub(super) const OP_READ: u8 = 2;
const MAGIC: u32 = 0x5352_444d; // "SRDM"
/// How long a responder waits for the rest of a request once it started (bytes of a WRITE).
const DATA_WAIT: Duration = Duration::from_secs(10);
/// How long a new connection may take to send its whole Hello (a peer QP sends it at once).
const HELLO_WAIT: Duration = Duration::from_secs(1);
/// Most connections that have not sent their Hello yet; one over it is closed at once.
const MAX_HELLO_PENDING: usize = 32;
/// Most connections a device serves (each is a thread); one over it is closed at once.
const MAX_CONNS: usize = 4096;
/// Environment variable: microseconds the responder waits before it answers each request (a
/// model of wire latency; tests use it to keep requests in flight). Unset: none.
pub const LATENCY_ENV: &str = "HIXL_SOFT_RDMA_LATENCY_US";

/// Environment variable: `NAME:N` makes this process's soft device NAME go dark once its
/// responder has served N requests: it answers nothing more, drops every connection and
/// refuses new ones, as a NIC whose link went down (its peers' requests end RETRY_EXC_ERR).
/// `NAME:N:MS`: dark for MS milliseconds, then it answers again (a link that came back).
/// Tests use it to fail one rail mid-transfer. Unset: never.
pub const FAIL_AFTER_ENV: &str = "HIXL_SOFT_RDMA_FAIL_AFTER";

/// What [`FAIL_AFTER_ENV`] asks of one device.
#[derive(Clone, Copy, Debug)]
pub(super) struct FailAfter {
    /// Requests served before it goes dark.
    after: u64,
    /// How long it stays dark (None: for good).
    dark: Option<Duration>,
}

/// What [`FAIL_AFTER_ENV`] says for the device `name`.
pub(super) fn fail_after(name: &str) -> crate::error::Result<Option<FailAfter>> {
    let Ok(v) = std::env::var(FAIL_AFTER_ENV) else { return Ok(None) };
    let bad = || {
        crate::error::Error::param(format!(
            "{FAIL_AFTER_ENV}={v:?} is not NAME:N or NAME:N:MS (e.g. soft1:100 or soft1:100:2000)"
        ))
    };
    let mut it = v.split(':');
    let (dev, n) = (it.next().ok_or_else(bad)?, it.next().ok_or_else(bad)?);
    let after: u64 = n.trim().parse().map_err(|_| bad())?;
    let dark = match it.next() {
        None => None,
        Some(ms) => Some(Duration::from_millis(ms.trim().parse().map_err(|_| bad())?)),
    };
    if it.next().is_some() {
        return Err(bad());
    }
    Ok((dev.trim() == name).then_some(FailAfter { after, dark }))
}

/// Whether the device is dark now ([`FAIL_AFTER_ENV`]).
fn dark(dev: &Device) -> bool {
    let (Some(f), Some(at)) = (dev.fail_after, dev.dark_since.get()) else { return false };
    f.dark.is_none_or(|d| at.elapsed() < d)
}

/// Counts one request about to be served; false while the device is dark (it then drops
/// every connection; for good, its listener too).
fn still_up(dev: &Device) -> bool {
    let Some(f) = dev.fail_after else { return true };
    if dev.dark_since.get().is_some() {
        return !dark(dev);
    }
    if dev.served.fetch_add(1, Ordering::AcqRel) < f.after {
        return true;
    }
    if dev.dark_since.set(std::time::Instant::now()).is_ok() {
        tracing::warn!(device = %dev.name, "soft RDMA NIC goes dark ({FAIL_AFTER_ENV}, for {:?})", f.dark);
        if f.dark.is_none() {
            dev.stopping.store(true, Ordering::Release);
            io::shutdown(dev.listener().as_raw_fd());
        }
        for c in dev.conns.lock().unwrap().iter() {
            io::shutdown(c.as_raw_fd());
        }
    }
    false
}

fn latency() -> Option<Duration> {
    static L: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *L.get_or_init(|| {
        let us: u64 = std::env::var(LATENCY_ENV).ok()?.parse().ok()?;
        (us > 0).then(|| Duration::from_micros(us.min(1_000_000)))
    })
}

/// The first message on a connection: which QP it is for and who asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Hello {
    pub(super) dst_qpn: u32,
    pub(super) src_qpn: u32,
    pub(super) psn: u32,
    pub(super) src_gid: [u8; 16],
}

impl Hello {
    pub(super) fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4..8].copy_from_slice(&self.dst_qpn.to_le_bytes());
        b[8..12].copy_from_slice(&self.src_qpn.to_le_bytes());
        b[12..16].copy_from_slice(&self.psn.to_le_bytes());
        b[16..32].copy_from_slice(&self.src_gid);
        b
    }

    fn decode(b: &[u8; 32]) -> Option<Hello> {
        let u = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap());
        (u(0) == MAGIC).then(|| Hello {
            dst_qpn: u(4),
            src_qpn: u(8),
            psn: u(12),
            src_gid: b[16..32].try_into().unwrap(),
        })
    }
}

/// One request's header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Request {
    pub(super) op: u8,
    pub(super) rkey: u32,
    pub(super) addr: u64,
    pub(super) len: u64,
    /// READ: this QP's READs outstanding, this one included (0 for a WRITE).
    pub(super) depth: u32,
}

impl Request {
    pub(super) fn encode(&self) -> [u8; 32] {
        let mut b = [0u8; 32];
        b[0] = self.op;
        b[4..8].copy_from_slice(&self.rkey.to_le_bytes());
        b[8..16].copy_from_slice(&self.addr.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..28].copy_from_slice(&self.depth.to_le_bytes());
        b
    }

    fn decode(b: &[u8; 32]) -> Request {
        Request {
            op: b[0],
            rkey: u32::from_le_bytes(b[4..8].try_into().unwrap()),
            addr: u64::from_le_bytes(b[8..16].try_into().unwrap()),
            len: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            depth: u32::from_le_bytes(b[24..28].try_into().unwrap()),
        }
    }
}

/// A responder's answer (a NAK's syndrome).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Ok = 0,
    AccessError = 1,
    InvalidRequest = 2,
    OperationError = 3,
}

impl Status {
    pub(super) fn from_byte(b: u8) -> Status {
        match b {
            0 => Status::Ok,
            1 => Status::AccessError,
            2 => Status::InvalidRequest,
            _ => Status::OperationError,
        }
    }
}

/// Connects to the soft NIC whose GID is `gid`, with `wait` as the limit of every blocking call.
pub(super) fn connect(gid: &[u8; 16], wait: Duration) -> std::io::Result<UnixStream> {
    use std::os::linux::net::SocketAddrExt;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(socket_name(gid).as_bytes())?;
    let c = UnixStream::connect_addr(&addr)?;
    let wait = Some(wait.max(Duration::from_millis(1)));
    c.set_read_timeout(wait)?;
    c.set_write_timeout(wait)?;
    Ok(c)
}

/// Whether a connection may be served: only a process of this process's user or root may
/// reach the device (the abstract socket is open to every local user otherwise), and only
/// within the caps; a refusal is logged once per device.
fn admit(dev: &Device, conn: &UnixStream) -> bool {
    let (_, me) = crate::sys::uids();
    let why = match sockio::peer_cred(conn.as_raw_fd()).ok().map(|c| c.uid) {
        Some(uid) if uid == me || uid == 0 => {
            if dev.hello_pending.load(Ordering::Acquire) >= MAX_HELLO_PENDING {
                format!("{MAX_HELLO_PENDING} connections have not sent their Hello yet")
            } else if dev.conns.lock().unwrap().len() >= MAX_CONNS {
                format!("it serves {MAX_CONNS} connections already")
            } else {
                return true;
            }
        }
        Some(uid) if me == 0 => format!("its peer runs as uid {uid}, and only root may connect"),
        Some(uid) => format!("its peer runs as uid {uid}, and only uid {me} or root may connect"),
        None => "its peer's credentials are unknown".to_string(),
    };
    if !dev.refused_logged.swap(true, Ordering::AcqRel) {
        tracing::warn!("soft RDMA NIC: a connection was refused: {why} (logged once)");
    }
    false
}

/// The device's accept loop: one responder thread per connection (each ends with it).
pub(super) fn listen(dev: &Arc<Device>) {
    loop {
        let Ok((conn, _)) = dev.listener().accept() else {
            if dev.stopping.load(Ordering::Acquire) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        if dev.stopping.load(Ordering::Acquire) {
            return;
        }
        if dark(dev) {
            continue; // dropped unanswered: a NIC whose link is down
        }
        if !admit(dev, &conn) {
            continue;
        }
        dev.hello_pending.fetch_add(1, Ordering::AcqRel);
        let conn = Arc::new(conn);
        dev.conns.lock().unwrap().push(conn.clone());
        let d = dev.clone();
        let spawned = crate::place::spawn("hixl-softnic-r".into(), move || {
            serve(&d, &conn);
            io::shutdown(conn.as_raw_fd());
            d.conns.lock().unwrap().retain(|c| !Arc::ptr_eq(c, &conn));
        });
        if spawned.is_err() {
            dev.hello_pending.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!("soft NIC: cannot start a responder thread; a peer's connection is dropped");
        }
    }
}

/// Serves one connected peer QP until it closes, or until this side's QP stops answering.
fn serve(dev: &Arc<Device>, conn: &Arc<UnixStream>) {
    let fd = conn.as_raw_fd();
    let mut hb = [0u8; 32];
    // One deadline for the whole Hello: a peer that drips it cannot stretch the wait.
    let got = io::recv_exact_by(fd, &mut hb, std::time::Instant::now() + HELLO_WAIT);
    dev.hello_pending.fetch_sub(1, Ordering::AcqRel);
    if got.is_err() {
        return;
    }
    if fault::muted() {
        return fault::stay_silent(fd, DATA_WAIT);
    }
    let Some(hello) = Hello::decode(&hb) else { return };
    let Some(qp) = dev.qps.lock().unwrap().get(&hello.dst_qpn).cloned() else { return };
    // An unknown QP, a QP not connected to this peer or a wrong PSN gets no answer at all, as
    // on the wire: the requester retries until it gives up (RETRY_EXC_ERR).
    if !qp.accept(&hello, conn) {
        return;
    }
    loop {
        let _ = conn.set_read_timeout(None);
        let mut rb = [0u8; 32];
        if io::recv_exact(fd, &mut rb).is_err() {
            return;
        }
        if fault::muted() {
            // The request (and a WRITE's bytes) stays unread and unanswered.
            return fault::stay_silent(fd, DATA_WAIT);
        }
        let _ = conn.set_read_timeout(Some(DATA_WAIT));
        if let Some(d) = latency() {
            std::thread::sleep(d);
        }
        if !still_up(dev) {
            return;
        }
        let req = Request::decode(&rb);
        let Some((qp_access, rd_in)) = qp.responder_access() else { return };
        let (need, write) = match req.op {
            OP_WRITE => (access::REMOTE_WRITE, true),
            OP_READ => (access::REMOTE_READ, false),
            _ => return,
        };
        let refuse = |status: Status| {
            if write && sockio::discard(fd, req.len).is_err() {
                return;
            }
            let _ = sockio::send_all_bytes(fd, &[status as u8, 0, 0, 0, 0, 0, 0, 0]);
            qp.fail_as_responder();
        };
        // More READs at once than this QP answers (`max_dest_rd_atomic`): a NIC's responder has
        // no resources for it and NAKs it as an invalid request.
        if qp_access & need == 0 || (!write && req.depth > rd_in as u32) {
            if !write && req.depth > rd_in as u32 {
                tracing::debug!(
                    qpn = qp.qpn,
                    depth = req.depth,
                    max = rd_in,
                    "soft NIC: READ over max_dest_rd_atomic"
                );
            }
            refuse(Status::InvalidRequest);
            return;
        }
        if req.len == 0 {
            // A zero-length READ or WRITE carries no R_Key to check (IB spec; rdma_rxe alike):
            // it only proves the path. The backend's probe of a rail that was left out is one.
            if sockio::send_all_bytes(fd, &[0u8; 8]).is_err() {
                return;
            }
            continue;
        }
        let mr =
            dev.mr(req.rkey).filter(|m| m.pd == qp.pd && m.covers(req.addr, req.len) && m.access & need != 0);
        let Some(mr) = mr else {
            refuse(Status::AccessError);
            return;
        };
        let alive = mr.busy.read().unwrap();
        if !*alive {
            drop(alive);
            refuse(Status::AccessError);
            return;
        }
        let at = mr.host_of(req.addr);
        if !write && !io::is_mapped(at, req.len) {
            drop(alive);
            refuse(Status::OperationError);
            return;
        }
        let mut v = [iov(at, req.len)];
        if write {
            let mut got = 0;
            // SAFETY: the range lies inside a region registered on this device (checked just
            // above), which stays registered while `alive` is held (dereg_mr waits for it).
            let r = unsafe { io::recv_all_counted(fd, &mut v, &mut got) };
            drop(alive);
            match r {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::EFAULT) => {
                    // Registered memory that the process unmapped since.
                    if sockio::discard(fd, req.len - got).is_ok() {
                        let _ =
                            sockio::send_all_bytes(fd, &[Status::OperationError as u8, 0, 0, 0, 0, 0, 0, 0]);
                    }
                    qp.fail_as_responder();
                    return;
                }
                Err(_) => return,
            }
            if sockio::send_all_bytes(fd, &[0u8; 8]).is_err() {
                return;
            }
            fault::answered();
        } else {
            if sockio::send_all_bytes(fd, &[0u8; 8]).is_err() {
                return;
            }
            // SAFETY: as above: a checked range of a region held registered by `alive`.
            let r = unsafe { sockio::send_all(fd, &mut v) };
            drop(alive);
            if r.is_err() {
                return;
            }
            fault::answered();
        }
    }
}
