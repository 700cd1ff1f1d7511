//! A pure extent allocator over an address range `[0, len)`.
//!
//! Best fit, coalescing on free, every extent a multiple of [`GRANULE`] bytes and aligned to it.
//! Both the pinned host pool (offsets into an arena) and the NVMe swap files (offsets into a
//! file) use it. No syscalls: everything here is plain arithmetic over two ordered maps, so it is
//! property-tested (see `tests/extent.rs`).
//!
//! Costs: `alloc` and `free` are O(log n) in the number of free extents.

use std::collections::{BTreeMap, BTreeSet};

/// Allocation granularity and alignment: 4 KiB (a page, and O_DIRECT's strictest alignment).
pub const GRANULE: u64 = 4096;

/// Round `n` up to a multiple of [`GRANULE`] (0 stays 0). Saturates instead of overflowing.
pub fn round_up(n: u64) -> u64 {
    n.div_ceil(GRANULE).saturating_mul(GRANULE)
}

/// A live allocation: `len` bytes at `offset`, both multiples of [`GRANULE`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

impl Extent {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// Best-fit allocator with coalescing.
///
/// Free space is kept twice: by offset (to find neighbours when coalescing) and by
/// `(len, offset)` (to find the smallest extent that fits). The two always describe the same set.
#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    capacity: u64,
    by_offset: BTreeMap<u64, u64>,
    by_size: BTreeSet<(u64, u64)>,
    free_bytes: u64,
}

impl ExtentAllocator {
    /// An allocator over `[0, capacity)`; `capacity` is rounded *down* to the granule.
    pub fn new(capacity: u64) -> Self {
        let capacity = capacity / GRANULE * GRANULE;
        let mut a = ExtentAllocator {
            capacity,
            by_offset: BTreeMap::new(),
            by_size: BTreeSet::new(),
            free_bytes: 0,
        };
        if capacity > 0 {
            a.insert_free(0, capacity);
        }
        a
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    pub fn free_bytes(&self) -> u64 {
        self.free_bytes
    }

    pub fn used_bytes(&self) -> u64 {
        self.capacity - self.free_bytes
    }

    /// Size of the largest free extent (what the next `alloc` can get at most).
    pub fn largest_free(&self) -> u64 {
        self.by_size.iter().next_back().map_or(0, |&(len, _)| len)
    }

    /// Number of free extents: 1 when nothing is leased (everything coalesced back).
    pub fn free_extent_count(&self) -> usize {
        self.by_offset.len()
    }

    /// The free extents in address order.
    pub fn free_extents(&self) -> impl Iterator<Item = Extent> + '_ {
        self.by_offset
            .iter()
            .map(|(&offset, &len)| Extent { offset, len })
    }

    /// Allocate `nbytes` (rounded up to the granule; 0 is treated as one granule) from the
    /// smallest free extent that holds it, taking its lowest addresses. `None` when no free
    /// extent is large enough.
    pub fn alloc(&mut self, nbytes: u64) -> Option<Extent> {
        let len = round_up(nbytes.max(1));
        let &(flen, foff) = self.by_size.range((len, 0)..).next()?;
        self.remove_free(foff, flen);
        if flen > len {
            self.insert_free(foff + len, flen - len);
        }
        Some(Extent { offset: foff, len })
    }

    /// Return an extent obtained from `alloc`. Neighbouring free extents merge with it.
    ///
    /// Panics if the extent is out of range or overlaps free space (a double free): both are
    /// bugs in the caller, and continuing would hand the same bytes out twice.
    pub fn free(&mut self, e: Extent) {
        assert!(
            e.len > 0
                && e.offset % GRANULE == 0
                && e.len % GRANULE == 0
                && e.end() <= self.capacity,
            "extent {e:?} was not allocated here"
        );
        let mut start = e.offset;
        let mut len = e.len;
        if let Some((&poff, &plen)) = self.by_offset.range(..=e.offset).next_back() {
            assert!(poff + plen <= e.offset, "double free of {e:?}");
            if poff + plen == e.offset {
                self.remove_free(poff, plen);
                start = poff;
                len += plen;
            }
        }
        if let Some((&noff, &nlen)) = self.by_offset.range(e.offset..).next() {
            assert!(noff >= e.end(), "double free of {e:?}");
            if noff == e.end() {
                self.remove_free(noff, nlen);
                len += nlen;
            }
        }
        self.insert_free(start, len);
    }

    fn insert_free(&mut self, offset: u64, len: u64) {
        self.by_offset.insert(offset, len);
        self.by_size.insert((len, offset));
        self.free_bytes += len;
    }

    fn remove_free(&mut self, offset: u64, len: u64) {
        self.by_offset.remove(&offset);
        self.by_size.remove(&(len, offset));
        self.free_bytes -= len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn best_fit_picks_the_smallest_hole() {
        let mut a = ExtentAllocator::new(16 * GRANULE);
        let x = a.alloc(GRANULE).unwrap();
        let y = a.alloc(3 * GRANULE).unwrap();
        let z = a.alloc(GRANULE).unwrap();
        let _w = a.alloc(GRANULE).unwrap();
        a.free(x); // 1-granule hole at 0
        a.free(z); // 1-granule hole at 4
        a.free(y); // merges with both: 5 granules at 0
        assert_eq!(a.free_extent_count(), 2);
        let small = a.alloc(GRANULE).unwrap();
        assert_eq!(small.offset, 0);
    }

    #[test]
    fn rounds_and_exhausts() {
        let mut a = ExtentAllocator::new(2 * GRANULE + 17);
        assert_eq!(a.capacity(), 2 * GRANULE);
        let e = a.alloc(1).unwrap();
        assert_eq!(e.len, GRANULE);
        assert!(a.alloc(GRANULE + 1).is_none());
        a.free(e);
        assert_eq!(a.largest_free(), 2 * GRANULE);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut a = ExtentAllocator::new(4 * GRANULE);
        let e = a.alloc(GRANULE).unwrap();
        a.free(e);
        a.free(e);
    }
}
