//! The tiered tensor store: one owner for every offloaded block.
//!
//! A [`Tier`] owns the host pool, the swap engine (none for a host-only tier) and every entry.
//! [`Step::put`] leases a block (making room by dropping or writing out older entries) and
//! returns a [`Handle`] with a staging [`View`] to copy into; [`Handle::seal`] says the copy
//! has landed; [`Handle::get`] returns a view of the bytes, reading them back if they left the
//! pool, and reads ahead what backward is expected to need next; dropping the last clone of a
//! handle frees the entry wherever it is. [`Step::put_copy`] (`hostcopy.rs`) leases, copies
//! bytes the host already has and seals in one call (the CPU host link's pack).
//!
//! Beside the entries, [`Inflight`] (`inflight.rs`) is the pure ledger of device->host copies
//! in flight that the link's policy keeps its accounting and its back-pressure victims in
//! (Note [the ledger of copies in flight]): the tier owns the bytes, their residency, and what
//! is still on its way to them.
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
//!
//! # Note [unpack before the seal]
//! An entry is sealed when the host sees its device-to-host copy land (the link's poll), which
//! on a GPU may be well after backward asks for it: the copy can still be running (the compute
//! stream was only made to wait for it, Note [back-pressure] in rust/link), or it landed since
//! the last poll. A device copy back needs no seal: the link orders it after the D2H copy's
//! event, on the device. So `get_for_device` hands the staging view of such an entry (counted
//! as a hit: its bytes never left the pool), and only the host's own reads require the seal.
//! The H200's first run crashed here ("get() of an entry whose copy has not landed"); the
//! simulated device reaches it since its lagging compute stream stopped holding the host for a
//! wait on a D2H copy (Note [the simulated device]).

mod direct;
mod gather;
mod handle;
mod hostcopy;
mod inflight;
pub mod policy;
mod room;
mod state;
mod stats;
mod transitions;
mod unpack;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::Result;
use crate::io::Swap;
use crate::pool::Pool;

pub use gather::Gathered;
pub(crate) use handle::view_of_blocks;
pub use handle::{Handle, Step, View};
pub use inflight::{Inflight, Issued};
use policy::{Forecast, Learned};
use room::one_off;
use state::{Entry, Residency, State, StepState};
pub use stats::{StepStats, TierOptions, TierStats, DEFAULT_PREFETCH_CAP};

pub(crate) struct Inner {
    pool: Pool,
    swap: Option<Arc<Swap>>,
    opts: TierOptions,
    state: Mutex<State>,
    /// The images of the storage being written from its tensor (its pieces so far) and of the
    /// largest one so far (Note [written from the tensor], Memory): atomics, so that a pack
    /// that copies takes no lock for them.
    direct_run: AtomicU64,
    direct_largest: AtomicU64,
    /// Note [writes wait for growth] (room.rs): a put that finds the pool full fails rather
    /// than write out, while the caller can still grow the pool.
    defer_writes: AtomicBool,
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
                    gathered_out: Vec::new(),
                    panic_gets: 0,
                }),
                direct_run: AtomicU64::new(0),
                direct_largest: AtomicU64::new(0),
                defer_writes: AtomicBool::new(false),
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

    /// Note [writes wait for growth] (room.rs): while `on`, a put that finds the pool full
    /// (nothing clean to drop, nothing in flight to wait for) fails with
    /// [`Error::PoolExhausted`] instead of writing unwritten entries out; reads back still
    /// make room as before.
    pub fn set_defer_writes(&self, on: bool) {
        self.inner.defer_writes.store(on, Relaxed);
    }

    pub fn defers_writes(&self) -> bool {
        self.inner.defer_writes.load(Relaxed)
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
}
