//! The fallback backend: worker threads doing chunk `pread`/`pwrite`, for where io_uring is
//! refused (containers' seccomp profiles, `kernel.io_uring_disabled`, old kernels).
//!
//! `min(queue_depth, 8)` workers take chunks from one FIFO queue, so at most that many chunks
//! are in flight. A request's block stays in the request until its last chunk is done (Note
//! [parked blocks]); the worker finishing that chunk completes the request.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

use super::fault::Injected;
use super::{AbortOnPanic, Chunk, Ctx, Engine, IoOptions, Op, Request};
use crate::error::{Error, Result};

pub(crate) struct ThreadEngine {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
}

struct Shared {
    queue: Mutex<Queue>,
    cv: Condvar,
    ctx: Arc<Ctx>,
}

struct Queue {
    jobs: VecDeque<Job>,
    shutdown: bool,
}

struct Job {
    req: Arc<Pending>,
    chunk: usize,
}

/// A request while its chunks are being worked on.
struct Pending {
    op: Op,
    /// The block's address (the block itself is in `state.req`, which keeps it alive).
    base: usize,
    chunks: Vec<Chunk>,
    /// Set at the first error: the remaining chunks are skipped.
    failed: AtomicBool,
    state: Mutex<PendingState>,
}

struct PendingState {
    req: Option<Request>,
    remaining: usize,
    error: Option<Error>,
}

impl Shared {
    fn queue(&self) -> MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl ThreadEngine {
    pub fn start(opts: &IoOptions, ctx: Arc<Ctx>) -> ThreadEngine {
        let shared = Arc::new(Shared {
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                shutdown: false,
            }),
            cv: Condvar::new(),
            ctx,
        });
        let n = opts.queue_depth.clamp(1, 8);
        let workers = (0..n)
            .map(|i| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("spillover-io-{i}"))
                    .spawn(move || worker(&s))
                    .expect("spawn an I/O worker thread")
            })
            .collect();
        ThreadEngine { shared, workers }
    }
}

impl Engine for ThreadEngine {
    fn name(&self) -> &'static str {
        "threads"
    }

    fn submit(&self, req: Request) {
        if req.chunks.is_empty() {
            self.shared.ctx.finish(req, Ok(()));
            return;
        }
        let n = req.chunks.len();
        let pending = Arc::new(Pending {
            op: req.op,
            base: req.block.as_ptr() as usize,
            chunks: req.chunks.clone(),
            failed: AtomicBool::new(false),
            state: Mutex::new(PendingState {
                req: Some(req),
                remaining: n,
                error: None,
            }),
        });
        let mut q = self.shared.queue();
        q.jobs.extend((0..n).map(|chunk| Job {
            req: pending.clone(),
            chunk,
        }));
        drop(q);
        if n == 1 {
            self.shared.cv.notify_one();
        } else {
            self.shared.cv.notify_all();
        }
    }

    fn shutdown(&mut self) {
        self.shared.queue().shutdown = true;
        self.shared.cv.notify_all();
        for w in self.workers.drain(..) {
            // A worker that panicked has already aborted the process (AbortOnPanic).
            let _ = w.join();
        }
    }
}

impl Drop for ThreadEngine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn worker(s: &Shared) {
    let _guard = AbortOnPanic("pread/pwrite worker");
    loop {
        let job = {
            let mut q = s.queue();
            loop {
                if let Some(j) = q.jobs.pop_front() {
                    break j;
                }
                if q.shutdown {
                    return;
                }
                q = s.cv.wait(q).unwrap_or_else(|e| e.into_inner());
            }
        };
        let p = &job.req;
        let result = if p.failed.load(Ordering::Relaxed) {
            Ok(())
        } else {
            transfer(&s.ctx, p, job.chunk)
        };
        let mut st = p.state.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = result {
            p.failed.store(true, Ordering::Relaxed);
            st.error.get_or_insert(e);
        }
        st.remaining -= 1;
        if st.remaining == 0 {
            let req = st.req.take().expect("a request completes once");
            let res = st.error.take().map_or(Ok(()), Err);
            drop(st);
            s.ctx.finish(req, res);
        }
    }
}

/// Move one chunk, resubmitting after short transfers and EINTR/EAGAIN.
fn transfer(ctx: &Ctx, p: &Pending, i: usize) -> Result<()> {
    let c = &p.chunks[i];
    let fd = ctx.space.files[c.file as usize].raw_fd();
    let mut done = 0usize;
    while done < c.len {
        let mut len = c.len - done;
        match ctx.faults.take(p.op, len) {
            Some(Injected::Errno(e)) => return Err(ctx.chunk_error(p.op, c, done, e)),
            Some(Injected::Short(n)) => len = n,
            None => {}
        }
        let buf = (p.base + c.buf_off + done) as *mut u8;
        let off = (c.file_off + done as u64) as libc::off_t;
        ctx.chunk_ops.fetch_add(1, Ordering::Relaxed);
        let r = match p.op {
            // SAFETY: `buf..buf+len` lies inside the request's block (chunks are cut from its
            // capacity), which the request owns and keeps alive until this chunk is counted
            // done; chunks of one request are disjoint, so nothing else touches these bytes.
            Op::Read => unsafe { libc::pread(fd, buf.cast(), len, off) },
            // SAFETY: as for the read; pwrite only reads the bytes.
            Op::Write => unsafe { libc::pwrite(fd, buf.cast_const().cast(), len, off) },
        };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EINTR | libc::EAGAIN) => continue,
                Some(errno) => return Err(ctx.chunk_error(p.op, c, done, errno)),
                None => return Err(ctx.chunk_error(p.op, c, done, libc::EIO)),
            }
        }
        if r == 0 {
            return Err(ctx.chunk_zero(p.op, c, done));
        }
        done += r as usize;
        if done < c.len {
            ctx.short_resubmits.fetch_add(1, Ordering::Relaxed);
        }
    }
    Ok(())
}
