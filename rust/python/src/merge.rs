//! Python bindings for trace types and the radix-trie merge (`lightning_core::trie`).
//!
//! Token ids live in numpy arrays on both sides: a `Call` keeps C-contiguous
//! uint32 input as is (no copy) and converts anything else once, with a precise
//! error; `merge_calls` borrows every buffer read-only, releases the GIL for the
//! whole merge, and hands the output vectors to numpy without copying.

use std::sync::{Arc, OnceLock};
use std::time::Instant;

use lightning_core::{
    Call, CallIndex, CallView, MergePlan, PackedTree, RolloutKey, SampleColumns, TokenOrigin,
    TreeIndex,
};
use numpy::{Element, IntoPyArray, PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PySlice};

use crate::arrays::{freeze, pooled, to_ids, to_logprobs, POOL};
use crate::errors::{core_error, invalid_call};
use crate::tokenizer::PyTokenizer;

/// One model call of a rollout: exact prompt ids, completion ids and rollout
/// logprobs. Ids accept lists or numpy integer arrays and are stored as uint32
/// numpy arrays (a C-contiguous uint32 array is kept as is, without copying, like
/// `np.asarray`); logprobs are stored as float32. Raises `InvalidCallError` (a
/// `ValueError`) for ids that are not integers or are outside the uint32 range.
#[pyclass(name = "Call", module = "lightning._core", frozen)]
#[derive(Debug)]
pub struct PyCall {
    rollout_id: String,
    prompt_ids: Py<PyArray1<u32>>,
    completion_ids: Py<PyArray1<u32>>,
    logprobs: Option<Py<PyArray1<f32>>>,
    finish_reason: Option<String>,
    weight_version: u64,
    group: Option<String>,
}

#[pymethods]
impl PyCall {
    #[new]
    #[pyo3(signature = (rollout_id, prompt_ids, completion_ids, logprobs=None, finish_reason=None, weight_version=0, group=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        rollout_id: String,
        prompt_ids: &Bound<'_, PyAny>,
        completion_ids: &Bound<'_, PyAny>,
        logprobs: Option<&Bound<'_, PyAny>>,
        finish_reason: Option<String>,
        weight_version: u64,
        group: Option<String>,
    ) -> PyResult<Self> {
        let fail = |m: String| invalid_call(py, format!("Call(rollout_id={rollout_id:?}): {m}"));
        let prompt_ids = to_ids(prompt_ids, "prompt_ids")?.map_err(&fail)?;
        let completion_ids = to_ids(completion_ids, "completion_ids")?.map_err(&fail)?;
        let logprobs = match logprobs {
            Some(l) if !l.is_none() => Some(to_logprobs(l)?.map_err(&fail)?),
            _ => None,
        };
        Ok(PyCall {
            rollout_id,
            prompt_ids,
            completion_ids,
            logprobs,
            finish_reason,
            weight_version,
            group,
        })
    }

    /// The rollout this call belongs to.
    #[getter]
    fn rollout_id(&self) -> &str {
        &self.rollout_id
    }

    /// Prompt token ids (uint32).
    #[getter]
    fn prompt_ids(&self, py: Python<'_>) -> Py<PyArray1<u32>> {
        self.prompt_ids.clone_ref(py)
    }

    /// Completion token ids (uint32).
    #[getter]
    fn completion_ids(&self, py: Python<'_>) -> Py<PyArray1<u32>> {
        self.completion_ids.clone_ref(py)
    }

    /// Rollout logprob per completion token (float32), or None.
    #[getter]
    fn logprobs(&self, py: Python<'_>) -> Option<Py<PyArray1<f32>>> {
        self.logprobs.as_ref().map(|l| l.clone_ref(py))
    }

    /// Why generation stopped ("stop", "length", ...), if known.
    #[getter]
    fn finish_reason(&self) -> Option<&str> {
        self.finish_reason.as_deref()
    }

    /// Version of the policy weights that served the call.
    #[getter]
    fn weight_version(&self) -> u64 {
        self.weight_version
    }

    /// The GRPO group (rollouts of one task), or None.
    #[getter]
    fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Call(rollout_id={:?}, prompt={} tokens, completion={} tokens, logprobs={}, \
             finish_reason={:?}, weight_version={}, group={:?})",
            self.rollout_id,
            self.prompt_ids.bind(py).len(),
            self.completion_ids.bind(py).len(),
            if self.logprobs.is_some() {
                "yes"
            } else {
                "None"
            },
            self.finish_reason,
            self.weight_version,
            self.group
        )
    }
}

impl PyCall {
    /// A call read from the store: its vectors become numpy arrays without copying.
    pub(crate) fn from_core(py: Python<'_>, c: Call) -> PyResult<Self> {
        Ok(PyCall {
            rollout_id: c.rollout_id,
            prompt_ids: freeze(c.prompt_ids.into_pyarray(py))?,
            completion_ids: freeze(c.completion_ids.into_pyarray(py))?,
            logprobs: match c.logprobs {
                Some(l) => Some(freeze(l.into_pyarray(py))?),
                None => None,
            },
            finish_reason: c.finish_reason,
            weight_version: c.weight_version,
            group: c.group,
        })
    }
}

/// Every call's buffers as slices, for reading with the GIL released.
///
/// numpy's borrow tracking is skipped on purpose: it costs microseconds per
/// array (a global table), which dominated merging thousands of calls, and it
/// cannot see writers in Python anyway. The arrays stay alive as long as
/// `calls` does, and nothing in lightning writes to a `Call`'s arrays (ours are
/// created read-only; caller-supplied uint32 arrays are documented as shared).
fn views<'a>(calls: &'a [Bound<'_, PyCall>]) -> PyResult<Vec<CallView<'a>>> {
    let mut out = Vec::with_capacity(calls.len());
    for (i, c) in calls.iter().enumerate() {
        let py = c.py();
        let c = c.get();
        let slice_err = |e: numpy::AsSliceError| invalid_call(py, format!("call {i}: {e}"));
        // SAFETY: see above; each array is 1-D, C-contiguous (checked by
        // `as_slice`) and owned by `calls`, which outlives the returned views.
        unsafe {
            out.push(CallView {
                rollout_id: &c.rollout_id,
                group: c.group.as_deref(),
                prompt: c.prompt_ids.bind(py).as_slice().map_err(slice_err)?,
                completion: c.completion_ids.bind(py).as_slice().map_err(slice_err)?,
                logprobs: match &c.logprobs {
                    Some(l) => Some(l.bind(py).as_slice().map_err(slice_err)?),
                    None => None,
                },
            });
        }
    }
    Ok(out)
}

/// An optional string as Python shows it (`None` or a quoted string).
fn py_repr(s: Option<&str>) -> String {
    s.map_or_else(|| "None".to_string(), |s| format!("{s:?}"))
}

/// One training sequence: a root-to-leaf path of a rollout's trie. `weights` is
/// the number of calls that generated each token in the one sample where it is
/// trained (0 for context); `logprobs` is the rollout logprob wherever some call
/// generated the token (NaN otherwise); `call_index` is the first generating
/// call's index in the `merge_calls` input where the weight is > 0, else -1.
/// The arrays are views into one flat buffer per field shared by all samples of
/// the merge (writable; each access returns a new view of the same memory).
#[pyclass(name = "Sample", module = "lightning._core", frozen)]
#[derive(Debug)]
pub struct PySample {
    rollout_id: String,
    group: Option<String>,
    rollout_index: usize,
    buffers: Arc<SampleBuffers>,
    start: usize,
    len: usize,
    truncated: usize,
}

/// The flat output of one merge; every sample is a range of it.
#[derive(Debug)]
struct SampleBuffers {
    tokens: Py<PyArray1<u32>>,
    weights: Py<PyArray1<f32>>,
    logprobs: Py<PyArray1<f32>>,
    call_index: Py<PyArray1<i32>>,
    /// Weight version (and rollout, group) of each input call.
    index: Arc<CallIndex>,
}

impl PySample {
    /// A numpy view of this sample's range of `arr`.
    fn view<'py, T: Element>(
        &self,
        py: Python<'py>,
        arr: &Py<PyArray1<T>>,
    ) -> PyResult<Bound<'py, PyArray1<T>>> {
        let slice = PySlice::new(py, self.start as isize, (self.start + self.len) as isize, 1);
        Ok(arr.bind(py).get_item(slice)?.cast_into::<PyArray1<T>>()?)
    }
}

#[pymethods]
impl PySample {
    /// The rollout this sample comes from.
    #[getter]
    fn rollout_id(&self) -> &str {
        &self.rollout_id
    }

    /// The rollout's GRPO group, or None.
    #[getter]
    fn group(&self) -> Option<&str> {
        self.group.as_deref()
    }

    /// Index of this sample's rollout in `MergeResult.rollouts`.
    #[getter]
    fn rollout_index(&self) -> usize {
        self.rollout_index
    }

    /// Token ids (uint32).
    #[getter]
    fn tokens<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<u32>>> {
        self.view(py, &self.buffers.tokens)
    }

    /// Loss weight per token (float32): number of generating calls, 0 for context.
    #[getter]
    fn weights<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        self.view(py, &self.buffers.weights)
    }

    /// Rollout logprob per token (float32, NaN where unknown).
    #[getter]
    fn logprobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<f32>>> {
        self.view(py, &self.buffers.logprobs)
    }

    /// Generating call per token (int32 index into the input, -1 for context).
    #[getter]
    fn call_index<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i32>>> {
        self.view(py, &self.buffers.call_index)
    }

    /// Weight version of the call that generated each token (int64, -1 for
    /// context); computed on access from `call_index`.
    #[getter]
    fn weight_version<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ci = self.view(py, &self.buffers.call_index)?;
        let ci = ci.readonly();
        let ci = ci.as_slice().map_err(|e| invalid_call(py, e.to_string()))?;
        let out = self.buffers.index.versions_of(ci);
        Ok(out.into_pyarray(py))
    }

    /// Generated tokens (summed weights) this sample lost to `max_tokens`.
    #[getter]
    fn truncated(&self) -> usize {
        self.truncated
    }

    fn __len__(&self) -> usize {
        self.len
    }

    fn __repr__(&self) -> String {
        format!(
            "Sample(rollout_id={:?}, group={}, tokens={}, truncated={})",
            self.rollout_id,
            py_repr(self.group.as_deref()),
            self.len,
            self.truncated
        )
    }
}

/// A point where a call's prompt departs from a path that an earlier call of
/// the same rollout produced: `position` is the first differing token's depth,
/// `left_call_index` the latest earlier call whose path continued there. `kind`
/// is "unclassified" without a tokenizer, else the cause `classify_drift`
/// names ("retokenization", "reasoning_stripped", "tool_call_reserialized",
/// "truncated", "separator", "compacted" or "other").
#[pyclass(name = "Divergence", module = "lightning._core", frozen, get_all)]
#[derive(Debug)]
pub struct PyDivergence {
    rollout_id: String,
    call_index: usize,
    position: usize,
    left_call_index: usize,
    kind: &'static str,
}

#[pymethods]
impl PyDivergence {
    fn __repr__(&self) -> String {
        format!(
            "Divergence(rollout_id={:?}, call_index={}, position={}, left_call_index={}, kind={:?})",
            self.rollout_id, self.call_index, self.position, self.left_call_index, self.kind
        )
    }
}

/// A rollout of a merge: its group and, when read from the store, its mode,
/// status and latest reward (None where unknown: calls merged without rollout
/// records, or a rollout nobody rewarded).
#[pyclass(name = "RolloutInfo", module = "lightning._core", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct PyRolloutInfo {
    pub rollout_id: String,
    pub group: Option<String>,
    pub mode: Option<String>,
    pub status: Option<String>,
    pub reward: Option<f64>,
}

#[pymethods]
impl PyRolloutInfo {
    #[new]
    #[pyo3(signature = (rollout_id, group=None, mode=None, status=None, reward=None))]
    fn new(
        rollout_id: String,
        group: Option<String>,
        mode: Option<String>,
        status: Option<String>,
        reward: Option<f64>,
    ) -> Self {
        PyRolloutInfo {
            rollout_id,
            group,
            mode,
            status,
            reward,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "RolloutInfo(rollout_id={:?}, group={}, mode={}, status={}, reward={})",
            self.rollout_id,
            py_repr(self.group.as_deref()),
            py_repr(self.mode.as_deref()),
            py_repr(self.status.as_deref()),
            self.reward
                .map_or_else(|| "None".to_string(), |r| r.to_string())
        )
    }
}

/// Counts describing one merge. `generated_tokens` sums completion lengths;
/// `sample_tokens` sums sample lengths; `truncated_tokens` counts generated
/// tokens (per generating call) cut by `max_tokens`; `dropped_samples` counts
/// samples that truncation left with nothing to train; `duplicates` counts calls
/// whose full sequence repeats an earlier call's in the same rollout;
/// `skipped_calls` counts stored calls a store read left out as untrainable.
#[pyclass(name = "MergeStats", module = "lightning._core", frozen, get_all)]
#[derive(Debug)]
pub struct PyMergeStats {
    calls: usize,
    rollouts: usize,
    samples: usize,
    generated_tokens: usize,
    sample_tokens: usize,
    truncated_tokens: usize,
    dropped_samples: usize,
    duplicates: usize,
    skipped_calls: usize,
}

#[pymethods]
impl PyMergeStats {
    /// The counts as a plain dict.
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("calls", self.calls)?;
        d.set_item("rollouts", self.rollouts)?;
        d.set_item("samples", self.samples)?;
        d.set_item("generated_tokens", self.generated_tokens)?;
        d.set_item("sample_tokens", self.sample_tokens)?;
        d.set_item("truncated_tokens", self.truncated_tokens)?;
        d.set_item("dropped_samples", self.dropped_samples)?;
        d.set_item("duplicates", self.duplicates)?;
        d.set_item("skipped_calls", self.skipped_calls)?;
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("MergeStats({})", self.as_dict(py)?.repr()?))
    }
}

/// The packed-tree form: every trie node (one per token) in DFS order, so one
/// forward pass with an ancestor attention mask computes every branch and every
/// shared prefix once. `parent` is -1 at roots; `depth` is the position id;
/// `weights` counts generating calls; `gen_offsets`/`gen_call` list the
/// generating calls per token (CSR); `tree_offsets`/`tree_keys` delimit trees.
/// Per token, `rollout`, `group` and `weight_version` come from the first
/// generating call (-1 for context; `group` is the tree's for every token);
/// `call_rollout` maps every input call to its rollout, so a token that calls
/// of several rollouts generated can credit each (via `gen_call`).
#[pyclass(name = "PackedTree", module = "lightning._core", frozen)]
#[derive(Debug)]
pub struct PyPackedTree {
    /// Token ids in DFS order (uint32).
    #[pyo3(get)]
    tokens: Py<PyArray1<u32>>,
    /// Index of each token's parent (int64, -1 at a root).
    #[pyo3(get)]
    parent: Py<PyArray1<i64>>,
    /// Position id of each token (int64).
    #[pyo3(get)]
    depth: Py<PyArray1<i64>>,
    /// Number of calls that generated each token (float32, 0 for context).
    #[pyo3(get)]
    weights: Py<PyArray1<f32>>,
    /// Rollout logprob of each token (float32, NaN where unknown).
    #[pyo3(get)]
    logprobs: Py<PyArray1<f32>>,
    /// CSR offsets into `gen_call` (int64, length len(tokens) + 1).
    #[pyo3(get)]
    gen_offsets: Py<PyArray1<i64>>,
    /// Generating call indices (int32), in input order per token.
    #[pyo3(get)]
    gen_call: Py<PyArray1<i32>>,
    /// Start of each tree (int64, length len(tree_keys) + 1).
    #[pyo3(get)]
    tree_offsets: Py<PyArray1<i64>>,
    /// Rollout id (or group name, when packed across rollouts) of each tree.
    #[pyo3(get)]
    tree_keys: Vec<String>,
    /// Rollout of each token's first generator (int32 index into `rollout_ids`, -1 for context).
    #[pyo3(get)]
    rollout: Py<PyArray1<i32>>,
    /// Group of each token's tree (int32 index into `groups`, -1 without a group).
    #[pyo3(get)]
    group: Py<PyArray1<i32>>,
    /// Weight version of each token's first generator (int64, -1 for context).
    #[pyo3(get)]
    weight_version: Py<PyArray1<i64>>,
    /// Rollout of every input call (int32 index into `rollout_ids`).
    #[pyo3(get)]
    call_rollout: Py<PyArray1<i32>>,
    /// The merge's rollouts, as in `MergeResult.rollouts`.
    #[pyo3(get)]
    rollout_ids: Vec<String>,
    /// The merge's distinct groups, in order of first appearance.
    #[pyo3(get)]
    groups: Vec<String>,
    /// Child lookup for `locate`, built on first use.
    index: OnceLock<TreeIndex>,
}

impl PyPackedTree {
    /// A tree of plain sequences (`pack_sequences`): no rollouts, groups or versions.
    fn from_core(py: Python<'_>, t: PackedTree) -> PyResult<Self> {
        let none = TokenOrigin::none(t.tokens.len());
        Self::new(py, t, none, Vec::new())
    }

    /// The token-length arrays go to numpy as pooled arrays (see `arrays`).
    fn new(
        py: Python<'_>,
        t: PackedTree,
        o: TokenOrigin,
        rollout_ids: Vec<String>,
    ) -> PyResult<Self> {
        Ok(PyPackedTree {
            tokens: pooled(py, t.tokens)?.unbind(),
            parent: pooled(py, t.parent)?.unbind(),
            depth: pooled(py, t.depth)?.unbind(),
            weights: pooled(py, t.weights)?.unbind(),
            logprobs: pooled(py, t.logprobs)?.unbind(),
            gen_offsets: pooled(py, t.gen_offsets)?.unbind(),
            gen_call: pooled(py, t.gen_call)?.unbind(),
            tree_offsets: t.tree_offsets.into_pyarray(py).unbind(),
            tree_keys: t.tree_keys,
            rollout: pooled(py, o.rollout)?.unbind(),
            group: pooled(py, o.group)?.unbind(),
            weight_version: pooled(py, o.weight_version)?.unbind(),
            call_rollout: o.call_rollout.into_pyarray(py).unbind(),
            rollout_ids,
            groups: o.groups,
            index: OnceLock::new(),
        })
    }
}

#[pymethods]
impl PyPackedTree {
    /// The node of each position of a token sequence (int64), found by walking
    /// from a root; raises `InvalidCallError` (a `ValueError`) naming the
    /// position where the sequence leaves the tree.
    fn locate<'py>(
        &self,
        py: Python<'py>,
        tokens: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let ids = to_ids(tokens, "tokens")?.map_err(|m| invalid_call(py, m))?;
        let ids = ids.bind(py).readonly();
        let ids = ids
            .as_slice()
            .map_err(|e| invalid_call(py, e.to_string()))?;
        let index = self.index.get_or_init(|| {
            let tokens = self.tokens.bind(py).readonly();
            let parent = self.parent.bind(py).readonly();
            let bounds = self.tree_offsets.bind(py).readonly();
            // Our own arrays, C-contiguous as made; none reads as an empty tree.
            TreeIndex::from_parts(
                tokens.as_slice().unwrap_or_default(),
                parent.as_slice().unwrap_or_default(),
                bounds.as_slice().unwrap_or_default(),
            )
        });
        match py.detach(|| index.locate(ids)) {
            Ok(nodes) => Ok(nodes.into_pyarray(py)),
            Err(k) => Err(invalid_call(
                py,
                format!(
                    "sequence not in the packed tree (diverges at position {k}); pack the \
                     calls or sequences it came from"
                ),
            )),
        }
    }

    fn __len__(&self, py: Python<'_>) -> usize {
        self.tokens.bind(py).len()
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "PackedTree(tokens={}, trees={})",
            self.tokens.bind(py).len(),
            self.tree_keys.len()
        )
    }
}

/// The result of `merge_calls` (or of a store read): `samples`, `divergences`,
/// `stats`, `rollouts`, and the packed-tree form on demand.
#[pyclass(name = "MergeResult", module = "lightning._core", frozen)]
pub struct PyMergeResult {
    /// The tries and sample layout; samples are written from it on first access.
    plan: MergePlan,
    samples: PyOnceLock<Vec<Py<PySample>>>,
    divergences: Vec<Py<PyDivergence>>,
    stats: Py<PyMergeStats>,
    calls: Vec<Py<PyCall>>,
    rollouts: Vec<Py<PyRolloutInfo>>,
    index: Arc<CallIndex>,
    max_tokens: Option<usize>,
    /// Seconds borrowing the inputs and planning (tries + layout).
    plan_timings: [(&'static str, f64); 2],
    /// Seconds allocating, writing and wrapping the samples, once written.
    sample_timings: OnceLock<[(&'static str, f64); 3]>,
}

impl std::fmt::Debug for PyMergeResult {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PyMergeResult")
            .field("stats", &self.plan.stats)
            .field("written", &self.sample_timings.get().is_some())
            .finish_non_exhaustive()
    }
}

impl PyMergeResult {
    /// Write every sample into one flat numpy buffer per field (GIL released
    /// while writing) and wrap each as a `Sample` view.
    fn write_samples(&self, py: Python<'_>) -> PyResult<Vec<Py<PySample>>> {
        let calls: Vec<Bound<'_, PyCall>> = self.calls.iter().map(|c| c.bind(py).clone()).collect();
        let views = views(&calls)?;
        let t0 = Instant::now();
        // One buffer per field for all samples, from the pool of dropped
        // results' arrays (see `arrays`): reused memory costs no page faults.
        let mut cols = SampleColumns::take(self.plan.stats.sample_tokens, &POOL);
        let t1 = Instant::now();
        // `plan.write` writes every element (the kept samples tile
        // [0, sample_tokens) exactly), so the buffers' old contents never show.
        py.detach(|| self.plan.write(&views, cols.as_mut()));
        let buffers = SampleBuffers {
            tokens: pooled(py, cols.tokens)?.unbind(),
            weights: pooled(py, cols.weights)?.unbind(),
            logprobs: pooled(py, cols.logprobs)?.unbind(),
            call_index: pooled(py, cols.call_index)?.unbind(),
            index: Arc::clone(&self.index),
        };
        let t2 = Instant::now();
        let buffers = Arc::new(buffers);
        let mut samples = Vec::with_capacity(self.plan.stats.samples);
        for span in self.index.spans(&self.plan, &views) {
            let s = PySample {
                rollout_id: span.info.rollout_id.to_string(),
                group: span.info.group.map(str::to_string),
                rollout_index: span.rollout,
                buffers: Arc::clone(&buffers),
                start: span.start,
                len: span.info.len,
                truncated: span.info.truncated,
            };
            samples.push(Py::new(py, s)?);
        }
        let _ = self.sample_timings.set([
            ("allocate", (t1 - t0).as_secs_f64()),
            ("write", (t2 - t1).as_secs_f64()),
            ("output", t2.elapsed().as_secs_f64()),
        ]);
        Ok(samples)
    }
}

#[pymethods]
impl PyMergeResult {
    /// Training samples, rollouts in order of first appearance, each rollout's
    /// samples in DFS order of its trie. Written from the merge's tries on first
    /// access (GIL released), so a consumer of `packed()` or `stats` alone never
    /// pays for them.
    #[getter]
    fn samples(&self, py: Python<'_>) -> PyResult<Vec<Py<PySample>>> {
        let samples = self
            .samples
            .get_or_try_init(py, || self.write_samples(py))?;
        Ok(samples.iter().map(|s| s.clone_ref(py)).collect())
    }

    /// Where a later call's prompt left an earlier call's path.
    #[getter]
    fn divergences(&self, py: Python<'_>) -> Vec<Py<PyDivergence>> {
        self.divergences.iter().map(|s| s.clone_ref(py)).collect()
    }

    /// Counts describing the merge.
    #[getter]
    fn stats(&self, py: Python<'_>) -> Py<PyMergeStats> {
        self.stats.clone_ref(py)
    }

    /// The merged calls, in input order (what `call_index` and `gen_call` index).
    #[getter]
    fn calls(&self, py: Python<'_>) -> Vec<Py<PyCall>> {
        self.calls.iter().map(|c| c.clone_ref(py)).collect()
    }

    /// Every rollout of the merge: those passed in (or read from the store),
    /// including rollouts without trainable calls, then any other rollout of
    /// the calls in order of first appearance.
    #[getter]
    fn rollouts(&self, py: Python<'_>) -> Vec<Py<PyRolloutInfo>> {
        self.rollouts.iter().map(|r| r.clone_ref(py)).collect()
    }

    /// The packed-tree form of the same calls (same `max_tokens`). One tree per
    /// rollout; with `across_rollouts=True` one tree per `group` (calls whose
    /// group is None stay in their rollout's tree), so a group's shared prompt
    /// appears once and `gen_call` says which call generated each token.
    #[pyo3(signature = (across_rollouts=false))]
    fn packed(&self, py: Python<'_>, across_rollouts: bool) -> PyResult<PyPackedTree> {
        let calls: Vec<Bound<'_, PyCall>> = self.calls.iter().map(|c| c.bind(py).clone()).collect();
        let views = views(&calls)?;
        let max_tokens = self.max_tokens;
        let index = &self.index;
        let plan = &self.plan;
        let (t, origin) = py
            .detach(|| index.pack(plan, &views, max_tokens, across_rollouts, &POOL))
            .map_err(|e| core_error(py, e))?;
        let rollout_ids = self
            .rollouts
            .iter()
            .map(|r| r.get().rollout_id.clone())
            .collect();
        PyPackedTree::new(py, t, origin, rollout_ids)
    }

    /// Seconds spent borrowing inputs and planning (GIL released), and, once
    /// `samples` was read, allocating, writing and wrapping them, for benchmarks.
    #[getter]
    fn _timings<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for (k, v) in self.plan_timings {
            d.set_item(k, v)?;
        }
        for (k, v) in self.sample_timings.get().into_iter().flatten() {
            d.set_item(k, v)?;
        }
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "MergeResult(samples={}, divergences={}, stats={})",
            self.plan.stats.samples,
            self.divergences.len(),
            self.stats.bind(py).get().__repr__(py)?
        ))
    }
}

/// The rollouts of a merge (`given`, then those only the calls name) and
/// every call's rollout, group and weight version (see `CallIndex::new`).
fn index_calls(
    py: Python<'_>,
    calls: &[Bound<'_, PyCall>],
    views: &[CallView<'_>],
    given: Vec<PyRolloutInfo>,
) -> PyResult<(Vec<PyRolloutInfo>, CallIndex)> {
    let keys: Vec<RolloutKey<'_>> = given
        .iter()
        .map(|r| RolloutKey {
            rollout_id: &r.rollout_id,
            group: r.group.as_deref(),
        })
        .collect();
    let versions: Vec<u64> = calls.iter().map(|c| c.get().weight_version).collect();
    let index = CallIndex::new(&keys, views, &versions).map_err(|e| core_error(py, e))?;
    drop(keys);
    let mut rollouts = given;
    for &i in &index.unlisted {
        let c = calls[i].get();
        rollouts.push(PyRolloutInfo::new(
            c.rollout_id.clone(),
            c.group.clone(),
            None,
            None,
            None,
        ));
    }
    Ok((rollouts, index))
}

/// The merge behind `merge_calls` and the store reads.
pub(crate) fn merge_pycalls(
    py: Python<'_>,
    pycalls: Vec<Bound<'_, PyCall>>,
    max_tokens: Option<usize>,
    tokenizer: Option<&Bound<'_, PyAny>>,
    rollouts: Vec<PyRolloutInfo>,
    skipped_calls: usize,
) -> PyResult<PyMergeResult> {
    let tokenizer = match tokenizer {
        None => None,
        Some(t) => Some(t.cast::<PyTokenizer>().map_err(|_| {
            PyTypeError::new_err(format!(
                "tokenizer must be a lightning.Tokenizer (e.g. lightning.Tokenizer.from_dir(model_dir)), got {}",
                t.get_type().name().map(|n| n.to_string()).unwrap_or_default()
            ))
        })?),
    };
    let t0 = Instant::now();
    let views = views(&pycalls)?;
    let t1 = Instant::now();
    let (rollouts, index) = index_calls(py, &pycalls, &views, rollouts)?;
    let mut plan = py
        .detach(|| lightning_core::plan(&views, max_tokens))
        .map_err(|e| core_error(py, e))?;
    if let Some(tok) = tokenizer {
        let tok = tok.get().core();
        py.detach(|| {
            lightning_core::drift::classify_divergences(&views, &mut plan.divergences, tok)
        })
        .map_err(|e| core_error(py, e))?;
    }
    let divergences = std::mem::take(&mut plan.divergences)
        .into_iter()
        .map(|d| {
            Py::new(
                py,
                PyDivergence {
                    rollout_id: d.rollout_id,
                    call_index: d.call_index,
                    position: d.position,
                    left_call_index: d.left_call_index,
                    kind: d.kind.as_str(),
                },
            )
        })
        .collect::<PyResult<Vec<_>>>()?;
    let s = &plan.stats;
    let stats = Py::new(
        py,
        PyMergeStats {
            calls: s.calls,
            rollouts: rollouts.len(),
            samples: s.samples,
            generated_tokens: s.generated_tokens,
            sample_tokens: s.sample_tokens,
            truncated_tokens: s.truncated_tokens,
            dropped_samples: s.dropped_samples,
            duplicates: s.duplicates,
            skipped_calls,
        },
    )?;
    drop(views);
    Ok(PyMergeResult {
        plan_timings: [
            ("borrow", (t1 - t0).as_secs_f64()),
            ("plan", plan.insert_seconds),
        ],
        plan,
        samples: PyOnceLock::new(),
        divergences,
        stats,
        calls: pycalls.into_iter().map(Bound::unbind).collect(),
        rollouts: rollouts
            .into_iter()
            .map(|r| Py::new(py, r))
            .collect::<PyResult<_>>()?,
        index: Arc::new(index),
        max_tokens,
        sample_timings: OnceLock::new(),
    })
}

/// `max_tokens` as the core takes it; at least 1.
pub(crate) fn max_tokens_arg(py: Python<'_>, max_tokens: Option<i64>) -> PyResult<Option<usize>> {
    match max_tokens {
        None => Ok(None),
        Some(m) if m >= 1 => Ok(Some(m as usize)),
        Some(m) => Err(invalid_call(
            py,
            format!("max_tokens = {m}; it must be at least 1 (or None for no limit)"),
        )),
    }
}

/// Merge calls into training samples with a radix trie per rollout (grouped by
/// `rollout_id`, input order kept within a rollout); the GIL is released while
/// merging. `max_tokens` cuts samples and reports what it cut. With a
/// `tokenizer`, every divergence's cause is classified (see `classify_drift`);
/// without one every kind is "unclassified". `rollouts` (optional) lists the
/// rollouts with group, mode, status and reward, in the order
/// `MergeResult.rollouts` keeps. Raises `InvalidCallError` (a `ValueError`)
/// naming the call index for an empty completion, logprobs whose length
/// differs from the completion's, or calls of one rollout that disagree on
/// `group` (with each other or with their rollout record).
#[pyfunction]
#[pyo3(signature = (calls, max_tokens=None, *, tokenizer=None, rollouts=None))]
fn merge_calls<'py>(
    py: Python<'py>,
    calls: &Bound<'py, PyAny>,
    max_tokens: Option<i64>,
    tokenizer: Option<&Bound<'py, PyAny>>,
    rollouts: Option<Vec<Bound<'py, PyRolloutInfo>>>,
) -> PyResult<PyMergeResult> {
    let max_tokens = max_tokens_arg(py, max_tokens)?;
    let mut pycalls: Vec<Bound<'_, PyCall>> = Vec::new();
    for (i, item) in calls.try_iter()?.enumerate() {
        let item = item?;
        match item.cast_into::<PyCall>() {
            Ok(c) => pycalls.push(c),
            Err(e) => {
                let ty = e.into_inner().get_type().name()?.to_string();
                return Err(PyTypeError::new_err(format!(
                    "calls[{i}] is a {ty}; merge_calls takes lightning.Call objects"
                )));
            }
        }
    }
    merge_pycalls(
        py,
        pycalls,
        max_tokens,
        tokenizer,
        rollouts
            .unwrap_or_default()
            .iter()
            .map(|r| r.get().clone())
            .collect(),
        0,
    )
}

/// Length of the common prefix of two uint32 arrays, compared with the merge's
/// own loop with the GIL released: `benches/merge.py` times it on arrays far
/// larger than the caches to measure the memory-bandwidth ceiling of a merge.
#[pyfunction]
fn _common_prefix_u32(
    py: Python<'_>,
    a: numpy::PyReadonlyArray1<'_, u32>,
    b: numpy::PyReadonlyArray1<'_, u32>,
) -> PyResult<usize> {
    let (a, b) = (a.as_slice()?, b.as_slice()?);
    Ok(py.detach(|| lightning_core::trie::lcp(a, b)))
}

/// Total common-prefix length of each pair `(a[i], b[i])` and the seconds the
/// compares took, on one thread with the GIL released. `benches/merge.py` pairs
/// every call's prompt with its rollout's previous call: the least reading any
/// prefix merge does on input laid out as one array per call (no trie, no
/// output; see `lightning_core::lcp_pairs`).
#[pyfunction]
fn _common_prefix_pairs_u32(
    py: Python<'_>,
    a: Vec<numpy::PyReadonlyArray1<'_, u32>>,
    b: Vec<numpy::PyReadonlyArray1<'_, u32>>,
) -> PyResult<(usize, f64)> {
    if a.len() != b.len() {
        return Err(invalid_call(
            py,
            format!("{} arrays against {}", a.len(), b.len()),
        ));
    }
    let pairs = a
        .iter()
        .zip(&b)
        .map(|(x, y)| Ok((x.as_slice()?, y.as_slice()?)))
        .collect::<PyResult<Vec<(&[u32], &[u32])>>>()?;
    Ok(py.detach(|| {
        let t = Instant::now();
        let n = lightning_core::lcp_pairs(&pairs);
        (n, t.elapsed().as_secs_f64())
    }))
}

/// The packed tree of plain token sequences: one forest in which every shared
/// prefix appears once (the training layout for samples that come without
/// their calls). Empty sequences are skipped; the GIL is released while packing.
#[pyfunction]
fn pack_sequences(py: Python<'_>, sequences: &Bound<'_, PyAny>) -> PyResult<PyPackedTree> {
    let mut owned = Vec::new();
    for (i, item) in sequences.try_iter()?.enumerate() {
        let ids = to_ids(&item?, &format!("sequences[{i}]"))?.map_err(|m| invalid_call(py, m))?;
        owned.push(ids);
    }
    let bound: Vec<_> = owned.iter().map(|a| a.bind(py).readonly()).collect();
    let slices = bound
        .iter()
        .map(|a| a.as_slice().map_err(|e| invalid_call(py, e.to_string())))
        .collect::<PyResult<Vec<&[u32]>>>()?;
    let packed = py.detach(|| lightning_core::pack_sequences(&slices));
    PyPackedTree::from_core(py, packed)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(_common_prefix_u32, m)?)?;
    m.add_function(wrap_pyfunction!(_common_prefix_pairs_u32, m)?)?;
    m.add_class::<PyCall>()?;
    m.add_class::<PySample>()?;
    m.add_class::<PyDivergence>()?;
    m.add_class::<PyRolloutInfo>()?;
    m.add_class::<PyMergeStats>()?;
    m.add_class::<PyPackedTree>()?;
    m.add_class::<PyMergeResult>()?;
    m.add_function(wrap_pyfunction!(merge_calls, m)?)?;
    m.add_function(wrap_pyfunction!(pack_sequences, m)?)?;
    Ok(())
}
