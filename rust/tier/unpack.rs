//! Unpacks: the bytes of an entry (read back if needed, checked when verifying), each unpack
//! counted in the order the next step learns, then read-ahead of what backward needs next
//! (Note [plans are snapshots]).

use std::time::Instant;

use super::gather;
use super::policy::{self, Ahead, Seen};
use super::state::{Entry, Residency, State, StepState};
use super::{one_off, Tier, View};
use crate::error::{Error, Result};
use crate::pool::Block;

impl Tier {
    /// Read ahead after an unpack of `seq` in `step` (policy::read_ahead).
    pub(super) fn read_ahead(&self, st: &mut State, step: u64, seq: u32) {
        let Some(swap) = self.inner.swap.clone() else {
            return;
        };
        let window = self.inner.opts.prefetch_bytes;
        let plan = {
            let State {
                steps,
                entries,
                chunks,
                gathering,
                ..
            } = &mut *st;
            let Some(s) = steps.get_mut(&step) else {
                return;
            };
            let StepState {
                ids,
                forecast,
                sizes,
                ..
            } = s;
            forecast.check(sizes);
            let forecast = &*forecast;
            let seen = |q: u32| -> Seen {
                let Some(e) = ids.get(q as usize).and_then(|id| entries.get(id)) else {
                    return Seen::Absent;
                };
                if let Some((c, g)) = e.chunk.and_then(|c| chunks.get(&c).map(|g| (c, g))) {
                    if g.direct() {
                        return Seen::Piece {
                            chunk: c,
                            startable: gathering.is_none() && g.not_started(),
                            nbytes: g.nbytes(),
                        };
                    }
                }
                match &e.res {
                    Residency::Disk { .. } => Seen::OnDisk(e.nbytes),
                    Residency::Writing { .. } | Residency::Reading { .. } => {
                        Seen::Resident(e.nbytes)
                    }
                    _ if e.viewed => Seen::Used,
                    _ => Seen::Resident(e.nbytes),
                }
            };
            let expected = forecast.expected(seq, sizes.len());
            // past the window only for a gathered storage that may start (Note [gather
            // distance]): none while one is being read, none in a step without any
            let may_gather = gathering.is_none() && !chunks.is_empty();
            policy::read_ahead(expected, window, may_gather, seen, |q| {
                forecast.is_learned(q)
            })
        };
        let mut first = true;
        for a in plan {
            match a {
                Ahead::Read(q) => {
                    let Some(&id) = st.steps.get(&step).and_then(|s| s.ids.get(q as usize)) else {
                        continue;
                    };
                    // Note [plans are snapshots]: skip what is no longer only on disk.
                    let image = match st.entries.get(&id) {
                        Some(e) if matches!(e.res, Residency::Disk { .. }) => e.image(),
                        _ => continue,
                    };
                    let block = match self.inner.pool.lease(image) {
                        Ok(b) => b,
                        Err(_) if first => match self.room_for_next(st, image, step) {
                            Some(b) => b,
                            None => break,
                        },
                        Err(_) => break, // past the next read, read-ahead never evicts
                    };
                    first = false;
                    let Some(e) = st.entries.get_mut(&id) else {
                        continue;
                    };
                    match std::mem::replace(&mut e.res, Residency::Moving) {
                        Residency::Disk { slot } => {
                            let ticket = swap.read(&slot, block);
                            e.res = Residency::Reading { ticket, slot };
                            st.reading.push(id);
                        }
                        other => e.res = other,
                    }
                }
                Ahead::Gather(c) => gather::start(self, st, c),
            }
        }
    }

    /// Note [the next read does not wait]: a block for the first read of a read-ahead plan
    /// that found no room in the pool: room made by dropping clean entries (never by waiting),
    /// else a one-off mapping (counted as an overflow read), as `get` would make a moment
    /// later. Waiting for its `get` to make room exposed the whole read: the SDPA GPT's 32 MiB
    /// MLP storages, written from the tensor (4 KiB more in the pool read back, so two no
    /// longer fit a 64 MiB pool beside anything else), waited 20 ms each, 11 of 12 a step.
    fn room_for_next(&self, st: &mut State, image: u64, step: u64) -> Option<Block> {
        while Self::drop_one_clean(st) {
            if let Ok(b) = self.inner.pool.lease(image) {
                return Some(b);
            }
        }
        let b = one_off(image).and_then(|p| p.lease(image)).ok()?;
        if let Some(s) = st.steps.get_mut(&step) {
            s.stats.overflow_reads += 1;
        }
        Some(b)
    }

    /// Count an unpack of entry `id` (hit: its bytes were in the pool in time). Its place in
    /// the learned order is its first unpack: several views of one storage unpack one entry
    /// several times, and an entry at two places of the order would be planned twice
    /// (Note [plans are snapshots]).
    pub(super) fn used(st: &mut State, id: u64, hit: bool) {
        let Some(e) = st.entries.get_mut(&id) else {
            return;
        };
        let first = !e.viewed;
        e.viewed = true;
        let (step, seq, disk) = (e.step, e.seq, e.went_to_disk);
        if let Some(s) = st.steps.get_mut(&step) {
            if first {
                s.order.push(seq);
            }
            if disk {
                if hit {
                    s.stats.prefetch_hits += 1;
                } else {
                    s.stats.prefetch_misses += 1;
                }
            } else {
                s.stats.host_cache_hits += 1;
            }
        }
    }

    fn check(&self, e: &Entry, id: u64, bytes: &[u8]) -> Result<()> {
        if let Some(expected) = e.checksum {
            let found = crc32c::crc32c(bytes);
            if found != expected {
                return Err(Error::Integrity {
                    key: id,
                    expected,
                    found,
                });
            }
        }
        Ok(())
    }

    /// The bytes of entry `id`, read back if needed (blocking, outside the lock); with
    /// `record`, counted as an unpack and followed by read-ahead. With `staging`, an entry
    /// whose copy has not landed yet gives its staging view (Note [unpack before the seal]);
    /// without, that is an error.
    pub(super) fn get(&self, id: u64, record: bool, staging: bool) -> Result<View> {
        let mut hit = true;
        let mut waited = 0.0;
        loop {
            let watch = {
                let mut st = self.lock();
                if st.panic_gets > 0 {
                    st.panic_gets -= 1;
                    panic!("injected panic (Tier::inject_panic)");
                }
                self.reap(&mut st)?;
                let e = st
                    .entries
                    .get(&id)
                    .ok_or_else(|| Error::Invalid("this entry was freed".into()))?;
                let step = e.step;
                match &e.res {
                    Residency::Staging(b) if staging => {
                        let view = e.view(b);
                        let (s, q) = (e.step, e.seq);
                        if record {
                            Self::used(&mut st, id, true);
                            self.read_ahead(&mut st, s, q);
                        }
                        return Ok(view);
                    }
                    Residency::Staging(_) => {
                        return Err(Error::Invalid(
                            "get() of an entry whose copy has not landed: seal() it first".into(),
                        ))
                    }
                    Residency::Dirty(b) | Residency::Clean { block: b, .. } => {
                        self.check(e, id, e.bytes(b))?;
                        let view = e.view(b);
                        let (s, q) = (e.step, e.seq);
                        if record {
                            Self::used(&mut st, id, hit);
                            st.add_stall(s, waited);
                            self.read_ahead(&mut st, s, q);
                        }
                        return Ok(view);
                    }
                    Residency::Writing { ticket, .. } => ticket.watch(),
                    Residency::Reading { ticket, .. } => {
                        if !ticket.is_done() {
                            hit = false;
                        }
                        ticket.watch()
                    }
                    Residency::Disk { .. } => {
                        hit = false;
                        let n = e.image();
                        drop(st);
                        let block = self.read_block(n, step)?;
                        let mut st = self.lock();
                        let Some(e) = st.entries.get_mut(&id) else {
                            return Err(Error::Invalid("this entry was freed".into()));
                        };
                        let Some(swap) = self.inner.swap.as_ref() else {
                            return Err(Error::Internal(format!(
                                "entry {id} is on disk in a tier without a swap"
                            )));
                        };
                        match std::mem::replace(&mut e.res, Residency::Moving) {
                            Residency::Disk { slot } => {
                                let ticket = swap.read(&slot, block);
                                let w = ticket.watch();
                                e.res = Residency::Reading { ticket, slot };
                                st.reading.push(id);
                                w
                            }
                            other => {
                                e.res = other;
                                continue; // someone else started it meanwhile
                            }
                        }
                    }
                    Residency::Moving => {
                        return Err(Error::Internal(format!(
                            "entry {id} was seen in the middle of a transition"
                        )))
                    }
                }
            };
            let t0 = Instant::now();
            watch.wait_done();
            waited += t0.elapsed().as_secs_f64();
            let mut st = self.lock();
            Self::finish_io(&mut st, id)?;
        }
    }
}
