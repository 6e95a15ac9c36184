//! Command-line parsing (`clap`) shared by the `lightning-gateway` binary and
//! the `lightning-gateway` console command the Python wheel installs.

use clap::Parser;
use std::path::PathBuf;

use crate::config::{Config, SyncMode, UpstreamConfig};

/// The recording gateway: harnesses call `/rollouts/{id}/v1/...` (OpenAI chat,
/// completions, Responses) and every call is stored with exact token ids.
#[derive(Debug, Parser)]
#[command(
    name = "lightning-gateway",
    version,
    about,
    after_help = "Logs: $RUST_LOG (default info)."
)]
pub struct Args {
    /// TOML config file; flags given on the command line override it.
    #[arg(long, value_name = "FILE.toml")]
    pub config: Option<PathBuf>,
    /// Address to listen on (port 0 picks a free port).
    #[arg(long, value_name = "HOST:PORT")]
    pub listen: Option<String>,
    /// Engine base URL with its API prefix, optionally `@VERSION` (weight version); repeatable.
    #[arg(long = "upstream", value_name = "URL[@VERSION]")]
    pub upstreams: Vec<String>,
    /// SQLite file of the trace store.
    #[arg(long, value_name = "PATH")]
    pub db: Option<PathBuf>,
    /// `full` fsyncs every group commit; `normal` survives a killed process only.
    #[arg(long, value_enum)]
    pub sync: Option<SyncArg>,
    /// Guards rollout creation and /admin routes.
    #[arg(long, env = "LIGHTNING_ADMIN_KEY", hide_env_values = true)]
    pub admin_key: Option<String>,
    /// Run without an admin key (admin routes open); only on a loopback --listen.
    #[arg(long)]
    pub insecure_local: bool,
    /// Base URL handed to harnesses in `POST /rollouts`.
    #[arg(long, value_name = "URL")]
    pub public_url: Option<String>,
    /// Tokio worker threads (default: the number of CPUs).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Largest request body (413 above).
    #[arg(long, value_name = "BYTES")]
    pub max_body_bytes: Option<usize>,
    /// Harness calls in flight at once, all rollouts together (429 above).
    #[arg(long, value_name = "N")]
    pub max_concurrent_calls: Option<usize>,
    /// Harness calls in flight at once on one rollout (429 above).
    #[arg(long, value_name = "N")]
    pub max_calls_per_rollout: Option<usize>,
    /// Largest SSE event accepted from an engine.
    #[arg(long, value_name = "BYTES")]
    pub max_sse_event_bytes: Option<usize>,
    /// Seconds to deliver a request head (also closes idle keep-alive connections).
    #[arg(long, value_name = "SECONDS")]
    pub header_read_timeout_s: Option<f64>,
    /// Longest client silence mid-request-body, seconds (408 after it).
    #[arg(long, value_name = "SECONDS")]
    pub idle_timeout_s: Option<f64>,
    /// `POST /rollouts` requests accepted per minute (429 above).
    #[arg(long, value_name = "N")]
    pub max_rollouts_per_minute: Option<usize>,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
pub enum SyncArg {
    Full,
    Normal,
}

/// `URL@N` → (URL, N); a trailing `@` part that is not a number stays in the URL.
fn upstream(v: &str) -> UpstreamConfig {
    let (url, version) = match v.rsplit_once('@') {
        Some((u, n)) if !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) => {
            (u.to_string(), n.parse().unwrap_or(0))
        }
        _ => (v.to_string(), 0),
    };
    UpstreamConfig {
        url,
        weight_version: version,
        engine: Default::default(),
    }
}

impl Args {
    /// The config this command line asks for: the file first, then the flags over it.
    pub fn into_config(self) -> Result<(Config, usize), String> {
        let mut cfg = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                Config::from_toml(&text).map_err(|e| e.to_string())?
            }
            None => Config::default(),
        };
        if let Some(l) = self.listen {
            cfg.listen = l;
        }
        if let Some(db) = self.db {
            cfg.db = db;
        }
        if let Some(s) = self.sync {
            cfg.sync = match s {
                SyncArg::Full => SyncMode::Full,
                SyncArg::Normal => SyncMode::Normal,
            };
        }
        if let Some(k) = self.admin_key.filter(|k| !k.is_empty()) {
            cfg.admin_key = Some(k);
        }
        if self.insecure_local {
            cfg.insecure_local = true;
        }
        if let Some(u) = self.public_url {
            cfg.public_url = Some(u);
        }
        let limits = [
            (self.max_body_bytes, &mut cfg.max_body_bytes),
            (self.max_concurrent_calls, &mut cfg.max_concurrent_calls),
            (self.max_calls_per_rollout, &mut cfg.max_calls_per_rollout),
            (self.max_sse_event_bytes, &mut cfg.max_sse_event_bytes),
            (
                self.max_rollouts_per_minute,
                &mut cfg.max_rollouts_per_minute,
            ),
        ];
        for (flag, field) in limits {
            if let Some(v) = flag {
                *field = v;
            }
        }
        if let Some(v) = self.header_read_timeout_s {
            cfg.header_read_timeout_s = v;
        }
        if let Some(v) = self.idle_timeout_s {
            cfg.idle_timeout_s = v;
        }
        if !self.upstreams.is_empty() {
            cfg.upstreams = self.upstreams.iter().map(|u| upstream(u)).collect();
        }
        let threads = self.threads.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(2)
        });
        Ok((cfg, threads))
    }
}

/// Parses `args` (without the program name). `Err` carries clap's own error,
/// which also renders `--help` and `--version`.
pub fn parse_args(args: &[String]) -> Result<(Config, usize), clap::Error> {
    let argv = std::iter::once("lightning-gateway".to_string()).chain(args.iter().cloned());
    let parsed = Args::try_parse_from(argv)?;
    parsed
        .into_config()
        .map_err(|msg| clap::Error::raw(clap::error::ErrorKind::ValueValidation, msg + "\n"))
}

/// Structured logs to stderr, filtered by `RUST_LOG` (default `info`). Safe to
/// call twice: a second call leaves the first subscriber in place.
pub fn init_logging() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_target(false)
        .with_writer(std::io::stderr)
        .try_init();
}

/// Parses `args` (without the program name), installs logging and serves until
/// SIGINT/SIGTERM. Returns the process exit code.
pub fn main_with_args(args: &[String]) -> i32 {
    init_logging();
    let (cfg, threads) = match parse_args(args) {
        Ok(x) => x,
        Err(e) => {
            let _ = e.print();
            return e.exit_code();
        }
    };
    match crate::routes::serve_blocking(cfg, threads) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("lightning-gateway: {e}");
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(a: &[&str]) -> Vec<String> {
        a.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn flags_fill_the_config() {
        let (cfg, threads) = parse_args(&args(&[
            "--listen",
            "127.0.0.1:0",
            "--upstream",
            "http://a:1/v1@3",
            "--upstream",
            "http://b:1/v1",
            "--sync",
            "normal",
            "--admin-key",
            "k12345678",
            "--threads",
            "1",
            "--max-calls-per-rollout",
            "3",
            "--idle-timeout-s",
            "2.5",
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(cfg.max_calls_per_rollout, 3);
        assert_eq!(cfg.idle_timeout_s, 2.5);
        assert_eq!(
            cfg.max_concurrent_calls,
            Config::default().max_concurrent_calls
        );
        assert_eq!(cfg.listen, "127.0.0.1:0");
        assert_eq!(cfg.upstreams.len(), 2);
        assert_eq!(cfg.upstreams[0].url, "http://a:1/v1");
        assert_eq!(cfg.upstreams[0].weight_version, 3);
        assert_eq!(cfg.upstreams[1].weight_version, 0);
        assert_eq!(cfg.sync, SyncMode::Normal);
        assert_eq!(threads, 1);
    }

    #[test]
    fn unknown_flags_and_bad_values_are_errors() {
        assert!(parse_args(&args(&["--bogus"])).is_err());
        assert!(parse_args(&args(&["--sync", "sometimes"])).is_err());
        assert!(parse_args(&args(&["--threads", "x"])).is_err());
    }
}
