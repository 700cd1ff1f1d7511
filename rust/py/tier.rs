//! `Tier`, `Step`, `Handle`, `View` and `Gathered` for Python: the activation tier
//! (`crate::tier`). Everything that may wait (a lease that makes room, a read back, a seal that
//! starts writes) runs with the GIL released.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::guarded;
use super::pool::PyPool;
use super::swap::PySwap;
use crate::pool::Owner;
use crate::tier::{Gathered, Handle, Step, StepStats, Tier, TierOptions, View};

#[pyclass(name = "Tier", module = "spillover._native", frozen)]
pub struct PyTier {
    tier: Tier,
}

#[pymethods]
impl PyTier {
    /// A tier over `pool`, spilling to `swap` (host-only when None). `dirty_bytes`: write
    /// behind past this many unwritten bytes (default a quarter of the pool);
    /// `prefetch_bytes`: read-ahead window (default a quarter of the pool, at most 256 MiB);
    /// `verify`: crc32c at seal, checked at every get (IntegrityError); `write_hold_bytes`:
    /// bytes being written past which a pack waits (default the pool's capacity and the
    /// largest storage written from a tensor so far).
    #[new]
    #[pyo3(signature = (pool, swap=None, *, dirty_bytes=None, prefetch_bytes=None, verify=false,
                        write_hold_bytes=None))]
    fn new(
        pool: &PyPool,
        swap: Option<&PySwap>,
        dirty_bytes: Option<u64>,
        prefetch_bytes: Option<u64>,
        verify: bool,
        write_hold_bytes: Option<u64>,
    ) -> Self {
        let mut o = TierOptions::for_pool(pool.pool.capacity());
        if let Some(d) = dirty_bytes {
            o.dirty_bytes = d;
        }
        if let Some(p) = prefetch_bytes {
            o.prefetch_bytes = p;
        }
        o.verify = verify;
        o.write_hold_bytes = write_hold_bytes;
        let swap = swap.map(|s| s.swap.clone());
        PyTier {
            tier: Tier::new(pool.pool.clone(), swap, o),
        }
    }

    /// Start a step; the order the previous step unpacked becomes its forecast.
    fn begin_step(&self) -> PyStep {
        PyStep {
            step: self.tier.begin_step(),
        }
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.tier.pool().capacity()
    }

    #[getter]
    fn prefetch_bytes(&self) -> u64 {
        self.tier.options().prefetch_bytes
    }

    /// The hold set for this tier (None: the pool's capacity and the largest storage written
    /// from a tensor so far).
    #[getter]
    fn write_hold_bytes(&self) -> Option<u64> {
        self.tier.options().write_hold_bytes
    }

    #[getter]
    fn dirty_bytes(&self) -> u64 {
        self.tier.options().dirty_bytes
    }

    #[getter]
    fn has_swap(&self) -> bool {
        self.tier.swap().is_some()
    }

    /// Note [writes wait for growth] (rust/tier/room.rs): while `on`, a put that finds the pool
    /// full raises PoolExhaustedError rather than write entries out (the caller grows the
    /// pool, or turns this off and puts again).
    fn defer_writes(&self, on: bool) {
        self.tier.set_defer_writes(on)
    }

    #[getter]
    fn defers_writes(&self) -> bool {
        self.tier.defers_writes()
    }

    /// Finish every write and read in flight (GIL released); raises the first error.
    fn wait_idle(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || self.tier.wait_idle())
    }

    /// For tests: the next `count` gets panic inside the engine (they raise InternalError).
    fn inject_panic(&self, count: u32) {
        self.tier.inject_panic(count)
    }

    /// Write out every entry nothing views and drop its block; returns the bytes freed.
    fn spill_all(&self, py: Python<'_>) -> PyResult<u64> {
        guarded(py, || self.tier.spill_all())
    }

    /// Counters: entries, pool_capacity, pool_in_use, pool_peak, entries by residency
    /// (staging, dirty, writing, clean, disk, reading), bytes_in_pool, bytes_on_disk_only,
    /// swap_in_use, io_in_flight.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = guarded(py, || Ok(self.tier.stats()))?;
        let d = PyDict::new(py);
        d.set_item("entries", s.entries)?;
        d.set_item("pool_capacity", s.pool_capacity)?;
        d.set_item("pool_in_use", s.pool_in_use)?;
        d.set_item("pool_peak", s.pool_peak)?;
        d.set_item("staging", s.staging)?;
        d.set_item("dirty", s.dirty)?;
        d.set_item("writing", s.writing)?;
        d.set_item("clean", s.clean)?;
        d.set_item("disk", s.disk)?;
        d.set_item("reading", s.reading)?;
        d.set_item("bytes_in_pool", s.bytes_in_pool)?;
        d.set_item("bytes_on_disk_only", s.bytes_on_disk_only)?;
        d.set_item("swap_in_use", s.swap_in_use)?;
        d.set_item("io_in_flight", s.io_in_flight)?;
        Ok(d)
    }
}

#[pyclass(name = "Step", module = "spillover._native", frozen)]
pub struct PyStep {
    pub(super) step: Step,
}

fn step_stats<'py>(py: Python<'py>, s: StepStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("bytes_put", s.bytes_put)?;
    d.set_item("bytes_written", s.bytes_written)?;
    d.set_item("prefetch_hits", s.prefetch_hits)?;
    d.set_item("prefetch_misses", s.prefetch_misses)?;
    d.set_item("host_cache_hits", s.host_cache_hits)?;
    d.set_item("overflow_reads", s.overflow_reads)?;
    d.set_item("stall_seconds", s.stall_seconds)?;
    Ok(d)
}

/// The length of `nbytes` at host address `address` handed over from Python: a ValueError for a
/// null address or a length no address space holds.
fn host_range(address: usize, nbytes: u64) -> PyResult<usize> {
    if address == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "null source address",
        ));
    }
    match isize::try_from(nbytes) {
        Ok(len) => Ok(len as usize),
        Err(_) => Err(pyo3::exceptions::PyValueError::new_err(
            "nbytes larger than an address space",
        )),
    }
}

#[pymethods]
impl PyStep {
    /// Lease a block for `nbytes` (making room on an NVMe tier; GIL released) and return
    /// `(handle, staging view)`: copy into the view, then `handle.seal()`. Raises
    /// PoolExhaustedError when nothing can be freed now.
    fn put(&self, py: Python<'_>, nbytes: u64) -> PyResult<(PyHandle, PyView)> {
        let (h, v) = guarded(py, || self.step.put(nbytes))?;
        Ok((PyHandle { h }, PyView { v }))
    }

    /// Pack on a CPU host in one call (GIL released): lease `nbytes` (making room), copy them
    /// from host address `address`, seal. `owner` is the CPU tensor whose data `address` is:
    /// this call holds it, so the bytes stay alive and mapped for the copy. Raises what `put`
    /// and `seal` raise; on an error no entry is left behind.
    #[pyo3(signature = (owner, address, nbytes))]
    fn put_from(
        &self,
        py: Python<'_>,
        owner: &Bound<'_, PyAny>,
        address: usize,
        nbytes: u64,
    ) -> PyResult<PyHandle> {
        let _held = owner; // a raw pointer only with its owner, held for the whole call
        let len = host_range(address, nbytes)?;
        // SAFETY: `address` is the data of `owner`, a live CPU tensor of at least `nbytes`
        // bytes that the Python caller (spillover.context) does not write during the call and
        // this frame holds until the slice is last used; the tier copies it into a block it
        // has just leased (pool memory, never the tensor's), so the ranges do not overlap.
        let src = unsafe { std::slice::from_raw_parts(address as *const u8, len) };
        let h = guarded(py, || self.step.put_copy(src))?;
        Ok(PyHandle { h })
    }

    /// Pack on a CPU host by writing `nbytes` at host address `address` to disk from where they
    /// are, with no copy into the pool (GIL released; Note [written from the tensor] in
    /// rust/tier/direct.rs). `owner` is the CPU storage whose data `address` is: the entry holds
    /// it until the write lands. The caller does not write those bytes meanwhile. Raises on a
    /// tier without swap and what allocating a slot raises; on an error no entry is left.
    /// `first`: false for the further pieces of one storage (they do not wait for writes).
    #[pyo3(signature = (owner, address, nbytes, first=true))]
    fn put_direct(
        &self,
        py: Python<'_>,
        owner: &Bound<'_, PyAny>,
        address: usize,
        nbytes: u64,
        first: bool,
    ) -> PyResult<PyHandle> {
        host_range(address, nbytes)?;
        let held: Owner = Box::new(owner.clone().unbind());
        // SAFETY: `address` is the data of `owner`, a live CPU storage of at least `nbytes`
        // bytes, which the entry holds (and with it the mapping) until the write has landed;
        // the caller (activations/hooks.py) offloads autograd's saved tensors, which nothing
        // writes until they are unpacked.
        let h = guarded(py, || unsafe {
            self.step
                .put_direct(address as *const u8, nbytes, held, first)
        })?;
        Ok(PyHandle { h })
    }

    /// One storage made of `parts` (this step's handles, in order), returned whole by `get`.
    fn gather(&self, py: Python<'_>, parts: Vec<PyRef<'_, PyHandle>>) -> PyResult<PyGathered> {
        let parts: Vec<Handle> = parts.iter().map(|p| p.h.clone()).collect();
        let g = guarded(py, || self.step.gather(parts))?;
        Ok(PyGathered { g })
    }

    /// Sequence numbers backward is expected to unpack after `seq`, next first, at most `n`.
    fn expected_after(&self, py: Python<'_>, seq: u32, n: usize) -> PyResult<Vec<u32>> {
        guarded(py, || Ok(self.step.expected_after(seq, n)))
    }

    #[getter]
    fn id(&self) -> u64 {
        self.step.id()
    }

    /// Counters: bytes_put, bytes_written, prefetch_hits, prefetch_misses, host_cache_hits,
    /// overflow_reads, stall_seconds.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = guarded(py, || Ok(self.step.stats()))?;
        step_stats(py, s)
    }
}

#[pyclass(name = "Handle", module = "spillover._native", frozen)]
pub struct PyHandle {
    pub(super) h: Handle,
}

#[pymethods]
impl PyHandle {
    /// The copy into the staging view has landed (GIL released: may start writes).
    fn seal(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || self.h.seal())
    }

    /// A view of the bytes, read back if needed (GIL released); counted as an unpack.
    /// `staging=True`: also while the copy filling them is in flight, for a device copy
    /// ordered after that copy (Note [unpack before the seal] in rust/tier), never for the
    /// host to read.
    #[pyo3(signature = (staging=false))]
    fn get(&self, py: Python<'_>, staging: bool) -> PyResult<PyView> {
        let v = guarded(py, || {
            if staging {
                self.h.get_for_device()
            } else {
                self.h.get()
            }
        })?;
        Ok(PyView { v })
    }

    /// Count an unpack served without the tier's bytes (the source still on the device, or
    /// staged ahead): the order is learned and read-ahead runs all the same.
    fn note_used(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            self.h.note_used();
            Ok(())
        })
    }

    /// A view if the bytes are sealed and in the pool now, else None; not counted.
    /// `staging=True`: also while the copy filling them is in flight (for a device copy
    /// ordered after it, never for the host to read).
    #[pyo3(signature = (staging=false))]
    fn try_get(&self, py: Python<'_>, staging: bool) -> PyResult<Option<PyView>> {
        Ok(guarded(py, || Ok(self.h.try_get(staging)))?.map(|v| PyView { v }))
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.h.nbytes()
    }

    #[getter]
    fn seq(&self) -> u32 {
        self.h.seq()
    }

    /// "staging", "dirty", "writing", "clean", "disk", "reading" (or "freed").
    #[getter]
    fn residency(&self, py: Python<'_>) -> &'static str {
        py.detach(|| self.h.residency())
    }

    #[getter]
    fn went_to_disk(&self, py: Python<'_>) -> bool {
        py.detach(|| self.h.went_to_disk())
    }

    fn __repr__(&self, py: Python<'_>) -> String {
        let r = py.detach(|| self.h.residency());
        format!(
            "Handle(seq={}, nbytes={}, {r})",
            self.h.seq(),
            self.h.nbytes()
        )
    }
}

/// Bytes of an entry (or a gathered storage). While a view lives its bytes stay where they
/// are: never written out, dropped or read into (Note [views hold blocks] in rust/tier).
/// `numpy.asarray(view)` makes an array whose `.base` is the view.
#[pyclass(name = "View", module = "spillover._native", frozen)]
pub struct PyView {
    pub(super) v: View,
}

#[pymethods]
impl PyView {
    #[getter]
    fn nbytes(&self) -> usize {
        self.v.len()
    }

    #[getter]
    fn address(&self) -> usize {
        self.v.as_ptr() as usize
    }

    /// True while the bytes are the packed tensor's own memory (written from the tensor, the
    /// write not landed yet): nothing was read back.
    #[getter]
    fn borrowed(&self) -> bool {
        self.v.is_borrowed()
    }

    /// numpy's array interface: a writable 1-D uint8 array over the bytes.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        d.set_item("shape", (self.v.len(),))?;
        d.set_item("typestr", "|u1")?;
        d.set_item("data", (self.v.as_ptr() as usize, false))?;
        d.set_item("version", 3)?;
        Ok(d)
    }

    /// crc32c of the bytes (GIL released).
    fn checksum(&self, py: Python<'_>) -> u32 {
        py.detach(|| ::crc32c::crc32c(self.v.as_slice()))
    }

    fn __len__(&self) -> usize {
        self.v.len()
    }

    fn __repr__(&self) -> String {
        format!(
            "View(nbytes={}, address={:#x})",
            self.v.len(),
            self.v.as_ptr() as usize
        )
    }
}

#[pyclass(name = "Gathered", module = "spillover._native", frozen)]
pub struct PyGathered {
    g: Gathered,
}

#[pymethods]
impl PyGathered {
    /// The whole storage as one buffer of its own (GIL released).
    fn get(&self, py: Python<'_>) -> PyResult<PyView> {
        let v = guarded(py, || self.g.get())?;
        Ok(PyView { v })
    }

    #[getter]
    fn nbytes(&self) -> u64 {
        self.g.nbytes()
    }

    #[getter]
    fn parts(&self) -> Vec<PyHandle> {
        self.g
            .parts()
            .iter()
            .map(|h| PyHandle { h: h.clone() })
            .collect()
    }

    /// Count an unpack of every piece served without the tier's bytes.
    fn note_used(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || {
            self.g.note_used();
            Ok(())
        })
    }

    /// Whether its reads were started ahead of `get` (and not yet consumed).
    #[getter]
    fn started(&self, py: Python<'_>) -> bool {
        py.detach(|| self.g.started())
    }
}
