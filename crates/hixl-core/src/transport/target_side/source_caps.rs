//! Caps on what peers make a target hold, counted in all and per source (an IPv4 address or
//! an IPv6 /64, as the pending-handshake caps count them): established streams
//! (`hixl.max_streams`, `hixl.max_streams_per_source`) and the RDMA queue pairs a target makes
//! for initiators (`hixl.rdma.max_qps`, `hixl.rdma.max_qps_per_source`). What a cap refuses is
//! refused with a message that names the cap and its option; what is already held is never
//! taken back to make room, so a source at its cap cannot disturb the links it, or anyone
//! else, already has.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;

/// A source of connections for the listener's caps: an IPv4 address, or an IPv6 /64 (one host
/// usually holds a whole /64).
pub(crate) fn source_key(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let mut o = v6.octets();
                o[8..].fill(0);
                IpAddr::V6(o.into())
            }
        },
        v4 => v4,
    }
}

/// One cap: a number, or (option value 0) a share of this process's descriptor limit
/// (RLIMIT_NOFILE's soft limit, read at each admission), for things that each cost a
/// descriptor: the cap then follows `ulimit -n`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cap {
    /// At most this many.
    Fixed(usize),
    /// At most the descriptor limit divided by this (at least 1).
    FdShare(usize),
}

impl Cap {
    /// An option's value: 0 is `FdShare(share)`, else that number.
    pub(crate) fn from_option(v: usize, share: usize) -> Cap {
        if v == 0 {
            Cap::FdShare(share)
        } else {
            Cap::Fixed(v)
        }
    }

    /// The cap now, and how a message shows the option's setting.
    fn resolve(self) -> (usize, String) {
        match self {
            Cap::Fixed(n) => (n, n.to_string()),
            Cap::FdShare(d) => {
                let soft = crate::sys::nofile_limit().map_or(1024, |l| l.min(1 << 24) as usize);
                let n = (soft / d.max(1)).max(1);
                (n, format!("0: 1/{d} of this process's descriptor limit {soft}"))
            }
        }
    }
}

/// What a [`SourceCaps`] counts, for its messages.
pub(crate) struct Counted {
    /// The things counted, plural ("established streams").
    pub(crate) what: &'static str,
    /// Who holds them ("this listener").
    pub(crate) holder: &'static str,
    /// The option of the cap in all, and of the cap per source.
    pub(crate) total_key: &'static str,
    pub(crate) per_source_key: &'static str,
}

/// Things held for peers, counted in all and per source, under two caps.
pub(crate) struct SourceCaps {
    counted: Counted,
    total_cap: Cap,
    per_source_cap: Cap,
    counts: Mutex<(usize, HashMap<IpAddr, usize>)>,
}

impl SourceCaps {
    /// Caps of `total` in all and `per_source` from one source.
    pub(crate) fn new(counted: Counted, total: Cap, per_source: Cap) -> SourceCaps {
        SourceCaps {
            counted,
            total_cap: total,
            per_source_cap: per_source,
            counts: Mutex::new((0, HashMap::new())),
        }
    }

    /// Counts `n` more for `ip`, or says which cap refuses them (nothing is counted then).
    /// Each `Ok` is matched by a [`SourceCaps::release`] of the same address and number.
    pub(crate) fn admit(&self, ip: IpAddr, n: usize) -> Result<(), String> {
        let key = source_key(ip);
        let Counted { what, holder, total_key, per_source_key } = &self.counted;
        let ((per_source, per_shown), (total, total_shown)) =
            (self.per_source_cap.resolve(), self.total_cap.resolve());
        let mut c = self.counts.lock().unwrap();
        let from = c.1.get(&key).copied().unwrap_or(0);
        if from + n > per_source {
            return Err(format!(
                "too many {what} for {key}: {holder} holds {from} of at most {per_source} for one \
                 source address ({per_source_key} = {per_shown}), and {n} more were asked for; \
                 close some links or raise it"
            ));
        }
        if c.0 + n > total {
            return Err(format!(
                "too many {what}: {holder} holds {} of at most {total} in all ({total_key} = \
                 {total_shown}), and {n} more were asked for; close some links or raise it",
                c.0
            ));
        }
        c.0 += n;
        *c.1.entry(key).or_default() += n;
        Ok(())
    }

    /// `n` counted by [`SourceCaps::admit`] for `ip` were let go.
    pub(crate) fn release(&self, ip: IpAddr, n: usize) {
        let key = source_key(ip);
        let mut c = self.counts.lock().unwrap();
        c.0 = c.0.saturating_sub(n);
        if let Some(k) = c.1.get_mut(&key) {
            *k = k.saturating_sub(n);
            if *k == 0 {
                c.1.remove(&key);
            }
        }
    }

    /// Held now: in all, and for `ip`'s source.
    #[cfg(test)]
    pub(crate) fn count(&self, ip: IpAddr) -> (usize, usize) {
        let c = self.counts.lock().unwrap();
        (c.0, c.1.get(&source_key(ip)).copied().unwrap_or(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(total: usize, per_source: usize) -> SourceCaps {
        let counted =
            Counted { what: "things", holder: "this test", total_key: "t.total", per_source_key: "t.source" };
        SourceCaps::new(counted, Cap::Fixed(total), Cap::Fixed(per_source))
    }

    #[test]
    fn a_share_of_the_descriptor_limit_follows_it() {
        let soft = crate::sys::nofile_limit().unwrap().min(1 << 24) as usize;
        let (n, shown) = Cap::FdShare(4).resolve();
        assert_eq!(n, (soft / 4).max(1));
        assert!(shown.contains(&format!("1/4 of this process's descriptor limit {soft}")), "{shown}");
        assert_eq!(Cap::from_option(0, 4), Cap::FdShare(4));
        assert_eq!(Cap::from_option(7, 4), Cap::Fixed(7));
    }

    #[test]
    fn caps_per_source_and_in_all_and_release() {
        let caps = caps(3, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let a6: IpAddr = "::ffff:10.0.0.1".parse().unwrap();
        let b: IpAddr = "2001:db8::1".parse().unwrap();
        let b2: IpAddr = "2001:db8::2".parse().unwrap();
        caps.admit(a, 1).unwrap();
        caps.admit(a6, 1).unwrap();
        let e = caps.admit(a, 1).unwrap_err();
        assert!(e.contains("t.source = 2") && e.contains("10.0.0.1") && e.contains("holds 2"), "{e}");
        caps.admit(b, 1).unwrap();
        // The same /64 is one source; the cap in all refuses it here.
        let e = caps.admit(b2, 1).unwrap_err();
        assert!(e.contains("t.total = 3"), "{e}");
        caps.release(a, 1);
        caps.admit(b2, 1).unwrap();
        let e = caps.admit(b, 1).unwrap_err();
        assert!(e.contains("2001:db8::"), "{e}");
        assert_eq!(caps.count(b), (3, 2));
        caps.release(b, 2);
        caps.release(a, 1);
        assert_eq!(caps.count(a), (0, 0));
        // Several at once: all or none.
        let e = caps.admit(a, 3).unwrap_err();
        assert!(e.contains("3 more"), "{e}");
        assert_eq!(caps.count(a), (0, 0));
        caps.admit(a, 2).unwrap();
        assert_eq!(caps.count(a6), (2, 2));
    }
}
