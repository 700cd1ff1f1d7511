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
use crate::optim::{
    AdamState, Dtype, Form, Hyper, Options, Ptr, StateBits, Tier, UnitBuffers, UnitStep,
};

/// The step record, field by field (name, little-endian `u8` or `f8`), in order: the one
/// definition of its layout. Python builds its numpy dtype from `_native.STEP_RECORD_FIELDS`
/// (spillover/optim/layout.py); `parse_steps` finds each field by its name, at compile time.
pub(crate) const STEP_FIELDS: [(&str, &str); 15] = [
    ("unit", "u8"),
    ("grad", "u8"),
    ("src", "u8"),
    ("out", "u8"),
    ("flags", "u8"),
    ("lr", "f8"),
    ("beta1", "f8"),
    ("beta2", "f8"),
    ("eps", "f8"),
    ("weight_decay", "f8"),
    ("step", "f8"),
    ("grad_scale", "f8"),
    ("tail", "u8"),
    ("key", "u8"),
    ("coef", "u8"),
];
/// The export/import record, as [`STEP_FIELDS`] (`_native.BUFFER_RECORD_FIELDS`).
pub(crate) const BUFFER_FIELDS: [(&str, &str); 6] = [
    ("unit", "u8"),
    ("master", "u8"),
    ("exp_avg", "u8"),
    ("exp_avg_sq", "u8"),
    ("exp_avg_scale", "u8"),
    ("exp_avg_sq_scale", "u8"),
];
/// Bits of the step record's `flags` (`_native.STEP_FLAGS`): which pointers are bf16, and
/// whether `out` gets the predicted parameter (Note [weight prediction]).
pub(crate) const STEP_FLAGS: [(&str, u64); 4] = [
    ("grad_bf16", 1),
    ("src_bf16", 2),
    ("out_bf16", 4),
    ("predict", 8),
];

const STEP_RECORD: usize = STEP_FIELDS.len() * 8;
const BUFFER_RECORD: usize = BUFFER_FIELDS.len() * 8;

const fn same(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// The index of field `name` in `fields`, at compile time (a name not there does not compile).
const fn at(fields: &[(&str, &str)], name: &str) -> usize {
    let mut i = 0;
    while i < fields.len() {
        if same(fields[i].0, name) {
            return i;
        }
        i += 1;
    }
    panic!("no such record field")
}

const fn flag(name: &str) -> u64 {
    let mut i = 0;
    while i < STEP_FLAGS.len() {
        if same(STEP_FLAGS[i].0, name) {
            return STEP_FLAGS[i].1;
        }
        i += 1;
    }
    panic!("no such flag")
}

const FLAG_GRAD_BF16: u64 = flag("grad_bf16");
const FLAG_SRC_BF16: u64 = flag("src_bf16");
const FLAG_OUT_BF16: u64 = flag("out_bf16");
const FLAG_PREDICT: u64 = flag("predict");

#[pyclass(name = "AdamState", module = "spillover._native", frozen)]
pub struct PyAdamState {
    // Locked only inside `py.detach`, never while holding the GIL across a wait.
    inner: Mutex<AdamState>,
    /// The threads `step` runs on: a pool of its own (`threads=n`), else rayon's global one.
    /// Note [update threads] in spillover/optim/adamw.py: an update that runs while the device
    /// computes leaves a core to the thread that drives the device.
    threads: Option<rayon::ThreadPool>,
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
            // field indices from the table, at compile time
            const UNIT: usize = at(&STEP_FIELDS, "unit");
            const GRAD: usize = at(&STEP_FIELDS, "grad");
            const SRC: usize = at(&STEP_FIELDS, "src");
            const OUT: usize = at(&STEP_FIELDS, "out");
            const FLAGS: usize = at(&STEP_FIELDS, "flags");
            const LR: usize = at(&STEP_FIELDS, "lr");
            const BETA1: usize = at(&STEP_FIELDS, "beta1");
            const BETA2: usize = at(&STEP_FIELDS, "beta2");
            const EPS: usize = at(&STEP_FIELDS, "eps");
            const WD: usize = at(&STEP_FIELDS, "weight_decay");
            const STEP: usize = at(&STEP_FIELDS, "step");
            const SCALE: usize = at(&STEP_FIELDS, "grad_scale");
            const TAIL: usize = at(&STEP_FIELDS, "tail");
            const KEY: usize = at(&STEP_FIELDS, "key");
            const COEF: usize = at(&STEP_FIELDS, "coef");
            let flags = u64_at(r, FLAGS);
            UnitStep {
                unit: u64_at(r, UNIT) as usize,
                grad: Ptr::new(u64_at(r, GRAD) as usize, dtype(flags, FLAG_GRAD_BF16)),
                src: Ptr::new(u64_at(r, SRC) as usize, dtype(flags, FLAG_SRC_BF16)),
                out: Ptr::new(u64_at(r, OUT) as usize, dtype(flags, FLAG_OUT_BF16)),
                hyper: Hyper {
                    lr: f64_at(r, LR),
                    beta1: f64_at(r, BETA1),
                    beta2: f64_at(r, BETA2),
                    eps: f64_at(r, EPS),
                    weight_decay: f64_at(r, WD),
                    step: f64_at(r, STEP),
                    grad_scale: f64_at(r, SCALE),
                },
                tail: u64_at(r, TAIL) as usize,
                predict: flags & FLAG_PREDICT != 0,
                coef: Ptr::new(u64_at(r, COEF) as usize, Dtype::Bf16),
                key: u64_at(r, KEY),
            }
        })
        .collect())
}

fn parse_form(form: &str) -> PyResult<Form> {
    match form {
        "stored" => Ok(Form::Stored),
        "f32" => Ok(Form::F32),
        other => Err(PyValueError::new_err(format!(
            "unknown state form {other:?}: 'stored' (as kept: bf16 bits or 8-bit codes and \
             scales) or 'f32' (as float32 values)"
        ))),
    }
}

fn parse_buffers(data: &[u8]) -> PyResult<Vec<UnitBuffers>> {
    Ok(records(data, BUFFER_RECORD)?
        .map(|r| {
            const UNIT: usize = at(&BUFFER_FIELDS, "unit");
            const MASTER: usize = at(&BUFFER_FIELDS, "master");
            const EXP_AVG: usize = at(&BUFFER_FIELDS, "exp_avg");
            const EXP_AVG_SQ: usize = at(&BUFFER_FIELDS, "exp_avg_sq");
            const EXP_AVG_SCALE: usize = at(&BUFFER_FIELDS, "exp_avg_scale");
            const EXP_AVG_SQ_SCALE: usize = at(&BUFFER_FIELDS, "exp_avg_sq_scale");
            UnitBuffers {
                unit: u64_at(r, UNIT) as usize,
                master: u64_at(r, MASTER) as usize,
                exp_avg: u64_at(r, EXP_AVG) as usize,
                exp_avg_sq: u64_at(r, EXP_AVG_SQ) as usize,
                exp_avg_scale: u64_at(r, EXP_AVG_SCALE) as usize,
                exp_avg_sq_scale: u64_at(r, EXP_AVG_SQ_SCALE) as usize,
            }
        })
        .collect())
}

#[pymethods]
impl PyAdamState {
    /// State for units of `unit_lens` elements, with an fp32 master column if `master`, the
    /// moments stored in `state_bits` (32: fp32, 16: bf16, 8: block-wise 8-bit; `seed` seeds
    /// stochastic rounding, Note [stochastic rounding] in rust/optim/quant.rs).
    /// `tier="host"` leases its chunks from `pool` now (heap when the pool is full and
    /// `allow_heap`); `tier="nvme"` reserves a slot per chunk now in `swap` (the process's
    /// shared engine and swap files, `spillover._tiers.swap_for`), streaming through `buffers`
    /// pool blocks per step.
    #[new]
    #[allow(clippy::too_many_arguments)] // mirrors the keyword arguments Python sees
    /// `threads`: run `step` on a pool of that many threads of its own (0: rayon's global
    /// pool, all cores unless RAYON_NUM_THREADS says otherwise).
    #[pyo3(signature = (pool, unit_lens, *, master, state_bits=32, seed=0, chunk_elems=4194304,
                        task_elems=8388608, tier="host", allow_heap=true, swap=None, buffers=16,
                        threads=0))]
    fn new(
        py: Python<'_>,
        pool: &PyPool,
        unit_lens: Vec<usize>,
        master: bool,
        state_bits: u32,
        seed: u64,
        chunk_elems: usize,
        task_elems: usize,
        tier: &str,
        allow_heap: bool,
        swap: Option<PyRef<'_, PySwap>>,
        buffers: usize,
        threads: usize,
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
        let bits = StateBits::from_bits(state_bits).ok_or_else(|| {
            PyValueError::new_err(format!("state_bits must be 32, 16 or 8, got {state_bits}"))
        })?;
        let opts = Options {
            master,
            bits,
            seed,
            chunk_elems,
            task_elems,
            tier,
        };
        let pool = pool.pool.clone();
        let state = guarded(py, || AdamState::new(&pool, &unit_lens, &opts))?;
        let threads = match threads {
            0 => None,
            n => Some(
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .thread_name(|i| format!("spillover-adamw-{i}"))
                    .build()
                    .map_err(|e| {
                        PyValueError::new_err(format!("AdamState: {n} update threads: {e}"))
                    })?,
            ),
        };
        Ok(PyAdamState {
            inner: Mutex::new(state),
            threads,
        })
    }

    /// The threads `step` runs on (`threads=` given, else rayon's global pool's).
    #[getter]
    fn threads(&self) -> usize {
        match &self.threads {
            Some(p) => p.current_num_threads(),
            None => rayon::current_num_threads(),
        }
    }

    /// Write the fp32 master of the units in `records` (step records: `unit` and `out` are
    /// read) to their `out` buffers in the model's dtype, GIL released: the parameters after
    /// predicted outputs (Note [weight prediction]). The caller's contract is `step`'s.
    fn write_params(&self, py: Python<'_>, records: &[u8]) -> PyResult<()> {
        let work = parse_steps(records)?;
        guarded(py, || {
            let run = || {
                let mut st = self.lock();
                // SAFETY: as in `step`.
                unsafe { st.write_params(&work) }
            };
            match &self.threads {
                Some(p) => p.install(run),
                None => run(),
            }
        })
    }

    /// One AdamW step over the units in `records` (see `STEP_RECORD`), GIL released.
    ///
    /// The Python caller (spillover.optim) passes the data_ptr of tensors it holds referenced
    /// and does not touch during the call; lengths come from the layout, overlaps are refused.
    fn step(&self, py: Python<'_>, records: &[u8]) -> PyResult<()> {
        let work = parse_steps(records)?;
        guarded(py, || {
            let run = || {
                let mut st = self.lock();
                // SAFETY: the Python layer's contract above: every address is the data_ptr of
                // a live, contiguous CPU tensor (or pool block) of the unit's length and dtype,
                // held alive for the call and written by no one else meanwhile.
                unsafe { st.step(&work) }
            };
            match &self.threads {
                Some(p) => p.install(run),
                None => run(),
            }
        })
    }

    /// Copy the state of the units in `records` (see `BUFFER_RECORD`) into buffers: `form=
    /// "stored"` as kept (moments as float32, bf16 bits or int8 / uint8 codes, and for 8-bit
    /// state one float32 scale per block of 256 in the scale buffers); `"f32"` as float32
    /// values (dequantized).
    #[pyo3(name = "export_state", signature = (records, form="stored"))]
    fn export(&self, py: Python<'_>, records: &[u8], form: &str) -> PyResult<()> {
        let bufs = parse_buffers(records)?;
        let form = parse_form(form)?;
        guarded(py, || {
            let mut st = self.lock();
            // SAFETY: every address is the data_ptr of a live contiguous CPU tensor holding the
            // unit's elements in `form` (see above), that the caller holds and nobody else uses
            // during the call.
            unsafe { st.export(&bufs, form) }
        })
    }

    /// Set the state of the units in `records` from buffers in `form` (as `export_state`;
    /// `"f32"` quantizes, rounding to nearest); they count as initialized.
    #[pyo3(name = "import_state", signature = (records, form="stored"))]
    fn import(&self, py: Python<'_>, records: &[u8], form: &str) -> PyResult<()> {
        let bufs = parse_buffers(records)?;
        let form = parse_form(form)?;
        guarded(py, || {
            let mut st = self.lock();
            // SAFETY: as in `export`; the buffers are only read.
            unsafe { st.import(&bufs, form) }
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

    /// How the moments are stored: 32, 16 or 8.
    #[getter]
    fn state_bits(&self, py: Python<'_>) -> u32 {
        py.detach(|| self.lock().bits().bits())
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
