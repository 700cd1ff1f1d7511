//! [`crate::Error`] → the exception classes defined in `spillover/errors.py`.
//!
//! The classes live in Python so they can subclass the right built-in twice over
//! (`SwapIOError(SpilloverError, OSError)`); this is the only place that maps variants to them.

use pyo3::prelude::*;

use crate::Error;

pub fn to_py(err: Error) -> PyErr {
    Python::attach(|py| match build(py, &err) {
        Ok(e) => e,
        Err(import_failed) => import_failed,
    })
}

fn build(py: Python<'_>, err: &Error) -> PyResult<PyErr> {
    let errors = py.import("spillover.errors")?;
    let msg = err.to_string();
    let e = match err {
        Error::PoolExhausted {
            need,
            largest_free,
            capacity,
        } => {
            let cls = errors.getattr("PoolExhaustedError")?;
            PyErr::from_value(cls.call1((msg, *need, *largest_free, *capacity))?)
        }
        Error::OutOfSpace { path, need, free } => {
            let cls = errors.getattr("OutOfSpaceError")?;
            let path = path.display().to_string();
            PyErr::from_value(cls.call1((msg, path, *need, *free))?)
        }
        Error::Io { source, .. } | Error::Map { source, .. } => {
            let cls = errors.getattr("SwapIOError")?;
            PyErr::from_value(cls.call1((source.raw_os_error().unwrap_or(0), msg))?)
        }
        Error::Integrity { .. } | Error::Landed { .. } => {
            PyErr::from_value(errors.getattr("IntegrityError")?.call1((msg,))?)
        }
        Error::Invalid(_) => PyErr::new::<pyo3::exceptions::PyValueError, _>(msg),
        Error::Device { .. } => PyErr::from_value(errors.getattr("DeviceError")?.call1((msg,))?),
        Error::Internal(_) => PyErr::from_value(errors.getattr("InternalError")?.call1((msg,))?),
    };
    Ok(e)
}

/// Note [no panic across the boundary]
/// A panic that reached Python would be a `pyo3_runtime.PanicException`, which derives from
/// `BaseException`: `except Exception` (HF Trainer's and Lightning's handlers) does not catch
/// it, and it is not a `SpilloverError`. Invariants that can fail are `Error::Internal` values
/// in the engine; anything that still panics is caught here and becomes the same error, so the
/// call fails with `spillover.InternalError` and the engine stays usable (its locks recover
/// from poisoning, a transition never leaves an entry half-moved on a path that returns).
pub fn catch<T>(f: impl FnOnce() -> Result<T, Error>) -> Result<T, Error> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".to_owned());
            Err(Error::Internal(format!("panic in the Rust engine: {what}")))
        }
    }
}

/// Run `f` with the GIL released, panics caught (Note [no panic across the boundary]), errors
/// converted once.
pub fn guarded<T: Send>(
    py: Python<'_>,
    f: impl FnOnce() -> Result<T, Error> + Send,
) -> PyResult<T> {
    py.detach(|| catch(f)).map_err(to_py)
}
