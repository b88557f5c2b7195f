//! Mutual challenge-response for the optional cluster secret (sans-IO).
//!
//! Every stream authenticates before the target sends anything about itself:
//! 1. the initiator's Hello carries a fresh random nonce `ni`;
//! 2. a target with a secret answers AuthChallenge { nonce `nt`, proof HMAC(k, T|ni|nt) },
//!    proving that it knows the secret without revealing it;
//! 3. the initiator checks that proof and answers AuthResponse { HMAC(k, I|ni|nt) };
//! 4. the target checks it and only then sends Welcome (engine id, pid, region table).
//!
//! Proofs are HMAC-SHA256 over both nonces with a different label per direction (so one
//! side's proof can never be replayed as the other's), compared in constant time.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use crate::error::{Error, Result};

/// Bytes of a nonce and of a proof.
pub const LEN: usize = 32;
/// A random challenge.
pub type Nonce = [u8; LEN];
/// An HMAC-SHA256 proof.
pub type Proof = [u8; LEN];

const TARGET_LABEL: &[u8] = b"hixl-auth-v1 target proof";
const INITIATOR_LABEL: &[u8] = b"hixl-auth-v1 initiator proof";

/// The cluster secret. Its `Debug` never shows the bytes, so it cannot leak through logs.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl Secret {
    /// A secret from its text; empty text is refused.
    pub fn new(text: &str) -> Result<Secret> {
        if text.is_empty() {
            return Err(Error::param("hixl.secret is empty: give a non-empty secret or leave it unset"));
        }
        Ok(Secret(text.as_bytes().to_vec()))
    }

    fn mac(&self, label: &[u8], ni: &Nonce, nt: &Nonce) -> Hmac<Sha256> {
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length");
        m.update(label);
        m.update(ni);
        m.update(nt);
        m
    }

    /// The target's proof for the nonce pair.
    pub fn target_proof(&self, ni: &Nonce, nt: &Nonce) -> Proof {
        self.mac(TARGET_LABEL, ni, nt).finalize().into_bytes().into()
    }

    /// The initiator's proof for the nonce pair.
    pub fn initiator_proof(&self, ni: &Nonce, nt: &Nonce) -> Proof {
        self.mac(INITIATOR_LABEL, ni, nt).finalize().into_bytes().into()
    }

    /// Whether `proof` is the target's proof (constant-time compare).
    pub fn check_target(&self, ni: &Nonce, nt: &Nonce, proof: &Proof) -> bool {
        self.mac(TARGET_LABEL, ni, nt).verify_slice(proof).is_ok()
    }

    /// Whether `proof` is the initiator's proof (constant-time compare).
    pub fn check_initiator(&self, ni: &Nonce, nt: &Nonce, proof: &Proof) -> bool {
        self.mac(INITIATOR_LABEL, ni, nt).verify_slice(proof).is_ok()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(<redacted>)")
    }
}

/// A fresh random nonce from the kernel.
pub fn nonce() -> Result<Nonce> {
    let mut n = [0u8; LEN];
    let mut got = 0;
    while got < LEN {
        // SAFETY: the pointer and length describe the unfilled rest of `n`.
        let r = unsafe { libc::getrandom(n[got..].as_mut_ptr().cast(), LEN - got, 0) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(Error::failed(format!("getrandom: {e}")));
        }
        got += r as usize;
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proofs_verify_only_with_the_same_secret_nonces_and_direction() {
        let k = Secret::new("cluster-7").unwrap();
        let other = Secret::new("cluster-8").unwrap();
        let (ni, nt) = (nonce().unwrap(), nonce().unwrap());
        assert_ne!(ni, nt);
        let pt = k.target_proof(&ni, &nt);
        let pi = k.initiator_proof(&ni, &nt);
        assert!(k.check_target(&ni, &nt, &pt));
        assert!(k.check_initiator(&ni, &nt, &pi));
        assert_ne!(pt, pi, "the two directions must differ");
        assert!(!k.check_initiator(&ni, &nt, &pt), "a target proof must not pass as an initiator's");
        assert!(!other.check_target(&ni, &nt, &pt));
        assert!(!k.check_target(&nt, &ni, &pt));
        let mut bad = pt;
        bad[31] ^= 1;
        assert!(!k.check_target(&ni, &nt, &bad));
    }

    #[test]
    fn secret_never_prints() {
        let k = Secret::new("hunter2").unwrap();
        assert!(!format!("{k:?}").contains("hunter2"));
        assert!(Secret::new("").is_err());
    }
}
