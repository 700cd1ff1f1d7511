//! `Swap`, `Slot` and `Ticket` for Python: the NVMe tier's I/O engine.
//!
//! A request takes its block out of the Python `Block` (which then refuses every use) and the
//! ticket hands back a new `Block` when the request completes, so Python can never touch memory
//! the kernel may still be writing; a ticket dropped unwaited parks its block in the engine
//! until the completion arrives.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{guarded, to_py};
use super::pool::{PyBlock, PyPool};
use crate::io::{EngineChoice, FaultKind, IoOptions, Slot, Swap, Ticket};

#[pyclass(name = "Swap", module = "spillover._native", frozen)]
pub struct PySwap {
    pub(crate) swap: Arc<Swap>,
}

#[pymethods]
impl PySwap {
    /// Open a private swap file in each of `dirs` (striped), with the pool's arenas registered
    /// for io_uring. Raises ValueError / SwapIOError / OutOfSpaceError naming the directory.
    #[new]
    #[allow(clippy::too_many_arguments)] // mirrors the keyword arguments Python sees
    #[pyo3(signature = (pool, dirs, *, engine="auto", queue_depth=32, block_bytes=1048576,
                        allow_buffered=false, capacity_per_dir=None))]
    fn new(
        py: Python<'_>,
        pool: &PyPool,
        dirs: Vec<PathBuf>,
        engine: &str,
        queue_depth: u32,
        block_bytes: u64,
        allow_buffered: bool,
        capacity_per_dir: Option<u64>,
    ) -> PyResult<Self> {
        let opts = IoOptions {
            dirs,
            engine: engine.parse::<EngineChoice>().map_err(to_py)?,
            queue_depth,
            block_bytes,
            allow_buffered,
            capacity_per_dir,
        };
        let pool = pool.pool.clone();
        let swap = guarded(py, || Swap::open(&opts, &pool))?;
        Ok(PySwap {
            swap: Arc::new(swap),
        })
    }

    /// "io_uring" or "threads".
    #[getter]
    fn engine(&self) -> &'static str {
        self.swap.engine_name()
    }

    /// The one warning to show (fallback engine, buffered I/O), or None.
    #[getter]
    fn warning(&self) -> Option<String> {
        self.swap.warning().map(str::to_string)
    }

    #[getter]
    fn dirs(&self) -> Vec<PathBuf> {
        self.swap.dirs()
    }

    #[getter]
    fn direct(&self) -> bool {
        self.swap.is_direct()
    }

    /// Reserve swap space for `nbytes`. Raises OutOfSpaceError naming the path.
    fn alloc(&self, nbytes: u64) -> PyResult<PySlot> {
        let slot = self.swap.alloc(nbytes).map_err(to_py)?;
        Ok(PySlot { slot })
    }

    /// Start writing `block` to `slot`; `block` is unusable until the ticket returns it.
    fn write(&self, block: &PyBlock, slot: &PySlot) -> PyResult<PyTicket> {
        let b = block.take()?;
        Ok(PyTicket::new(self.swap.write(b, &slot.slot)))
    }

    /// Start reading `slot` into `block`; `block` is unusable until the ticket returns it.
    fn read(&self, slot: &PySlot, block: &PyBlock) -> PyResult<PyTicket> {
        let b = block.take()?;
        Ok(PyTicket::new(self.swap.read(&slot.slot, b)))
    }

    /// Block until nothing is in flight (GIL released).
    fn wait_idle(&self, py: Python<'_>) {
        py.detach(|| self.swap.wait_idle())
    }

    /// Counters: bytes_written, bytes_read, writes, reads, failed, chunk_ops, short_resubmits,
    /// busy_seconds, swap_in_use, swap_peak.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.swap.stats();
        let d = PyDict::new(py);
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("writes", s.writes)?;
        d.set_item("reads", s.reads)?;
        d.set_item("failed", s.failed)?;
        d.set_item("chunk_ops", s.chunk_ops)?;
        d.set_item("short_resubmits", s.short_resubmits)?;
        d.set_item("busy_seconds", s.busy_seconds)?;
        d.set_item("swap_in_use", s.swap_in_use)?;
        d.set_item("swap_peak", s.swap_peak)?;
        Ok(d)
    }

    fn reset_peak(&self) {
        self.swap.reset_peak()
    }

    /// For tests: fail the next `count` chunk operations of `kind` ("read" or "write") with
    /// `errno`, or ("short") cut them short so the engine must resubmit the rest.
    #[pyo3(signature = (kind, errno=5, count=1))]
    fn inject_fault(&self, kind: &str, errno: i32, count: u32) -> PyResult<()> {
        let k = match kind {
            "read" => FaultKind::Read,
            "write" => FaultKind::Write,
            "short" => FaultKind::ShortIo,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown fault kind {other:?}: read, write or short"
                )))
            }
        };
        self.swap.inject_fault(k, errno, count);
        Ok(())
    }
}

#[pyclass(name = "Slot", module = "spillover._native", frozen)]
pub struct PySlot {
    slot: Slot,
}

#[pymethods]
impl PySlot {
    #[getter]
    fn nbytes(&self) -> u64 {
        self.slot.len()
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.slot.capacity()
    }
}

#[pyclass(name = "Ticket", module = "spillover._native", frozen)]
pub struct PyTicket {
    inner: Mutex<Option<Ticket>>,
}

impl PyTicket {
    fn new(t: Ticket) -> Self {
        PyTicket {
            inner: Mutex::new(Some(t)),
        }
    }
}

#[pymethods]
impl PyTicket {
    /// True once the request has completed (never blocks).
    fn done(&self) -> bool {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.as_ref().is_none_or(|t| t.is_done())
    }

    /// Wait (GIL released) and return the block. A failed request raises SwapIOError /
    /// OutOfSpaceError and its block goes back to the pool. A ticket can be waited once.
    fn wait(&self, py: Python<'_>) -> PyResult<PyBlock> {
        let t = {
            let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
            g.take()
        };
        let t = t.ok_or_else(|| PyValueError::new_err("this ticket was already waited on"))?;
        let (block, result) = py.detach(|| t.wait());
        match result {
            Ok(()) => Ok(PyBlock::new(block)),
            Err(e) => {
                drop(block);
                Err(to_py(e))
            }
        }
    }
}
