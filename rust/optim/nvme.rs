//! NVMe-tier storage: one swap slot per chunk, streamed through a few pool blocks.
//!
//! # Note [three-stage pipeline]
//! [`NvmeStore::stream`] visits chunks in order. While chunk `i` is being updated, reads of
//! the next chunks are in flight and the writes of the previous ones are draining, with at
//! most `buffers` blocks leased at once (so at least 3: one reading, one updating, one
//! writing). A block is leased for a chunk just before its read is issued and goes back to the
//! pool when its write has completed, so between steps the optimizer holds no pool memory.
//!
//! Ordering: the swap engine does not order requests against each other, so a slot is read
//! only after the write of its previous contents has been waited for. Within a pass each chunk
//! is read before it is written, and a pass waits for all of its writes before returning, so
//! the next pass always reads what the last one wrote.
//!
//! A chunk that has never been written is not read: its block is zero-filled instead (the
//! first step, and chunks whose units have never had a gradient).
//!
//! On an I/O error the pass returns at once; requests still in flight finish in the engine,
//! which keeps their blocks until then (Note [parked blocks]). The state of the chunks that
//! pass touched is then unspecified (the caller's step raised), the others are intact.
//!
//! The swap is shared (the process's one engine and set of files, also used by the activation
//! tier). The store's slots go back to it when the store is dropped; a request still in flight
//! holds a clone of its slot, so its extent is not reused before it completes (Note [slot
//! lifetime] in rust/io/slot.rs), and its block keeps its pool alive.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::io::{Slot, Swap, Ticket};
use crate::pool::{Block, Pool};

enum Pending {
    Reading(Ticket),
    Ready(Block),
}

/// Counters a pass adds to.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct PassStats {
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub io_wait: f64,
    pub compute: f64,
}

pub(crate) struct NvmeStore {
    swap: Arc<Swap>,
    slots: Vec<Slot>,
    bytes: Vec<u64>,
    written: Vec<bool>,
    buffers: usize,
    pool: Pool,
}

impl NvmeStore {
    /// Reserve a slot of `bytes[c]` in `swap` for every chunk.
    pub fn new(pool: &Pool, swap: Arc<Swap>, bytes: Vec<u64>, buffers: usize) -> Result<Self> {
        if buffers < 3 {
            return Err(Error::Invalid(format!(
                "the NVMe optimizer pipeline needs at least 3 buffers (read, update, write), \
                 got {buffers}"
            )));
        }
        let slots = bytes
            .iter()
            .map(|&b| swap.alloc(b.max(1)))
            .collect::<Result<Vec<_>>>()?;
        Ok(NvmeStore {
            written: vec![false; slots.len()],
            swap,
            slots,
            bytes,
            buffers,
            pool: pool.clone(),
        })
    }

    pub fn swap(&self) -> &Swap {
        &self.swap
    }

    /// Run `update(chunk, base)` on every chunk of `chunks` (ascending, distinct) with the
    /// chunk's bytes in a pool block at `base`, reading them first and, if `write_back`,
    /// writing them after. Note [three-stage pipeline].
    pub fn stream(
        &mut self,
        chunks: &[usize],
        write_back: bool,
        stats: &mut PassStats,
        mut update: impl FnMut(usize, *mut u8) -> Result<()>,
    ) -> Result<()> {
        let mut pending: VecDeque<Pending> = VecDeque::new();
        let mut writes: VecDeque<(usize, Ticket)> = VecDeque::new();
        let mut next = 0;
        for (i, &chunk) in chunks.iter().enumerate() {
            self.reap(&mut writes, stats)?;
            // Issue reads ahead while blocks are allowed, and at least this chunk's.
            while next < chunks.len() && (next <= i || pending.len() + writes.len() < self.buffers)
            {
                if pending.len() + writes.len() >= self.buffers {
                    let (c, t) = writes
                        .pop_front()
                        .expect("blocks in use are pending or writing");
                    self.finish_write(c, t, stats)?;
                }
                let block = self.lease(chunks[next], &mut writes, stats)?;
                pending.push_back(self.issue_read(chunks[next], block, stats));
                next += 1;
            }
            let mut block = match pending.pop_front().expect("issued above") {
                Pending::Ready(b) => b,
                Pending::Reading(t) => wait(t, &mut stats.io_wait)?,
            };
            let t0 = Instant::now();
            update(chunk, block.as_mut_slice().as_mut_ptr())?;
            stats.compute += t0.elapsed().as_secs_f64();
            if write_back {
                writes.push_back((chunk, self.swap.write(block, &self.slots[chunk])));
            }
            self.reap(&mut writes, stats)?;
        }
        while let Some((c, t)) = writes.pop_front() {
            self.finish_write(c, t, stats)?;
        }
        Ok(())
    }

    /// Finish the writes that have completed, oldest first.
    fn reap(
        &mut self,
        writes: &mut VecDeque<(usize, Ticket)>,
        stats: &mut PassStats,
    ) -> Result<()> {
        while writes.front().is_some_and(|(_, t)| t.is_done()) {
            let (c, t) = writes.pop_front().expect("checked");
            self.finish_write(c, t, stats)?;
        }
        Ok(())
    }

    fn lease(
        &mut self,
        chunk: usize,
        writes: &mut VecDeque<(usize, Ticket)>,
        stats: &mut PassStats,
    ) -> Result<Block> {
        loop {
            match self.pool.lease(self.bytes[chunk]) {
                Ok(b) => return Ok(b),
                Err(Error::PoolExhausted {
                    need,
                    largest_free,
                    capacity,
                }) => match writes.pop_front() {
                    Some((c, t)) => self.finish_write(c, t, stats)?,
                    None => {
                        return Err(Error::Invalid(format!(
                            "the NVMe optimizer needs {need}-byte pool blocks to stream its \
                             state, but the host pool's largest free extent is {largest_free} \
                             of {capacity} bytes; raise SPILLOVER_HOST_POOL_BYTES or lower the \
                             optimizer's chunk size"
                        )))
                    }
                },
                Err(e) => return Err(e),
            }
        }
    }

    fn issue_read(&self, chunk: usize, mut block: Block, stats: &mut PassStats) -> Pending {
        if self.written[chunk] {
            stats.bytes_read += block.capacity() as u64;
            Pending::Reading(self.swap.read(&self.slots[chunk], block))
        } else {
            block.as_mut_slice().fill(0);
            Pending::Ready(block)
        }
    }

    fn finish_write(&mut self, chunk: usize, t: Ticket, stats: &mut PassStats) -> Result<()> {
        let block = wait(t, &mut stats.io_wait)?;
        stats.bytes_written += block.capacity() as u64;
        self.written[chunk] = true;
        Ok(())
    }
}

fn wait(t: Ticket, io_wait: &mut f64) -> Result<Block> {
    let t0 = Instant::now();
    let (block, r) = t.wait();
    *io_wait += t0.elapsed().as_secs_f64();
    r.map(|()| block)
}
