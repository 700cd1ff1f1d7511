//! The ledger of device->host copies in flight: which copies have not been observed complete,
//! which of them still have their device source held, how many bytes each set weighs, and,
//! when a new copy pushes the held bytes past the cap, whose sources must go.
//!
//! Pure bookkeeping over ids and byte counts: no lock, no I/O, no torch. The device link
//! (`rust/link/mod.rs`, `Link`) issues a copy per id handed out here, asks
//! [`Inflight::issue`] which sources to drop, makes the compute stream wait on those copies'
//! events; its Python side (`activations/link/device.py`) drops them (Note [sources held]).
//! Python reaches it as `spillover._native.Inflight` (`rust/py/inflight.rs`); the property
//! tests against a plain model are in `tests/inflight.rs`.
//!
//! # Note [the ledger of copies in flight]
//! A copy is issued with its source held (the device bytes it reads must stay alive until it
//! has read them). From then on two things happen to it, each once, in any order relative to
//! the other copies:
//! - its source is *released*: as a victim of a later [`Inflight::issue`] that passed the cap,
//!   or by [`Inflight::release_all`] (the caller made the compute stream wait on the copy);
//! - it *lands* ([`Inflight::landed`]): observed complete; if its source was still held it is
//!   released now, without a wait.
//!
//! Invariants, after every call (guarded by `tests/inflight.rs`):
//! 1. ids grow in issue order, so the maps below iterate in issue order; `front()` is the
//!    oldest copy not landed (a copy stream finishes in issue order: poll that one);
//! 2. held ⊆ in flight: a landed copy's source is never held;
//! 3. `bytes_in_flight` / `bytes_held` are the sums of the copies' sizes over the two sets;
//! 4. `bytes_held <= cap_bytes`, unless the only copy held is the newest one issued: a copy
//!    larger than the cap passes alone, and the copy just issued is never its own victim (its
//!    event was recorded after the call that made it; waiting on it at once would serialize
//!    the compute stream behind every copy);
//! 5. the victims of an issue are the oldest held sources, in issue order, and no more of them
//!    than it takes to bring the held bytes under the cap;
//! 6. `landed` is true exactly once per issued id; any other call changes nothing;
//! 7. the peaks are the maxima of the two sums over time, taken after a copy was added and
//!    before its victims were released (the bytes the device held at that moment).
//!
//! Sums saturate instead of overflowing, so no call can panic (Note [no panic across the
//! boundary] in `rust/py/errors.rs`); sizes of real copies never come near.

use std::collections::BTreeMap;

/// What [`Inflight::issue`] decided: the new copy's id, and the copies whose sources must be
/// dropped now (oldest first, never the new one) after the compute stream waited on them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    pub id: u64,
    pub victims: Vec<u64>,
}

/// The ledger (Note [the ledger of copies in flight]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inflight {
    cap_bytes: u64,
    next_id: u64,
    /// Copies not observed complete, id -> bytes.
    flight: BTreeMap<u64, u64>,
    /// Copies whose source is held, id -> bytes (a subset of `flight`).
    held: BTreeMap<u64, u64>,
    bytes_in_flight: u64,
    bytes_held: u64,
    peak_bytes_in_flight: u64,
    peak_bytes_held: u64,
    copies: u64,
    forced_waits: u64,
    sources_released: u64,
}

impl Inflight {
    /// An empty ledger whose held sources are capped at `cap_bytes`.
    pub fn new(cap_bytes: u64) -> Inflight {
        Inflight {
            cap_bytes,
            next_id: 0,
            flight: BTreeMap::new(),
            held: BTreeMap::new(),
            bytes_in_flight: 0,
            bytes_held: 0,
            peak_bytes_in_flight: 0,
            peak_bytes_held: 0,
            copies: 0,
            forced_waits: 0,
            sources_released: 0,
        }
    }

    /// A copy of `nbytes` started, its source held. Returns its id and the victims: the
    /// oldest held sources to drop so that the held bytes fit under the cap again (the new
    /// copy is never one of them). A non-empty list counts one forced wait.
    pub fn issue(&mut self, nbytes: u64) -> Issued {
        let id = self.next_id;
        self.next_id += 1;
        self.copies += 1;
        self.flight.insert(id, nbytes);
        self.held.insert(id, nbytes);
        self.bytes_in_flight = self.bytes_in_flight.saturating_add(nbytes);
        self.bytes_held = self.bytes_held.saturating_add(nbytes);
        self.peak_bytes_in_flight = self.peak_bytes_in_flight.max(self.bytes_in_flight);
        self.peak_bytes_held = self.peak_bytes_held.max(self.bytes_held);
        let mut victims = Vec::new();
        while self.bytes_held > self.cap_bytes {
            let Some(entry) = self.held.first_entry() else {
                break;
            };
            if *entry.key() == id {
                break; // the newest passes alone
            }
            let (v, n) = entry.remove_entry();
            self.bytes_held = self.bytes_held.saturating_sub(n);
            victims.push(v);
        }
        if !victims.is_empty() {
            self.forced_waits += 1;
            self.sources_released += victims.len() as u64;
        }
        Issued { id, victims }
    }

    /// Copy `id` was observed complete: it leaves the copies in flight, and its source, if
    /// still held, is released (no wait needed). True the first time only; any other call
    /// (landed before, never issued) changes nothing.
    pub fn landed(&mut self, id: u64) -> bool {
        let Some(n) = self.flight.remove(&id) else {
            return false;
        };
        self.bytes_in_flight = self.bytes_in_flight.saturating_sub(n);
        if let Some(h) = self.held.remove(&id) {
            self.bytes_held = self.bytes_held.saturating_sub(h);
        }
        true
    }

    /// Release every held source: the ids whose sources the caller drops now (after making
    /// the compute stream wait on their copies), oldest first. No forced wait is counted.
    pub fn release_all(&mut self) -> Vec<u64> {
        let ids: Vec<u64> = std::mem::take(&mut self.held).into_keys().collect();
        self.bytes_held = 0;
        self.sources_released += ids.len() as u64;
        ids
    }

    /// The oldest copy not observed complete: the one to poll (a copy stream finishes in issue
    /// order, so if it has not landed none after it has).
    pub fn front(&self) -> Option<u64> {
        self.flight.first_key_value().map(|(&id, _)| id)
    }

    /// Whether copy `id` has been issued and not observed complete.
    pub fn is_in_flight(&self, id: u64) -> bool {
        self.flight.contains_key(&id)
    }

    /// Whether the source of copy `id` is held.
    pub fn is_held(&self, id: u64) -> bool {
        self.held.contains_key(&id)
    }

    /// The copies not observed complete, oldest first.
    pub fn in_flight_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.flight.keys().copied()
    }

    /// The copies whose source is held, oldest first.
    pub fn held_ids(&self) -> impl Iterator<Item = u64> + '_ {
        self.held.keys().copied()
    }

    pub fn cap_bytes(&self) -> u64 {
        self.cap_bytes
    }

    /// Bytes of the copies not observed complete.
    pub fn bytes_in_flight(&self) -> u64 {
        self.bytes_in_flight
    }

    /// Number of copies not observed complete.
    pub fn in_flight(&self) -> usize {
        self.flight.len()
    }

    /// Bytes of the sources held.
    pub fn bytes_held(&self) -> u64 {
        self.bytes_held
    }

    /// Number of sources held.
    pub fn held(&self) -> usize {
        self.held.len()
    }

    pub fn peak_bytes_in_flight(&self) -> u64 {
        self.peak_bytes_in_flight
    }

    pub fn peak_bytes_held(&self) -> u64 {
        self.peak_bytes_held
    }

    /// Copies issued.
    pub fn copies(&self) -> u64 {
        self.copies
    }

    /// Issues that passed the cap and released sources (each one wait of the compute stream).
    pub fn forced_waits(&self) -> u64 {
        self.forced_waits
    }

    /// Sources released before their copy landed: victims and `release_all`.
    pub fn sources_released(&self) -> u64 {
        self.sources_released
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn past_the_cap_the_oldest_sources_go_and_the_newest_passes_alone() {
        let mut l = Inflight::new(10);
        assert_eq!(l.issue(4).victims, Vec::<u64>::new());
        assert_eq!(l.issue(4).victims, Vec::<u64>::new());
        let c = l.issue(4);
        assert_eq!((c.id, c.victims), (2, vec![0]));
        assert_eq!((l.bytes_held(), l.bytes_in_flight()), (8, 12));
        let big = l.issue(100);
        assert_eq!(big.victims, vec![1, 2]);
        assert_eq!((l.bytes_held(), l.held()), (100, 1));
        assert_eq!((l.forced_waits(), l.sources_released()), (2, 3));
        assert_eq!((l.peak_bytes_held(), l.peak_bytes_in_flight()), (108, 112));
    }

    #[test]
    fn landing_releases_once_and_the_front_moves_in_issue_order() {
        let mut l = Inflight::new(100);
        let a = l.issue(3).id;
        let b = l.issue(5).id;
        assert_eq!(l.front(), Some(a));
        assert!(l.landed(b));
        assert!(!l.landed(b));
        assert!(!l.landed(99));
        assert_eq!(
            (l.front(), l.bytes_in_flight(), l.bytes_held()),
            (Some(a), 3, 3)
        );
        assert_eq!(l.release_all(), vec![a]);
        assert_eq!(
            (l.bytes_held(), l.bytes_in_flight(), l.sources_released()),
            (0, 3, 1)
        );
        assert!(l.landed(a));
        assert_eq!((l.front(), l.bytes_in_flight()), (None, 0));
    }
}
