//! The Python exception tree. `LightningError` is the root; specific errors also
//! subclass the builtin a Python user would expect to catch.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _core,
    LightningError,
    PyException,
    "Root of all lightning errors."
);
create_exception!(
    _core,
    GatewayError,
    LightningError,
    "The gateway could not start or run (bad config, port in use, store failure)."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("LightningError", m.py().get_type::<LightningError>())?;
    m.add("GatewayError", m.py().get_type::<GatewayError>())?;
    Ok(())
}
