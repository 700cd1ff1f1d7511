//! The pinned host pool: a few large arenas made once, leased out as [`Block`]s.
//!
//! Leasing is an extent allocation under one mutex (no syscall, no heap allocation beyond the
//! `Arc` clone), so it is cheap enough for the per-tensor path. A block returns its extent when
//! dropped; the arenas are unmapped only when the pool *and* every block are gone, so a tensor
//! viewing a block can never see unmapped memory.

mod arena;

use std::sync::{Arc, Mutex, MutexGuard};

pub use arena::{memlock_limit, Arena, LockOutcome};

use crate::error::{Error, Result};
use crate::extent::{Extent, ExtentAllocator, GRANULE};

/// Largest single arena. Several arenas keep each mapping (and each CUDA registration) modest.
pub const DEFAULT_ARENA_BYTES: u64 = 1 << 30;

/// How to build a pool.
#[derive(Debug, Clone)]
pub struct PoolOptions {
    pub capacity: u64,
    pub arena_bytes: u64,
    pub prefault: bool,
    pub huge_pages: bool,
    pub lock: bool,
}

impl PoolOptions {
    pub fn new(capacity: u64) -> Self {
        PoolOptions {
            capacity,
            arena_bytes: DEFAULT_ARENA_BYTES,
            prefault: true,
            huge_pages: true,
            lock: true,
        }
    }
}

/// Counters, read under the pool's lock.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolStats {
    pub capacity: u64,
    pub in_use: u64,
    pub peak: u64,
    /// Blocks leased and not yet returned.
    pub live_blocks: u64,
    /// Leases granted since the pool was made.
    pub leases: u64,
    /// Leases refused because no free extent was large enough.
    pub failed_leases: u64,
    pub largest_free: u64,
    pub free_extents: u64,
    pub locked_bytes: u64,
}

struct State {
    allocs: Vec<ExtentAllocator>,
    in_use: u64,
    peak: u64,
    live: u64,
    leases: u64,
    failed: u64,
}

/// What keeps a borrowed arena's memory alive ([`Pool::borrowed`]); dropped with the pool.
pub type Owner = Box<dyn Send + Sync>;

struct Inner {
    arenas: Vec<Arena>,
    state: Mutex<State>,
    lock_warning: Option<String>,
    _owner: Option<Owner>,
}

impl Inner {
    fn state(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves the counters consistent (every update is a
        // single step), so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The host pool. Cheap to clone (an `Arc`).
#[derive(Clone)]
pub struct Pool {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("stats", &self.stats())
            .finish()
    }
}

impl Pool {
    /// Map `opts.capacity` bytes (rounded up to the granule) in arenas of at most
    /// `opts.arena_bytes`. Locking is attempted when asked for; if the kernel refuses, the pool
    /// still works unlocked and [`Pool::lock_warning`] says what to raise.
    pub fn new(opts: &PoolOptions) -> Result<Pool> {
        if opts.capacity == 0 {
            return Err(Error::Invalid(
                "host pool capacity must be > 0 bytes".into(),
            ));
        }
        let capacity = crate::extent::round_up(opts.capacity);
        let arena_bytes = crate::extent::round_up(opts.arena_bytes.max(GRANULE));
        let mut arenas = Vec::new();
        let mut left = capacity;
        while left > 0 {
            let len = left.min(arena_bytes);
            arenas.push(Arena::map(len as usize, opts.prefault, opts.huge_pages)?);
            left -= len;
        }
        let mut refused = None;
        if opts.lock {
            for a in arenas.iter_mut() {
                if let LockOutcome::Refused(errno) = a.lock() {
                    refused = Some(errno);
                    break;
                }
            }
        }
        let locked: u64 = arenas
            .iter()
            .filter(|a| a.is_locked())
            .map(|a| a.len() as u64)
            .sum();
        let lock_warning = refused.map(|errno| {
            let limit = match memlock_limit() {
                Some(l) => format!("{l} bytes"),
                None => "unlimited".to_string(),
            };
            format!(
                "spillover: the {capacity}-byte host pool could not be locked in RAM ({}; \
                 RLIMIT_MEMLOCK is {limit}, {locked} bytes locked). It works unlocked, but the \
                 kernel may swap it and CUDA copies from it are slower. Raise the limit \
                 (`ulimit -l unlimited`, LimitMEMLOCK= in systemd, --ulimit memlock=-1 in docker) \
                 or lower SPILLOVER_HOST_POOL_BYTES.",
                std::io::Error::from_raw_os_error(errno)
            )
        });
        let allocs = arenas
            .iter()
            .map(|a| ExtentAllocator::new(a.len() as u64))
            .collect();
        Ok(Pool {
            inner: Arc::new(Inner {
                arenas,
                state: Mutex::new(State {
                    allocs,
                    in_use: 0,
                    peak: 0,
                    live: 0,
                    leases: 0,
                    failed: 0,
                }),
                lock_warning,
                _owner: None,
            }),
        })
    }

    /// A pool of one arena over `len` bytes at `base`, memory that `owner` keeps mapped: the
    /// pool (and every block leased from it) holds `owner` and drops it last. For writing a
    /// tensor's own bytes to disk (Note [written from the tensor] in rust/tier/direct.rs).
    /// `base` and `len` must be multiples of the granule (4 KiB).
    ///
    /// # Safety
    /// `base..base + len` must stay mapped and readable while `owner` lives, and nothing may
    /// be written through the pool's blocks (they are read by the kernel only).
    pub unsafe fn borrowed(base: *mut u8, len: u64, owner: Owner) -> Result<Pool> {
        let Some(nn) = std::ptr::NonNull::new(base) else {
            return Err(Error::Invalid(
                "cannot borrow memory at a null address".into(),
            ));
        };
        if len == 0 || len % GRANULE != 0 || base as u64 % GRANULE != 0 {
            return Err(Error::Invalid(format!(
                "a borrowed range must be {GRANULE}-byte aligned and sized, not {len} bytes at \
                 {base:p}"
            )));
        }
        // SAFETY: the caller's promise.
        let arena = unsafe { Arena::borrowed(nn, len as usize) };
        Ok(Pool {
            inner: Arc::new(Inner {
                arenas: vec![arena],
                state: Mutex::new(State {
                    allocs: vec![ExtentAllocator::new(len)],
                    in_use: 0,
                    peak: 0,
                    live: 0,
                    leases: 0,
                    failed: 0,
                }),
                lock_warning: None,
                _owner: Some(owner),
            }),
        })
    }

    /// Lease `nbytes` (> 0). The block's extent is the smallest free one, across arenas, that
    /// holds it (rounded up to 4 KiB). Fails with [`Error::PoolExhausted`], never blocks.
    pub fn lease(&self, nbytes: u64) -> Result<Block> {
        if nbytes == 0 {
            return Err(Error::Invalid("cannot lease a 0-byte block".into()));
        }
        let need = crate::extent::round_up(nbytes);
        let mut st = self.inner.state();
        let best = st
            .allocs
            .iter()
            .enumerate()
            .filter(|(_, a)| a.largest_free() >= need)
            .min_by_key(|(_, a)| a.largest_free())
            .map(|(i, _)| i);
        let Some(arena) = best else {
            st.failed += 1;
            let largest_free = st
                .allocs
                .iter()
                .map(|a| a.largest_free())
                .max()
                .unwrap_or(0);
            return Err(Error::PoolExhausted {
                need: nbytes,
                largest_free,
                capacity: self.capacity(),
            });
        };
        let extent = st.allocs[arena]
            .alloc(need)
            .expect("largest_free said the extent fits");
        st.in_use += extent.len;
        st.peak = st.peak.max(st.in_use);
        st.live += 1;
        st.leases += 1;
        drop(st);
        Ok(Block {
            pool: self.inner.clone(),
            arena: arena as u32,
            extent,
            len: nbytes as usize,
        })
    }

    pub fn capacity(&self) -> u64 {
        self.inner.arenas.iter().map(|a| a.len() as u64).sum()
    }

    pub fn stats(&self) -> PoolStats {
        let st = self.inner.state();
        PoolStats {
            capacity: self.capacity(),
            in_use: st.in_use,
            peak: st.peak,
            live_blocks: st.live,
            leases: st.leases,
            failed_leases: st.failed,
            largest_free: st
                .allocs
                .iter()
                .map(|a| a.largest_free())
                .max()
                .unwrap_or(0),
            free_extents: st.allocs.iter().map(|a| a.free_extent_count() as u64).sum(),
            locked_bytes: self
                .inner
                .arenas
                .iter()
                .filter(|a| a.is_locked())
                .map(|a| a.len() as u64)
                .sum(),
        }
    }

    /// Start a new peak measurement from the current use.
    pub fn reset_peak(&self) {
        let mut st = self.inner.state();
        st.peak = st.in_use;
    }

    /// `(base address, length)` of every arena: for CUDA registration and io_uring fixed buffers.
    pub fn arenas(&self) -> Vec<(usize, usize)> {
        self.inner
            .arenas
            .iter()
            .map(|a| (a.base() as usize, a.len()))
            .collect()
    }

    /// Set when locking was asked for and refused: the text of the one warning to show.
    pub fn lock_warning(&self) -> Option<&str> {
        self.inner.lock_warning.as_deref()
    }
}

/// A leased extent of the pool: `len()` usable bytes at `as_ptr()`, 4 KiB aligned.
/// Returned to the pool when dropped.
pub struct Block {
    pool: Arc<Inner>,
    arena: u32,
    extent: Extent,
    len: usize,
}

// SAFETY: a block owns its extent exclusively until dropped (the allocator never hands out
// overlapping extents), and the arena it points into lives as long as `pool` (an `Arc`).
unsafe impl Send for Block {}
// SAFETY: `&Block` gives only a raw pointer; writes through it need `unsafe` by the caller.
unsafe impl Sync for Block {}

impl Block {
    pub fn as_ptr(&self) -> *mut u8 {
        let base = self.pool.arenas[self.arena as usize].base();
        // SAFETY: the extent lies inside the arena (the allocator covers exactly its length).
        unsafe { base.add(self.extent.offset as usize) }
    }

    /// Bytes asked for at lease time.
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes reserved (the request rounded up to 4 KiB).
    pub fn capacity(&self) -> usize {
        self.extent.len as usize
    }

    /// Index of the arena (= io_uring fixed-buffer index) and offset inside it.
    pub fn arena_index(&self) -> u32 {
        self.arena
    }

    pub fn arena_offset(&self) -> u64 {
        self.extent.offset
    }

    /// Whether the block is memory someone else owns ([`Pool::borrowed`]): read by the kernel
    /// only, never through a slice (its bytes beyond an entry's may be another allocation's).
    pub fn is_borrowed(&self) -> bool {
        self.pool.arenas[self.arena as usize].is_borrowed()
    }

    /// `n` bytes at `offset` of the block. Panics outside `len()`.
    pub fn bytes(&self, offset: usize, n: usize) -> &[u8] {
        assert!(
            offset.checked_add(n).is_some_and(|end| end <= self.len),
            "{n} bytes at {offset} outside a {}-byte block",
            self.len
        );
        // SAFETY: the range is inside the block (checked) and mapped while it lives; the
        // bytes of a borrowed block asked for here are the owner's, which it does not write
        // while they are offloaded (Note [written from the tensor]). Readers that race with
        // writers through raw pointers are the caller's documented responsibility.
        unsafe { std::slice::from_raw_parts(self.as_ptr().add(offset), n) }
    }

    pub fn as_slice(&self) -> &[u8] {
        debug_assert!(!self.is_borrowed(), "a borrowed block is read with `bytes`");
        self.bytes(0, self.len)
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        debug_assert!(
            !self.is_borrowed(),
            "a borrowed block is never written through"
        );
        // SAFETY: as `as_slice`, and `&mut self` makes this the only Rust reference.
        unsafe { std::slice::from_raw_parts_mut(self.as_ptr(), self.len) }
    }

    /// Copy `len` bytes from `src` into the block at `offset`.
    ///
    /// # Safety
    /// `src` must be valid for reads of `len` bytes and not overlap the block, and no one else
    /// may write the block's bytes concurrently.
    pub unsafe fn copy_from_raw(&self, src: *const u8, len: usize, offset: usize) -> Result<()> {
        self.check_range(len, offset)?;
        // SAFETY: the range is inside the block (checked); the caller vouches for `src`.
        unsafe { std::ptr::copy_nonoverlapping(src, self.as_ptr().add(offset), len) };
        Ok(())
    }

    /// Copy `len` bytes of the block at `offset` to `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of `len` bytes and not overlap the block.
    pub unsafe fn copy_to_raw(&self, dst: *mut u8, len: usize, offset: usize) -> Result<()> {
        self.check_range(len, offset)?;
        // SAFETY: the range is inside the block (checked); the caller vouches for `dst`.
        unsafe { std::ptr::copy_nonoverlapping(self.as_ptr().add(offset), dst, len) };
        Ok(())
    }

    fn check_range(&self, len: usize, offset: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(Error::Invalid(format!(
                "copy of {len} bytes at offset {offset} does not fit a {}-byte block",
                self.len
            ))),
        }
    }
}

impl std::fmt::Debug for Block {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Block")
            .field("arena", &self.arena)
            .field("extent", &self.extent)
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for Block {
    fn drop(&mut self) {
        let mut st = self.pool.state();
        st.allocs[self.arena as usize].free(self.extent);
        st.in_use -= self.extent.len;
        st.live -= 1;
    }
}
