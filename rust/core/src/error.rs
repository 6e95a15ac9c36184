//! The one error type of lightning-core.

use thiserror::Error;

/// Everything that can go wrong in lightning-core. Messages name the offending
/// value and say how to fix it.
#[derive(Debug, Error)]
pub enum CoreError {
    /// A call's data is inconsistent (e.g. logprobs length differs from completion length).
    #[error("call {index}: {message}")]
    InvalidCall { index: usize, message: String },
    /// An option passed to a merge is out of range.
    #[error("{0}")]
    InvalidOption(String),
}
