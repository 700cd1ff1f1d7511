//! Tasks: a run of one unit's piece of a chunk, as raw pointers a rayon worker updates or
//! copies; how a pass over units is cut into tasks (Note [task size]) and run over the store,
//! all chunks at once on the host tier, chunk by chunk through the pipeline on the NVMe tier.

use std::time::Instant;

use rayon::prelude::*;

use super::layout::{self, Columns, Piece};
use super::quant::BLOCK;
use super::{nvme, AdamState, Ptr, Store, MIN_TASK};
use crate::error::Result;

/// Raw pointers for a task run on another thread.
#[derive(Clone, Copy)]
pub(super) struct Task {
    pub(super) work: usize,
    pub(super) base: *mut u8,
    /// Where the chunk's columns start.
    pub(super) cols: Columns,
    pub(super) chunk_off: usize,
    pub(super) unit_off: usize,
    pub(super) len: usize,
}

// SAFETY: a task's pointers address ranges no other task touches (state: disjoint pieces of
// chunks; gradients, sources and outputs: disjoint units, checked by `AdamState::validate`),
// valid for the duration of the parallel loop that runs it (the caller's contract).
unsafe impl Send for Task {}
// SAFETY: as for `Send`; a `&Task` only gives copies of the addresses.
unsafe impl Sync for Task {}

impl AdamState {
    /// Run `f` over tasks covering every piece of the given units (listed in `units` order, a
    /// task's `work` is the index into it), chunk by chunk on the NVMe tier, all at once on
    /// the host tier. `write_back`: whether the state changed (NVMe tier writes chunks back).
    pub(super) fn for_each_task(
        &mut self,
        units: impl Iterator<Item = usize>,
        write_back: bool,
        f: impl Fn(&Task) + Sync,
    ) -> Result<()> {
        let (master, bits) = (self.master, self.bits);
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
        let align = layout.align();
        let tasks_of = |chunk: usize, base: *mut u8, out: &mut Vec<Task>| {
            let cols = layout.columns(chunk, master, bits);
            let task_elems = if is_host {
                host_task
            } else {
                task_size(by_chunk[chunk].iter().map(|(_, p)| p.len).sum())
            };
            for &(work, p) in &by_chunk[chunk] {
                for (off, len) in layout::split_even(p.len, task_elems, align) {
                    out.push(Task {
                        work,
                        base,
                        cols,
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
}

/// A task's piece of one column that holds `T`s, starting `at` bytes into the chunk.
///
/// # Safety
/// `t.base` must address a chunk laid out as `t.cols` says, with the column at `at` holding
/// at least `t.chunk_off + t.len` elements of `T` (suitably aligned: columns start on cache
/// lines), and no other live reference to those elements.
unsafe fn col<'a, T>(t: &Task, at: usize) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut((t.base.add(at) as *mut T).add(t.chunk_off), t.len) }
}

/// The fp32 state columns of a task's piece: (master, exp_avg, exp_avg_sq).
///
/// # Safety
/// As [`col`], for a chunk of fp32 state.
pub(super) unsafe fn columns<'a>(
    t: &Task,
) -> (Option<&'a mut [f32]>, &'a mut [f32], &'a mut [f32]) {
    // SAFETY: the columns are where `t.cols` says and hold the piece (the caller's contract).
    unsafe {
        let master = t.cols.master.map(|at| col::<f32>(t, at));
        (master, col(t, t.cols.exp_avg), col(t, t.cols.exp_avg_sq))
    }
}

/// A task's piece of the moments, as stored.
pub(super) enum Moments<'a> {
    F32 {
        m: &'a mut [f32],
        v: &'a mut [f32],
    },
    /// bf16 bits.
    Bf16 {
        m: &'a mut [u16],
        v: &'a mut [u16],
    },
    /// Codes and the scales of the piece's blocks (Note [8-bit moments] in quant.rs).
    Q8 {
        m: &'a mut [i8],
        v: &'a mut [u8],
        m_scale: &'a mut [f32],
        v_scale: &'a mut [f32],
    },
}

/// The master column (if any) and the moments of a task's piece, for any format.
///
/// # Safety
/// As [`col`]; for 8-bit state the piece starts on a block (Note [block alignment]).
pub(super) unsafe fn state<'a>(
    t: &Task,
    bits: super::StateBits,
) -> (Option<&'a mut [f32]>, Moments<'a>) {
    use super::StateBits;
    // SAFETY: the columns are where `t.cols` says and hold the piece (the caller's contract);
    // the scale columns hold one f32 per block of the chunk and the piece's blocks are inside.
    unsafe {
        let master = t.cols.master.map(|at| col::<f32>(t, at));
        let (m, v) = (t.cols.exp_avg, t.cols.exp_avg_sq);
        let scales = t.cols.exp_avg_scale.zip(t.cols.exp_avg_sq_scale);
        // The scale columns exist exactly for 8-bit state (`Layout::columns`).
        let moments = match (scales, bits) {
            (Some((ms, vs)), _) => {
                debug_assert_eq!(t.chunk_off % BLOCK, 0);
                let blocks = |at: usize| {
                    let p = (t.base.add(at) as *mut f32).add(t.chunk_off / BLOCK);
                    std::slice::from_raw_parts_mut(p, super::quant::blocks(t.len))
                };
                Moments::Q8 {
                    m: col(t, m),
                    v: col(t, v),
                    m_scale: blocks(ms),
                    v_scale: blocks(vs),
                }
            }
            (None, StateBits::Bf16) => Moments::Bf16 {
                m: col(t, m),
                v: col(t, v),
            },
            (None, _) => Moments::F32 {
                m: col(t, m),
                v: col(t, v),
            },
        };
        (master, moments)
    }
}

/// A typed slice of a unit's buffer for a task.
///
/// # Safety
/// `p` must address at least `t.unit_off + t.len` elements of `T`.
pub(super) unsafe fn part<'a, T>(p: Ptr, t: &Task) -> &'a [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts((p.addr as *const T).add(t.unit_off), t.len) }
}

/// # Safety
/// As [`part`], and no other reference to the range may be live.
pub(super) unsafe fn part_mut<'a, T>(p: Ptr, t: &Task) -> &'a mut [T] {
    // SAFETY: the caller's contract.
    unsafe { std::slice::from_raw_parts_mut((p.addr as *mut T).add(t.unit_off), t.len) }
}
