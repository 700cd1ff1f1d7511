//! Host-side copies into the tier: [`Step::put_copy`] leases a block, copies bytes the host
//! already has into it and seals it, in one call (the CPU host link's pack). Safe code: the
//! source is a slice; the one `unsafe` that builds it from an address Python handed over stays
//! at the PyO3 boundary (`PyStep::put_from` in `rust/py/tier.rs`), next to the owner that keeps
//! the address alive.
//!
//! The copy is made into the block while it is still only leased, before it becomes an entry:
//! nothing else can see it, so a plain `&mut [u8]` does it, and an error on the way (no room,
//! a failed write behind at seal) leaves no entry behind -- the block goes back to the pool or
//! the handle is dropped, which frees the entry wherever it is.

use super::{Handle, Step};
use crate::error::Result;
use crate::pool::Block;

impl Step {
    /// Lease a block for `src.len()` bytes (making room as [`Step::put`] does), copy `src`
    /// into it and seal it: the entry is dirty (or already being written behind) when this
    /// returns. Raises what `put` and [`Handle::seal`] raise; on an error no entry is left.
    pub fn put_copy(&self, src: &[u8]) -> Result<Handle> {
        self.put_copy_at(src, 0)
    }

    /// As [`Step::put_copy`], the bytes `head` bytes into the block (and into the slot it is
    /// written to): the layout of an entry written from the tensor (Note [written from the
    /// tensor] in direct.rs), so that either kind reads back the same way.
    pub(super) fn put_copy_at(&self, src: &[u8], head: u64) -> Result<Handle> {
        let block = self.lease(head + src.len() as u64)?;
        self.copy_in(block, src, head)
    }

    /// Copy `src` into `block` (leased for it, `head` bytes more), `head` bytes in; stage and
    /// seal it.
    pub(super) fn copy_in(&self, mut block: Block, src: &[u8], head: u64) -> Result<Handle> {
        block.as_mut_slice()[head as usize..].copy_from_slice(src);
        let h = self.stage_at(block, head, src.len() as u64)?;
        h.seal()?;
        Ok(h)
    }
}

#[cfg(test)]
mod tests {
    use crate::error::Error;
    use crate::pool::{Pool, PoolOptions};
    use crate::tier::{Tier, TierOptions};

    fn host_tier(capacity: u64) -> Tier {
        let mut o = PoolOptions::new(capacity);
        o.lock = false;
        o.huge_pages = false;
        o.prefault = false;
        let pool = Pool::new(&o).unwrap();
        Tier::new(pool, None, TierOptions::for_pool(capacity))
    }

    #[test]
    fn bytes_round_trip_through_get() {
        let t = host_tier(1 << 20);
        let step = t.begin_step();
        let src: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + 3) as u8).collect();
        let h = step.put_copy(&src).unwrap();
        assert_eq!(h.nbytes(), src.len() as u64);
        assert_eq!(h.residency(), "dirty");
        assert_eq!(h.get().unwrap().as_slice(), &src[..]);
        drop(h);
        assert_eq!(t.stats().entries, 0);
    }

    #[test]
    fn a_failed_put_leaves_no_entry() {
        let t = host_tier(64 << 10);
        let step = t.begin_step();
        let keep = step.put_copy(&[1u8; 40 << 10]).unwrap();
        let in_use = t.stats().pool_in_use;
        let too_big = step.put_copy(&[2u8; 40 << 10]);
        assert!(matches!(too_big, Err(Error::PoolExhausted { .. })));
        assert!(matches!(step.put_copy(&[]), Err(Error::Invalid(_))));
        let s = t.stats();
        assert_eq!((s.entries, s.pool_in_use), (1, in_use));
        assert_eq!(keep.get().unwrap().as_slice(), &[1u8; 40 << 10][..]);
        drop(keep);
        assert_eq!(t.stats().pool_in_use, 0);
    }
}
