//! Trace types: what the gateway records per call, and what merging produces.
//!
//! A call's full sequence is `S = prompt ++ completion`; "position" and "depth"
//! below always mean an index into such a sequence (the position id a model sees).

use rayon::prelude::*;

use crate::arrays::{Arrays, Plain};
use crate::error::CoreError;

/// One recorded model call, owning its data (what the store reads back).
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub rollout_id: String,
    /// Order of the call within its rollout (the gateway's sequence number).
    pub order: u32,
    pub prompt_ids: Vec<u32>,
    pub completion_ids: Vec<u32>,
    /// One rollout logprob per completion token, when the engine returned them.
    pub logprobs: Option<Vec<f32>>,
    pub finish_reason: Option<String>,
    pub weight_version: u64,
    /// The GRPO group (rollouts of one task) this call's rollout belongs to.
    pub group: Option<String>,
}

impl Call {
    /// A borrowed view for merging.
    pub fn view(&self) -> CallView<'_> {
        CallView {
            rollout_id: &self.rollout_id,
            group: self.group.as_deref(),
            prompt: &self.prompt_ids,
            completion: &self.completion_ids,
            logprobs: self.logprobs.as_deref(),
        }
    }
}

/// A call as the merge sees it: borrowed slices, so token buffers owned elsewhere
/// (numpy arrays, the store) are read in place.
#[derive(Debug, Clone, Copy)]
pub struct CallView<'a> {
    pub rollout_id: &'a str,
    pub group: Option<&'a str>,
    pub prompt: &'a [u32],
    pub completion: &'a [u32],
    pub logprobs: Option<&'a [f32]>,
}

impl<'a> CallView<'a> {
    /// Length of the full sequence `prompt ++ completion`.
    #[inline]
    pub fn len(&self) -> usize {
        self.prompt.len() + self.completion.len()
    }

    /// True when both prompt and completion are empty.
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Token at `depth` of the full sequence.
    #[inline]
    pub fn token(&self, depth: usize) -> u32 {
        let p = self.prompt.len();
        if depth < p {
            self.prompt[depth]
        } else {
            self.completion[depth - p]
        }
    }

    /// The tokens at depths `from..to` of the full sequence, as at most two
    /// contiguous pieces (the sequence is never concatenated in memory).
    #[inline]
    pub fn pieces(&self, from: usize, to: usize) -> [&'a [u32]; 2] {
        let p = self.prompt.len();
        if to <= p {
            [&self.prompt[from..to], &[]]
        } else if from >= p {
            [&self.completion[from - p..to - p], &[]]
        } else {
            [&self.prompt[from..], &self.completion[..to - p]]
        }
    }

    /// Rollout logprob of the generated token at `depth` (NaN when unknown).
    #[inline]
    pub fn logprob_at(&self, depth: usize) -> f32 {
        match self.logprobs {
            Some(l) => l[depth - self.prompt.len()],
            None => f32::NAN,
        }
    }

    /// Check what merging relies on; `index` is the call's index in the input.
    pub fn validate(&self, index: usize) -> Result<(), CoreError> {
        let invalid = |message: String| CoreError::InvalidCall { index, message };
        if self.completion.is_empty() {
            return Err(invalid(format!(
                "rollout {:?} has an empty completion; drop calls without completion tokens \
                 (aborted or failed calls) before merging",
                self.rollout_id
            )));
        }
        if let Some(l) = self.logprobs {
            if l.len() != self.completion.len() {
                return Err(invalid(format!(
                    "rollout {:?}: logprobs has {} entries but the completion has {} tokens; \
                     pass one logprob per completion token, or logprobs=None",
                    self.rollout_id,
                    l.len(),
                    self.completion.len()
                )));
            }
        }
        if self.len() >= u32::MAX as usize {
            return Err(invalid(format!(
                "rollout {:?}: sequence of {} tokens is longer than the supported 2^32 - 1",
                self.rollout_id,
                self.len()
            )));
        }
        Ok(())
    }
}

/// Why a later call's prompt left the path of an earlier call: the one set of
/// causes, from the merge (which finds divergences, `Unclassified`) and the
/// drift classifier (`crate::drift`, which names them with a tokenizer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DivergenceKind {
    /// No tokenizer was given, so the cause is not known.
    Unclassified,
    /// The next prompt extends the previous context (no divergence).
    Match,
    /// Decoded texts agree, token ids differ.
    Retokenization,
    /// The template removed a `<think>` block from the previous turn.
    ReasoningStripped,
    /// Tool-call JSON came back with equal values but different text.
    ToolCallReserialized,
    /// The previous completion was cut (no control token) and its tail rewritten.
    Truncated,
    /// Only whitespace or control tokens between turns changed.
    Separator,
    /// Most later turns are gone: history dropped or summarized.
    Compacted,
    /// Anything else (edited history, sub-agents, ...).
    Other,
}

impl DivergenceKind {
    /// Every kind, in the order above.
    pub const ALL: [DivergenceKind; 9] = [
        DivergenceKind::Unclassified,
        DivergenceKind::Match,
        DivergenceKind::Retokenization,
        DivergenceKind::ReasoningStripped,
        DivergenceKind::ToolCallReserialized,
        DivergenceKind::Truncated,
        DivergenceKind::Separator,
        DivergenceKind::Compacted,
        DivergenceKind::Other,
    ];

    /// The string Python sees.
    pub fn as_str(self) -> &'static str {
        match self {
            DivergenceKind::Unclassified => "unclassified",
            DivergenceKind::Match => "match",
            DivergenceKind::Retokenization => "retokenization",
            DivergenceKind::ReasoningStripped => "reasoning_stripped",
            DivergenceKind::ToolCallReserialized => "tool_call_reserialized",
            DivergenceKind::Truncated => "truncated",
            DivergenceKind::Separator => "separator",
            DivergenceKind::Compacted => "compacted",
            DivergenceKind::Other => "other",
        }
    }
}

/// A point where a call's prompt departs from a path an earlier call of the same
/// rollout produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Divergence {
    pub rollout_id: String,
    /// Index (into the merge input) of the call whose prompt departs.
    pub call_index: usize,
    /// Depth of the first token that differs.
    pub position: usize,
    /// Index of the latest earlier call whose path continued past `position`.
    pub left_call_index: usize,
    pub kind: DivergenceKind,
}

/// One training sequence: a root-to-leaf path of a rollout's trie.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub rollout_id: String,
    pub group: Option<String>,
    pub tokens: Vec<u32>,
    /// Number of calls that generated the token at this node, in the one sample
    /// where the node is trained; 0 for context.
    pub weights: Vec<f32>,
    /// Rollout logprob wherever some call generated the token (NaN otherwise).
    pub logprobs: Vec<f32>,
    /// First generating call (index into the input) where weight > 0, else -1.
    pub call_index: Vec<i32>,
    /// Generated tokens (summed weights) this sample lost to `max_tokens`.
    pub truncated: usize,
}

/// Counts describing one merge.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MergeStats {
    pub calls: usize,
    pub rollouts: usize,
    pub samples: usize,
    /// Sum of completion lengths over all calls.
    pub generated_tokens: usize,
    /// Sum of sample lengths (after truncation).
    pub sample_tokens: usize,
    /// Generated tokens (counted per generating call) beyond `max_tokens`.
    pub truncated_tokens: usize,
    /// Samples dropped because truncation left them nothing to train.
    pub dropped_samples: usize,
    /// Calls whose full sequence repeats an earlier call's in the same rollout.
    pub duplicates: usize,
}

/// Output of [`crate::trie::merge`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Merged {
    pub samples: Vec<Sample>,
    pub divergences: Vec<Divergence>,
    pub stats: MergeStats,
    /// Wall-clock seconds spent inserting calls and emitting samples (for benchmarks).
    pub insert_seconds: f64,
    pub samples_seconds: f64,
}

/// All trie nodes (one per token) in DFS order, for one forward pass with an
/// ancestor attention mask. Several trees are concatenated (a forest).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PackedTree {
    pub tokens: Vec<u32>,
    /// Index of the previous token on the path; -1 at a root.
    pub parent: Vec<i64>,
    /// Position id (depth in the sequence).
    pub depth: Vec<i64>,
    /// Number of calls that generated this token here (0 for context).
    pub weights: Vec<f32>,
    /// Rollout logprob of the first generator that has one (NaN otherwise).
    pub logprobs: Vec<f32>,
    /// CSR offsets into `gen_call`, length `tokens.len() + 1`.
    pub gen_offsets: Vec<i64>,
    /// Generating calls (input indices), in input order per token.
    pub gen_call: Vec<i32>,
    /// Start of each tree in the arrays, length `tree_keys.len() + 1`.
    pub tree_offsets: Vec<i64>,
    /// The rollout id or group name of each tree.
    pub tree_keys: Vec<String>,
    /// The first call (input index) of each tree: its rollout and group name the tree.
    pub tree_call: Vec<i32>,
}

impl PackedTree {
    /// A forest of `tokens` tokens and `gens` generator entries, its arrays
    /// taken from `arrays` (their values unspecified, to be written in place;
    /// `gen_offsets[0]` is 0), with room for `trees` trees.
    pub fn alloc(tokens: usize, gens: usize, trees: usize, arrays: &impl Arrays) -> Self {
        let mut tree_offsets = Vec::with_capacity(trees + 1);
        tree_offsets.push(0);
        let mut gen_offsets = arrays.take(tokens + 1);
        gen_offsets[0] = 0;
        PackedTree {
            tokens: arrays.take(tokens),
            parent: arrays.take(tokens),
            depth: arrays.take(tokens),
            weights: arrays.take(tokens),
            logprobs: arrays.take(tokens),
            gen_offsets,
            gen_call: arrays.take(gens),
            tree_offsets,
            tree_keys: Vec::with_capacity(trees),
            tree_call: Vec::with_capacity(trees),
        }
    }

    /// Per token, `by_call` at its first generating call (an input index into
    /// `by_call`), `context` where no call generated it. Computed in parallel
    /// into an array from `arrays`.
    pub fn by_first_generator<T: Plain>(
        &self,
        by_call: &[T],
        context: T,
        arrays: &impl Arrays,
    ) -> Vec<T> {
        let mut out = arrays.take(self.tokens.len());
        out.par_iter_mut()
            .zip(self.gen_offsets.par_windows(2))
            .for_each(|(o, w)| {
                *o = if w[0] < w[1] {
                    by_call[self.gen_call[w[0] as usize] as usize]
                } else {
                    context
                }
            });
        out
    }

    /// Per token, `by_tree` at the tree it belongs to. Computed in parallel
    /// into an array from `arrays`.
    pub fn by_tree(&self, by_tree: &[i32], arrays: &impl Arrays) -> Vec<i32> {
        let mut out = arrays.take(self.tokens.len());
        let mut parts = Vec::with_capacity(by_tree.len());
        let mut rest = &mut out[..];
        for (w, &v) in self.tree_offsets.windows(2).zip(by_tree) {
            let (part, tail) = rest.split_at_mut((w[1] - w[0]) as usize);
            parts.push((part, v));
            rest = tail;
        }
        parts.into_par_iter().for_each(|(part, v)| part.fill(v));
        out
    }
}
