//! The link's device-to-host half: copies issued in groups (Note [grouped copies]), their events,
//! the verify mode's checksum slots, and the victims past the cap. The ledger, the polls and
//! the Notes they follow are in `mod.rs` (Notes [stream ordering], [sources held]).

use super::*;

/// Checksum slots allocated at once (64 KiB of host memory).
const SLOTS_PER_SLAB: u64 = 8192;

/// Note [grouped copies]: copies are issued in groups of two or more once they hold this
/// many bytes (or, even alone, a quarter of the cap) ...
pub const GROUP_FLUSH_BYTES: u64 = 48 << 20;
/// ... and at most this many copies.
pub const GROUP_COPIES: usize = 8;

/// A copy held back for its group (Note [grouped copies]).
pub(super) struct Pending {
    id: u64,
    src: u64,
    dst: u64,
    nbytes: u64,
    keep: Option<Keep>,
    /// verify mode: (host slot, device checksum address, what holds it)
    checksum: Option<(u64, u64, Option<Keep>)>,
}

impl Link {
    /// Start copying `nbytes` of device memory at `src` into host memory at `dst` on the D2H
    /// stream, after the work queued so far on `compute`. `hold` is kept until the copy is
    /// seen complete, then `landing` runs (in [`Link::poll`] or a wait). Returns the ledger's
    /// decision: the copy's id, and the copies whose sources the caller drops now (the compute
    /// stream already waits for them: Note [sources held]).
    ///
    /// # Safety
    /// `src` is device memory of `nbytes` the caller keeps alive as the ledger says (Note
    /// [sources held]), or `keep_src` holds it; `dst` is host memory of `nbytes` that `hold`
    /// keeps alive and nothing else writes until the copy landed.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn d2h(
        &self,
        src: u64,
        dst: u64,
        nbytes: u64,
        compute: Stream,
        hold: Option<Keep>,
        keep_src: Option<Keep>,
        landing: Option<Landing>,
        verify: Option<Verify>,
    ) -> Result<Issued> {
        self.dev.bind_thread()?;
        let mut st = self.lock();
        if !st.pending.is_empty() && st.pending_stream != compute {
            self.flush_pending(&mut st)?; // a group is of one compute stream; order is kept
        }
        let (checked, checksum) = match verify {
            None => (None, None),
            Some(v) => {
                let slot = self.slot(&mut st)?;
                let checked = Checked {
                    slot,
                    host: v.host,
                    len: v.len,
                    device: None,
                };
                (Some(checked), Some((slot, v.checksum, v.keep)))
            }
        };
        let issued = st.ledger.issue(nbytes);
        st.stats.copies_to_host += 1;
        st.d2h.insert(
            issued.id,
            D2h {
                ev: None,
                compute,
                nbytes,
                hold,
                landing,
                verify: checked,
            },
        );
        if st.pending.is_empty() {
            st.pending_stream = compute;
        }
        st.pending.push(Pending {
            id: issued.id,
            src,
            dst,
            nbytes,
            keep: keep_src,
            checksum,
        });
        st.pending_bytes += nbytes;
        // a group goes at a quarter of the cap, even of one copy: past the cap the oldest
        // copies become victims, which the compute stream waits for -- better long issued than
        // just now; below that, two or more go at GROUP_FLUSH_BYTES (Note [grouped copies])
        let n = st.pending.len();
        let bytes = st.pending_bytes;
        if n >= GROUP_COPIES
            || bytes >= st.ledger.cap_bytes() / 4
            || (n >= 2 && bytes >= GROUP_FLUSH_BYTES)
        {
            self.flush_pending(&mut st)?;
        }
        self.order_victims(&mut st, &issued.victims)?;
        Ok(issued)
    }

    /// Issue the copies held back (Note [grouped copies]): the D2H stream ordered once after
    /// the compute stream's work so far, each copy (and its checksum's), one event after them.
    /// A failed call still issues the rest and gives them the event; the first error returns.
    pub(super) fn flush_pending(&self, st: &mut State) -> Result<()> {
        if st.pending.is_empty() {
            return Ok(());
        }
        let group = std::mem::take(&mut st.pending);
        st.pending_bytes = 0;
        let mut first: Result<()> = (|| {
            let after = self.event(st)?;
            self.dev.record(after, st.pending_stream)?;
            self.dev.wait(self.d2h, after)?;
            st.free.push(after); // a wait takes the event's state when it is queued
            Ok(())
        })();
        for p in group {
            st.unevented.push(p.id);
            if first.is_err() {
                continue; // the compute stream could not be ordered: issue nothing after it
            }
            // SAFETY: d2h's contract, held since the pack: the source as the ledger says (or
            // by `keep`), the destination by the copy's `hold` until it is seen landed.
            let r = unsafe {
                self.dev
                    .copy(p.dst, p.src, p.nbytes, Dir::ToHost, self.d2h, p.keep)
            };
            let r = r.and_then(|()| match p.checksum {
                // SAFETY: `slot` is 8 bytes of the link's host memory, free until this copy
                // lands; `checksum` is the caller's 8-byte device value, held as `src` is.
                Some((slot, checksum, keep)) => unsafe {
                    self.dev
                        .copy(slot, checksum, 8, Dir::ToHost, self.d2h, keep)
                },
                None => Ok(()),
            });
            if let Err(e) = r {
                first = Err(e);
            }
        }
        let recorded = self.record_d2h(st);
        first.and(recorded)
    }

    /// Issue the copies held back now (Note [grouped copies]: the end of forward).
    pub fn flush(&self) -> Result<()> {
        self.dev.bind_thread()?;
        let mut st = self.lock();
        self.flush_pending(&mut st)
    }

    /// An 8-byte host slot for a device checksum (Note [device checksum]).
    pub(super) fn slot(&self, st: &mut State) -> Result<u64> {
        if let Some(s) = st.free_slots.pop() {
            return Ok(s);
        }
        let base = self.dev.host_alloc((SLOTS_PER_SLAB * 8) as usize)?;
        st.free_slots
            .extend((1..SLOTS_PER_SLAB).rev().map(|i| base + i * 8));
        Ok(base)
    }

    /// Record an event on the D2H stream for the copies that have none (Note [device calls]).
    pub(super) fn record_d2h(&self, st: &mut State) -> Result<()> {
        if st.unevented.is_empty() {
            return Ok(());
        }
        let ev = self.event(st)?;
        self.dev.record(ev, self.d2h)?;
        let ids = std::mem::take(&mut st.unevented);
        let mut n = 0;
        for id in ids {
            if let Some(c) = st.d2h.get_mut(&id) {
                c.ev = Some(ev);
                n += 1;
            }
        }
        if n == 0 {
            st.free.push(ev); // nothing left to see landing by it
            return Ok(());
        }
        st.ev_refs.insert(ev, n);
        st.d2h_evs.push_back(ev);
        Ok(())
    }

    /// The D2H event after copy `id` (recording one if it has none); None once it landed.
    pub(super) fn d2h_event(&self, st: &mut State, id: u64) -> Result<Option<Event>> {
        if st.pending.iter().any(|p| p.id == id) {
            self.flush_pending(st)?;
        }
        match st.d2h.get(&id).map(|c| c.ev) {
            None => Ok(None),
            Some(Some(ev)) => Ok(Some(ev)),
            Some(None) => {
                self.record_d2h(st)?;
                Ok(st.d2h.get(&id).and_then(|c| c.ev))
            }
        }
    }

    /// A copy that landed lets go of its share of its event.
    pub(super) fn unref(st: &mut State, ev: Event) {
        let gone = match st.ev_refs.get_mut(&ev) {
            Some(n) if *n > 1 => {
                *n -= 1;
                false
            }
            _ => true,
        };
        if gone {
            st.ev_refs.remove(&ev);
            // copies land (and are let go of) in the order of their events
            if st.d2h_evs.front() == Some(&ev) {
                st.d2h_evs.pop_front();
            } else {
                st.d2h_evs.retain(|&e| e != ev);
            }
            st.free.push(ev);
        }
    }

    /// The compute streams of `ids` wait for their copies (the newest per stream: a copy
    /// stream finishes in order). A copy already seen landed needs nothing.
    pub(super) fn order_victims(&self, st: &mut State, ids: &[u64]) -> Result<()> {
        let mut newest: Vec<(Stream, Event)> = Vec::new();
        for &id in ids {
            let Some(compute) = st.d2h.get(&id).map(|c| c.compute) else {
                continue;
            };
            let Some(ev) = self.d2h_event(st, id)? else {
                continue;
            };
            match newest.iter_mut().find(|(s, _)| *s == compute) {
                Some(slot) => slot.1 = ev,
                None => newest.push((compute, ev)),
            }
        }
        for (stream, ev) in newest {
            let t0 = Instant::now();
            self.dev.wait(stream, ev)?;
            st.stats.host_wait_seconds += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// Every held source is released: the compute streams wait for those copies. Returns
    /// their ids (oldest first) for the caller to drop the sources.
    pub fn release_all(&self) -> Result<Vec<u64>> {
        self.dev.bind_thread()?;
        let mut st = self.lock();
        let ids = st.ledger.release_all();
        self.order_victims(&mut st, &ids)?;
        Ok(ids)
    }
}
