//! The stats as JSON, written by hand (the core has no serializer and needs none).

use std::fmt::Write;

use hixl_core::PeerSnapshot;

/// A JSON string literal of `s`.
fn string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// `{"peer": {...}, ...}`: the same fields as the Python `stats()`.
pub(crate) fn stats(peers: &[PeerSnapshot]) -> String {
    let mut o = String::from("{");
    for (i, p) in peers.iter().enumerate() {
        if i > 0 {
            o.push(',');
        }
        let l = &p.latency;
        let rails = rails(&p.rails);
        let _ = write!(
            o,
            "{}:{{\"backend\":{},\"not_chosen\":{},\"alive\":{},\"bytes_write\":{},\"bytes_read\":{},\
             \"ops_write\":{},\"ops_read\":{},\"errors\":{},\"notifies\":{},\"direct_parts\":{},\
             \"in_flight\":{},\"queue_slots_used\":{},\"queue_slots\":{},\"heartbeat_misses\":{},\
             \"rails\":[{}],\"latency_us\":{{\"count\":{},\"avg\":{},\"p50\":{},\"p99\":{},\"max\":{}}}}}",
            string(&p.peer),
            string(p.backend),
            string(&p.not_chosen),
            p.alive,
            p.bytes_write,
            p.bytes_read,
            p.ops_write,
            p.ops_read,
            p.errors,
            p.notifies,
            p.direct_parts,
            p.in_flight,
            p.queue_slots.0,
            p.queue_slots.1,
            p.heartbeat_misses,
            rails,
            l.count,
            l.avg_us,
            l.p50_us,
            l.p99_us,
            l.max_us
        );
    }
    o.push('}');
    o
}

/// The rails of an rdma link, as JSON objects separated by commas (`stats()`'s `rails`).
fn rails(rails: &[hixl_core::RailSnapshot]) -> String {
    let one = |r: &hixl_core::RailSnapshot| {
        format!(
            "{{\"device\":{},\"up\":{},\"out_why\":{},\"bytes\":{},\"returns\":{}}}",
            string(&r.device),
            r.up,
            string(&r.out_why),
            r.bytes,
            r.returns
        )
    };
    rails.iter().map(one).collect::<Vec<_>>().join(",")
}

#[cfg(test)]
mod tests {
    #[test]
    fn strings_are_escaped() {
        assert_eq!(super::string("a\"b\\c\n"), "\"a\\\"b\\\\c\\u000a\"");
    }

    #[test]
    fn rails_are_listed_with_their_returns() {
        let r = hixl_core::RailSnapshot {
            device: "soft1".into(),
            up: true,
            out_why: String::new(),
            bytes: 7,
            returns: 1,
        };
        assert_eq!(super::rails(&[r]), r#"{"device":"soft1","up":true,"out_why":"","bytes":7,"returns":1}"#);
    }
}
