//! lightning-gateway: the recording proxy in front of inference engines and
//! its SQLite store.
//!
//! A harness points its SDK's base URL at `/rollouts/{id}/v1`; every call is
//! translated by its protocol's adapter (`protocol`) into a vLLM-wire engine
//! request with exact token ids and logprobs switched on, forwarded
//! (`proxy::forward`), recorded (`proxy::record`, `store`), and answered in
//! the harness's protocol, streamed as the engine generates; the call is
//! committed before the answer's final frame leaves the gateway.
//!
//! Modules: `routes` (HTTP server and routing) → `proxy` (pipeline) →
//! `protocol` (adapters, pure) and `wire` (engine formats, pure); `state`,
//! `http`, `auth`, `config`, `limits`, `upstream`, `store`, `metrics`, `columnar`
//! underneath; `online` (application keys, sessions, feedback, retention)
//! hooks into auth (`State::rollout_from_key`) and the record step (its
//! session resolution runs inside the store's writer). No module imports one
//! above it.

pub mod auth;
pub mod cli;
pub mod columnar;
pub mod config;
pub mod error;
// Test-only: the properties the fuzzers and `cargo test` check. Built into
// this crate's own tests and, with the `fuzzing` feature, for `fuzz/`; never
// into the shipped library or the wheel.
#[cfg(any(test, feature = "fuzzing"))]
#[doc(hidden)]
pub mod fuzzing;
pub mod http;
pub mod limits;
pub mod metrics;
pub mod online;
pub mod protocol;
pub mod proxy;
pub mod reader;
pub mod routes;
pub mod state;
pub mod store;
pub mod upstream;
pub mod wire;

pub use config::{Config, Engine, SyncMode, UpstreamConfig};
pub use error::{ApiError, GatewayError};
pub use routes::{serve_blocking, shutdown_signal, Server};
