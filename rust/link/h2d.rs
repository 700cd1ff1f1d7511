//! The link's host-to-device half: urgent copies on the compute stream, copies staged ahead on
//! the H2D stream, and what becomes of a staged tensor (used, or let go unused). The ledger,
//! the device-to-host half and the Notes they follow are in `mod.rs` (Note [stream ordering]).

use super::*;

/// Note [device calls]: consecutive staged copies share one event up to this many bytes.
pub const SHARE_BYTES: u64 = 16 << 20;

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
    /// after, hold, keep)` as for [`Link::to_device`]. Returns one event per copy (the copies
    /// of a run up to [`SHARE_BYTES`] share one), for [`Link::use_staged`] or
    /// [`Link::drop_staged`] (exactly one of them, once per copy).
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
        // a run of copies sharing one event, recorded after its last (Note [device calls])
        let mut run: Vec<Option<Keep>> = Vec::new();
        let mut run_bytes = 0u64;
        let n = items.len();
        for (i, it) in items.into_iter().enumerate() {
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
            run.push(it.hold);
            run_bytes += it.nbytes;
            st.stats.copies_to_device += 1;
            st.stats.staged += 1;
            let last = i + 1 == n;
            if !last && run_bytes < SHARE_BYTES {
                continue;
            }
            let ev = self.event(&mut st)?;
            self.dev.record(ev, self.h2d)?;
            st.staged_order.push_back(ev);
            out.extend(std::iter::repeat_n(ev, run.len()));
            st.staged.insert(
                ev,
                Staged {
                    left: run.len(),
                    holds: std::mem::take(&mut run),
                    waited: Vec::new(),
                    ran: false,
                },
            );
            run_bytes = 0;
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
        if s.left == 0 {
            return Ok(()); // every tensor of the run settled already
        }
        s.left -= 1;
        if s.ran || s.waited.contains(&stream) {
            // seen landed (Note [staged copies seen landed]), or this stream waits already
            return Ok(());
        }
        s.waited.push(stream);
        let t0 = Instant::now();
        let r = self.dev.wait(stream, ev);
        st.stats.host_wait_seconds += t0.elapsed().as_secs_f64();
        r
    }

    /// Note [staged copies seen landed]: find which staged copies ran (one H2D stream runs them
    /// in order: the prefix of those not yet seen, by halving, Note [polls in order]); what they
    /// read goes at once, and their events once their tensors were used (or dropped) too.
    pub(super) fn reap_staged(&self, st: &mut State) {
        let n = st.staged_order.len();
        let known = st.staged_ran.min(n);
        let ran = known + self.fired_prefix(st, n - known, |s, i| s.staged_order[known + i]);
        for i in known..ran {
            if let Some(s) = st.staged.get_mut(&st.staged_order[i]) {
                s.ran = true;
                s.holds.clear(); // the copies read them: the pool's views go back now
            }
        }
        // a run seen landed whose tensors were all used or dropped: its event goes
        let (order, staged, free) = (&mut st.staged_order, &mut st.staged, &mut st.free);
        order.retain(|ev| match staged.get(ev) {
            Some(s) if s.ran && s.left == 0 => {
                staged.remove(ev);
                free.push(*ev);
                false
            }
            Some(_) => true,
            None => false,
        });
        // what is left of those seen landed is still the front (one H2D stream: in order)
        st.staged_ran = order
            .iter()
            .take_while(|ev| staged.get(ev).is_some_and(|s| s.ran))
            .count();
    }
}
