//! The io_uring backend: one thread owns the ring, takes requests from a queue (woken through an
//! eventfd read kept armed in the ring), keeps up to `queue_depth` chunk SQEs in flight, and
//! completes requests from their CQEs.
//!
//! The host pool's arenas are registered as fixed buffers, so a chunk of a pool block is a
//! `READ_FIXED`/`WRITE_FIXED` (no page pinning per I/O); the swap files are registered as fixed
//! files (`types::Fixed`, no fd lookup per I/O). Either registration may be refused (fixed
//! buffers count against RLIMIT_MEMLOCK without CAP_IPC_LOCK): then plain `READ`/`WRITE` and
//! `types::Fd` are used, with a warning for the buffers.
//!
//! The ring is set up inside its thread (so `IORING_SETUP_SINGLE_ISSUER` holds), and the thread
//! reports the probe's outcome before it starts serving.

use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

use io_uring::{opcode, register, squeue, types, IoUring};

use super::fault::Injected;
use super::{AbortOnPanic, Ctx, Engine, IoOptions, Op, Request};
use crate::pool::{Block, Pool};

/// user_data of the eventfd read that wakes the ring thread for new requests.
const WAKE: u64 = u64::MAX;
/// user_data of the cancellation of that read at shutdown.
const CANCEL: u64 = u64::MAX - 1;
/// The kernel's limit on registered buffers (IORING_MAX_REG_BUFFERS).
const MAX_REG_BUFFERS: usize = 1 << 14;

/// Why io_uring could not be used: the step that failed and the kernel's answer.
#[derive(Debug)]
pub(crate) struct SetupError {
    op: &'static str,
    source: io::Error,
}

/// A sentence for the warning or error: what failed, and the usual cause.
pub(crate) fn explain(e: &SetupError) -> String {
    let cause = match e.source.raw_os_error() {
        Some(libc::EPERM) => {
            "; usually a seccomp profile (Docker's and containerd's default) or \
             kernel.io_uring_disabled=2"
        }
        Some(libc::ENOSYS) => {
            "; the kernel is older than 5.1, built without io_uring, or a seccomp profile \
             hides it"
        }
        Some(libc::ENOMEM) => "; RLIMIT_MEMLOCK may be too low for the ring (kernels before 5.12)",
        _ => "",
    };
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| s != "0")
        .map(|s| format!(" (kernel.io_uring_disabled = {s})"))
        .unwrap_or_default();
    format!("{}: {}{cause}{sysctl}", e.op, e.source)
}

pub(crate) struct UringEngine {
    incoming: Arc<Incoming>,
    thread: Option<JoinHandle<()>>,
}

/// Requests handed to the ring thread, and the eventfd that wakes it.
struct Incoming {
    state: Mutex<IncomingState>,
    efd: OwnedFd,
}

struct IncomingState {
    reqs: VecDeque<Request>,
    shutdown: bool,
}

impl Incoming {
    fn state(&self) -> MutexGuard<'_, IncomingState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn wake(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a local u64 to our eventfd. It can only fail with EAGAIN
        // when the counter is near overflow, and then the ring thread is already due to wake.
        unsafe { libc::write(self.efd.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

impl UringEngine {
    /// Probe io_uring (setup, opcode probe, registrations) on a new ring thread and start it.
    /// Returns the engine and, when fixed buffers were refused, a warning.
    pub fn start(
        opts: &IoOptions,
        ctx: Arc<Ctx>,
        pool: &Pool,
    ) -> Result<(UringEngine, Option<String>), SetupError> {
        // SAFETY: eventfd takes no pointers; the result is checked.
        let efd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
        if efd < 0 {
            return Err(SetupError {
                op: "eventfd",
                source: io::Error::last_os_error(),
            });
        }
        let incoming = Arc::new(Incoming {
            state: Mutex::new(IncomingState {
                reqs: VecDeque::new(),
                shutdown: false,
            }),
            // SAFETY: `efd` was just created and is owned by nothing else.
            efd: unsafe { OwnedFd::from_raw_fd(efd) },
        });
        let (tx, rx) = mpsc::sync_channel(1);
        let qd = opts.queue_depth as usize;
        let inc = incoming.clone();
        let pool = pool.clone();
        let thread = std::thread::Builder::new()
            .name("spillover-uring".into())
            .spawn(move || {
                let _guard = AbortOnPanic("io_uring thread");
                match Driver::setup(qd, ctx, inc, pool) {
                    Ok((mut driver, warning)) => {
                        let _ = tx.send(Ok(warning));
                        driver.run();
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| SetupError {
                op: "spawn the io_uring thread",
                source: e,
            })?;
        match rx.recv() {
            Ok(Ok(warning)) => Ok((
                UringEngine {
                    incoming,
                    thread: Some(thread),
                },
                warning,
            )),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(SetupError {
                    op: "io_uring thread",
                    source: io::Error::other("exited during setup"),
                })
            }
        }
    }
}

impl Engine for UringEngine {
    fn name(&self) -> &'static str {
        "io_uring"
    }

    fn submit(&self, req: Request) {
        self.incoming.state().reqs.push_back(req);
        self.incoming.wake();
    }

    fn shutdown(&mut self) {
        if let Some(t) = self.thread.take() {
            self.incoming.state().shutdown = true;
            self.incoming.wake();
            // A panicking ring thread aborts the process (AbortOnPanic), so join returns Ok.
            let _ = t.join();
        }
    }
}

impl Drop for UringEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// A request inside the ring thread.
struct Inflight {
    req: Request,
    base: *mut u8,
    /// Fixed-buffer index when the block lies in a registered arena.
    buf_index: Option<u16>,
    /// Bytes done per chunk.
    done: Vec<usize>,
    /// Next chunk never submitted.
    next: usize,
    /// Chunks to submit again from `done[i]` (short transfer, EAGAIN).
    redo: Vec<usize>,
    /// SQEs (or injected failures) not yet completed.
    pending: usize,
    error: Option<crate::error::Error>,
    /// In `Driver::order`.
    queued: bool,
}

impl Inflight {
    fn has_work(&self) -> bool {
        self.error.is_none() && (!self.redo.is_empty() || self.next < self.req.chunks.len())
    }
}

struct Driver {
    // Dropped first: the ring goes before the buffers it had registered and the eventfd.
    ring: IoUring,
    ctx: Arc<Ctx>,
    incoming: Arc<Incoming>,
    _pool: Pool,
    fixed_files: bool,
    /// Registered arenas `(base, len)`, by fixed-buffer index; empty when not registered.
    buffers: Vec<(usize, usize)>,
    qd: usize,
    slab: Vec<Option<Inflight>>,
    free_ids: Vec<usize>,
    live: usize,
    /// Requests with chunks left to submit, oldest first.
    order: VecDeque<usize>,
    /// Chunk SQEs pushed and not yet completed (injected failures included).
    in_flight: usize,
    /// Completions made up without the kernel (injected faults), handled before blocking.
    synthetic: Vec<(u64, i32)>,
    /// Reused buffer for reaped completions.
    cqes: Vec<(u64, i32)>,
    wake_buf: Box<u64>,
    wake_armed: bool,
    shutdown: bool,
}

fn step<T>(op: &'static str, r: io::Result<T>) -> Result<T, SetupError> {
    r.map_err(|source| SetupError { op, source })
}

impl Driver {
    fn setup(
        qd: usize,
        ctx: Arc<Ctx>,
        incoming: Arc<Incoming>,
        pool: Pool,
    ) -> Result<(Driver, Option<String>), SetupError> {
        // Room for every chunk in flight, the wake-up read and its cancellation.
        let entries = (qd as u32 + 4).next_power_of_two();
        // Flags that save work on newer kernels; older ones answer EINVAL.
        let ring = match IoUring::builder()
            .setup_coop_taskrun()
            .setup_single_issuer()
            .build(entries)
        {
            Ok(r) => r,
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                step("io_uring_setup", IoUring::new(entries))?
            }
            Err(e) => {
                return Err(SetupError {
                    op: "io_uring_setup",
                    source: e,
                })
            }
        };
        let mut probe = register::Probe::new();
        step(
            "io_uring opcode probe (needs Linux 5.6+)",
            ring.submitter().register_probe(&mut probe),
        )?;
        for (code, name) in [
            (opcode::Read::CODE, "IORING_OP_READ"),
            (opcode::Write::CODE, "IORING_OP_WRITE"),
            (opcode::ReadFixed::CODE, "IORING_OP_READ_FIXED"),
            (opcode::WriteFixed::CODE, "IORING_OP_WRITE_FIXED"),
            (opcode::AsyncCancel::CODE, "IORING_OP_ASYNC_CANCEL"),
        ] {
            if !probe.is_supported(code) {
                return Err(SetupError {
                    op: name,
                    source: io::Error::from_raw_os_error(libc::EOPNOTSUPP),
                });
            }
        }
        let fds: Vec<RawFd> = ctx.space.files.iter().map(|f| f.raw_fd()).collect();
        let fixed_files = ring.submitter().register_files(&fds).is_ok();

        let arenas = pool.arenas();
        let iovecs: Vec<libc::iovec> = arenas
            .iter()
            .map(|&(base, len)| libc::iovec {
                iov_base: base as *mut libc::c_void,
                iov_len: len,
            })
            .collect();
        let mut warning = None;
        let registered = if iovecs.len() > MAX_REG_BUFFERS {
            Err(io::Error::from_raw_os_error(libc::EINVAL))
        } else {
            // SAFETY: every iovec is a whole arena of `pool`; `Driver` holds a clone of the
            // pool, so the arenas stay mapped for as long as the ring (dropped first) exists.
            unsafe { ring.submitter().register_buffers(&iovecs) }
        };
        let buffers = match registered {
            Ok(()) => arenas,
            Err(e) => {
                warning = Some(format!(
                    "spillover: io_uring could not register the {}-byte host pool as fixed \
                     buffers ({e}); using plain READ/WRITE, which pins pages on every I/O. \
                     Raise RLIMIT_MEMLOCK (`ulimit -l unlimited`, --ulimit memlock=-1) to fix.",
                    pool.capacity()
                ));
                Vec::new()
            }
        };
        let driver = Driver {
            ring,
            ctx,
            incoming,
            _pool: pool,
            fixed_files,
            buffers,
            qd,
            slab: Vec::new(),
            free_ids: Vec::new(),
            live: 0,
            order: VecDeque::new(),
            in_flight: 0,
            synthetic: Vec::new(),
            cqes: Vec::with_capacity(2 * entries as usize),
            wake_buf: Box::new(0),
            wake_armed: false,
            shutdown: false,
        };
        Ok((driver, warning))
    }

    fn run(&mut self) {
        loop {
            self.take_incoming();
            self.fill();
            if !self.synthetic.is_empty() {
                for (ud, res) in std::mem::take(&mut self.synthetic) {
                    self.complete(ud, res);
                }
                continue;
            }
            if self.shutdown && self.live == 0 {
                break;
            }
            if !self.wake_armed {
                self.arm_wake();
            }
            self.enter(1);
            self.reap();
        }
        // Take the wake-up read back before the ring (and `wake_buf`) go away.
        if self.wake_armed {
            let cancel = opcode::AsyncCancel::new(WAKE).build().user_data(CANCEL);
            // SAFETY: a cancellation references no memory.
            unsafe { self.push(&cancel) };
            while self.wake_armed {
                self.enter(1);
                self.reap();
            }
        }
    }

    fn take_incoming(&mut self) {
        let (reqs, shutdown) = {
            let mut st = self.incoming.state();
            (std::mem::take(&mut st.reqs), st.shutdown)
        };
        self.shutdown = shutdown;
        for req in reqs {
            self.admit(req);
        }
    }

    fn admit(&mut self, req: Request) {
        if req.chunks.is_empty() {
            self.ctx.finish(req, Ok(()));
            return;
        }
        let f = Inflight {
            base: req.block.as_ptr(),
            buf_index: self.buf_index(&req.block),
            done: vec![0; req.chunks.len()],
            next: 0,
            redo: Vec::new(),
            pending: 0,
            error: None,
            queued: true,
            req,
        };
        let id = match self.free_ids.pop() {
            Some(id) => {
                self.slab[id] = Some(f);
                id
            }
            None => {
                self.slab.push(Some(f));
                self.slab.len() - 1
            }
        };
        self.live += 1;
        self.order.push_back(id);
    }

    fn buf_index(&self, b: &Block) -> Option<u16> {
        let i = b.arena_index() as usize;
        let &(base, len) = self.buffers.get(i)?;
        let p = b.as_ptr() as usize;
        (p >= base && p + b.capacity() <= base + len).then_some(i as u16)
    }

    /// Push chunk SQEs, oldest request first, until `qd` are in flight.
    fn fill(&mut self) {
        while self.in_flight < self.qd {
            let Some(&id) = self.order.front() else {
                break;
            };
            let f = self.slab[id].as_mut().expect("queued request is live");
            if !f.has_work() {
                f.queued = false;
                self.order.pop_front();
                continue;
            }
            let i = match f.redo.pop() {
                Some(i) => i,
                None => {
                    f.next += 1;
                    f.next - 1
                }
            };
            self.submit_chunk(id, i);
        }
    }

    fn submit_chunk(&mut self, id: usize, i: usize) {
        let f = self.slab[id].as_mut().expect("live request");
        let op = f.req.op;
        let c = f.req.chunks[i];
        let done = f.done[i];
        let mut len = c.len - done;
        let ud = ((id as u64) << 32) | i as u64;
        f.pending += 1;
        self.in_flight += 1;
        match self.ctx.faults.take(op, len) {
            Some(Injected::Errno(e)) => {
                self.synthetic.push((ud, -e));
                return;
            }
            Some(Injected::Short(n)) => len = n,
            None => {}
        }
        // SAFETY: the chunk lies inside the block (chunks are cut from its capacity).
        let buf = unsafe { f.base.add(c.buf_off + done) };
        let off = c.file_off + done as u64;
        let len = len as u32; // chunks are at most block_bytes <= 1 GiB
        let bi = f.buf_index;
        macro_rules! rw {
            ($fd:expr) => {
                match (op, bi) {
                    (Op::Read, Some(b)) => {
                        opcode::ReadFixed::new($fd, buf, len, b).offset(off).build()
                    }
                    (Op::Read, None) => opcode::Read::new($fd, buf, len).offset(off).build(),
                    (Op::Write, Some(b)) => opcode::WriteFixed::new($fd, buf.cast_const(), len, b)
                        .offset(off)
                        .build(),
                    (Op::Write, None) => opcode::Write::new($fd, buf.cast_const(), len)
                        .offset(off)
                        .build(),
                }
            };
        }
        let sqe = if self.fixed_files {
            rw!(types::Fixed(c.file))
        } else {
            rw!(types::Fd(self.ctx.space.files[c.file as usize].raw_fd()))
        }
        .user_data(ud);
        self.ctx.chunk_ops.fetch_add(1, Ordering::Relaxed);
        // SAFETY: Note [parked blocks]: the request (and so its block, its slot and the swap
        // files through `ctx`) stays in the slab until this SQE's CQE has been reaped; the
        // buffer index, when given, names the registered arena that contains `buf..buf+len`.
        unsafe { self.push(&sqe) };
    }

    fn arm_wake(&mut self) {
        let buf: *mut u64 = &mut *self.wake_buf;
        let sqe = opcode::Read::new(types::Fd(self.incoming.efd.as_raw_fd()), buf.cast(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: `wake_buf` is a heap u64 owned by the driver, which stays alive until this
        // read's CQE is reaped (`run` cancels and reaps it before returning); the eventfd is
        // owned by `incoming`, which the driver holds.
        unsafe { self.push(&sqe) };
        self.wake_armed = true;
    }

    /// # Safety
    /// Whatever `sqe` points at must stay valid until its completion is reaped.
    unsafe fn push(&mut self, sqe: &squeue::Entry) {
        loop {
            // SAFETY: the caller's promise.
            if unsafe { self.ring.submission().push(sqe) }.is_ok() {
                return;
            }
            // Full (cannot happen with the sizing in `setup`, but is harmless): hand the
            // queued SQEs to the kernel and retry.
            self.enter(0);
        }
    }

    fn enter(&mut self, want: usize) {
        match self.ring.submit_and_wait(want) {
            Ok(_) => {}
            Err(e) => match e.raw_os_error() {
                Some(libc::EINTR) => {}
                // Short of memory or completion room for now: what is queued stays queued.
                Some(libc::EAGAIN | libc::EBUSY) => {
                    std::thread::sleep(std::time::Duration::from_micros(200))
                }
                // The ring is unusable while the kernel may still own buffers: there is no safe
                // way to continue (Note [parked blocks]); AbortOnPanic aborts the process.
                _ => panic!("io_uring_enter failed: {e}"),
            },
        }
    }

    fn reap(&mut self) {
        let mut cqes = std::mem::take(&mut self.cqes);
        cqes.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
        for &(ud, res) in &cqes {
            self.complete(ud, res);
        }
        cqes.clear();
        self.cqes = cqes;
    }

    fn complete(&mut self, ud: u64, res: i32) {
        match ud {
            WAKE => {
                self.wake_armed = false;
                return;
            }
            CANCEL => return,
            _ => {}
        }
        let id = (ud >> 32) as usize;
        let i = (ud & 0xffff_ffff) as usize;
        self.in_flight -= 1;
        let f = self.slab[id]
            .as_mut()
            .expect("completion for a live request");
        f.pending -= 1;
        let c = f.req.chunks[i];
        let op = f.req.op;
        let mut retry = false;
        if res < 0 {
            let errno = -res;
            if matches!(errno, libc::EINTR | libc::EAGAIN) {
                retry = true;
            } else if f.error.is_none() {
                f.error = Some(self.ctx.chunk_error(op, &c, f.done[i], errno));
            }
        } else if res == 0 {
            if f.error.is_none() {
                f.error = Some(self.ctx.chunk_zero(op, &c, f.done[i]));
            }
        } else {
            f.done[i] += res as usize;
            if f.done[i] < c.len {
                self.ctx.short_resubmits.fetch_add(1, Ordering::Relaxed);
                retry = true;
            }
        }
        if retry && f.error.is_none() {
            f.redo.push(i);
            if !f.queued {
                f.queued = true;
                self.order.push_back(id);
            }
        }
        if f.pending == 0 && !f.has_work() {
            self.finish(id);
        }
    }

    fn finish(&mut self, id: usize) {
        let f = self.slab[id].take().expect("live request");
        if f.queued {
            self.order.retain(|&x| x != id);
        }
        self.free_ids.push(id);
        self.live -= 1;
        let res = f.error.map_or(Ok(()), Err);
        self.ctx.finish(f.req, res);
    }
}
