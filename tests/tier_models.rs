//! The activation tier driven the way real models drive it (Note [plans are snapshots] in
//! rust/tier): several steps of one "model", each step packing storages in forward and
//! unpacking them in backward, with
//! - storages larger than half the pool and larger than the whole pool (put in pieces and
//!   gathered, as the Python layer does);
//! - one storage unpacked through several views (RMSNorm saves `x` and `x * rsqrt(...)` views;
//!   on CPU each view is one `get`);
//! - a next step that differs from the one that taught the order (a resized, an extra or a
//!   missing tensor), backward orders that are not reverse pack order;
//! - steps abandoned halfway, read-ahead windows from 0 to the whole pool, write holds from one
//!   page to four pools (and the default), injected I/O faults;
//! - storages written out from their own memory at an address 64 bytes into a page, as torch
//!   places them (Note [written from the tensor]), beside storages copied into the pool.
//!
//! Each case checks every byte that comes back, that no call panics (proptest fails a case that
//! panics), and that the pool and the swap are empty once everything is dropped. A HF Llama
//! panicked in the second step of such a sequence ("the plan reads only entries on disk").

use std::sync::Arc;

use proptest::prelude::*;
use spillover_core::io::{EngineChoice, FaultKind, IoOptions, Swap};
use spillover_core::tier::{Gathered, Handle, Step, Tier, TierOptions, View};
use spillover_core::Error;

mod common;
use common::{pattern, pool, write};

const KIB: u64 = 1 << 10;

fn tier(cap: u64, window: u64, hold: Option<u64>, dir: &std::path::Path) -> Tier {
    let p = pool(cap);
    let mut o = IoOptions::new([dir]);
    o.engine = EngineChoice::Threads;
    o.allow_buffered = true;
    o.block_bytes = 64 * KIB;
    o.queue_depth = 8;
    o.capacity_per_dir = Some(256 << 20);
    let s = Arc::new(Swap::open(&o, &p).unwrap());
    let mut t = TierOptions::for_pool(cap);
    t.prefetch_bytes = window;
    t.write_hold_bytes = hold;
    Tier::new(p, Some(s), t)
}

/// One saved storage of the model: its size as a fraction of the pool (in 1/64ths, so one
/// model fits pools of any size) and how many views of it backward unpacks.
#[derive(Debug, Clone, Copy)]
struct Saved {
    size64: u64,
    views: u8,
    /// Written from its own memory (`Step::put_direct`), whole or in pieces.
    direct: bool,
}

/// How a step differs from the step before it.
#[derive(Debug, Clone, Copy)]
enum Change {
    Same,
    Resize(usize, u64),
    Extra(usize, u64),
    Missing(usize),
}

#[derive(Debug, Clone)]
struct StepPlan {
    change: Change,
    /// Adjacent swaps applied to reverse pack order (recomputed regions unpack in their own
    /// order).
    swaps: Vec<usize>,
    /// Stop backward after this many storages and drop everything (None: run to the end).
    abandon_after: Option<usize>,
    /// Arm an I/O fault before forward (true: a read, false: a write).
    fault: Option<bool>,
    /// How many unpacked views stay alive at once (a tensor lives until its grad op ran).
    live_views: usize,
}

#[derive(Debug, Clone)]
struct Case {
    cap_kib: u64,
    window64: u64,
    /// The write hold in 1/64ths of the pool (None: the default, the pool and the largest
    /// storage written from its memory so far; 0: one page, every such pack waits).
    hold64: Option<u64>,
    model: Vec<Saved>,
    steps: Vec<StepPlan>,
}

fn size64() -> impl Strategy<Value = u64> {
    // Small, under half the pool, over half the pool, over the whole pool.
    prop_oneof![3 => 1u64..8, 3 => 8u64..32, 2 => 33u64..64, 2 => 65u64..200]
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        3 => Just(Change::Same),
        1 => (any::<usize>(), size64()).prop_map(|(i, s)| Change::Resize(i, s)),
        1 => (any::<usize>(), size64()).prop_map(|(i, s)| Change::Extra(i, s)),
        1 => any::<usize>().prop_map(Change::Missing),
    ]
}

fn step_plan() -> impl Strategy<Value = StepPlan> {
    (
        change(),
        prop::collection::vec(any::<usize>(), 0..4),
        prop_oneof![4 => Just(None), 1 => (0usize..12).prop_map(Some)],
        prop_oneof![4 => Just(None), 1 => any::<bool>().prop_map(Some)],
        1usize..4,
    )
        .prop_map(
            |(change, swaps, abandon_after, fault, live_views)| StepPlan {
                change,
                swaps,
                abandon_after,
                fault,
                live_views,
            },
        )
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop_oneof![Just(256u64), Just(512), Just(1024)],
        prop_oneof![Just(0u64), 1u64..64, Just(64)],
        prop_oneof![2 => Just(None), 1 => Just(Some(0u64)), 1 => (1u64..256).prop_map(Some)],
        prop::collection::vec(
            (size64(), 1u8..4, any::<bool>()).prop_map(|(size64, views, direct)| Saved {
                size64,
                views,
                direct,
            }),
            1..10,
        ),
        prop::collection::vec(step_plan(), 2..5),
    )
        .prop_map(|(cap_kib, window64, hold64, model, steps)| Case {
            cap_kib,
            window64,
            hold64,
            model,
            steps,
        })
}

/// What one storage became in forward.
enum Stored {
    One(Handle),
    Pieces(Gathered),
}

/// Retry past injected I/O errors: a failed request raises once, from whichever call sees it
/// (maybe another entry's read-ahead), and leaves its entry where it was.
fn retry<T>(mut f: impl FnMut() -> Result<T, Error>) -> Result<T, TestCaseError> {
    for _ in 0..16 {
        match f() {
            Ok(v) => return Ok(v),
            Err(Error::Io { .. }) => continue,
            Err(e) => return Err(TestCaseError::fail(format!("unexpected error: {e}"))),
        }
    }
    Err(TestCaseError::fail("kept failing"))
}

/// Forward: pack one storage of `n` bytes (pieces of an eighth of the pool past half of it,
/// as `spillover._tiers` cuts them). None: the pool had no room (the tensor stays put).
fn pack(
    step: &Step,
    cap: u64,
    n: u64,
    bytes: &[u8],
    direct: bool,
) -> Result<Option<Stored>, TestCaseError> {
    if direct {
        return pack_direct(step, cap, n, bytes);
    }
    let put = |off: usize, len: usize| -> Result<Option<Handle>, TestCaseError> {
        match step.put(len as u64) {
            Ok((h, v)) => {
                write(&v, &bytes[off..off + len]);
                drop(v);
                match h.seal() {
                    Ok(()) | Err(Error::Io { .. }) | Err(Error::OutOfSpace { .. }) => {}
                    Err(e) => return Err(TestCaseError::fail(format!("seal: {e}"))),
                }
                Ok(Some(h))
            }
            Err(Error::PoolExhausted { .. }) | Err(Error::Io { .. }) => Ok(None),
            Err(Error::OutOfSpace { .. }) => Ok(None),
            Err(e) => Err(TestCaseError::fail(format!("put: {e}"))),
        }
    };
    if n <= cap / 2 {
        return Ok(put(0, n as usize)?.map(Stored::One));
    }
    let piece = (cap / 8) as usize;
    let mut parts = Vec::new();
    let mut off = 0;
    while off < n as usize {
        let len = piece.min(n as usize - off);
        match put(off, len)? {
            Some(h) => parts.push(h),
            None => return Ok(None), // the pieces put so far go with `parts`
        }
        off += len;
    }
    step.gather(parts)
        .map(|g| Some(Stored::Pieces(g)))
        .map_err(|e| TestCaseError::fail(format!("gather: {e}")))
}

/// Forward, written from the storage's own memory, 64 bytes into a page with other bytes around
/// it in the same pages: whole, or past half the pool in pieces of an eighth of it, every piece
/// after the first starting on a page (as `spillover.activations.hooks` cuts them).
fn pack_direct(
    step: &Step,
    cap: u64,
    n: u64,
    bytes: &[u8],
) -> Result<Option<Stored>, TestCaseError> {
    let mut src = vec![0xA5u8; n as usize + 3 * 4096];
    let off = (4096 - src.as_ptr() as usize % 4096) % 4096 + 64;
    src[off..off + n as usize].copy_from_slice(bytes);
    let src = Arc::new(src);
    let p = src[off..].as_ptr();
    let put = |at: usize, len: usize| -> Result<Option<Handle>, TestCaseError> {
        // SAFETY: the owner is the buffer itself, never written again.
        match unsafe {
            step.put_direct(
                p.wrapping_add(at),
                len as u64,
                Box::new(src.clone()),
                at == 0,
            )
        } {
            Ok(h) => Ok(Some(h)),
            Err(Error::Io { .. }) | Err(Error::OutOfSpace { .. }) => Ok(None),
            Err(e) => Err(TestCaseError::fail(format!("put_direct: {e}"))),
        }
    };
    if n <= cap / 2 {
        return Ok(put(0, n as usize)?.map(Stored::One));
    }
    let piece = (cap / 8) as usize;
    let (mut at, mut len) = (0usize, piece - p as usize % 4096);
    let mut parts = Vec::new();
    while at < n as usize {
        len = len.min(n as usize - at);
        match put(at, len)? {
            Some(h) => parts.push(h),
            None => return Ok(None),
        }
        (at, len) = (at + len, piece);
    }
    step.gather(parts)
        .map(|g| Some(Stored::Pieces(g)))
        .map_err(|e| TestCaseError::fail(format!("gather: {e}")))
}

fn unpack(s: &Stored) -> Result<View, TestCaseError> {
    match s {
        Stored::One(h) => retry(|| h.get()),
        Stored::Pieces(g) => retry(|| g.get()),
    }
}

fn sizes_of(model: &[Saved], change: Change) -> Vec<u64> {
    let mut m: Vec<Saved> = model.to_vec();
    match change {
        Change::Same => {}
        Change::Resize(i, s) => {
            let i = i % m.len();
            m[i].size64 = s;
        }
        Change::Extra(i, s) => {
            let i = i % (m.len() + 1);
            m.insert(
                i,
                Saved {
                    size64: s,
                    views: 2,
                    direct: false,
                },
            );
        }
        Change::Missing(i) if m.len() > 1 => {
            m.remove(i % m.len());
        }
        Change::Missing(_) => {}
    }
    m.iter().map(|s| s.size64).collect()
}

fn run(case: &Case) -> Result<(), TestCaseError> {
    let dir = tempfile::tempdir().unwrap();
    let cap = case.cap_kib * KIB;
    let hold = case.hold64.map(|h| (cap * h / 64).max(4 * KIB));
    let t = tier(cap, cap * case.window64 / 64, hold, dir.path());
    let swap = t.swap().unwrap().clone();
    let mut seed = 0u64;
    for plan in &case.steps {
        if let Some(read) = plan.fault {
            let kind = if read {
                FaultKind::Read
            } else {
                FaultKind::Write
            };
            swap.inject_fault(kind, 5, 1);
        }
        let step = t.begin_step();
        // Forward.
        let mut saved: Vec<Option<(Stored, Vec<u8>, u8)>> = Vec::new();
        for (i, s64) in sizes_of(&case.model, plan.change).into_iter().enumerate() {
            seed += 1;
            let n = (cap * s64 / 64).max(1);
            let bytes = pattern(seed, n as usize);
            let views = case.model.get(i).map_or(2, |s| s.views);
            let direct = case.model.get(i).is_some_and(|s| s.direct);
            saved.push(pack(&step, cap, n, &bytes, direct)?.map(|st| (st, bytes, views)));
        }
        // Backward: reverse pack order, with some neighbours swapped.
        let mut order: Vec<usize> = (0..saved.len()).rev().collect();
        for &k in &plan.swaps {
            if order.len() > 1 {
                let k = k % (order.len() - 1);
                order.swap(k, k + 1);
            }
        }
        let mut alive: std::collections::VecDeque<View> = Default::default();
        for (done, &i) in order.iter().enumerate() {
            if plan.abandon_after == Some(done) {
                break; // the step is abandoned: its graph (and every handle) goes away
            }
            let Some((stored, bytes, views)) = saved[i].take() else {
                continue;
            };
            for _ in 0..views {
                let v = unpack(&stored)?;
                prop_assert_eq!(v.as_slice(), &bytes[..]);
                alive.push_back(v);
                while alive.len() > plan.live_views {
                    alive.pop_front();
                }
            }
            drop(stored); // autograd frees a saved tensor once its grad op ran
        }
        drop(alive);
        drop(saved);
        drop(step);
    }
    swap.inject_fault(FaultKind::Read, 5, 0);
    swap.inject_fault(FaultKind::Write, 5, 0);
    let _ = t.wait_idle();
    swap.wait_idle();
    let s = t.stats();
    prop_assert_eq!(s.entries, 0);
    prop_assert_eq!(s.pool_in_use, 0);
    prop_assert_eq!(s.swap_in_use, 0);
    Ok(())
}

proptest! {
    // Enough cases to find the second-step panic on the code before the fix in every run.
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    #[test]
    fn model_shaped_steps_round_trip(case in case()) {
        run(&case)?;
    }
}

/// The shape that panicked: one storage unpacked through two views, pool smaller than the
/// step, on the second step (when the learned order held the entry twice).
#[test]
fn a_storage_unpacked_through_views_on_the_second_step() {
    let case = Case {
        cap_kib: 1024,
        window64: 64,
        hold64: None,
        model: (0..12)
            .map(|_| Saved {
                size64: 8,
                views: 2,
                direct: false,
            })
            .collect(),
        steps: (0..3)
            .map(|_| StepPlan {
                change: Change::Same,
                swaps: vec![],
                abandon_after: None,
                fault: None,
                live_views: 1,
            })
            .collect(),
    };
    run(&case).unwrap();
}

/// Storages written from their own memory on every step, beside copied ones: the learned
/// order keeps what backward needs first in the pool (Note [written from the tensor]), the
/// rest is read back at an offset into its page, some of it (images a page larger than half
/// the pool) into one-off buffers ahead of its unpack (Note [the next read does not wait]).
#[test]
fn storages_written_from_their_memory_over_several_steps() {
    let case = Case {
        cap_kib: 1024,
        window64: 16,
        hold64: None,
        model: (0..12)
            .map(|i| Saved {
                size64: [32, 8, 16, 32][i % 4],
                views: 1 + (i % 2) as u8,
                direct: i % 3 != 0,
            })
            .collect(),
        steps: (0..4)
            .map(|_| StepPlan {
                change: Change::Same,
                swaps: vec![],
                abandon_after: None,
                fault: None,
                live_views: 2,
            })
            .collect(),
    };
    run(&case).unwrap();
}
