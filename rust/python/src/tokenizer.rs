//! Python bindings for the tokenizer, chat templates, splicing and drift
//! classification (`lightning_core::{tokenizer, template, retokenize, drift}`).
//!
//! Files are read here (the core takes contents, not paths). Messages cross as
//! Python dicts/lists and are converted to JSON values once; ids leave as
//! numpy uint32 arrays. Rendering and encoding release the GIL.

use std::path::{Path, PathBuf};

use lightning_core::drift::classify_drift as core_classify;
use lightning_core::retokenize::{ChatInput, Generation};
use lightning_core::tokenizer::{Tokenizer as CoreTokenizer, TokenizerConfig};
use lightning_core::CoreError;
use numpy::PyArray1;
use pyo3::exceptions::{PyFileNotFoundError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde_json::{Map, Number, Value as Json};

use crate::arrays::ids_vec;

fn to_py(err: CoreError) -> PyErr {
    Python::attach(|py| crate::errors::core_error(py, err))
}

/// Convert plain Python data (dict/list/tuple/str/int/float/bool/None, numpy
/// arrays via `tolist`) to JSON, keeping dict order.
fn to_json(obj: &Bound<'_, PyAny>) -> PyResult<Json> {
    if obj.is_none() {
        return Ok(Json::Null);
    }
    if let Ok(b) = obj.cast::<PyBool>() {
        return Ok(Json::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(i) = obj.extract::<i64>() {
            return Ok(Json::from(i));
        }
        if let Ok(u) = obj.extract::<u64>() {
            return Ok(Json::from(u));
        }
        return Ok(Json::String(obj.str()?.to_string()));
    }
    if let Ok(f) = obj.cast::<PyFloat>() {
        return Ok(Number::from_f64(f.value()).map_or(Json::Null, Json::Number));
    }
    if let Ok(s) = obj.cast::<PyString>() {
        return Ok(Json::String(s.to_str()?.to_owned()));
    }
    if let Ok(d) = obj.cast::<PyDict>() {
        let mut m = Map::new();
        for (k, v) in d.iter() {
            let key = match k.cast::<PyString>() {
                Ok(s) => s.to_str()?.to_owned(),
                Err(_) => k.str()?.to_string(),
            };
            m.insert(key, to_json(&v)?);
        }
        return Ok(Json::Object(m));
    }
    if let Ok(l) = obj.cast::<PyList>() {
        return l
            .iter()
            .map(|x| to_json(&x))
            .collect::<PyResult<Vec<_>>>()
            .map(Json::Array);
    }
    if let Ok(t) = obj.cast::<PyTuple>() {
        return t
            .iter()
            .map(|x| to_json(&x))
            .collect::<PyResult<Vec<_>>>()
            .map(Json::Array);
    }
    if obj.hasattr("tolist")? {
        return to_json(&obj.call_method0("tolist")?);
    }
    if obj.hasattr("model_dump")? {
        return to_json(&obj.call_method0("model_dump")?);
    }
    let ty = obj.get_type().name()?.to_string();
    Err(PyTypeError::new_err(format!(
        "cannot pass a {ty} to a chat template; use dicts, lists, strings, numbers, bools and None"
    )))
}

fn messages_json(messages: &Bound<'_, PyAny>) -> PyResult<Vec<Json>> {
    match to_json(messages)? {
        Json::Array(v) => Ok(v),
        _ => Err(PyTypeError::new_err(
            "messages must be a list of dicts with 'role' and 'content'",
        )),
    }
}

fn kwargs_json(kwargs: Option<&Bound<'_, PyDict>>) -> PyResult<Map<String, Json>> {
    match kwargs {
        Some(d) => match to_json(d.as_any())? {
            Json::Object(m) => Ok(m),
            _ => Ok(Map::new()),
        },
        None => Ok(Map::new()),
    }
}

/// Token ids from Python through the one converter (`arrays::ids_vec`); bad
/// input is a `TypeError` naming the argument.
pub fn ids_arg(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Vec<u32>> {
    ids_vec(obj, field)?.map_err(PyTypeError::new_err)
}

fn read(path: &Path) -> PyResult<Vec<u8>> {
    std::fs::read(path)
        .map_err(|e| PyFileNotFoundError::new_err(format!("cannot read {}: {e}", path.display())))
}

/// Where one message sits in the rendered text (bytes) and in the ids.
#[pyclass(name = "MessageSpan", module = "lightning._core", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct PyMessageSpan {
    index: usize,
    role: String,
    byte_start: usize,
    byte_end: usize,
    token_start: usize,
    token_end: usize,
}

#[pymethods]
impl PyMessageSpan {
    fn __repr__(&self) -> String {
        format!(
            "MessageSpan(index={}, role={:?}, bytes={}..{}, tokens={}..{})",
            self.index, self.role, self.byte_start, self.byte_end, self.token_start, self.token_end
        )
    }
}

/// A prompt region that reuses an earlier generation's exact ids.
#[pyclass(name = "SplicedSpan", module = "lightning._core", frozen, get_all)]
#[derive(Debug, Clone)]
pub struct PySplicedSpan {
    generation: usize,
    byte_start: usize,
    byte_end: usize,
    token_start: usize,
    token_end: usize,
    plain_differs: bool,
}

#[pymethods]
impl PySplicedSpan {
    fn __repr__(&self) -> String {
        format!(
            "SplicedSpan(generation={}, tokens={}..{}, plain_differs={})",
            self.generation,
            self.token_start,
            self.token_end,
            if self.plain_differs { "True" } else { "False" }
        )
    }
}

/// The result of `Tokenizer.splice`.
#[pyclass(name = "SpliceResult", module = "lightning._core", frozen)]
#[derive(Debug)]
pub struct PySpliceResult {
    ids: Vec<u32>,
    #[pyo3(get)]
    text: String,
    #[pyo3(get)]
    spliced: Vec<PySplicedSpan>,
    #[pyo3(get)]
    unmatched: Vec<usize>,
}

#[pymethods]
impl PySpliceResult {
    /// The prompt ids (uint32).
    #[getter]
    fn ids<'py>(&self, py: Python<'py>) -> Bound<'py, PyArray1<u32>> {
        PyArray1::from_slice(py, &self.ids)
    }

    /// Spans where plain tokenization would have produced different ids.
    #[getter]
    fn prevented(&self) -> usize {
        self.spliced.iter().filter(|s| s.plain_differs).count()
    }
}

/// Why a later prompt left the earlier context (see `classify_drift`).
#[pyclass(name = "Drift", module = "lightning._core", frozen, get_all)]
#[derive(Debug)]
pub struct PyDrift {
    kind: String,
    position: usize,
    text_offset: usize,
    detail: String,
}

#[pymethods]
impl PyDrift {
    fn __repr__(&self) -> String {
        format!(
            "Drift(kind={:?}, position={}, detail={:?})",
            self.kind, self.position, self.detail
        )
    }
}

/// A HF tokenizer (`tokenizer.json`) with its chat template, rendered and
/// encoded in Rust byte for byte like transformers.
#[pyclass(name = "Tokenizer", module = "lightning._core", frozen)]
#[derive(Debug)]
pub struct PyTokenizer {
    inner: CoreTokenizer,
}

impl PyTokenizer {
    pub fn core(&self) -> &CoreTokenizer {
        &self.inner
    }
}

fn chat<'a>(
    messages: &'a [Json],
    tools: Option<&'a Json>,
    add_generation_prompt: bool,
    kwargs: Map<String, Json>,
) -> ChatInput<'a> {
    ChatInput {
        messages,
        tools,
        add_generation_prompt,
        kwargs,
    }
}

#[pymethods]
impl PyTokenizer {
    /// Load a `tokenizer.json` file; `chat_template` (template source) is optional.
    #[staticmethod]
    #[pyo3(signature = (path, chat_template=None))]
    fn from_file(path: PathBuf, chat_template: Option<String>) -> PyResult<Self> {
        let bytes = read(&path)?;
        let inner =
            CoreTokenizer::from_parts(&bytes, None, chat_template, &path.display().to_string())
                .map_err(to_py)?;
        Ok(Self { inner })
    }

    /// Load a model directory: `tokenizer.json`, `tokenizer_config.json`
    /// (special tokens, `chat_template`), and `chat_template.jinja` if present
    /// (it wins, as in transformers). `chat_template` overrides both.
    #[staticmethod]
    #[pyo3(signature = (path, chat_template=None))]
    fn from_dir(path: PathBuf, chat_template: Option<String>) -> PyResult<Self> {
        let tj = path.join("tokenizer.json");
        let bytes = read(&tj)?;
        let cfg_path = path.join("tokenizer_config.json");
        let config = if cfg_path.exists() {
            Some(
                TokenizerConfig::from_json_bytes(
                    &read(&cfg_path)?,
                    &cfg_path.display().to_string(),
                )
                .map_err(to_py)?,
            )
        } else {
            None
        };
        let jinja = path.join("chat_template.jinja");
        let template = match chat_template {
            Some(t) => Some(t),
            None if jinja.exists() => Some(String::from_utf8_lossy(&read(&jinja)?).into_owned()),
            None => None,
        };
        let inner = CoreTokenizer::from_parts(&bytes, config, template, &tj.display().to_string())
            .map_err(to_py)?;
        Ok(Self { inner })
    }

    /// The chat template source, or None.
    #[getter]
    fn chat_template(&self) -> Option<String> {
        self.inner.config().chat_template.clone()
    }

    #[getter]
    fn bos_token(&self) -> Option<String> {
        self.inner.config().bos_token.clone()
    }

    #[getter]
    fn eos_token(&self) -> Option<String> {
        self.inner.config().eos_token.clone()
    }

    /// Whether segment-wise (cached) encoding is exact for this tokenizer.
    #[getter]
    fn segment_safe(&self) -> bool {
        self.inner.segment_safe()
    }

    /// Whether segments take the cached word path (byte-level BPE whose
    /// pre-tokenizer it reproduces; checked against the full pipeline at load).
    #[getter]
    fn word_path(&self) -> bool {
        self.inner.word_path()
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Whether `id` is a special added (control) token.
    fn is_special(&self, id: u32) -> bool {
        self.inner.is_special(id)
    }

    /// Encode text like `tokenizer(text, add_special_tokens=...)["input_ids"]`.
    #[pyo3(signature = (text, add_special_tokens=false))]
    fn encode<'py>(
        &self,
        py: Python<'py>,
        text: &str,
        add_special_tokens: bool,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let ids = py
            .detach(|| self.inner.encode(text, add_special_tokens))
            .map_err(to_py)?;
        Ok(PyArray1::from_vec(py, ids))
    }

    #[pyo3(signature = (texts, add_special_tokens=false))]
    fn encode_batch<'py>(
        &self,
        py: Python<'py>,
        texts: Vec<String>,
        add_special_tokens: bool,
    ) -> PyResult<Vec<Bound<'py, PyArray1<u32>>>> {
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        let out = py
            .detach(|| self.inner.encode_batch(&refs, add_special_tokens))
            .map_err(to_py)?;
        Ok(out.into_iter().map(|v| PyArray1::from_vec(py, v)).collect())
    }

    #[pyo3(signature = (ids, skip_special_tokens=false))]
    fn decode(
        &self,
        py: Python<'_>,
        ids: &Bound<'_, PyAny>,
        skip_special_tokens: bool,
    ) -> PyResult<String> {
        let ids = ids_arg(ids, "ids")?;
        py.detach(|| self.inner.decode(&ids, skip_special_tokens))
            .map_err(to_py)
    }

    /// Render like `apply_chat_template(messages, tokenize=False, ...)`.
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=false, **kwargs))]
    fn render_chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        let msgs = messages_json(messages)?;
        let tools = tools.map(to_json).transpose()?;
        let kw = kwargs_json(kwargs)?;
        let input = chat(&msgs, tools.as_ref(), add_generation_prompt, kw);
        py.detach(|| self.inner.render_chat(&input)).map_err(to_py)
    }

    /// Render and encode like `apply_chat_template(messages, tokenize=True, ...)`.
    /// With `protect_content=True`, control-token text in any input string
    /// (message fields, tool specs, template kwargs) stays text while the
    /// template's own markup still becomes control tokens: the ids of
    /// `apply_chat_template(..., sanitize_control_tokens=True)`.
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=false, protect_content=false, **kwargs))]
    fn encode_chat<'py>(
        &self,
        py: Python<'py>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        protect_content: bool,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Bound<'py, PyArray1<u32>>> {
        let msgs = messages_json(messages)?;
        let tools = tools.map(to_json).transpose()?;
        let kw = kwargs_json(kwargs)?;
        let input = chat(&msgs, tools.as_ref(), add_generation_prompt, kw);
        let (_, ids) = py
            .detach(|| self.inner.encode_chat(&input, protect_content))
            .map_err(to_py)?;
        Ok(PyArray1::from_vec(py, ids))
    }

    /// Per-message spans: (message index, role, byte range, token range).
    #[pyo3(signature = (messages, tools=None, add_generation_prompt=false, **kwargs))]
    fn chat_spans(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Vec<PyMessageSpan>> {
        let msgs = messages_json(messages)?;
        let tools = tools.map(to_json).transpose()?;
        let kw = kwargs_json(kwargs)?;
        let input = chat(&msgs, tools.as_ref(), add_generation_prompt, kw);
        let (_, _, spans) = py.detach(|| self.inner.chat_spans(&input)).map_err(to_py)?;
        Ok(spans
            .into_iter()
            .map(|s| PyMessageSpan {
                index: s.index,
                role: s.role,
                byte_start: s.byte_start,
                byte_end: s.byte_end,
                token_start: s.token_start,
                token_end: s.token_end,
            })
            .collect())
    }

    /// Prompt ids whose assistant turns reuse earlier generations' exact ids.
    /// `generations`: earlier calls of the rollout, in order — each a
    /// `lightning.Call` (its `completion_ids`) or a sequence of ids. The
    /// text around them is encoded as `encode_chat` does, protected by default.
    #[pyo3(signature = (messages, generations, tools=None, add_generation_prompt=true, protect_content=true, **kwargs))]
    #[allow(clippy::too_many_arguments)]
    fn splice(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        generations: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        protect_content: bool,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<PySpliceResult> {
        let msgs = messages_json(messages)?;
        let tools = tools.map(to_json).transpose()?;
        let kw = kwargs_json(kwargs)?;
        let mut gens = Vec::new();
        for (i, g) in generations.try_iter()?.enumerate() {
            let g = g?;
            let ids = if g.hasattr("completion_ids")? {
                ids_arg(
                    &g.getattr("completion_ids")?,
                    &format!("generations[{i}].completion_ids"),
                )?
            } else {
                ids_arg(&g, &format!("generations[{i}]"))?
            };
            gens.push(Generation {
                completion_ids: ids,
            });
        }
        let input = chat(&msgs, tools.as_ref(), add_generation_prompt, kw);
        let r = py
            .detach(|| self.inner.splice(&input, &gens, protect_content))
            .map_err(to_py)?;
        Ok(PySpliceResult {
            ids: r.ids,
            text: r.text,
            spliced: r
                .spliced
                .into_iter()
                .map(|s| PySplicedSpan {
                    generation: s.generation,
                    byte_start: s.byte_start,
                    byte_end: s.byte_end,
                    token_start: s.token_start,
                    token_end: s.token_end,
                    plain_differs: s.plain_differs,
                })
                .collect(),
            unmatched: r.unmatched,
        })
    }

    /// How many control tokens `text` would turn into if encoded in parity mode.
    fn count_control_tokens(&self, text: &str) -> usize {
        self.inner.count_control_tokens(text)
    }

    /// How many control tokens the messages' content would inject in parity mode.
    fn content_control_tokens(&self, messages: &Bound<'_, PyAny>) -> PyResult<usize> {
        Ok(self.inner.content_control_tokens(&messages_json(messages)?))
    }

    /// Forget cached segment encodings.
    fn clear_cache(&self) {
        self.inner.clear_cache();
    }
}

/// Classify why `next_ids` leaves `prev_ids` (an earlier call's prompt +
/// completion): `match`, `retokenization`, `reasoning_stripped`,
/// `tool_call_reserialized`, `truncated`, `separator`, `compacted` or `other`.
#[pyfunction]
pub fn classify_drift(
    py: Python<'_>,
    prev_ids: &Bound<'_, PyAny>,
    next_ids: &Bound<'_, PyAny>,
    tokenizer: &PyTokenizer,
) -> PyResult<PyDrift> {
    let prev = ids_arg(prev_ids, "prev_ids")?;
    let next = ids_arg(next_ids, "next_ids")?;
    let d = py
        .detach(|| core_classify(&prev, &next, &tokenizer.inner))
        .map_err(to_py)?;
    Ok(PyDrift {
        kind: d.kind.as_str().to_owned(),
        position: d.position,
        text_offset: d.text_offset,
        detail: d.detail,
    })
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyTokenizer>()?;
    m.add_class::<PyMessageSpan>()?;
    m.add_class::<PySplicedSpan>()?;
    m.add_class::<PySpliceResult>()?;
    m.add_class::<PyDrift>()?;
    m.add_function(wrap_pyfunction!(classify_drift, m)?)?;
    Ok(())
}
