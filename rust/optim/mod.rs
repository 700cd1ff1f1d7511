//! CPU AdamW over fp32 optimizer state kept in host memory or on NVMe (ZeRO-Offload /
//! ZeRO-Infinity style).
//!
//! [`AdamState`] owns the state of a list of *units* (runs of elements: a parameter, or the
//! part of one a rank owns) and applies torch's AdamW to them, given for each unit the address
//! of its gradient and of the parameter it reads and writes. It knows nothing of torch: Python
//! (`spillover/optim/`) hands it addresses of tensors it keeps alive for the call.
//!
//! State per element: `exp_avg`, `exp_avg_sq`, and — when the model's parameter is not itself
//! the fp32 master (bf16 parameters, parameters on a GPU, sharded ranks) — the fp32 `master`.
//! [`layout`] places units in chunks; the host tier keeps every chunk resident ([`host`]), the
//! NVMe tier keeps chunks in swap slots and streams them through a three-stage pipeline
//! ([`nvme`], Note [three-stage pipeline]). The update itself is [`kernel::apply`] (Note [torch
//! rounding]), run in parallel on rayon's pool over long runs of elements (Note [task size]).
//!
//! A unit's state is *initialized* by its first step (moments zeroed, master copied from the
//! parameter), exactly when torch's AdamW creates its state; [`AdamState::import`] initializes
//! it from a checkpoint instead, [`AdamState::reset`] forgets it.

mod host;
pub mod kernel;
pub mod layout;
mod nvme;

use std::sync::Arc;
use std::time::Instant;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::io::{FaultKind, Swap};
use crate::pool::Pool;

pub use kernel::{bf16_to_f32, f32_to_bf16, fma_available, Bf16, Coeffs, Hyper};
pub use layout::{Layout, Piece, ALIGN};

use kernel::{Grad, Run};

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
}

/// Addresses of f32 buffers of `len(unit)` elements, for [`AdamState::export`] and
/// [`AdamState::import`]. `master` is ignored (may be 0) when the state has no master column.
#[derive(Debug, Clone, Copy)]
pub struct UnitBuffers {
    pub unit: usize,
    pub master: usize,
    pub exp_avg: usize,
    pub exp_avg_sq: usize,
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
    /// Elements per chunk: a positive multiple of [`ALIGN`].
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
    /// Bytes of state (chunks' columns).
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
            .field("stats", &self.stats)
            .finish()
    }
}

/// Raw pointers for a task run on another thread.
#[derive(Clone, Copy)]
struct Task {
    work: usize,
    base: *mut f32,
    /// Elements between the starts of the chunk's columns.
    stride: usize,
    chunk_off: usize,
    unit_off: usize,
    len: usize,
}

// SAFETY: a task's pointers address ranges no other task touches (state: disjoint pieces of
// chunks; gradients, sources and outputs: disjoint units, checked by `AdamState::validate`),
// valid for the duration of the parallel loop that runs it (the caller's contract).
unsafe impl Send for Task {}
// SAFETY: as for `Send`; a `&Task` only gives copies of the addresses.
unsafe impl Sync for Task {}

impl AdamState {
    /// State for units of `unit_lens` elements. The host tier leases its chunks now; the NVMe
    /// tier reserves its slots in the swap now, so a full disk is reported here.
    pub fn new(pool: &Pool, unit_lens: &[usize], opts: &Options) -> Result<AdamState> {
        let layout = Layout::new(unit_lens, opts.chunk_elems).map_err(Error::Invalid)?;
        if opts.task_elems == 0 {
            return Err(Error::Invalid("task size must be > 0 elements".into()));
        }
        let cols = if opts.master { 3 } else { 2 };
        let floats = (0..layout.chunks()).map(|c| cols * layout.col_stride(c));
        let state_bytes = 4 * floats.clone().sum::<usize>() as u64;
        let store = match &opts.tier {
            Tier::Host { allow_heap } => {
                Store::Host(host::HostStore::new(pool, floats, *allow_heap)?)
            }
            Tier::Nvme { swap, buffers } => {
                let bytes = floats.map(|n| 4 * n as u64).collect();
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

    /// One AdamW step for each unit in `work` (units not listed are untouched). On error
    /// nothing has been written when the error is a validation error; an I/O error leaves the
    /// units of the chunks in flight unspecified.
    ///
    /// # Safety
    /// Every non-null address in `work` must be valid for `len(unit)` elements of its dtype
    /// (reads for `grad` and `src`, writes for `out`) for the duration of the call, and no one
    /// else may write them meanwhile (reading `grad` or `src` concurrently is fine). Overlaps
    /// between units, and between a unit's gradient and its output, are checked and refused.
    pub unsafe fn step(&mut self, work: &[UnitStep]) -> Result<()> {
        let t0 = Instant::now();
        let coeffs = self.validate(work)?;
        let init: Vec<bool> = work.iter().map(|w| !self.initialized[w.unit]).collect();
        for (w, &init) in work.iter().zip(&init) {
            if init && self.master && w.src.is_none() {
                return Err(Error::Invalid(format!(
                    "unit {}: its first step needs the parameter's value to start the fp32 \
                     master from, but no source address was given",
                    w.unit
                )));
            }
        }
        let tail_from: Vec<usize> = work
            .iter()
            .map(|w| {
                let len = self.layout.unit_len(w.unit);
                len - w.tail.min(len)
            })
            .collect();
        let master = self.master;
        let run = |t: &Task| {
            let i = t.work;
            let w = &work[i];
            // SAFETY: the task's ranges are valid and exclusive (see `Task` and this fn's
            // contract); the constants belong to the same unit.
            unsafe { run_task(t, w, &coeffs[i], init[i], master, tail_from[i]) }
        };
        self.for_each_task(work.iter().map(|w| w.unit), true, run)?;
        for w in work {
            self.initialized[w.unit] = true;
        }
        self.stats.steps += 1;
        self.stats.last_step_seconds = t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Copy each listed unit's state into the f32 buffers given.
    ///
    /// # Safety
    /// Every non-zero address must be valid for writes of `len(unit)` f32, not overlapping
    /// anything else in the call, for its duration.
    pub unsafe fn export(&mut self, bufs: &[UnitBuffers]) -> Result<()> {
        self.check_buffers(bufs, true)?;
        let master = self.master;
        let copy = |t: &Task| {
            let b = &bufs[t.work];
            // SAFETY: the piece lies inside its chunk; the caller vouches for the buffers.
            unsafe { copy_piece(t, b, master, false) }
        };
        self.for_each_task(bufs.iter().map(|b| b.unit), false, copy)
    }

    /// Set each listed unit's state from the f32 buffers given; the units count as
    /// initialized afterwards.
    ///
    /// # Safety
    /// Every non-zero address must be valid for reads of `len(unit)` f32 for the call.
    pub unsafe fn import(&mut self, bufs: &[UnitBuffers]) -> Result<()> {
        self.check_buffers(bufs, false)?;
        let master = self.master;
        let copy = |t: &Task| {
            let b = &bufs[t.work];
            // SAFETY: as in `export`, in the other direction.
            unsafe { copy_piece(t, b, master, true) }
        };
        self.for_each_task(bufs.iter().map(|b| b.unit), true, copy)?;
        for b in bufs {
            self.initialized[b.unit] = true;
        }
        Ok(())
    }

    fn check_buffers(&self, bufs: &[UnitBuffers], need_init: bool) -> Result<()> {
        let mut seen = vec![false; self.layout.units()];
        for b in bufs {
            self.check_unit(b.unit)?;
            if std::mem::replace(&mut seen[b.unit], true) {
                return Err(Error::Invalid(format!("unit {} listed twice", b.unit)));
            }
            if need_init && !self.initialized[b.unit] {
                return Err(Error::Invalid(format!(
                    "unit {} has no state yet (it has not taken a step)",
                    b.unit
                )));
            }
            if b.exp_avg == 0 || b.exp_avg_sq == 0 || (self.master && b.master == 0) {
                return Err(Error::Invalid(format!(
                    "unit {}: a buffer address is missing",
                    b.unit
                )));
            }
        }
        Ok(())
    }

    /// Run `f` over tasks covering every piece of the given units (listed in `units` order, a
    /// task's `work` is the index into it), chunk by chunk on the NVMe tier, all at once on
    /// the host tier. `write_back`: whether the state changed (NVMe tier writes chunks back).
    fn for_each_task(
        &mut self,
        units: impl Iterator<Item = usize>,
        write_back: bool,
        f: impl Fn(&Task) + Sync,
    ) -> Result<()> {
        let cols = if self.master { 3 } else { 2 };
        let nchunks = self.layout.chunks();
        let mut by_chunk: Vec<Vec<(usize, Piece)>> = vec![Vec::new(); nchunks];
        for (i, u) in units.enumerate() {
            for p in self.layout.pieces(u) {
                by_chunk[p.chunk].push((i, p));
            }
        }
        let layout = &self.layout;
        let max_task = self.task_elems.max(1);
        // Note [task size]: long runs keep the hardware prefetchers' streams going (measured
        // at 100M fp32 parameters on 2 cores: 32 Ki-element tasks 83 ms, 1 Mi 63 ms, 8 Mi
        // 61 ms, torch fused 66 ms); a pass is still cut into at least 4 tasks per thread so
        // work stealing can even out the cores.
        let threads = rayon::current_num_threads().max(1);
        let task_size =
            |elems: usize| (elems / (4 * threads)).clamp(MIN_TASK.min(max_task), max_task);
        let host_task = task_size(by_chunk.iter().flatten().map(|(_, p)| p.len).sum());
        let is_host = matches!(self.store, Store::Host(_));
        let tasks_of = |chunk: usize, base: *mut f32, out: &mut Vec<Task>| {
            let stride = layout.col_stride(chunk);
            debug_assert!(cols * stride > 0);
            let task_elems = if is_host {
                host_task
            } else {
                task_size(by_chunk[chunk].iter().map(|(_, p)| p.len).sum())
            };
            for &(work, p) in &by_chunk[chunk] {
                for (off, len) in layout::split_even(p.len, task_elems) {
                    out.push(Task {
                        work,
                        base,
                        stride,
                        chunk_off: p.chunk_off + off,
                        unit_off: p.unit_off + off,
                        len,
                    });
                }
            }
        };
        match &mut self.store {
            Store::Host(h) => {
                let ptrs = h.chunk_ptrs();
                let mut tasks = Vec::new();
                for (c, &base) in ptrs.iter().enumerate() {
                    tasks_of(c, base, &mut tasks);
                }
                let t0 = Instant::now();
                tasks.par_iter().for_each(&f);
                self.stats.compute_seconds += t0.elapsed().as_secs_f64();
                Ok(())
            }
            Store::Nvme(n) => {
                let chunks: Vec<usize> =
                    (0..nchunks).filter(|&c| !by_chunk[c].is_empty()).collect();
                let mut ps = nvme::PassStats::default();
                let mut tasks = Vec::new();
                let r = n.stream(&chunks, write_back, &mut ps, |chunk, base| {
                    tasks.clear();
                    tasks_of(chunk, base, &mut tasks);
                    tasks.par_iter().for_each(&f);
                    Ok(())
                });
                self.stats.bytes_read += ps.bytes_read;
                self.stats.bytes_written += ps.bytes_written;
                self.stats.io_wait_seconds += ps.io_wait;
                self.stats.compute_seconds += ps.compute;
                r
            }
        }
    }

    /// Check a step's work list; returns each unit's constants.
    fn validate(&self, work: &[UnitStep]) -> Result<Vec<Coeffs>> {
        let mut seen = vec![false; self.layout.units()];
        let mut outs: Vec<(usize, usize, usize)> = Vec::with_capacity(work.len());
        let mut coeffs = Vec::with_capacity(work.len());
        for w in work {
            let u = w.unit;
            self.check_unit(u)?;
            if std::mem::replace(&mut seen[u], true) {
                return Err(Error::Invalid(format!("unit {u} listed twice in one step")));
            }
            let bad = |what: &str| Err(Error::Invalid(format!("unit {u}: {what}")));
            w.hyper
                .validate()
                .map_err(|e| Error::Invalid(format!("unit {u}: {e}")))?;
            let len = self.layout.unit_len(u);
            if w.grad.is_none() {
                return bad("no gradient address");
            }
            if !self.master {
                if w.src.is_none() || w.src.dtype != Dtype::F32 {
                    return bad("without a master column the fp32 parameter must be the source");
                }
                if w.out.is_none() || w.out.dtype != Dtype::F32 {
                    return bad("without a master column the output must be the fp32 parameter");
                }
                if w.src.addr != w.out.addr && overlaps(w.src.range(len), w.out.range(len)) {
                    return bad("source and output overlap without being the same buffer");
                }
            }
            if !w.out.is_none() {
                let (a, b) = w.out.range(len);
                if overlaps((a, b), w.grad.range(len)) {
                    return bad("gradient and output overlap");
                }
                if len > 0 {
                    outs.push((a, b, u));
                }
            }
            coeffs.push(w.hyper.coeffs());
        }
        outs.sort_unstable();
        for pair in outs.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(Error::Invalid(format!(
                    "units {} and {} write overlapping outputs",
                    pair[0].2, pair[1].2
                )));
            }
        }
        Ok(coeffs)
    }
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1 && a.0 < a.1 && b.0 < b.1
}

/// The state columns of a task's piece: (master, exp_avg, exp_avg_sq).
///
/// # Safety
/// `t.base` must address a chunk of `cols * t.stride` f32 and the piece must lie inside it,
/// with no other live reference to those elements.
unsafe fn columns<'a>(
    t: &Task,
    master: bool,
) -> (Option<&'a mut [f32]>, &'a mut [f32], &'a mut [f32]) {
    // SAFETY: column `c` of the chunk starts at `c * stride`; the piece is inside it.
    let col = |c: usize| unsafe {
        std::slice::from_raw_parts_mut(t.base.add(c * t.stride + t.chunk_off), t.len)
    };
    if master {
        (Some(col(0)), col(1), col(2))
    } else {
        (None, col(0), col(1))
    }
}

/// A typed slice of a unit's buffer for a task.
///
/// # Safety
/// `p` must address at least `t.unit_off + t.len` elements of `T`.
unsafe fn part<'a, T>(p: Ptr, t: &Task) -> &'a [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts((p.addr as *const T).add(t.unit_off), t.len) }
}

/// # Safety
/// As [`part`], and no other reference to the range may be live.
unsafe fn part_mut<'a, T>(p: Ptr, t: &Task) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut((p.addr as *mut T).add(t.unit_off), t.len) }
}

/// # Safety
/// See `AdamState::step`: the task's state and the unit's buffers are valid and exclusive.
unsafe fn run_task(t: &Task, w: &UnitStep, k: &Coeffs, init: bool, master: bool, tail_from: usize) {
    // Elements from `split` on are in the unit's tail (`UnitStep::tail`).
    let split = tail_from.saturating_sub(t.unit_off).min(t.len);
    let main = Task { len: split, ..*t };
    let tail = Task {
        chunk_off: t.chunk_off + split,
        unit_off: t.unit_off + split,
        len: t.len - split,
        ..*t
    };
    // SAFETY: forwarded contract; `main` and `tail` split the task's range.
    unsafe {
        for (part, is_tail) in [(main, false), (tail, true)] {
            if part.len == 0 {
                continue;
            }
            match w.grad.dtype {
                Dtype::F32 => run_typed::<f32>(&part, w, k, init, master, is_tail),
                Dtype::Bf16 => run_typed::<Bf16>(&part, w, k, init, master, is_tail),
            }
        }
    }
}

/// # Safety
/// As `run_task`.
unsafe fn run_typed<G: Grad>(
    t: &Task,
    w: &UnitStep,
    k: &Coeffs,
    init: bool,
    master: bool,
    tail: bool,
) {
    // SAFETY: forwarded contract.
    unsafe {
        let grad = part::<G>(w.grad, t);
        let (mut mst, m, v) = columns(t, master);
        if init {
            m.fill(0.0);
            v.fill(0.0);
            if let Some(mst) = mst.as_deref_mut() {
                match w.src.dtype {
                    Dtype::F32 => mst.copy_from_slice(part::<f32>(w.src, t)),
                    Dtype::Bf16 => kernel::widen_into(part::<Bf16>(w.src, t), mst),
                }
            }
        }
        match (mst, w.out.is_none(), w.out.dtype) {
            (Some(master), true, _) => {
                let run: Run<'_, G, f32> = Run::Master {
                    master,
                    grad,
                    out: &mut [],
                };
                go(tail, run, m, v, k)
            }
            (Some(master), false, Dtype::F32) => {
                let out = part_mut::<f32>(w.out, t);
                go(tail, Run::Master { master, grad, out }, m, v, k)
            }
            (Some(master), false, Dtype::Bf16) => {
                let out = part_mut::<Bf16>(w.out, t);
                go(tail, Run::Master { master, grad, out }, m, v, k)
            }
            (None, _, _) if w.src.addr == w.out.addr => {
                let param = part_mut::<f32>(w.out, t);
                let run: Run<'_, G, f32> = Run::InPlace { param, grad };
                go(tail, run, m, v, k)
            }
            (None, _, _) => {
                let src = part::<f32>(w.src, t);
                let out = part_mut::<f32>(w.out, t);
                go(tail, Run::Copy { src, grad, out }, m, v, k)
            }
        }
    }
}

fn go<G: Grad, P: kernel::Param>(
    tail: bool,
    run: Run<'_, G, P>,
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    if tail {
        kernel::apply_tail(run, m, v, k)
    } else {
        kernel::apply(run, m, v, k)
    }
}

/// Copy a piece between the state and a unit's f32 buffers (`into_state`: import).
///
/// # Safety
/// As [`columns`] for the state; the buffers must be valid for `unit_off + len` f32.
unsafe fn copy_piece(t: &Task, b: &UnitBuffers, master: bool, into_state: bool) {
    // SAFETY: forwarded contract.
    unsafe {
        let (mst, m, v) = columns(t, master);
        let pairs = [
            (mst, b.master),
            (Some(m), b.exp_avg),
            (Some(v), b.exp_avg_sq),
        ];
        for (col, addr) in pairs {
            let Some(col) = col else { continue };
            let p = Ptr::new(addr, Dtype::F32);
            if into_state {
                col.copy_from_slice(part::<f32>(p, t));
            } else {
                part_mut::<f32>(p, t).copy_from_slice(col);
            }
        }
    }
}
