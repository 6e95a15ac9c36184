//! Arrays across the boundary: token ids and logprobs in (numpy buffers or
//! lists, checked and converted once), and output arrays out that go back to
//! a pool when numpy is done with them.
//!
//! A merge's samples and packed trees are written into arrays from one
//! process-wide [`ArrayPool`]. Each is handed to numpy with a small owner object
//! as its base; when the last numpy view of it dies, the owner returns the
//! array to the pool, so the next step's result is written into memory that is
//! already faulted in instead of fresh pages the kernel must zero first.

use lightning_core::{AnyVec, ArrayPool, Plain};
use numpy::ndarray::ArrayView1;
use numpy::{
    dtype, Element, IntoPyArray, PyArray1, PyArrayDescrMethods, PyArrayMethods, PyUntypedArray,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;
use pyo3::types::PyList;

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

const U32_RANGE: &str = "outside the uint32 token-id range [0, 4294967295]";

/// Convert a numpy integer array of element type `T` to token ids.
fn ids_from_typed<T>(arr: &Bound<'_, PyAny>, field: &str) -> Result<Option<Vec<u32>>, String>
where
    T: Element + Copy + TryInto<u32> + std::fmt::Display,
{
    let Ok(a) = arr.cast::<PyArray1<T>>() else {
        return Ok(None);
    };
    let ro = a
        .try_readonly()
        .map_err(|e| format!("{field} cannot be read: {e}"))?;
    let view = ro.as_array();
    let mut out = Vec::with_capacity(view.len());
    for (i, &v) in view.iter().enumerate() {
        match v.try_into() {
            Ok(x) => out.push(x),
            Err(_) => return Err(format!("{field}[{i}] = {v} is {U32_RANGE}")),
        }
    }
    Ok(Some(out))
}

/// Token ids from any Python sequence of ints (the list path: one extraction
/// per element, unavoidable for Python ints).
fn ids_from_sequence(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Result<Vec<u32>, String>> {
    let describe = |i: usize, item: &Bound<'_, PyAny>| -> String {
        let shown = item
            .repr()
            .map(|r| r.to_string())
            .unwrap_or_else(|_| "?".into());
        if item.is_instance_of::<pyo3::types::PyInt>() {
            format!("{field}[{i}] = {shown} is {U32_RANGE}")
        } else {
            let ty = item
                .get_type()
                .name()
                .map(|n| n.to_string())
                .unwrap_or_else(|_| "?".into());
            format!("{field}[{i}] = {shown} ({ty}) is not an integer; token ids must be integers")
        }
    };
    let mut out = Vec::new();
    if let Ok(list) = obj.cast::<PyList>() {
        out.reserve(list.len());
        for (i, item) in list.iter().enumerate() {
            match item.extract::<u32>() {
                Ok(v) => out.push(v),
                Err(_) => return Ok(Err(describe(i, &item))),
            }
        }
        return Ok(Ok(out));
    }
    let iter = match obj.try_iter() {
        Ok(it) => it,
        Err(_) => {
            let ty = obj.get_type().name()?.to_string();
            return Ok(Err(format!(
                "{field} must be a list or 1-D numpy array of integers, got {ty}"
            )));
        }
    };
    for (i, item) in iter.enumerate() {
        let item = item?;
        match item.extract::<u32>() {
            Ok(v) => out.push(v),
            Err(_) => return Ok(Err(describe(i, &item))),
        }
    }
    Ok(Ok(out))
}

/// Mark an array we created read-only: `Call` is immutable.
pub fn freeze<T: Element>(arr: Bound<'_, PyArray1<T>>) -> PyResult<Py<PyArray1<T>>> {
    arr.call_method1("setflags", (false,))?;
    Ok(arr.unbind())
}

/// Token ids as they came from Python: the caller's own uint32 array, or ids
/// converted into a fresh vector.
enum Ids<'py> {
    Shared(Bound<'py, PyArray1<u32>>),
    Converted(Vec<u32>),
}

/// The one place token ids cross from Python; `Err(String)` describes bad
/// input (each caller raises it as its own error). A C-contiguous uint32 array
/// is kept as is (no copy, like `np.asarray`), another integer array is
/// converted in one typed pass with each value range-checked, and only a list
/// (or an exotic dtype) is read per element.
fn parse_ids<'py>(obj: &Bound<'py, PyAny>, field: &str) -> PyResult<Result<Ids<'py>, String>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Ok(Err(format!(
                "{field} must be 1-D, got an array of shape {:?}",
                arr.shape()
            )));
        }
        let dt = arr.dtype();
        if dt.is_equiv_to(&dtype::<u32>(py)) && arr.is_c_contiguous() {
            return Ok(Ok(Ids::Shared(obj.cast::<PyArray1<u32>>()?.clone())));
        }
        if !matches!(dt.kind(), b'i' | b'u') {
            return Ok(Err(format!(
                "{field} is a numpy array of dtype {}; token ids must be integers",
                dt.str()?
            )));
        }
        macro_rules! try_type {
            ($($t:ty),*) => {$(
                match ids_from_typed::<$t>(obj, field) {
                    Ok(Some(v)) => return Ok(Ok(Ids::Converted(v))),
                    Ok(None) => {}
                    Err(e) => return Ok(Err(e)),
                }
            )*};
        }
        try_type!(i64, i32, u32, u64, u16, u8, i16, i8);
        // Non-native byte order or an exotic integer type: go through Python ints.
        let list = obj.call_method0("tolist")?;
        return Ok(ids_from_sequence(&list, field)?.map(Ids::Converted));
    }
    Ok(ids_from_sequence(obj, field)?.map(Ids::Converted))
}

/// Token ids as a uint32 numpy array (what a `Call` keeps): the caller's own
/// array when it already is one (zero copy: the `Call` shares its buffer),
/// else a fresh read-only one.
pub fn to_ids(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Result<Py<PyArray1<u32>>, String>> {
    Ok(match parse_ids(obj, field)? {
        Ok(Ids::Shared(a)) => Ok(a.unbind()),
        Ok(Ids::Converted(v)) => Ok(freeze(v.into_pyarray(obj.py()))?),
        Err(e) => Err(e),
    })
}

/// Token ids as a vector, for calls that only read them (decode, splice,
/// drift): the same conversion and messages as [`to_ids`].
pub fn ids_vec(obj: &Bound<'_, PyAny>, field: &str) -> PyResult<Result<Vec<u32>, String>> {
    Ok(match parse_ids(obj, field)? {
        Ok(Ids::Shared(a)) => match a.try_readonly() {
            // Shared only when C-contiguous, so the slice always exists.
            Ok(ro) => Ok(ro.as_array().iter().copied().collect()),
            Err(e) => Err(format!("{field} cannot be read: {e}")),
        },
        Ok(Ids::Converted(v)) => Ok(v),
        Err(e) => Err(e),
    })
}

/// Logprobs as a float32 numpy array; `Err(String)` describes bad input.
pub fn to_logprobs(obj: &Bound<'_, PyAny>) -> PyResult<Result<Py<PyArray1<f32>>, String>> {
    let py = obj.py();
    if let Ok(arr) = obj.cast::<PyUntypedArray>() {
        if arr.ndim() != 1 {
            return Ok(Err(format!(
                "logprobs must be 1-D, got an array of shape {:?}",
                arr.shape()
            )));
        }
        let dt = arr.dtype();
        if dt.is_equiv_to(&dtype::<f32>(py)) && arr.is_c_contiguous() {
            return Ok(Ok(obj.cast::<PyArray1<f32>>()?.clone().unbind()));
        }
        if !matches!(dt.kind(), b'f' | b'i' | b'u') {
            return Ok(Err(format!(
                "logprobs is a numpy array of dtype {}; logprobs must be floats",
                dt.str()?
            )));
        }
        let converted = obj.call_method1("astype", (dtype::<f32>(py),))?;
        let converted = converted.cast_into::<PyArray1<f32>>()?;
        return Ok(Ok(freeze(converted)?));
    }
    let iter = match obj.try_iter() {
        Ok(it) => it,
        Err(_) => {
            let ty = obj.get_type().name()?.to_string();
            return Ok(Err(format!(
                "logprobs must be a list or 1-D numpy array of floats, got {ty}"
            )));
        }
    };
    let mut out = Vec::new();
    for (i, item) in iter.enumerate() {
        let item = item?;
        match item.extract::<f64>() {
            Ok(v) => out.push(v as f32),
            Err(_) => {
                let shown = item.repr()?.to_string();
                return Ok(Err(format!("logprobs[{i}] = {shown} is not a number")));
            }
        }
    }
    Ok(Ok(freeze(out.into_pyarray(py))?))
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
