//! The same-host proof: before either side treats a peer as a process of this host, each proves
//! to the other, over an abstract Unix socket, that it holds its end of this very TCP stream
//! (docs/PROTOCOL.md, "Same-host proof").
//!
//! - The initiator sends the request with its stream-0 socket attached (SCM_RIGHTS); the target
//!   checks that this descriptor's two ends are its served stream's, reversed. Only then does it
//!   wait for that stream's region-table confirmations.
//! - The target answers with the number of its accepted socket; the initiator takes that
//!   descriptor from the process the kernel names behind the Unix socket (`pidfd_getfd`, which
//!   needs the same permission as cross-memory attach) and checks its ends against its own.
//!   The process is named by a pidfd from the kernel (SO_PEERPIDFD, or SO_PEERCRED's pid),
//!   checked to be alive, to run as the user that created the socket, and to hold the stream.
//! - Before sending the request, the initiator asks `exec_rule` whether the direct path may be
//!   used with that process at all (a process that may override ptrace checks: only with root).
//!
//! Nothing a peer claims (host name, addresses, pids) is trusted on its own.

use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr as UnixAddr, UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::sys::{self, pidfd, sockio};
use crate::transport::same_host::exec_rule::{self, uids_of};

/// The first words of a request line (with the protocol version).
const REQUEST: &str = "HIXL-LOCAL 3";
/// Longest request or answer line.
const MAX_LINE: usize = 512;
/// How long the listener gives one client (clients are served one at a time).
const CLIENT_BUDGET: Duration = Duration::from_millis(200);
/// `SO_PEERPIDFD` (Linux 6.5): a pidfd of the peer socket's creator.
const SO_PEERPIDFD: libc::c_int = 77;

/// Answers one proof request whose descriptor checked out: `Some((table_version, fd))` when a
/// served link head has exactly these ends (the target then waits for its region-table
/// confirmations), with the number of this process's descriptor of that stream; else None.
pub type Confirm = dyn Fn(&str, &str) -> Option<(u64, RawFd)> + Send + Sync;

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
        let mut rnd = [0u8; 16];
        crate::auth::random_bytes(&mut rnd)?;
        let name = format!("hixl-{}", rnd.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let addr = UnixAddr::from_abstract_name(name.as_bytes())
            .map_err(|e| Error::failed(format!("abstract socket name {name}: {e}")))?;
        let listener = UnixListener::bind_addr(&addr)
            .map_err(|e| Error::failed(format!("cannot listen on the same-host socket {name}: {e}")))?;
        let me = Arc::new(LocalListener {
            name,
            listener,
            stopping: AtomicBool::new(false),
            thread: Mutex::new(None),
        });
        let l = me.clone();
        let h = crate::place::spawn("hixl-local".into(), move || l.serve(&*confirm))
            .map_err(|e| Error::failed(format!("cannot start the same-host proof thread: {e}")))?;
        *me.thread.lock().unwrap() = Some(h);
        Ok(me)
    }

    /// The socket's name (without the leading NUL), sent in Welcome.
    pub fn name(&self) -> &str {
        &self.name
    }

    fn serve(&self, confirm: &Confirm) {
        loop {
            let conn = self.listener.accept();
            if self.stopping.load(Ordering::Acquire) {
                return;
            }
            let Ok((conn, _)) = conn else {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            };
            if let Err(e) = answer(conn, confirm) {
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

fn answer(conn: UnixStream, confirm: &Confirm) -> std::io::Result<()> {
    conn.set_read_timeout(Some(CLIENT_BUDGET))?;
    conn.set_write_timeout(Some(CLIENT_BUDGET))?;
    let (line, fd) = recv_with_fd(&conn)?;
    let words: Vec<&str> = line.split_whitespace().collect();
    // Only a process that may access our memory directly needs (or gets) the same-host path:
    // one of our user, or root. Any other local user stays a TCP peer and cannot make us wait
    // for its confirmations.
    let uid = peer_cred(conn.as_raw_fd()).map(|c| c.uid).unwrap_or(u32::MAX);
    let may_access = uid == 0 || uid == sys::uids().1;
    let reply = match (words.as_slice(), fd) {
        _ if !may_access => format!("NO uid {uid} may not access this process's memory\n"),
        (["HIXL-LOCAL", "3", initiator, target], Some(fd)) => {
            // The requester must hold the initiator's end of the stream it names.
            if socket_ends(fd.as_fd()).is_some_and(|(l, p)| l == *initiator && p == *target) {
                drop(fd);
                match confirm(initiator, target) {
                    Some((v, fd)) => format!("OK {v} {fd}\n"),
                    None => "NO no stream of this process has those ends\n".to_string(),
                }
            } else {
                "NO the attached descriptor is not that stream\n".to_string()
            }
        }
        (["HIXL-LOCAL", "3", ..], None) => "NO the request carries no descriptor\n".to_string(),
        _ => "NO malformed request\n".to_string(),
    };
    (&conn).write_all(reply.as_bytes())
}

/// The two ends (local, peer) of a TCP socket, as `addr_text`, or None.
fn socket_ends(fd: BorrowedFd<'_>) -> Option<(String, String)> {
    let (l, p) = sockio::with_tcp_stream(fd, |s| Some((s.local_addr().ok()?, s.peer_addr().ok()?)))?;
    Some((crate::transport::io::addr_text(l), crate::transport::io::addr_text(p)))
}

/// Receives one request line (up to MAX_LINE bytes) and at most one attached descriptor.
fn recv_with_fd(conn: &UnixStream) -> std::io::Result<(String, Option<OwnedFd>)> {
    let mut buf = [0u8; MAX_LINE];
    let (n, fd) = sockio::recv_with_fd(conn.as_raw_fd(), &mut buf)?;
    let line = String::from_utf8_lossy(&buf[..n]).into_owned();
    Ok((line, fd))
}

/// Sends `line` with `fd` attached.
fn send_with_fd(conn: &UnixStream, line: &str, fd: RawFd) -> std::io::Result<()> {
    let n = sockio::send_with_fd(conn.as_raw_fd(), line.as_bytes(), fd)?;
    if n != line.len() {
        return Err(std::io::Error::other("short send of the proof request"));
    }
    Ok(())
}

/// A peer proven to be the process that holds the other end of a stream.
pub struct Proven {
    /// Its pid (in this process's pid namespace).
    pub pid: i32,
    /// A descriptor of that very process: tells when it exits, and takes its memfds.
    pub pidfd: OwnedFd,
    /// The peer's region-table version when it started waiting for our confirmations: direct
    /// copies may start once we hold at least this version.
    pub table_version: u64,
}

/// Proves the process behind the abstract socket `name` holds the other end of `stream` (our
/// stream 0, whose ends are `initiator` and `target`), and makes it wait for our confirmations.
/// Err says why the same-host path cannot be used.
pub fn prove(
    name: &str,
    stream: RawFd,
    initiator: &str,
    target: &str,
    deadline: Instant,
) -> std::result::Result<Proven, String> {
    let conn = connect_by(name, deadline)?;
    let left = deadline.saturating_duration_since(Instant::now()).max(Duration::from_millis(50));
    conn.set_read_timeout(Some(left)).map_err(|e| e.to_string())?;
    conn.set_write_timeout(Some(left)).map_err(|e| e.to_string())?;
    let (pidfd, uid) = peer_process(conn.as_raw_fd())?;
    let pid = pid_of(&pidfd)?;
    let uids = uids_of(pid)?;
    // Exec after proof: a process that may override ptrace checks copies directly only to root
    // (see `exec_rule`). Asked before the request, so that a refused peer never waits for us.
    if let Some(why) = exec_rule::refusal(exec_rule::ptrace_override(), pid, uid, uids) {
        return Err(why);
    }
    send_with_fd(&conn, &format!("{REQUEST} {initiator} {target}\n"), stream)
        .map_err(|e| format!("same-host proof request: {e}"))?;
    let mut buf = Vec::new();
    (&conn)
        .take(MAX_LINE as u64)
        .read_to_end(&mut buf)
        .map_err(|e| format!("same-host proof answer: {e}"))?;
    let line = String::from_utf8_lossy(&buf);
    let words: Vec<&str> = line.split_whitespace().collect();
    let (version, fd) = match words.as_slice() {
        ["OK", v, fd] => match (v.parse::<u64>(), fd.parse::<RawFd>()) {
            (Ok(v), Ok(fd)) => (v, fd),
            _ => return Err(format!("malformed same-host proof answer {line:?}")),
        },
        ["NO", ..] => return Err(format!("the same-host proof was refused: {}", line.trim())),
        _ => return Err(format!("malformed same-host proof answer {line:?}")),
    };
    if uids[1] != uid {
        return Err(format!("pid {pid} no longer runs as the user who created its socket"));
    }
    // Take the process's own descriptor of the stream: this needs ptrace permission over it
    // (the same as cross-memory attach), and shows that it, not a bystander, holds the stream.
    match get_fd(&pidfd, fd) {
        Ok(held) => {
            let ends = socket_ends(held.as_fd());
            drop(held);
            if ends.as_ref().is_none_or(|(l, p)| l != target || p != initiator) {
                return Err(format!(
                    "pid {pid} does not hold this stream (its descriptor {fd} has ends {ends:?})"
                ));
            }
        }
        // Kernels before 5.6 (and valgrind) lack pidfd_getfd: compare socket inodes instead.
        Err(e) if e.raw_os_error() == Some(libc::ENOSYS) => {
            holds_stream_by_inode(pid, fd, target, initiator)?
        }
        Err(e) => return Err(format!("pidfd_getfd({pid}, {fd}): {e}")),
    }
    // Checked last: if it is still alive, `pid` still names the process we checked.
    if exited(&pidfd) {
        return Err(format!("pid {pid} exited during the same-host proof"));
    }
    Ok(Proven { pid, pidfd, table_version: version })
}

/// Connects to an abstract socket without blocking past `deadline` (a full backlog is retried).
fn connect_by(name: &str, deadline: Instant) -> std::result::Result<UnixStream, String> {
    let addr = UnixAddr::from_abstract_name(name.as_bytes()).map_err(|e| format!("bad socket name: {e}"))?;
    loop {
        let s = UnixStream::from(sockio::unix_stream_socket().map_err(|e| format!("socket: {e}"))?);
        let bytes = addr.as_abstract_name().unwrap_or_default();
        let Err(e) = sockio::connect_abstract(s.as_raw_fd(), bytes) else {
            s.set_nonblocking(false).map_err(|e| e.to_string())?;
            return Ok(s);
        };
        if e.raw_os_error() != Some(libc::EAGAIN) || Instant::now() >= deadline {
            return Err(format!("no same-host proof socket {name:?} here ({e}): another host or namespace"));
        }
        std::thread::sleep(Duration::from_millis(5)); // backlog full: try again
    }
}

/// A pidfd for the process behind a connected Unix socket, and the uid it had when it created
/// the socket. SO_PEERPIDFD names that very process (never a reused pid); older kernels fall
/// back to SO_PEERCRED's pid.
/// The credentials the kernel recorded for the other end of a Unix socket.
fn peer_cred(fd: RawFd) -> std::io::Result<libc::ucred> {
    sockio::peer_cred(fd)
}

fn peer_process(fd: RawFd) -> std::result::Result<(OwnedFd, u32), String> {
    let cred = peer_cred(fd).map_err(|e| format!("SO_PEERCRED: {e}"))?;
    if let Ok(pidfd) = sockio::peer_pidfd(fd, SO_PEERPIDFD) {
        return Ok((pidfd, cred.uid));
    }
    if cred.pid <= 0 {
        return Err("the peer's pid is not visible from this pid namespace".into());
    }
    let fd = pidfd::open(cred.pid).map_err(|e| format!("pidfd_open({}): {e}", cred.pid))?;
    Ok((fd, cred.uid))
}

/// The pid a pidfd names (from /proc/self/fdinfo), or why not (it exited).
fn pid_of(pidfd: &OwnedFd) -> std::result::Result<i32, String> {
    let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{}", pidfd.as_raw_fd()))
        .map_err(|e| format!("reading the pidfd's fdinfo: {e}"))?;
    let pid = info
        .lines()
        .find_map(|l| l.strip_prefix("Pid:"))
        .and_then(|v| v.trim().parse::<i32>().ok())
        .ok_or("the pidfd names no pid")?;
    if pid <= 0 {
        return Err("the peer process exited or lives in another pid namespace".into());
    }
    Ok(pid)
}

/// Without pidfd_getfd: whether descriptor `fd` of process `pid` is the TCP socket whose local
/// end is `local` and remote end `remote`, by its inode (`/proc/PID/fd/N` names it, and the
/// kernel's socket table `/proc/net/tcp{,6}` gives the inode of that four-tuple). Reading the
/// link needs ptrace permission over the process, like cross-memory attach.
fn holds_stream_by_inode(pid: i32, fd: RawFd, local: &str, remote: &str) -> std::result::Result<(), String> {
    let link =
        std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).map_err(|e| format!("pid {pid} fd {fd}: {e}"))?;
    let held: u64 = link
        .to_string_lossy()
        .strip_prefix("socket:[")
        .and_then(|r| r.strip_suffix(']'))
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| format!("pid {pid} fd {fd} is {link:?}, not a socket"))?;
    let (local, remote): (std::net::SocketAddr, std::net::SocketAddr) = match (local.parse(), remote.parse())
    {
        (Ok(l), Ok(r)) => (l, r),
        _ => return Err(format!("cannot parse the stream's ends {local} / {remote}")),
    };
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else { continue };
        for line in text.lines().skip(1) {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 9 && proc_addr(f[1]) == Some(local) && proc_addr(f[2]) == Some(remote) {
                return if f[9].parse::<u64>().ok() == Some(held) {
                    Ok(())
                } else {
                    Err(format!("pid {pid} does not hold this stream (its fd {fd} is another socket)"))
                };
            }
        }
    }
    Err(format!("the stream {local} <- {remote} is not in this namespace's socket table"))
}

/// An address of `/proc/net/tcp{,6}`: hex IP (in 32-bit host-order words) and hex port;
/// an IPv4-mapped IPv6 address comes back as IPv4, as `addr_text` writes it.
fn proc_addr(field: &str) -> Option<std::net::SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..ip.len() / 8)
        .map(|i| u32::from_str_radix(&ip[i * 8..i * 8 + 8], 16))
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_ne_bytes()).collect();
    let ip = match bytes.len() {
        4 => std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?),
        16 => {
            let v6 = std::net::Ipv6Addr::from(<[u8; 16]>::try_from(bytes).ok()?);
            v6.to_ipv4_mapped().map_or(std::net::IpAddr::V6(v6), std::net::IpAddr::V4)
        }
        _ => return None,
    };
    Some(std::net::SocketAddr::new(ip, port))
}

/// Takes descriptor `fd` of the process behind `pidfd`.
pub fn get_fd(pidfd: &OwnedFd, fd: RawFd) -> std::io::Result<OwnedFd> {
    pidfd::get_fd(pidfd, fd)
}

/// Whether the process behind `pidfd` has exited.
pub fn exited(pidfd: &OwnedFd) -> bool {
    pidfd::exited(pidfd)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kernel_socket_table_names_a_connected_stream_by_inode() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (a, _) = l.accept().unwrap();
        let (local, remote) = socket_ends(a.as_fd()).unwrap();
        let me = std::process::id() as i32;
        assert_eq!(holds_stream_by_inode(me, a.as_raw_fd(), &local, &remote), Ok(()));
        let e = holds_stream_by_inode(me, c.as_raw_fd(), &local, &remote).unwrap_err();
        assert!(e.contains("another socket"), "{e}");
        assert_eq!(proc_addr("0100007F:1F90"), Some("127.0.0.1:8080".parse().unwrap()));
    }
}
