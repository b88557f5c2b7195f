//! Received notifications, bounded per connection and in total, by count and by bytes.
//!
//! Quotas are keyed by the stream a notification arrived on, never by the engine id a peer
//! claims: a peer cannot escape its quota by rotating ids, and cannot spend another peer's by
//! claiming that peer's id. Each one keeps the engine id its connection's handshake
//! established (`NotifyDesc::peer`): the application learns who sent it from the connection,
//! never from the notification's text.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::error::{Error, Result, Status};
use crate::queue::NotifyDesc;

/// The limits of a [`NotifyStore`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NotifyLimits {
    /// Pending notifications per connection (`hixl.max_notifies`).
    pub per_conn: usize,
    /// Pending bytes (name + message) per connection (`hixl.max_notify_bytes`).
    pub per_conn_bytes: usize,
    /// Pending notifications in all (`hixl.max_notifies_total`).
    pub total: usize,
    /// Pending bytes in all (`hixl.max_notify_bytes_total`).
    pub total_bytes: usize,
}

#[derive(Default)]
struct Pending {
    /// Each with the connection it arrived on (its quota is freed when it is collected).
    queue: VecDeque<(u64, NotifyDesc)>,
    /// (count, bytes) per connection.
    by_conn: HashMap<u64, (usize, usize)>,
    bytes: usize,
}

/// Notifications received and not yet collected by `get_notifies`.
pub struct NotifyStore {
    limits: NotifyLimits,
    inner: Mutex<Pending>,
    /// Rung on every arrival (`wait_take` sleeps on it).
    arrived: Condvar,
    /// An eventfd whose counter every arrival raises, made by the first [`NotifyStore::arrival_fd`].
    signal: OnceLock<OwnedFd>,
}

impl NotifyStore {
    /// An empty store with these limits.
    pub fn new(limits: NotifyLimits) -> Self {
        NotifyStore {
            limits,
            inner: Mutex::new(Pending::default()),
            arrived: Condvar::new(),
            signal: OnceLock::new(),
        }
    }

    /// Adds one that arrived on connection `conn`, whose peer is the engine `peer`;
    /// `RESOURCE_EXHAUSTED` (naming the limit) when it would exceed that connection's quota or
    /// the total.
    pub fn push(&self, conn: u64, peer: &str, name: String, msg: String) -> Result<()> {
        let size = name.len() + msg.len();
        let l = self.limits;
        let mut g = self.inner.lock().unwrap();
        let (n, bytes) = g.by_conn.get(&conn).copied().unwrap_or_default();
        let full = if n >= l.per_conn {
            Some(format!(
                "{n} notifications from this connection are pending (hixl.max_notifies={})",
                l.per_conn
            ))
        } else if bytes + size > l.per_conn_bytes {
            Some(format!(
                "{bytes} + {size} bytes of notifications from this connection would exceed \
                 hixl.max_notify_bytes={}",
                l.per_conn_bytes
            ))
        } else if g.queue.len() >= l.total {
            Some(format!("{} notifications are pending (hixl.max_notifies_total={})", g.queue.len(), l.total))
        } else if g.bytes + size > l.total_bytes {
            Some(format!(
                "{} + {size} bytes of notifications would exceed hixl.max_notify_bytes_total={}",
                g.bytes, l.total_bytes
            ))
        } else {
            None
        };
        if let Some(why) = full {
            return Err(Error::new(
                Status::ResourceExhausted,
                format!("{why} at the target; the target must call get_notifies"),
            ));
        }
        g.by_conn.insert(conn, (n + 1, bytes + size));
        g.bytes += size;
        g.queue.push_back((conn, NotifyDesc { name, msg, peer: peer.to_string() }));
        self.arrived.notify_all();
        if let Some(fd) = self.signal.get() {
            crate::sys::eventfd::add(fd, 1);
        }
        Ok(())
    }

    /// A descriptor of its own (the caller closes it) that becomes readable after each arrival
    /// from now on: an eventfd, which reading 8 bytes resets. Arrivals before the first call
    /// do not make it readable, so a waiter asks for it first and then looks at what is
    /// pending. Every descriptor it returns shares one counter: one reader resets it for all.
    pub fn arrival_fd(&self) -> Result<OwnedFd> {
        let io = |e: std::io::Error| Error::new(Status::Failed, format!("notification descriptor: {e}"));
        let fd = match self.signal.get() {
            Some(fd) => fd,
            None => {
                let made = crate::sys::eventfd::create().map_err(io)?;
                self.signal.get_or_init(|| made)
            }
        };
        fd.try_clone().map_err(io)
    }

    /// Returns and clears everything pending, in arrival order.
    pub fn take(&self) -> Vec<NotifyDesc> {
        let mut g = self.inner.lock().unwrap();
        g.by_conn.clear();
        g.bytes = 0;
        g.queue.drain(..).map(|(_, n)| n).collect()
    }

    /// Waits up to `timeout` until a notification named one of `names` (any, when empty) is
    /// pending, then returns and removes every pending one that matches, in arrival order (the
    /// others stay). `TIMEOUT` naming what it waited for when none came.
    pub fn wait_take(&self, names: &[&str], timeout: Duration) -> Result<Vec<NotifyDesc>> {
        let deadline = Instant::now() + timeout;
        let matches = |n: &NotifyDesc| names.is_empty() || names.contains(&n.name.as_str());
        let mut g = self.inner.lock().unwrap();
        loop {
            if g.queue.iter().any(|(_, n)| matches(n)) {
                let mut out = Vec::new();
                let mut kept = VecDeque::with_capacity(g.queue.len());
                for (conn, n) in std::mem::take(&mut g.queue) {
                    if !matches(&n) {
                        kept.push_back((conn, n));
                        continue;
                    }
                    let size = n.name.len() + n.msg.len();
                    g.bytes -= size;
                    if let Some(c) = g.by_conn.get_mut(&conn) {
                        c.0 -= 1;
                        c.1 -= size;
                    }
                    out.push(n);
                }
                g.queue = kept;
                g.by_conn.retain(|_, c| c.0 > 0);
                return Ok(out);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::timeout(format!("no {} arrived within {timeout:?}", waited_for(names))));
            }
            g = self.arrived.wait_timeout(g, left).unwrap().0;
        }
    }
}

/// What a wait for `names` waited for, for its `TIMEOUT`: "notification", "notification named
/// \"a\"" or "notification named one of [\"a\", \"b\"]".
pub fn waited_for(names: &[&str]) -> String {
    match names {
        [] => "notification".to_string(),
        [one] => format!("notification named {one:?}"),
        many => format!("notification named one of {many:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_arrival_descriptor_wakes_after_each_arrival_and_resets_when_read() {
        use std::os::fd::AsRawFd;
        let s =
            NotifyStore::new(NotifyLimits { per_conn: 8, per_conn_bytes: 1024, total: 8, total_bytes: 1024 });
        s.push(1, "p", "early".into(), String::new()).unwrap();
        let (a, b) = (s.arrival_fd().unwrap(), s.arrival_fd().unwrap());
        let readable = |fd: &OwnedFd| crate::sys::poll_one(fd.as_raw_fd(), libc::POLLIN, 0).unwrap() == 1;
        assert!(!readable(&a), "an arrival before the first call does not count");
        s.push(1, "p", "n".into(), "m".into()).unwrap();
        assert!(readable(&a) && readable(&b), "every descriptor shares the one counter");
        assert_eq!(crate::sys::eventfd::take(&a), 1);
        assert!(!readable(&b), "reading one resets it for all");
        assert_eq!(s.take().len(), 2);
    }

    #[test]
    fn quotas_are_per_connection_and_total_by_count_and_bytes() {
        let s =
            NotifyStore::new(NotifyLimits { per_conn: 2, per_conn_bytes: 10, total: 3, total_bytes: 100 });
        let push = |c, m: &str| s.push(c, "p", "n".into(), m.into());
        assert!(push(1, "a").is_ok() && push(1, "b").is_ok());
        assert!(push(1, "c").unwrap_err().message.contains("hixl.max_notifies=2"));
        assert!(push(2, "0123456789").unwrap_err().message.contains("hixl.max_notify_bytes=10"));
        assert!(push(2, "x").is_ok(), "another connection keeps its own quota");
        assert!(push(3, "y").unwrap_err().message.contains("hixl.max_notifies_total=3"));
        assert_eq!(s.take().len(), 3);
        assert!(push(1, "again").is_ok(), "collecting frees the quota");
    }

    #[test]
    fn wait_take_takes_the_named_ones_and_frees_their_quota() {
        let s = std::sync::Arc::new(NotifyStore::new(NotifyLimits {
            per_conn: 2,
            per_conn_bytes: 100,
            total: 10,
            total_bytes: 100,
        }));
        s.push(1, "10.0.0.1:5000", "layer".into(), "0".into()).unwrap();
        s.push(1, "10.0.0.1:5000", "done".into(), "".into()).unwrap();
        let e = s.wait_take(&["other"], Duration::from_millis(20)).unwrap_err();
        assert_eq!(e.status, Status::Timeout);
        assert!(e.message.contains("\"other\""), "{e}");
        let got = s.wait_take(&["done"], Duration::ZERO).unwrap();
        assert_eq!(got, vec![NotifyDesc::new("done", "")]);
        assert_eq!(got[0].peer, "10.0.0.1:5000", "each keeps the engine it came from");
        assert!(
            s.push(1, "10.0.0.1:5000", "x".into(), "".into()).is_ok(),
            "the taken one's quota is free again"
        );
        // One that arrives while waiting wakes the waiter.
        let s2 = s.clone();
        let t = std::thread::spawn(move || s2.wait_take(&["late"], Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        s.push(2, "10.0.0.2#7", "late".into(), "hi".into()).unwrap();
        let late = t.join().unwrap().unwrap();
        assert_eq!((late.len(), late[0].peer.as_str()), (1, "10.0.0.2#7"));
        assert_eq!(s.take().len(), 2, "the others stayed: layer and x");
    }

    #[test]
    fn wait_take_of_several_names_keeps_their_arrival_order_and_leaves_the_rest() {
        let s =
            NotifyStore::new(NotifyLimits { per_conn: 9, per_conn_bytes: 100, total: 9, total_bytes: 100 });
        for (name, msg) in [("hello", "1"), ("app", "a"), ("bye", "2"), ("hello", "3"), ("app", "b")] {
            s.push(1, "p", name.into(), msg.into()).unwrap();
        }
        let got = s.wait_take(&["bye", "hello"], Duration::ZERO).unwrap();
        let msgs: Vec<&str> = got.iter().map(|n| n.msg.as_str()).collect();
        assert_eq!(msgs, ["1", "2", "3"], "in arrival order, whichever name");
        let e = s.wait_take(&["bye", "hello"], Duration::ZERO).unwrap_err();
        assert!(e.message.contains("one of [\"bye\", \"hello\"]"), "{e}");
        let rest: Vec<String> = s.take().into_iter().map(|n| n.name + &n.msg).collect();
        assert_eq!(rest, ["appa", "appb"], "the other names stayed");
    }
}
