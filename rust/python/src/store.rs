//! Bindings for the store reader (`lightning_gateway::store::reader`): the one path
//! from the SQLite file to Python. Every read releases the GIL; token vectors
//! read from the store become numpy arrays without a copy.

use std::path::PathBuf;

use lightning_gateway::config::SyncMode;
use lightning_gateway::store::online::{SessionFilter, SessionPage};
use lightning_gateway::store::{Reader, SecretSource, Selection, Store};
use lightning_gateway::GatewayError;
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
    /// fixes the order. Without ids: creation order, one keyset page at a time
    /// (`after` a rollout id, at most `limit`), read through an index.
    #[pyo3(signature = (rollout_ids=None, *, group=None, status=None, mode=None, after=None, limit=None))]
    #[allow(clippy::too_many_arguments)]
    fn rollouts<'py>(
        &self,
        py: Python<'py>,
        rollout_ids: Option<Vec<String>>,
        group: Option<String>,
        status: Option<String>,
        mode: Option<String>,
        after: Option<String>,
        limit: Option<i64>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        if rollout_ids.is_some() && (after.is_some() || limit.is_some()) {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "rollouts(): `after`/`limit` page the creation order; give them or `rollout_ids`, not both",
            ));
        }
        if limit.is_some_and(|n| n < 0) {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "rollouts(): limit={limit:?} must be >= 0 (or None: all)"
            )));
        }
        let sel = Selection {
            rollout_ids,
            group,
            status,
            mode,
            after,
            limit,
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

    /// Online sessions last active in `[since, until)`, oldest activity
    /// first, as dicts (rollout_id, key_id, app_key, session_key, task_json,
    /// n_calls, started, updated, closed, trained).
    #[pyo3(signature = (*, since=None, until=None))]
    fn sessions<'py>(
        &self,
        py: Python<'py>,
        since: Option<f64>,
        until: Option<f64>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let filter = SessionFilter {
            updated_from: since,
            updated_before: until,
            oldest_first: true,
            limit: -1,
            ..SessionFilter::default()
        };
        let rows = py
            .detach(|| self.inner.sessions(&filter))
            .map_err(|e| gateway_error(py, e))?;
        rows.into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("rollout_id", r.session_id)?;
                d.set_item("key_id", r.key_id)?;
                d.set_item("app_key", r.key_name)?;
                d.set_item("session_key", r.session_key)?;
                d.set_item("task_json", r.task)?;
                d.set_item("n_calls", r.n_calls)?;
                d.set_item("started", r.started)?;
                d.set_item("updated", r.updated)?;
                d.set_item("closed", r.closed)?;
                d.set_item("trained", r.trained)?;
                Ok(d)
            })
            .collect()
    }

    /// Rollouts per mode and status, as `(mode, status, count)`, by one SQL aggregate.
    fn rollout_counts(&self, py: Python<'_>) -> PyResult<Vec<(String, String, i64)>> {
        py.detach(|| self.inner.rollout_counts())
            .map_err(|e| gateway_error(py, e))
    }

    /// Calls per `bucket_s` over the `window_s` ending at the latest call:
    /// `{"end": float | None, "bucket_s": float, "buckets": [(start, calls,
    /// upstream_errors, aborted), ...]}`, empty buckets included.
    #[pyo3(signature = (*, window_s=600.0, bucket_s=5.0))]
    fn call_rate<'py>(
        &self,
        py: Python<'py>,
        window_s: f64,
        bucket_s: f64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let rate = py
            .detach(|| self.inner.call_rate(window_s, bucket_s))
            .map_err(|e| gateway_error(py, e))?;
        let d = PyDict::new(py);
        d.set_item("end", rate.end)?;
        d.set_item("bucket_s", rate.bucket_s)?;
        let buckets: Vec<(f64, i64, i64, i64)> = rate
            .buckets
            .into_iter()
            .map(|b| (b.start, b.calls, b.upstream_errors, b.aborted))
            .collect();
        d.set_item("buckets", buckets)?;
        Ok(d)
    }

    /// One page of online sessions, newest activity first, as dicts
    /// (rollout_id, key_id, app_key, session_key, user, task_json, n_calls,
    /// started, updated, closed, trained, feedback = number of signals).
    /// `key` is a key's id or name; `feedback`/`trained` select with (True)
    /// or without (False); `after` is the last session of the previous page.
    #[pyo3(signature = (*, after=None, limit=50, key=None, tag=None, feedback=None, trained=None))]
    #[allow(clippy::too_many_arguments)]
    fn session_page<'py>(
        &self,
        py: Python<'py>,
        after: Option<String>,
        limit: i64,
        key: Option<String>,
        tag: Option<String>,
        feedback: Option<bool>,
        trained: Option<bool>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        if limit < 0 {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "session_page(): limit={limit} must be >= 0"
            )));
        }
        let page = SessionPage {
            key,
            tag,
            with_feedback: feedback,
            trained,
            after,
            limit,
        };
        let rows = py
            .detach(|| self.inner.session_page(&page))
            .map_err(|e| gateway_error(py, e))?;
        rows.into_iter()
            .map(|r| {
                let d = PyDict::new(py);
                d.set_item("rollout_id", r.session_id)?;
                d.set_item("key_id", r.key_id)?;
                d.set_item("app_key", r.key_name)?;
                d.set_item("session_key", r.session_key)?;
                d.set_item("user", r.user)?;
                d.set_item("task_json", r.task)?;
                d.set_item("n_calls", r.n_calls)?;
                d.set_item("started", r.started)?;
                d.set_item("updated", r.updated)?;
                d.set_item("closed", r.closed)?;
                d.set_item("trained", r.trained)?;
                d.set_item("feedback", r.feedback)?;
                Ok(d)
            })
            .collect()
    }

    /// A session's feedback signals in timestamp, then arrival, order, as
    /// dicts (feedback_id, response_id, name, value, ts, after_training, data_json).
    fn feedback<'py>(
        &self,
        py: Python<'py>,
        rollout_id: &str,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let rows = py
            .detach(|| self.inner.feedback(rollout_id))
            .map_err(|e| gateway_error(py, e))?;
        rows.into_iter()
            .map(|f| {
                let d = PyDict::new(py);
                d.set_item("feedback_id", f.feedback_id)?;
                d.set_item("response_id", f.response_id)?;
                d.set_item("name", f.name)?;
                d.set_item("value", f.value)?;
                d.set_item("ts", f.ts)?;
                d.set_item("after_training", f.after_training)?;
                d.set_item("data_json", f.data)?;
                Ok(d)
            })
            .collect()
    }

    /// Each call's `(seq, protocol, harness_request, response_id)` in seq
    /// order (the harness request is on a request's first choice only).
    #[allow(clippy::type_complexity)]
    fn call_bodies(
        &self,
        py: Python<'_>,
        rollout_id: &str,
    ) -> PyResult<Vec<(i64, Option<String>, Option<String>, Option<String>)>> {
        let rows = py
            .detach(|| self.inner.call_bodies(rollout_id))
            .map_err(|e| gateway_error(py, e))?;
        Ok(rows
            .into_iter()
            .map(|c| (c.seq, c.protocol, c.harness_request, c.response_id))
            .collect())
    }

    /// Each call's `(seq, engine_request, harness_request)` in seq order, whole
    /// however the store keeps them (`""` and `None` on a request's later choices).
    fn requests(
        &self,
        py: Python<'_>,
        rollout_id: &str,
    ) -> PyResult<Vec<(i64, String, Option<String>)>> {
        py.detach(|| self.inner.requests(rollout_id))
            .map_err(|e| gateway_error(py, e))
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
    fn read_step(
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
            ..Selection::default()
        };
        let data = py
            .detach(|| self.inner.read_step(&sel))
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

/// `Ok` when a file is at `path`: a writer opened on a wrong path would
/// create an empty store there instead of saying the path is wrong.
fn existing_store(path: &std::path::Path) -> Result<(), GatewayError> {
    if path.is_file() {
        return Ok(());
    }
    Err(GatewayError::store(
        path.display(),
        "no gateway store here; pass the --db path the gateway was started with",
    ))
}

/// Marks online sessions trained at `when` in the store file at `path` of a
/// gateway that is not running, through the store's own writer (the same code
/// the gateway's `POST /admin/online/trained` runs); returns how many it found.
#[pyfunction]
fn mark_trained(
    py: Python<'_>,
    path: PathBuf,
    rollout_ids: Vec<String>,
    when: f64,
) -> PyResult<usize> {
    let run = || -> Result<usize, GatewayError> {
        existing_store(&path)?;
        let store = Store::open(&path, SyncMode::Full, SecretSource::None)?;
        let rt = tokio::runtime::Builder::new_current_thread().build()?;
        let n = rt.block_on(store.mark_trained(rollout_ids, when));
        store.close();
        n
    };
    py.detach(run).map_err(|e| gateway_error(py, e))
}

/// Checks that a writer could open the store file at `path` now (no gateway
/// writes it): takes the writer's lock and gives it back, opening no database
/// connection. Raises `StoreLocked` naming the writer's pid otherwise.
#[pyfunction]
fn check_writable(py: Python<'_>, path: PathBuf) -> PyResult<()> {
    let run = || -> Result<(), GatewayError> {
        existing_store(&path)?;
        lightning_gateway::store::check_writable(&path)
    };
    py.detach(run).map_err(|e| gateway_error(py, e))
}

/// Whether a store writer or reader of this process (an in-process gateway,
/// `StoreReader`, `mark_trained`) has the file at `path` open now, under any
/// of its names. Another SQLite library (Python's `sqlite3`) must not open
/// the file then: closing its connection would delete the `-wal` the store
/// still writes to and drop the store's locks (`lightning/gateway/store_guard.py`).
#[pyfunction]
fn store_open_here(path: PathBuf) -> bool {
    lightning_gateway::store::open_here(&path)
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyStoreReader>()?;
    m.add_function(wrap_pyfunction!(store_open_here, m)?)?;
    m.add_function(wrap_pyfunction!(mark_trained, m)?)?;
    m.add_function(wrap_pyfunction!(check_writable, m)?)?;
    Ok(())
}
