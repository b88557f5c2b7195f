//! How much pinned staging memory a target lends at once: per engine and per peer (source
//! address). Every staged frame takes a [`Ticket`] for its buffer before the buffer is taken;
//! a frame over either cap is refused with RESOURCE_EXHAUSTED (the stream goes on), and the
//! ticket gives its bytes back when the frame's buffer is returned. Pure bookkeeping, no I/O.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result, Status};

/// Most pinned staging bytes one engine lends at once, over all its streams.
pub(crate) const ENGINE_CAP: u64 = 1 << 30;
/// Most pinned staging bytes one peer (source address) holds at once, over all its streams.
pub(crate) const PEER_CAP: u64 = 256 << 20;

/// The staging bytes lent now, in all and per peer.
pub(crate) struct StageBudget {
    engine_cap: u64,
    peer_cap: u64,
    lent: Mutex<(u64, HashMap<String, u64>)>,
}

impl Default for StageBudget {
    fn default() -> StageBudget {
        StageBudget::new(ENGINE_CAP, PEER_CAP)
    }
}

/// Bytes lent to one peer; given back on drop.
pub(crate) struct Ticket {
    budget: Arc<StageBudget>,
    peer: String,
    bytes: u64,
}

impl StageBudget {
    /// A budget with these caps.
    pub(crate) fn new(engine_cap: u64, peer_cap: u64) -> StageBudget {
        StageBudget { engine_cap, peer_cap, lent: Mutex::new((0, HashMap::new())) }
    }

    /// Lends `bytes` to `peer`, or says which cap it would pass.
    pub(crate) fn take(self: &Arc<Self>, peer: &str, bytes: u64) -> Result<Ticket> {
        let mut g = self.lent.lock().unwrap();
        let (total, per) = &mut *g;
        let mine = per.get(peer).copied().unwrap_or(0);
        let refuse = |what: &str, lent: u64, cap: u64| {
            Error::new(
                Status::ResourceExhausted,
                format!(
                    "the target's pinned staging buffers are lent out: {lent} bytes {what}, a frame needs \
                     {bytes} more, the cap is {cap}; retry when earlier transfers ended"
                ),
            )
        };
        if mine.saturating_add(bytes) > self.peer_cap {
            return Err(refuse(&format!("to {peer}"), mine, self.peer_cap));
        }
        if total.saturating_add(bytes) > self.engine_cap {
            return Err(refuse("by this engine", *total, self.engine_cap));
        }
        *total += bytes;
        *per.entry(peer.to_string()).or_insert(0) += bytes;
        Ok(Ticket { budget: self.clone(), peer: peer.to_string(), bytes })
    }

    /// Bytes lent now: in all, and to `peer`.
    #[cfg(test)]
    fn lent(&self, peer: &str) -> (u64, u64) {
        let g = self.lent.lock().unwrap();
        (g.0, g.1.get(peer).copied().unwrap_or(0))
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut g = self.budget.lent.lock().unwrap();
        let (total, per) = &mut *g;
        *total -= self.bytes;
        if let Some(n) = per.get_mut(&self.peer) {
            *n -= self.bytes;
            if *n == 0 {
                per.remove(&self.peer);
            }
        }
    }
}

/// The peer a served stream's frames are counted against: its source address without the port
/// (one peer opening more streams gets no more).
pub(crate) fn peer_key(peer_addr: &str) -> &str {
    match peer_addr.rsplit_once(':') {
        Some((host, port)) if port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => peer_addr,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_capped_per_peer_and_per_engine_and_given_back() {
        let b = Arc::new(StageBudget::new(100, 60));
        let t1 = b.take("10.0.0.1", 40).unwrap();
        let e = b.take("10.0.0.1", 30).err().expect("over the peer cap");
        assert_eq!(e.status, Status::ResourceExhausted);
        assert!(e.message.contains("40 bytes to 10.0.0.1") && e.message.contains("60"), "{}", e.message);
        let t2 = b.take("10.0.0.2", 60).unwrap();
        let e = b.take("10.0.0.3", 1).err().expect("over the engine cap");
        assert!(e.message.contains("100 bytes by this engine"), "{}", e.message);
        drop(t1);
        assert_eq!(b.lent("10.0.0.1"), (60, 0));
        let _t3 = b.take("10.0.0.1", 40).unwrap();
        drop(t2);
        assert_eq!(b.lent("10.0.0.2"), (40, 0));
        assert!(b.take("x", u64::MAX).is_err(), "no overflow");
    }

    #[test]
    fn a_peer_is_its_address_without_the_port() {
        assert_eq!(peer_key("127.0.0.1:5000"), "127.0.0.1");
        assert_eq!(peer_key("[::1]:5000"), "[::1]");
        assert_eq!(peer_key("unix"), "unix");
    }
}
