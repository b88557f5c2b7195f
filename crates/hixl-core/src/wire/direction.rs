//! Which frame kinds travel in which direction after a handshake (docs/PROTOCOL.md, "Frame"):
//! a reader checks a header against these before it sets aside anything for the payload.

use super::{Header, Kind, WireError};

/// The kinds an initiator sends on a stream after its handshake (docs/PROTOCOL.md, direction
/// I→T or both, less the handshake's Hello and AuthResponse).
pub const TO_TARGET: &[Kind] = &[
    Kind::Write,
    Kind::Read,
    Kind::WriteStrided,
    Kind::ReadStrided,
    Kind::Notify,
    Kind::Heartbeat,
    Kind::Bye,
    Kind::RegionsQuery,
    Kind::RegionsAck,
    Kind::BackendOpen,
    Kind::Error,
];
/// The kinds a target sends on a stream after the handshake (direction T→I or both, less the
/// handshake's Welcome and AuthChallenge).
pub const TO_INITIATOR: &[Kind] = &[
    Kind::ReadResp,
    Kind::Ack,
    Kind::HeartbeatAck,
    Kind::Error,
    Kind::RegionsTable,
    Kind::RegionsUpdate,
    Kind::RegionsDelta,
    Kind::BackendOpened,
];

/// Refuses a header, after the handshake, of a kind its direction never carries
/// (`to_target`: it came from an initiator); checked before any memory is set aside for its
/// payload.
pub fn after_handshake(h: &Header, to_target: bool) -> Result<(), WireError> {
    let allowed = if to_target { TO_TARGET } else { TO_INITIATOR };
    if allowed.contains(&h.kind) {
        Ok(())
    } else {
        Err(WireError::Direction { kind: h.kind, to_target })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handshake_kinds_never_pass_after_it_and_error_goes_both_ways() {
        let h = |kind| Header { kind, payload_len: 0, tag: 0, bulk_len: 0 };
        for k in [Kind::Hello, Kind::Welcome, Kind::AuthChallenge, Kind::AuthResponse] {
            assert!(after_handshake(&h(k), true).is_err() && after_handshake(&h(k), false).is_err(), "{k:?}");
        }
        assert!(
            after_handshake(&h(Kind::Error), true).is_ok() && after_handshake(&h(Kind::Error), false).is_ok()
        );
        assert!(TO_TARGET.iter().all(|k| *k == Kind::Error || !TO_INITIATOR.contains(k)));
        let e = after_handshake(&h(Kind::Welcome), true).unwrap_err().to_string();
        assert!(e.starts_with("unexpected Welcome frame from an initiator"), "{e}");
    }
}
