//! `AdamState` for Python: the Rust AdamW over host or NVMe state (`spillover/optim/`).
//!
//! The per-step work list crosses the boundary as one `bytes` of fixed-size little-endian
//! records (built with numpy on the Python side), so a step with thousands of units costs one
//! conversion, not thousands of Python objects. Every call that touches state runs with the
//! GIL released.

use std::sync::{Mutex, MutexGuard};

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::guarded;
use super::pool::PyPool;
use super::swap::PySwap;
use crate::io::FaultKind;
use crate::optim::{AdamState, Dtype, Hyper, Options, Ptr, Tier, UnitBuffers, UnitStep};

/// Bytes per step record: unit, grad, src, out, flags (u64); lr, beta1, beta2, eps,
/// weight_decay, step, grad_scale (f64); tail (u64).
const STEP_RECORD: usize = 13 * 8;
/// Bytes per export/import record: unit, master, exp_avg, exp_avg_sq (u64).
const BUFFER_RECORD: usize = 4 * 8;

const FLAG_GRAD_BF16: u64 = 1;
const FLAG_SRC_BF16: u64 = 2;
const FLAG_OUT_BF16: u64 = 4;

#[pyclass(name = "AdamState", module = "spillover._native", frozen)]
pub struct PyAdamState {
    // Locked only inside `py.detach`, never while holding the GIL across a wait.
    inner: Mutex<AdamState>,
}

impl PyAdamState {
    fn lock(&self) -> MutexGuard<'_, AdamState> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn u64_at(rec: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(rec[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

fn f64_at(rec: &[u8], i: usize) -> f64 {
    f64::from_bits(u64_at(rec, i))
}

fn records(data: &[u8], size: usize) -> PyResult<std::slice::ChunksExact<'_, u8>> {
    if data.len() % size != 0 {
        return Err(PyValueError::new_err(format!(
            "record buffer of {} bytes is not a whole number of {size}-byte records",
            data.len()
        )));
    }
    Ok(data.chunks_exact(size))
}

fn dtype(flags: u64, bit: u64) -> Dtype {
    if flags & bit != 0 {
        Dtype::Bf16
    } else {
        Dtype::F32
    }
}

fn parse_steps(data: &[u8]) -> PyResult<Vec<UnitStep>> {
    Ok(records(data, STEP_RECORD)?
        .map(|r| {
            let flags = u64_at(r, 4);
            UnitStep {
                unit: u64_at(r, 0) as usize,
                grad: Ptr::new(u64_at(r, 1) as usize, dtype(flags, FLAG_GRAD_BF16)),
                src: Ptr::new(u64_at(r, 2) as usize, dtype(flags, FLAG_SRC_BF16)),
                out: Ptr::new(u64_at(r, 3) as usize, dtype(flags, FLAG_OUT_BF16)),
                hyper: Hyper {
                    lr: f64_at(r, 5),
                    beta1: f64_at(r, 6),
                    beta2: f64_at(r, 7),
                    eps: f64_at(r, 8),
                    weight_decay: f64_at(r, 9),
                    step: f64_at(r, 10),
                    grad_scale: f64_at(r, 11),
                },
                tail: u64_at(r, 12) as usize,
            }
        })
        .collect())
}

fn parse_buffers(data: &[u8]) -> PyResult<Vec<UnitBuffers>> {
    Ok(records(data, BUFFER_RECORD)?
        .map(|r| UnitBuffers {
            unit: u64_at(r, 0) as usize,
            master: u64_at(r, 1) as usize,
            exp_avg: u64_at(r, 2) as usize,
            exp_avg_sq: u64_at(r, 3) as usize,
        })
        .collect())
}

#[pymethods]
impl PyAdamState {
    /// State for units of `unit_lens` elements, with an fp32 master column if `master`.
    /// `tier="host"` leases its chunks from `pool` now (heap when the pool is full and
    /// `allow_heap`); `tier="nvme"` reserves a slot per chunk now in `swap` (the process's
    /// shared engine and swap files, `spillover._tiers.swap_for`), streaming through `buffers`
    /// pool blocks per step.
    #[new]
    #[allow(clippy::too_many_arguments)] // mirrors the keyword arguments Python sees
    #[pyo3(signature = (pool, unit_lens, *, master, chunk_elems=4194304, task_elems=8388608,
                        tier="host", allow_heap=true, swap=None, buffers=16))]
    fn new(
        py: Python<'_>,
        pool: &PyPool,
        unit_lens: Vec<usize>,
        master: bool,
        chunk_elems: usize,
        task_elems: usize,
        tier: &str,
        allow_heap: bool,
        swap: Option<PyRef<'_, PySwap>>,
        buffers: usize,
    ) -> PyResult<Self> {
        let tier = match tier {
            "host" => Tier::Host { allow_heap },
            "nvme" => Tier::Nvme {
                swap: swap
                    .ok_or_else(|| {
                        PyValueError::new_err(
                            "tier='nvme' needs the swap engine to keep its state in: pass \
                             swap=spillover._tiers.swap_for(config, pool) (a \
                             spillover._native.Swap)",
                        )
                    })?
                    .swap
                    .clone(),
                buffers,
            },
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown optimizer tier {other:?}: host or nvme"
                )))
            }
        };
        let opts = Options {
            master,
            chunk_elems,
            task_elems,
            tier,
        };
        let pool = pool.pool.clone();
        let state = guarded(py, || AdamState::new(&pool, &unit_lens, &opts))?;
        Ok(PyAdamState {
            inner: Mutex::new(state),
        })
    }

    /// One AdamW step over the units in `records` (see `STEP_RECORD`), GIL released.
    ///
    /// The Python caller (spillover.optim) passes the data_ptr of tensors it holds referenced
    /// and does not touch during the call; lengths come from the layout, overlaps are refused.
    fn step(&self, py: Python<'_>, records: &[u8]) -> PyResult<()> {
        let work = parse_steps(records)?;
        guarded(py, || {
            let mut st = self.lock();
            // SAFETY: the Python layer's contract above: every address is the data_ptr of a
            // live, contiguous CPU tensor (or pool block) of the unit's length and dtype, held
            // alive for the call and written by no one else meanwhile.
            unsafe { st.step(&work) }
        })
    }

    /// Copy the state of the units in `records` (see `BUFFER_RECORD`) into f32 buffers.
    #[pyo3(name = "export_state")]
    fn export(&self, py: Python<'_>, records: &[u8]) -> PyResult<()> {
        let bufs = parse_buffers(records)?;
        guarded(py, || {
            let mut st = self.lock();
            // SAFETY: every address is the data_ptr of a live contiguous float32 CPU tensor of
            // the unit's length that the caller holds and nobody else uses during the call.
            unsafe { st.export(&bufs) }
        })
    }

    /// Set the state of the units in `records` from f32 buffers; they count as initialized.
    #[pyo3(name = "import_state")]
    fn import(&self, py: Python<'_>, records: &[u8]) -> PyResult<()> {
        let bufs = parse_buffers(records)?;
        guarded(py, || {
            let mut st = self.lock();
            // SAFETY: as in `export`; the buffers are only read.
            unsafe { st.import(&bufs) }
        })
    }

    /// Forget a unit's state (its next step starts it afresh).
    fn reset(&self, py: Python<'_>, unit: usize) -> PyResult<()> {
        guarded(py, || self.lock().reset(unit))
    }

    fn initialized(&self, py: Python<'_>) -> Vec<bool> {
        py.detach(|| {
            let st = self.lock();
            (0..st.layout().units())
                .map(|u| st.is_initialized(u))
                .collect()
        })
    }

    #[getter]
    fn tier(&self, py: Python<'_>) -> &'static str {
        py.detach(|| self.lock().tier_name())
    }

    #[getter]
    fn master(&self, py: Python<'_>) -> bool {
        py.detach(|| self.lock().has_master())
    }

    #[getter]
    fn chunks(&self, py: Python<'_>) -> usize {
        py.detach(|| self.lock().layout().chunks())
    }

    /// The NVMe tier's I/O engine ("io_uring" or "threads"), None on the host tier.
    #[getter]
    fn swap_engine(&self, py: Python<'_>) -> Option<&'static str> {
        py.detach(|| self.lock().swap_info().map(|i| i.0))
    }

    /// The NVMe tier's one warning (engine fallback, buffered I/O), or None.
    #[getter]
    fn swap_warning(&self, py: Python<'_>) -> Option<String> {
        py.detach(|| self.lock().swap_info().and_then(|i| i.1))
    }

    /// Counters: steps, bytes_read, bytes_written, io_wait_seconds, compute_seconds,
    /// last_step_seconds, state_bytes, heap_chunks.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.detach(|| self.lock().stats());
        let d = PyDict::new(py);
        d.set_item("steps", s.steps)?;
        d.set_item("bytes_read", s.bytes_read)?;
        d.set_item("bytes_written", s.bytes_written)?;
        d.set_item("io_wait_seconds", s.io_wait_seconds)?;
        d.set_item("compute_seconds", s.compute_seconds)?;
        d.set_item("last_step_seconds", s.last_step_seconds)?;
        d.set_item("state_bytes", s.state_bytes)?;
        d.set_item("heap_chunks", s.heap_chunks)?;
        Ok(d)
    }

    /// Whether the kernel uses FMA on this CPU (then it matches torch's fused CPU AdamW bit for
    /// bit; Note [torch rounding] in rust/optim/kernel.rs).
    #[staticmethod]
    fn fma_available() -> bool {
        crate::optim::fma_available()
    }

    /// For tests: fail the next `count` chunk operations of `kind` ("read", "write" or
    /// "short") of the NVMe tier's swap (shared: whoever uses it next sees the fault).
    #[pyo3(signature = (kind, errno=5, count=1))]
    fn inject_fault(&self, py: Python<'_>, kind: &str, errno: i32, count: u32) -> PyResult<()> {
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
        guarded(py, || self.lock().inject_fault(k, errno, count))
    }
}
