//! lightning-gateway: the recording OpenAI-compatible proxy and its SQLite store.
//!
//! A harness points its OpenAI base URL at `/rollouts/{id}/v1`; every call is
//! forwarded to an inference engine with exact token ids and logprobs switched
//! on, the harness gets the engine's answer unchanged, and the captured call is
//! committed to the store before the answer's last byte leaves the gateway.

pub mod auth;
pub mod capture;
pub mod cli;
pub mod columnar;
pub mod config;
pub mod error;
pub mod metrics;
pub mod proxy;
pub mod reader;
pub mod server;
pub mod sse;
pub mod store;
pub mod upstream;

pub use config::{Config, Engine, SyncMode, UpstreamConfig};
pub use error::{ApiError, GatewayError};
pub use server::{serve_blocking, shutdown_signal, Server};
