//! Prometheus text-format metrics, kept in atomics (no locks on the hot path
//! except the rarely-written error-kind map).

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

use crate::store::{StoreStats, COMMIT_BUCKETS_MS};

const LATENCY_BUCKETS_S: [f64; 14] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0,
];

#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; 15],
    sum_us: AtomicU64,
    count: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, seconds: f64) {
        let i = LATENCY_BUCKETS_S
            .iter()
            .position(|ub| seconds <= *ub)
            .unwrap_or(LATENCY_BUCKETS_S.len());
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
        self.sum_us
            .fetch_add((seconds.max(0.0) * 1e6) as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (i, ub) in LATENCY_BUCKETS_S.iter().enumerate() {
            cum += self.buckets[i].load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{ub}\"}} {cum}");
        }
        cum += self.buckets[LATENCY_BUCKETS_S.len()].load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cum}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {}", self.count.load(Ordering::Relaxed));
    }
}

#[derive(Debug, Default)]
pub struct Metrics {
    pub http_requests: AtomicU64,
    pub proxied_calls: AtomicU64,
    pub in_flight: AtomicI64,
    pub calls_ok: AtomicU64,
    pub calls_upstream_error: AtomicU64,
    pub calls_aborted: AtomicU64,
    /// Calls answered although the store could not record them (`on_store_failure = "serve"`).
    pub calls_unrecorded: AtomicU64,
    pub flagged_calls: AtomicU64,
    pub retries: AtomicU64,
    pub upstream_latency: Histogram,
    pub added_latency: Histogram,
    errors: Mutex<BTreeMap<&'static str, u64>>,
}

impl Metrics {
    pub fn error(&self, code: &'static str) {
        if let Ok(mut m) = self.errors.lock() {
            *m.entry(code).or_insert(0) += 1;
        }
    }

    pub fn render(&self, store: &StoreStats, paused: bool, weight_version: u64) -> String {
        let mut o = String::with_capacity(4096);
        let c = |o: &mut String, name: &str, help: &str, kind: &str, v: String| {
            let _ = writeln!(o, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        };
        c(
            &mut o,
            "lightning_http_requests_total",
            "HTTP requests received.",
            "counter",
            self.http_requests.load(Ordering::Relaxed).to_string(),
        );
        c(
            &mut o,
            "lightning_proxied_calls_total",
            "Proxied model calls started.",
            "counter",
            self.proxied_calls.load(Ordering::Relaxed).to_string(),
        );
        c(
            &mut o,
            "lightning_in_flight_calls",
            "Proxied calls in flight.",
            "gauge",
            self.in_flight.load(Ordering::Relaxed).to_string(),
        );
        let _ = writeln!(o, "# HELP lightning_recorded_calls_total Calls recorded, by status.\n# TYPE lightning_recorded_calls_total counter");
        for (s, v) in [
            ("ok", &self.calls_ok),
            ("upstream_error", &self.calls_upstream_error),
            ("aborted", &self.calls_aborted),
        ] {
            let _ = writeln!(
                o,
                "lightning_recorded_calls_total{{status=\"{s}\"}} {}",
                v.load(Ordering::Relaxed)
            );
        }
        c(
            &mut o,
            "lightning_unrecorded_calls_total",
            "Calls served although the store could not write them (on_store_failure = serve).",
            "counter",
            self.calls_unrecorded.load(Ordering::Relaxed).to_string(),
        );
        c(
            &mut o,
            "lightning_flagged_calls_total",
            "Recorded calls carrying consistency flags.",
            "counter",
            self.flagged_calls.load(Ordering::Relaxed).to_string(),
        );
        c(
            &mut o,
            "lightning_upstream_retries_total",
            "Upstream attempts retried.",
            "counter",
            self.retries.load(Ordering::Relaxed).to_string(),
        );
        let _ = writeln!(o, "# HELP lightning_errors_total Errors answered by the gateway, by code.\n# TYPE lightning_errors_total counter");
        if let Ok(m) = self.errors.lock() {
            for (k, v) in m.iter() {
                let _ = writeln!(o, "lightning_errors_total{{code=\"{k}\"}} {v}");
            }
        }
        self.upstream_latency.render(
            &mut o,
            "lightning_upstream_latency_seconds",
            "Time from sending to the upstream until its answer ended.",
        );
        self.added_latency.render(
            &mut o,
            "lightning_added_latency_seconds",
            "Gateway time per call beyond the upstream's (parsing, recording, commit).",
        );
        c(
            &mut o,
            "lightning_store_queue_depth",
            "Writes waiting for the store writer.",
            "gauge",
            store.queue_depth.load(Ordering::Relaxed).to_string(),
        );
        c(
            &mut o,
            "lightning_store_commits_total",
            "Group commits.",
            "counter",
            store.commits.load(Ordering::Relaxed).to_string(),
        );
        c(
            &mut o,
            "lightning_store_committed_writes_total",
            "Writes committed.",
            "counter",
            store.committed_ops.load(Ordering::Relaxed).to_string(),
        );
        let _ = writeln!(o, "# HELP lightning_store_commit_seconds Group commit duration.\n# TYPE lightning_store_commit_seconds histogram");
        let mut cum = 0;
        for (i, ub) in COMMIT_BUCKETS_MS.iter().enumerate() {
            cum += store.commit_buckets[i].load(Ordering::Relaxed);
            let le = if ub.is_finite() {
                format!("{}", ub / 1000.0)
            } else {
                "+Inf".to_string()
            };
            let _ = writeln!(
                o,
                "lightning_store_commit_seconds_bucket{{le=\"{le}\"}} {cum}"
            );
        }
        let _ = writeln!(
            o,
            "lightning_store_commit_seconds_sum {}",
            store.commit_us_total.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(
            o,
            "lightning_store_commit_seconds_count {}",
            store.commits.load(Ordering::Relaxed)
        );
        c(
            &mut o,
            "lightning_store_writable",
            "0 while the store cannot write (disk full or file unwritable).",
            "gauge",
            (store.health.writable() as u8).to_string(),
        );
        c(
            &mut o,
            "lightning_paused",
            "1 while paused for weight sync.",
            "gauge",
            (paused as u8).to_string(),
        );
        c(
            &mut o,
            "lightning_weight_version",
            "Highest weight version served by the upstreams.",
            "gauge",
            weight_version.to_string(),
        );
        o
    }
}
