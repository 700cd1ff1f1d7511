//! Host-tier storage: one buffer per chunk, resident for the optimizer's lifetime.
//!
//! Buffers are leased from the host pool; when the pool has no room the chunk falls back to
//! a 64-byte-aligned heap allocation (counted in [`HostStore::heap_chunks`], so the caller can
//! warn once) instead of failing: the optimizer state is needed for the whole run, and the
//! pool is shared with activation offload, which degrades gracefully when it is full.

use crate::error::{Error, Result};
use crate::pool::{Block, Pool};

/// One cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

enum Buf {
    Pool(Block),
    Heap(Vec<Line>),
}

pub(crate) struct HostStore {
    bufs: Vec<Buf>,
    heap_chunks: usize,
}

impl HostStore {
    /// A buffer of `sizes[c]` bytes for every chunk `c`.
    pub fn new(pool: &Pool, sizes: impl Iterator<Item = usize>, allow_heap: bool) -> Result<Self> {
        let mut bufs = Vec::new();
        let mut heap_chunks = 0;
        for n in sizes {
            let bytes = n.max(1) as u64;
            match pool.lease(bytes) {
                Ok(b) => bufs.push(Buf::Pool(b)),
                Err(Error::PoolExhausted { .. }) if allow_heap => {
                    heap_chunks += 1;
                    // Zeroed pages come lazily from the kernel; the state is initialised per
                    // unit on its first step anyway.
                    bufs.push(Buf::Heap(vec![Line([0; 64]); n.div_ceil(64).max(1)]));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(HostStore { bufs, heap_chunks })
    }

    pub fn heap_chunks(&self) -> usize {
        self.heap_chunks
    }

    /// Base address of each chunk's buffer. `&mut self`: the caller is the only one writing
    /// through them until it next borrows the store.
    pub fn chunk_ptrs(&mut self) -> Vec<*mut u8> {
        self.bufs
            .iter_mut()
            .map(|b| match b {
                Buf::Pool(b) => b.as_ptr(),
                Buf::Heap(v) => v.as_mut_ptr() as *mut u8,
            })
            .collect()
    }
}
