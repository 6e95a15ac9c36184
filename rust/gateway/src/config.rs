//! Gateway configuration: TOML file, command line, or JSON from Python (the
//! same serde model for all three).

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use crate::error::GatewayError;

/// `http://host:port/prefix` split for request building.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BaseUrl {
    pub authority: String,
    /// Path prefix without a trailing slash (e.g. `/v1`).
    pub prefix: String,
}

pub fn parse_base_url(url: &str) -> Result<BaseUrl, String> {
    let rest = url.strip_prefix("http://").ok_or_else(|| {
        format!("upstream URL {url:?} must start with http:// (TLS upstreams are not supported; put the engine on a local address)")
    })?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    if authority.is_empty() {
        return Err(format!("upstream URL {url:?} has no host"));
    }
    Ok(BaseUrl {
        authority: authority.to_string(),
        prefix: path.trim_end_matches('/').to_string(),
    })
}

/// Which wire dialect an upstream speaks; decides how ids are requested and read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// vLLM (and the lightning engine): `return_token_ids`, `prompt_token_ids`, `token_ids`.
    #[default]
    Vllm,
    /// SGLang's OpenAI endpoints (same field names as vLLM where it returns ids).
    Sglang,
    /// Any other OpenAI-compatible server: no ids; calls are recorded with text and flagged.
    Openai,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL including the API prefix, e.g. `http://127.0.0.1:8000/v1`.
    pub url: String,
    /// Weight version the engine behind this URL serves; recorded on every call.
    #[serde(default)]
    pub weight_version: u64,
    #[serde(default)]
    pub engine: Engine,
}

/// How hard a commit pushes to disk. `full` fsyncs the WAL on every group
/// commit (survives power loss); `normal` survives a killed process only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    #[default]
    Full,
    Normal,
}

/// What the gateway does while its store cannot write (disk full, file
/// unwritable): `refuse` answers new proxied calls 503 (a call it cannot
/// record is never served); `serve` keeps serving them unrecorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum StoreFailure {
    #[default]
    Refuse,
    Serve,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// `host:port` to listen on; port 0 picks a free port.
    pub listen: String,
    pub upstreams: Vec<UpstreamConfig>,
    /// SQLite file of the trace store.
    pub db: PathBuf,
    /// Guards rollout creation and `/admin/*`. Required unless `insecure_local`.
    pub admin_key: Option<String>,
    /// Run without an admin key (admin routes open to anyone who can connect);
    /// accepted only with a loopback `listen` address, for a single-user machine.
    pub insecure_local: bool,
    /// Base URL handed to harnesses in `POST /rollouts`; defaults to `http://{listen}`.
    pub public_url: Option<String>,
    /// Largest accepted request body (413 above).
    pub max_body_bytes: usize,
    /// Largest engine answer read for one call (a whole body, or all of a
    /// stream's bytes, so also any one SSE event): above it the call fails
    /// with a 502 / the stream's error event and is recorded as an upstream error.
    pub max_upstream_answer_bytes: usize,
    /// Harness calls in flight at once, all rollouts together (429 above).
    pub max_concurrent_calls: usize,
    /// Harness calls in flight at once on one rollout (one application key
    /// in online mode); 429 above.
    pub max_calls_per_rollout: usize,
    /// Largest SSE event accepted from an engine; a bigger one ends the
    /// stream with an error event and the call is recorded `upstream_error`.
    pub max_sse_event_bytes: usize,
    /// Seconds a connection may take to deliver a complete request head,
    /// counted from when it is ready for a request (accepted, or the previous
    /// answer sent): it also closes keep-alive connections idle that long.
    pub header_read_timeout_s: f64,
    /// Longest silence, seconds, from a client in the middle of sending a
    /// request body (408 after it).
    pub idle_timeout_s: f64,
    /// `POST /rollouts` requests accepted in any 60-second window (429 above).
    pub max_rollouts_per_minute: usize,
    /// Whole-request timeout for one upstream attempt, seconds.
    pub upstream_timeout_s: f64,
    /// Retries of connect errors, 429 and 5xx, only before any byte reached the harness.
    pub max_retries: u32,
    /// Base of the jittered exponential backoff, milliseconds.
    pub retry_base_ms: u64,
    /// Consecutive failures after which an upstream is marked down.
    pub mark_down_after: u32,
    /// How long a marked-down upstream is skipped before it is tried again, seconds.
    pub down_for_s: f64,
    /// Bearer key sent to upstreams (never the rollout token).
    pub upstream_api_key: Option<String>,
    /// Temperature forced on train-mode calls (None: the harness's own).
    pub train_temperature: Option<f64>,
    /// Temperature forced on eval-mode calls (None: the harness's own).
    pub eval_temperature: Option<f64>,
    /// Whether eval-mode calls ask the engine for ids and logprobs.
    pub eval_capture: bool,
    pub sync: SyncMode,
    /// While the store cannot write: refuse new proxied calls (503) or serve them unrecorded.
    pub on_store_failure: StoreFailure,
    /// Seconds graceful shutdown waits for in-flight calls.
    pub drain_timeout_s: f64,
    /// Longest time, seconds, a client may take to send a whole request
    /// body, however steadily it trickles (408 after it).
    pub body_timeout_s: f64,
    /// Most answers one request may ask for (`n`, `best_of`); 400 above.
    pub max_n: u64,
    /// Most tokens one answer may ask for (`max_tokens`,
    /// `max_completion_tokens`, `max_output_tokens`); 400 above.
    pub max_output_tokens: u64,
    /// Most alternatives per token a request may ask for (`top_logprobs`,
    /// completions' `logprobs`); 400 above.
    pub max_top_logprobs: u64,
    /// Online mode: sessions, idle closing, retention (`[online]`).
    pub online: crate::online::OnlineConfig,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: "127.0.0.1:8080".into(),
            upstreams: Vec::new(),
            db: PathBuf::from("lightning.db"),
            admin_key: None,
            insecure_local: false,
            public_url: None,
            max_body_bytes: 32 * 1024 * 1024,
            max_upstream_answer_bytes: 256 * 1024 * 1024,
            max_concurrent_calls: 4096,
            max_calls_per_rollout: 256,
            max_sse_event_bytes: 16 * 1024 * 1024,
            header_read_timeout_s: 30.0,
            idle_timeout_s: 60.0,
            max_rollouts_per_minute: 10_000,
            upstream_timeout_s: 600.0,
            max_retries: 2,
            retry_base_ms: 50,
            mark_down_after: 3,
            down_for_s: 5.0,
            upstream_api_key: None,
            train_temperature: None,
            eval_temperature: None,
            eval_capture: true,
            sync: SyncMode::Full,
            on_store_failure: StoreFailure::Refuse,
            drain_timeout_s: 30.0,
            body_timeout_s: 300.0,
            max_n: 16,
            max_output_tokens: 262_144,
            max_top_logprobs: 20,
            online: Default::default(),
        }
    }
}

impl Config {
    pub fn from_toml(text: &str) -> Result<Self, GatewayError> {
        toml::from_str(text).map_err(|e| GatewayError::Config(format!("bad TOML: {e}")))
    }

    pub fn from_json(text: &str) -> Result<Self, GatewayError> {
        serde_json::from_str(text).map_err(|e| GatewayError::Config(format!("bad JSON: {e}")))
    }

    /// Checks values a server cannot run with; messages name the field and the fix.
    pub fn validate(&self) -> Result<(), GatewayError> {
        match self.admin_key.as_deref() {
            None | Some("") if self.insecure_local => {
                if !is_loopback_listen(&self.listen) {
                    return Err(GatewayError::Config(format!(
                        "insecure_local runs without an admin key and is only allowed on a loopback listener, not {:?}; listen on 127.0.0.1 or set admin_key",
                        self.listen
                    )));
                }
            }
            None | Some("") => {
                return Err(GatewayError::Config(
                    "admin_key is not set; pass --admin-key, set LIGHTNING_ADMIN_KEY or admin_key in the config (or --insecure-local on a loopback listener)"
                        .into(),
                ))
            }
            Some(k) if k.len() < 8 => {
                return Err(GatewayError::Config(
                    "admin_key is shorter than 8 characters; use a longer random key".into(),
                ))
            }
            Some(_) => {}
        }
        for u in &self.upstreams {
            parse_base_url(&u.url).map_err(GatewayError::Config)?;
        }
        for (name, v) in [
            ("max_body_bytes", self.max_body_bytes),
            ("max_concurrent_calls", self.max_concurrent_calls),
            ("max_calls_per_rollout", self.max_calls_per_rollout),
            ("max_sse_event_bytes", self.max_sse_event_bytes),
            ("max_rollouts_per_minute", self.max_rollouts_per_minute),
            ("max_n", self.max_n as usize),
            ("max_output_tokens", self.max_output_tokens as usize),
        ] {
            if v == 0 {
                return Err(GatewayError::Config(format!("{name} must be > 0")));
            }
        }
        for (name, v) in [
            ("upstream_timeout_s", self.upstream_timeout_s),
            ("header_read_timeout_s", self.header_read_timeout_s),
            ("idle_timeout_s", self.idle_timeout_s),
            ("body_timeout_s", self.body_timeout_s),
        ] {
            // Infinity would overflow a deadline.
            if v.is_nan() || v <= 0.0 || v.is_infinite() {
                return Err(GatewayError::Config(format!(
                    "{name} = {v} must be a finite number of seconds > 0"
                )));
            }
        }
        if self.max_upstream_answer_bytes == 0 {
            return Err(GatewayError::Config(
                "max_upstream_answer_bytes must be > 0".into(),
            ));
        }
        Ok(())
    }
}

/// Whether `host:port` binds only a loopback interface (`127.0.0.0/8`, `::1`, `localhost`).
pub fn is_loopback_listen(listen: &str) -> bool {
    let host = match listen.rsplit_once(':') {
        Some((h, _)) => h,
        None => listen,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.eq_ignore_ascii_case("localhost") {
        return true;
    }
    host.parse::<std::net::IpAddr>()
        .map(|ip| ip.is_loopback())
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyless(listen: &str, insecure_local: bool) -> Config {
        Config {
            listen: listen.into(),
            insecure_local,
            ..Config::default()
        }
    }

    #[test]
    fn empty_admin_key_needs_insecure_local_on_loopback() {
        assert!(keyless("127.0.0.1:0", false).validate().is_err());
        let mut empty = keyless("127.0.0.1:0", false);
        empty.admin_key = Some(String::new());
        assert!(empty.validate().is_err());
        for ok in ["127.0.0.1:0", "127.0.0.2:80", "[::1]:8080", "localhost:1"] {
            assert!(keyless(ok, true).validate().is_ok(), "{ok}");
        }
        for bad in ["0.0.0.0:8080", "[::]:1", "10.0.0.1:80", "example.com:80"] {
            match keyless(bad, true).validate() {
                Err(e) => assert!(e.to_string().contains("loopback"), "{bad}: {e}"),
                Ok(()) => panic!("{bad} is not loopback yet was accepted"),
            }
        }
    }

    #[test]
    fn parses_base_urls() {
        assert_eq!(
            parse_base_url("http://127.0.0.1:8000/v1/"),
            Ok(BaseUrl {
                authority: "127.0.0.1:8000".into(),
                prefix: "/v1".into()
            })
        );
        assert!(parse_base_url("https://x/v1").is_err());
        assert!(parse_base_url("http:///v1").is_err());
    }
}
