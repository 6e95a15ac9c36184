//! Command-line parsing (`clap`) shared by the `lightning-gateway` binary and
//! the `lightning-gateway` console command the Python wheel installs.

use clap::{Args as _, CommandFactory, FromArgMatches, Parser};
use std::path::PathBuf;

use crate::config::{Config, UpstreamConfig};

/// The recording gateway: harnesses call `/rollouts/{id}/v1/...` (OpenAI chat
/// completions, completions, Responses, Anthropic Messages) and every call is
/// stored with exact token ids.
///
/// Every config field is also a flag; flags override the `--config` file.
// The flags declared here are the ones that are not config fields; the config
// fields come from `Config`'s clap derive, added in `command`.
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
    /// Engine base URL with its API prefix, optionally `@VERSION` (weight version); repeatable.
    #[arg(long = "upstream", value_name = "URL[@VERSION]")]
    pub upstreams: Vec<String>,
    /// Tokio worker threads (default: the number of CPUs).
    #[arg(long)]
    pub threads: Option<usize>,
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

/// The whole command line: `Args` and one flag per config field.
pub fn command() -> clap::Command {
    Config::augment_args(Args::command())
}

/// Parses `args` (without the program name): the config file first, then the
/// flags given over it. `Err` carries clap's own error, which also renders
/// `--help` and `--version`.
pub fn parse_args(args: &[String]) -> Result<(Config, usize), clap::Error> {
    let argv = std::iter::once("lightning-gateway".to_string()).chain(args.iter().cloned());
    let mut matches = command().try_get_matches_from(argv)?;
    let own = Args::from_arg_matches_mut(&mut matches)?;
    let invalid =
        |msg: String| clap::Error::raw(clap::error::ErrorKind::ValueValidation, msg + "\n");
    let mut cfg = match &own.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?;
            Config::from_toml(&text).map_err(|e| invalid(e.to_string()))?
        }
        None => Config::default(),
    };
    let file_admin_key = cfg.admin_key.clone();
    // Only the flags that were given (or, for the admin key, its environment
    // variable) are in `matches`: none has a clap default.
    cfg.update_from_arg_matches_mut(&mut matches)?;
    if cfg.admin_key.as_deref() == Some("") {
        // An empty LIGHTNING_ADMIN_KEY is unset, not a key.
        cfg.admin_key = file_admin_key;
    }
    if !own.upstreams.is_empty() {
        cfg.upstreams = own.upstreams.iter().map(|u| upstream(u)).collect();
    }
    let threads = own.threads.unwrap_or_else(|| {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
    });
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
    use crate::config::SyncMode;

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
    fn every_config_field_is_a_flag_of_its_name() {
        let cmd = command();
        for f in Config::fields() {
            let flag = f.name.replace('_', "-");
            let arg = cmd
                .get_arguments()
                .find(|a| a.get_long() == Some(flag.as_str()));
            let arg = arg.unwrap_or_else(|| panic!("no --{flag}"));
            assert!(arg.get_help().is_some(), "--{flag} has no help");
        }
    }

    #[test]
    fn the_file_holds_where_no_flag_is_given() {
        let path = std::env::temp_dir().join(format!("gw-cli-{}.toml", std::process::id()));
        std::fs::write(
            &path,
            "insecure_local = true\neval_capture = false\nmax_retries = 7\nadmin_key = \"fromfile1\"\nlisten = \"127.0.0.1:9\"\n",
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let file = path.display().to_string();
        let (cfg, _) = parse_args(&args(&["--config", &file])).unwrap_or_else(|e| panic!("{e}"));
        assert!(cfg.insecure_local && !cfg.eval_capture);
        assert_eq!((cfg.max_retries, cfg.listen.as_str()), (7, "127.0.0.1:9"));
        assert_eq!(cfg.admin_key.as_deref(), Some("fromfile1"));
        let (cfg, _) = parse_args(&args(&[
            "--config",
            &file,
            "--eval-capture",
            "true",
            "--insecure-local=false",
            "--max-retries",
            "1",
            "--on-store-failure",
            "serve",
        ]))
        .unwrap_or_else(|e| panic!("{e}"));
        let _ = std::fs::remove_file(&path);
        assert!(!cfg.insecure_local && cfg.eval_capture);
        assert_eq!((cfg.max_retries, cfg.listen.as_str()), (1, "127.0.0.1:9"));
        assert_eq!(cfg.on_store_failure, crate::config::StoreFailure::Serve);
        assert_eq!(cfg.admin_key.as_deref(), Some("fromfile1"));
        let (cfg, _) = parse_args(&args(&["--insecure-local"])).unwrap_or_else(|e| panic!("{e}"));
        assert!(cfg.insecure_local);
    }

    #[test]
    fn unknown_flags_and_bad_values_are_errors() {
        assert!(parse_args(&args(&["--bogus"])).is_err());
        assert!(parse_args(&args(&["--sync", "sometimes"])).is_err());
        assert!(parse_args(&args(&["--threads", "x"])).is_err());
    }
}
