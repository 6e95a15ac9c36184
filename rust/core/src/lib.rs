//! lightning-core: the pure heart of lightning.
//!
//! Trace types (`trace`), radix-trie sample merging (`trie`), tokenizers
//! (`tokenizer`), chat templates (`template`), token-exact chat encoding and
//! splicing (`retokenize`), drift classification (`drift`), each merged call's
//! and token's rollout, group and weight version (`origin`) and the output
//! arrays' source (`arrays`: fresh, or a pool of a dropped result's). No I/O, no
//! Python: everything here is a function from values (file contents, not
//! paths) to values, so it can be tested and fuzzed in isolation.

pub mod arrays;
pub mod drift;
pub mod error;
pub mod origin;
pub mod retokenize;
pub mod template;
pub mod tokenizer;
pub mod trace;
pub mod trie;

pub use arrays::{AnyVec, ArrayPool, Arrays, Fresh, Plain};
pub use error::CoreError;
pub use origin::{CallIndex, RolloutKey, SampleSpan, TokenOrigin};
pub use trace::{
    Call, CallView, Divergence, DivergenceKind, MergeStats, Merged, PackedTree, Sample,
};
pub use trie::{
    lcp_pairs, merge, pack, pack_sequences, plan, MergePlan, SampleColumns, SampleInfo, SampleMut,
    TreeIndex, Trie,
};
