//! The Python exception tree. `LightningError` is the root; specific errors also
//! subclass the builtin a Python user would expect to catch.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    _core,
    LightningError,
    PyException,
    "Root of all lightning errors."
);

/// Exception classes with two bases (ours and a builtin), built with `type()`
/// because `create_exception!` takes a single base class.
static INVALID_CALL_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static GATEWAY_CONFIG_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();
static GATEWAY_BIND_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn two_base_type(
    py: Python<'_>,
    name: &str,
    doc: &str,
    ours: Bound<'_, PyType>,
    builtin: Bound<'_, PyType>,
) -> PyResult<Py<PyType>> {
    let bases = PyTuple::new(py, [ours.into_any(), builtin.into_any()])?;
    let ns = PyDict::new(py);
    ns.set_item("__module__", "lightning._core")?;
    ns.set_item("__doc__", doc)?;
    let ty = py.get_type::<PyType>().call1((name, bases, ns))?;
    Ok(ty.cast_into::<PyType>()?.unbind())
}

fn invalid_call_type(py: Python<'_>) -> PyResult<&Py<PyType>> {
    INVALID_CALL_ERROR.get_or_try_init(py, || {
        two_base_type(
            py,
            "InvalidCallError",
            "A call's data cannot be merged (bad ids, lengths that disagree, ...). A ValueError.",
            py.get_type::<LightningError>(),
            py.get_type::<PyValueError>(),
        )
    })
}

fn gateway_config_type(py: Python<'_>) -> PyResult<&Py<PyType>> {
    GATEWAY_CONFIG_ERROR.get_or_try_init(py, || {
        two_base_type(
            py,
            "GatewayConfigError",
            "The gateway configuration is invalid (the message names the field). A ValueError.",
            py.get_type::<GatewayError>(),
            py.get_type::<PyValueError>(),
        )
    })
}

fn gateway_bind_type(py: Python<'_>) -> PyResult<&Py<PyType>> {
    GATEWAY_BIND_ERROR.get_or_try_init(py, || {
        two_base_type(
            py,
            "GatewayBindError",
            "The gateway cannot listen on its address (port in use, no permission). An OSError.",
            py.get_type::<GatewayError>(),
            py.get_type::<PyOSError>(),
        )
    })
}

fn raise(ty: PyResult<&Py<PyType>>, py: Python<'_>, message: String) -> PyErr {
    match ty {
        Ok(ty) => PyErr::from_type(ty.bind(py).clone(), message),
        Err(e) => e,
    }
}

/// Map the gateway crate's error enum onto the Python tree, keeping its kind.
pub fn gateway_error(py: Python<'_>, err: lightning_gateway::GatewayError) -> PyErr {
    use lightning_gateway::GatewayError as E;
    let message = err.to_string();
    match err {
        E::Config(_) => raise(gateway_config_type(py), py, message),
        E::Bind { .. } => raise(gateway_bind_type(py), py, message),
        E::Store { .. } | E::StoreClosed | E::StoreUnwritable { .. } | E::StoreLocked { .. } => {
            StoreError::new_err(message)
        }
        E::Io(_) => GatewayError::new_err(message),
    }
}

/// Raise `InvalidCallError` (a `ValueError`) with `message`.
pub fn invalid_call(py: Python<'_>, message: String) -> PyErr {
    raise(invalid_call_type(py), py, message)
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
    StoreError,
    GatewayError,
    "The trace store cannot be opened or read (the message names the file)."
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
    // `create_exception!` names the module `_core`; tracebacks and pickling
    // should say where the class lives.
    let py = m.py();
    for ty in [
        py.get_type::<LightningError>(),
        py.get_type::<GatewayError>(),
        py.get_type::<StoreError>(),
        py.get_type::<TemplateError>(),
        py.get_type::<TokenizerError>(),
    ] {
        ty.setattr("__module__", "lightning._core")?;
    }
    m.add("LightningError", m.py().get_type::<LightningError>())?;
    m.add("InvalidCallError", invalid_call_type(m.py())?.bind(m.py()))?;
    m.add("GatewayError", m.py().get_type::<GatewayError>())?;
    m.add(
        "GatewayConfigError",
        gateway_config_type(m.py())?.bind(m.py()),
    )?;
    m.add("GatewayBindError", gateway_bind_type(m.py())?.bind(m.py()))?;
    m.add("StoreError", m.py().get_type::<StoreError>())?;
    m.add("TemplateError", m.py().get_type::<TemplateError>())?;
    m.add("TokenizerError", m.py().get_type::<TokenizerError>())?;
    Ok(())
}
