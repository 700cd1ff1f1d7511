//! The activation tier through its public API: random put / seal / get / drop / fault
//! sequences against a model of what each entry holds (bytes round-trip, no block in two
//! places, pool and swap back to zero), plus the behaviours the Python layer relies on.

use std::sync::Arc;

use proptest::prelude::*;
use spillover_core::io::{EngineChoice, FaultKind, IoOptions, Swap};
use spillover_core::pool::Pool;
use spillover_core::tier::{Handle, Tier, TierOptions, View};
use spillover_core::Error;

mod common;
use common::{pattern, pool, write};

const KIB: u64 = 1 << 10;

fn swap(pool: &Pool, dir: &std::path::Path, engine: EngineChoice) -> Option<Arc<Swap>> {
    let mut o = IoOptions::new([dir]);
    o.engine = engine;
    o.allow_buffered = true;
    o.block_bytes = 64 * KIB;
    o.queue_depth = 8;
    o.capacity_per_dir = Some(64 << 20);
    match Swap::open(&o, pool) {
        Ok(s) => Some(Arc::new(s)),
        Err(e) if engine == EngineChoice::IoUring => {
            eprintln!("skipping io_uring: {e}");
            None
        }
        Err(e) => panic!("{e}"),
    }
}

fn tier(cap: u64, dir: &std::path::Path, verify: bool) -> Tier {
    let p = pool(cap);
    let s = swap(&p, dir, EngineChoice::Threads);
    let mut o = TierOptions::for_pool(cap);
    o.verify = verify;
    Tier::new(p, s, o)
}

/// `h.get()`, retried past injected I/O errors: a failed read leaves its entry on disk, and an
/// error is raised once, by whichever call sees it (maybe another entry's read ahead).
fn get_retrying(h: &Handle) -> View {
    for _ in 0..16 {
        match h.get() {
            Ok(v) => return v,
            Err(Error::Io { .. }) => continue,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("get kept failing")
}

#[derive(Debug, Clone)]
enum Op {
    Put(u64),
    Get(usize),
    KeepView(usize),
    DropViews,
    Free(usize),
    Fault(bool),
    Spill,
    NewStep,
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            4 => (1u64..300 * KIB).prop_map(Op::Put),
            3 => any::<usize>().prop_map(Op::Get),
            1 => any::<usize>().prop_map(Op::KeepView),
            1 => Just(Op::DropViews),
            2 => any::<usize>().prop_map(Op::Free),
            1 => any::<bool>().prop_map(Op::Fault),
            1 => Just(Op::Spill),
            1 => Just(Op::NewStep),
        ],
        1..60,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 40, ..ProptestConfig::default() })]

    #[test]
    fn random_sequences_round_trip_and_return_everything(ops in ops(), verify in any::<bool>()) {
        let dir = tempfile::tempdir().unwrap();
        let cap = 1 << 20;
        let t = tier(cap, dir.path(), verify);
        let mut step = t.begin_step();
        let mut live: Vec<(Handle, Vec<u8>)> = Vec::new();
        let mut views: Vec<View> = Vec::new();
        let mut seed = 0u64;
        for op in ops {
            match op {
                Op::Put(n) => {
                    seed += 1;
                    match step.put(n) {
                        Ok((h, v)) => {
                            let bytes = pattern(seed, n as usize);
                            write(&v, &bytes);
                            drop(v);
                            h.seal().or_else(|e| match e {
                                Error::Io { .. } => Ok(()), // injected: raised once, kept
                                e => Err(e),
                            }).unwrap();
                            prop_assert!(h.residency() != "staging");
                            live.push((h, bytes));
                        }
                        // Every block is viewed: nothing can be freed now.
                        Err(Error::PoolExhausted { .. }) => prop_assert!(!views.is_empty() || n > cap / 2),
                        Err(Error::Io { .. }) => {}
                        Err(e) => panic!("{e}"),
                    }
                }
                Op::Get(i) | Op::KeepView(i) if !live.is_empty() => {
                    let (h, bytes) = &live[i % live.len()];
                    let got = get_retrying(h);
                    prop_assert_eq!(got.as_slice(), &bytes[..]);
                    if matches!(op, Op::KeepView(_)) {
                        views.push(got);
                    }
                }
                Op::DropViews => views.clear(),
                Op::Free(i) if !live.is_empty() => {
                    live.swap_remove(i % live.len());
                }
                Op::Fault(read) => {
                    let kind = if read { FaultKind::Read } else { FaultKind::Write };
                    t.swap().unwrap().inject_fault(kind, 5, 1);
                }
                Op::Spill => {
                    let _ = t.spill_all();
                }
                Op::NewStep => step = t.begin_step(),
                _ => {}
            }
            let s = t.stats();
            prop_assert!(s.pool_in_use <= s.pool_capacity);
            prop_assert_eq!(s.entries as usize, live.len());
            prop_assert_eq!(s.staging, 0);
        }
        for (h, bytes) in &live {
            let v = get_retrying(h);
            prop_assert_eq!(v.as_slice(), &bytes[..]);
        }
        t.swap().unwrap().inject_fault(FaultKind::Read, 5, 0);
        t.swap().unwrap().inject_fault(FaultKind::Write, 5, 0);
        drop(views);
        drop(live);
        drop(step);
        let _ = t.wait_idle();
        t.swap().unwrap().wait_idle();
        let s = t.stats();
        prop_assert_eq!(s.entries, 0);
        prop_assert_eq!(s.pool_in_use, 0);
        prop_assert_eq!(s.swap_in_use, 0);
    }
}

#[test]
fn a_viewed_block_is_never_written_or_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(1 << 20, dir.path(), false);
    let step = t.begin_step();
    let (a, va) = step.put(512 * KIB).unwrap();
    write(&va, &pattern(1, 512 * KIB as usize));
    // The staging view is alive: sealing does not hand the block to the kernel.
    a.seal().unwrap();
    assert_eq!(a.residency(), "dirty");
    assert_eq!(t.spill_all().unwrap(), 0);
    assert_eq!(a.residency(), "dirty");
    drop(va);
    let (b, vb) = step.put(256 * KIB).unwrap();
    drop(vb);
    b.seal().unwrap();
    let seen = a.get().unwrap();
    // Neither a live view nor room to make: the pool refuses rather than evict `a`.
    let (c, vc) = step.put(256 * KIB).unwrap(); // `b` can go to disk to make room
    drop(vc);
    c.seal().unwrap();
    assert!(
        matches!(step.put(512 * KIB), Err(Error::PoolExhausted { .. })) || b.residency() != "dirty"
    );
    assert_eq!(seen.as_slice(), &pattern(1, 512 * KIB as usize)[..]);
    assert!(matches!(a.residency(), "dirty" | "clean"));
}

#[test]
fn backward_reads_ahead_in_the_learned_order() {
    let dir = tempfile::tempdir().unwrap();
    let cap = 1 << 20;
    let t = tier(cap, dir.path(), false);
    let sizes = [
        200 * KIB,
        200 * KIB,
        200 * KIB,
        200 * KIB,
        200 * KIB,
        200 * KIB,
    ];
    for round in 0..2 {
        let step = t.begin_step();
        let hs: Vec<Handle> = sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let (h, v) = step.put(n).unwrap();
                write(&v, &pattern(i as u64, n as usize));
                drop(v);
                h.seal().unwrap();
                h
            })
            .collect();
        t.spill_all().unwrap();
        // Unpack in an order that is not reverse pack order: 1, 0, 3, 2, 5, 4. After each
        // unpack the reads it started ahead are let finish: a hit means "read ahead in the
        // learned order", not "read faster than this loop" (on a loaded 2-core machine the
        // loop won the race and the test failed now and then).
        for &i in &[1usize, 0, 3, 2, 5, 4] {
            let v = hs[i].get().unwrap();
            assert_eq!(v.as_slice(), &pattern(i as u64, sizes[i] as usize)[..]);
            drop(v);
            t.wait_idle().unwrap();
        }
        let s = step.stats();
        assert_eq!(s.prefetch_hits + s.prefetch_misses, 6);
        if round == 1 {
            // The second step knows the order: everything after the first unpack was read
            // ahead of its use.
            assert!(s.prefetch_hits >= 4, "{s:?}");
            assert_eq!(step.expected_after(1, 10), vec![0, 3, 2, 5, 4]);
        }
    }
}

#[test]
fn a_failed_write_keeps_the_bytes_and_raises_once() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(1 << 20, dir.path(), true);
    let step = t.begin_step();
    let (h, v) = step.put(300 * KIB).unwrap();
    let bytes = pattern(7, 300 * KIB as usize);
    write(&v, &bytes);
    drop(v);
    t.swap().unwrap().inject_fault(FaultKind::Write, 28, 1);
    h.seal().unwrap(); // more than a quarter of the pool unwritten: the write starts here
    let err = t.spill_all().unwrap_err();
    assert!(matches!(err, Error::OutOfSpace { .. }), "{err}");
    assert_eq!(h.residency(), "dirty");
    t.spill_all().unwrap();
    assert_eq!(h.residency(), "disk");
    assert_eq!(h.get().unwrap().as_slice(), &bytes[..]);
}

#[test]
fn gathered_pieces_come_back_as_one_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let t = tier(1 << 20, dir.path(), true);
    let step = t.begin_step();
    let total = 3 << 20; // three times the pool
    let bytes = pattern(3, total);
    let piece = 128 * KIB as usize;
    let parts: Vec<Handle> = bytes
        .chunks(piece)
        .map(|c| {
            let (h, v) = step.put(c.len() as u64).unwrap();
            write(&v, c);
            drop(v);
            h.seal().unwrap();
            h
        })
        .collect();
    let g = step.gather(parts).unwrap();
    let v = g.get().unwrap();
    assert_eq!(v.as_slice(), &bytes[..]);
    drop(v);
    let again = g.get().unwrap(); // retain_graph: a second backward reads again
    assert_eq!(again.as_slice(), &bytes[..]);
    drop(again);
    drop(g);
    drop(step);
    t.wait_idle().unwrap();
    assert_eq!(t.stats().pool_in_use, 0);
    assert_eq!(t.stats().swap_in_use, 0);
}

#[test]
fn a_host_tier_refuses_instead_of_evicting() {
    let t = Tier::new(pool(1 << 20), None, TierOptions::for_pool(1 << 20));
    let step = t.begin_step();
    let (a, va) = step.put(768 * KIB).unwrap();
    drop(va);
    a.seal().unwrap();
    assert!(matches!(
        step.put(512 * KIB),
        Err(Error::PoolExhausted { .. })
    ));
    assert_eq!(a.residency(), "dirty");
    drop(a);
    assert!(step.put(512 * KIB).is_ok());
}

#[test]
fn io_uring_engine_round_trips_through_the_tier() {
    let dir = tempfile::tempdir().unwrap();
    let p = pool(1 << 20);
    let Some(s) = swap(&p, dir.path(), EngineChoice::IoUring) else {
        return;
    };
    let t = Tier::new(p, Some(s), TierOptions::for_pool(1 << 20));
    let step = t.begin_step();
    let hs: Vec<(Handle, Vec<u8>)> = (0..8)
        .map(|i| {
            let bytes = pattern(i, 256 * KIB as usize);
            let (h, v) = step.put(bytes.len() as u64).unwrap();
            write(&v, &bytes);
            drop(v);
            h.seal().unwrap();
            (h, bytes)
        })
        .collect();
    for (h, bytes) in hs.iter().rev() {
        assert_eq!(h.get().unwrap().as_slice(), &bytes[..]);
    }
}
