//! Property tests of the extent allocator: no two live extents overlap, everything stays
//! aligned and inside the range, and freeing everything coalesces back to one extent.

use proptest::prelude::*;
use spillover_core::extent::{Extent, ExtentAllocator, GRANULE};

#[derive(Debug, Clone)]
enum Op {
    Alloc(u64),
    Free(usize),
}

fn ops() -> impl Strategy<Value = Vec<Op>> {
    prop::collection::vec(
        prop_oneof![
            3 => (1u64..40 * GRANULE).prop_map(Op::Alloc),
            2 => any::<usize>().prop_map(Op::Free),
        ],
        1..300,
    )
}

fn check(a: &ExtentAllocator, live: &[Extent]) {
    let mut all: Vec<(u64, u64, bool)> = live.iter().map(|e| (e.offset, e.len, true)).collect();
    all.extend(a.free_extents().map(|e| (e.offset, e.len, false)));
    all.sort();
    let mut end = 0;
    for &(off, len, _) in &all {
        assert_eq!(off % GRANULE, 0);
        assert_eq!(len % GRANULE, 0);
        assert!(len > 0);
        assert!(off >= end, "overlap at {off}");
        end = off + len;
    }
    assert!(end <= a.capacity());
    // live + free tile the whole range exactly
    assert_eq!(all.iter().map(|x| x.1).sum::<u64>(), a.capacity());
    // no two free extents are adjacent (coalescing)
    let free: Vec<Extent> = a.free_extents().collect();
    for w in free.windows(2) {
        assert!(
            w[0].end() < w[1].offset,
            "free extents {:?} not coalesced",
            w
        );
    }
    assert_eq!(a.used_bytes(), live.iter().map(|e| e.len).sum::<u64>());
}

proptest! {
    #[test]
    fn live_extents_never_overlap_and_frees_coalesce(ops in ops(), cap in 64u64..512) {
        let mut a = ExtentAllocator::new(cap * GRANULE);
        let mut live: Vec<Extent> = Vec::new();
        for op in ops {
            match op {
                Op::Alloc(n) => {
                    let fits = a.largest_free() >= n.div_ceil(GRANULE) * GRANULE;
                    match a.alloc(n) {
                        Some(e) => {
                            prop_assert!(fits);
                            prop_assert!(e.len >= n && e.len - n < GRANULE);
                            live.push(e);
                        }
                        None => prop_assert!(!fits),
                    }
                }
                Op::Free(i) if !live.is_empty() => {
                    let e = live.swap_remove(i % live.len());
                    a.free(e);
                }
                Op::Free(_) => {}
            }
            check(&a, &live);
        }
        for e in live.drain(..) {
            a.free(e);
        }
        prop_assert_eq!(a.free_extent_count(), 1);
        prop_assert_eq!(a.largest_free(), a.capacity());
    }

    #[test]
    fn best_fit_takes_the_smallest_sufficient_hole(sizes in prop::collection::vec(1u64..16, 2..20)) {
        let mut a = ExtentAllocator::new(1024 * GRANULE);
        let exts: Vec<Extent> = sizes.iter().map(|s| a.alloc(s * GRANULE).unwrap()).collect();
        // free every other one (never the last): holes of the given sizes between live extents
        let holes: Vec<Extent> = exts[..exts.len() - 1].iter().step_by(2).copied().collect();
        for e in &holes {
            a.free(*e);
        }
        let want = 3 * GRANULE;
        let best = holes.iter().filter(|e| e.len >= want).map(|e| e.len).min();
        let tail = a.free_extents().last().unwrap();
        let got = a.alloc(want).unwrap();
        match best {
            Some(len) if len <= tail.len => {
                let hole = holes.iter().find(|e| e.offset == got.offset).unwrap();
                prop_assert_eq!(hole.len, len);
            }
            _ => prop_assert!(got.offset >= tail.offset),
        }
    }
}
