//! The CUDA device: the driver API (`libcuda.so.1`), loaded at run time.
//!
//! # Note [the driver, loaded at run time]
//! The crate never links CUDA: one abi3 wheel serves every torch and CUDA version and builds
//! and tests on a machine without a GPU. When a link for a CUDA device is made, the driver
//! library torch already loaded (`libcuda.so.1`, found by the dynamic loader as torch found
//! it) is opened with `libloading` and the sixteen entry points the link uses are looked up
//! once. Why `libloading` and not `cudarc`: the link needs a dozen driver calls on handles
//! torch made (its streams, its context), not a second CUDA runtime with its own context and
//! allocator management; `cudarc`'s dynamic loading would bring bindings for the whole driver
//! API and its own ownership model of streams and contexts, which would have to be bypassed
//! for torch's. A few symbols through `libloading` are auditable in one file.
//!
//! Calls run on whatever thread Python calls from: [`Device::bind_thread`] makes the device's
//! primary context (the one torch uses) current on it when another (or none) is.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicU64, Ordering};

use libloading::Library;

use super::device::{Device, Dir, Event, Keep, Stream};
use crate::error::{Error, Result};

type CuResult = c_int;
type CuContext = *mut c_void;

const CUDA_SUCCESS: CuResult = 0;
const CUDA_ERROR_NOT_READY: CuResult = 600;
const CU_STREAM_NON_BLOCKING: c_uint = 1;
const CU_EVENT_DISABLE_TIMING: c_uint = 2;

struct Api {
    ctx_get_current: unsafe extern "C" fn(*mut CuContext) -> CuResult,
    ctx_set_current: unsafe extern "C" fn(CuContext) -> CuResult,
    device_get: unsafe extern "C" fn(*mut c_int, c_int) -> CuResult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CuContext, c_int) -> CuResult,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    event_create: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult,
    event_record: unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult,
    event_query: unsafe extern "C" fn(*mut c_void) -> CuResult,
    event_synchronize: unsafe extern "C" fn(*mut c_void) -> CuResult,
    stream_wait_event: unsafe extern "C" fn(*mut c_void, *mut c_void, c_uint) -> CuResult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize, *mut c_void) -> CuResult,
    memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize, *mut c_void) -> CuResult,
    error_name: unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult,
    mem_alloc_host: unsafe extern "C" fn(*mut *mut c_void, usize) -> CuResult,
    init: unsafe extern "C" fn(c_uint) -> CuResult,
}

/// The CUDA device `ordinal` through the driver API (Note [the driver, loaded at run time]).
pub struct CudaDevice {
    api: Api,
    ctx: CuContext,
    calls: AtomicU64,
    // The library stays loaded while the function pointers above are used.
    _lib: Library,
}

// SAFETY: the driver API is thread-safe; the context handle is a process-wide object that the
// driver lets any thread make current.
unsafe impl Send for CudaDevice {}
// SAFETY: as above; `&CudaDevice` only calls thread-safe driver entry points.
unsafe impl Sync for CudaDevice {}

fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T> {
    // SAFETY: each name is looked up with the exact C signature of the driver API's entry
    // point of that name (CUDA driver API reference, cuda.h), stored as that type.
    unsafe {
        lib.get::<T>(name.as_bytes())
            .map(|s| *s)
            .map_err(|e| Error::Device {
                op: "load",
                detail: format!("libcuda.so.1 has no {name}: {e}"),
            })
    }
}

impl CudaDevice {
    /// Open the driver and bind to device `ordinal`'s primary context (the one torch uses).
    /// Fails (an `Error::Device`) where there is no driver: the caller then has no CUDA link.
    pub fn open(ordinal: i32) -> Result<CudaDevice> {
        // SAFETY: loading the NVIDIA driver library runs its initializers, which have no
        // preconditions; torch has loaded the same library already on a CUDA host.
        let lib = unsafe { Library::new("libcuda.so.1") }.map_err(|e| Error::Device {
            op: "load",
            detail: format!("cannot open libcuda.so.1 (no NVIDIA driver?): {e}"),
        })?;
        let api = Api {
            ctx_get_current: sym(&lib, "cuCtxGetCurrent")?,
            ctx_set_current: sym(&lib, "cuCtxSetCurrent")?,
            device_get: sym(&lib, "cuDeviceGet")?,
            primary_ctx_retain: sym(&lib, "cuDevicePrimaryCtxRetain")?,
            stream_create: sym(&lib, "cuStreamCreate")?,
            event_create: sym(&lib, "cuEventCreate")?,
            event_record: sym(&lib, "cuEventRecord")?,
            event_query: sym(&lib, "cuEventQuery")?,
            event_synchronize: sym(&lib, "cuEventSynchronize")?,
            stream_wait_event: sym(&lib, "cuStreamWaitEvent")?,
            memcpy_dtoh: sym(&lib, "cuMemcpyDtoHAsync_v2")?,
            memcpy_htod: sym(&lib, "cuMemcpyHtoDAsync_v2")?,
            error_name: sym(&lib, "cuGetErrorName")?,
            mem_alloc_host: sym(&lib, "cuMemAllocHost_v2")?,
            init: sym(&lib, "cuInit")?,
        };
        let mut dev = CudaDevice {
            api,
            ctx: std::ptr::null_mut(),
            calls: AtomicU64::new(0),
            _lib: lib,
        };
        // SAFETY: cuInit takes flags 0; it is idempotent.
        dev.check("cuInit", unsafe { (dev.api.init)(0) })?;
        let mut cu_dev: c_int = 0;
        // SAFETY: an out-pointer to a local.
        dev.check("cuDeviceGet", unsafe {
            (dev.api.device_get)(&mut cu_dev, ordinal)
        })?;
        let mut ctx: CuContext = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the primary context is retained for the life of
        // the process (torch retains it too and never releases it before exit).
        dev.check("cuDevicePrimaryCtxRetain", unsafe {
            (dev.api.primary_ctx_retain)(&mut ctx, cu_dev)
        })?;
        dev.ctx = ctx;
        Ok(dev)
    }

    fn check(&self, op: &'static str, r: CuResult) -> Result<()> {
        if r == CUDA_SUCCESS {
            return Ok(());
        }
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: an out-pointer to a local; the driver returns a static string or an error.
        let known = unsafe { (self.api.error_name)(r, &mut name) } == CUDA_SUCCESS;
        let text = if known && !name.is_null() {
            // SAFETY: cuGetErrorName returned a NUL-terminated static string.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        } else {
            format!("CUresult {r}")
        };
        Err(Error::Device { op, detail: text })
    }

    fn counted(&self) {
        self.calls.fetch_add(1, Ordering::Relaxed);
    }
}

impl Device for CudaDevice {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn bind_thread(&self) -> Result<()> {
        let mut cur: CuContext = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local.
        self.check("cuCtxGetCurrent", unsafe {
            (self.api.ctx_get_current)(&mut cur)
        })?;
        if cur != self.ctx {
            // SAFETY: `ctx` is the retained primary context of this device.
            self.check("cuCtxSetCurrent", unsafe {
                (self.api.ctx_set_current)(self.ctx)
            })?;
        }
        Ok(())
    }

    fn new_stream(&self) -> Result<Stream> {
        self.counted();
        let mut s: *mut c_void = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the context is current (bind_thread).
        self.check("cuStreamCreate", unsafe {
            (self.api.stream_create)(&mut s, CU_STREAM_NON_BLOCKING)
        })?;
        Ok(s as Stream)
    }

    fn new_event(&self) -> Result<Event> {
        self.counted();
        let mut e: *mut c_void = std::ptr::null_mut();
        // SAFETY: as above.
        self.check("cuEventCreate", unsafe {
            (self.api.event_create)(&mut e, CU_EVENT_DISABLE_TIMING)
        })?;
        Ok(e as Event)
    }

    fn record(&self, ev: Event, stream: Stream) -> Result<()> {
        self.counted();
        // SAFETY: `ev` was made by new_event; `stream` is a live stream of this context
        // (the link's own, or torch's current stream handed over by the caller).
        self.check("cuEventRecord", unsafe {
            (self.api.event_record)(ev as *mut c_void, stream as *mut c_void)
        })
    }

    fn query(&self, ev: Event) -> Result<bool> {
        self.counted();
        // SAFETY: `ev` was made by new_event.
        match unsafe { (self.api.event_query)(ev as *mut c_void) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            r => self.check("cuEventQuery", r).map(|_| false),
        }
    }

    fn synchronize(&self, ev: Event) -> Result<()> {
        self.counted();
        // SAFETY: `ev` was made by new_event.
        self.check("cuEventSynchronize", unsafe {
            (self.api.event_synchronize)(ev as *mut c_void)
        })
    }

    fn wait(&self, stream: Stream, ev: Event) -> Result<()> {
        self.counted();
        // SAFETY: as for record.
        self.check("cuStreamWaitEvent", unsafe {
            (self.api.stream_wait_event)(stream as *mut c_void, ev as *mut c_void, 0)
        })
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
        self.counted();
        let n = usize::try_from(nbytes)
            .map_err(|_| Error::Invalid(format!("a copy of {nbytes} bytes")))?;
        let r = match dir {
            // SAFETY: the caller's contract: `src` device memory and `dst` host memory valid
            // for `n` bytes until the copy ran on `stream`.
            Dir::ToHost => unsafe {
                (self.api.memcpy_dtoh)(dst as *mut c_void, src, n, stream as *mut c_void)
            },
            // SAFETY: as above, the other way.
            Dir::ToDevice => unsafe {
                (self.api.memcpy_htod)(dst, src as *const c_void, n, stream as *mut c_void)
            },
        };
        drop(keep); // the driver's stream order keeps device memory; host blocks are the caller's
        self.check(
            match dir {
                Dir::ToHost => "cuMemcpyDtoHAsync",
                Dir::ToDevice => "cuMemcpyHtoDAsync",
            },
            r,
        )
    }

    fn host_alloc(&self, nbytes: usize) -> Result<u64> {
        self.counted();
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: an out-pointer to a local; the context is current (bind_thread).
        self.check("cuMemAllocHost", unsafe {
            (self.api.mem_alloc_host)(&mut p, nbytes)
        })?;
        Ok(p as u64)
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }
}
