//! The pool through its public API: leases, exhaustion, counters, threads.

use spillover_core::pool::{Pool, PoolOptions};
use spillover_core::Error;

fn pool(capacity: u64, arena: u64) -> Pool {
    let mut o = PoolOptions::new(capacity);
    o.arena_bytes = arena;
    o.lock = false;
    Pool::new(&o).unwrap()
}

#[test]
fn blocks_are_aligned_disjoint_and_return_on_drop() {
    let p = pool(16 << 20, 4 << 20);
    assert_eq!(p.arenas().len(), 4);
    let mut blocks: Vec<_> = (1..40).map(|i| p.lease(i * 10_000).unwrap()).collect();
    for (i, b) in blocks.iter_mut().enumerate() {
        assert_eq!(b.as_ptr() as usize % 4096, 0);
        b.as_mut_slice().fill(i as u8);
    }
    for (i, b) in blocks.iter().enumerate() {
        assert!(
            b.as_slice().iter().all(|&x| x == i as u8),
            "block {i} was overwritten"
        );
    }
    let s = p.stats();
    assert_eq!(s.live_blocks, 39);
    assert_eq!(s.peak, s.in_use);
    drop(blocks);
    let s = p.stats();
    assert_eq!((s.in_use, s.live_blocks, s.free_extents), (0, 0, 4));
    assert_eq!(s.largest_free, 4 << 20);
}

#[test]
fn exhaustion_is_an_error_not_a_crash() {
    let p = pool(1 << 20, 1 << 20);
    let _a = p.lease(700 << 10).unwrap();
    match p.lease(400 << 10) {
        Err(Error::PoolExhausted {
            need,
            largest_free,
            capacity,
        }) => {
            assert_eq!(need, 400 << 10);
            assert_eq!(largest_free, (1 << 20) - (700 << 10));
            assert_eq!(capacity, 1 << 20);
        }
        other => panic!("expected PoolExhausted, got {other:?}"),
    }
    assert_eq!(p.stats().failed_leases, 1);
    assert!(p.lease(0).is_err());
}

#[test]
fn blocks_outlive_the_pool_handle() {
    let p = pool(1 << 20, 1 << 20);
    let mut b = p.lease(4096).unwrap();
    drop(p);
    b.as_mut_slice().fill(3); // the arena is still mapped
    assert_eq!(b.as_slice()[4095], 3);
}

#[test]
fn leases_from_many_threads() {
    let p = pool(64 << 20, 16 << 20);
    std::thread::scope(|s| {
        for t in 0..4 {
            let p = p.clone();
            s.spawn(move || {
                for i in 0..2000u64 {
                    let mut b = p.lease(4096 * (1 + (i + t) % 13)).unwrap();
                    b.as_mut_slice()[0] = t as u8;
                    assert_eq!(b.as_slice()[0], t as u8);
                }
            });
        }
    });
    let s = p.stats();
    assert_eq!((s.in_use, s.live_blocks, s.leases), (0, 0, 8000));
}

#[test]
fn copy_range_is_checked() {
    let p = pool(1 << 20, 1 << 20);
    let b = p.lease(100).unwrap();
    let src = [1u8; 200];
    // SAFETY: `src` is 200 readable bytes; the call must refuse before touching them.
    let r = unsafe { b.copy_from_raw(src.as_ptr(), 200, 0) };
    assert!(matches!(r, Err(Error::Invalid(_))));
    // SAFETY: as above, 100 bytes in range.
    unsafe { b.copy_from_raw(src.as_ptr(), 100, 0) }.unwrap();
    assert_eq!(b.as_slice(), &src[..100]);
}
