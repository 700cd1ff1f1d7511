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
        Error::Integrity { .. } => {
            PyErr::from_value(errors.getattr("IntegrityError")?.call1((msg,))?)
        }
        Error::Invalid(_) => PyErr::new::<pyo3::exceptions::PyValueError, _>(msg),
    };
    Ok(e)
}
