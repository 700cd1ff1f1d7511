//! Space in the swap files: one extent allocator per file, and [`Slot`]s cut from them.
//!
//! # Note [slot lifetime]
//! A slot's extents go back to the allocators when the last clone of the slot is dropped. Every
//! request holds a clone until its completion, so bytes the kernel may still be writing into a
//! swap file are never handed to another slot, even when the caller drops its slot (and its
//! ticket) while the I/O is in flight.

use std::sync::{Arc, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::extent::{round_up, Extent, ExtentAllocator};

use super::file::SwapFile;

/// One contiguous piece of a slot: `extent` of the swap file in directory number `file`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    pub file: u32,
    pub extent: Extent,
}

pub(crate) struct Space {
    pub files: Vec<SwapFile>,
    block_bytes: u64,
    state: Mutex<SpaceState>,
}

struct SpaceState {
    allocs: Vec<ExtentAllocator>,
    /// Per file: `[0, reserved)` is backed (fallocated, or at least inside the file size).
    reserved: Vec<u64>,
    /// The directory the next piece prefers (round robin across calls).
    next: usize,
    in_use: u64,
    peak: u64,
}

/// Space-wide counters for [`super::IoStats`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct SpaceStats {
    pub capacity: u64,
    pub in_use: u64,
    pub peak: u64,
}

impl Space {
    pub fn new(files: Vec<SwapFile>, capacities: &[u64], block_bytes: u64) -> Space {
        Space {
            block_bytes,
            state: Mutex::new(SpaceState {
                allocs: capacities
                    .iter()
                    .map(|&c| ExtentAllocator::new(c))
                    .collect(),
                reserved: vec![0; files.len()],
                next: 0,
                in_use: 0,
                peak: 0,
            }),
            files,
        }
    }

    fn state(&self) -> MutexGuard<'_, SpaceState> {
        // Every update under the lock is completed before anything can panic, so a poisoned
        // lock still guards consistent state.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn stats(&self) -> SpaceStats {
        let st = self.state();
        SpaceStats {
            capacity: st.allocs.iter().map(|a| a.capacity()).sum(),
            in_use: st.in_use,
            peak: st.peak,
        }
    }

    pub fn reset_peak(&self) {
        let mut st = self.state();
        st.peak = st.in_use;
    }

    /// Cut `nbytes` (rounded up to the granule) into pieces of at most `block_bytes`, the k-th
    /// piece preferring directory `(start + k) % dirs` (striping), falling over to another
    /// directory with room, and to smaller pieces when free space is fragmented. Space past a
    /// file's reserved end is reserved now, so a full disk is reported here and not by a write.
    pub fn alloc(self: &Arc<Self>, nbytes: u64) -> Result<Slot> {
        if nbytes == 0 {
            return Err(Error::Invalid("cannot allocate a 0-byte swap slot".into()));
        }
        let need = round_up(nbytes);
        let mut st = self.state();
        let n = self.files.len();
        let start = st.next;
        let free: u64 = st.allocs.iter().map(|a| a.free_bytes()).sum();
        if free < need {
            return Err(Error::OutOfSpace {
                path: self.files[start].dir.clone(),
                need,
                free,
            });
        }
        let mut pieces: Vec<Piece> = Vec::with_capacity(need.div_ceil(self.block_bytes) as usize);
        let mut left = need;
        let mut k = 0;
        while left > 0 {
            let want = left.min(self.block_bytes);
            let prefer = (start + k) % n;
            k += 1;
            let got = (0..n).map(|j| (prefer + j) % n).find_map(|f| {
                st.allocs[f].alloc(want).map(|e| Piece {
                    file: f as u32,
                    extent: e,
                })
            });
            let piece = match got {
                Some(p) => p,
                None => {
                    // Fragmented: take the largest free extent anywhere (free >= left holds).
                    let (f, largest) = st
                        .allocs
                        .iter()
                        .map(|a| a.largest_free())
                        .enumerate()
                        .max_by_key(|&(_, l)| l)
                        .expect("at least one directory");
                    let e = st.allocs[f]
                        .alloc(largest.min(want))
                        .expect("largest_free fits");
                    Piece {
                        file: f as u32,
                        extent: e,
                    }
                }
            };
            let f = piece.file as usize;
            if piece.extent.end() > st.reserved[f] {
                let limit = st.allocs[f].capacity();
                match self.files[f].reserve(st.reserved[f], piece.extent.end(), limit) {
                    Ok(end) => st.reserved[f] = end,
                    Err(e) => {
                        st.allocs[f].free(piece.extent);
                        for p in pieces {
                            st.allocs[p.file as usize].free(p.extent);
                        }
                        return Err(e);
                    }
                }
            }
            left -= piece.extent.len;
            pieces.push(piece);
        }
        st.next = (start + k) % n;
        st.in_use += need;
        st.peak = st.peak.max(st.in_use);
        drop(st);
        Ok(Slot {
            inner: Arc::new(SlotInner {
                space: self.clone(),
                pieces,
                len: nbytes,
            }),
        })
    }
}

/// Space for one tensor in the swap files. Cheap to clone; the space is freed when the last
/// clone is dropped and no request uses it any more (Note [slot lifetime]).
#[derive(Clone)]
pub struct Slot {
    inner: Arc<SlotInner>,
}

struct SlotInner {
    space: Arc<Space>,
    pieces: Vec<Piece>,
    len: u64,
}

impl Slot {
    /// Bytes asked for.
    pub fn len(&self) -> u64 {
        self.inner.len
    }

    pub fn is_empty(&self) -> bool {
        self.inner.len == 0
    }

    /// Bytes held (the request rounded up to 4 KiB): the most a block read or written with
    /// this slot may hold (its `capacity()`).
    pub fn capacity(&self) -> u64 {
        self.inner.pieces.iter().map(|p| p.extent.len).sum()
    }

    /// Where the bytes live, in order: striped across the directories.
    pub fn pieces(&self) -> &[Piece] {
        &self.inner.pieces
    }

    pub(crate) fn belongs_to(&self, space: &Arc<Space>) -> bool {
        Arc::ptr_eq(&self.inner.space, space)
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slot")
            .field("len", &self.inner.len)
            .field("pieces", &self.inner.pieces)
            .finish()
    }
}

impl Drop for SlotInner {
    fn drop(&mut self) {
        let mut st = self.space.state();
        for p in &self.pieces {
            st.allocs[p.file as usize].free(p.extent);
        }
        st.in_use -= self.pieces.iter().map(|p| p.extent.len).sum::<u64>();
    }
}
