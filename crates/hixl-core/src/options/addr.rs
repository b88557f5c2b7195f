//! Engine addresses as users write them.

use std::net::{SocketAddr, ToSocketAddrs};

use crate::error::{Error, Result};

/// Parses "ip:port", "[v6]:port", "host:port" into one socket address.
pub fn parse_addr(s: &str) -> Result<SocketAddr> {
    if let Ok(a) = s.parse::<SocketAddr>() {
        return Ok(a);
    }
    match s.to_socket_addrs() {
        Ok(mut it) => it.next().ok_or_else(|| Error::param(format!("address {s:?} resolves to nothing"))),
        Err(_) => Err(Error::param(format!("address {s:?} is not \"ip:port\" (IPv6 as \"[::1]:port\")"))),
    }
}
