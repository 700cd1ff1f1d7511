//! The tier's handles: [`Step`] (one forward and its backward), [`Handle`] (an entry) and
//! [`View`] (bytes that stay where they are while it lives). The transitions they drive live
//! in `transitions.rs`, `room.rs` and `unpack.rs` (Note [residency] in `mod.rs`).

use std::sync::Arc;

use super::gather::{self, Gathered};
use super::policy::Learned;
use super::{Entry, Residency, State, StepStats, Tier};
use crate::error::{Error, Result};
use crate::pool::Block;

/// A view of an entry's bytes (or of a gathered storage): keeps them where they are while it
/// lives (Note [views hold blocks]). A clone holds them too.
#[derive(Clone)]
pub struct View {
    keep: Keep,
    ptr: *mut u8,
    len: usize,
}

// Held only to keep the bytes alive and out of the kernel's hands; never read.
#[allow(dead_code)]
#[derive(Clone)]
enum Keep {
    Block(Arc<Block>),
    Gathered(Arc<Vec<Block>>),
}

// SAFETY: a view only carries a pointer into memory its `keep` owns; the blocks are Send + Sync.
unsafe impl Send for View {}
// SAFETY: as above; `&View` hands out only a raw pointer and a shared slice.
unsafe impl Sync for View {}

impl View {
    pub(super) fn of(b: &Arc<Block>) -> View {
        View::at(b, 0, b.len())
    }

    /// `len` bytes at `offset` of `b`. Panics outside the block.
    pub(super) fn at(b: &Arc<Block>, offset: usize, len: usize) -> View {
        assert!(
            offset.checked_add(len).is_some_and(|end| end <= b.len()),
            "a view of {len} bytes at {offset} outside a {}-byte block",
            b.len()
        );
        View {
            ptr: b.as_ptr().wrapping_add(offset),
            len,
            keep: Keep::Block(b.clone()),
        }
    }

    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` bytes at `ptr` belong to the block(s) `keep` holds alive; nobody hands
        // those blocks to the kernel while this view exists (Note [views hold blocks]).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The buffer of a gathered view, weakly (None for a view of one block).
    pub(super) fn gathered(&self) -> Option<std::sync::Weak<Vec<Block>>> {
        match &self.keep {
            Keep::Gathered(b) => Some(Arc::downgrade(b)),
            Keep::Block(_) => None,
        }
    }

    /// Whether this view keeps a pool block (not a gathered buffer).
    pub fn is_block(&self) -> bool {
        matches!(self.keep, Keep::Block(_))
    }

    /// Whether the bytes are still the tensor's own memory (Note [written from the tensor]:
    /// its write to disk has not landed), not a pool block nor a read-back buffer.
    pub fn is_borrowed(&self) -> bool {
        matches!(&self.keep, Keep::Block(b) if b.is_borrowed())
    }
}

/// One step (one forward and its backward): its entries' pack order, what it unpacked, its
/// counters and its forecast. Dropping it keeps what it taught for the next step.
pub struct Step {
    pub(super) tier: Tier,
    pub(super) id: u64,
}

/// An entry. Clones share it; dropping the last frees it wherever it is.
#[derive(Clone)]
pub struct Handle {
    pub(super) inner: Arc<HandleInner>,
}

pub(super) struct HandleInner {
    pub(super) tier: Tier,
    id: u64,
    nbytes: u64,
    seq: u32,
}

impl Drop for HandleInner {
    fn drop(&mut self) {
        // Dropping the residency returns the block, frees the slot, or leaves a request in
        // flight to finish with its block parked in the engine (Note [parked blocks]).
        let gone = self.tier.lock().entries.remove(&self.id);
        drop(gone);
    }
}

impl Step {
    pub fn id(&self) -> u64 {
        self.id
    }

    pub fn tier(&self) -> &Tier {
        &self.tier
    }

    /// Lease a block for `nbytes` and make it an entry of this step, staged: copy into the
    /// returned view, then [`Handle::seal`]. On an NVMe tier older entries are dropped or
    /// written out to make room. Fails with [`Error::PoolExhausted`] when nothing can be freed
    /// now (every block is staged or viewed; the caller may wait for its copies and retry).
    pub fn put(&self, nbytes: u64) -> Result<(Handle, View)> {
        let block = self.lease(nbytes)?;
        self.stage(block)
    }

    /// A block of `nbytes` for a new entry of this step, room made as [`Step::put`] does. It
    /// is no entry yet: dropping it gives it back to the pool.
    pub(super) fn lease(&self, nbytes: u64) -> Result<Block> {
        if nbytes == 0 {
            return Err(Error::Invalid("cannot put a 0-byte entry".into()));
        }
        let may_write = !self.tier.defers_writes();
        let Some(block) = self.tier.lease_making_room(nbytes, self.id, may_write)? else {
            let p = self.tier.inner.pool.stats();
            return Err(Error::PoolExhausted {
                need: nbytes,
                largest_free: p.largest_free,
                capacity: p.capacity,
            });
        };
        Ok(block)
    }

    /// Make `block` (from [`Step::lease`]) an entry of this step, staged; its size is the
    /// block's length.
    pub(super) fn stage(&self, block: Block) -> Result<(Handle, View)> {
        let nbytes = block.len() as u64;
        let block = Arc::new(block);
        let view = View::of(&block);
        let mut st = self.tier.lock();
        let h = self.add_entry(&mut st, nbytes, 0, None, Residency::Staging(block))?;
        drop(st);
        Ok((h, view))
    }

    /// Make `block`, already filled with `nbytes` from `head` on, an entry of this step,
    /// staged (Note [written from the tensor] in direct.rs: the layout of an image).
    pub(super) fn stage_at(&self, block: Block, head: u64, nbytes: u64) -> Result<Handle> {
        let mut st = self.tier.lock();
        self.add_entry(
            &mut st,
            nbytes,
            head,
            None,
            Residency::Staging(Arc::new(block)),
        )
    }

    /// A new entry of this step, next in pack order (caller holds the lock).
    pub(super) fn add_entry(
        &self,
        st: &mut State,
        nbytes: u64,
        head: u64,
        checksum: Option<u32>,
        res: Residency,
    ) -> Result<Handle> {
        let id = st.next_id;
        let Some(s) = st.steps.get_mut(&self.id) else {
            return Err(Error::Internal(format!(
                "step {} has no state while its Step lives",
                self.id
            )));
        };
        let seq = s.sizes.len() as u32;
        s.sizes.push(nbytes);
        s.ids.push(id);
        s.stats.bytes_put += nbytes;
        st.next_id += 1;
        st.entries.insert(
            id,
            Entry {
                nbytes,
                step: self.id,
                seq,
                res,
                checksum,
                went_to_disk: false,
                viewed: false,
                chunk: None,
                head,
            },
        );
        Ok(Handle {
            inner: Arc::new(HandleInner {
                tier: self.tier.clone(),
                id,
                nbytes,
                seq,
            }),
        })
    }

    /// Make `parts` (entries of this step, in order) one storage that `get` returns as a
    /// single buffer (Note [gathered storages]).
    pub fn gather(&self, parts: Vec<Handle>) -> Result<Gathered> {
        gather::new(self, parts)
    }

    /// Sequence numbers backward is expected to unpack after `seq`, next first, at most `n`.
    pub fn expected_after(&self, seq: u32, n: usize) -> Vec<u32> {
        let mut st = self.tier.lock();
        let Some(s) = st.steps.get_mut(&self.id) else {
            return Vec::new();
        };
        s.forecast.after(seq, &s.sizes).take(n).collect()
    }

    /// This step's counters, once the requests already done are finished (so that the bytes
    /// of writes that landed count, Note [written from the tensor]); an error of one of them
    /// is left for the call that owns it.
    pub fn stats(&self) -> StepStats {
        let mut st = self.tier.lock();
        let _ = self.tier.reap(&mut st);
        st.steps.get(&self.id).map(|s| s.stats).unwrap_or_default()
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        let mut st = self.tier.lock();
        if let Some(s) = st.steps.remove(&self.id) {
            if st.last_step == Some(self.id) && !s.order.is_empty() {
                st.last_learned = Some(Learned {
                    order: s.order,
                    sizes: s.sizes,
                });
            }
        }
    }
}

impl Handle {
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    pub fn nbytes(&self) -> u64 {
        self.inner.nbytes
    }

    /// Pack order within the step.
    pub fn seq(&self) -> u32 {
        self.inner.seq
    }

    fn tier(&self) -> &Tier {
        &self.inner.tier
    }

    /// The copy into the staging view has landed: the entry may be written out. Takes the
    /// checksum when verifying, then writes behind. Idempotent.
    pub fn seal(&self) -> Result<()> {
        let t = self.tier();
        let mut st = t.lock();
        let id = self.inner.id;
        let Some(e) = st.entries.get_mut(&id) else {
            return Ok(());
        };
        let b = match std::mem::replace(&mut e.res, Residency::Moving) {
            Residency::Staging(b) => b,
            other => {
                e.res = other;
                return Ok(());
            }
        };
        if t.inner.opts.verify {
            e.checksum = Some(crc32c::crc32c(e.bytes(&b)));
        }
        e.res = Residency::Dirty(b);
        let n = e.nbytes;
        st.dirty.push_back((id, n));
        st.dirty_bytes += n;
        let reaped = t.reap(&mut st);
        t.write_behind(&mut st)?;
        reaped
    }

    /// The entry's bytes (blocking until they are back in the pool), counted as an unpack,
    /// then read-ahead of what comes next. Raises the swap's errors, and
    /// [`Error::Integrity`] when verifying and the bytes differ from those sealed.
    pub fn get(&self) -> Result<View> {
        self.tier().get(self.inner.id, true, false)
    }

    /// As [`Handle::get`], for a device copy ordered after the copy that fills the entry
    /// (Note [unpack before the seal]): an entry whose copy has not been seen landing gives
    /// its staging view instead of an error. Never for the host to read.
    pub fn get_for_device(&self) -> Result<View> {
        self.tier().get(self.inner.id, true, true)
    }

    /// Count an unpack that did not need the bytes from the tier (the device still had them,
    /// or they were staged ahead), so that the order backward unpacks in is learned all the
    /// same, and read ahead from here.
    pub fn note_used(&self) {
        let t = self.tier();
        let mut st = t.lock();
        let id = self.inner.id;
        let Some(e) = st.entries.get(&id) else {
            return;
        };
        let (s, q) = (e.step, e.seq);
        Tier::used(&mut st, id, true);
        t.read_ahead(&mut st, s, q);
    }

    /// A view when the bytes are sealed and in the pool now; no waiting, not counted. With
    /// `staging`, also of a block whose copy has not landed yet: for a device copy ordered
    /// after that copy's event (Note [stream ordering] in rust/link), never for the host to read.
    pub fn try_get(&self, staging: bool) -> Option<View> {
        let st = self.tier().lock();
        let e = st.entries.get(&self.inner.id)?;
        match &e.res {
            Residency::Dirty(b) | Residency::Clean { block: b, .. } => Some(e.view(b)),
            Residency::Staging(b) if staging => Some(e.view(b)),
            _ => None,
        }
    }

    /// "staging", "dirty", "writing", "clean", "disk" or "reading".
    pub fn residency(&self) -> &'static str {
        let st = self.tier().lock();
        st.entries
            .get(&self.inner.id)
            .map_or("freed", |e| e.res.name())
    }

    /// Whether the bytes ever went to disk.
    pub fn went_to_disk(&self) -> bool {
        let st = self.tier().lock();
        st.entries
            .get(&self.inner.id)
            .is_some_and(|e| e.went_to_disk)
    }
}

/// Let a view be made from blocks the tier owns, back to back (used by gather): `len` bytes
/// from `head` bytes into the first.
pub(crate) fn view_of_blocks(blocks: Vec<Block>, head: usize, len: usize) -> View {
    let total: usize = blocks.iter().map(|b| b.capacity()).sum();
    assert!(head + len <= total, "a gathered view past its blocks");
    let ptr = blocks
        .first()
        .map_or(std::ptr::null_mut(), |b| b.as_ptr().wrapping_add(head));
    View {
        keep: Keep::Gathered(Arc::new(blocks)),
        ptr,
        len,
    }
}
