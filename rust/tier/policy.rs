//! The tier's decisions as plain functions over numbers: which entries backward is expected to
//! need next, which to read ahead, which to write behind. No locks, no I/O; the tier applies
//! them (`super`), and `tests/tier.rs` property-tests both.
//!
//! # Note [expected order]
//! Backward unpacks in roughly reverse pack order, but not exactly (recomputed regions unpack
//! in their own order, several views share one entry). So the order in which the previous step
//! unpacked is learned and used as the forecast for the next step, as long as that step packed
//! the same sizes in the same order (a step that packs other tensors -- the model or its plan
//! changed -- would read the wrong entries ahead). Without a learned order the forecast is
//! reverse pack order.
//!
//! # Note [write early, drop late]
//! Writing out only when the pool is full made forward wait for the disk whenever a large
//! tensor arrived (a 128 MiB softmax output through a 64 MiB pool: 0.18-0.20 s a step on the
//! GPT benchmark), while the disk sat idle for most of forward. So entries are written behind,
//! earliest packed first, as soon as unwritten bytes pass a share of the pool, and a written
//! entry keeps its block ("clean"): dropping it when room is needed costs nothing, and if it is
//! never dropped (the last layers' tensors) backward finds it in the pool.

use std::collections::{HashMap, HashSet, VecDeque};

/// The learned order of one step: the sequence numbers it unpacked, in order, and the sizes of
/// the entries it packed, in pack order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Learned {
    pub order: Vec<u32>,
    pub sizes: Vec<u64>,
}

/// Forecast of the unpack order of one step (Note [expected order]).
#[derive(Debug, Default)]
pub struct Forecast {
    learned: Option<Learned>,
    pos: HashMap<u32, usize>,
    /// Bytes the learned order unpacks before each of its places.
    before: Vec<u64>,
    checked: bool,
}

impl Forecast {
    pub fn new(learned: Option<Learned>) -> Forecast {
        // Each entry once, at its first place (Note [plans are snapshots] in the tier).
        let learned = learned
            .map(|mut l| {
                let mut once = HashSet::new();
                l.order.retain(|&s| once.insert(s));
                l
            })
            .filter(|l| !l.order.is_empty());
        let pos = learned
            .as_ref()
            .map(|l| l.order.iter().enumerate().map(|(i, &s)| (s, i)).collect())
            .unwrap_or_default();
        let before = learned
            .as_ref()
            .map(|l| {
                let mut at = 0u64;
                l.order
                    .iter()
                    .map(|&q| {
                        let b = at;
                        at = at.saturating_add(l.sizes.get(q as usize).copied().unwrap_or(0));
                        b
                    })
                    .collect()
            })
            .unwrap_or_default();
        Forecast {
            learned,
            pos,
            before,
            checked: false,
        }
    }

    /// Whether backward is expected to unpack `seq` (of `nbytes`) among its first `budget`
    /// bytes, by the learned order (Note [written from the tensor], tier/direct.rs). False
    /// without one, and for an entry of another size than the step that taught it packed.
    pub fn needed_within(&self, seq: u32, nbytes: u64, budget: u64) -> bool {
        let (Some(l), Some(&p)) = (&self.learned, self.pos.get(&seq)) else {
            return false;
        };
        l.sizes.get(seq as usize) == Some(&nbytes)
            && self.before[p].saturating_add(nbytes) <= budget
    }

    /// Forget the learned order when this step packed other sizes than the step that taught
    /// it. Checked once, when backward starts (`sizes` is complete by then).
    pub fn check(&mut self, sizes: &[u64]) {
        if self.checked {
            return;
        }
        self.checked = true;
        if self.learned.as_ref().is_some_and(|l| l.sizes != sizes) {
            self.learned = None;
            self.pos.clear();
        }
    }

    /// Whether `seq` has a place in a learned order (the forecast is not a guess).
    pub fn is_learned(&self, seq: u32) -> bool {
        self.pos.contains_key(&seq)
    }

    /// The entries expected after `seq`, next first. `sizes`: this step's sizes in pack order.
    pub fn after(&mut self, seq: u32, sizes: &[u64]) -> Expected<'_> {
        self.check(sizes);
        self.expected(seq, sizes.len())
    }

    /// As [`Forecast::after`], once [`Forecast::check`] has run; `packed`: entries this step
    /// packed. Borrows the forecast only to read it.
    pub fn expected(&self, seq: u32, packed: usize) -> Expected<'_> {
        match (&self.learned, self.pos.get(&seq)) {
            (Some(l), Some(&p)) => Expected::Learned(l.order[p + 1..].iter()),
            _ => Expected::Reverse(seq.min(packed as u32)),
        }
    }
}

/// Iterator over the forecast (see [`Forecast::after`]).
pub enum Expected<'a> {
    Learned(std::slice::Iter<'a, u32>),
    /// Reverse pack order below this sequence number.
    Reverse(u32),
}

impl Iterator for Expected<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        match self {
            Expected::Learned(it) => it.next().copied(),
            Expected::Reverse(0) => None,
            Expected::Reverse(n) => {
                *n -= 1;
                Some(*n)
            }
        }
    }
}

/// What the read-ahead sees of an entry the forecast names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Seen {
    /// Freed, or not an entry of this step.
    Absent,
    /// In the pool, already unpacked once in this backward: not counted against the window.
    Used,
    /// In the pool and not yet unpacked, or a write or read in flight: its bytes count.
    Resident(u64),
    /// Only on disk: a read is wanted.
    OnDisk(u64),
    /// A piece of a gathered storage of `nbytes` in all (Note [gathered storages]):
    /// `startable` when its direct read may start now; otherwise skipped.
    Piece {
        chunk: u64,
        startable: bool,
        nbytes: u64,
    },
}

/// What to do ahead of backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ahead {
    Read(u32),
    Gather(u64),
}

/// How far past the read-ahead window the forecast is scanned for a gathered storage to start
/// (Note [gather distance]): bytes of other entries, and entries.
pub const GATHER_REACH_BYTES: u64 = 256 << 20;
pub const GATHER_REACH_ENTRIES: usize = 512;

/// Read ahead along `expected` until `window` bytes are resident or in flight (Note [expected
/// order]). A gathered storage starts once the entries expected before it hold no more bytes
/// than it does, and its place is learned (`learned(seq)`); at most one starts (Note [gather
/// distance]). The caller stops at the first read it has no room for.
///
/// # Note [gather distance]
/// A gathered storage is read straight into a buffer of its own, not the pool, so the
/// read-ahead window (a share of the pool) does not bound it: its bytes are held from the
/// start of its read. Started only when it was next (nothing else before it), its read was
/// exposed almost whole: on the CPU GPT (6x512, seq 1024, batch 4, explicit attention, 64 MiB
/// pool) the six 128 MiB attention probabilities waited 0.61-0.74 s of a 4.6 s backward,
/// 100-125 ms each, because the op before them (the output projection's backward, ~20 ms)
/// is short. Started once what is expected before it is no larger than itself, the read gets
/// about as much backward as its own size takes to consume (the backward of the block's MLP
/// there), and it holds its buffer early by at most that: in a backward whose peak is the
/// storage's own consumer (a softmax's backward beside its gradients) the step's peak does
/// not move. Still one at a time, and only where the order is learned.
pub fn read_ahead(
    expected: impl Iterator<Item = u32>,
    window: u64,
    may_gather: bool,
    mut seen: impl FnMut(u32) -> Seen,
    learned: impl Fn(u32) -> bool,
) -> Vec<Ahead> {
    let mut out = Vec::new();
    let mut ahead = 0u64;
    // with no gathered storage that may start, the scan ends at the window
    let mut gathered = !may_gather;
    let mut once = HashSet::new();
    for (i, seq) in expected.enumerate() {
        // Past the window only a gathered storage is looked for (Note [gather distance]).
        if ahead >= window && (gathered || ahead > GATHER_REACH_BYTES || i >= GATHER_REACH_ENTRIES)
        {
            break;
        }
        if !once.insert(seq) {
            continue; // an entry is planned once, however often the forecast names it
        }
        match seen(seq) {
            Seen::Absent | Seen::Used => {}
            Seen::Resident(n) => ahead += n,
            Seen::OnDisk(n) => {
                if ahead < window {
                    out.push(Ahead::Read(seq));
                }
                ahead += n;
            }
            Seen::Piece {
                chunk,
                startable,
                nbytes,
            } => {
                if startable && ahead <= nbytes && !gathered && learned(seq) {
                    out.push(Ahead::Gather(chunk));
                    gathered = true;
                }
            }
        }
    }
    out
}

/// What write-behind sees of the oldest unwritten entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unwritten {
    /// Freed, or written since it was queued: drop it from the queue.
    Gone,
    /// A live view or a copy still uses its block: wait for the next call.
    Busy,
    Ready,
}

/// Note [write early, drop late]: the entries to start writing now, oldest first, so that no
/// more than `max_dirty` bytes stay unwritten. `queue` holds (id, bytes) in pack order and
/// `dirty` their sum; both are updated.
pub fn write_behind(
    queue: &mut VecDeque<(u64, u64)>,
    dirty: &mut u64,
    max_dirty: u64,
    mut state: impl FnMut(u64) -> Unwritten,
) -> Vec<u64> {
    let mut out = Vec::new();
    while *dirty > max_dirty {
        let Some(&(id, n)) = queue.front() else { break };
        match state(id) {
            Unwritten::Busy => break,
            Unwritten::Ready => out.push(id),
            Unwritten::Gone => {}
        }
        queue.pop_front();
        *dirty -= n;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reverse_pack_order_without_learning() {
        let mut f = Forecast::new(None);
        assert_eq!(f.after(3, &[1, 1, 1, 1]).collect::<Vec<_>>(), vec![2, 1, 0]);
        assert!(!f.is_learned(3));
    }

    #[test]
    fn learned_order_is_dropped_when_sizes_differ() {
        let l = Learned {
            order: vec![0, 2, 1],
            sizes: vec![1, 2, 3],
        };
        let mut f = Forecast::new(Some(l.clone()));
        assert_eq!(f.after(0, &[1, 2, 3]).collect::<Vec<_>>(), vec![2, 1]);
        let mut g = Forecast::new(Some(l));
        assert_eq!(g.after(2, &[1, 2, 4]).collect::<Vec<_>>(), vec![1, 0]);
    }

    fn piece(chunk: u64, nbytes: u64) -> Seen {
        Seen::Piece {
            chunk,
            startable: true,
            nbytes,
        }
    }

    #[test]
    fn read_ahead_stops_at_the_window_and_gathers_once() {
        let plan = read_ahead(
            [5u32, 4, 3, 2, 1].into_iter(),
            10,
            true,
            |s| match s {
                5 | 4 => piece(9, 20),
                _ => Seen::OnDisk(6),
            },
            |_| true,
        );
        assert_eq!(plan, vec![Ahead::Gather(9), Ahead::Read(3), Ahead::Read(2)]);
    }

    #[test]
    fn a_gathered_storage_starts_within_its_own_size_past_the_window() {
        // Note [gather distance]: 12 bytes expected before a 16-byte gathered storage (past a
        // 10-byte window): it starts; reads stop at the window.
        let seen = |s: u32| match s {
            9 | 8 => piece(7, 16),
            _ => Seen::OnDisk(6),
        };
        let order = [3u32, 2, 9, 8, 1];
        let plan = read_ahead(order.into_iter(), 10, true, seen, |_| true);
        assert_eq!(plan, vec![Ahead::Read(3), Ahead::Read(2), Ahead::Gather(7)]);
        // more than its size before it: not yet
        let far = [3u32, 2, 4, 9, 8];
        let plan = read_ahead(far.into_iter(), 10, true, seen, |_| true);
        assert_eq!(plan, vec![Ahead::Read(3), Ahead::Read(2)]);
        // one at a time: the second gathered storage waits for the first
        let two = |s: u32| match s {
            9 => piece(7, 16),
            8 => piece(8, 16),
            _ => Seen::OnDisk(6),
        };
        let plan = read_ahead([9u32, 8].into_iter(), 10, true, two, |_| true);
        assert_eq!(plan, vec![Ahead::Gather(7)]);
        // not where the order is a guess
        let plan = read_ahead(order.into_iter(), 10, true, seen, |s| s != 9 && s != 8);
        assert_eq!(plan, vec![Ahead::Read(3), Ahead::Read(2)]);
    }
}
