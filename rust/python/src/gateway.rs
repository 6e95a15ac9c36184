//! Bindings for the gateway: start it on a background thread (`gateway_start`)
//! or serve in the foreground until SIGINT/SIGTERM (`gateway_main`), the GIL
//! released the whole time the server runs.

use pyo3::prelude::*;
use std::sync::{mpsc, Mutex};
use std::thread::JoinHandle;

use lightning_gateway::{Config, Engine, Server, SyncMode};

use crate::errors::{gateway_error, GatewayError};

fn to_py(e: impl std::fmt::Display) -> PyErr {
    GatewayError::new_err(e.to_string())
}

/// A gateway running on a background thread. `stop()` drains in-flight calls,
/// flushes the store and joins the thread.
#[pyclass(name = "GatewayHandle", module = "lightning._core")]
#[derive(Debug)]
pub struct PyGatewayHandle {
    url: String,
    stop_tx: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    thread: Mutex<Option<JoinHandle<Result<(), String>>>>,
}

#[pymethods]
impl PyGatewayHandle {
    /// Base URL the gateway listens on, e.g. `http://127.0.0.1:41234`.
    #[getter]
    fn url(&self) -> &str {
        &self.url
    }

    /// Stops accepting, waits for in-flight calls (up to `drain_timeout_s`),
    /// flushes the store and joins the server thread. Idempotent.
    fn stop(&self, py: Python<'_>) -> PyResult<()> {
        let tx = self.stop_tx.lock().ok().and_then(|mut g| g.take());
        if let Some(tx) = tx {
            let _ = tx.send(());
        }
        let handle = self.thread.lock().ok().and_then(|mut g| g.take());
        if let Some(h) = handle {
            let res = py.detach(move || h.join());
            match res {
                Ok(Ok(())) => {}
                Ok(Err(msg)) => return Err(to_py(msg)),
                Err(_) => return Err(to_py("the gateway thread panicked")),
            }
        }
        Ok(())
    }

    /// Whether the server thread is still running.
    #[getter]
    fn running(&self) -> bool {
        self.thread
            .lock()
            .ok()
            .and_then(|g| g.as_ref().map(|h| !h.is_finished()))
            .unwrap_or(false)
    }
}

fn init_logging() {
    // Only when asked: a library must not install a global subscriber silently.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_target(false)
            .try_init();
    }
}

/// Starts a gateway from a JSON config on a background thread with its own
/// tokio runtime; returns once it is listening.
#[pyfunction]
#[pyo3(signature = (config_json, threads=2))]
fn gateway_start(py: Python<'_>, config_json: &str, threads: usize) -> PyResult<PyGatewayHandle> {
    init_logging();
    let cfg = Config::from_json(config_json).map_err(|e| gateway_error(py, e))?;
    cfg.validate().map_err(|e| gateway_error(py, e))?;
    let (ready_tx, ready_rx) = mpsc::channel::<Result<String, lightning_gateway::GatewayError>>();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("lightning-gateway".into())
        .spawn(move || -> Result<(), String> {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads.max(1))
                .thread_name("lightning-gateway-worker")
                .enable_all()
                .build()
                .map_err(|e| e.to_string());
            let rt = match rt {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(lightning_gateway::GatewayError::Io(
                        std::io::Error::other(e.clone()),
                    )));
                    return Err(e);
                }
            };
            rt.block_on(async move {
                let server = match Server::bind(cfg).await {
                    Ok(s) => s,
                    Err(e) => {
                        let msg = e.to_string();
                        let _ = ready_tx.send(Err(e));
                        return Err(msg);
                    }
                };
                let _ = ready_tx.send(Ok(format!("http://{}", server.local_addr())));
                server
                    .run(async move {
                        let _ = stop_rx.await;
                    })
                    .await
                    .map_err(|e| e.to_string())
            })
        })
        .map_err(to_py)?;
    let ready = py.detach(move || ready_rx.recv());
    match ready {
        Ok(Ok(url)) => Ok(PyGatewayHandle {
            url,
            stop_tx: Mutex::new(Some(stop_tx)),
            thread: Mutex::new(Some(thread)),
        }),
        Ok(Err(e)) => {
            let _ = thread.join();
            Err(gateway_error(py, e))
        }
        Err(_) => Err(to_py("the gateway thread exited before listening")),
    }
}

/// Serves a gateway from a JSON config in the foreground until SIGINT/SIGTERM.
#[pyfunction]
#[pyo3(signature = (config_json, threads=2))]
fn gateway_serve(py: Python<'_>, config_json: &str, threads: usize) -> PyResult<()> {
    let cfg = Config::from_json(config_json).map_err(|e| gateway_error(py, e))?;
    lightning_gateway::cli::init_logging();
    py.detach(move || lightning_gateway::serve_blocking(cfg, threads))
        .map_err(|e| gateway_error(py, e))
}

/// The `lightning-gateway` command line (same flags as the Rust binary);
/// returns the exit code.
#[pyfunction]
fn gateway_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(move || lightning_gateway::cli::main_with_args(&argv))
}

/// The gateway configuration as Rust defines it, as JSON: `fields` (each
/// flag-able field: name, Python type, default, doc, bound; from these
/// `.ci/gateway_config.py` writes Python's `GatewayConfig`), `defaults` (every
/// field of the config with its default, sections included),
/// `upstream_defaults`, and the closed sets `engines` (every accepted name) and
/// `sync_modes`.
#[pyfunction]
fn gateway_config_schema() -> PyResult<String> {
    // A match per enum: a new variant fails to compile here until it is listed.
    let sync_modes = [SyncMode::Full, SyncMode::Normal].map(|s| match s {
        SyncMode::Full | SyncMode::Normal => s,
    });
    let upstream = lightning_gateway::UpstreamConfig {
        url: String::new(),
        weight_version: 0,
        engine: Engine::default(),
    };
    let mut upstream = serde_json::to_value(upstream).map_err(to_py)?;
    if let Some(o) = upstream.as_object_mut() {
        o.remove("url");
    }
    let schema = serde_json::json!({
        "fields": Config::fields(),
        "defaults": Config::default(),
        "upstream_defaults": upstream,
        "engines": Engine::NAMES,
        "sync_modes": sync_modes,
    });
    Ok(schema.to_string())
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(gateway_config_schema, m)?)?;
    m.add_class::<PyGatewayHandle>()?;
    m.add_function(wrap_pyfunction!(gateway_start, m)?)?;
    m.add_function(wrap_pyfunction!(gateway_serve, m)?)?;
    m.add_function(wrap_pyfunction!(gateway_main, m)?)?;
    Ok(())
}
