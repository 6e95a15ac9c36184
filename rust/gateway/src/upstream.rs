//! The upstream pool: rollout affinity by rendezvous (highest-random-weight)
//! hashing, mark-down after consecutive failures, and run-time replacement.
//!
//! Rendezvous hashing is consistent hashing without a ring: each rollout ranks
//! every upstream by hash(rollout, upstream) and uses the best healthy one, so
//! adding or removing one upstream moves only the rollouts that ranked it first,
//! and a rollout's prefix cache stays on one engine.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::config::{parse_base_url, BaseUrl, Engine, UpstreamConfig};

#[derive(Debug)]
pub struct Upstream {
    pub url: String,
    pub base: BaseUrl,
    pub weight_version: u64,
    pub engine: Engine,
    failures: AtomicU32,
    /// Micros since the pool's epoch until which this upstream is skipped (0 = up).
    down_until_us: AtomicU64,
}

impl Upstream {
    pub fn uri(&self, path: &str) -> String {
        format!("http://{}{}{}", self.base.authority, self.base.prefix, path)
    }
}

#[derive(Debug)]
pub struct Pool {
    upstreams: RwLock<Arc<Vec<Arc<Upstream>>>>,
    epoch: Instant,
    mark_down_after: u32,
    down_for: Duration,
}

fn mix(mut x: u64) -> u64 {
    // splitmix64 finalizer: cheap and well distributed.
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

fn fnv1a(bytes: &[u8], seed: u64) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed;
    for b in bytes {
        h ^= *b as u64;
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

pub fn affinity_score(key: &str, upstream_url: &str) -> u64 {
    mix(fnv1a(key.as_bytes(), 0) ^ mix(fnv1a(upstream_url.as_bytes(), 0x9e37_79b9)))
}

impl Pool {
    pub fn new(
        cfgs: &[UpstreamConfig],
        mark_down_after: u32,
        down_for: Duration,
    ) -> Result<Pool, String> {
        let pool = Pool {
            upstreams: RwLock::new(Arc::new(Vec::new())),
            epoch: Instant::now(),
            mark_down_after: mark_down_after.max(1),
            down_for,
        };
        pool.replace(cfgs)?;
        Ok(pool)
    }

    /// Replaces the whole set (weight sync: new engines or new weight versions).
    pub fn replace(&self, cfgs: &[UpstreamConfig]) -> Result<(), String> {
        let mut list = Vec::with_capacity(cfgs.len());
        for c in cfgs {
            list.push(Arc::new(Upstream {
                url: c.url.clone(),
                base: parse_base_url(&c.url)?,
                weight_version: c.weight_version,
                engine: c.engine,
                failures: AtomicU32::new(0),
                down_until_us: AtomicU64::new(0),
            }));
        }
        if let Ok(mut g) = self.upstreams.write() {
            *g = Arc::new(list);
        }
        Ok(())
    }

    pub fn all(&self) -> Arc<Vec<Arc<Upstream>>> {
        self.upstreams.read().map(|g| g.clone()).unwrap_or_default()
    }

    fn now_us(&self) -> u64 {
        self.epoch.elapsed().as_micros() as u64
    }

    pub fn is_up(&self, u: &Upstream) -> bool {
        u.down_until_us.load(Ordering::Relaxed) <= self.now_us()
    }

    /// Upstreams in the order a rollout should try them: healthy ones by
    /// affinity, then marked-down ones (a last resort beats no answer).
    pub fn candidates(&self, key: &str) -> Vec<Arc<Upstream>> {
        let all = self.all();
        let mut ranked: Vec<(bool, u64, Arc<Upstream>)> = all
            .iter()
            .map(|u| (self.is_up(u), affinity_score(key, &u.url), u.clone()))
            .collect();
        ranked.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
        ranked.into_iter().map(|(_, _, u)| u).collect()
    }

    pub fn record_success(&self, u: &Upstream) {
        u.failures.store(0, Ordering::Relaxed);
        u.down_until_us.store(0, Ordering::Relaxed);
    }

    /// Counts a failure; returns true when this one marked the upstream down.
    pub fn record_failure(&self, u: &Upstream) -> bool {
        let n = u.failures.fetch_add(1, Ordering::Relaxed) + 1;
        if n >= self.mark_down_after {
            let until = self.now_us() + self.down_for.as_micros() as u64;
            let prev = u.down_until_us.swap(until, Ordering::Relaxed);
            return prev <= self.now_us();
        }
        false
    }

    pub fn describe(&self) -> serde_json::Value {
        let list: Vec<serde_json::Value> = self
            .all()
            .iter()
            .map(|u| {
                serde_json::json!({
                    "url": u.url,
                    "weight_version": u.weight_version,
                    "engine": u.engine,
                    "up": self.is_up(u),
                    "consecutive_failures": u.failures.load(Ordering::Relaxed),
                })
            })
            .collect();
        serde_json::json!({ "upstreams": list })
    }

    /// The highest weight version any upstream serves.
    pub fn weight_version(&self) -> u64 {
        self.all()
            .iter()
            .map(|u| u.weight_version)
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(urls: &[&str]) -> Vec<UpstreamConfig> {
        urls.iter()
            .map(|u| UpstreamConfig {
                url: u.to_string(),
                weight_version: 0,
                engine: Engine::Vllm,
            })
            .collect()
    }

    #[test]
    fn affinity_is_stable_and_moves_little() {
        let urls = ["http://a:1/v1", "http://b:1/v1", "http://c:1/v1"];
        let pool =
            Pool::new(&cfg(&urls), 2, Duration::from_secs(5)).unwrap_or_else(|e| panic!("{e}"));
        let first: Vec<String> = (0..300)
            .map(|i| pool.candidates(&format!("r{i}"))[0].url.clone())
            .collect();
        for u in urls {
            let share = first.iter().filter(|x| x.as_str() == u).count();
            assert!(share > 60, "{u} got {share}/300");
        }
        pool.replace(&cfg(&urls[..2]))
            .unwrap_or_else(|e| panic!("{e}"));
        for (i, f) in first.iter().enumerate() {
            if f != urls[2] {
                assert_eq!(&pool.candidates(&format!("r{i}"))[0].url, f);
            }
        }
    }

    #[test]
    fn mark_down_moves_rollouts() {
        let pool = Pool::new(
            &cfg(&["http://a:1", "http://b:1"]),
            2,
            Duration::from_secs(60),
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let c = pool.candidates("x");
        assert!(!pool.record_failure(&c[0]));
        assert!(pool.record_failure(&c[0]));
        assert_eq!(pool.candidates("x")[0].url, c[1].url);
        pool.record_success(&c[0]);
        assert_eq!(pool.candidates("x")[0].url, c[0].url);
    }
}
