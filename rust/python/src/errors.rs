//! The Python exception tree. `LightningError` is the root; specific errors also
//! subclass the builtin a Python user would expect to catch.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(_core, LightningError, PyException, "Root of all lightning errors.");
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
    m.add("TemplateError", m.py().get_type::<TemplateError>())?;
    m.add("TokenizerError", m.py().get_type::<TokenizerError>())?;
    Ok(())
}
