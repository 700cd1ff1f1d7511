//! CPU AdamW over optimizer state kept in host memory or on NVMe (ZeRO-Offload /
//! ZeRO-Infinity style), in fp32, bf16 or block-wise 8-bit.
//!
//! [`AdamState`] owns the state of a list of *units* (runs of elements: a parameter, or the
//! part of one a rank owns) and applies torch's AdamW to them, given for each unit the address
//! of its gradient and of the parameter it reads and writes. It knows nothing of torch: Python
//! (`spillover/optim/`) hands it addresses of tensors it keeps alive for the call.
//!
//! State per element: `exp_avg`, `exp_avg_sq`, and — when the model's parameter is not itself
//! the fp32 master (bf16 parameters, parameters on a GPU, sharded ranks) and the caller keeps
//! one — the fp32 `master`. The moments are fp32 ([`StateBits::F32`], torch's state), bf16
//! or 8-bit with a scale per block ([`quant`], Note [stochastic rounding], Note [8-bit
//! moments]). [`layout`] places units in chunks; the host tier keeps every chunk resident
//! ([`host`]), the NVMe tier keeps chunks in swap slots and streams them through a three-stage
//! pipeline ([`nvme`], Note [three-stage pipeline]). The update itself is [`kernel::apply`]
//! (Note [torch rounding]), run in parallel on rayon's pool over long runs of elements
//! ([`task`], Note [task size]); low-bit state and bf16 parameters without a master go
//! through [`lowbit`], which dequantizes, updates and requantizes a block at a time with the
//! same arithmetic (Note [one pass per block]).
//!
//! A unit's state is *initialized* by its first step (moments zeroed, master copied from the
//! parameter), exactly when torch's AdamW creates its state; [`AdamState::import`] initializes
//! it from a checkpoint instead, [`AdamState::reset`] forgets it.

mod checkpoint;
pub mod dtype;
mod host;
pub mod kernel;
pub mod layout;
mod lowbit;
mod nvme;
pub mod predict;
mod q8;
pub mod quant;
mod step;
mod task;

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::io::{FaultKind, Swap};
use crate::pool::Pool;

pub use kernel::{bf16_to_f32, f32_to_bf16, fma_available, Bf16, Coeffs, Hyper};
pub use layout::{Columns, Layout, Piece, ALIGN};
pub use quant::{StateBits, BLOCK};

/// Smallest task, in elements (64 KiB per f32 stream), unless a piece is shorter.
pub const MIN_TASK: usize = 1 << 14;

/// Element type of a gradient or a model parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    F32,
    Bf16,
}

impl Dtype {
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 => 2,
        }
    }
}

/// A host address of `dtype` elements; `addr == 0` means none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ptr {
    pub addr: usize,
    pub dtype: Dtype,
}

impl Ptr {
    pub const NONE: Ptr = Ptr {
        addr: 0,
        dtype: Dtype::F32,
    };

    pub fn new(addr: usize, dtype: Dtype) -> Ptr {
        Ptr { addr, dtype }
    }

    pub fn is_none(&self) -> bool {
        self.addr == 0
    }

    fn range(&self, len: usize) -> (usize, usize) {
        (self.addr, self.addr + len * self.dtype.size())
    }
}

/// One unit's work for a step. All addresses point at `len(unit)` contiguous elements.
#[derive(Debug, Clone, Copy)]
pub struct UnitStep {
    pub unit: usize,
    pub grad: Ptr,
    /// Without a master column: the fp32 parameter to read (it is the master). With one: the
    /// parameter value the master starts from, needed only on the unit's first step.
    pub src: Ptr,
    /// Where the updated parameter is written in the model's dtype. Without a master column
    /// it must be f32 and may equal `src` (updated in place). With one it may be none.
    pub out: Ptr,
    pub hyper: Hyper,
    /// How many of the unit's last elements to update in the rounding of torch's scalar
    /// remainder loop (`numel % vector width` for a unit that ends a tensor, else 0), to stay
    /// bitwise equal to torch's fused kernel (Note [torch rounding]).
    pub tail: usize,
    /// Write to `out` the parameter predicted for the next step, not the master (Note [weight
    /// prediction] in predict.rs): needs an fp32 master and fp32 moments.
    pub predict: bool,
    /// With `predict`: where the next denominator's `v` part is written, in bf16, the
    /// prediction then leaving the next gradient's term to the device (Note [next-gradient
    /// prediction] in predict.rs). None: the plain prediction.
    pub coef: Ptr,
    /// The key of the unit's first element for stochastic rounding (Note [stochastic
    /// rounding]): where it sits in its parameter, the same whatever the tier or layout.
    pub key: u64,
}

/// Addresses of buffers of `len(unit)` elements, for [`AdamState::export`] and
/// [`AdamState::import`]. `master` is ignored (may be 0) when the state has no master column.
/// In the [`Form::F32`] form every buffer is f32; in the [`Form::Stored`] form the moments are
/// as stored (f32, bf16 bits, or i8 / u8 codes) and, for 8-bit state, the scale buffers hold
/// `blocks(len(unit))` f32 (ignored otherwise).
#[derive(Debug, Clone, Copy)]
pub struct UnitBuffers {
    pub unit: usize,
    pub master: usize,
    pub exp_avg: usize,
    pub exp_avg_sq: usize,
    pub exp_avg_scale: usize,
    pub exp_avg_sq_scale: usize,
}

/// How [`AdamState::export`] and [`AdamState::import`] present the moments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Form {
    /// Exactly as stored: a round trip through it is bit for bit.
    Stored,
    /// As f32 values: dequantized on export; quantized on import (rounded to nearest, Note
    /// [stochastic rounding]), a conversion between formats.
    F32,
}

/// Where the state lives.
#[derive(Debug, Clone)]
pub enum Tier {
    /// Pool blocks (heap when the pool is full, if `allow_heap`).
    Host { allow_heap: bool },
    /// Slots in `swap` (shared: the process's one engine and set of swap files), streamed
    /// through `buffers` pool blocks.
    Nvme { swap: Arc<Swap>, buffers: usize },
}

#[derive(Debug, Clone)]
pub struct Options {
    /// Keep an fp32 master column (the parameter is not its own master).
    pub master: bool,
    /// How the moments are stored.
    pub bits: StateBits,
    /// Seed of stochastic rounding (Note [stochastic rounding]).
    pub seed: u64,
    /// Elements per chunk: a positive multiple of [`ALIGN`] (of [`BLOCK`] for low-bit state).
    pub chunk_elems: usize,
    /// Largest run one rayon task updates (passes are cut into about 4 tasks per thread, each
    /// at least [`MIN_TASK`] and at most this many elements; Note [task size]).
    pub task_elems: usize,
    pub tier: Tier,
}

/// Counters since the state was made.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Stats {
    pub steps: u64,
    /// Swap bytes moved by the optimizer (NVMe tier).
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// Time blocked on swap I/O, and in the kernel, summed over steps.
    pub io_wait_seconds: f64,
    pub compute_seconds: f64,
    pub last_step_seconds: f64,
    /// Bytes of state as stored (chunks' columns, padding included).
    pub state_bytes: u64,
    /// Host-tier chunks that did not fit the pool and live on the heap.
    pub heap_chunks: u64,
}

enum Store {
    Host(host::HostStore),
    Nvme(nvme::NvmeStore),
}

/// The optimizer state of a list of units, and the AdamW step over it.
pub struct AdamState {
    // Host blocks, or slots in the shared swap; both go back to their owner when dropped.
    store: Store,
    layout: Layout,
    master: bool,
    bits: StateBits,
    seed: u64,
    initialized: Vec<bool>,
    task_elems: usize,
    stats: Stats,
}

impl std::fmt::Debug for AdamState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdamState")
            .field("tier", &self.tier_name())
            .field("units", &self.layout.units())
            .field("chunks", &self.layout.chunks())
            .field("master", &self.master)
            .field("bits", &self.bits)
            .field("stats", &self.stats)
            .finish()
    }
}

impl AdamState {
    /// State for units of `unit_lens` elements. The host tier leases its chunks now; the NVMe
    /// tier reserves its slots in the swap now, so a full disk is reported here.
    pub fn new(pool: &Pool, unit_lens: &[usize], opts: &Options) -> Result<AdamState> {
        let align = Layout::align_for(opts.bits);
        let layout = Layout::aligned(unit_lens, opts.chunk_elems, align).map_err(Error::Invalid)?;
        if opts.task_elems == 0 {
            return Err(Error::Invalid("task size must be > 0 elements".into()));
        }
        let sizes = (0..layout.chunks()).map(|c| layout.columns(c, opts.master, opts.bits).bytes);
        let state_bytes = sizes.clone().sum::<usize>() as u64;
        let store = match &opts.tier {
            Tier::Host { allow_heap } => {
                Store::Host(host::HostStore::new(pool, sizes, *allow_heap)?)
            }
            Tier::Nvme { swap, buffers } => {
                let bytes = sizes.map(|n| n as u64).collect();
                Store::Nvme(nvme::NvmeStore::new(pool, swap.clone(), bytes, *buffers)?)
            }
        };
        let heap_chunks = match &store {
            Store::Host(h) => h.heap_chunks() as u64,
            Store::Nvme(_) => 0,
        };
        Ok(AdamState {
            store,
            initialized: vec![false; layout.units()],
            layout,
            master: opts.master,
            bits: opts.bits,
            seed: opts.seed,
            task_elems: opts.task_elems,
            stats: Stats {
                state_bytes,
                heap_chunks,
                ..Stats::default()
            },
        })
    }

    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    pub fn has_master(&self) -> bool {
        self.master
    }

    pub fn bits(&self) -> StateBits {
        self.bits
    }

    /// `"host"` or `"nvme"`.
    pub fn tier_name(&self) -> &'static str {
        match self.store {
            Store::Host(_) => "host",
            Store::Nvme(_) => "nvme",
        }
    }

    /// The swap engine's name and warning (NVMe tier).
    pub fn swap_info(&self) -> Option<(&'static str, Option<String>)> {
        match &self.store {
            Store::Nvme(n) => Some((
                n.swap().engine_name(),
                n.swap().warning().map(str::to_string),
            )),
            Store::Host(_) => None,
        }
    }

    /// For tests: fail the NVMe tier's next I/O (see [`crate::io::Swap::inject_fault`]); the
    /// swap is shared, so whoever uses it next sees the fault.
    pub fn inject_fault(&self, kind: FaultKind, errno: i32, count: u32) -> Result<()> {
        match &self.store {
            Store::Nvme(n) => {
                n.swap().inject_fault(kind, errno, count);
                Ok(())
            }
            Store::Host(_) => Err(Error::Invalid("fault injection needs the NVMe tier".into())),
        }
    }

    pub fn stats(&self) -> Stats {
        self.stats
    }

    pub fn is_initialized(&self, unit: usize) -> bool {
        self.initialized[unit]
    }

    /// Forget a unit's state: its next step starts it afresh.
    pub fn reset(&mut self, unit: usize) -> Result<()> {
        self.check_unit(unit)?;
        self.initialized[unit] = false;
        Ok(())
    }

    fn check_unit(&self, unit: usize) -> Result<()> {
        if unit >= self.layout.units() {
            return Err(Error::Invalid(format!(
                "unit {unit} out of range: the state has {} units",
                self.layout.units()
            )));
        }
        Ok(())
    }
}
