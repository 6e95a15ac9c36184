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
    /// `tokenizer.json` (or `tokenizer_config.json`) could not be parsed.
    #[error("cannot load tokenizer from {what}: {message}")]
    TokenizerLoad { what: String, message: String },
    /// Encoding or decoding failed inside the tokenizer.
    #[error("tokenizer: {0}")]
    Tokenize(String),
    /// The chat template failed to compile, raised (`raise_exception`) or hit an error.
    #[error("{0}")]
    Template(String),
    /// The tokenizer has no chat template but one was needed.
    #[error("this tokenizer has no chat_template; pass one with chat_template=... or load a model directory whose tokenizer_config.json or chat_template.jinja has it")]
    NoTemplate,
    /// Messages or generations passed in are malformed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}
