//! `Link` for Python: the device link (`crate::link`), one call per pack and per unpack.
//!
//! Addresses come from Python with the object that owns them (Note [a raw pointer only with
//! its owner]): a device source with its storage, a host block as the tier's `View` or
//! `Handle`. The link holds the host side itself until the copy ran; the device source is the
//! caller's to hold as the ledger says (Note [sources held] in rust/link), and on the simulated
//! device the copy holds it too (its memory is read through a raw pointer).
//!
//! Every call that may wait (the simulated compute stream is the host) runs with the GIL
//! released.

use std::sync::Arc;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::errors::{guarded, to_py};
use super::tier::{PyHandle, PyStep, PyView};
use crate::link::cuda::CudaDevice;
use crate::link::sim::{Fault, SimDevice, SimOptions};
use crate::link::{Device, Dir, Keep, Landed, Link, StageItem, Verify};

/// Copies seen complete: `(id, error or None)` each.
type LandedList = Vec<(u64, Option<Py<PyAny>>)>;
/// One copy to stage: `(device address, view, after, owner)`.
type StageArg<'py> = (
    usize,
    PyRef<'py, PyView>,
    Option<u64>,
    Option<Bound<'py, PyAny>>,
);

#[pyclass(name = "Link", module = "spillover._native", frozen)]
pub struct PyLink {
    link: Link,
    sim: Option<Arc<SimDevice>>,
}

fn keep_of(obj: Option<Bound<'_, PyAny>>) -> Option<Keep> {
    obj.map(|o| Box::new(o.unbind()) as Keep)
}

fn landed_list(py: Python<'_>, landed: Vec<Landed>) -> LandedList {
    landed
        .into_iter()
        .map(|l| {
            let err = l.error.map(|e| to_py(e).into_value(py).into_any());
            (l.id, err)
        })
        .collect()
}

fn nonzero(address: usize, what: &str) -> PyResult<u64> {
    if address == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "null {what} address"
        )));
    }
    Ok(address as u64)
}

#[pymethods]
impl PyLink {
    /// A link for a CUDA device (`kind="cuda"`, device `index`: its primary context, the one
    /// torch uses) or the simulated device (`kind="sim"`: `bandwidth` bytes/s or None for
    /// free copies, `latency` and `compute_lag` seconds, `call_cost` host seconds per device
    /// call). `cap_bytes`: the held sources' cap (Note [back-pressure]). Raises DeviceError
    /// where the CUDA driver cannot be opened, ValueError for a bad option.
    #[new]
    #[pyo3(signature = (kind, *, cap_bytes, index=0, bandwidth=None, latency=0.0,
                        compute_lag=0.0, call_cost=0.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        kind: &str,
        cap_bytes: u64,
        index: i32,
        bandwidth: Option<f64>,
        latency: f64,
        compute_lag: f64,
        call_cost: f64,
    ) -> PyResult<Self> {
        let (dev, sim): (Arc<dyn Device>, Option<Arc<SimDevice>>) = match kind {
            "cuda" => (Arc::new(guarded(py, || CudaDevice::open(index))?), None),
            "sim" => {
                let s = Arc::new(
                    SimDevice::new(SimOptions {
                        bandwidth,
                        latency,
                        compute_lag,
                        call_cost,
                    })
                    .map_err(to_py)?,
                );
                (s.clone(), Some(s))
            }
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "Link kind {other:?}: expected \"cuda\" or \"sim\""
                )))
            }
        };
        let link = guarded(py, || Link::new(dev, cap_bytes))?;
        Ok(PyLink { link, sim })
    }

    /// Pack one storage (or one piece of it): lease `nbytes` from `step` (making room; raises
    /// PoolExhaustedError), copy them from device address `address` after the work queued on
    /// `stream`, seal the entry once they landed. `owner`: the source storage (held by the
    /// copy on the simulated device). `checksum`: verify mode, `(device address of the int64
    /// checksum of the source taken before the copy, its tensor)`; the landed bytes are
    /// checked against it (IntegrityError through `poll`). Returns `(handle, copy id,
    /// victims)`: drop the victims' sources now (Note [sources held]).
    #[pyo3(signature = (step, address, nbytes, stream, owner=None, checksum=None))]
    #[allow(clippy::too_many_arguments)]
    fn pack(
        &self,
        py: Python<'_>,
        step: &PyStep,
        address: usize,
        nbytes: u64,
        stream: u64,
        owner: Option<Bound<'_, PyAny>>,
        checksum: Option<(usize, Bound<'_, PyAny>)>,
    ) -> PyResult<(PyHandle, u64, Vec<u64>)> {
        let src = nonzero(address, "source")?;
        let sim = self.sim.is_some();
        let keep = if sim { keep_of(owner) } else { None };
        let checksum = match checksum {
            Some((a, o)) => Some((
                nonzero(a, "checksum")?,
                if sim { keep_of(Some(o)) } else { None },
            )),
            None => None,
        };
        let (h, issued) = guarded(py, || {
            let (h, view) = step.step.put(nbytes)?;
            let dst = view.as_ptr() as u64;
            let verify = checksum.map(|(a, k)| Verify {
                checksum: a,
                host: dst,
                len: nbytes,
                keep: k,
            });
            let seal = h.clone();
            // SAFETY: `src` is device memory of the caller's storage, held as the ledger says
            // (and by `keep` on the simulated device); `dst` is the staging view just leased,
            // held by the link until the copy landed, and nothing else writes a staging block.
            let issued = unsafe {
                self.link.d2h(
                    src,
                    dst,
                    nbytes,
                    stream,
                    Some(Box::new(view)),
                    keep,
                    Some(Box::new(move || seal.seal())),
                    verify,
                )
            }?;
            Ok((h, issued))
        })?;
        Ok((PyHandle { h }, issued.id, issued.victims))
    }

    /// Issue the copies held back for their group now (Note [grouped copies] in rust/link):
    /// the end of forward.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        guarded(py, || self.link.flush())
    }

    /// Copies seen complete since the last poll: `[(id, error or None)]`, oldest first (their
    /// entries sealed; an error is what the copy or its seal raised).
    fn poll(&self, py: Python<'_>) -> PyResult<LandedList> {
        let landed = guarded(py, || self.link.poll())?;
        Ok(landed_list(py, landed))
    }

    /// Block until copy `id` has landed: `(seconds waited, what the poll then saw)`.
    fn wait(&self, py: Python<'_>, id: u64) -> PyResult<(f64, LandedList)> {
        let (dt, landed) = guarded(py, || self.link.wait_copy(id))?;
        Ok((dt, landed_list(py, landed)))
    }

    /// Release every held source (their compute streams wait for the copies): their ids.
    fn release_all(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        guarded(py, || self.link.release_all())
    }

    /// Bring `view`'s bytes into device memory at `address` (made from `stream`'s pool) now,
    /// on `stream`, after the D2H copy `after` if it was not seen complete. `owner`: the
    /// destination storage (held by the copy on the simulated device).
    #[pyo3(signature = (address, view, stream, after=None, owner=None))]
    fn to_device(
        &self,
        py: Python<'_>,
        address: usize,
        view: &PyView,
        stream: u64,
        after: Option<u64>,
        owner: Option<Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let dst = nonzero(address, "destination")?;
        let keep = if self.sim.is_some() {
            keep_of(owner)
        } else {
            None
        };
        let v = view.v.clone();
        let (src, n) = (v.as_ptr() as u64, v.len() as u64);
        guarded(py, || {
            // SAFETY: `dst` is device memory of `n` bytes the caller made from `stream`'s pool
            // (held by `keep` on the simulated device); `src` is the view's bytes, held by the
            // link (the clone) until the copy ran.
            unsafe {
                self.link
                    .to_device(dst, src, n, stream, after, Some(Box::new(v)), keep)
            }
        })
    }

    /// Stage copies ahead on the H2D stream, after the work queued on `stream`: `items` are
    /// `(address, view, after, owner)` as for `to_device`. Returns one event per item, for
    /// `use_staged` or `drop_staged`.
    fn stage(&self, py: Python<'_>, stream: u64, items: Vec<StageArg<'_>>) -> PyResult<Vec<u64>> {
        let mut staged = Vec::with_capacity(items.len());
        for (address, view, after, owner) in items {
            let dst = nonzero(address, "destination")?;
            let v = view.v.clone();
            staged.push(StageItem {
                dst,
                src: v.as_ptr() as u64,
                nbytes: v.len() as u64,
                after,
                hold: Some(Box::new(v)),
                keep: if self.sim.is_some() {
                    keep_of(owner)
                } else {
                    None
                },
            });
        }
        // SAFETY: as for to_device, item by item.
        guarded(py, || unsafe { self.link.stage(stream, staged) })
    }

    /// A staged tensor is used on `stream` from now: the stream waits for its copy.
    fn use_staged(&self, py: Python<'_>, event: u64, stream: u64) -> PyResult<()> {
        guarded(py, || self.link.use_staged(event, stream))
    }

    /// A staged tensor is let go unused: `made_on` (its allocator's stream) waits for its copy.
    fn drop_staged(&self, py: Python<'_>, event: u64, made_on: u64) -> PyResult<()> {
        guarded(py, || self.link.drop_staged(event, made_on))
    }

    /// Wait for every copy in flight; what the poll then saw.
    fn synchronize(&self, py: Python<'_>) -> PyResult<LandedList> {
        let landed = guarded(py, || self.link.synchronize())?;
        Ok(landed_list(py, landed))
    }

    /// Simulated device only: inject `fault` ("fail", "stale_source", "late_landing") into the
    /// next copy going `direction` ("to_host", "to_device").
    fn inject(&self, fault: &str, direction: &str) -> PyResult<()> {
        let Some(sim) = &self.sim else {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "faults are injected into the simulated device only",
            ));
        };
        let f = match fault {
            "fail" => Fault::Fail,
            "stale_source" => Fault::StaleSource,
            "late_landing" => Fault::LateLanding,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "fault {other:?}: expected fail, stale_source or late_landing"
                )))
            }
        };
        let d = match direction {
            "to_host" => Dir::ToHost,
            "to_device" => Dir::ToDevice,
            other => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "direction {other:?}: expected to_host or to_device"
                )))
            }
        };
        sim.inject(f, d);
        Ok(())
    }

    /// "cuda" or "sim".
    #[getter]
    fn kind(&self) -> &'static str {
        self.link.device().kind()
    }

    /// Calls made to the device (Note [device calls]).
    #[getter]
    fn calls(&self) -> u64 {
        self.link.device().calls()
    }

    /// The held sources' cap (Note [back-pressure]).
    #[getter]
    fn cap_bytes(&self) -> u64 {
        self.link.counters().0.cap_bytes
    }

    /// Bytes of the copies not seen complete.
    #[getter]
    fn bytes_in_flight(&self) -> u64 {
        self.link.bytes_in_flight()
    }

    /// Bytes of the sources the ledger holds.
    #[getter]
    fn bytes_held(&self) -> u64 {
        self.link.counters().0.bytes_held
    }

    /// Copies whose victims made a compute stream wait.
    #[getter]
    fn forced_waits(&self) -> u64 {
        self.link.counters().0.forced_waits
    }

    /// Host seconds the link waited for the device.
    #[getter]
    fn host_wait_seconds(&self) -> f64 {
        self.link.counters().1.host_wait_seconds
    }

    /// Whether copy `id` has not been seen complete.
    fn in_flight(&self, id: u64) -> bool {
        self.link.in_flight(id)
    }

    /// Counters: cap_bytes, bytes_in_flight, peak_bytes_in_flight, bytes_held,
    /// peak_bytes_held, copies, forced_waits, sources_released, in_flight, staged (not yet
    /// used), copies_to_host, copies_to_device, staged_copies, urgent_copies, after_waits,
    /// host_wait_seconds, queries, calls.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let (l, s) = self.link.counters();
        let d = PyDict::new(py);
        d.set_item("cap_bytes", l.cap_bytes)?;
        d.set_item("bytes_in_flight", l.bytes_in_flight)?;
        d.set_item("peak_bytes_in_flight", l.peak_bytes_in_flight)?;
        d.set_item("bytes_held", l.bytes_held)?;
        d.set_item("peak_bytes_held", l.peak_bytes_held)?;
        d.set_item("copies", l.copies)?;
        d.set_item("forced_waits", l.forced_waits)?;
        d.set_item("sources_released", l.sources_released)?;
        d.set_item("in_flight", l.in_flight)?;
        d.set_item("staged", l.staged)?;
        d.set_item("copies_to_host", s.copies_to_host)?;
        d.set_item("copies_to_device", s.copies_to_device)?;
        d.set_item("staged_copies", s.staged)?;
        d.set_item("urgent_copies", s.urgent)?;
        d.set_item("after_waits", s.after_waits)?;
        d.set_item("host_wait_seconds", s.host_wait_seconds)?;
        d.set_item("queries", s.queries)?;
        d.set_item("calls", self.link.device().calls())?;
        Ok(d)
    }
}
