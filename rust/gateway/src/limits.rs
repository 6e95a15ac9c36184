//! Resource limits on what clients can make the gateway hold: harness calls in
//! flight (overall and per rollout) and rollouts created per minute. Over a
//! limit the caller gets a 429 with `Retry-After` before anything reaches the
//! engine or the store. (Body size, SSE event size and the connection
//! timeouts are enforced where the bytes are read: `http`, `wire::sse`,
//! `routes`.)

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::config::Config;
use crate::error::ApiError;

const WINDOW: Duration = Duration::from_secs(60);

#[derive(Debug)]
pub struct Limits {
    max_calls: usize,
    max_per_rollout: usize,
    max_creations: usize,
    calls: AtomicUsize,
    per_rollout: Mutex<HashMap<String, usize>>,
    /// When each `POST /rollouts` of the last minute was accepted, oldest first.
    creations: Mutex<VecDeque<Instant>>,
}

/// One admitted harness call; dropping it frees its place in both counts.
#[derive(Debug)]
pub struct CallPermit {
    limits: Arc<Limits>,
    rollout: String,
}

fn too_many(code: &'static str, message: String, retry_after: u64) -> ApiError {
    let mut e = ApiError::new(429, "rate_limit_error", code, message);
    e.retry_after = Some(retry_after);
    e
}

impl Limits {
    pub fn new(cfg: &Config) -> Self {
        Limits {
            max_calls: cfg.max_concurrent_calls,
            max_per_rollout: cfg.max_calls_per_rollout,
            max_creations: cfg.max_rollouts_per_minute,
            calls: AtomicUsize::new(0),
            per_rollout: Mutex::new(HashMap::new()),
            creations: Mutex::new(VecDeque::new()),
        }
    }

    /// Admits one harness call on `rollout`, or refuses it with a 429 naming
    /// the limit it hit (the rollout's own first).
    pub fn admit_call(self: &Arc<Self>, rollout: &str) -> Result<CallPermit, ApiError> {
        let mut m = self.per_rollout.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(rollout.to_string()).or_insert(0);
        if *n >= self.max_per_rollout {
            // Online calls run under `online:key-…`: their caller knows a key, not a rollout.
            let whose = if rollout.starts_with("online:") {
                "this application key"
            } else {
                "this rollout"
            };
            return Err(too_many(
                "too_many_calls",
                format!(
                    "{whose} already has {} calls in flight (max_calls_per_rollout); wait for one to finish",
                    self.max_per_rollout
                ),
                1,
            ));
        }
        let admitted = self
            .calls
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |c| {
                (c < self.max_calls).then_some(c + 1)
            });
        if admitted.is_err() {
            if *n == 0 {
                m.remove(rollout);
            }
            return Err(too_many(
                "too_many_calls",
                format!(
                    "the gateway already has {} calls in flight (max_concurrent_calls); retry after the Retry-After seconds",
                    self.max_calls
                ),
                1,
            ));
        }
        *n += 1;
        Ok(CallPermit {
            limits: self.clone(),
            rollout: rollout.to_string(),
        })
    }

    /// Counts one `POST /rollouts`, or refuses it with a 429 whose
    /// `Retry-After` is when the oldest creation of the window expires.
    pub fn admit_rollout(&self) -> Result<(), ApiError> {
        let now = Instant::now();
        let mut q = self.creations.lock().unwrap_or_else(|p| p.into_inner());
        while q.front().is_some_and(|t| now.duration_since(*t) >= WINDOW) {
            q.pop_front();
        }
        if q.len() >= self.max_creations {
            let wait = q
                .front()
                .map(|t| WINDOW.saturating_sub(now.duration_since(*t)))
                .unwrap_or(WINDOW);
            return Err(too_many(
                "too_many_rollouts",
                format!(
                    "more than {} rollouts created in the last minute (max_rollouts_per_minute); retry after the Retry-After seconds",
                    self.max_creations
                ),
                wait.as_secs_f64().ceil().max(1.0) as u64,
            ));
        }
        q.push_back(now);
        Ok(())
    }

    /// Calls in flight now (for tests and metrics).
    pub fn calls_in_flight(&self) -> usize {
        self.calls.load(Ordering::Acquire)
    }
}

impl Drop for CallPermit {
    fn drop(&mut self) {
        let l = &self.limits;
        {
            let mut m = l.per_rollout.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(n) = m.get_mut(&self.rollout) {
                *n -= 1;
                if *n == 0 {
                    m.remove(&self.rollout);
                }
            }
        }
        l.calls.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(calls: usize, per_rollout: usize, creations: usize) -> Arc<Limits> {
        Arc::new(Limits::new(&Config {
            max_concurrent_calls: calls,
            max_calls_per_rollout: per_rollout,
            max_rollouts_per_minute: creations,
            ..Config::default()
        }))
    }

    #[test]
    fn calls_are_limited_per_rollout_and_overall_and_freed_on_drop() {
        let l = limits(3, 2, 1);
        let a1 = l.admit_call("a");
        let a2 = l.admit_call("a");
        assert!(a1.is_ok() && a2.is_ok());
        let e = l.admit_call("a").err().map(|e| (e.status, e.retry_after));
        assert_eq!(e, Some((429, Some(1))));
        let b1 = l.admit_call("b");
        assert!(b1.is_ok());
        assert!(l.admit_call("c").is_err(), "overall limit");
        assert_eq!(l.calls_in_flight(), 3);
        drop(a1);
        assert!(l.admit_call("c").is_ok(), "a freed place is reusable");
        drop((a2, b1));
        assert_eq!(l.calls_in_flight(), 0);
        assert!(l.per_rollout.lock().map(|m| m.is_empty()).unwrap_or(false));
    }

    #[test]
    fn rollout_creations_are_limited_per_window() {
        let l = limits(1, 1, 2);
        assert!(l.admit_rollout().is_ok() && l.admit_rollout().is_ok());
        match l.admit_rollout() {
            Err(e) => {
                assert_eq!(e.status, 429);
                assert!(matches!(e.retry_after, Some(s) if (1..=60).contains(&s)));
            }
            Ok(()) => panic!("a third creation within a minute was admitted"),
        }
    }
}
