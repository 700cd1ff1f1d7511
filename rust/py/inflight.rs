//! `Inflight` for Python: the ledger of device->host copies in flight (`crate::tier::Inflight`,
//! Note [the ledger of copies in flight]) that the link's `Transfers` keeps its accounting and
//! its victim choice in. Every call is a few map operations under a mutex nobody holds for
//! long, so none releases the GIL; none can fail or panic.

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;

use crate::tier::Inflight;

#[pyclass(name = "Inflight", module = "spillover._native", frozen)]
pub struct PyInflight {
    ledger: Mutex<Inflight>,
}

impl PyInflight {
    fn lock(&self) -> MutexGuard<'_, Inflight> {
        // The ledger cannot panic (saturating sums), so a poisoned lock still holds a whole one.
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

#[pymethods]
impl PyInflight {
    /// An empty ledger whose held sources are capped at `cap_bytes`.
    #[new]
    fn new(cap_bytes: u64) -> Self {
        PyInflight {
            ledger: Mutex::new(Inflight::new(cap_bytes)),
        }
    }

    /// A copy of `nbytes` started, its source held: `(id, victims)`, the victims being the ids
    /// whose sources must be dropped now (oldest first, never `id`) after the compute stream
    /// waited on their copies. A non-empty list counts one forced wait.
    fn issue(&self, nbytes: u64) -> (u64, Vec<u64>) {
        let i = self.lock().issue(nbytes);
        (i.id, i.victims)
    }

    /// Copy `id` was observed complete (its source, if held, released): True the first time
    /// only; any other call changes nothing.
    fn landed(&self, id: u64) -> bool {
        self.lock().landed(id)
    }

    /// Release every held source: their ids, oldest first.
    fn release_all(&self) -> Vec<u64> {
        self.lock().release_all()
    }

    /// The oldest copy not observed complete (the one to poll), or None.
    fn front(&self) -> Option<u64> {
        self.lock().front()
    }

    /// Copies not observed complete, oldest first.
    fn in_flight_ids(&self) -> Vec<u64> {
        self.lock().in_flight_ids().collect()
    }

    /// Copies whose source is held, oldest first.
    fn held_ids(&self) -> Vec<u64> {
        self.lock().held_ids().collect()
    }

    fn is_in_flight(&self, id: u64) -> bool {
        self.lock().is_in_flight(id)
    }

    fn is_held(&self, id: u64) -> bool {
        self.lock().is_held(id)
    }

    #[getter]
    fn cap_bytes(&self) -> u64 {
        self.lock().cap_bytes()
    }

    #[getter]
    fn bytes_in_flight(&self) -> u64 {
        self.lock().bytes_in_flight()
    }

    #[getter]
    fn in_flight(&self) -> usize {
        self.lock().in_flight()
    }

    #[getter]
    fn bytes_held(&self) -> u64 {
        self.lock().bytes_held()
    }

    #[getter]
    fn held(&self) -> usize {
        self.lock().held()
    }

    #[getter]
    fn peak_bytes_in_flight(&self) -> u64 {
        self.lock().peak_bytes_in_flight()
    }

    #[getter]
    fn peak_bytes_held(&self) -> u64 {
        self.lock().peak_bytes_held()
    }

    #[getter]
    fn copies(&self) -> u64 {
        self.lock().copies()
    }

    #[getter]
    fn forced_waits(&self) -> u64 {
        self.lock().forced_waits()
    }

    #[getter]
    fn sources_released(&self) -> u64 {
        self.lock().sources_released()
    }
}
