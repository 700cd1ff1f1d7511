//! [`Ticket`]: the caller's half of a request, which gives the block back with the result.
//!
//! # Note [parked blocks]
//! A request owns its block from submission until every chunk of it has completed in the
//! kernel (or in a worker thread); only then is the block put into the ticket's completion.
//! Dropping a ticket therefore never frees memory the kernel may still write: the engine keeps
//! the block (it is "parked" in the request) and, at completion, finds no one waiting, so the
//! block drops there and returns to the pool. The I/O itself is not cancelled. (The same idea
//! as tokio-uring's `Lifecycle::Ignored`, except that here the engine owned the block all along.)

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use crate::error::Result;
use crate::pool::Block;

type Outcome = (Block, Result<()>);

pub(crate) struct Completion {
    outcome: Mutex<Option<Outcome>>,
    done: AtomicBool,
    cv: Condvar,
}

impl Completion {
    pub fn new() -> Arc<Completion> {
        Arc::new(Completion {
            outcome: Mutex::new(None),
            done: AtomicBool::new(false),
            cv: Condvar::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Option<Outcome>> {
        self.outcome.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Hand the block back. Called once, when no chunk of the request is in flight any more.
    pub fn complete(&self, block: Block, result: Result<()>) {
        let mut g = self.lock();
        debug_assert!(g.is_none(), "a request completed twice");
        *g = Some((block, result));
        self.done.store(true, Ordering::Release);
        self.cv.notify_all();
    }
}

/// An asynchronous read or write in progress. [`Ticket::wait`] gives the block back with the
/// result; dropping the ticket lets the I/O finish and returns the block to the pool then
/// (Note [parked blocks]).
#[must_use = "dropping a ticket does not cancel the I/O, but its result is lost"]
pub struct Ticket {
    c: Arc<Completion>,
}

impl Ticket {
    pub(crate) fn new(c: Arc<Completion>) -> Ticket {
        Ticket { c }
    }

    /// Whether the I/O has finished (then `wait` returns at once).
    pub fn is_done(&self) -> bool {
        self.c.done.load(Ordering::Acquire)
    }

    /// Block until the I/O has finished, up to `timeout`; true when it has.
    pub fn wait_timeout(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut g = self.c.lock();
        while g.is_none() {
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            g = self
                .c
                .cv
                .wait_timeout(g, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }

    /// A handle that can wait for this request without owning it: lets a caller wait for a
    /// ticket that another structure holds, outside that structure's lock.
    pub fn watch(&self) -> Watch {
        Watch { c: self.c.clone() }
    }

    /// Block until the I/O has finished; the block comes back whatever the result. On error
    /// the block's contents are unspecified (a read may have filled part of it).
    pub fn wait(self) -> (Block, Result<()>) {
        let mut g = self.c.lock();
        loop {
            if let Some(outcome) = g.take() {
                return outcome;
            }
            g = self.c.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ticket")
            .field("done", &self.is_done())
            .finish()
    }
}

/// Waits for a request without taking its outcome (see [`Ticket::watch`]).
#[derive(Clone)]
pub struct Watch {
    c: Arc<Completion>,
}

impl Watch {
    pub fn is_done(&self) -> bool {
        self.c.done.load(Ordering::Acquire)
    }

    /// Block until the request has completed; its ticket's `wait` then returns at once.
    pub fn wait_done(&self) {
        let mut g = self.c.lock();
        while g.is_none() && !self.is_done() {
            g = self.c.cv.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }
}
