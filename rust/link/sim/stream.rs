//! The simulated device's streams and events (Note [the simulated device] in `mod.rs`): an
//! event's records and what fired, the waits a lagging compute stream deferred, and each
//! stream's worker thread running its queue of copies, records and waits in order.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::super::device::Keep;
use super::Fault;

#[derive(Default)]
pub(super) struct EvState {
    /// Records so far, and how many of them have fired.
    pub(super) recorded: u64,
    pub(super) fired: u64,
    /// When the latest record fires, for a record on the compute stream.
    pub(super) due: Option<Instant>,
    /// The latest record is on a stream that only ever copied to the host (Note [the
    /// simulated device]: a lagging compute stream's wait for it does not hold the host).
    pub(super) to_host: bool,
    /// For a record on the compute stream: the waits deferred before it (Note [the simulated
    /// device]), which it fires only after.
    pub(super) deps: Vec<Dep>,
    pub(super) error: Option<String>,
}

/// A record of an event (the event, its record's number), which a wait is for.
pub(super) type Dep = (Arc<SimEvent>, u64);

pub(super) fn deps_fired(deps: &[Dep]) -> bool {
    deps.iter().all(|(e, seq)| e.lock().fired >= *seq)
}

pub(super) struct SimEvent {
    pub(super) st: Mutex<EvState>,
    pub(super) cv: Condvar,
}

impl SimEvent {
    pub(super) fn lock(&self) -> MutexGuard<'_, EvState> {
        self.st.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn fire(&self, seq: u64, error: Option<String>) {
        let mut st = self.lock();
        st.fired = st.fired.max(seq);
        if error.is_some() {
            st.error = error;
        }
        drop(st);
        self.cv.notify_all();
    }

    /// Block until record `seq` fired (or its due time passed and the waits deferred before
    /// it ran, on the compute stream).
    pub(super) fn wait_for(&self, seq: u64, due: Option<Instant>) {
        if let Some(due) = due {
            let now = Instant::now();
            if due > now {
                std::thread::sleep(due - now);
            }
            let deps = self.lock().deps.clone();
            for (e, s) in deps {
                e.wait_for(s, None);
            }
            return;
        }
        let mut st = self.lock();
        while st.fired < seq {
            st = self.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }
}

pub(super) enum Op {
    Copy {
        dst: u64,
        src: u64,
        nbytes: u64,
        seconds: f64,
        fault: Option<Fault>,
        keep: Option<Keep>,
    },
    Record {
        ev: Arc<SimEvent>,
        seq: u64,
    },
    Wait {
        ev: Arc<SimEvent>,
        seq: u64,
        due: Option<Instant>,
    },
    Stop,
}

pub(super) struct Worker {
    pub(super) tx: Sender<Op>,
    /// Ops sent and not yet run: at 0 the stream is idle, and an op that takes no time runs
    /// on the caller's thread (no hop to the worker: a free link's copies cost the host what
    /// a memcpy costs, not two thread wake-ups).
    pub(super) pending: Arc<AtomicU64>,
    /// A failed copy's error, for the stream's next event (shared: an idle stream's record
    /// runs on the caller's thread).
    pub(super) error: Arc<Mutex<Option<String>>>,
    /// The stream has copied into device memory (Note [the simulated device]).
    pub(super) to_device: bool,
    pub(super) thread: Option<JoinHandle<()>>,
}

pub(super) fn run_worker(
    rx: std::sync::mpsc::Receiver<Op>,
    pending: Arc<AtomicU64>,
    failed: Arc<AtomicU64>,
    error: Arc<Mutex<Option<String>>>,
) {
    while let Ok(op) = rx.recv() {
        let stop = matches!(op, Op::Stop);
        if matches!(
            op,
            Op::Copy {
                fault: Some(Fault::Fail),
                ..
            }
        ) {
            failed.fetch_add(1, Ordering::AcqRel);
        }
        run_op(op, &error);
        pending.fetch_sub(1, Ordering::AcqRel);
        if stop {
            return;
        }
    }
}

pub(super) fn run_op(op: Op, error: &Mutex<Option<String>>) {
    {
        match op {
            Op::Copy {
                dst,
                src,
                nbytes,
                seconds,
                fault,
                keep,
            } => {
                if seconds > 0.0 {
                    std::thread::sleep(Duration::from_secs_f64(seconds));
                }
                match fault {
                    Some(Fault::Fail) => {
                        *lock(error) = Some("simulated copy failure (injected)".into());
                        drop(keep);
                    }
                    Some(Fault::LateLanding) => {
                        // the bytes arrive after the event: a reader that trusted it sees the
                        // old contents (the thread holds what the copy reads and writes)
                        std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(50));
                            // SAFETY: as for an on-time copy: `keep`, moved here, holds both
                            // ranges alive (Device::copy's contract).
                            unsafe { raw_copy(dst, src, nbytes) };
                            drop(keep);
                        });
                    }
                    other => {
                        // SAFETY: Device::copy's contract: both ranges valid until the copy
                        // ran, or held by `keep`, dropped only below.
                        unsafe { raw_copy(dst, src, nbytes) };
                        if other == Some(Fault::StaleSource) && nbytes > 0 {
                            // SAFETY: `dst` is valid for `nbytes` > 0 bytes (as above).
                            unsafe { *(dst as *mut u8) ^= 0x5a };
                        }
                        drop(keep);
                    }
                }
            }
            Op::Record { ev, seq } => ev.fire(seq, lock(error).take()),
            Op::Wait { ev, seq, due } => ev.wait_for(seq, due),
            Op::Stop => {}
        }
    }
}

/// # Safety
/// `src` and `dst` are valid for `nbytes` bytes and do not overlap.
pub(super) unsafe fn raw_copy(dst: u64, src: u64, nbytes: u64) {
    if nbytes == 0 {
        return;
    }
    // SAFETY: the caller's contract.
    unsafe {
        std::ptr::copy_nonoverlapping(src as *const u8, dst as *mut u8, nbytes as usize);
    }
}

pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
