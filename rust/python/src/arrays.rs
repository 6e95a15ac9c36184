//! Output arrays that go back to a pool when numpy is done with them.
//!
//! A merge's samples and packed trees are written into arrays from one
//! process-wide [`ArrayPool`]. Each is handed to numpy with a small owner object
//! as its base; when the last numpy view of it dies, the owner returns the
//! array to the pool, so the next step's result is written into memory that is
//! already faulted in instead of fresh pages the kernel must zero first.

use lightning_core::{AnyVec, ArrayPool, Plain};
use numpy::ndarray::ArrayView1;
use numpy::{Element, PyArray1};
use pyo3::prelude::*;

/// About two results' worth: a packed tree has ten token-length arrays, samples four.
pub static POOL: ArrayPool = ArrayPool::new(32);

/// Owns one pooled array while numpy arrays view it; returns it to [`POOL`] on drop.
#[pyclass(module = "lightning._core", frozen)]
struct PooledArray {
    data: Option<AnyVec>,
}

impl Drop for PooledArray {
    fn drop(&mut self) {
        if let Some(v) = self.data.take() {
            POOL.give(v);
        }
    }
}

/// `v` as a numpy array whose memory returns to [`POOL`] when the array and
/// every view of it are gone.
pub fn pooled<T: Plain + Element>(py: Python<'_>, v: Vec<T>) -> PyResult<Bound<'_, PyArray1<T>>> {
    let owner = Bound::new(
        py,
        PooledArray {
            data: Some(T::wrap(v)),
        },
    )?;
    let Some(data) = owner.get().data.as_ref().and_then(T::peek) else {
        unreachable!("an array wrapped as T reads back as T");
    };
    let view = ArrayView1::from(data.as_slice());
    // SAFETY: the vector is owned by `owner`, which becomes the array's base
    // object, so it outlives the array; it is never resized or moved out of
    // `owner` until `owner` is dropped, so its buffer stays where the array points.
    Ok(unsafe { PyArray1::borrow_from_array(&view, owner.clone().into_any()) })
}

/// Free the arrays that earlier merge results left for reuse; returns the bytes
/// released. Results still alive keep theirs. The pool holds at most about two
/// results' arrays, and hands one out only for a result of at least half its
/// size; call this when a process is done merging and wants the memory back.
#[pyfunction]
fn release_merge_buffers() -> usize {
    POOL.clear()
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(release_merge_buffers, m)?)?;
    Ok(())
}
