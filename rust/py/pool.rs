//! `Pool` and `Block` for Python.
//!
//! A block is exposed to numpy/torch through `__array_interface__`: `numpy.asarray(block)` makes
//! an array whose `.base` is the block, and `torch.from_numpy` keeps that array alive, so the
//! block (and the arena under it) stays mapped while any tensor views it — with no copy, on every
//! Python version the abi3 wheel supports.

use std::sync::{Arc, Mutex};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{guarded, to_py};
use crate::pool::{Block, Pool, PoolOptions};

#[pyclass(name = "Pool", module = "spillover._native", frozen)]
pub struct PyPool {
    pub(crate) pool: Pool,
}

#[pymethods]
impl PyPool {
    /// Map `capacity` bytes of host memory in arenas of at most `arena_bytes`, pre-faulted
    /// (`prefault`), with transparent huge pages advised, and locked in RAM if `lock` and the
    /// kernel allows (see `lock_warning`). The mapping work runs with the GIL released.
    #[new]
    #[pyo3(signature = (capacity, *, arena_bytes=None, prefault=true, lock=true, huge_pages=true))]
    fn new(
        py: Python<'_>,
        capacity: u64,
        arena_bytes: Option<u64>,
        prefault: bool,
        lock: bool,
        huge_pages: bool,
    ) -> PyResult<Self> {
        let mut opts = PoolOptions::new(capacity);
        if let Some(a) = arena_bytes {
            opts.arena_bytes = a;
        }
        opts.prefault = prefault;
        opts.lock = lock;
        opts.huge_pages = huge_pages;
        let pool = guarded(py, || Pool::new(&opts))?;
        Ok(PyPool { pool })
    }

    /// Lease a block of `nbytes` (> 0). Raises `PoolExhaustedError` when no free extent fits.
    fn lease(&self, nbytes: u64) -> PyResult<PyBlock> {
        let block = self.pool.lease(nbytes).map_err(to_py)?;
        Ok(PyBlock::new(block))
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.pool.capacity()
    }

    /// The warning to show once when locking was refused; None when locked or not asked.
    #[getter]
    fn lock_warning(&self) -> Option<String> {
        self.pool.lock_warning().map(str::to_string)
    }

    /// `[(address, length), ...]` of the arenas, e.g. for `cudaHostRegister`.
    fn arenas(&self) -> Vec<(usize, usize)> {
        self.pool.arenas()
    }

    fn reset_peak(&self) {
        self.pool.reset_peak()
    }

    /// Counters: capacity, in_use, peak, live_blocks, leases, failed_leases, largest_free,
    /// free_extents, locked_bytes (all ints).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.pool.stats();
        let d = PyDict::new(py);
        d.set_item("capacity", s.capacity)?;
        d.set_item("in_use", s.in_use)?;
        d.set_item("peak", s.peak)?;
        d.set_item("live_blocks", s.live_blocks)?;
        d.set_item("leases", s.leases)?;
        d.set_item("failed_leases", s.failed_leases)?;
        d.set_item("largest_free", s.largest_free)?;
        d.set_item("free_extents", s.free_extents)?;
        d.set_item("locked_bytes", s.locked_bytes)?;
        Ok(d)
    }

    fn __repr__(&self) -> String {
        let s = self.pool.stats();
        format!(
            "Pool(capacity={}, in_use={}, peak={}, live_blocks={})",
            s.capacity, s.in_use, s.peak, s.live_blocks
        )
    }
}

/// A leased block. I/O takes the block out of this object for the duration of a request
/// (`Swap.write`/`Swap.read`) and its ticket hands back a new `Block`; any use of the emptied
/// object raises ValueError instead of touching memory the kernel may be writing.
#[pyclass(name = "Block", module = "spillover._native", frozen)]
pub struct PyBlock {
    // The lock is only held to clone or take the Arc, never across a GIL release (a thread
    // waiting for it while holding the GIL would otherwise deadlock with one re-acquiring it).
    inner: Mutex<Option<Arc<Block>>>,
}

impl PyBlock {
    pub(crate) fn new(block: Block) -> Self {
        PyBlock {
            inner: Mutex::new(Some(Arc::new(block))),
        }
    }

    fn get(&self) -> PyResult<Arc<Block>> {
        let g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        g.clone().ok_or_else(|| {
            PyValueError::new_err(
                "this block was handed to an I/O request; use the Block its ticket returns",
            )
        })
    }

    /// Move the block out (for an I/O request). Fails while a copy is using it.
    pub(crate) fn take(&self) -> PyResult<Block> {
        let mut g = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let arc = g.take().ok_or_else(|| {
            PyValueError::new_err("this block was already handed to an I/O request")
        })?;
        match Arc::try_unwrap(arc) {
            Ok(b) => Ok(b),
            Err(arc) => {
                *g = Some(arc);
                Err(PyValueError::new_err("block is busy (a copy is using it)"))
            }
        }
    }

    fn with<R>(&self, f: impl FnOnce(&Block) -> R) -> PyResult<R> {
        let b = self.get()?;
        Ok(f(&b))
    }
}

#[pymethods]
impl PyBlock {
    /// Bytes asked for at lease time.
    #[getter]
    fn nbytes(&self) -> PyResult<usize> {
        self.with(|b| b.len())
    }

    /// Bytes reserved (rounded up to 4 KiB).
    #[getter]
    fn capacity(&self) -> PyResult<usize> {
        self.with(|b| b.capacity())
    }

    #[getter]
    fn address(&self) -> PyResult<usize> {
        self.with(|b| b.as_ptr() as usize)
    }

    /// numpy's array interface: a writable 1-D uint8 array over the block's `nbytes`.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (len, addr) = self.with(|b| (b.len(), b.as_ptr() as usize))?;
        let d = PyDict::new(py);
        d.set_item("shape", (len,))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (addr, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// Copy `nbytes` from host address `src` into the block at `offset`, GIL released.
    ///
    /// The caller (spillover's Python layer) passes the `data_ptr()` of a live CPU tensor it
    /// keeps referenced for the duration of the call; ranges are checked against the block.
    #[pyo3(signature = (src, nbytes, offset=0))]
    fn copy_from(&self, py: Python<'_>, src: usize, nbytes: usize, offset: usize) -> PyResult<()> {
        if src == 0 && nbytes > 0 {
            return Err(PyValueError::new_err("null source address"));
        }
        let block = self.get()?;
        // SAFETY: the Python caller guarantees `src` points at `nbytes` readable host bytes of a
        // tensor it holds alive and does not mutate during the call; a block is never a tensor's
        // own storage when copying into it, so the ranges do not overlap.
        guarded(py, || unsafe {
            block.copy_from_raw(src as *const u8, nbytes, offset)
        })
    }

    /// Copy `nbytes` of the block at `offset` to host address `dst`, GIL released.
    #[pyo3(signature = (dst, nbytes, offset=0))]
    fn copy_to(&self, py: Python<'_>, dst: usize, nbytes: usize, offset: usize) -> PyResult<()> {
        if dst == 0 && nbytes > 0 {
            return Err(PyValueError::new_err("null destination address"));
        }
        let block = self.get()?;
        // SAFETY: as in `copy_from`, with `dst` valid for `nbytes` writes.
        guarded(py, || unsafe {
            block.copy_to_raw(dst as *mut u8, nbytes, offset)
        })
    }

    /// crc32c of the block's bytes (GIL released).
    fn checksum(&self, py: Python<'_>) -> PyResult<u32> {
        let block = self.get()?;
        Ok(py.detach(|| ::crc32c::crc32c(block.as_slice())))
    }

    fn __len__(&self) -> PyResult<usize> {
        self.nbytes()
    }

    fn __repr__(&self) -> String {
        match self.with(|b| (b.len(), b.as_ptr() as usize)) {
            Ok((n, a)) => format!("Block(nbytes={n}, address={a:#x})"),
            Err(_) => "Block(<in an I/O request>)".to_string(),
        }
    }
}

/// RLIMIT_MEMLOCK's soft limit in bytes, or None when unlimited.
#[pyfunction]
pub fn memlock_limit() -> Option<u64> {
    crate::pool::memlock_limit()
}

/// crc32c of `nbytes` at host address `address` (GIL released); for SPILLOVER_VERIFY.
#[pyfunction]
pub fn crc32c(py: Python<'_>, address: usize, nbytes: usize) -> u32 {
    if nbytes == 0 {
        return 0;
    }
    // SAFETY: the Python caller passes the data_ptr of a live CPU tensor of at least `nbytes`.
    let s = unsafe { std::slice::from_raw_parts(address as *const u8, nbytes) };
    py.detach(|| ::crc32c::crc32c(s))
}
