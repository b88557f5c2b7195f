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

/// Fewest different values a secret's characters, and its steps, must take.
pub const MIN_SECRET_DISTINCT: usize = 8;
/// Most equal steps in a row a secret may have (15 = 16 characters counting up, down or
/// repeating).
pub const MAX_SECRET_EQUAL_STEPS: usize = 14;

/// Why a secret of at least [`MIN_SECRET_HEX`] hex characters is a pattern, or None. The text
/// is read case-folded, as values 0..16, and so is its sequence of steps (each character minus
/// the one before it, mod 16; a run counting up has steps of 1). A secret is refused when:
///
/// - the text or its steps repeat a block of fewer than [`MIN_SECRET_HEX`] values at least
///   twice over (`"3f" * 32`, `"deadbeef" * 4`; `00112233...`, whose steps are `0101...`):
///   it then holds at most 4 bits per value of the block, under 128;
/// - the text or its steps take fewer than [`MIN_SECRET_DISTINCT`] different values (a
///   random secret of 32 does with probability under 1e-7, of 64 under 1e-18);
/// - more than [`MAX_SECRET_EQUAL_STEPS`] steps in a row are equal (16 characters counting
///   up, down or repeating: they hold 8 bits where random ones hold 64);
/// - it is all digits and shorter than 39, or all letters and shorter than 50: it then holds
///   under 128 bits (log2 10 and log2 6 bits a character).
///
/// `hixl secret` prints 64 random hex characters: they are refused with probability under
/// 1e-15. The reason names the pattern, never the characters.
pub fn pattern_in(text: &str) -> Option<String> {
    let v: Vec<u8> = text.bytes().map(|b| (b as char).to_digit(16).unwrap_or(0) as u8).collect();
    let steps: Vec<u8> = v.windows(2).map(|w| w[1].wrapping_sub(w[0]) & 15).collect();
    for (what, seq) in [("its characters", &v), ("its steps from character to character", &steps)] {
        if let Some(p) = repeated_block(seq) {
            return Some(format!("{what} repeat a block of {p}"));
        }
        let mut seen = [false; 16];
        seq.iter().for_each(|&x| seen[x as usize] = true);
        let distinct = seen.iter().filter(|&&b| b).count();
        if distinct < MIN_SECRET_DISTINCT {
            return Some(format!(
                "{what} take only {distinct} different values (at least {MIN_SECRET_DISTINCT})"
            ));
        }
    }
    let (mut run, mut longest) = (0usize, 0usize);
    for w in steps.windows(2) {
        run = if w[0] == w[1] { run + 1 } else { 0 };
        longest = longest.max(run + 1);
    }
    if longest > MAX_SECRET_EQUAL_STEPS {
        return Some(format!("{} characters in a row count up, down or repeat", longest + 1));
    }
    let digits = text.bytes().all(|b| b.is_ascii_digit());
    let letters = text.bytes().all(|b| b.is_ascii_alphabetic());
    if digits && text.len() < 39 || letters && text.len() < 50 {
        let kind = if digits { "digits, under 39" } else { "letters, under 50" };
        return Some(format!("it is all {kind} of them (under 128 bits)"));
    }
    None
}

/// The shortest block of fewer than [`MIN_SECRET_HEX`] values that `seq` repeats at least
/// twice over (any rest a beginning of the block), or None.
fn repeated_block(seq: &[u8]) -> Option<usize> {
    (1..MIN_SECRET_HEX.min(seq.len() / 2 + 1)).find(|&p| (p..seq.len()).all(|i| seq[i] == seq[i - p]))
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
    /// A secret from its text: at least [`MIN_SECRET_HEX`] hex digits and nothing else, with
    /// none of the patterns of [`pattern_in`], so that a proof sent to anyone who asks cannot
    /// be used to guess it offline. The error says why, never repeating the text.
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
        if let Some(why) = pattern_in(text) {
            return Err(Error::param(format!(
                "hixl.secret is too weak: {why}, which a random secret never does; make one with \
                 `hixl secret`"
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
        match crate::sys::getrandom(&mut buf[got..]) {
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(Error::failed(format!("getrandom: {e}"))),
        }
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

    const K: &str = "a0a05abe5918446a7cb7c05dee7d2866"; // from `hixl secret`, cut to 32

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
    fn patterned_secrets_are_refused_saying_why_and_never_how() {
        let d = "0123456789";
        let cases: [(String, &str); 12] = [
            ("0".repeat(32), "characters repeat a block of 1"),
            ("3f".repeat(32), "characters repeat a block of 2"),
            ("deadbeef".repeat(4), "characters repeat a block of 8"),
            ("DeadBeef".repeat(8), "characters repeat a block of 8"),
            ("0123456789abcdef".repeat(2), "characters repeat a block of 16"),
            (format!("{}{}", &K[..31], &K[..31]), "characters repeat a block of 31"),
            ("00112233445566778899aabbccddeeff".into(), "steps from character to character repeat"),
            ("0123456789abcdefABCDEF0123456789".into(), "steps from character to character take only 2"),
            (format!("{}1", "0".repeat(31)), "take only 2 different values"),
            ("1234123412341234432143214321432".to_string() + "1", "take only 4 different values"),
            (format!("{}{}", "0123456789abcdef", &K[..16]), "16 characters in a row count up"),
            (format!("{d}{}", "3141592653589793238462643383"), "all digits"),
        ];
        for (weak, why) in &cases {
            let e = Secret::new(weak).unwrap_err();
            assert!(e.message.contains(why) && e.message.contains("hixl secret"), "{weak}: {e}");
            assert!(!e.message.contains(&weak[..8]), "the secret leaked into: {e}");
        }
        // 64 characters of one half repeated hold 128 bits: not a short block, accepted.
        assert!(Secret::new(&format!("{K}{K}")).is_ok());
        // Digits alone are enough from 39 on (39 x log2 10 > 128 bits).
        assert!(Secret::new("314159265358979323846264338327950288419").is_ok());
    }

    #[test]
    fn random_secrets_always_pass() {
        // What `hixl secret` prints (64 random hex characters), 200,000 times, from a fixed
        // xorshift so that the test is the same every run; and 32-character ones.
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut hex = |n: usize| -> String {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    char::from_digit((x >> 60) as u32, 16).unwrap()
                })
                .collect()
        };
        for _ in 0..200_000 {
            let s = hex(64);
            assert!(pattern_in(&s).is_none(), "{s}: {:?}", pattern_in(&s));
        }
        let refused = (0..200_000).filter(|_| pattern_in(&hex(32)).is_some()).count();
        assert!(refused <= 2, "{refused} of 200000 random 32-character secrets refused");
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
