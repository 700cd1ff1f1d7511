//! Residency transitions made under the tier's lock (Note [residency]): starting writes and
//! writing behind after a seal, finishing requests (Note [failed I/O]), dropping clean blocks
//! (Note [clean entries]).

use std::sync::Arc;

use super::policy::{self, Unwritten};
use super::state::{unshared, Entry, Residency, State};
use super::Tier;
use crate::error::Result;

impl Tier {
    // ---- transitions (caller holds the lock) ----

    /// Start writing `id` if it is unwritten and unshared. Returns whether a write started.
    pub(super) fn start_write(&self, st: &mut State, id: u64) -> Result<bool> {
        let Some(swap) = &self.inner.swap else {
            return Ok(false);
        };
        let verify = self.inner.opts.verify;
        let Some(e) = st.entries.get_mut(&id) else {
            return Ok(false);
        };
        let Residency::Dirty(b) = &e.res else {
            return Ok(false);
        };
        if !unshared(b) {
            return Ok(false);
        }
        let slot = swap.alloc(e.image())?; // OutOfSpace: the step that hit it fails here
        let b = match std::mem::replace(&mut e.res, Residency::Moving) {
            Residency::Dirty(b) => b,
            other => {
                e.res = other;
                return Ok(false);
            }
        };
        let block = match Arc::try_unwrap(b) {
            Ok(block) => block,
            Err(b) => {
                e.res = Residency::Dirty(b); // a view appeared: not now
                return Ok(false);
            }
        };
        if verify && e.checksum.is_none() {
            e.checksum = Some(crc32c::crc32c(e.bytes(&block)));
        }
        let ticket = swap.write(block, &slot);
        e.res = Residency::Writing { ticket, slot };
        st.writing.push_back(id);
        Ok(true)
    }

    /// A finished write or read of `id` becomes clean (or, failed, unwritten / on disk again:
    /// Note [failed I/O]). No-op unless its request is done.
    pub(super) fn finish_io(st: &mut State, id: u64) -> Result<()> {
        let Some(e) = st.entries.get_mut(&id) else {
            return Ok(());
        };
        let done = match &e.res {
            Residency::Writing { ticket, .. } | Residency::Reading { ticket, .. } => {
                ticket.is_done()
            }
            _ => return Ok(()),
        };
        if !done {
            return Ok(());
        }
        match std::mem::replace(&mut e.res, Residency::Moving) {
            Residency::Writing { ticket, slot } => {
                st.writing.retain(|&w| w != id);
                let (block, r) = ticket.wait();
                match r {
                    Ok(()) => {
                        if !e.went_to_disk {
                            e.went_to_disk = true;
                            let n = e.nbytes;
                            if let Some(s) = st.steps.get_mut(&e.step) {
                                s.stats.bytes_written += n;
                            }
                        }
                        if block.is_borrowed() {
                            // Note [written from the tensor]: the tensor goes now
                            drop(block);
                            e.res = Residency::Disk { slot };
                        } else {
                            e.res = Residency::Clean {
                                block: Arc::new(block),
                                slot,
                            };
                        }
                        Ok(())
                    }
                    Err(err) => {
                        e.res = Residency::Dirty(Arc::new(block));
                        let n = e.nbytes;
                        st.dirty.push_front((id, n));
                        st.dirty_bytes += n;
                        Err(err)
                    }
                }
            }
            Residency::Reading { ticket, slot } => {
                st.reading.retain(|&r| r != id);
                let (block, r) = ticket.wait();
                match r {
                    Ok(()) => {
                        e.res = Residency::Clean {
                            block: Arc::new(block),
                            slot,
                        };
                        Ok(())
                    }
                    Err(err) => {
                        e.res = Residency::Disk { slot };
                        Err(err)
                    }
                }
            }
            other => {
                e.res = other;
                Ok(())
            }
        }
    }

    /// Finish every request that is done. Returns the first error.
    pub(super) fn reap(&self, st: &mut State) -> Result<()> {
        let mut first = None;
        let ids: Vec<u64> = st
            .writing
            .iter()
            .chain(st.reading.iter())
            .copied()
            .collect();
        for id in ids {
            if let Err(e) = Self::finish_io(st, id) {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// Drop the block of `id` if it is clean and unshared. Returns the bytes freed.
    pub(super) fn drop_clean_entry(st: &mut State, id: u64) -> u64 {
        let Some(e) = st.entries.get_mut(&id) else {
            return 0;
        };
        match &e.res {
            Residency::Clean { block, .. } if unshared(block) => {}
            _ => return 0,
        }
        match std::mem::replace(&mut e.res, Residency::Moving) {
            Residency::Clean { slot, block } => {
                let freed = block.capacity() as u64;
                e.res = Residency::Disk { slot };
                drop(block);
                freed
            }
            other => {
                e.res = other;
                0
            }
        }
    }

    /// Write behind after a seal (Note [write early, drop late]).
    pub(super) fn write_behind(&self, st: &mut State) -> Result<()> {
        if self.inner.swap.is_none() {
            st.dirty.clear();
            st.dirty_bytes = 0;
            return Ok(());
        }
        let max = self.inner.opts.dirty_bytes;
        let State {
            dirty,
            dirty_bytes,
            entries,
            ..
        } = st;
        let start = policy::write_behind(dirty, dirty_bytes, max, |id| match entries.get(&id) {
            Some(Entry {
                res: Residency::Dirty(b),
                ..
            }) => {
                if unshared(b) {
                    Unwritten::Ready
                } else {
                    Unwritten::Busy
                }
            }
            Some(Entry {
                res: Residency::Staging(_),
                ..
            }) => Unwritten::Busy,
            _ => Unwritten::Gone,
        });
        for id in start {
            self.start_write(st, id)?;
        }
        Ok(())
    }
}
