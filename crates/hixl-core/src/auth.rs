//! Mutual challenge-response for the cluster secret, and the per-frame MACs of sealed streams
//! (sans-IO; docs/PROTOCOL.md has the byte layouts).
//!
//! Every stream authenticates before the target sends anything about itself:
//! 1. the initiator's Hello carries a fresh nonce `ni` and the address it dialled;
//! 2. a target with a secret answers AuthChallenge { `nt`, its proof, its engine id };
//! 3. the initiator checks that proof and answers AuthResponse { its proof };
//! 4. the target checks it and only then sends Welcome, the first sealed frame.
//!
//! Both proofs are HMAC-SHA256 over a hash of the whole transcript: both nonces, both engine
//! ids and the dialled address, each side using the address as it sees it. A proof relayed from
//! another connection, engine or address therefore does not verify. Two session keys (one per
//! direction) are derived from the same transcript; every later frame carries a BLAKE3-keyed MAC
//! over its sequence number, header and payload, checked before the frame is acted on.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

use crate::error::{Error, Result};

/// Bytes of a nonce and of a proof.
pub const LEN: usize = 32;
/// A random challenge.
pub type Nonce = [u8; LEN];
/// An HMAC-SHA256 proof.
pub type Proof = [u8; LEN];
/// Bytes of a frame MAC (and of a data MAC) on the wire.
pub const MAC_LEN: usize = 16;
/// Fewest hex digits a secret must have (128 bits).
pub const MIN_SECRET_HEX: usize = 32;

const TARGET_LABEL: &[u8] = b"hixl-v3 target proof";
const INITIATOR_LABEL: &[u8] = b"hixl-v3 initiator proof";
const KEY_IT_LABEL: &[u8] = b"hixl-v3 key initiator->target";
const KEY_TI_LABEL: &[u8] = b"hixl-v3 key target->initiator";

/// The cluster secret. Its `Debug` never shows the bytes, so it cannot leak through logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

/// What both proofs and both session keys are bound to.
#[derive(Clone, Debug)]
pub struct Transcript<'a> {
    /// The initiator's nonce.
    pub ni: &'a Nonce,
    /// The target's nonce.
    pub nt: &'a Nonce,
    /// The initiator's engine id (from Hello).
    pub initiator: &'a str,
    /// The target's engine id (from AuthChallenge).
    pub target: &'a str,
    /// The address the stream reached, as this side sees it.
    pub dialled: &'a str,
    /// Hello's link nonce.
    pub link_nonce: u64,
    /// Hello's stream index.
    pub stream_index: u16,
    /// Hello's flags.
    pub flags: u32,
}

impl Transcript<'_> {
    /// SHA-256 over every field, each prefixed with its length.
    fn hash(&self) -> [u8; 32] {
        let mut h = Sha256::new();
        let fields: [&[u8]; 8] = [
            self.ni,
            self.nt,
            self.initiator.as_bytes(),
            self.target.as_bytes(),
            self.dialled.as_bytes(),
            &self.link_nonce.to_le_bytes(),
            &self.stream_index.to_le_bytes(),
            &self.flags.to_le_bytes(),
        ];
        for f in fields {
            h.update((f.len() as u32).to_le_bytes());
            h.update(f);
        }
        h.finalize().into()
    }
}

/// The two keys of an authenticated stream, one per direction.
#[derive(Clone)]
pub struct SessionKeys {
    /// Seals frames from the initiator to the target.
    pub initiator_to_target: [u8; 32],
    /// Seals frames from the target to the initiator.
    pub target_to_initiator: [u8; 32],
}

impl Secret {
    /// A secret from its text: at least [`MIN_SECRET_HEX`] hex digits and nothing else, so that
    /// a proof sent to anyone who asks cannot be used to guess it offline.
    pub fn new(text: &str) -> Result<Secret> {
        let hex = text.bytes().all(|b| b.is_ascii_hexdigit());
        if text.len() < MIN_SECRET_HEX || !hex {
            return Err(Error::param(format!(
                "hixl.secret is too weak: it must be at least {MIN_SECRET_HEX} hex characters (0-9, a-f) \
                 and nothing else (it has {} characters{}); make one with `hixl secret`",
                text.len(),
                if hex { "" } else { ", not all hex" }
            )));
        }
        Ok(Secret(text.as_bytes().to_vec()))
    }

    fn mac(&self, label: &[u8], t: &Transcript<'_>) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(&t.hash());
        m
    }

    /// The target's proof.
    pub fn target_proof(&self, t: &Transcript<'_>) -> Proof {
        self.mac(TARGET_LABEL, t).finalize().into_bytes().into()
    }

    /// The initiator's proof.
    pub fn initiator_proof(&self, t: &Transcript<'_>) -> Proof {
        self.mac(INITIATOR_LABEL, t).finalize().into_bytes().into()
    }

    /// Whether `proof` is the target's proof (constant-time compare).
    pub fn check_target(&self, t: &Transcript<'_>, proof: &Proof) -> bool {
        self.mac(TARGET_LABEL, t).verify_slice(proof).is_ok()
    }

    /// Whether `proof` is the initiator's proof (constant-time compare).
    pub fn check_initiator(&self, t: &Transcript<'_>, proof: &Proof) -> bool {
        self.mac(INITIATOR_LABEL, t).verify_slice(proof).is_ok()
    }

    /// The stream's two session keys.
    pub fn session_keys(&self, t: &Transcript<'_>) -> SessionKeys {
        SessionKeys {
            initiator_to_target: self.mac(KEY_IT_LABEL, t).finalize().into_bytes().into(),
            target_to_initiator: self.mac(KEY_TI_LABEL, t).finalize().into_bytes().into(),
        }
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// One direction of a stream's MACs: a key and the sequence number of the next frame. Without a
/// key (no secret) it does nothing: frames go out and come in unsealed.
#[derive(Default)]
pub struct FrameMac {
    key: Option<[u8; 32]>,
    seq: u64,
    data: bool,
}

impl FrameMac {
    /// MACs with `key` (None: an unsealed stream); `data`: bulk bytes get a MAC too.
    pub fn new(key: Option<[u8; 32]>, data: bool) -> FrameMac {
        FrameMac { key, seq: 0, data: data && key.is_some() }
    }

    /// Whether frames carry a MAC.
    pub fn sealed(&self) -> bool {
        self.key.is_some()
    }

    /// Whether bulk bytes carry a MAC.
    pub fn data(&self) -> bool {
        self.data
    }

    fn frame_mac(&self, key: &[u8; 32], seq: u64, parts: &[&[u8]]) -> [u8; MAC_LEN] {
        let mut h = blake3::Hasher::new_keyed(key);
        h.update(&seq.to_le_bytes());
        for p in parts {
            h.update(p);
        }
        h.finalize().as_bytes()[..MAC_LEN].try_into().unwrap()
    }

    /// Appends the MAC of an encoded frame (header + payload) and counts it; returns the
    /// sequence number it used (for the data MAC).
    pub fn seal(&mut self, frame: &mut Vec<u8>) -> u64 {
        let seq = self.seq;
        if let Some(key) = &self.key {
            let mac = self.frame_mac(key, seq, &[frame]);
            frame.extend_from_slice(&mac);
            self.seq += 1;
        }
        seq
    }

    /// Checks the MAC that came after an encoded frame and counts it; returns the sequence
    /// number for the data MAC. Err names what failed (wrong MAC: injected, altered, replayed
    /// or reordered).
    pub fn open(&mut self, parts: &[&[u8]], mac: &[u8]) -> std::result::Result<u64, String> {
        let seq = self.seq;
        let Some(key) = &self.key else { return Ok(seq) };
        let want = self.frame_mac(key, seq, parts);
        if !constant_eq(&want, mac) {
            return Err(format!("frame {seq} has a wrong MAC (injected, altered or replayed)"));
        }
        self.seq += 1;
        Ok(seq)
    }

    /// A hasher for the bulk bytes of frame `seq` (None without data MACs).
    pub fn data_hasher(&self, seq: u64) -> Option<blake3::Hasher> {
        if !self.data {
            return None;
        }
        let mut h = blake3::Hasher::new_keyed(self.key.as_ref()?);
        h.update(&seq.to_le_bytes());
        h.update(b"bulk");
        Some(h)
    }
}

/// The 16-byte data MAC of a finished hasher.
pub fn data_mac(h: &blake3::Hasher) -> [u8; MAC_LEN] {
    h.finalize().as_bytes()[..MAC_LEN].try_into().unwrap()
}

/// Constant-time equality of two byte strings of the same length.
pub fn constant_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Fills `buf` from the kernel's random source.
pub fn random_bytes(buf: &mut [u8]) -> Result<()> {
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: the pointer and length describe the unfilled rest of `buf`.
        let r = unsafe { libc::getrandom(buf[got..].as_mut_ptr().cast(), buf.len() - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::failed(format!("getrandom: {e}")));
        }
        got += r as usize;
    }
    Ok(())
}

/// A fresh random nonce from the kernel.
pub fn nonce() -> Result<Nonce> {
    let mut n = [0u8; LEN];
    random_bytes(&mut n)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    const K: &str = "00112233445566778899aabbccddeeff";

    fn t<'a>(ni: &'a Nonce, nt: &'a Nonce, dialled: &'a str) -> Transcript<'a> {
        Transcript {
            ni,
            nt,
            initiator: "127.0.0.1#7",
            target: "127.0.0.1:4000",
            dialled,
            link_nonce: 9,
            stream_index: 0,
            flags: 0,
        }
    }

    #[test]
    fn proofs_bind_secret_nonces_direction_and_address() {
        let k = Secret::new(K).unwrap();
        let other = Secret::new(&K.replace('0', "1")).unwrap();
        let (ni, nt) = (nonce().unwrap(), nonce().unwrap());
        let here = t(&ni, &nt, "127.0.0.1:4000");
        let pt = k.target_proof(&here);
        let pi = k.initiator_proof(&here);
        assert!(k.check_target(&here, &pt));
        assert!(k.check_initiator(&here, &pi));
        assert_ne!(pt, pi, "the two directions must differ");
        assert!(!k.check_initiator(&here, &pt), "a target proof must not pass as an initiator's");
        assert!(!other.check_target(&here, &pt));
        assert!(!k.check_target(&t(&nt, &ni, "127.0.0.1:4000"), &pt), "nonces are bound");
        assert!(!k.check_target(&t(&ni, &nt, "127.0.0.1:4001"), &pt), "the dialled address is bound");
        let mut relayed = here.clone();
        relayed.initiator = "127.0.0.1#8";
        assert!(!k.check_target(&relayed, &pt), "the initiator's id is bound");
        let mut bad = pt;
        bad[31] ^= 1;
        assert!(!k.check_target(&here, &bad));
        let keys = k.session_keys(&here);
        assert_ne!(keys.initiator_to_target, keys.target_to_initiator);
    }

    #[test]
    fn weak_secrets_are_refused_and_none_prints() {
        let k = Secret::new(K).unwrap();
        assert!(!format!("{k:?}").contains(K));
        for weak in ["", "summer2024", &K[1..], &format!("{}zz", &K[..30])] {
            let e = Secret::new(weak).unwrap_err();
            assert!(e.message.contains("hixl secret"), "{e}");
        }
    }

    #[test]
    fn sealed_frames_detect_tampering_replay_and_reordering() {
        let key = Some([7u8; 32]);
        let (mut tx, mut rx) = (FrameMac::new(key, false), FrameMac::new(key, false));
        let mut a = b"frame-a".to_vec();
        let mut b = b"frame-b".to_vec();
        tx.seal(&mut a);
        tx.seal(&mut b);
        let (fa, ma) = a.split_at(a.len() - MAC_LEN);
        let (fb, mb) = b.split_at(b.len() - MAC_LEN);
        assert!(rx.clone_for_test().open(&[fb], mb).is_err(), "out of order");
        assert_eq!(rx.open(&[&fa[..3], &fa[3..]], ma), Ok(0), "parts hash as their concatenation");
        assert!(rx.clone_for_test().open(&[fa], ma).is_err(), "replayed");
        let mut altered = fb.to_vec();
        altered[0] ^= 1;
        assert!(rx.clone_for_test().open(&[&altered], mb).is_err(), "altered");
        assert_eq!(rx.open(&[fb], mb), Ok(1));
        let mut plain = FrameMac::new(None, true);
        let mut f = b"x".to_vec();
        plain.seal(&mut f);
        assert_eq!(f, b"x", "no key: no MAC");
        assert!(!plain.data());
    }

    impl FrameMac {
        fn clone_for_test(&self) -> FrameMac {
            FrameMac { key: self.key, seq: self.seq, data: self.data }
        }
    }
}
