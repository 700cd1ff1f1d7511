//! The simulated device: the CPU pretending to be a GPU behind a link, for tests and benchmarks
//! on machines without one (Note [the simulated device]).
//!
//! # Note [the simulated device]
//! "Device memory" is host memory (CPU tensors); what is modelled is time and order:
//! - every stream the device makes is a worker thread running its queue in order; a copy on it
//!   finishes `latency + bytes / bandwidth` after the stream started it, and reads its source
//!   at the end (the late reader a GPU may be);
//! - stream 0 is the compute stream, and the compute stream is the host: work the host queues
//!   there (a copy, a wait) runs at once on the calling thread, so a copy on it holds the host
//!   for its time, as an exposed copy holds a GPU's compute. Its events fire `compute_lag`
//!   after they were recorded: the compute stream of a GPU runs behind a host that queues work
//!   faster than it runs, and a host that waits to *see* such an event waits the lag (another
//!   stream ordered after it does not: the work before it has run, on the host). Such a
//!   lagging compute stream also queues its waits for device-to-host copies without holding
//!   the host (a GPU's `cudaStreamWaitEvent` returns at once): the host runs on while the
//!   copy drains, and may ask for the copy's bytes before it is seen landing (Note [unpack
//!   before the seal] in rust/tier). Such a wait is deferred, not dropped: the compute
//!   stream's next copy waits for it first (the host runs that copy), and its later events
//!   fire only once it ran. A wait for a copy into device memory still holds the host, which
//!   reads that memory next as the compute stream;
//! - each call to the device costs the host `call_cost` (spun, not slept): the driver's host
//!   time per call, so that a link's host cost per tensor shows on a CPU (zero by default);
//! - faults can be injected ([`SimDevice::inject`]): a failed copy (its stream's next event
//!   carries the error), a device-to-host copy that reads bytes other than its source's (the
//!   source overwritten before the copy ran), and a host-to-device copy whose bytes land only
//!   after its event fired (a tensor read before its copy landed), for the verify mode's tests.
//!
//! What a copy reads or writes stays alive until it ran because the copy holds it (`Keep`):
//! the simulator reads memory through raw pointers, and freeing it under a queued copy would
//! read freed memory rather than show a race (the races are injected instead).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::channel;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use super::device::{Device, Dir, Event, Keep, Stream};
use crate::error::{Error, Result};

mod stream;
use stream::{deps_fired, lock, raw_copy, run_op, run_worker, Dep, EvState, Op, SimEvent, Worker};

/// The compute stream's handle in the simulator: the host.
pub const COMPUTE: Stream = 0;

/// How the simulated device behaves (Note [the simulated device]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimOptions {
    /// Bytes per second of a copy (None: copies take no time).
    pub bandwidth: Option<f64>,
    /// Seconds every copy takes besides its bytes.
    pub latency: f64,
    /// Seconds the compute stream runs behind the host.
    pub compute_lag: f64,
    /// Host seconds each call to the device costs.
    pub call_cost: f64,
}

impl Default for SimOptions {
    fn default() -> Self {
        SimOptions {
            bandwidth: None,
            latency: 0.0,
            compute_lag: 0.0,
            call_cost: 0.0,
        }
    }
}

/// A fault to inject into the next copies (Note [the simulated device]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The copy fails; its stream's next event carries the error.
    Fail,
    /// A device-to-host copy reads one byte other than its source's (flipped).
    StaleSource,
    /// A host-to-device copy's bytes land 50 ms after its event fired.
    LateLanding,
}

/// The simulated device (Note [the simulated device]).
pub struct SimDevice {
    opts: SimOptions,
    streams: Mutex<Vec<Worker>>,
    events: Mutex<Vec<Arc<SimEvent>>>,
    faults: Mutex<VecDeque<(Fault, Dir)>>,
    calls: AtomicU64,
    failed: Arc<AtomicU64>,
    /// Waits queued on the lagging compute stream for copies to the host, not run yet (Note
    /// [the simulated device]).
    deferred: Mutex<Vec<Dep>>,
}

impl SimDevice {
    pub fn new(opts: SimOptions) -> Result<SimDevice> {
        if let Some(bw) = opts.bandwidth {
            if bw.is_nan() || bw <= 0.0 {
                return Err(Error::Invalid(format!(
                    "simulated bandwidth must be > 0 bytes/s, got {bw}"
                )));
            }
        }
        for (name, v) in [
            ("latency", opts.latency),
            ("compute_lag", opts.compute_lag),
            ("call_cost", opts.call_cost),
        ] {
            if !v.is_finite() || v < 0.0 {
                return Err(Error::Invalid(format!(
                    "simulated {name} must be a number of seconds >= 0, got {v}"
                )));
            }
        }
        Ok(SimDevice {
            opts,
            streams: Mutex::new(Vec::new()),
            events: Mutex::new(Vec::new()),
            faults: Mutex::new(VecDeque::new()),
            calls: AtomicU64::new(0),
            failed: Arc::new(AtomicU64::new(0)),
            deferred: Mutex::new(Vec::new()),
        })
    }

    pub fn options(&self) -> SimOptions {
        self.opts
    }

    /// Inject `fault` into the next copy going `dir` (faults queue up, oldest first).
    pub fn inject(&self, fault: Fault, dir: Dir) {
        lock(&self.faults).push_back((fault, dir));
    }

    fn call(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        if self.opts.call_cost > 0.0 {
            let until = Instant::now() + Duration::from_secs_f64(self.opts.call_cost);
            while Instant::now() < until {
                std::hint::spin_loop();
            }
        }
    }

    fn event(&self, ev: Event) -> Result<Arc<SimEvent>> {
        let events = lock(&self.events);
        events
            .get(ev as usize)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("unknown simulated event {ev}")))
    }

    fn send(&self, stream: Stream, op: Op) -> Result<()> {
        let (tx, pending, error) = {
            let streams = lock(&self.streams);
            let w = streams
                .get((stream as usize).wrapping_sub(1))
                .ok_or_else(|| Error::Invalid(format!("unknown simulated stream {stream}")))?;
            (w.tx.clone(), w.pending.clone(), w.error.clone())
        };
        let instant = match &op {
            Op::Copy { seconds, fault, .. } => *seconds == 0.0 && fault.is_none(),
            Op::Record { .. } => true,
            Op::Wait { ev, seq, due } => due.is_none() && ev.lock().fired >= *seq,
            Op::Stop => false,
        };
        if instant && pending.load(Ordering::Acquire) == 0 {
            run_op(op, &error);
            return Ok(());
        }
        pending.fetch_add(1, Ordering::AcqRel);
        tx.send(op).map_err(|_| {
            pending.fetch_sub(1, Ordering::AcqRel);
            Error::Internal(format!("simulated stream {stream} has stopped"))
        })
    }

    /// The deferred waits not seen run yet (those that ran are forgotten).
    fn pending_waits(&self) -> Vec<Dep> {
        let mut d = lock(&self.deferred);
        d.retain(|(e, seq)| e.lock().fired < *seq);
        d.clone()
    }

    /// The compute stream (the host) is about to run a copy: the waits queued before it run
    /// first.
    fn run_deferred(&self) {
        let d = std::mem::take(&mut *lock(&self.deferred));
        for (e, seq) in d {
            e.wait_for(seq, None);
        }
    }

    fn take_fault(&self, dir: Dir) -> Option<Fault> {
        let mut faults = lock(&self.faults);
        let i = faults.iter().position(|&(_, d)| d == dir)?;
        faults.remove(i).map(|(f, _)| f)
    }
}

impl Drop for SimDevice {
    fn drop(&mut self) {
        let mut streams = lock(&self.streams);
        for w in streams.iter() {
            w.pending.fetch_add(1, Ordering::AcqRel);
            let _ = w.tx.send(Op::Stop);
        }
        for w in streams.iter_mut() {
            if let Some(t) = w.thread.take() {
                let _ = t.join();
            }
        }
    }
}

impl Device for SimDevice {
    fn kind(&self) -> &'static str {
        "sim"
    }

    fn new_stream(&self) -> Result<Stream> {
        self.call();
        let (tx, rx) = channel();
        let pending = Arc::new(AtomicU64::new(0));
        let error = Arc::new(Mutex::new(None));
        let (p, e) = (pending.clone(), error.clone());
        let thread = std::thread::Builder::new()
            .name("spillover-sim-stream".into())
            .spawn({
                let failed = self.failed.clone();
                move || run_worker(rx, p, failed, e)
            })
            .map_err(|e| Error::Internal(format!("could not start a simulated stream: {e}")))?;
        let mut streams = lock(&self.streams);
        streams.push(Worker {
            tx,
            pending,
            error,
            to_device: false,
            thread: Some(thread),
        });
        Ok(streams.len() as Stream) // 1-based: 0 is the compute stream
    }

    fn new_event(&self) -> Result<Event> {
        self.call();
        let mut events = lock(&self.events);
        events.push(Arc::new(SimEvent {
            st: Mutex::new(EvState::default()),
            cv: Condvar::new(),
        }));
        Ok((events.len() - 1) as Event)
    }

    fn record(&self, ev: Event, stream: Stream) -> Result<()> {
        self.call();
        let e = self.event(ev)?;
        let mut deps = if stream == COMPUTE && self.opts.compute_lag > 0.0 {
            self.pending_waits() // before `e`'s lock: a reused event may be among them
        } else {
            Vec::new()
        };
        deps.retain(|(d, _)| !Arc::ptr_eq(d, &e));
        let mut st = e.lock();
        st.recorded += 1;
        st.error = None; // a new record: what failed before it is the old record's
        let seq = st.recorded;
        if stream == COMPUTE {
            if self.opts.compute_lag > 0.0 {
                st.due = Some(Instant::now() + Duration::from_secs_f64(self.opts.compute_lag));
                st.deps = deps;
            } else {
                st.due = None;
                st.fired = seq;
            }
            return Ok(());
        }
        st.due = None;
        st.to_host = {
            let streams = lock(&self.streams);
            let w = streams.get((stream as usize).wrapping_sub(1));
            w.is_some_and(|w| !w.to_device)
        };
        drop(st);
        self.send(stream, Op::Record { ev: e, seq })
    }

    fn query(&self, ev: Event) -> Result<bool> {
        self.call();
        let e = self.event(ev)?;
        let mut st = e.lock();
        if let Some(due) = st.due {
            if Instant::now() >= due && deps_fired(&st.deps) {
                st.fired = st.recorded;
                st.due = None;
                st.deps.clear();
            }
        }
        if st.fired < st.recorded {
            return Ok(false);
        }
        match &st.error {
            Some(msg) => Err(Error::Device {
                op: "copy",
                detail: msg.clone(),
            }),
            None => Ok(true),
        }
    }

    fn synchronize(&self, ev: Event) -> Result<()> {
        self.call();
        let e = self.event(ev)?;
        let (seq, due) = {
            let st = e.lock();
            (st.recorded, st.due)
        };
        e.wait_for(seq, due);
        let mut st = e.lock();
        if due.is_some() {
            st.fired = st.fired.max(seq);
        }
        match &st.error {
            Some(msg) => Err(Error::Device {
                op: "copy",
                detail: msg.clone(),
            }),
            None => Ok(()),
        }
    }

    fn wait(&self, stream: Stream, ev: Event) -> Result<()> {
        self.call();
        let e = self.event(ev)?;
        let (seq, due, to_host) = {
            let st = e.lock();
            (st.recorded, st.due, st.to_host)
        };
        if stream == COMPUTE {
            if to_host && self.opts.compute_lag > 0.0 {
                // queued on a compute stream that runs behind the host: the host runs on (what
                // the copy reads is held by the copy) until the stream's next copy or an event
                // after it must see it (Note [the simulated device])
                lock(&self.deferred).push((e, seq));
                return Ok(());
            }
            e.wait_for(seq, due); // the compute stream is the host
            return Ok(());
        }
        if due.is_some() {
            // recorded on the compute stream: the host has run that work already (its lag is
            // only when the host *sees* the event), so a stream ordered after it need not wait
            // -- but for the waits the compute stream had deferred before it
            let deps = e.lock().deps.clone();
            for (d, s) in deps {
                if d.lock().fired < s {
                    let due = None;
                    self.send(stream, Op::Wait { ev: d, seq: s, due })?;
                }
            }
            return Ok(());
        }
        self.send(stream, Op::Wait { ev: e, seq, due })
    }

    unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        nbytes: u64,
        dir: Dir,
        stream: Stream,
        keep: Option<Keep>,
    ) -> Result<()> {
        self.call();
        if dir == Dir::ToDevice && stream != COMPUTE {
            if let Some(w) = lock(&self.streams).get_mut((stream as usize).wrapping_sub(1)) {
                w.to_device = true;
            }
        }
        let seconds = self.opts.latency + self.opts.bandwidth.map_or(0.0, |bw| nbytes as f64 / bw);
        let fault = self.take_fault(dir);
        if stream == COMPUTE {
            self.run_deferred();
            // the host is the compute stream: the copy holds it for its time
            if seconds > 0.0 {
                std::thread::sleep(Duration::from_secs_f64(seconds));
            }
            if fault == Some(Fault::Fail) {
                self.failed.fetch_add(1, Ordering::AcqRel);
                return Err(Error::Device {
                    op: "copy",
                    detail: "simulated copy failure (injected)".into(),
                });
            }
            if fault == Some(Fault::LateLanding) {
                // a copy the reader is not ordered after: its bytes arrive after the read
                run_op(
                    Op::Copy {
                        dst,
                        src,
                        nbytes,
                        seconds: 0.0,
                        fault,
                        keep,
                    },
                    &Mutex::new(None),
                );
                return Ok(());
            }
            // SAFETY: the caller's contract (both ranges valid now: the copy runs at once).
            unsafe { raw_copy(dst, src, nbytes) };
            if fault == Some(Fault::StaleSource) && nbytes > 0 {
                // SAFETY: `dst` is valid for `nbytes` > 0 bytes.
                unsafe { *(dst as *mut u8) ^= 0x5a };
            }
            drop(keep);
            return Ok(());
        }
        self.send(
            stream,
            Op::Copy {
                dst,
                src,
                nbytes,
                seconds,
                fault,
                keep,
            },
        )
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    fn failed_copies(&self) -> u64 {
        self.failed.load(Ordering::Acquire)
    }
}
