//! The device link: copies between device memory and the host pool, issued from Rust on the
//! streams of one device ([`device::Device`]: CUDA through the driver API, or the simulated
//! device), one call per saved tensor from Python.
//!
//! # Note [stream ordering]
//! - Device to host (pack): the link's D2H stream waits for an event recorded on the compute
//!   stream handed over (the user's current stream), then copies, then records the copy's
//!   event. Never a host wait: forward runs on while the copy drains.
//! - Host to device, urgent (an unpack whose bytes were not staged): the copy is queued on the
//!   compute stream itself, after the work queued there and before the node that needs it;
//!   an event after it keeps the host block until it ran. The tensor it fills was made from
//!   that stream's allocator pool, so nothing else orders it. A copy the using stream needs
//!   now does not queue behind look-ahead on the H2D stream.
//! - Host to device, staged ahead: the H2D stream waits once per batch for the compute
//!   stream's queued work (the blocks are from the compute stream's pool, and queued work may
//!   still use them: Note [backward's tensors in the compute pool] in activations/link), then
//!   copies each and records its event; the using stream waits for that event at the unpack
//!   (`use_staged`), or before the tensor is let go unused (`drop_staged`).
//! - Bytes whose D2H copy has not been observed complete are brought back after it: the
//!   stream that copies them waits for the D2H event (`after`), never the host.
//!
//! # Note [sources held]
//! A copy reads its source after `d2h` returned. The source (a torch tensor) is Python's to
//! keep; the link's ledger ([`crate::tier::Inflight`]) says how long: until the copy is
//! observed complete ([`Link::poll`]), or until the compute stream the source was made on has
//! been made to wait for the copy (the victims `d2h` returns past the cap, and
//! [`Link::release_all`]) -- then the caching allocator can hand the source's block only to
//! work ordered after the copy. The host blocks a copy writes or reads (a tier entry's staging
//! view, a pool view) are held here (`hold`) until its event was seen.
//!
//! # Note [back-pressure]
//! Forward produces activations faster than the link drains them. Unbounded, every source
//! would stay alive until its copy ran and offloading would save nothing. So the bytes of
//! copies whose source is held are capped (`cap_bytes`; the newest copy may pass it alone):
//! past the cap the compute stream waits for the oldest copies (one wait per stream, on the
//! newest of them: a copy stream runs in order) and their sources go. The ledger picks them
//! (Note [the ledger of copies in flight] in rust/tier/inflight.rs). The default cap is 20 ms
//! of the link's bandwidth, within [64 MiB, 2 GiB]: enough to keep the link busy, small beside
//! device memory. What the cap costs shows as `copy_waits_forced` and the stalls.
//!
//! # Note [device calls]
//! What a pack costs the device API. Copies are issued in groups (Note [grouped copies]): per
//! group a record (compute) and a wait (D2H stream), per copy the copy, per group the record
//! of the D2H event after it -- 1 + 3/k calls a copy for a group of k (8: 1.4; six of 8 MiB:
//! 1.5; three of 16 MiB: 2; two of 24 MiB or more: 2.5). Then the waits its
//! victims need past the cap and the queries of [`Link::poll`] (Note [polls in order]). An
//! urgent unpack: a
//! copy and a record on the compute stream = 2 (a wait more when its D2H copy was not seen
//! complete). A staged unpack: per batch a record and a wait, per entry a copy, per run of
//! entries up to [`SHARE_BYTES`] a record (their tensors wait for the run's last copy: at most
//! ~300 us of the H200's link; with 4 MiB, each 8 MiB entry had a run of its own and an unpack
//! of 8 MiB took 4.4 calls), and per run and using stream one wait at the first unpack unless
//! a poll saw the run land (Note [staged copies seen landed]). `Device::calls` counts them; the link's
//! `calls` property reads it.
//!
//! # Note [polls in order]
//! A stream runs its work in order, so the events of one stream that fired are a prefix of
//! those recorded. A poll asks the oldest first (none fired: one query), then the newest (all
//! fired: two), then finds the first that has not by halving: at most 2 + log2(k) queries for
//! k events in flight. Between two polls a few events fire, so the oldest alone answers most
//! (the newest first cost 1 + log2(k) whenever the copies lagged). It asked one query per
//! event that fired and one for the first that had not (after the newest): at the end of a
//! forward of 200 copies of 4 KiB, 25 queries in one poll; at 8 MiB a copy, 0.75-1.5 queries a
//! pack, which put a pack's calls anywhere in 3.5-4.2 from one run to the next (the goal is 3;
//! `link_cost.py` prints them). A copy that failed since the last poll makes it ask each event
//! again, for each copy's error. Polls from packs and unpacks come at most every 1 ms and
//! every `POLL_BYTES` packed or unpacked (Note [polls] in activations/link/device.py).
//!
//! # Note [staged copies seen landed]
//! A staged copy's tensor waited for the copy's event at its unpack (one device call per run
//! and using stream) even when a poll had already seen that event fire, and its pool views
//! stayed held until the tensor was used. A poll now asks the staged events it has not yet
//! seen fire (the next prefix, by halving), marks those that have: their views go back to the
//! pool at once, and the unpack of their tensors makes no wait (the copy is done on the
//! device: nothing left to order after). On the simulated device (`link_cost.py`'s
//! `device_calls`: every copy landed before backward) an unpack of 32 MiB went from 5.83 to
//! 4.33 calls, one of 16 MiB from 4.46 to 3.71; the polls of unpacks every 64 MiB instead of
//! 32 (Note [polls] in activations/link/device.py) took those to 4.25 and 3.38. An unpack of
//! 32 MiB still stages one entry a batch there (two and a record and a wait each: the
//! staging distance is an eighth of that run's 512 MiB pool, Note [staging distance]); in a
//! pool the size of a step of 24 or 48 such saves, 3.4-3.5.
//!
//! # Note [grouped copies]
//! The H200 measured 3.2 device calls a pack of 4 KiB and 5.6 of 1 MiB (at ~1-5 us of host time
//! each): a record and a wait per copy, to order the D2H stream after the compute stream's
//! work so far, were half of them. A copy is therefore held back (`pending`, in the ledger
//! from its pack: its source is held as any copy in flight) and issued with the next ones
//! after one record and one wait: when [`GROUP_COPIES`] are held, or two or more holding
//! [`GROUP_FLUSH_BYTES`], or any holding a quarter of the cap of Note [back-pressure] (a
//! victim past the cap makes the compute stream wait for its copy, best issued long before), or
//! a copy of
//! another compute stream comes (order is kept), or anything needs one of them (a victim's
//! wait, a copy back ordered after it, a host wait, [`Link::release_all`],
//! [`Link::synchronize`]), and at the end of forward ([`Link::flush`]). Ordering the group
//! after the compute stream's work *at the flush* orders each copy after its source's
//! producer, which was queued before its pack; the source cannot change meanwhile (autograd's
//! saved tensor: an in-place write raises at unpack, Note [in-place after pack] in
//! activations/link). What a group delays is its copies until the next pack past the limit:
//! on a GPU the host runs ahead of the compute the copies wait for anyway, and a link with
//! copies queued is busy with them; at worst (a long op after a few saves) until forward
//! ends. A copy over 8 MiB went alone (record, wait, copy, event: 4 calls) -- most of the
//! probe's 1B Llama's saves at seq 4096 (16-44 MiB) -- now two share 5 up to a quarter of the
//! cap (the default on CUDA: 320 MB, so up to 80 MB; it was an eighth, below); with groups of at most 16 MiB, a pack of
//! 8 MiB took 2.5 calls before the polls, then 1.75 at 32 MiB. At 32 MiB a pack of 16 MiB still
//! went in pairs: 3.04 calls with the polls (the goal is 3); at [`GROUP_FLUSH_BYTES`] = 48 MiB
//! three of 16 MiB share 6, 2.46 with the polls. The bench ran without a cap; under CUDA's
//! default (320 MB: 16 GB/s x 20 ms) a copy of 44 or 64 MiB passed an eighth of it alone and
//! went alone, 4.7-4.8 calls a pack with the polls. At a quarter (80 MB) two share 5: 3.04-3.06
//! (`link_cost.device_calls` at that cap). Under small caps still nothing changes: copies of 1
//! MiB under a 4 MiB cap go at once.

pub mod checksum;
pub mod cuda;
mod d2h;
pub mod device;
mod h2d;
pub mod sim;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

pub use d2h::{GROUP_COPIES, GROUP_FLUSH_BYTES};
pub use device::{Device, Dir, Event, Keep, Stream};
pub use h2d::{StageItem, SHARE_BYTES};

use d2h::Pending;

use crate::error::{Error, Result};
use crate::tier::{Inflight, Issued};

/// What runs once a device-to-host copy has landed (the tier entry's seal, the verify check).
pub type Landing = Box<dyn FnOnce() -> Result<()> + Send>;

/// A copy observed complete by [`Link::poll`]: its id and what it (or its landing) raised.
#[derive(Debug)]
pub struct Landed {
    pub id: u64,
    pub error: Option<Error>,
}

/// Verify mode (Note [device checksum]): where the device's checksum of a copy's source is,
/// and the host bytes it must match once the copy landed.
pub struct Verify {
    /// Device address of the source's checksum (an int64 the caller computed on the compute
    /// stream before the copy; `keep` holds it on the simulated device).
    pub checksum: u64,
    /// The host bytes the copy writes (held by the copy's `hold`).
    pub host: u64,
    pub len: u64,
    pub keep: Option<Keep>,
}

struct Checked {
    slot: u64,
    host: u64,
    len: u64,
    device: Option<u32>,
}

struct D2h {
    /// The event recorded after it on the D2H stream (shared with the copies before it that
    /// had none: Note [device calls]); None until one is.
    ev: Option<Event>,
    compute: Stream,
    nbytes: u64,
    hold: Option<Keep>,
    landing: Option<Landing>,
    verify: Option<Checked>,
}

struct H2d {
    ev: Event,
    hold: Option<Keep>,
}

/// Staged copies sharing one event (Note [device calls]): what they read (until they ran), how
/// many of their tensors are still to be used or let go, the streams already made to wait for
/// it, and whether a poll saw it fire (Note [staged copies seen landed]).
struct Staged {
    holds: Vec<Option<Keep>>,
    left: usize,
    waited: Vec<Stream>,
    ran: bool,
}

#[derive(Default, Debug, Clone, Copy)]
pub struct LinkStats {
    pub copies_to_host: u64,
    pub copies_to_device: u64,
    pub staged: u64,
    pub urgent: u64,
    pub after_waits: u64,
    pub host_wait_seconds: f64,
    /// Event queries (Note [polls in order]).
    pub queries: u64,
}

struct State {
    ledger: Inflight,
    d2h: BTreeMap<u64, D2h>,
    h2d: VecDeque<H2d>,
    /// Staged copies by their event, and their events in issue order (one H2D stream).
    staged: HashMap<Event, Staged>,
    staged_order: VecDeque<Event>,
    /// How many of `staged_order`'s first events a poll saw fire.
    staged_ran: usize,
    free: Vec<Event>,
    stats: LinkStats,
    /// `Device::failed_copies` at the last poll.
    failed_seen: u64,
    /// Copies issued after the last event recorded on the D2H stream, oldest first.
    unevented: Vec<u64>,
    /// How many copies in flight share each D2H event.
    ev_refs: HashMap<Event, u32>,
    /// Those events, oldest first (Note [polls in order]).
    d2h_evs: VecDeque<Event>,
    /// Verify mode: free 8-byte host slots the devices' checksums are copied into.
    free_slots: Vec<u64>,
    /// Copies held back for their group, oldest first, all of `pending_stream`'s (Note
    /// [grouped copies]), and their bytes.
    pending: Vec<Pending>,
    pending_stream: Stream,
    pending_bytes: u64,
}

/// The link of one device (Notes [stream ordering], [sources held], [device calls]).
pub struct Link {
    dev: Arc<dyn Device>,
    d2h: Stream,
    h2d: Stream,
    st: Mutex<State>,
}

impl Link {
    /// A link over `dev`, its held sources capped at `cap_bytes` (Note [back-pressure] in the
    /// ledger): makes its two streams.
    pub fn new(dev: Arc<dyn Device>, cap_bytes: u64) -> Result<Link> {
        dev.bind_thread()?;
        let d2h = dev.new_stream()?;
        let h2d = dev.new_stream()?;
        Ok(Link {
            dev,
            d2h,
            h2d,
            st: Mutex::new(State {
                ledger: Inflight::new(cap_bytes),
                d2h: BTreeMap::new(),
                h2d: VecDeque::new(),
                staged: HashMap::new(),
                staged_order: VecDeque::new(),
                staged_ran: 0,
                free: Vec::new(),
                stats: LinkStats::default(),
                failed_seen: 0,
                unevented: Vec::new(),
                ev_refs: HashMap::new(),
                d2h_evs: VecDeque::new(),
                free_slots: Vec::new(),
                pending: Vec::new(),
                pending_stream: 0,
                pending_bytes: 0,
            }),
        })
    }

    pub fn device(&self) -> &Arc<dyn Device> {
        &self.dev
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Ask the device whether `ev` fired, counted in [`LinkStats::queries`].
    fn query(&self, st: &mut State, ev: Event) -> Result<bool> {
        st.stats.queries += 1;
        self.dev.query(ev)
    }

    /// How many of `evs` (recorded on one stream, oldest first) have fired: they fire in
    /// order, so after the oldest (none fired: one query) and the newest (all fired: two) the
    /// first that has not is found by halving (Note [polls in order]). An error counts as not
    /// fired.
    /// `ev_at(st, i)` is the `i`-th of `n`, read from the state in place (no copy of them).
    fn fired_prefix(
        &self,
        st: &mut State,
        n: usize,
        ev_at: impl Fn(&State, usize) -> Event,
    ) -> usize {
        let fired = |st: &mut State, i: usize| {
            let ev = ev_at(st, i);
            matches!(self.query(st, ev), Ok(true))
        };
        if n == 0 || !fired(st, 0) {
            return 0;
        }
        if n == 1 || fired(st, n - 1) {
            return n;
        }
        let (mut lo, mut hi) = (1, n - 1);
        while lo < hi {
            let mid = (lo + hi) / 2;
            if fired(st, mid) {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    fn event(&self, st: &mut State) -> Result<Event> {
        match st.free.pop() {
            Some(ev) => Ok(ev),
            None => self.dev.new_event(),
        }
    }

    /// Observe the copies that have landed (oldest first, up to the first that has not: a
    /// copy stream finishes in order; Note [polls in order]), run their landings, let go of
    /// what finished host-to-device copies held.
    pub fn poll(&self) -> Result<Vec<Landed>> {
        self.dev.bind_thread()?;
        let mut st = self.lock();
        let mut done: Vec<(u64, D2h, Option<Error>)> = Vec::new();
        // Note [polls in order]: when no copy failed since the last poll, the events that
        // fired are a prefix of those in flight, found by halving
        let failed = self.dev.failed_copies();
        let clean = failed == st.failed_seen;
        st.failed_seen = failed;
        // Some(the first event that has not fired, None when all have): the copies go in the
        // order of their events, so a copy has landed unless its event is that one or later
        let first_not = if clean {
            let n = st.d2h_evs.len();
            let k = self.fired_prefix(&mut st, n, |s, i| s.d2h_evs[i]);
            Some(st.d2h_evs.get(k).copied())
        } else {
            None
        };
        let mut seen: Option<(Event, bool)> = None; // the last event queried, and its answer
        while let Some((&id, c)) = st.d2h.first_key_value() {
            let Some(ev) = c.ev else { break }; // no event after it yet: cannot be seen
            let fired = match (seen, first_not) {
                (Some((e, f)), _) if e == ev => Ok(f),
                (_, Some(first_not)) => Ok(first_not != Some(ev)),
                _ => self.query(&mut st, ev),
            };
            let error = match fired {
                Ok(false) => break,
                Ok(true) => {
                    seen = Some((ev, true));
                    None
                }
                Err(e) => Some(e),
            };
            let Some(mut c) = st.d2h.remove(&id) else {
                break;
            };
            st.ledger.landed(id);
            Link::unref(&mut st, ev);
            if let Some(v) = c.verify.as_mut() {
                // SAFETY: the slot's 8 bytes were written by the checksum's copy, which ran
                // before the event just seen; nothing else writes a slot until it is freed.
                let value = unsafe { std::ptr::read_unaligned(v.slot as *const u64) };
                v.device = Some(value as u32);
                st.free_slots.push(v.slot);
            }
            done.push((id, c, error));
        }
        self.poll_h2d(&mut st);
        self.reap_staged(&mut st);
        drop(st);
        Ok(finish(done))
    }

    fn poll_h2d(&self, st: &mut State) {
        let n = st.h2d.len();
        for _ in 0..self.fired_prefix(st, n, |s, i| s.h2d[i].ev) {
            if let Some(h) = st.h2d.pop_front() {
                st.free.push(h.ev);
                drop(h.hold);
            }
        }
    }

    /// Block the host until copy `id` has landed (and every copy before it); then poll.
    /// Returns the seconds waited and what the poll observed. A copy already observed: 0 s.
    pub fn wait_copy(&self, id: u64) -> Result<(f64, Vec<Landed>)> {
        self.dev.bind_thread()?;
        let ev = {
            let mut st = self.lock();
            self.d2h_event(&mut st, id)?
        };
        let t0 = Instant::now();
        if let Some(ev) = ev {
            // an error of the copy is the poll's to report, with its id
            let _ = self.dev.synchronize(ev);
        }
        let dt = t0.elapsed().as_secs_f64();
        let landed = self.poll()?;
        self.lock().stats.host_wait_seconds += dt;
        Ok((if ev.is_some() { dt } else { 0.0 }, landed))
    }

    /// Wait for every copy in flight either way (tests, measurements, a full pool), then
    /// poll. What the copies raised comes back with their ids.
    pub fn synchronize(&self) -> Result<Vec<Landed>> {
        self.dev.bind_thread()?;
        let evs: Vec<Event> = {
            let mut st = self.lock();
            self.flush_pending(&mut st)?;
            self.record_d2h(&mut st)?;
            // the D2H events in flight, each once (Note [polls in order])
            let mut v: Vec<Event> = st.d2h_evs.iter().copied().collect();
            v.extend(st.h2d.iter().map(|h| h.ev));
            v.extend(st.staged.iter().filter(|(_, s)| !s.ran).map(|(&e, _)| e));
            v
        };
        let t0 = Instant::now();
        for ev in evs {
            let _ = self.dev.synchronize(ev); // errors come back through the poll
        }
        let landed = self.poll()?;
        let mut st = self.lock();
        st.stats.host_wait_seconds += t0.elapsed().as_secs_f64();
        self.reap_staged(&mut st);
        Ok(landed)
    }

    /// The ledger's counters and the link's (a snapshot).
    pub fn counters(&self) -> (LedgerCounters, LinkStats) {
        let st = self.lock();
        let l = &st.ledger;
        (
            LedgerCounters {
                cap_bytes: l.cap_bytes(),
                bytes_in_flight: l.bytes_in_flight(),
                peak_bytes_in_flight: l.peak_bytes_in_flight(),
                bytes_held: l.bytes_held(),
                peak_bytes_held: l.peak_bytes_held(),
                copies: l.copies(),
                forced_waits: l.forced_waits(),
                sources_released: l.sources_released(),
                in_flight: l.in_flight() as u64,
                staged: st.staged.values().map(|s| s.left as u64).sum(),
            },
            st.stats,
        )
    }

    /// Whether copy `id` is in flight (not yet seen complete).
    pub fn in_flight(&self, id: u64) -> bool {
        self.lock().d2h.contains_key(&id)
    }

    /// Bytes of the copies not seen complete (what [`Link::counters`] reads, without the rest:
    /// a pack asks it, Note [polls] in activations/link/device.py).
    pub fn bytes_in_flight(&self) -> u64 {
        self.lock().ledger.bytes_in_flight()
    }

    /// Whether the source of copy `id` is still the ledger's to hold.
    pub fn held(&self, id: u64) -> bool {
        self.lock().ledger.is_held(id)
    }

    /// The bytes of copy `id` while in flight.
    pub fn nbytes(&self, id: u64) -> Option<u64> {
        self.lock().d2h.get(&id).map(|c| c.nbytes)
    }
}

/// The ledger's counters (Note [the ledger of copies in flight]).
#[derive(Debug, Clone, Copy, Default)]
pub struct LedgerCounters {
    pub cap_bytes: u64,
    pub bytes_in_flight: u64,
    pub peak_bytes_in_flight: u64,
    pub bytes_held: u64,
    pub peak_bytes_held: u64,
    pub copies: u64,
    pub forced_waits: u64,
    pub sources_released: u64,
    pub in_flight: u64,
    pub staged: u64,
}

/// Run the landings of copies seen complete (outside the link's lock: a seal takes the tier's),
/// after checking the host bytes against the device's checksum (verify mode) and dropping what
/// they held. A copy whose bytes do not match is not sealed: its entry goes with its step.
fn finish(done: Vec<(u64, D2h, Option<Error>)>) -> Vec<Landed> {
    done.into_iter()
        .map(|(id, c, error)| {
            let mismatch = match (&error, &c.verify) {
                (None, Some(v)) => {
                    // SAFETY: `hold` keeps the `len` bytes at `host` alive; the copy writing
                    // them has run (its event fired).
                    let bytes =
                        unsafe { std::slice::from_raw_parts(v.host as *const u8, v.len as usize) };
                    let host = checksum::checksum(bytes);
                    match v.device {
                        Some(device) if device != host => Some(Error::Landed { id, device, host }),
                        _ => None,
                    }
                }
                _ => None,
            };
            // the staging view goes first: the tier writes behind only blocks nobody views
            drop(c.hold);
            let error = match (error, mismatch) {
                (Some(e), _) | (None, Some(e)) => Some(e),
                (None, None) => c.landing.and_then(|f| f().err()),
            };
            Landed { id, error }
        })
        .collect()
}
