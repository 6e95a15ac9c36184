//! Rollout tokens and key checks.
//!
//! A rollout's token is `lt-` + hex(HMAC-SHA256(db secret, rollout id)): random
//! to anyone without the per-database secret, yet the same on every `POST
//! /rollouts` with that id, which is what makes creation idempotent. Only
//! SHA-256 of the token is stored; it authorizes that rollout and nothing else.

use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::util::hex;

pub fn hmac_sha256(key: &[u8], msg: &[u8]) -> [u8; 32] {
    // HMAC accepts keys of any length (RFC 2104), so `new_from_slice` cannot fail.
    let mut mac = match Hmac::<Sha256>::new_from_slice(key) {
        Ok(m) => m,
        Err(_) => unreachable!("HMAC takes keys of any length"),
    };
    mac.update(msg);
    mac.finalize().into_bytes().into()
}

pub fn rollout_token(secret: &[u8], rollout_id: &str) -> String {
    format!("lt-{}", hex(&hmac_sha256(secret, rollout_id.as_bytes())))
}

pub fn token_hash(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

/// Equality in time independent of where the inputs differ (`subtle`).
pub fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.ct_eq(b).into()
}

/// Rollout ids: 1..=128 characters of `[A-Za-z0-9._:-]` (they appear in URLs).
pub fn valid_rollout_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 128
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hmac_matches_rfc4231_case_2() {
        let mac = hmac_sha256(b"Jefe", b"what do ya want for nothing?");
        assert_eq!(
            hex(&mac),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn tokens_differ_per_rollout() {
        let a = rollout_token(b"s", "a");
        assert_eq!(a, rollout_token(b"s", "a"));
        assert_ne!(a, rollout_token(b"s", "b"));
        assert_ne!(a, rollout_token(b"t", "a"));
        assert!(constant_time_eq(
            token_hash(&a).as_bytes(),
            token_hash(&a).as_bytes()
        ));
    }

    #[test]
    fn rollout_ids() {
        assert!(valid_rollout_id("task-1.a:b_c"));
        assert!(!valid_rollout_id(""));
        assert!(!valid_rollout_id("a/b"));
        assert!(!valid_rollout_id(&"x".repeat(129)));
    }
}
