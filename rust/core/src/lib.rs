//! lightning-core: the pure heart of lightning.
//!
//! Trace types (`trace`), radix-trie sample merging (`trie`). No I/O, no Python:
//! everything here is a function from values to values, so it can be tested and
//! fuzzed in isolation.

pub mod error;
pub mod trace;
pub mod trie;

pub use error::CoreError;
pub use trace::{
    Call, CallView, Divergence, DivergenceKind, MergeStats, Merged, PackedTree, Sample,
};
pub use trie::{merge, pack, Trie};
