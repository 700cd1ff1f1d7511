//! Entries written to disk from the memory of the storage they offload, with no copy into the
//! pool ([`Step::put_direct`]).
//!
//! # Note [written from the tensor]
//! On the NVMe tier a CPU pack used to copy the storage into the pool and write the pool block
//! out. The copy is memory-bound and runs on the cores that compute: 0.14 s of a 1.5 s forward
//! on the SDPA GPT of `benches/python/recompute_bench.py`, 0.45 s on its explicit kind, plus
//! waits for the pool's writes whenever it filled. The storage's own memory can be written
//! instead, as long as it stays alive and unchanged until the write lands:
//!
//! - **Alignment.** O_DIRECT wants the buffer, the length and the file offset aligned (512 B on
//!   most drives, 4 KiB at most), and torch's CPU storages start 64 bytes into a page. So the
//!   entry's block is the image of the whole pages its bytes lie in, a block of a borrowed
//!   arena ([`Pool::borrowed`]): every page that holds one of its bytes is mapped, so reading
//!   the rest of those pages cannot fault. The slot holds that image, and the entry's bytes
//!   start `head` bytes in: in the slot, and in the pool block it is read back into
//!   (`Entry::image`, `Entry::view`). The bytes around them may be another allocation's and
//!   change while the kernel reads them; they are never read back as the entry's, and a
//!   checksum covers the entry's bytes only.
//! - **Lifetime.** The borrowed pool holds the storage (the owner) and every block of it holds
//!   the pool, so the storage lives until the write lands: then the block is dropped and the
//!   entry is on disk only (`finish_io`). A failed write leaves the entry unwritten in the
//!   storage's memory (Note [failed I/O]): readable there, written again later.
//! - **The pool first.** While the pool has room to spare (a lease that drops and waits for
//!   nothing), the storage is copied into it as before: an entry still in the pool when
//!   backward comes needs no read, and a pool that holds a whole step (the default pool grows
//!   to that) is never read from disk. Only what would make the pack wait for room is written
//!   from the tensor.
//! - **What backward needs first stays in the pool.** Written from the tensor, nothing is left
//!   in the pool when forward ends, and backward's first unpacks waited for their reads (0.23 s
//!   a step on the SDPA GPT, against 0.10 s through the pool). So an entry that the learned
//!   order (Note [expected order]) has backward unpack within its first bytes -- the pool less
//!   the read-ahead window -- is copied into the pool as before, at the same place in its first
//!   page ([`Step::put_copy_at`]): it is written behind and still there, clean, when backward
//!   starts, and both kinds read back and gather alike.
//! - **Pieces.** A storage larger than half the pool goes in pieces (Note [gathered storages]):
//!   the caller cuts them so that every piece after the first starts on a page, and the pieces'
//!   images then lie back to back in the gathered buffer, the storage `head` bytes into it.
//! - **Memory.** Sources whose writes are in flight are memory the step holds, so a put waits
//!   while the bytes being written (from the pool or from tensors) would pass the *hold*: at
//!   most that much, and the storage being packed, beyond what the step holds anyway. The hold
//!   is the pool's capacity plus the largest storage written from its tensor so far
//!   (`TierOptions::write_hold_bytes` sets another). With the pool's capacity alone, every
//!   pack after a storage larger than the pool waited for most of its write: on the explicit
//!   CPU GPT (`benches/python/step_trace.py`, 64 MiB pool) the packs after each 128 MiB
//!   attention probabilities stalled 0.39-0.58 s a step, against 0.04-0.11 s with a hold of
//!   two or four pools, and the whole step's peak did not move (backward's is the higher).
//!   Only a storage's first piece waits: its further pieces are memory held until its
//!   last piece lands whatever they wait for, and waiting for them held forward up (the CPU
//!   GPT's 128 MiB attention probabilities through a 64 MiB pool).
//! - **What the caller promises.** Nothing writes the storage's bytes while the write is in
//!   flight (for autograd's saved tensors an in-place write is an error at unpack anyway), and
//!   nothing frees its memory behind the owner's back (`storage.resize_(0)`, which a saved
//!   tensor does not survive without offload either).

use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use super::state::Residency;
use super::{Handle, Step};
use crate::error::{Error, Result};
use crate::extent::{round_up, GRANULE};
use crate::pool::{Owner, Pool};

impl Step {
    /// Offload `nbytes` at `ptr` (Note [written from the tensor]): copied into the pool while
    /// it has room to spare or when backward needs them first, else written to disk from where
    /// they are: the entry is being written when this returns, and on disk only once the write
    /// lands, when `owner` is dropped. `wait` marks a storage's first piece, which first waits
    /// while the bytes being written would pass the hold (`TierOptions::write_hold_bytes`);
    /// its further pieces do not: their bytes are that storage's, held until its last piece
    /// lands whatever they wait for. Fails on a tier without swap, and with what allocating a
    /// slot raises (`OutOfSpace`); on an error no entry is left and `owner` is dropped.
    ///
    /// # Safety
    /// `ptr..ptr + nbytes` must stay mapped, readable and unwritten while `owner` lives.
    pub unsafe fn put_direct(
        &self,
        ptr: *const u8,
        nbytes: u64,
        owner: Owner,
        wait: bool,
    ) -> Result<Handle> {
        let tier = &self.tier;
        let Some(swap) = tier.inner.swap.clone() else {
            return Err(Error::Invalid(
                "a tier without swap cannot write a storage out from its own memory".into(),
            ));
        };
        let addr = ptr as u64;
        let end = addr.checked_add(nbytes).filter(|_| nbytes > 0 && addr > 0);
        let Some(end) = end else {
            return Err(Error::Invalid(format!(
                "cannot write {nbytes} bytes at {ptr:p} from the tensor"
            )));
        };
        let start = addr - addr % GRANULE;
        let (head, image) = (addr - start, round_up(end) - start);
        if wait {
            tier.inner.direct_run.store(0, Relaxed); // a storage's first piece
        }
        // SAFETY: the caller's promise, for the length of this call (`owner` lives through
        // it); a copy goes into a block leased from the pool, never the caller's memory.
        let src = unsafe { std::slice::from_raw_parts(ptr, nbytes as usize) };
        if let Ok(block) = tier.inner.pool.lease(head + nbytes) {
            return self.copy_in(block, src, head); // room to spare: it stays in the pool
        }
        if tier.defers_writes() {
            // Note [writes wait for growth] (room.rs): the caller grows the pool first
            return self.put_copy_at(src, head);
        }
        if self.needed_first(nbytes) {
            match self.put_copy_at(src, head) {
                Err(Error::PoolExhausted { .. }) => {} // written from the tensor after all
                copied => return copied,
            }
        }
        if wait {
            self.wait_for_writes(image)?;
        }
        let run = tier.inner.direct_run.fetch_add(image, Relaxed) + image;
        tier.inner.direct_largest.fetch_max(run, Relaxed);
        // SAFETY: the pages from `start` to `start + image` each hold a byte of the caller's
        // range, so they are mapped while `owner` lives (the caller's promise); the borrowed
        // pool holds `owner` and its block is only ever read by the kernel.
        let pool = unsafe { Pool::borrowed(start as *mut u8, image, owner)? };
        let block = pool.lease(image)?;
        let checksum = tier
            .inner
            .opts
            .verify
            .then(|| crc32c::crc32c(block.bytes(head as usize, nbytes as usize)));
        let mut st = tier.lock();
        let slot = swap.alloc(image)?; // OutOfSpace: the step that hit it fails here
        let ticket = swap.write(block, &slot);
        let h = self.add_entry(
            &mut st,
            nbytes,
            head,
            checksum,
            Residency::Writing { ticket, slot },
        )?;
        st.writing.push_back(h.id());
        Ok(h)
    }

    /// Whether the next entry of this step, of `nbytes`, is among what backward is expected to
    /// unpack first, within the pool less the read-ahead window (Note [written from the
    /// tensor]).
    fn needed_first(&self, nbytes: u64) -> bool {
        let tier = &self.tier;
        let budget = (tier.inner.pool.capacity()).saturating_sub(tier.inner.opts.prefetch_bytes);
        let st = tier.lock();
        st.steps.get(&self.id).is_some_and(|s| {
            s.forecast
                .needed_within(s.sizes.len() as u32, nbytes, budget)
        })
    }

    /// Wait, oldest write first, until `image` more bytes being written stay within the hold
    /// (`write_hold_bytes`, by default the pool's capacity and the largest storage written
    /// from a tensor so far) or nothing is being written.
    fn wait_for_writes(&self, image: u64) -> Result<()> {
        let tier = &self.tier;
        let cap = tier.inner.opts.write_hold_bytes.unwrap_or_else(|| {
            let largest = tier.inner.direct_largest.load(Relaxed);
            tier.inner.pool.capacity() + largest.max(image)
        });
        loop {
            let watch = {
                let mut st = tier.lock();
                tier.reap(&mut st)?;
                let writing = st.bytes_writing();
                if writing == 0 || writing + image <= cap {
                    return Ok(());
                }
                let oldest = st
                    .writing
                    .iter()
                    .find_map(|id| st.entries.get(id).and_then(|e| e.res.watch()));
                match oldest {
                    Some(w) => w,
                    None => return Ok(()),
                }
            };
            let t0 = Instant::now();
            watch.wait_done();
            let secs = t0.elapsed().as_secs_f64();
            tier.lock().add_stall(self.id, secs);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use crate::error::Error;
    use crate::io::{FaultKind, IoOptions, Swap};
    use crate::pool::{Pool, PoolOptions};
    use crate::tier::{Step, Tier, TierOptions};

    /// Flags its drop: stands for the storage a put holds.
    struct Source(Arc<AtomicBool>);

    impl Drop for Source {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A flag the owner sets when dropped, and the owner.
    fn source() -> (Arc<AtomicBool>, Box<Source>) {
        let released = Arc::new(AtomicBool::new(false));
        (released.clone(), Box::new(Source(released)))
    }

    /// An NVMe tier over a swap file in a directory of its own, and its first step.
    fn nvme_step(capacity: u64, verify: bool) -> (tempfile::TempDir, Tier, Step) {
        nvme_step_with(capacity, |t| t.verify = verify)
    }

    /// As `nvme_step`, with the tier's options set by `set`.
    fn nvme_step_with(
        capacity: u64,
        set: impl FnOnce(&mut TierOptions),
    ) -> (tempfile::TempDir, Tier, Step) {
        let dir = tempfile::tempdir().unwrap();
        let mut o = PoolOptions::new(capacity);
        o.lock = false;
        o.huge_pages = false;
        let pool = Pool::new(&o).unwrap();
        let mut io = IoOptions::new([dir.path()]);
        io.allow_buffered = true;
        let swap = Arc::new(Swap::open(&io, &pool).unwrap());
        let mut t = TierOptions::for_pool(capacity);
        set(&mut t);
        let tier = Tier::new(pool, Some(swap), t);
        let step = tier.begin_step();
        (dir, tier, step)
    }

    /// The whole pool, leased: while it is held a put has no room to spare, so it writes from
    /// the tensor (the step has no learned order either).
    fn fill(tier: &Tier) -> crate::pool::Block {
        tier.pool().lease(tier.pool().capacity()).unwrap()
    }

    /// Bytes at an address 64 bytes into a page, as torch places a large CPU storage, with
    /// bytes of "another allocation" on both sides in the same pages.
    fn unaligned(n: usize) -> (Vec<u8>, usize) {
        let buf: Vec<u8> = (0..n + 3 * 4096).map(|i| (i * 7 % 251) as u8).collect();
        let base = buf.as_ptr() as usize;
        let off = (4096 - base % 4096) % 4096 + 64;
        (buf, off)
    }

    #[test]
    fn round_trip_from_an_unaligned_storage_releases_it_once_written() {
        for verify in [false, true] {
            let (_dir, tier, step) = nvme_step(1 << 20, verify);
            let n = 300_001;
            let (buf, off) = unaligned(n);
            let (released, src) = source();
            let full = fill(&tier);
            // SAFETY: `buf` outlives the write (waited for below) and is not written meanwhile.
            let h = unsafe { step.put_direct(buf[off..].as_ptr(), n as u64, src, true) }.unwrap();
            drop(full);
            assert_eq!(h.nbytes(), n as u64);
            tier.wait_idle().unwrap();
            assert!(
                released.load(Ordering::SeqCst),
                "the source is held after its write"
            );
            assert_eq!(h.residency(), "disk");
            assert!(h.went_to_disk());
            assert_eq!(
                tier.stats().pool_in_use,
                0,
                "nothing of it went through the pool"
            );
            let v = h.get().unwrap();
            assert_eq!(v.as_slice(), &buf[off..off + n]);
        }
    }

    #[test]
    fn with_room_to_spare_it_is_copied_into_the_pool() {
        let (_dir, tier, step) = nvme_step(1 << 20, false);
        let n = 100_000;
        let (buf, off) = unaligned(n);
        let (released, src) = source();
        // SAFETY: `buf` outlives the call and is not written meanwhile.
        let h = unsafe { step.put_direct(buf[off..].as_ptr(), n as u64, src, true) }.unwrap();
        assert!(
            released.load(Ordering::SeqCst),
            "copied: the source is not held"
        );
        assert!(matches!(h.residency(), "dirty" | "writing" | "clean"));
        assert!(tier.stats().pool_in_use > 0);
        assert_eq!(h.try_get(false).unwrap().as_slice(), &buf[off..off + n]);
    }

    #[test]
    fn a_failed_write_keeps_the_source_readable_and_writes_it_again() {
        let (_dir, tier, step) = nvme_step(1 << 20, true);
        let n = 100_000;
        let (buf, off) = unaligned(n);
        let (released, src) = source();
        tier.swap()
            .unwrap()
            .inject_fault(FaultKind::Write, libc::EIO, 1);
        let full = fill(&tier);
        // SAFETY: as above.
        let h = unsafe { step.put_direct(buf[off..].as_ptr(), n as u64, src, true) }.unwrap();
        drop(full);
        assert!(tier.wait_idle().is_err(), "the injected error is raised");
        assert_eq!(h.residency(), "dirty");
        assert!(
            !released.load(Ordering::SeqCst),
            "unwritten: the source is still needed"
        );
        let v = h.try_get(false).unwrap();
        assert!(v.is_borrowed(), "the source's own memory");
        assert_eq!(v.as_slice(), &buf[off..off + n]);
        drop(v);
        assert!(tier.spill_all().is_ok());
        assert!(released.load(Ordering::SeqCst));
        let v = h.get().unwrap();
        assert!(!v.is_borrowed(), "read back from disk");
        assert_eq!(v.as_slice(), &buf[off..off + n]);
    }

    #[test]
    fn writes_in_flight_stay_within_the_hold() {
        // The default, one under the pool's capacity and one over it; every image is 26 pages,
        // so a hold of 150 KiB lets one write at a time.
        for hold in [None, Some(150 << 10), Some(600 << 10)] {
            let (_dir, tier, step) = nvme_step_with(256 << 10, |t| t.write_hold_bytes = hold);
            // by default the pool and the largest storage so far: one image
            let cap = hold.unwrap_or((256 << 10) + 26 * 4096);
            assert_eq!(tier.options().write_hold_bytes, hold);
            let n = 100 << 10;
            let (buf, off) = unaligned(8 * n);
            let _full = fill(&tier);
            let mut hs = Vec::new();
            for i in 0..8 {
                let p = buf[off + i * n..].as_ptr();
                // SAFETY: as above.
                hs.push(unsafe { step.put_direct(p, n as u64, Box::new(()), true) }.unwrap());
                let writing = tier.lock().bytes_writing();
                assert!(writing <= cap, "{writing} bytes being written, hold {cap}");
            }
            tier.wait_idle().unwrap();
            for (i, h) in hs.iter().enumerate() {
                assert_eq!(
                    h.get().unwrap().as_slice(),
                    &buf[off + i * n..off + (i + 1) * n]
                );
            }
        }
    }

    #[test]
    fn pieces_cut_at_pages_are_gathered_straight_from_disk() {
        let (_dir, tier, step) = nvme_step(1 << 20, true);
        let (n, piece) = (700_000usize, 128usize << 10);
        let (buf, off) = unaligned(n);
        let p = buf[off..].as_ptr();
        let full = fill(&tier);
        let mut parts = Vec::new();
        let (mut at, mut len) = (0, piece - p as usize % 4096);
        while at < n {
            len = len.min(n - at);
            // SAFETY: `buf` outlives the writes (waited for below) and is not written.
            parts.push(
                unsafe { step.put_direct(p.add(at), len as u64, Box::new(()), at == 0) }.unwrap(),
            );
            (at, len) = (at + len, piece);
        }
        let g = step.gather(parts).unwrap();
        drop(full);
        tier.wait_idle().unwrap();
        tier.pool().reset_peak();
        let v = g.get().unwrap();
        assert_eq!(v.as_slice(), &buf[off..off + n]);
        assert_eq!(
            tier.pool().stats().peak,
            0,
            "read through the pool, not into its buffer"
        );
    }

    #[test]
    fn a_host_tier_refuses() {
        let mut o = PoolOptions::new(1 << 20);
        o.lock = false;
        let tier = Tier::new(Pool::new(&o).unwrap(), None, TierOptions::for_pool(1 << 20));
        let step = tier.begin_step();
        let b = [1u8; 16];
        // SAFETY: `b` outlives the call, which fails before reading it.
        let r = unsafe { step.put_direct(b.as_ptr(), 16, Box::new(()), true) };
        assert!(r.is_err());
        assert_eq!(tier.stats().entries, 0);
    }

    #[test]
    fn deferred_writes_fail_the_put_and_write_nothing_until_turned_off() {
        // Note [writes wait for growth] (room.rs): a full pool refuses a put, copied or
        // written from the tensor, instead of writing entries out (write-behind off, as tier
        // auto sets it while its pool can grow)
        let (_dir, tier, step) = nvme_step_with(256 << 10, |t| t.dirty_bytes = 256 << 10);
        tier.set_defer_writes(true);
        let first = step.put_copy(&[1u8; 200 << 10]).unwrap(); // unwritten, in the pool
        let refused = step.put_copy(&[2u8; 200 << 10]);
        assert!(matches!(refused, Err(Error::PoolExhausted { .. })));
        let n = 100_000;
        let (buf, off) = unaligned(n);
        let (released, src) = source();
        // SAFETY: `buf` outlives the call and is not written meanwhile.
        let direct = unsafe { step.put_direct(buf[off..].as_ptr(), n as u64, src, true) };
        assert!(matches!(direct, Err(Error::PoolExhausted { .. })));
        assert!(
            released.load(Ordering::SeqCst),
            "a refused put holds no source"
        );
        tier.wait_idle().unwrap();
        assert_eq!(step.stats().bytes_written, 0);
        assert_eq!(tier.stats().entries, 1);
        tier.set_defer_writes(false); // the pool cannot grow: write the oldest out
        let second = step.put_copy(&[2u8; 200 << 10]).unwrap();
        tier.wait_idle().unwrap();
        assert!(step.stats().bytes_written >= 200 << 10);
        assert_eq!(first.get().unwrap().as_slice(), &[1u8; 200 << 10][..]);
        assert_eq!(second.get().unwrap().as_slice(), &[2u8; 200 << 10][..]);
    }
}
