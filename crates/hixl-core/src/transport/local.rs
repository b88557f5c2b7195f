//! The same-host proof: before an initiator copies into a peer's memory directly, the peer
//! proves over an abstract Unix socket that it is the very process that accepted the
//! initiator's TCP stream (docs/PROTOCOL.md, "Same-host proof").
//!
//! The kernel names the process behind the Unix socket (SO_PEERCRED), and only that process
//! can confirm the stream's four-tuple, which is unique on one kernel. Nothing a peer claims
//! (host name, pid, addresses in Welcome) is trusted on its own.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::transport::io::iov;

/// The first word of a request line (with the protocol version).
const REQUEST: &str = "HIXL-LOCAL 3";
/// Longest request or answer line.
const MAX_LINE: u64 = 512;
/// How long the listener waits for one client's request (clients are served one at a time).
const CLIENT_TIMEOUT: Duration = Duration::from_secs(1);

/// An 8-byte token at a stable address: a proven peer reads it by cross-memory attach, which
/// checks that this process may access the peer's memory at all.
pub struct Probe {
    cell: Box<u64>,
}

impl Probe {
    /// A probe holding a fresh random token.
    pub fn new() -> Result<Probe> {
        let mut token = [0u8; 8];
        crate::auth::random_bytes(&mut token)?;
        Ok(Probe { cell: Box::new(u64::from_le_bytes(token) | 1) })
    }
    /// Where the token lives.
    pub fn addr(&self) -> u64 {
        &*self.cell as *const u64 as u64
    }
    /// The token.
    pub fn token(&self) -> u64 {
        *self.cell
    }
}

/// Answers one proof request: `Some(table_version)` when a served stream has exactly these two
/// ends (and it now waits for that stream's region-table confirmations), else None.
pub type Confirm = dyn Fn(&str, &str) -> Option<u64> + Send + Sync;

/// The target's side: an abstract Unix socket with a random name, served by one thread.
pub struct LocalListener {
    name: String,
    listener: UnixListener,
    stopping: AtomicBool,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl LocalListener {
    /// Binds a fresh abstract socket and starts answering with `confirm`.
    pub fn start(confirm: Box<Confirm>) -> Result<Arc<LocalListener>> {
        let mut rnd = [0u8; 12];
        crate::auth::random_bytes(&mut rnd)?;
        let name = format!("hixl-{}", rnd.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let addr = UnixAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::failed(format!("abstract socket name {name}: {e}")))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::failed(format!("cannot listen on the same-host socket {name}: {e}")))?;
        let probe = Probe::new()?;
        let me = Arc::new(LocalListener {
            name,
            listener,
            stopping: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let l = me.clone();
        let h = std::thread::Builder::new()
            .name("hixl-local".into())
            .spawn(move || l.serve(&*confirm, &probe))
            .map_err(|e| Error::failed(format!("cannot start the same-host proof thread: {e}")))?;
        *me.thread.lock().unwrap() = Some(h);
        Ok(me)
    }

    /// The socket's name (without the leading NUL), sent in Welcome.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn serve(&self, confirm: &Confirm, probe: &Probe) {
        loop {
            let conn = self.listener.accept();
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let Ok((conn, _)) = conn else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            if let Err(e) = answer(conn, confirm, probe) {
                tracing::debug!(error = %e, "same-host proof request failed");
            }
        }
    }

    /// Stops answering and joins the thread.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        crate::transport::io::shutdown(self.listener.as_raw_fd());
        if let Some(h) = self.thread.lock().unwrap().take() {
            let _ = h.join();
        }
    }
}

fn answer(conn: UnixStream, confirm: &Confirm, probe: &Probe) -> std::io::Result<()> {
    conn.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    conn.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let mut line = String::new();
    BufReader::new((&conn).take_max(MAX_LINE)).read_line(&mut line)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let reply = match words.as_slice() {
        ["HIXL-LOCAL", "3", initiator, target] => match confirm(initiator, target) {
            Some(v) => format!("OK {v} {} {}\n", probe.addr(), probe.token()),
            None => "NO no stream of this process has those ends\n".to_string(),
        },
        _ => "NO malformed request\n".to_string(),
    };
    (&conn).write_all(reply.as_bytes())
}

/// `Read::take` on a reference, named so that the call site reads clearly.
trait TakeMax: std::io::Read + Sized {
    fn take_max(self, n: u64) -> std::io::Take<Self> {
        self.take(n)
    }
}
impl<R: std::io::Read> TakeMax for R {}

/// A peer proven to be the process behind a stream.
pub struct Proven {
    /// Its pid, as the kernel gave it (in this process's pid namespace).
    pub pid: i32,
    /// A descriptor of that very process: tells when it exits, and takes its memfds.
    pub pidfd: OwnedFd,
    /// The peer's region-table version when it started waiting for our confirmations: direct
    /// copies may start once we hold at least this version.
    pub table_version: u64,
}

/// Asks the process behind the abstract socket `name` to confirm that it accepted the stream
/// whose ends are `initiator` (ours) and `target`, then checks cross-memory-attach permission.
/// Err says why the same-host path cannot be used.
pub fn prove(name: &str, initiator: &str, target: &str) -> std::result::Result<Proven, String> {
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| format!("bad socket name: {e}"))?;
    let conn = UnixStream::connect_addr(&addr)
        .map_err(|e| format!("no same-host proof socket {name:?} here ({e}): another host or namespace"))?;
    conn.set_read_timeout(Some(CLIENT_TIMEOUT * 2)).map_err(|e| e.to_string())?;
    conn.set_write_timeout(Some(CLIENT_TIMEOUT * 2)).map_err(|e| e.to_string())?;
    let pid = peer_pid(conn.as_raw_fd()).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as RawFd;
    if fd < 0 {
        return Err(format!("pidfd_open({pid}): {}", std::io::Error::last_os_error()));
    }
    // SAFETY: a non-negative return is a fresh descriptor that we now own.
    let pidfd = unsafe { OwnedFd::from_raw_fd(fd) };
    (&conn)
        .write_all(format!("{REQUEST} {initiator} {target}\n").as_bytes())
        .map_err(|e| format!("same-host proof request: {e}"))?;
    let mut line = String::new();
    BufReader::new((&conn).take_max(MAX_LINE))
        .read_line(&mut line)
        .map_err(|e| format!("same-host proof answer: {e}"))?;
    let words: Vec<&str> = line.split_whitespace().collect();
    let (version, probe_addr, token) = match words.as_slice() {
        ["OK", v, a, t] => match (v.parse::<u64>(), a.parse::<u64>(), t.parse::<u64>()) {
            (Ok(v), Ok(a), Ok(t)) => (v, a, t),
            _ => return Err(format!("malformed same-host proof answer {line:?}")),
        },
        ["NO", ..] => return Err(format!("pid {pid} did not accept this stream: {}", line.trim())),
        _ => return Err(format!("malformed same-host proof answer {line:?}")),
    };
    // The process answered while we held its pidfd: if it is still alive, `pid` is still it.
    if exited(&pidfd) {
        return Err(format!("pid {pid} exited during the same-host proof"));
    }
    read_probe(pid, probe_addr, token)?;
    Ok(Proven { pid, pidfd, table_version: version })
}

/// Whether the process behind `pidfd` has exited.
pub fn exited(pidfd: &OwnedFd) -> bool {
    let mut p = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd and a zero timeout.
    unsafe { libc::poll(&mut p, 1, 0) > 0 }
}

fn peer_pid(fd: RawFd) -> std::io::Result<i32> {
    // SAFETY: ucred is plain data; all-zero is valid.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: SO_PEERCRED writes one ucred into the live `cred`, `len` holds its size.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if cred.pid <= 0 {
        return Err(std::io::Error::other("the peer's pid is not visible from this pid namespace"));
    }
    Ok(cred.pid)
}

/// Reads the proven peer's probe token directly: Ok when cross-memory attach to it works.
fn read_probe(pid: i32, addr: u64, token: u64) -> std::result::Result<(), String> {
    let mut got = 0u64;
    let local = iov(&mut got as *mut u64 as u64, 8);
    let remote = iov(addr, 8);
    // SAFETY: `local` covers the 8 bytes of `got`; the remote side is checked by the kernel.
    let r = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    if r < 0 {
        return Err(format!("cross-memory attach to pid {pid} failed: {}", std::io::Error::last_os_error()));
    }
    if r != 8 || got != token {
        return Err(format!("pid {pid} does not hold the token it announced"));
    }
    Ok(())
}
