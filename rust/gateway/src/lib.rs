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
//! Layers, bottom to top: `util` < `error` < `wire` < `protocol` < `config` <
//! `store` < `http` < `metrics` < `auth` < `limits` < `upstream` < `state` <
//! `online` < `proxy` < `routes` < `fuzzing` < `cli`. A module uses only
//! modules to its left (`tests/module_layers.rs` fails on an upward `crate::`
//! path, so there is no import circle). The pure parts sit low: `wire`
//! (engine formats) and `protocol` (adapters) need nothing stateful, which is
//! what lets the store keep a protocol's `Kept` object. `store` owns the
//! schema and every query, online mode's included (session resolution runs
//! inside its writer); `online` above `state` is what a call says about its
//! session, the sweep and the history look-up, with no SQL; `routes` (HTTP
//! server and routing) drives `proxy` (the pipeline); `cli` is the binary's
//! front door.

pub mod auth;
pub mod cli;
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
pub mod routes;
pub mod state;
pub mod store;
pub mod upstream;
pub mod util;
pub mod wire;

pub use config::{Config, Engine, SyncMode, UpstreamConfig};
pub use error::{ApiError, GatewayError};
pub use routes::{serve_blocking, shutdown_signal, Server};
