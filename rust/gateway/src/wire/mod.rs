//! Engine wire formats: SSE framing and the vLLM-wire answers that carry ids.

pub mod engine;
pub mod lenient;
pub mod sse;
