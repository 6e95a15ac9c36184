//! The Python exception tree. `LightningError` is the root; specific errors also
//! subclass the builtin a Python user would expect to catch.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    _core,
    LightningError,
    PyException,
    "Root of all lightning errors."
);

/// `InvalidCallError(LightningError, ValueError)`: bad call data. Built with
/// `type()` because `create_exception!` takes a single base class.
static INVALID_CALL_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn value_error_type(py: Python<'_>, name: &str, doc: &str) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(
        py,
        [
            py.get_type::<LightningError>().into_any(),
            py.get_type::<PyValueError>().into_any(),
        ],
    )?;
    let ns = PyDict::new(py);
    ns.set_item("__module__", "lightning._core")?;
    ns.set_item("__doc__", doc)?;
    let ty = py.get_type::<PyType>().call1((name, bases, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

fn invalid_call_type(py: Python<'_>) -> PyResult<&Py<PyType>> {
    INVALID_CALL_ERROR.get_or_try_init(py, || {
        value_error_type(
            py,
            "InvalidCallError",
            "A call's data cannot be merged (bad ids, lengths that disagree, ...). A ValueError.",
        )
    })
}

/// Raise `InvalidCallError` (a `ValueError`) with `message`.
pub fn invalid_call(py: Python<'_>, message: String) -> PyErr {
    match invalid_call_type(py) {
        Ok(ty) => PyErr::from_type(ty.bind(py).clone(), message),
        Err(e) => e,
    }
}

/// Map lightning-core's error enum onto the Python tree (the one place that does).
pub fn core_error(py: Python<'_>, err: lightning_core::CoreError) -> PyErr {
    use lightning_core::CoreError;
    match err {
        CoreError::InvalidCall { .. } | CoreError::InvalidOption(_) => {
            invalid_call(py, err.to_string())
        }
        CoreError::Template(_) | CoreError::NoTemplate => TemplateError::new_err(err.to_string()),
        CoreError::TokenizerLoad { .. } | CoreError::Tokenize(_) | CoreError::InvalidInput(_) => {
            TokenizerError::new_err(err.to_string())
        }
    }
}

create_exception!(
    _core,
    GatewayError,
    LightningError,
    "The gateway could not start or run (bad config, port in use, store failure)."
);
create_exception!(
    _core,
    TemplateError,
    LightningError,
    "A chat template failed to compile or raised (the template's own message)."
);
create_exception!(
    _core,
    TokenizerError,
    LightningError,
    "A tokenizer could not be loaded (bad JSON names the path) or failed to encode/decode."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LightningError", m.py().get_type::<LightningError>())?;
    m.add("InvalidCallError", invalid_call_type(m.py())?.bind(m.py()))?;
    m.add("GatewayError", m.py().get_type::<GatewayError>())?;
    m.add("TemplateError", m.py().get_type::<TemplateError>())?;
    m.add("TokenizerError", m.py().get_type::<TokenizerError>())?;
    Ok(())
}
