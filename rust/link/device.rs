//! What the link needs of a device: streams, events and asynchronous copies between raw
//! addresses. Two implementations behind this one trait, chosen once when a link is made:
//! [`super::cuda::CudaDevice`] (the CUDA driver API, loaded at run time) and
//! [`super::sim::SimDevice`] (a simulated GPU for machines without one).
//!
//! Handles are plain integers: a `CUstream` / `CUevent` pointer on CUDA, an index in the
//! simulator. A stream handle may be one the device did not make (torch's current stream,
//! handed over as `torch.cuda.current_stream().cuda_stream`); events are always the device's.

use std::any::Any;

use crate::error::Result;

/// A stream handle (`CUstream`; 0 is the legacy default stream on CUDA, the host-side compute
/// stream in the simulator).
pub type Stream = u64;
/// An event handle (`CUevent`, or the simulator's index).
pub type Event = u64;

/// What a copy keeps alive until the device has run it: memory the copy reads or writes that
/// its owner could otherwise free (the simulator reads host memory through raw pointers; CUDA
/// needs nothing, its allocator frees in stream order).
pub type Keep = Box<dyn Any + Send>;

/// Which way a copy goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dir {
    /// Device memory to host memory.
    ToHost,
    /// Host memory to device memory.
    ToDevice,
}

/// The primitives a link is made of (Note [stream ordering] in `mod.rs`). Every call is
/// asynchronous for the host except [`Device::synchronize`] and a [`Device::wait`] on a stream
/// the host itself is (the simulator's compute stream). Each call to the device counts once in
/// [`Device::calls`].
pub trait Device: Send + Sync {
    /// "cuda" or "sim".
    fn kind(&self) -> &'static str;

    /// A new stream that does not synchronize with the legacy default stream.
    fn new_stream(&self) -> Result<Stream>;

    /// A new event (no timing).
    fn new_event(&self) -> Result<Event>;

    /// Record `ev` at `stream`'s current point.
    fn record(&self, ev: Event, stream: Stream) -> Result<()>;

    /// Whether the work before `ev`'s last record has run. An error: that work failed.
    fn query(&self, ev: Event) -> Result<bool>;

    /// Block the host until the work before `ev`'s last record has run.
    fn synchronize(&self, ev: Event) -> Result<()>;

    /// `stream`'s later work runs after the work before `ev`'s last record (at this call).
    fn wait(&self, stream: Stream, ev: Event) -> Result<()>;

    /// Copy `nbytes` from `src` to `dst` on `stream`; `keep` is dropped once it ran.
    ///
    /// # Safety
    /// `src` and `dst` are valid for `nbytes` (device or host memory as `dir` says) until the
    /// copy has run on the stream, or `keep` holds them alive until then.
    unsafe fn copy(
        &self,
        dst: u64,
        src: u64,
        nbytes: u64,
        dir: Dir,
        stream: Stream,
        keep: Option<Keep>,
    ) -> Result<()>;

    /// Host memory of `nbytes` that copies to and from the device may use asynchronously
    /// (CUDA: page-locked; never freed: the link keeps it for the process).
    fn host_alloc(&self, nbytes: usize) -> Result<u64> {
        let v: &'static mut [u64] = Box::leak(vec![0u64; nbytes.div_ceil(8)].into_boxed_slice());
        Ok(v.as_mut_ptr() as u64)
    }

    /// Calls made to the device so far (streams, events, copies, queries, waits).
    fn calls(&self) -> u64;

    /// Copies that failed so far, where the device can tell without a query (the simulator); a
    /// device whose errors are sticky (CUDA: every later query reports them) says 0.
    fn failed_copies(&self) -> u64 {
        0
    }

    /// Make the calling thread ready to call the device (CUDA: the device's context current).
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }
}
