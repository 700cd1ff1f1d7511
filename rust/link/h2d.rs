//! The link's host-to-device half: urgent copies on the compute stream, copies staged ahead on
//! the H2D stream, and what becomes of a staged tensor (used, or let go unused). The ledger,
//! the device-to-host half and the Notes they follow are in `mod.rs` (Note [stream ordering]).

use super::*;

/// One copy of [`Link::stage`].
pub struct StageItem {
    pub dst: u64,
    pub src: u64,
    pub nbytes: u64,
    pub after: Option<u64>,
    pub hold: Option<Keep>,
    pub keep: Option<Keep>,
}

impl Link {
    /// Bring `nbytes` from host memory `src` into device memory `dst` now, on `compute`
    /// (Note [stream ordering]: urgent), after the D2H copy `after` when it was not seen
    /// complete. `hold` keeps `src` until the copy ran.
    ///
    /// # Safety
    /// `dst` is device memory of `nbytes` made from `compute`'s pool (or held by `keep`);
    /// `src` is host memory of `nbytes` that `hold` keeps alive.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn to_device(
        &self,
        dst: u64,
        src: u64,
        nbytes: u64,
        compute: Stream,
        after: Option<u64>,
        hold: Option<Keep>,
        keep: Option<Keep>,
    ) -> Result<()> {
        self.dev.bind_thread()?;
        let mut st = self.lock();
        if let Some(ev) = match after {
            Some(id) => self.d2h_event(&mut st, id)?,
            None => None,
        } {
            self.dev.wait(compute, ev)?;
            st.stats.after_waits += 1;
        }
        let t0 = Instant::now();
        // SAFETY: the caller's contract.
        unsafe {
            self.dev
                .copy(dst, src, nbytes, Dir::ToDevice, compute, keep)?
        };
        // the host's time in the call: a simulated compute stream (the host) runs the copy
        st.stats.host_wait_seconds += t0.elapsed().as_secs_f64();
        let ev = self.event(&mut st)?;
        self.dev.record(ev, compute)?;
        st.h2d.push_back(H2d { ev, hold });
        st.stats.copies_to_device += 1;
        st.stats.urgent += 1;
        Ok(())
    }

    /// Stage copies ahead on the H2D stream (Note [stream ordering]): each `(dst, src, nbytes,
    /// after, hold, keep)` as for [`Link::to_device`]. Returns one event per copy, for
    /// [`Link::use_staged`] or [`Link::drop_staged`] (exactly one of them, once).
    ///
    /// # Safety
    /// As [`Link::to_device`] for each item.
    pub unsafe fn stage(&self, compute: Stream, items: Vec<StageItem>) -> Result<Vec<Event>> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        self.dev.bind_thread()?;
        let mut st = self.lock();
        let before = self.event(&mut st)?;
        self.dev.record(before, compute)?;
        self.dev.wait(self.h2d, before)?;
        st.free.push(before);
        let mut out = Vec::with_capacity(items.len());
        for it in items {
            if let Some(ev) = match it.after {
                Some(id) => self.d2h_event(&mut st, id)?,
                None => None,
            } {
                self.dev.wait(self.h2d, ev)?;
                st.stats.after_waits += 1;
            }
            // SAFETY: the caller's contract.
            unsafe {
                self.dev
                    .copy(it.dst, it.src, it.nbytes, Dir::ToDevice, self.h2d, it.keep)?
            };
            let ev = self.event(&mut st)?;
            self.dev.record(ev, self.h2d)?;
            st.staged_order.push_back(ev);
            st.staged.insert(
                ev,
                Staged {
                    hold: it.hold,
                    settled: false,
                },
            );
            st.stats.copies_to_device += 1;
            st.stats.staged += 1;
            out.push(ev);
        }
        Ok(out)
    }

    /// A staged copy's tensor is used on `stream` from now: the stream waits for the copy.
    pub fn use_staged(&self, ev: Event, stream: Stream) -> Result<()> {
        self.settle(ev, stream)
    }

    /// A staged copy's tensor is let go unused: the stream that made it waits for the copy
    /// first (its block would otherwise go to that stream's next allocation under the copy).
    pub fn drop_staged(&self, ev: Event, made_on: Stream) -> Result<()> {
        self.settle(ev, made_on)
    }

    fn settle(&self, ev: Event, stream: Stream) -> Result<()> {
        self.dev.bind_thread()?;
        let mut st = self.lock();
        let Some(s) = st.staged.get_mut(&ev) else {
            return Err(Error::Invalid(format!("event {ev} is no staged copy's")));
        };
        if s.settled {
            return Ok(());
        }
        s.settled = true;
        let t0 = Instant::now();
        let r = self.dev.wait(stream, ev);
        st.stats.host_wait_seconds += t0.elapsed().as_secs_f64();
        r
    }

    /// Staged copies used (or dropped) and seen complete: their holds and events go. One H2D
    /// stream runs them in order: when the newest has run, all have (one query).
    pub(super) fn reap_staged(&self, st: &mut State) {
        if !st.staged.values().any(|s| s.settled) {
            return;
        }
        let all = st
            .staged_order
            .back()
            .is_some_and(|&ev| matches!(self.dev.query(ev), Ok(true)));
        let mut kept = VecDeque::with_capacity(st.staged_order.len());
        let mut running = false;
        while let Some(ev) = st.staged_order.pop_front() {
            let settled = st.staged.get(&ev).is_some_and(|s| s.settled);
            let done = all || (!running && matches!(self.dev.query(ev), Ok(true)));
            running |= !done;
            if done && settled {
                if let Some(s) = st.staged.remove(&ev) {
                    drop(s.hold);
                    st.free.push(ev);
                }
            } else {
                kept.push_back(ev);
            }
        }
        st.staged_order = kept;
    }
}
