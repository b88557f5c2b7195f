//! The control channel: what it offers the data paths (`channel`), and how a peer is found
//! dead (`liveness`, sans-IO). Every link has exactly one, and no backend's data path reads or
//! writes the peer's region table except through it. Today it runs over the TCP link's
//! streams (stream 0 carries the table updates): `streams::control` implements it.

pub(crate) mod channel;
pub mod liveness;
