//! The swap engine: the NVMe tier's I/O.
//!
//! [`Swap::open`] makes one private, unlinked swap file per directory (Note [private swap
//! files]) and starts an engine: io_uring with the host pool's arenas registered as fixed
//! buffers (`READ_FIXED`/`WRITE_FIXED`) and the swap files as fixed files, or, where io_uring is
//! refused, a pread/pwrite thread pool; the choice is made once, after a probe, with one warning
//! when it falls back. [`Swap::alloc`] cuts a [`Slot`] from the files, striped across the
//! directories in `block_bytes` pieces; [`Swap::write`] and [`Swap::read`] move a whole pool
//! [`Block`] (its `capacity()`, a 4 KiB multiple) to or from a slot asynchronously and return a
//! [`Ticket`], which gives the block back with the result.
//!
//! Requests are split into chunks of at most `block_bytes`, kept in flight up to `queue_depth`
//! chunks across all requests (oldest request first); short transfers are resubmitted for the
//! rest, and errors carry the operation, the swap file and the offset. Requests are not ordered
//! with respect to one another: wait for a write's ticket (or [`Swap::wait_idle`]) before reading
//! its slot.
//!
//! Buffers: a request owns its block until the kernel is done with it (Note [parked blocks]);
//! a request owns a clone of its slot likewise (Note [slot lifetime]). Dropping the `Swap`
//! waits for every request already submitted, then stops the engine.

mod fault;
mod file;
mod slot;
mod threads;
mod ticket;
mod uring;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::extent::GRANULE;
use crate::pool::{Block, Pool};

pub use fault::FaultKind;
pub use slot::{Piece, Slot};
pub use ticket::{Ticket, Watch};

use fault::Faults;
use file::SwapFile;
use slot::Space;
use ticket::Completion;

/// Which backend moves the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineChoice {
    /// io_uring when the probe succeeds, else the thread pool (with one warning).
    #[default]
    Auto,
    /// io_uring or an error.
    IoUring,
    /// The pread/pwrite thread pool.
    Threads,
}

impl std::str::FromStr for EngineChoice {
    type Err = Error;

    /// `auto`, `io_uring` (or `uring`, `io-uring`) and `threads`, as in SPILLOVER_IO_ENGINE.
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(EngineChoice::Auto),
            "io_uring" | "io-uring" | "uring" => Ok(EngineChoice::IoUring),
            "threads" => Ok(EngineChoice::Threads),
            other => Err(Error::Invalid(format!(
                "unknown I/O engine {other:?}: expected io_uring, threads or auto"
            ))),
        }
    }
}

/// How to open a [`Swap`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IoOptions {
    /// One directory per drive; a swap file is made in each and slots are striped across them.
    pub dirs: Vec<PathBuf>,
    pub engine: EngineChoice,
    /// Chunks kept in flight at once (io_uring) / worker threads, at most 8 (threads).
    pub queue_depth: u32,
    /// Largest chunk and stripe unit: a multiple of 4 KiB, at most 1 GiB.
    pub block_bytes: u64,
    /// Accept a directory that refuses O_DIRECT (buffered I/O, with a warning) instead of
    /// failing.
    pub allow_buffered: bool,
    /// Bytes each swap file may grow to; `None`: the file system's free space at open.
    pub capacity_per_dir: Option<u64>,
}

impl Default for IoOptions {
    fn default() -> Self {
        IoOptions {
            dirs: Vec::new(),
            engine: EngineChoice::Auto,
            queue_depth: 32,
            block_bytes: 1 << 20,
            allow_buffered: false,
            capacity_per_dir: None,
        }
    }
}

impl IoOptions {
    pub fn new(dirs: impl IntoIterator<Item = impl Into<PathBuf>>) -> Self {
        IoOptions {
            dirs: dirs.into_iter().map(Into::into).collect(),
            ..IoOptions::default()
        }
    }
}

/// Counters since the swap was opened.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IoStats {
    /// Bytes moved by requests that succeeded.
    pub bytes_written: u64,
    pub bytes_read: u64,
    /// Requests that succeeded.
    pub writes: u64,
    pub reads: u64,
    /// Requests that failed.
    pub failed: u64,
    /// Chunk operations issued (SQEs or syscalls), resubmissions included.
    pub chunk_ops: u64,
    /// Chunk operations that came back short and were resubmitted for the rest.
    pub short_resubmits: u64,
    /// Wall time with at least one request outstanding.
    pub busy_seconds: f64,
    /// Requests submitted and not yet completed.
    pub in_flight: u64,
    /// Swap space: the sum of the directories' capacities, the part held by live slots, and
    /// its peak since open or [`Swap::reset_peak`].
    pub swap_capacity: u64,
    pub swap_in_use: u64,
    pub swap_peak: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    Read,
    Write,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Read => "read",
            Op::Write => "write",
        }
    }
}

/// One contiguous transfer: `len` bytes between the block at `buf_off` and file `file` at
/// `file_off`. At most `block_bytes`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    pub file: u32,
    pub file_off: u64,
    pub buf_off: usize,
    pub len: usize,
}

/// A submitted read or write. Owns its block and a clone of its slot until [`Ctx::finish`].
pub(crate) struct Request {
    pub op: Op,
    pub block: Block,
    pub slot: Slot,
    pub chunks: Vec<Chunk>,
    done: Arc<Completion>,
}

/// What the engines share with the `Swap`.
pub(crate) struct Ctx {
    pub space: Arc<Space>,
    pub faults: Faults,
    bytes_written: AtomicU64,
    bytes_read: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    failed: AtomicU64,
    pub chunk_ops: AtomicU64,
    pub short_resubmits: AtomicU64,
    outstanding: Mutex<Outstanding>,
    idle: Condvar,
}

#[derive(Default)]
struct Outstanding {
    n: u64,
    since: Option<Instant>,
    busy: Duration,
}

impl Ctx {
    fn outstanding(&self) -> MutexGuard<'_, Outstanding> {
        self.outstanding.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn begin(&self) {
        let mut o = self.outstanding();
        if o.n == 0 {
            o.since = Some(Instant::now());
        }
        o.n += 1;
    }

    /// Complete a request: count it and hand its block back (Note [parked blocks]). Engines
    /// call this only once no chunk of the request is in flight.
    pub fn finish(&self, req: Request, result: Result<()>) {
        let bytes: u64 = req.chunks.iter().map(|c| c.len as u64).sum();
        match (&result, req.op) {
            (Ok(()), Op::Write) => {
                self.bytes_written.fetch_add(bytes, Ordering::Relaxed);
                self.writes.fetch_add(1, Ordering::Relaxed);
            }
            (Ok(()), Op::Read) => {
                self.bytes_read.fetch_add(bytes, Ordering::Relaxed);
                self.reads.fetch_add(1, Ordering::Relaxed);
            }
            (Err(_), _) => {
                self.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        let Request {
            block, slot, done, ..
        } = req;
        // The slot may be the last clone: its extents go back before the ticket can see the
        // block, so a caller that waits and then checks the swap usage sees it released.
        drop(slot);
        // Completing under the `outstanding` lock makes the request's end one step for
        // observers: a waiter woken by `complete` that reads `stats()`, and `wait_idle`, both
        // see it counted out, and a block whose ticket was dropped is back in the pool (the
        // last `done` reference drops it here) before `wait_idle` returns.
        let mut o = self.outstanding();
        done.complete(block, result);
        drop(done);
        o.n -= 1;
        if o.n == 0 {
            if let Some(since) = o.since.take() {
                o.busy += since.elapsed();
            }
            self.idle.notify_all();
        }
    }

    /// The error for a chunk operation that failed with `errno` after `done` bytes.
    pub fn chunk_error(&self, op: Op, c: &Chunk, done: usize, errno: i32) -> Error {
        let file = &self.space.files[c.file as usize];
        if errno == libc::ENOSPC {
            return Error::OutOfSpace {
                path: file.dir.clone(),
                need: (c.len - done) as u64,
                free: file::free_bytes(&file.dir).unwrap_or(0),
            };
        }
        self.chunk_io_error(op, c, done, std::io::Error::from_raw_os_error(errno))
    }

    /// The error for a chunk operation that moved 0 bytes (end of file / nothing written).
    pub fn chunk_zero(&self, op: Op, c: &Chunk, done: usize) -> Error {
        let source = match op {
            Op::Read => std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "swap file ended before the slot",
            ),
            Op::Write => std::io::Error::new(std::io::ErrorKind::WriteZero, "wrote 0 bytes"),
        };
        self.chunk_io_error(op, c, done, source)
    }

    fn chunk_io_error(&self, op: Op, c: &Chunk, done: usize, source: std::io::Error) -> Error {
        Error::Io {
            op: op.name(),
            path: self.space.files[c.file as usize].path.clone(),
            offset: c.file_off + done as u64,
            source,
        }
    }
}

/// Aborts the process if an I/O thread unwinds: its requests' buffers may still be owned by
/// the kernel, so neither freeing them nor leaving their waiters hanging is acceptable
/// (Note [parked blocks]). A panic there is a bug in this module.
pub(crate) struct AbortOnPanic(pub &'static str);

impl Drop for AbortOnPanic {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "spillover: the {} panicked with I/O in flight; aborting",
                self.0
            );
            std::process::abort();
        }
    }
}

/// A backend. Each owns its threads; `submit` may be called from any thread.
pub(crate) trait Engine: Send + Sync {
    fn name(&self) -> &'static str;
    /// Start a request; the engine calls [`Ctx::finish`] exactly once for it.
    fn submit(&self, req: Request);
    /// Finish every request already submitted, then stop and join the engine's threads.
    fn shutdown(&mut self);
}

/// The NVMe tier's I/O: swap files, their space, and an engine. Send + Sync; share by `Arc`.
pub struct Swap {
    /// `ManuallyDrop` so a copy inherited by a forked child can be leaked instead of joined
    /// (Note [fork]).
    engine: std::mem::ManuallyDrop<Box<dyn Engine>>,
    /// The process that opened the swap.
    pid: u32,
    ctx: Arc<Ctx>,
    block_bytes: u64,
    warning: Option<String>,
}

impl std::fmt::Debug for Swap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Swap")
            .field("engine", &self.engine_name())
            .field("dirs", &self.dirs())
            .field("stats", &self.stats())
            .finish()
    }
}

impl Swap {
    /// Check every directory, create its private swap file, and start the engine. See the
    /// module docs; errors name the directory and what to do about it.
    pub fn open(opts: &IoOptions, pool: &Pool) -> Result<Swap> {
        validate(opts)?;
        let mut warnings = Vec::new();
        let mut dirs: Vec<PathBuf> = Vec::new();
        for d in &opts.dirs {
            let r = file::resolve_dir(d)?;
            // The same directory twice would count its free space twice.
            if !dirs.contains(&r) {
                dirs.push(r);
            }
        }
        let mut files = Vec::with_capacity(dirs.len());
        let mut capacities = Vec::with_capacity(dirs.len());
        for d in &dirs {
            let opened = SwapFile::create(d, opts.allow_buffered)?;
            warnings.extend(opened.warning);
            let cap = match opts.capacity_per_dir {
                Some(c) => c,
                None => file::free_bytes(d).map_err(|e| Error::Io {
                    op: "statvfs",
                    path: d.clone(),
                    offset: 0,
                    source: e,
                })?,
            };
            if cap < GRANULE {
                return Err(Error::OutOfSpace {
                    path: d.clone(),
                    need: GRANULE,
                    free: cap,
                });
            }
            files.push(opened.file);
            capacities.push(cap);
        }
        let ctx = Arc::new(Ctx {
            space: Arc::new(Space::new(files, &capacities, opts.block_bytes)),
            faults: Faults::default(),
            bytes_written: AtomicU64::new(0),
            bytes_read: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            reads: AtomicU64::new(0),
            failed: AtomicU64::new(0),
            chunk_ops: AtomicU64::new(0),
            short_resubmits: AtomicU64::new(0),
            outstanding: Mutex::new(Outstanding::default()),
            idle: Condvar::new(),
        });
        let engine: Box<dyn Engine> = match opts.engine {
            EngineChoice::Threads => Box::new(threads::ThreadEngine::start(opts, ctx.clone())),
            EngineChoice::IoUring => {
                let (e, w) = uring::UringEngine::start(opts, ctx.clone(), pool).map_err(|e| {
                    Error::Invalid(format!(
                        "the io_uring I/O engine was asked for but is unavailable: {}; \
                         set SPILLOVER_IO_ENGINE=threads (or auto)",
                        uring::explain(&e)
                    ))
                })?;
                warnings.extend(w);
                Box::new(e)
            }
            EngineChoice::Auto => match uring::UringEngine::start(opts, ctx.clone(), pool) {
                Ok((e, w)) => {
                    warnings.extend(w);
                    Box::new(e)
                }
                Err(e) => {
                    warnings.push(format!(
                        "spillover: io_uring is unavailable ({}); the NVMe tier uses a \
                         pread/pwrite thread pool instead, which costs more CPU per byte",
                        uring::explain(&e)
                    ));
                    Box::new(threads::ThreadEngine::start(opts, ctx.clone()))
                }
            },
        };
        Ok(Swap {
            engine: std::mem::ManuallyDrop::new(engine),
            pid: std::process::id(),
            ctx,
            block_bytes: opts.block_bytes,
            warning: (!warnings.is_empty()).then(|| warnings.join("\n")),
        })
    }

    /// `"io_uring"` or `"threads"`.
    pub fn engine_name(&self) -> &'static str {
        self.engine.name()
    }

    /// The one warning to show, if the swap runs degraded (io_uring refused, fixed buffers
    /// refused, buffered I/O): what happened and why.
    pub fn warning(&self) -> Option<&str> {
        self.warning.as_deref()
    }

    /// The directories in use, resolved, in striping order.
    pub fn dirs(&self) -> Vec<PathBuf> {
        self.ctx.space.files.iter().map(|f| f.dir.clone()).collect()
    }

    /// Whether every swap file uses O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.ctx.space.files.iter().all(|f| f.direct)
    }

    pub fn block_bytes(&self) -> u64 {
        self.block_bytes
    }

    /// Reserve space for `nbytes` (> 0, rounded up to 4 KiB). Fails with
    /// [`Error::OutOfSpace`] when the directories' capacities are used up or the file system
    /// refuses to reserve the space.
    pub fn alloc(&self, nbytes: u64) -> Result<Slot> {
        self.ctx.space.alloc(nbytes)
    }

    /// Write the whole block (`block.capacity()` bytes) to the start of `slot`.
    pub fn write(&self, block: Block, slot: &Slot) -> Ticket {
        self.request(Op::Write, block, slot)
    }

    /// Read the start of `slot` into the whole block (`block.capacity()` bytes).
    pub fn read(&self, slot: &Slot, block: Block) -> Ticket {
        self.request(Op::Read, block, slot)
    }

    fn request(&self, op: Op, block: Block, slot: &Slot) -> Ticket {
        let done = Completion::new();
        let ticket = Ticket::new(done.clone());
        if self.forked() {
            let msg = "this swap engine belongs to the parent process (it was inherited through \
                       fork); a forked child must open its own offload context";
            done.complete(block, Err(Error::Invalid(msg.into())));
            return ticket;
        }
        let chunks = match self.chunks(&block, slot) {
            Ok(c) => c,
            Err(e) => {
                done.complete(block, Err(e));
                return ticket;
            }
        };
        self.ctx.begin();
        self.engine.submit(Request {
            op,
            block,
            slot: slot.clone(),
            chunks,
            done,
        });
        ticket
    }

    fn chunks(&self, block: &Block, slot: &Slot) -> Result<Vec<Chunk>> {
        if !slot.belongs_to(&self.ctx.space) {
            return Err(Error::Invalid(
                "swap slot belongs to another Swap instance".into(),
            ));
        }
        let cap = block.capacity() as u64;
        if slot.capacity() < cap {
            return Err(Error::Invalid(format!(
                "a {cap}-byte block does not fit a {}-byte swap slot",
                slot.capacity()
            )));
        }
        let mut chunks = Vec::with_capacity(slot.pieces().len());
        let mut at = 0u64;
        for p in slot.pieces() {
            if at == cap {
                break;
            }
            let mut off = 0;
            while off < p.extent.len && at < cap {
                let len = (p.extent.len - off).min(cap - at).min(self.block_bytes);
                chunks.push(Chunk {
                    file: p.file,
                    file_off: p.extent.offset + off,
                    buf_off: at as usize,
                    len: len as usize,
                });
                off += len;
                at += len;
            }
        }
        Ok(chunks)
    }

    /// Wait until every request submitted so far has completed.
    pub fn wait_idle(&self) {
        let mut o = self.ctx.outstanding();
        while o.n > 0 {
            o = self.ctx.idle.wait(o).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn stats(&self) -> IoStats {
        let c = &self.ctx;
        let (busy, in_flight) = {
            let o = c.outstanding();
            let running = o.since.map_or(Duration::ZERO, |s| s.elapsed());
            (o.busy + running, o.n)
        };
        let space = c.space.stats();
        IoStats {
            bytes_written: c.bytes_written.load(Ordering::Relaxed),
            bytes_read: c.bytes_read.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            reads: c.reads.load(Ordering::Relaxed),
            failed: c.failed.load(Ordering::Relaxed),
            chunk_ops: c.chunk_ops.load(Ordering::Relaxed),
            short_resubmits: c.short_resubmits.load(Ordering::Relaxed),
            busy_seconds: busy.as_secs_f64(),
            in_flight,
            swap_capacity: space.capacity,
            swap_in_use: space.in_use,
            swap_peak: space.peak,
        }
    }

    /// Start a new swap-space peak measurement from the current use.
    pub fn reset_peak(&self) {
        self.ctx.space.reset_peak();
    }

    /// For tests: make the next `count` chunk operations of `kind` fail with `errno` (or, for
    /// [`FaultKind::ShortIo`], come back short). `count = 0` disarms that kind. A request whose
    /// chunk fails completes with the mapped error ([`Error::Io`], or [`Error::OutOfSpace`] for
    /// ENOSPC) after its other chunks in flight have finished.
    pub fn inject_fault(&self, kind: FaultKind, errno: i32, count: u32) {
        self.ctx.faults.inject(kind, errno, count);
    }
}

// Note [fork]: a child made by fork() inherits the Swap's memory but not its engine threads,
// while the ring, the files and any in-flight requests still belong to the parent. The child
// must neither submit (nothing would ever complete the request) nor join threads that do not
// exist in it (a hang at exit), so both check the pid and the child leaks its copy. Guarded by
// tests/python/test_hardening.py::test_fork_child_does_not_touch_the_engine.
impl Swap {
    fn forked(&self) -> bool {
        std::process::id() != self.pid
    }
}

impl Drop for Swap {
    fn drop(&mut self) {
        if self.forked() {
            return; // the engine is leaked, never joined: Note [fork]
        }
        self.engine.shutdown();
        // SAFETY: `engine` is dropped exactly once, here, and never used again.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.engine) };
    }
}

fn validate(opts: &IoOptions) -> Result<()> {
    if opts.dirs.is_empty() {
        return Err(Error::Invalid(
            "no swap directory given: set SPILLOVER_NVME_PATH to one directory per drive".into(),
        ));
    }
    if opts.queue_depth == 0 || opts.queue_depth > 4096 {
        return Err(Error::Invalid(format!(
            "I/O queue depth must be 1..=4096, got {} (SPILLOVER_IO_QUEUE_DEPTH)",
            opts.queue_depth
        )));
    }
    let b = opts.block_bytes;
    if b == 0 || b % GRANULE != 0 || b > 1 << 30 {
        return Err(Error::Invalid(format!(
            "I/O block size must be a multiple of 4 KiB up to 1 GiB, got {b} bytes \
             (SPILLOVER_IO_BLOCK_BYTES)"
        )));
    }
    Ok(())
}
