//! Engine addresses as users write them.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{Error, Result};

/// Parses "ip:port", "[v6]:port", "host:port" into one socket address.
///
/// Text that is not "host:port" at all says so; a host name that does not resolve says that
/// the name did not resolve, with the resolver's reason.
pub fn parse_addr(s: &str) -> Result<SocketAddr> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    let not_addr = || Error::param(format!("address {s:?} is not \"ip:port\" (IPv6 as \"[::1]:port\")"));
    // A host name (no brackets, no further colon) and a port: anything else is no address.
    let host = match s.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && !h.contains([':', '[', ']']) && p.parse::<u16>().is_ok() => h,
        _ => return Err(not_addr()),
    };
    match s.to_socket_addrs() {
        Ok(mut it) => it
            .next()
            .ok_or_else(|| Error::param(format!("address {s:?}: host name {host:?} resolves to no address"))),
        Err(e) => Err(Error::param(format!("address {s:?}: host name {host:?} did not resolve ({e})"))),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_addr;

    #[test]
    fn ip_and_names_that_resolve_parse() {
        assert_eq!(parse_addr("127.0.0.1:5").unwrap().port(), 5);
        assert_eq!(parse_addr("[::1]:6").unwrap().port(), 6);
        assert!(parse_addr("localhost:7").unwrap().ip().is_loopback());
    }

    #[test]
    fn a_name_that_does_not_resolve_is_named_with_the_reason() {
        // ".invalid" never resolves (RFC 6761).
        let m = parse_addr("nohost.invalid:19501").unwrap_err().message;
        assert!(
            m.starts_with("address \"nohost.invalid:19501\": host name \"nohost.invalid\" did not resolve ("),
            "{m}"
        );
        assert!(!m.contains("ip:port"), "{m}");
    }

    #[test]
    fn text_that_is_not_host_port_says_so() {
        for s in ["19501", "host", "host:", ":80", "host:99999", "host:x", "a:b:c", "[::1]", "[x]:1"] {
            let m = parse_addr(s).unwrap_err().message;
            assert!(m.contains("is not \"ip:port\""), "{s}: {m}");
        }
    }
}
