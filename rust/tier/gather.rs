//! Storages offloaded in pieces, returned as one buffer.
//!
//! # Note [gathered storages]
//! On the NVMe tier a storage larger than half the pool is offloaded in pieces (entries of
//! their own, written out, read back and prefetched like any other), so that one tensor larger
//! than the whole pool still leaves the device. [`Gathered::get`] returns the whole storage as
//! one buffer of its own (a one-off mapping): pieces only on disk are read straight into it,
//! pieces still in the pool are copied. Pieces written from the tensor (Note [written from the
//! tensor] in direct.rs) are images of whole pages, cut so that every piece after the first
//! starts on one: the buffer holds the images back to back and the storage starts the first
//! piece's `head` bytes in. Those reads start once what backward is expected to
//! need before the storage (the learned order, Note [expected order]) holds no more bytes than
//! it does (Note [gather distance] in policy.rs), so the backward before it overlaps the
//! reads without holding its bytes through a whole region's backward. One storage is read
//! ahead at a time, and only once no gathered buffer handed out is still held by a view: the
//! explicit CPU GPT's next 128 MiB attention probabilities, read ahead straight into their
//! buffer as soon as the current ones were taken, were resident through the current ones'
//! softmax backward, the step's peak (`plain-offload` on a 32 MiB pool: 634 MiB against 518
//! through the pool, `recompute_bench.py` auto). A direct read leaves its piece's entry on
//! disk; the request holds a clone of the slot, so freeing the entry meanwhile cannot hand
//! those bytes to another write (Note [slot lifetime]).

use std::time::Instant;

use super::{one_off, view_of_blocks, Handle, State, Step, Tier, View};
use crate::error::{Error, Result};
use crate::io::Ticket;
use crate::pool::{Block, Pool};

/// A gathered storage (Note [gathered storages]); holds its pieces' handles.
pub struct Gathered {
    tier: Tier,
    chunk: u64,
    step: u64,
    parts: Vec<Handle>,
    nbytes: u64,
}

pub(crate) struct GatherState {
    /// Each piece's entry, bytes and offset into its first page (Note [written from the
    /// tensor] in direct.rs).
    parts: Vec<Part>,
    /// The whole storage's bytes (read at every read-ahead that sees one of its pieces).
    nbytes: u64,
    ahead: Ahead,
}

#[derive(Debug, Clone, Copy)]
struct Part {
    id: u64,
    nbytes: u64,
    head: u64,
}

enum Ahead {
    NotStarted,
    /// A `get` is assembling it now.
    InUse,
    /// The one-off buffer could not be cut into contiguous pieces: pieces go through the pool.
    Unusable,
    Started(Direct),
}

struct Direct {
    bufs: Vec<Buf>,
    parts: Vec<Part>,
    // Keeps the mapping's allocator alive with its blocks (the blocks hold the arena anyway).
    _pool: Pool,
}

enum Buf {
    /// Part of the buffer, to be filled by a copy from the piece's entry.
    Free(Block),
    /// A read from the piece's slot into this part is in flight.
    Reading(Ticket),
}

impl GatherState {
    /// Whether its pieces are read into a buffer of its own (not through the pool).
    pub(crate) fn direct(&self) -> bool {
        !matches!(self.ahead, Ahead::Unusable)
    }

    pub(crate) fn not_started(&self) -> bool {
        matches!(self.ahead, Ahead::NotStarted)
    }

    /// The whole storage's bytes.
    pub(crate) fn nbytes(&self) -> u64 {
        self.nbytes
    }
}

pub(crate) fn new(step: &Step, parts: Vec<Handle>) -> Result<Gathered> {
    if parts.is_empty() {
        return Err(Error::Invalid("gather() needs at least one piece".into()));
    }
    let tier = step.tier().clone();
    let nbytes = parts.iter().map(|h| h.nbytes()).sum();
    let mut st = tier.lock();
    for h in &parts {
        if !std::sync::Arc::ptr_eq(&h.inner.tier.inner, &tier.inner) {
            return Err(Error::Invalid(
                "gather() of a piece that belongs to another tier".into(),
            ));
        }
    }
    let layout = parts
        .iter()
        .map(|h| Part {
            id: h.id(),
            nbytes: h.nbytes(),
            head: st.entries.get(&h.id()).map_or(0, |e| e.head),
        })
        .collect();
    let chunk = st.new_chunk(GatherState {
        parts: layout,
        nbytes,
        ahead: Ahead::NotStarted,
    });
    for h in &parts {
        st.set_chunk(h.id(), chunk);
    }
    drop(st);
    Ok(Gathered {
        tier,
        chunk,
        step: step.id(),
        parts,
        nbytes,
    })
}

/// The buffer, cut into one block per piece (each the image of its piece: its bytes `head`
/// bytes in), the pieces' bytes back to back; None when they do not lie back to back (the
/// allocator placed the blocks apart, or a piece after the first does not start on a page).
fn direct_buffer(parts: &[Part]) -> Result<Option<(Pool, Vec<Block>)>> {
    let total: u64 = parts
        .iter()
        .map(|p| crate::extent::round_up(p.head + p.nbytes))
        .sum();
    let pool = one_off(total)?;
    let mut blocks = Vec::with_capacity(parts.len());
    let mut next = None;
    for p in parts {
        let b = pool.lease(p.head + p.nbytes)?;
        let at = b.as_ptr() as usize + p.head as usize;
        if next.is_some_and(|n| n != at) {
            return Ok(None);
        }
        next = Some(at + p.nbytes as usize);
        blocks.push(b);
    }
    Ok(Some((pool, blocks)))
}

/// Start the reads of chunk `c`'s pieces that are only on disk. Caller holds the lock.
fn begin(tier: &Tier, st: &mut State, c: u64) -> Result<Option<Direct>> {
    let Some(g) = st.chunk_mut(c) else {
        return Ok(None);
    };
    let parts = g.parts.clone();
    let Some((pool, blocks)) = direct_buffer(&parts)? else {
        if let Some(g) = st.chunk_mut(c) {
            g.ahead = Ahead::Unusable;
        }
        return Ok(None);
    };
    let swap = tier.swap().cloned();
    let mut bufs = Vec::with_capacity(blocks.len());
    for (p, b) in parts.iter().zip(blocks) {
        let buf = match &swap {
            Some(sw) => match st.read_piece(sw, p.id, b) {
                Ok(t) => Buf::Reading(t),
                Err(b) => Buf::Free(b),
            },
            None => Buf::Free(b),
        };
        bufs.push(buf);
    }
    Ok(Some(Direct {
        bufs,
        parts,
        _pool: pool,
    }))
}

/// Read chunk `c` ahead of its use (policy::Ahead::Gather). Caller holds the lock. A failure
/// here is left for `get`, which tries again and raises it.
pub(crate) fn start(tier: &Tier, st: &mut State, c: u64) {
    if st.gathering().is_some() || !st.chunk_mut(c).is_some_and(|g| g.not_started()) {
        return;
    }
    let assembling = st.chunks.values().any(|g| matches!(g.ahead, Ahead::InUse));
    if assembling || st.gathered_alive() {
        return; // one gathered buffer at a time (Note [gathered storages])
    }
    if let Ok(Some(d)) = begin(tier, st, c) {
        if let Some(g) = st.chunk_mut(c) {
            g.ahead = Ahead::Started(d);
            st.set_gathering(Some(c));
        }
    }
}

impl Gathered {
    pub fn nbytes(&self) -> u64 {
        self.nbytes
    }

    pub fn parts(&self) -> &[Handle] {
        &self.parts
    }

    /// Count an unpack of every piece that did not need the bytes from the tier (see
    /// [`Handle::note_used`]).
    pub fn note_used(&self) {
        for h in self.parts.iter().rev() {
            h.note_used();
        }
    }

    /// Whether its reads were started ahead of `get` and not yet consumed.
    pub fn started(&self) -> bool {
        let st = self.tier.lock();
        st.chunks
            .get(&self.chunk)
            .is_some_and(|g| matches!(g.ahead, Ahead::Started(_)))
    }

    /// The whole storage as one buffer (last piece first, the order backward reads them on a
    /// first step). Each piece counts as an unpack. Raises the swap's errors and, verifying,
    /// [`Error::Integrity`]. A second `get` (retain_graph) reads again.
    pub fn get(&self) -> Result<View> {
        let direct = {
            let mut st = self.tier.lock();
            let Some(g) = st.chunk_mut(self.chunk) else {
                return Err(Error::Invalid("this gathered storage was freed".into()));
            };
            let taken = match std::mem::replace(&mut g.ahead, Ahead::InUse) {
                Ahead::Started(d) => Some(d),
                Ahead::Unusable => {
                    g.ahead = Ahead::Unusable;
                    None
                }
                Ahead::NotStarted | Ahead::InUse => begin(&self.tier, &mut st, self.chunk)?,
            };
            if st.gathering() == Some(self.chunk) {
                st.set_gathering(None);
            }
            taken
        };
        let out = match direct {
            Some(d) => self.assemble(d),
            None => self.through_pool(),
        };
        let mut st = self.tier.lock();
        if let Some(w) = out.as_ref().ok().and_then(View::gathered) {
            st.gathered_alive(); // drop the dead first: a step gathers many, one at a time
            st.gathered_out.push(w);
        }
        if let Some(g) = st.chunk_mut(self.chunk) {
            if matches!(g.ahead, Ahead::InUse) {
                g.ahead = Ahead::NotStarted;
            }
        }
        out
    }

    fn assemble(&self, d: Direct) -> Result<View> {
        let Direct { bufs, parts, _pool } = d;
        let mut blocks: Vec<Option<Block>> = Vec::with_capacity(bufs.len());
        let mut pending: Vec<Option<Buf>> = bufs.into_iter().map(Some).collect();
        blocks.resize_with(pending.len(), || None);
        for i in (0..pending.len()).rev() {
            let h = &self.parts[i];
            let Some(&Part { nbytes, head, .. }) = parts.get(i) else {
                return Err(Error::Internal(format!(
                    "piece {i} of a gather has no layout"
                )));
            };
            let (head, nbytes) = (head as usize, nbytes as usize);
            let Some(buf) = pending[i].take() else {
                return Err(Error::Internal(format!(
                    "piece {i} of a gather taken twice"
                )));
            };
            let block = match buf {
                Buf::Reading(t) => {
                    let hit = t.is_done();
                    let t0 = Instant::now();
                    let (block, r) = t.wait();
                    let waited = t0.elapsed().as_secs_f64();
                    let mut st = self.tier.lock();
                    st.add_stall(self.step, waited);
                    r?;
                    if let Some(expected) = st.piece_checksum(h.id()) {
                        let found = crc32c::crc32c(block.bytes(head, nbytes));
                        if found != expected {
                            return Err(Error::Integrity {
                                key: h.id(),
                                expected,
                                found,
                            });
                        }
                    }
                    st.note_used(h.id(), hit);
                    block
                }
                Buf::Free(block) => {
                    let v = self.tier.get(h.id(), true, false)?;
                    // SAFETY: `v` keeps its bytes alive and unwritten for the call; `block` is
                    // this gather's own, so the ranges do not overlap.
                    unsafe { block.copy_from_raw(v.as_ptr(), v.len(), head)? };
                    block
                }
            };
            blocks[i] = Some(block);
        }
        let Some(blocks) = blocks.into_iter().collect::<Option<Vec<Block>>>() else {
            return Err(Error::Internal("a gathered piece was never filled".into()));
        };
        let head = parts.first().map_or(0, |p| p.head as usize);
        Ok(view_of_blocks(blocks, head, self.nbytes as usize))
    }

    fn through_pool(&self) -> Result<View> {
        let pool = one_off(self.nbytes)?;
        let out = pool.lease(self.nbytes)?;
        let mut off = self.nbytes as usize;
        for h in self.parts.iter().rev() {
            let v = self.tier.get(h.id(), true, false)?;
            off -= v.len();
            // SAFETY: `v` keeps its bytes alive for the call; `out` is this gather's own.
            unsafe { out.copy_from_raw(v.as_ptr(), v.len(), off)? };
        }
        Ok(view_of_blocks(vec![out], 0, self.nbytes as usize))
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        // Reads in flight keep their blocks parked in the engine until they complete.
        let gone = self.tier.lock().remove_chunk(self.chunk);
        drop(gone);
    }
}
