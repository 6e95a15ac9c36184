//! Bindings for the store reader (`lightning_gateway::store::reader`): the one path
//! from the SQLite file to Python. Every read releases the GIL; token vectors
//! read from the store become numpy arrays without a copy.

use std::path::PathBuf;

use lightning_gateway::store::{Reader, Selection};
use numpy::IntoPyArray;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::gateway_error;
use crate::merge::{max_tokens_arg, merge_pycalls, PyCall, PyMergeResult, PyRolloutInfo};

/// A read-only connection to a gateway's store file (safe beside a running
/// gateway: WAL mode shows every committed call). Used by `lightning.Store`.
#[pyclass(name = "StoreReader", module = "lightning._core", frozen)]
#[derive(Debug)]
pub struct PyStoreReader {
    inner: Reader,
}

#[pymethods]
impl PyStoreReader {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = py
            .detach(|| Reader::open(&path))
            .map_err(|e| gateway_error(py, e))?;
        Ok(PyStoreReader { inner })
    }

    /// Rollouts as dicts (rollout_id, group, task_json, mode, status, reward,
    /// created, updated), filtered by every given argument; `rollout_ids` also
    /// fixes the order.
    #[pyo3(signature = (rollout_ids=None, *, group=None, status=None, mode=None))]
    fn rollouts<'py>(
        &self,
        py: Python<'py>,
        rollout_ids: Option<Vec<String>>,
        group: Option<String>,
        status: Option<String>,
        mode: Option<String>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let sel = Selection {
            rollout_ids,
            group,
            status,
            mode,
        };
        let rows = py
            .detach(|| self.inner.rollouts(&sel))
            .map_err(|e| gateway_error(py, e))?;
        rows.into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("rollout_id", r.rollout_id)?;
                d.set_item("group", r.group)?;
                d.set_item("task_json", r.task)?;
                d.set_item("mode", r.mode)?;
                d.set_item("status", r.status)?;
                d.set_item("reward", r.reward)?;
                d.set_item("created", r.created)?;
                d.set_item("updated", r.updated)?;
                Ok(d)
            })
            .collect()
    }

    /// Every recorded call of a rollout in seq order, as dicts of the store's
    /// columns (ids and logprobs as numpy arrays; usage as JSON text).
    fn records<'py>(&self, py: Python<'py>, rollout_id: &str) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let rows = py
            .detach(|| self.inner.records(rollout_id))
            .map_err(|e| gateway_error(py, e))?;
        rows.into_iter()
            .map(|c| {
                let d = PyDict::new(py);
                d.set_item("rollout_id", rollout_id)?;
                d.set_item("seq", c.seq)?;
                d.set_item("request_id", c.request_id)?;
                d.set_item("choice_index", c.choice_index)?;
                d.set_item("kind", c.kind)?;
                d.set_item("prompt_ids", c.prompt_ids.map(|v| v.into_pyarray(py)))?;
                d.set_item(
                    "completion_ids",
                    c.completion_ids.map(|v| v.into_pyarray(py)),
                )?;
                d.set_item("logprobs", c.logprobs.map(|v| v.into_pyarray(py)))?;
                d.set_item("finish_reason", c.finish_reason)?;
                d.set_item("status", c.status)?;
                d.set_item("flags", c.flags)?;
                d.set_item("delivered", c.delivered)?;
                d.set_item("retry_count", c.retry_count)?;
                d.set_item("weight_version", c.weight_version)?;
                d.set_item("upstream", c.upstream)?;
                d.set_item("http_status", c.http_status)?;
                d.set_item("latency_ms", c.latency_ms)?;
                d.set_item("text", c.text)?;
                d.set_item("usage_json", c.usage.map(|u| u.to_string()))?;
                Ok(d)
            })
            .collect()
    }

    /// Every event of a rollout as `(seq, type, data_json, created)`.
    fn events(
        &self,
        py: Python<'_>,
        rollout_id: &str,
    ) -> PyResult<Vec<(i64, String, String, f64)>> {
        let rows = py
            .detach(|| self.inner.events(rollout_id))
            .map_err(|e| gateway_error(py, e))?;
        Ok(rows
            .into_iter()
            .map(|e| (e.seq, e.kind, e.data, e.created))
            .collect())
    }

    /// The calls of a rollout the harness saw whole, with exact ids.
    fn trace(&self, py: Python<'_>, rollout_id: &str) -> PyResult<Vec<PyCall>> {
        let calls = py
            .detach(|| self.inner.trace(rollout_id))
            .map_err(|e| gateway_error(py, e))?;
        calls
            .into_iter()
            .map(|c| PyCall::from_core(py, c))
            .collect()
    }

    /// A step's batch in one read transaction and one merge: the selected
    /// rollouts (with group, mode, status, latest reward) and their trainable
    /// calls, merged as `merge_calls` does.
    #[pyo3(signature = (rollout_ids=None, *, group=None, status=None, mode=None, max_tokens=None, tokenizer=None))]
    #[allow(clippy::too_many_arguments)]
    fn step(
        &self,
        py: Python<'_>,
        rollout_ids: Option<Vec<String>>,
        group: Option<String>,
        status: Option<String>,
        mode: Option<String>,
        max_tokens: Option<i64>,
        tokenizer: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyMergeResult> {
        let max_tokens = max_tokens_arg(py, max_tokens)?;
        let sel = Selection {
            rollout_ids,
            group,
            status,
            mode,
        };
        let data = py
            .detach(|| self.inner.step(&sel))
            .map_err(|e| gateway_error(py, e))?;
        let rollouts = data
            .rollouts
            .into_iter()
            .map(|r| PyRolloutInfo {
                rollout_id: r.rollout_id,
                group: r.group,
                mode: Some(r.mode),
                status: Some(r.status),
                reward: r.reward,
            })
            .collect();
        let calls = data
            .calls
            .into_iter()
            .map(|c| Bound::new(py, PyCall::from_core(py, c)?))
            .collect::<PyResult<Vec<_>>>()?;
        merge_pycalls(
            py,
            calls,
            max_tokens,
            tokenizer,
            rollouts,
            data.skipped_calls,
        )
    }

    fn __repr__(&self) -> String {
        format!("StoreReader({:?})", self.inner.path())
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStoreReader>()?;
    Ok(())
}
