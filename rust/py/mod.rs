//! The `spillover._native` extension module (feature "python").
//!
//! Classes here are thin: they convert arguments, release the GIL around anything that waits or
//! copies in bulk, and turn [`crate::Error`] into the Python classes of `spillover.errors` once,
//! at this boundary.

mod errors;
mod inflight;
mod link;
mod optim;
mod pool;
mod swap;
mod tier;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<pool::PyPool>()?;
    m.add_class::<pool::PyBlock>()?;
    m.add_class::<swap::PySwap>()?;
    m.add_class::<swap::PySlot>()?;
    m.add_class::<swap::PyTicket>()?;
    m.add_class::<tier::PyTier>()?;
    m.add_class::<tier::PyStep>()?;
    m.add_class::<tier::PyHandle>()?;
    m.add_class::<tier::PyView>()?;
    m.add_class::<tier::PyGathered>()?;
    m.add_class::<inflight::PyInflight>()?;
    m.add_class::<link::PyLink>()?;
    m.add_class::<optim::PyAdamState>()?;
    m.add("STEP_RECORD_FIELDS", optim::STEP_FIELDS.to_vec())?;
    m.add("BUFFER_RECORD_FIELDS", optim::BUFFER_FIELDS.to_vec())?;
    m.add("STEP_FLAGS", optim::STEP_FLAGS.to_vec())?;
    // Elements per block of low-bit state (Note [block alignment] in rust/optim/layout.rs).
    m.add("STATE_BLOCK", crate::optim::BLOCK)?;
    m.add_function(wrap_pyfunction!(pool::memlock_limit, m)?)?;
    m.add_function(wrap_pyfunction!(pool::crc32c, m)?)?;
    Ok(())
}
