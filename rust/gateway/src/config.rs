//! Gateway configuration: TOML file, command line, or JSON from Python (the
//! same serde model for all three).

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

use crate::error::GatewayError;
use crate::protocol::validate::Caps;

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
    // Every engine we forward to (vLLM, SGLang, lightning serve) serves its
    // OpenAI routes under /v1, and a bare `http://host:port` is the natural
    // thing to type: without this a harness would get 404s, retry, and fill
    // the store with `upstream_error` calls.
    let prefix = match path.trim_end_matches('/') {
        "" => "/v1",
        p => p,
    };
    Ok(BaseUrl {
        authority: authority.to_string(),
        prefix: prefix.to_string(),
    })
}

/// Which wire dialect an upstream speaks; decides how ids are requested and read.
///
/// Two dialects, not one per engine: SGLang's OpenAI endpoints take and return
/// ids under vLLM's field names, so nothing in the gateway would differ for it.
/// `engine = "sglang"` is accepted as a name for `vllm` (and reported as
/// `vllm`); give SGLang a variant of its own only once it needs different
/// handling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// vLLM, SGLang and the lightning engine: `return_token_ids`,
    /// `prompt_token_ids`, `token_ids`.
    #[default]
    #[serde(alias = "sglang")]
    Vllm,
    /// Any other OpenAI-compatible server: no ids; calls are recorded with text and flagged.
    Openai,
}

impl Engine {
    /// Every name a config may give, aliases included.
    pub const NAMES: [&'static str; 3] = ["vllm", "sglang", "openai"];
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpstreamConfig {
    /// Base URL including the API prefix, e.g. `http://127.0.0.1:8000/v1`; a
    /// bare `http://host:port` means `/v1`, where every supported engine serves.
    pub url: String,
    /// Weight version the engine behind this URL serves; recorded on every call.
    #[serde(default)]
    pub weight_version: u64,
    #[serde(default)]
    pub engine: Engine,
}

/// How hard a commit pushes to disk. `full` fsyncs the WAL on every group
/// commit (survives power loss); `normal` survives a killed process only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SyncMode {
    #[default]
    Full,
    Normal,
}

/// How the store writes a call (`store::prefix`): `shared` stores only what
/// a call adds to an earlier call of its rollout (prompt ids, request
/// bodies); `full` writes every call whole, as layout 1 did (benchmarks
/// compare the two). Readers read both.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StoreLayout {
    #[default]
    Shared,
    Full,
}

/// What the gateway does while its store cannot write (disk full, file
/// unwritable): `refuse` answers new proxied calls 503 (a call it cannot
/// record is never served); `serve` keeps serving them unrecorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum StoreFailure {
    #[default]
    Refuse,
    Serve,
}

/// The range a field's value must lie in. Python's `GatewayConfig` enforces
/// it when a config is built; `Config::validate` enforces the ones a server
/// cannot run without, and the server clamps the rest.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    Any,
    /// `> 0`.
    Positive,
    /// `> 0`, not infinite or NaN (a deadline).
    PositiveFinite,
    /// `>= 0`.
    NonNegative,
    /// `>= 1`.
    AtLeastOne,
}

/// The Python annotation of a config value, for the generated `GatewayConfig`.
pub trait FieldType {
    fn python() -> String;
}

macro_rules! python_type {
    ($($t:ty => $py:literal),* $(,)?) => {
        $(impl FieldType for $t {
            fn python() -> String {
                $py.into()
            }
        })*
    };
}
python_type!(String => "str", PathBuf => "str", bool => "bool", usize => "int", u32 => "int", u64 => "int", f64 => "float", Vec<String> => "list[str]");

impl<T: FieldType> FieldType for Option<T> {
    fn python() -> String {
        format!("{} | None", T::python())
    }
}

/// `Literal["a", "b"]` of a flag enum's values (the same names as serde's;
/// a test checks that).
fn literal<T: clap::ValueEnum>() -> String {
    let names: Vec<String> = T::value_variants()
        .iter()
        .filter_map(|v| v.to_possible_value())
        .map(|v| format!("{:?}", v.get_name()))
        .collect();
    format!("Literal[{}]", names.join(", "))
}

impl FieldType for SyncMode {
    fn python() -> String {
        literal::<Self>()
    }
}

impl FieldType for StoreLayout {
    fn python() -> String {
        literal::<Self>()
    }
}

impl FieldType for StoreFailure {
    fn python() -> String {
        literal::<Self>()
    }
}

/// One field of the config as the other languages see it (`Config::fields`).
#[derive(Debug, Clone, Serialize)]
pub struct Field {
    /// The TOML key, the JSON key and (with `-` for `_`) the flag.
    pub name: &'static str,
    pub python_type: String,
    pub default: serde_json::Value,
    /// The field's doc comment on one line: its `--help` and its Python description.
    pub doc: String,
    pub bound: Bound,
}

fn one_line(doc: &[&str]) -> String {
    doc.iter()
        .map(|l| l.trim())
        .filter(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ")
}

/// The one schema of the gateway's settings. Each field is written once, here:
/// its doc (rustdoc, `--help` and Python's description), type, default, bound
/// and flag options. From this table come the serde struct (TOML and JSON
/// keys), the clap flags (`cli.rs` overlays the given ones on the TOML file),
/// `Default`, and `Config::fields`, from which `.ci/gateway_config.py` writes
/// Python's `GatewayConfig` (a test fails when that copy drifts). A macro and
/// not a derive of our own: one table, no proc-macro crate to maintain.
///
/// The fields after `;` are sections with a shape of their own (lists,
/// tables): no flag, written by hand in Python.
macro_rules! config {
    (
        $(
            $(#[doc = $doc:literal])+
            #[arg($($arg:tt)*)]
            $name:ident: $ty:ty = $default:expr, $bound:ident;
        )*
        ;
        $(
            $(#[doc = $sdoc:literal])+
            $sname:ident: $sty:ty = $sdefault:expr;
        )*
    ) => {
        #[derive(Debug, Clone, Serialize, Deserialize, clap::Args)]
        #[serde(deny_unknown_fields, default)]
        // No `Config` argument group: the flags are plain overrides.
        #[group(skip)]
        pub struct Config {
            $(
                $(#[doc = $doc])+
                // Not required and no clap default: a flag left out leaves the
                // file's value (see `cli::parse_args`).
                #[arg(long, required = false, $($arg)*)]
                pub $name: $ty,
            )*
            $(
                $(#[doc = $sdoc])+
                #[arg(skip)]
                pub $sname: $sty,
            )*
        }

        impl Default for Config {
            fn default() -> Self {
                Config {
                    $($name: $default,)*
                    $($sname: $sdefault,)*
                }
            }
        }

        impl Config {
            /// Every field that is a flag, in order, with its default.
            pub fn fields() -> Vec<Field> {
                let d = Config::default();
                vec![$(Field {
                    name: stringify!($name),
                    python_type: <$ty as FieldType>::python(),
                    default: serde_json::to_value(&d.$name).unwrap_or(serde_json::Value::Null),
                    doc: one_line(&[$($doc),+]),
                    bound: Bound::$bound,
                }),*]
            }
        }
    };
}

// A `bool` flag takes an optional value: `--insecure-local` sets it,
// `--eval-capture false` clears one whose default is on.
config! {
    /// `host:port` to listen on; port 0 picks a free port.
    #[arg(value_name = "HOST:PORT")]
    listen: String = "127.0.0.1:8080".into(), Any;
    /// SQLite file of the trace store.
    #[arg(value_name = "PATH")]
    db: PathBuf = PathBuf::from("lightning.db"), Any;
    /// Guards rollout creation and `/admin/*`: 8 characters or more, random is
    /// best; give it as LIGHTNING_ADMIN_KEY or in the config file rather than the
    /// flag, which every user on the machine sees in `ps`. Required unless
    /// `insecure_local`.
    #[arg(env = "LIGHTNING_ADMIN_KEY", hide_env_values = true)]
    admin_key: Option<String> = None, Any;
    /// Run without an admin key (admin routes open to anyone who can connect);
    /// accepted only with a loopback `listen` address, for a single-user machine.
    #[arg(num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    insecure_local: bool = false, Any;
    /// Base URL handed to harnesses in `POST /rollouts`; defaults to `http://{listen}`.
    #[arg(value_name = "URL")]
    public_url: Option<String> = None, Any;
    /// Largest accepted request body (413 above).
    #[arg(value_name = "BYTES")]
    max_body_bytes: usize = 32 * 1024 * 1024, Positive;
    /// Largest engine answer read for one call (a whole body, or all of a
    /// stream's bytes, so also any one SSE event): above it the call fails
    /// with a 502 / the stream's error event and is recorded as an upstream error.
    #[arg(value_name = "BYTES")]
    max_upstream_answer_bytes: usize = 256 * 1024 * 1024, Positive;
    /// Harness calls in flight at once, all rollouts together (429 above).
    #[arg(value_name = "N")]
    max_concurrent_calls: usize = 4096, Positive;
    /// Harness calls in flight at once on one rollout (one application key
    /// in online mode); 429 above.
    #[arg(value_name = "N")]
    max_calls_per_rollout: usize = 256, Positive;
    /// Largest SSE event accepted from an engine; a bigger one ends the
    /// stream with an error event and the call is recorded `upstream_error`.
    #[arg(value_name = "BYTES")]
    max_sse_event_bytes: usize = 16 * 1024 * 1024, Positive;
    /// Seconds a connection may take to deliver a complete request head,
    /// counted from when it is ready for a request (accepted, or the previous
    /// answer sent): it also closes keep-alive connections idle that long.
    #[arg(value_name = "SECONDS")]
    header_read_timeout_s: f64 = 30.0, PositiveFinite;
    /// Longest silence, seconds, from a client in the middle of sending a
    /// request body (408 after it).
    #[arg(value_name = "SECONDS")]
    idle_timeout_s: f64 = 60.0, PositiveFinite;
    /// `POST /rollouts` requests accepted in any 60-second window (429 above).
    #[arg(value_name = "N")]
    max_rollouts_per_minute: usize = 10_000, Positive;
    /// Whole-request timeout for one upstream attempt, seconds.
    #[arg(value_name = "SECONDS")]
    upstream_timeout_s: f64 = 600.0, PositiveFinite;
    /// Retries of connect errors, 429 and 5xx, only before any byte reached the harness.
    #[arg(value_name = "N")]
    max_retries: u32 = 2, NonNegative;
    /// Base of the jittered exponential backoff, milliseconds.
    #[arg(value_name = "MS")]
    retry_base_ms: u64 = 50, AtLeastOne;
    /// Consecutive failures after which an upstream is marked down.
    #[arg(value_name = "N")]
    mark_down_after: u32 = 3, AtLeastOne;
    /// How long a marked-down upstream is skipped before it is tried again, seconds.
    #[arg(value_name = "SECONDS")]
    down_for_s: f64 = 5.0, NonNegative;
    /// File holding the secret rollout tokens derive from (not readable by
    /// every user). Without it: `LIGHTNING_TOKEN_SECRET` if set, else
    /// `<db>.secret`, made 0600 on first start. Never kept in the store.
    #[arg(value_name = "PATH")]
    token_secret_file: Option<PathBuf> = None, Any;
    /// Bearer key sent to upstreams (never the rollout token).
    #[arg(value_name = "KEY")]
    upstream_api_key: Option<String> = None, Any;
    /// Temperature forced on train-mode calls (None: the harness's own).
    #[arg(value_name = "T")]
    train_temperature: Option<f64> = None, Any;
    /// Temperature forced on eval-mode calls (None: the harness's own).
    #[arg(value_name = "T")]
    eval_temperature: Option<f64> = None, Any;
    /// Whether eval-mode calls ask the engine for ids and logprobs.
    #[arg(num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set)]
    eval_capture: bool = true, Any;
    /// `full` fsyncs the WAL on every group commit (survives power loss);
    /// `normal` survives a killed process only.
    #[arg(value_enum)]
    sync: SyncMode = SyncMode::Full, Any;
    /// `shared` stores only what a call adds to an earlier call of its
    /// rollout (prompt ids, request bodies); `full` writes every call whole.
    #[arg(value_enum)]
    store_layout: StoreLayout = StoreLayout::Shared, Any;
    /// While the store cannot write: refuse new proxied calls (503) or serve them unrecorded.
    #[arg(value_enum)]
    on_store_failure: StoreFailure = StoreFailure::Refuse, Any;
    /// Seconds graceful shutdown waits for in-flight calls.
    #[arg(value_name = "SECONDS")]
    drain_timeout_s: f64 = 30.0, NonNegative;
    /// Longest time, seconds, a client may take to send a whole request
    /// body, however steadily it trickles (408 after it).
    #[arg(value_name = "SECONDS")]
    body_timeout_s: f64 = 300.0, PositiveFinite;
    /// Most answers one request may ask for (`n`, `best_of`); 400 above.
    #[arg(value_name = "N")]
    max_n: u64 = 16, AtLeastOne;
    /// Most tokens one answer may ask for (`max_tokens`,
    /// `max_completion_tokens`, `max_output_tokens`); 400 above.
    #[arg(value_name = "N")]
    max_output_tokens: u64 = 262_144, AtLeastOne;
    /// Most alternatives per token a request may ask for (`top_logprobs`,
    /// completions' `logprobs`); 400 above.
    #[arg(value_name = "N")]
    max_top_logprobs: u64 = 20, NonNegative;
    /// Names a request may give in `Host` besides localhost, loopback
    /// addresses, the listen address, the address a connection reached and
    /// `public_url`'s host (others get 403: a page of another site can point
    /// its name at this machine). `*` serves any name. On the command line
    /// `--allowed-host NAME` (repeatable) or LIGHTNING_ALLOWED_HOSTS=a,b.
    #[arg(value_name = "NAME", visible_alias = "allowed-host", env = "LIGHTNING_ALLOWED_HOSTS", value_delimiter = ',')]
    allowed_hosts: Vec<String> = Vec::new(), Any;
    ;
    /// Engines behind the gateway (`[[upstreams]]`; on the command line
    /// `--upstream URL[@VERSION]`).
    upstreams: Vec<UpstreamConfig> = Vec::new();
    /// Online mode: sessions, idle closing, retention (`[online]`).
    online: OnlineConfig = Default::default();
}

impl Config {
    /// The request sizes the door lets through (`max_n`, `max_output_tokens`,
    /// `max_top_logprobs`); built here because config sits above protocol.
    pub fn caps(&self) -> Caps {
        Caps {
            n: self.max_n,
            output_tokens: self.max_output_tokens,
            top_logprobs: self.max_top_logprobs,
        }
    }

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
        let (lo, hi) = (self.online.feedback_min, self.online.feedback_max);
        if !(lo.is_finite() && hi.is_finite() && lo <= hi) {
            return Err(GatewayError::Config(format!(
                "[online] feedback_min = {lo} and feedback_max = {hi} must be finite numbers with feedback_min <= feedback_max"
            )));
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

/// The `[online]` section of the gateway config.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OnlineConfig {
    /// How long after a session's last call a continuing prompt may still join it, seconds.
    pub session_window_s: f64,
    /// A session with no call for this long is closed, seconds.
    pub idle_timeout_s: f64,
    /// Delete closed online sessions whose last call is older than this many days.
    pub retention_days: Option<f64>,
    /// Delete the oldest closed online sessions while their stored bytes exceed this.
    pub retention_bytes: Option<u64>,
    /// How often the background sweep (idle closing, retention) runs, seconds.
    pub sweep_interval_s: f64,
    /// Smallest feedback `value` accepted (400 below). Values become rewards
    /// (the mean, sum or weighted sum of a session's signals): a bound keeps
    /// those and their statistics finite. `POST /rollouts/{id}/reward` takes
    /// the same range.
    pub feedback_min: f64,
    /// Largest feedback `value` accepted (400 above).
    pub feedback_max: f64,
}

impl Default for OnlineConfig {
    fn default() -> Self {
        OnlineConfig {
            session_window_s: 3600.0,
            idle_timeout_s: 1800.0,
            retention_days: None,
            retention_bytes: None,
            sweep_interval_s: 60.0,
            feedback_min: -1e6,
            feedback_max: 1e6,
        }
    }
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
    fn sglang_is_a_name_for_the_vllm_wire() {
        let cfg = Config::from_toml("[[upstreams]]\nurl = \"http://a/v1\"\nengine = \"sglang\"\n")
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.upstreams[0].engine, Engine::Vllm);
        for name in Engine::NAMES {
            let e: Result<Engine, _> = serde_json::from_value(serde_json::json!(name));
            assert!(e.is_ok(), "{name}");
        }
    }

    #[test]
    fn fields_are_the_serde_fields_and_flag_values_are_serde_names() {
        let defaults = serde_json::to_value(Config::default()).unwrap_or_default();
        let mut keys: Vec<&str> = defaults
            .as_object()
            .map(|o| o.keys().map(|k| k.as_str()).collect())
            .unwrap_or_default();
        keys.retain(|k| !matches!(*k, "upstreams" | "online"));
        let fields: Vec<&str> = Config::fields().iter().map(|f| f.name).collect();
        assert_eq!(fields, keys);
        for f in Config::fields() {
            assert_eq!(defaults[f.name], f.default, "{}", f.name);
        }
        fn same<T: clap::ValueEnum + Serialize>() {
            for v in T::value_variants() {
                let name = v.to_possible_value().map(|p| p.get_name().to_string());
                assert_eq!(
                    serde_json::to_value(v).ok(),
                    name.map(serde_json::Value::from)
                );
            }
        }
        same::<SyncMode>();
        same::<StoreFailure>();
        same::<StoreLayout>();
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
        // A bare host means the engines' usual /v1.
        for bare in ["http://127.0.0.1:8000", "http://127.0.0.1:8000/"] {
            assert_eq!(
                parse_base_url(bare).map(|b| b.prefix),
                Ok("/v1".to_string())
            );
        }
        assert_eq!(
            parse_base_url("http://h/api/v2").map(|b| b.prefix),
            Ok("/api/v2".to_string())
        );
        assert!(parse_base_url("https://x/v1").is_err());
        assert!(parse_base_url("http:///v1").is_err());
    }
}
