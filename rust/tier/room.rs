//! Where the tier's blocks come from: the pool, making room by dropping clean entries (Note
//! [write early, drop late]), waiting for requests in flight and writing unwritten ones; else,
//! for a read back, a one-off mapping.
//!
//! Note [writes wait for growth]
//!     A pool that can still grow (`tier="auto"` over a default pool below its cap: Note [RAM
//!     before the drive] in spillover/_growth.py) wrote its oldest entries out whenever a put
//!     found it full: the first step of a process, on a 64 MiB first pool, wrote most of itself
//!     to the drive on a host with RAM to spare. While [`Tier::set_defer_writes`] is on, such a
//!     put fails with `PoolExhausted` instead (after dropping clean entries and waiting for
//!     requests in flight, which write nothing new), and the caller grows the pool, or, when it
//!     cannot, turns deferring off and puts again. Reads back make room as before.

use std::time::Instant;

use super::state::{unshared, Residency, State};
use super::Tier;
use crate::error::{Error, Result};
use crate::pool::{Block, Pool, PoolOptions};

impl Tier {
    /// Note [write early, drop late] (policy.rs): drop the earliest packed clean entry nobody
    /// views. Returns whether a block went back to the pool.
    pub(super) fn drop_one_clean(st: &mut State) -> bool {
        let victim = st.entries.iter().find_map(|(&id, e)| match &e.res {
            Residency::Clean { block, .. } if unshared(block) => Some(id),
            _ => None,
        });
        victim.is_some_and(|id| Self::drop_clean_entry(st, id) > 0)
    }

    /// Lease `nbytes`, making room by dropping clean entries, waiting for writes and reads in
    /// flight, and writing unwritten entries, earliest packed first (unless `may_write` is
    /// false: Note [writes wait for growth]). `Ok(None)`: nothing can be freed now (every
    /// block is staged or viewed, or only a write would free one and none may start).
    pub(super) fn lease_making_room(
        &self,
        nbytes: u64,
        step: u64,
        may_write: bool,
    ) -> Result<Option<Block>> {
        loop {
            match self.inner.pool.lease(nbytes) {
                Ok(b) => return Ok(Some(b)),
                Err(Error::PoolExhausted { .. }) => {}
                Err(e) => return Err(e),
            }
            if self.inner.swap.is_none() {
                return Ok(None);
            }
            let watch = {
                let mut st = self.lock();
                self.reap(&mut st)?;
                if Self::drop_one_clean(&mut st) {
                    continue;
                }
                let in_flight = st
                    .writing
                    .iter()
                    .chain(st.reading.iter())
                    .find_map(|id| st.entries.get(id).and_then(|e| e.res.watch()));
                match in_flight {
                    Some(w) => w,
                    None => {
                        let oldest = st.entries.iter().find_map(|(&id, e)| match &e.res {
                            Residency::Dirty(b) if unshared(b) => Some(id),
                            _ => None,
                        });
                        match oldest {
                            Some(id) if may_write => {
                                self.start_write(&mut st, id)?;
                                continue;
                            }
                            _ => return Ok(None),
                        }
                    }
                }
            };
            let t0 = Instant::now();
            watch.wait_done();
            let mut st = self.lock();
            st.add_stall(step, t0.elapsed().as_secs_f64());
            self.reap(&mut st)?;
        }
    }

    /// A block for reading back `nbytes`: from the pool (making room), else a one-off mapping
    /// that goes away with the entry's view (counted as an overflow read).
    pub(super) fn read_block(&self, nbytes: u64, step: u64) -> Result<Block> {
        if let Some(b) = self.lease_making_room(nbytes, step, true)? {
            return Ok(b);
        }
        let mut st = self.lock();
        if let Some(s) = st.steps.get_mut(&step) {
            s.stats.overflow_reads += 1;
        }
        drop(st);
        one_off(nbytes)?.lease(nbytes)
    }
}

/// A one-off mapping of `nbytes`: not pre-faulted (the reads fault it in, as a fresh tensor
/// would be by its first write), not locked, not registered with io_uring (the engine uses
/// plain reads for it).
pub(super) fn one_off(nbytes: u64) -> Result<Pool> {
    let cap = crate::extent::round_up(nbytes.max(1));
    let mut o = PoolOptions::new(cap);
    o.arena_bytes = cap;
    o.prefault = false;
    o.lock = false;
    o.huge_pages = false;
    Pool::new(&o)
}
