//! The few helpers every layer may use: the clock, random ids, and the tests'
//! proptest settings. It imports nothing from the crate, so it sits at the
//! bottom of the layer order (see `lib.rs`).

use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds since the Unix epoch (0.0 on a clock set before 1970).
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

pub(crate) fn hex(bytes: &[u8]) -> String {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(HEX[(b >> 4) as usize] as char);
        s.push(HEX[(b & 15) as usize] as char);
    }
    s
}

pub fn random_hex(n_bytes: usize) -> String {
    let mut buf = vec![0u8; n_bytes];
    if getrandom::fill(&mut buf).is_err() {
        // No OS randomness: fall back to time, which is unique enough for ids (never for tokens).
        let t = now().to_bits().to_le_bytes();
        for (i, b) in buf.iter_mut().enumerate() {
            *b = t[i % 8] ^ (i as u8);
        }
    }
    hex(&buf)
}

/// The property tests' config: `cases` per property, a fixed seed under
/// `CI=true` (so `make test` in CI is reproducible; `PROPTEST_RNG_SEED` picks
/// another), random otherwise, and shrinking capped at 10 s so a failure
/// cannot stall the suite.
#[cfg(test)]
pub(crate) fn proptest_config(cases: u32) -> proptest::test_runner::Config {
    let ci = std::env::var("CI").is_ok_and(|v| v == "true" || v == "1");
    proptest_config_for(cases, ci && std::env::var_os("PROPTEST_RNG_SEED").is_none())
}

#[cfg(test)]
pub(crate) fn proptest_config_for(cases: u32, fixed_seed: bool) -> proptest::test_runner::Config {
    use proptest::test_runner::{Config, RngSeed};
    let mut cfg = Config {
        cases,
        max_shrink_time: 10_000,
        ..Config::default()
    };
    if fixed_seed {
        cfg.rng_seed = RngSeed::Fixed(0x11e7_2026);
    }
    cfg
}

#[cfg(test)]
mod proptest_config_tests {
    use proptest::strategy::{Strategy, ValueTree};
    use proptest::test_runner::TestRunner;

    fn draws(fixed: bool) -> Vec<Vec<u8>> {
        let mut runner = TestRunner::new(super::proptest_config_for(4, fixed));
        let bytes = proptest::collection::vec(proptest::num::u8::ANY, 0..64);
        (0..8)
            .map(|_| match bytes.new_tree(&mut runner) {
                Ok(tree) => tree.current(),
                Err(e) => panic!("strategy failed: {e}"),
            })
            .collect()
    }

    #[test]
    fn ci_config_draws_the_same_inputs_every_run() {
        assert_eq!(draws(true), draws(true));
        if std::env::var_os("PROPTEST_RNG_SEED").is_some() {
            // A seed picked by hand (exploring, or replaying a failure) is
            // honoured outside CI too, so its runs repeat.
            assert_eq!(draws(false), draws(false));
        } else {
            // The random seed really is random (8 draws of up to 64 bytes colliding is ~impossible).
            assert_ne!(draws(false), draws(false));
        }
    }
}
