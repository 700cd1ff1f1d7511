//! Storages offloaded in pieces, returned as one buffer.
//!
//! # Note [gathered storages]
//! On the NVMe tier a storage larger than half the pool is offloaded in pieces (entries of
//! their own, written out, read back and prefetched like any other), so that one tensor larger
//! than the whole pool still leaves the device. [`Gathered::get`] returns the whole storage as
//! one buffer of its own (a one-off mapping): pieces only on disk are read straight into it,
//! pieces still in the pool are copied. Those reads start once what backward is expected to
//! need before the storage (the learned order, Note [expected order]) holds no more bytes than
//! it does (Note [gather distance] in policy.rs), so the backward before it overlaps the
//! reads without holding its bytes through a whole region's backward. One storage is read
//! ahead at a time. A direct read leaves its piece's entry on disk; the request
//! holds a clone of the slot, so freeing the entry meanwhile cannot hand those bytes to another
//! write (Note [slot lifetime]).

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
    parts: Vec<(u64, u64)>,
    /// The whole storage's bytes (read at every read-ahead that sees one of its pieces).
    nbytes: u64,
    ahead: Ahead,
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
    let chunk = st.new_chunk(GatherState {
        parts: parts.iter().map(|h| (h.id(), h.nbytes())).collect(),
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

/// The buffer, cut into one block per piece, contiguous; None when the allocator did not
/// place them back to back.
fn direct_buffer(parts: &[(u64, u64)]) -> Result<Option<(Pool, Vec<Block>)>> {
    let total: u64 = parts.iter().map(|&(_, n)| crate::extent::round_up(n)).sum();
    let pool = one_off(total)?;
    let mut blocks = Vec::with_capacity(parts.len());
    let mut next = None;
    for &(_, n) in parts {
        let b = pool.lease(n)?;
        if next.is_some_and(|p| p != b.as_ptr() as usize) {
            return Ok(None);
        }
        next = Some(b.as_ptr() as usize + b.capacity());
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
    for (&(id, _), b) in parts.iter().zip(blocks) {
        let buf = match &swap {
            Some(sw) => match st.read_piece(sw, id, b) {
                Ok(t) => Buf::Reading(t),
                Err(b) => Buf::Free(b),
            },
            None => Buf::Free(b),
        };
        bufs.push(buf);
    }
    Ok(Some(Direct { bufs, _pool: pool }))
}

/// Read chunk `c` ahead of its use (policy::Ahead::Gather). Caller holds the lock. A failure
/// here is left for `get`, which tries again and raises it.
pub(crate) fn start(tier: &Tier, st: &mut State, c: u64) {
    if st.gathering().is_some() || !st.chunk_mut(c).is_some_and(|g| g.not_started()) {
        return;
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
        if let Some(g) = st.chunk_mut(self.chunk) {
            if matches!(g.ahead, Ahead::InUse) {
                g.ahead = Ahead::NotStarted;
            }
        }
        out
    }

    fn assemble(&self, d: Direct) -> Result<View> {
        let Direct { bufs, _pool } = d;
        let mut blocks: Vec<Option<Block>> = Vec::with_capacity(bufs.len());
        let mut pending: Vec<Option<Buf>> = bufs.into_iter().map(Some).collect();
        blocks.resize_with(pending.len(), || None);
        for i in (0..pending.len()).rev() {
            let h = &self.parts[i];
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
                        let found = crc32c::crc32c(block.as_slice());
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
                    let v = self.tier.get(h.id(), true)?;
                    // SAFETY: `v` keeps its bytes alive and unwritten for the call; `block` is
                    // this gather's own, so the ranges do not overlap.
                    unsafe { block.copy_from_raw(v.as_ptr(), v.len(), 0)? };
                    block
                }
            };
            blocks[i] = Some(block);
        }
        let Some(blocks) = blocks.into_iter().collect::<Option<Vec<Block>>>() else {
            return Err(Error::Internal("a gathered piece was never filled".into()));
        };
        Ok(view_of_blocks(blocks, self.nbytes as usize))
    }

    fn through_pool(&self) -> Result<View> {
        let pool = one_off(self.nbytes)?;
        let out = pool.lease(self.nbytes)?;
        let mut off = self.nbytes as usize;
        for h in self.parts.iter().rev() {
            let v = self.tier.get(h.id(), true)?;
            off -= v.len();
            // SAFETY: `v` keeps its bytes alive for the call; `out` is this gather's own.
            unsafe { out.copy_from_raw(v.as_ptr(), v.len(), off)? };
        }
        Ok(view_of_blocks(vec![out], self.nbytes as usize))
    }
}

impl Drop for Gathered {
    fn drop(&mut self) {
        // Reads in flight keep their blocks parked in the engine until they complete.
        let gone = self.tier.lock().remove_chunk(self.chunk);
        drop(gone);
    }
}
