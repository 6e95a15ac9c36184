//! The private native module `lightning._core`: thin, typed bindings over
//! lightning-core and lightning-gateway. Public names are re-exported by
//! `lightning/__init__.py`; users never import this module directly.
//!
//! Each concern registers its classes from its own file so work on one does not
//! touch the others.

use pyo3::prelude::*;

mod arrays;
mod errors;
mod gateway;
mod merge;
mod store;
mod tokenizer;

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    errors::register(m)?;
    arrays::register(m)?;
    merge::register(m)?;
    gateway::register(m)?;
    tokenizer::register(m)?;
    store::register(m)?;
    Ok(())
}
