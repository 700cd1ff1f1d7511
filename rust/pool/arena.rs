//! One anonymous mapping of the host pool: the only file here that calls mmap/madvise/mlock.

use std::io;
use std::ptr::NonNull;

use crate::error::{Error, Result};

/// A private anonymous mapping, unmapped on drop.
#[derive(Debug)]
pub struct Arena {
    base: NonNull<u8>,
    len: usize,
    locked: bool,
    /// Mapped here (unmapped on drop), or memory someone else owns ([`Arena::borrowed`]).
    owned: bool,
}

// SAFETY: the arena is a plain byte range owned by this value; it is only unmapped in `drop`,
// and the pool hands disjoint extents of it to blocks, so sharing the pointer between threads
// is no different from sharing a `Vec<u8>`'s buffer behind a lock.
unsafe impl Send for Arena {}
// SAFETY: see `Send`; `&Arena` only exposes the base pointer and length.
unsafe impl Sync for Arena {}

/// What an attempt to lock an arena into RAM gave.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LockOutcome {
    Locked,
    /// Locking was not asked for.
    Skipped,
    /// The kernel refused (errno): RLIMIT_MEMLOCK too small and no CAP_IPC_LOCK, usually.
    Refused(i32),
}

impl Arena {
    /// Map `len` bytes (a multiple of the page size). With `prefault`, every page is touched now
    /// (MAP_POPULATE) so no step ever pays a page fault; with `huge_pages`, transparent huge pages
    /// are requested (advice only: refusal is ignored).
    pub fn map(len: usize, prefault: bool, huge_pages: bool) -> Result<Arena> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        if prefault && !huge_pages {
            flags |= libc::MAP_POPULATE;
        }
        // SAFETY: an anonymous mapping at an address of the kernel's choosing touches no
        // existing memory; the result is checked against MAP_FAILED before use.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(Error::Map {
                bytes: len as u64,
                source: io::Error::last_os_error(),
            });
        }
        let base = NonNull::new(p.cast::<u8>()).expect("mmap returned null without MAP_FAILED");
        let arena = Arena {
            base,
            len,
            locked: false,
            owned: true,
        };
        if huge_pages {
            // SAFETY: the range is exactly the mapping made above. Advice failure is harmless.
            unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
            if prefault {
                // Advice first, then touch: the faults can then be served with huge pages.
                // SAFETY: the range is our own writable mapping; populating it writes nothing.
                let r = unsafe { libc::madvise(p, len, libc::MADV_POPULATE_WRITE) };
                if r != 0 {
                    arena.touch_pages();
                }
            }
        }
        Ok(arena)
    }

    /// An arena over `len` bytes at `base` that someone else owns and keeps mapped (Note
    /// [written from the tensor] in rust/tier/direct.rs): never locked, never unmapped here.
    ///
    /// # Safety
    /// `base..base + len` must stay mapped and readable for as long as the arena lives.
    pub unsafe fn borrowed(base: NonNull<u8>, len: usize) -> Arena {
        Arena {
            base,
            len,
            locked: false,
            owned: false,
        }
    }

    /// Whether the memory is someone else's ([`Arena::borrowed`]).
    pub fn is_borrowed(&self) -> bool {
        !self.owned
    }

    fn touch_pages(&self) {
        let page = 4096;
        let mut off = 0;
        while off < self.len {
            // SAFETY: `off < len`, inside our writable mapping; volatile so it is not elided.
            unsafe { std::ptr::write_volatile(self.base.as_ptr().add(off), 0) };
            off += page;
        }
    }

    /// Try to lock the arena into RAM so it cannot be swapped and DMA engines can use it.
    pub fn lock(&mut self) -> LockOutcome {
        // SAFETY: the range is exactly our mapping; mlock does not change its contents.
        let r = unsafe { libc::mlock(self.base.as_ptr().cast(), self.len) };
        if r == 0 {
            self.locked = true;
            LockOutcome::Locked
        } else {
            LockOutcome::Refused(io::Error::last_os_error().raw_os_error().unwrap_or(0))
        }
    }

    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn is_locked(&self) -> bool {
        self.locked
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        // SAFETY: the pool keeps the arena alive while any block (and so any view of it) exists,
        // so nothing refers to the mapping any more. munlock is implied by munmap.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// RLIMIT_MEMLOCK's soft limit in bytes (`None` = unlimited).
pub fn memlock_limit() -> Option<u64> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct that we own.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut rl) };
    if r != 0 || rl.rlim_cur == libc::RLIM_INFINITY {
        None
    } else {
        Some(rl.rlim_cur)
    }
}
