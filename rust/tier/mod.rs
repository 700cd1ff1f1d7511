//! The tiered tensor store: one owner for every offloaded block.
//!
//! A [`Tier`] owns the host pool, the swap engine (none for a host-only tier) and every entry.
//! [`Step::put`] leases a block (making room by dropping or writing out older entries) and
//! returns a [`Handle`] with a staging [`View`] to copy into; [`Handle::seal`] says the copy
//! has landed; [`Handle::get`] returns a view of the bytes, reading them back if they left the
//! pool, and reads ahead what backward is expected to need next; dropping the last clone of a
//! handle frees the entry wherever it is.
//!
//! # Note [views hold blocks]
//! A view holds its block (`Arc<Block>`), and an entry's block goes to the kernel only by
//! moving it out of the `Arc` (`Arc::try_unwrap`): a block that any live view can see -- a
//! staging view a copy is still writing through, an unpacked tensor -- can never be written
//! out, dropped or read into. No reference count is inspected from Python.
//!
//! # Note [residency]
//! An entry's residency is one enum whose variants carry their data: in the pool not yet
//! written (`Dirty`), being written (`Writing`, the block is the request's), written and still
//! in the pool (`Clean`), only on disk (`Disk`), being read (`Reading`). A request's ticket and
//! slot live in the variant, so "reading with no ticket" cannot be represented. Waits happen
//! outside the tier's lock, on a [`Watch`] of the ticket; the transition is made under the lock
//! by whoever gets there first.
//!
//! # Note [clean entries]
//! An entry read back keeps its swap slot until it dies: when the pool needs its block again
//! it is dropped without a second write, and a second backward (`retain_graph=True`) reads it
//! again from the same place.
//!
//! # Note [plans are snapshots]
//! The read-ahead plans from what it sees under the lock (policy::read_ahead) and then applies
//! the plan entry by entry; write-behind and gathering likewise. The same entry can appear at
//! two places of a forecast (one storage unpacked through several views, pieces of one
//! storage), and an entry may have been read, gathered, written or freed by the time the plan
//! reaches it. So whoever applies a plan re-checks each entry's residency in the same lock
//! scope and skips what it cannot do: a plan is advice, never an assumption. Found by a HF
//! Llama (RMSNorm saves one storage through several views) panicking in its second step.
//!
//! # Note [failed I/O]
//! A write that fails gives its block back: the entry is unwritten again (nothing is lost) and
//! the error is raised by the call that saw it. A read that fails leaves the entry on disk and
//! raises from `get`. Never a zero-filled view.

mod gather;
mod handle;
pub mod policy;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use crate::error::{Error, Result};
use crate::io::{Slot, Swap, Ticket, Watch};
use crate::pool::{Block, Pool, PoolOptions};

use gather::GatherState;
pub use gather::Gathered;
pub(crate) use handle::view_of_blocks;
pub use handle::{Handle, Step, View};
use policy::{Ahead, Forecast, Learned, Seen, Unwritten};

/// Default read-ahead cap (the window is a quarter of the pool, at most this).
pub const DEFAULT_PREFETCH_CAP: u64 = 256 << 20;

/// Knobs of a tier.
#[derive(Debug, Clone)]
pub struct TierOptions {
    /// Write behind while more than this many bytes are not on disk.
    pub dirty_bytes: u64,
    /// Read-ahead window in backward.
    pub prefetch_bytes: u64,
    /// crc32c every entry at seal and check it at every `get`.
    pub verify: bool,
}

impl TierOptions {
    /// Defaults for a pool of `capacity` bytes.
    pub fn for_pool(capacity: u64) -> TierOptions {
        TierOptions {
            dirty_bytes: capacity / 4,
            prefetch_bytes: (capacity / 4).min(DEFAULT_PREFETCH_CAP),
            verify: false,
        }
    }
}

/// Counters of one step.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepStats {
    /// Bytes put (every entry, pieces included).
    pub bytes_put: u64,
    /// Bytes written to disk for the first time (an entry is counted once).
    pub bytes_written: u64,
    /// Unpacks of entries that had gone to disk and were back in the pool in time, or not.
    pub prefetch_hits: u64,
    pub prefetch_misses: u64,
    /// Unpacks of entries that never left the pool.
    pub host_cache_hits: u64,
    /// Reads back that found no room in the pool and used a one-off buffer.
    pub overflow_reads: u64,
    /// Seconds `put`, `get` and gathering waited for the disk.
    pub stall_seconds: f64,
}

/// Counters of the whole tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierStats {
    pub entries: u64,
    pub pool_capacity: u64,
    pub pool_in_use: u64,
    pub pool_peak: u64,
    /// Entries (and their bytes) by residency.
    pub staging: u64,
    pub dirty: u64,
    pub writing: u64,
    pub clean: u64,
    pub disk: u64,
    pub reading: u64,
    pub bytes_in_pool: u64,
    pub bytes_on_disk_only: u64,
    pub swap_in_use: u64,
    pub io_in_flight: u64,
}

/// Where an entry's bytes are (Note [residency]).
enum Residency {
    /// Leased; the copy into it has not landed yet.
    Staging(Arc<Block>),
    Dirty(Arc<Block>),
    Writing {
        ticket: Ticket,
        slot: Slot,
    },
    Clean {
        block: Arc<Block>,
        slot: Slot,
    },
    Disk {
        slot: Slot,
    },
    Reading {
        ticket: Ticket,
        slot: Slot,
    },
    /// Only inside a transition made under the lock; never seen outside it.
    Moving,
}

impl Residency {
    fn name(&self) -> &'static str {
        match self {
            Residency::Staging(_) => "staging",
            Residency::Dirty(_) => "dirty",
            Residency::Writing { .. } => "writing",
            Residency::Clean { .. } => "clean",
            Residency::Disk { .. } => "disk",
            Residency::Reading { .. } => "reading",
            Residency::Moving => "moving",
        }
    }

    fn watch(&self) -> Option<Watch> {
        match self {
            Residency::Writing { ticket, .. } | Residency::Reading { ticket, .. } => {
                Some(ticket.watch())
            }
            _ => None,
        }
    }
}

struct Entry {
    nbytes: u64,
    step: u64,
    seq: u32,
    res: Residency,
    checksum: Option<u32>,
    went_to_disk: bool,
    /// Unpacked in the current backward (its bytes no longer count against the window).
    viewed: bool,
    /// The gathered storage this entry is a piece of.
    chunk: Option<u64>,
}

/// Whether only the entry sees its block (Note [views hold blocks]).
fn unshared(b: &Arc<Block>) -> bool {
    Arc::strong_count(b) == 1
}

struct StepState {
    /// This step's unpack order (taught to the next step) and sizes in pack order.
    order: Vec<u32>,
    sizes: Vec<u64>,
    ids: Vec<u64>,
    forecast: Forecast,
    stats: StepStats,
}

pub(crate) struct State {
    entries: BTreeMap<u64, Entry>,
    next_id: u64,
    /// Sealed entries not yet written, in pack order, with their bytes.
    dirty: VecDeque<(u64, u64)>,
    dirty_bytes: u64,
    /// Entries with a write in flight (oldest first) and with a read in flight.
    writing: VecDeque<u64>,
    reading: Vec<u64>,
    steps: HashMap<u64, StepState>,
    next_step: u64,
    last_step: Option<u64>,
    /// What the most recent step taught, kept when that step ended.
    last_learned: Option<Learned>,
    chunks: HashMap<u64, GatherState>,
    next_chunk: u64,
    /// The gathered storage being read ahead of its use (at most one).
    gathering: Option<u64>,
    /// `get`s left to panic ([`Tier::inject_panic`]).
    panic_gets: u32,
}

pub(crate) struct Inner {
    pool: Pool,
    swap: Option<Arc<Swap>>,
    opts: TierOptions,
    state: Mutex<State>,
}

/// The tier. Cheap to clone; share it between steps and threads.
#[derive(Clone)]
pub struct Tier {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Tier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tier")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Tier {
    /// A tier over `pool`, spilling to `swap` (host-only when `None`).
    pub fn new(pool: Pool, swap: Option<Arc<Swap>>, opts: TierOptions) -> Tier {
        Tier {
            inner: Arc::new(Inner {
                pool,
                swap,
                opts,
                state: Mutex::new(State {
                    entries: BTreeMap::new(),
                    next_id: 0,
                    dirty: VecDeque::new(),
                    dirty_bytes: 0,
                    writing: VecDeque::new(),
                    reading: Vec::new(),
                    steps: HashMap::new(),
                    next_step: 0,
                    last_step: None,
                    last_learned: None,
                    chunks: HashMap::new(),
                    next_chunk: 0,
                    gathering: None,
                    panic_gets: 0,
                }),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every transition is completed before anything under the lock can panic.
        self.inner.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn pool(&self) -> &Pool {
        &self.inner.pool
    }

    pub fn swap(&self) -> Option<&Arc<Swap>> {
        self.inner.swap.as_ref()
    }

    pub fn options(&self) -> &TierOptions {
        &self.inner.opts
    }

    /// Start a step. The order the previous step unpacked becomes this one's forecast.
    pub fn begin_step(&self) -> Step {
        let mut st = self.lock();
        let taught = match st.last_step.and_then(|s| st.steps.get(&s)) {
            Some(prev) if !prev.order.is_empty() => Some(Learned {
                order: prev.order.clone(),
                sizes: prev.sizes.clone(),
            }),
            Some(_) => None,
            None => st.last_learned.clone(),
        };
        let id = st.next_step;
        st.next_step += 1;
        st.steps.insert(
            id,
            StepState {
                order: Vec::new(),
                sizes: Vec::new(),
                ids: Vec::new(),
                forecast: Forecast::new(taught),
                stats: StepStats::default(),
            },
        );
        st.last_step = Some(id);
        Step {
            tier: self.clone(),
            id,
        }
    }

    pub fn stats(&self) -> TierStats {
        let st = self.lock();
        let p = self.inner.pool.stats();
        let mut s = TierStats {
            entries: st.entries.len() as u64,
            pool_capacity: p.capacity,
            pool_in_use: p.in_use,
            pool_peak: p.peak,
            ..TierStats::default()
        };
        for e in st.entries.values() {
            match e.res {
                Residency::Staging(_) => s.staging += 1,
                Residency::Dirty(_) => s.dirty += 1,
                Residency::Writing { .. } => s.writing += 1,
                Residency::Clean { .. } => s.clean += 1,
                Residency::Disk { .. } => s.disk += 1,
                Residency::Reading { .. } => s.reading += 1,
                Residency::Moving => {}
            }
            match e.res {
                Residency::Disk { .. } => s.bytes_on_disk_only += e.nbytes,
                Residency::Staging(_) | Residency::Dirty(_) | Residency::Clean { .. } => {
                    s.bytes_in_pool += e.nbytes
                }
                _ => {}
            }
        }
        if let Some(sw) = &self.inner.swap {
            let io = sw.stats();
            s.swap_in_use = io.swap_in_use;
            s.io_in_flight = io.in_flight;
        }
        s
    }

    /// Make the next `count` `get`s panic while they hold the tier's lock, to test that a panic
    /// becomes an error at the Python boundary and leaves the tier usable (Note [no panic
    /// across the boundary] in rust/py/errors.rs). `count = 0` disarms.
    pub fn inject_panic(&self, count: u32) {
        self.lock().panic_gets = count;
    }

    /// Finish every write and read in flight (their entries become clean). Raises the first
    /// error one of them hit.
    pub fn wait_idle(&self) -> Result<()> {
        let mut first = None;
        loop {
            let watch = {
                let st = self.lock();
                st.writing
                    .iter()
                    .chain(st.reading.iter())
                    .find_map(|id| st.entries.get(id).and_then(|e| e.res.watch()))
            };
            let Some(w) = watch else { break };
            w.wait_done();
            let mut st = self.lock();
            if let Err(e) = self.reap(&mut st) {
                first.get_or_insert(e);
            }
        }
        if let Some(sw) = &self.inner.swap {
            sw.wait_idle();
        }
        first.map_or(Ok(()), Err)
    }

    /// Move every entry that nothing views to disk only: write the unwritten ones, wait, drop
    /// their blocks. Returns the bytes that left the pool. For tests and for callers that
    /// want the pool empty (a host-only tier drops nothing).
    pub fn spill_all(&self) -> Result<u64> {
        if self.inner.swap.is_none() {
            return Ok(0);
        }
        {
            let mut st = self.lock();
            let ids: Vec<u64> = st.entries.keys().copied().collect();
            for id in ids {
                self.start_write(&mut st, id)?;
            }
        }
        self.wait_idle()?;
        let mut st = self.lock();
        let mut freed = 0;
        let ids: Vec<u64> = st.entries.keys().copied().collect();
        for id in ids {
            freed += Self::drop_clean_entry(&mut st, id);
        }
        Ok(freed)
    }

    // ---- transitions (caller holds the lock) ----

    /// Start writing `id` if it is unwritten and unshared. Returns whether a write started.
    fn start_write(&self, st: &mut State, id: u64) -> Result<bool> {
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
        let slot = swap.alloc(e.nbytes)?; // OutOfSpace: the step that hit it fails here
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
            e.checksum = Some(crc32c::crc32c(block.as_slice()));
        }
        let ticket = swap.write(block, &slot);
        e.res = Residency::Writing { ticket, slot };
        st.writing.push_back(id);
        Ok(true)
    }

    /// A finished write or read of `id` becomes clean (or, failed, unwritten / on disk again:
    /// Note [failed I/O]). No-op unless its request is done.
    fn finish_io(st: &mut State, id: u64) -> Result<()> {
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
                        e.res = Residency::Clean {
                            block: Arc::new(block),
                            slot,
                        };
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
    fn reap(&self, st: &mut State) -> Result<()> {
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
    fn drop_clean_entry(st: &mut State, id: u64) -> u64 {
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

    /// Note [write early, drop late] (policy.rs): drop the earliest packed clean entry nobody
    /// views. Returns whether a block went back to the pool.
    fn drop_one_clean(st: &mut State) -> bool {
        let victim = st.entries.iter().find_map(|(&id, e)| match &e.res {
            Residency::Clean { block, .. } if unshared(block) => Some(id),
            _ => None,
        });
        victim.is_some_and(|id| Self::drop_clean_entry(st, id) > 0)
    }

    /// Lease `nbytes`, making room by dropping clean entries, waiting for writes and reads in
    /// flight, and writing unwritten entries, earliest packed first. `Ok(None)`: nothing can
    /// be freed now (every block is staged or viewed).
    fn lease_making_room(&self, nbytes: u64, step: u64) -> Result<Option<Block>> {
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
                            Some(id) => {
                                self.start_write(&mut st, id)?;
                                continue;
                            }
                            None => return Ok(None),
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
    fn read_block(&self, nbytes: u64, step: u64) -> Result<Block> {
        if let Some(b) = self.lease_making_room(nbytes, step)? {
            return Ok(b);
        }
        let mut st = self.lock();
        if let Some(s) = st.steps.get_mut(&step) {
            s.stats.overflow_reads += 1;
        }
        drop(st);
        one_off(nbytes)?.lease(nbytes)
    }

    /// Write behind after a seal (Note [write early, drop late]).
    fn write_behind(&self, st: &mut State) -> Result<()> {
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

    /// Read ahead after an unpack of `seq` in `step` (policy::read_ahead).
    fn read_ahead(&self, st: &mut State, step: u64, seq: u32) {
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
                if let Some(c) = e.chunk {
                    if chunks.get(&c).is_some_and(|g| g.direct()) {
                        return Seen::Piece {
                            chunk: c,
                            startable: gathering.is_none()
                                && chunks.get(&c).is_some_and(|g| g.not_started()),
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
            policy::read_ahead(expected, window, seen, |q| forecast.is_learned(q))
        };
        for a in plan {
            match a {
                Ahead::Read(q) => {
                    let Some(&id) = st.steps.get(&step).and_then(|s| s.ids.get(q as usize)) else {
                        continue;
                    };
                    let Some(e) = st.entries.get_mut(&id) else {
                        continue;
                    };
                    // Note [plans are snapshots]: skip what is no longer only on disk.
                    if !matches!(e.res, Residency::Disk { .. }) {
                        continue;
                    }
                    let Ok(block) = self.inner.pool.lease(e.nbytes) else {
                        break; // read-ahead never evicts
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

    /// Count an unpack of entry `id` (hit: its bytes were in the pool in time). Its place in
    /// the learned order is its first unpack: several views of one storage unpack one entry
    /// several times, and an entry at two places of the order would be planned twice
    /// (Note [plans are snapshots]).
    fn used(st: &mut State, id: u64, hit: bool) {
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
    /// `record`, counted as an unpack and followed by read-ahead.
    fn get(&self, id: u64, record: bool) -> Result<View> {
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
                    Residency::Staging(_) => {
                        return Err(Error::Invalid(
                            "get() of an entry whose copy has not landed: seal() it first".into(),
                        ))
                    }
                    Residency::Dirty(b) | Residency::Clean { block: b, .. } => {
                        let b = b.clone();
                        self.check(e, id, b.as_slice())?;
                        let (s, q) = (e.step, e.seq);
                        if record {
                            Self::used(&mut st, id, hit);
                            st.add_stall(s, waited);
                            self.read_ahead(&mut st, s, q);
                        }
                        return Ok(View::of(&b));
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
                        let n = e.nbytes;
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

/// A one-off mapping of `nbytes`: not pre-faulted (the reads fault it in, as a fresh tensor
/// would be by its first write), not locked, not registered with io_uring (the engine uses
/// plain reads for it).
fn one_off(nbytes: u64) -> Result<Pool> {
    let cap = crate::extent::round_up(nbytes.max(1));
    let mut o = PoolOptions::new(cap);
    o.arena_bytes = cap;
    o.prefault = false;
    o.lock = false;
    o.huge_pages = false;
    Pool::new(&o)
}

impl State {
    pub(crate) fn new_chunk(&mut self, g: GatherState) -> u64 {
        let c = self.next_chunk;
        self.next_chunk += 1;
        self.chunks.insert(c, g);
        c
    }

    pub(crate) fn set_chunk(&mut self, id: u64, chunk: u64) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.chunk = Some(chunk);
        }
    }

    pub(crate) fn chunk_mut(&mut self, c: u64) -> Option<&mut GatherState> {
        self.chunks.get_mut(&c)
    }

    pub(crate) fn remove_chunk(&mut self, c: u64) -> Option<GatherState> {
        if self.gathering == Some(c) {
            self.gathering = None;
        }
        self.chunks.remove(&c)
    }

    pub(crate) fn set_gathering(&mut self, c: Option<u64>) {
        self.gathering = c;
    }

    pub(crate) fn gathering(&self) -> Option<u64> {
        self.gathering
    }

    /// Start reading `id` (on disk only) into `block` for a gather; returns the ticket, or
    /// gives the block back when the entry is not on disk only.
    pub(crate) fn read_piece(
        &mut self,
        swap: &Swap,
        id: u64,
        block: Block,
    ) -> std::result::Result<Ticket, Block> {
        match self.entries.get(&id) {
            Some(Entry {
                res: Residency::Disk { slot },
                ..
            }) => Ok(swap.read(slot, block)),
            _ => Err(block),
        }
    }

    pub(crate) fn piece_checksum(&self, id: u64) -> Option<u32> {
        self.entries.get(&id).and_then(|e| e.checksum)
    }

    pub(crate) fn note_used(&mut self, id: u64, hit: bool) {
        Tier::used(self, id, hit);
    }

    pub(crate) fn add_stall(&mut self, step: u64, secs: f64) {
        if let Some(s) = self.steps.get_mut(&step) {
            s.stats.stall_seconds += secs;
        }
    }
}
