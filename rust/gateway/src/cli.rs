//! Command-line parsing shared by the `lightning-gateway` binary and the
//! `lightning-gateway` console command the Python wheel installs.

use crate::config::{Config, UpstreamConfig};

pub const USAGE: &str = "usage: lightning-gateway [--config FILE.toml] [--listen HOST:PORT] [--upstream URL[@VERSION]]... \
[--db PATH] [--sync full|normal] [--admin-key KEY] [--public-url URL] [--threads N]
The admin key may also come from $LIGHTNING_ADMIN_KEY. Logs: $RUST_LOG (default info).";

pub fn parse_args(args: &[String]) -> Result<(Config, usize), String> {
    let mut cfg = Config::default();
    let mut threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2);
    // The config file first, so flags override it.
    if let Some(i) = args.iter().position(|a| a == "--config") {
        let path = args.get(i + 1).ok_or("--config needs a file")?;
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
        cfg = Config::from_toml(&text).map_err(|e| e.to_string())?;
    }
    let mut upstreams = Vec::new();
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let val = || {
            args.get(i + 1)
                .cloned()
                .ok_or(format!("{flag} needs a value"))
        };
        match flag {
            "--config" => {}
            "--listen" => cfg.listen = val()?,
            "--db" => cfg.db = val()?.into(),
            "--admin-key" => cfg.admin_key = Some(val()?),
            "--public-url" => cfg.public_url = Some(val()?),
            "--sync" => {
                cfg.sync = match val()?.as_str() {
                    "full" => crate::config::SyncMode::Full,
                    "normal" => crate::config::SyncMode::Normal,
                    other => return Err(format!("--sync {other:?}: use full or normal")),
                }
            }
            "--threads" => threads = val()?.parse().map_err(|_| "--threads needs a number")?,
            "--upstream" => {
                let v = val()?;
                let (url, version) = match v.rsplit_once('@') {
                    Some((u, n)) if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() => {
                        (u.to_string(), n.parse().unwrap_or(0))
                    }
                    _ => (v, 0),
                };
                upstreams.push(UpstreamConfig {
                    url,
                    weight_version: version,
                    engine: Default::default(),
                });
            }
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other:?}")),
        }
        i += 2;
    }
    if !upstreams.is_empty() {
        cfg.upstreams = upstreams;
    }
    if cfg.admin_key.is_none() {
        cfg.admin_key = std::env::var("LIGHTNING_ADMIN_KEY")
            .ok()
            .filter(|k| !k.is_empty());
    }
    Ok((cfg, threads))
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
        Err(msg) => {
            if !msg.is_empty() {
                eprintln!("lightning-gateway: {msg}");
            }
            eprintln!("{USAGE}");
            return if msg.is_empty() { 0 } else { 2 };
        }
    };
    match crate::server::serve_blocking(cfg, threads) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("lightning-gateway: {e}");
            1
        }
    }
}
