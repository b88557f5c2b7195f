//! The engine id a served connection's peer is known by: what its Hello claims, checked against
//! the address the connection really comes from (docs/RELIABILITY.md, "Notifications' sender").
//!
//! An engine's id is its bound listen address ("ip:port") or, for a client-only engine,
//! "ip#pid". A Hello may claim any text; the id this engine reports for the connection (on
//! every notification that arrives on it) is:
//!
//! - the claim, when its host is the connection's source address, or a loopback or local
//!   address of this host while the connection comes from this host;
//! - the claim with its host replaced by the source address, when its host is unspecified
//!   (`0.0.0.0`, `::`: an engine listening on every address names no host of its own);
//! - `?` and the claim, when the claim is not an engine id at all (so that it can equal no
//!   engine's address);
//!
//! and `?` and the claim too (unverified) when its host is another machine's address. Such a
//! stream is still served (a host with several addresses may route to the target from
//! another one than it listens on, and without a secret any id is a claim anyway); only its
//! notifications can never pass for that engine's.

use std::net::{IpAddr, SocketAddr, UdpSocket};

/// The id under which notifications from this connection are reported, or why the claim
/// cannot be verified (the caller then reports `?` and the claim). `from` is the connection's source address, `local` the address it reached here.
pub(crate) fn sender_id(claim: &str, from: IpAddr, local: IpAddr) -> Result<String, String> {
    let (from, local) = (plain(from), plain(local));
    let Some((ip, rest)) = parse(claim) else {
        return Ok(format!("?{claim}"));
    };
    let ip = plain(ip);
    let same_host = from.is_loopback() || from == local;
    let with_host = |host: IpAddr| match rest {
        Rest::Port(port) => SocketAddr::new(host, port).to_string(),
        Rest::Pid(pid) => format!("{host}#{pid}"),
    };
    if ip.is_unspecified() {
        return Ok(with_host(from));
    }
    if ip == from || (same_host && (ip.is_loopback() || ip == local || is_local(ip))) {
        return Ok(with_host(ip));
    }
    Err(format!(
        "the Hello claims engine id {claim:?}, but the connection comes from {from}: an engine \
         connects from the address it is named by (listen on the address this host reaches the \
         target from)"
    ))
}

/// What follows the host in an engine id.
#[derive(Clone, Copy)]
enum Rest {
    Port(u16),
    Pid(u32),
}

fn parse(claim: &str) -> Option<(IpAddr, Rest)> {
    if let Ok(a) = claim.parse::<SocketAddr>() {
        return Some((a.ip(), Rest::Port(a.port())));
    }
    let (host, pid) = claim.rsplit_once('#')?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    Some((host.parse().ok()?, Rest::Pid(pid.parse().ok()?)))
}

/// An IPv4-mapped IPv6 address as IPv4 (as `addr_text` writes it).
fn plain(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// Whether `ip` is an address of this host (one a socket can be bound to).
fn is_local(ip: IpAddr) -> bool {
    UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_claim_stands_only_where_the_connection_comes_from_its_host() {
        let lo = ip("127.0.0.1");
        assert_eq!(sender_id("10.1.2.3:5000", ip("10.1.2.3"), ip("10.9.9.9")).unwrap(), "10.1.2.3:5000");
        assert_eq!(sender_id("10.1.2.3#77", ip("10.1.2.3"), ip("10.9.9.9")).unwrap(), "10.1.2.3#77");
        let e = sender_id("10.1.2.3:5000", ip("10.6.6.6"), ip("10.9.9.9")).unwrap_err();
        assert!(e.contains("\"10.1.2.3:5000\"") && e.contains("10.6.6.6"), "{e}");
        assert!(sender_id("10.1.2.3#77", ip("10.6.6.6"), ip("10.9.9.9")).is_err());
        // From this host: a loopback or local id is this host's to claim.
        assert_eq!(sender_id("127.0.0.1:5000", lo, lo).unwrap(), "127.0.0.1:5000");
        assert_eq!(sender_id("[::1]:5000", lo, lo).unwrap(), "[::1]:5000");
        assert_eq!(sender_id("127.0.0.1:5000", ip("10.9.9.9"), ip("10.9.9.9")).unwrap(), "127.0.0.1:5000");
        assert_eq!(
            sender_id("10.9.9.9:1", lo, ip("10.9.9.9")).unwrap(),
            "10.9.9.9:1",
            "the address it reached"
        );
        // From elsewhere, a loopback id is refused.
        assert!(sender_id("127.0.0.1:5000", ip("10.6.6.6"), ip("10.9.9.9")).is_err());
        // IPv4-mapped sources compare as IPv4.
        assert!(sender_id("10.1.2.3:5000", ip("::ffff:10.1.2.3"), ip("::ffff:10.9.9.9")).is_ok());
    }

    #[test]
    fn unspecified_hosts_take_the_source_and_non_ids_are_marked() {
        let from = ip("10.1.2.3");
        assert_eq!(sender_id("0.0.0.0:5000", from, ip("10.9.9.9")).unwrap(), "10.1.2.3:5000");
        assert_eq!(sender_id("[::]:5000", from, ip("10.9.9.9")).unwrap(), "10.1.2.3:5000");
        assert_eq!(sender_id("0.0.0.0#9", ip("::1"), ip("::1")).unwrap(), "::1#9");
        assert_eq!(sender_id("raw-client", from, from).unwrap(), "?raw-client");
        assert_eq!(sender_id("localhost:5000", from, from).unwrap(), "?localhost:5000");
        assert_eq!(sender_id("", from, from).unwrap(), "?");
    }
}
