//! What the tier's lock guards ([`State`]): every entry and its residency (Note [residency]),
//! the unwritten and in-flight queues, each live step's state, and the gathered storages.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use super::gather::GatherState;
use super::policy::{Forecast, Learned};
use super::stats::StepStats;
use super::{Tier, View};
use crate::io::{Slot, Swap, Ticket, Watch};
use crate::pool::Block;

/// Where an entry's bytes are (Note [residency]).
pub(super) enum Residency {
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
    pub(super) fn name(&self) -> &'static str {
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

    pub(super) fn watch(&self) -> Option<Watch> {
        match self {
            Residency::Writing { ticket, .. } | Residency::Reading { ticket, .. } => {
                Some(ticket.watch())
            }
            _ => None,
        }
    }
}

pub(super) struct Entry {
    pub(super) nbytes: u64,
    pub(super) step: u64,
    pub(super) seq: u32,
    pub(super) res: Residency,
    pub(super) checksum: Option<u32>,
    pub(super) went_to_disk: bool,
    /// Unpacked in the current backward (its bytes no longer count against the window).
    pub(super) viewed: bool,
    /// The gathered storage this entry is a piece of.
    pub(super) chunk: Option<u64>,
    /// Where the entry's bytes start in its block and in its slot: 0, except for an entry
    /// written from the tensor (Note [written from the tensor] in direct.rs), whose block and
    /// slot are the image of the whole pages its bytes lie in.
    pub(super) head: u64,
}

impl Entry {
    /// Bytes its block and its slot hold: the entry's, after `head` bytes of its first page.
    pub(super) fn image(&self) -> u64 {
        self.head + self.nbytes
    }

    /// A view of the entry's bytes in `b` (its block).
    pub(super) fn view(&self, b: &Arc<Block>) -> View {
        View::at(b, self.head as usize, self.nbytes as usize)
    }

    /// The entry's bytes in `b` (its block).
    pub(super) fn bytes<'a>(&self, b: &'a Block) -> &'a [u8] {
        b.bytes(self.head as usize, self.nbytes as usize)
    }
}

/// Whether only the entry sees its block (Note [views hold blocks]).
pub(super) fn unshared(b: &Arc<Block>) -> bool {
    Arc::strong_count(b) == 1
}

pub(super) struct StepState {
    /// This step's unpack order (taught to the next step) and sizes in pack order.
    pub(super) order: Vec<u32>,
    pub(super) sizes: Vec<u64>,
    pub(super) ids: Vec<u64>,
    pub(super) forecast: Forecast,
    pub(super) stats: StepStats,
}

pub(crate) struct State {
    pub(super) entries: BTreeMap<u64, Entry>,
    pub(super) next_id: u64,
    /// Sealed entries not yet written, in pack order, with their bytes.
    pub(super) dirty: VecDeque<(u64, u64)>,
    pub(super) dirty_bytes: u64,
    /// Entries with a write in flight (oldest first) and with a read in flight.
    pub(super) writing: VecDeque<u64>,
    pub(super) reading: Vec<u64>,
    pub(super) steps: HashMap<u64, StepState>,
    pub(super) next_step: u64,
    pub(super) last_step: Option<u64>,
    /// What the most recent step taught, kept when that step ended.
    pub(super) last_learned: Option<Learned>,
    pub(super) chunks: HashMap<u64, GatherState>,
    pub(super) next_chunk: u64,
    /// The gathered storage being read ahead of its use (at most one).
    pub(super) gathering: Option<u64>,
    /// The buffers of gathered storages handed out (Note [gathered storages]: one at a time).
    pub(super) gathered_out: Vec<std::sync::Weak<Vec<crate::pool::Block>>>,
    /// `get`s left to panic ([`Tier::inject_panic`]).
    pub(super) panic_gets: u32,
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

    /// Whether a gathered storage's buffer is still held by a view.
    pub(crate) fn gathered_alive(&mut self) -> bool {
        self.gathered_out.retain(|w| w.strong_count() > 0);
        !self.gathered_out.is_empty()
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

    /// Bytes of the writes in flight (images, Note [written from the tensor] in direct.rs).
    pub(super) fn bytes_writing(&self) -> u64 {
        self.writing
            .iter()
            .filter_map(|id| self.entries.get(id))
            .map(|e| e.image())
            .sum()
    }

    pub(crate) fn add_stall(&mut self, step: u64, secs: f64) {
        if let Some(s) = self.steps.get_mut(&step) {
            s.stats.stall_seconds += secs;
        }
    }
}
