//! The ledger of copies in flight (`spillover_core::tier::Inflight`, Note [the ledger of copies
//! in flight]) against a model: random sequences of issue / landed (any order, repeats, ids
//! never issued) / release_all. The model is the bookkeeping `Transfers` in
//! the Python link policy did before the ledger moved here (a FIFO of
//! copies and a deque of held sources, emptied lazily from the front), so passing also says
//! the victims and the counters are the same as before; the invariants are checked on their own
//! after every operation.

use std::collections::VecDeque;

use proptest::prelude::*;
use spillover_core::tier::Inflight;

#[derive(Debug, Clone)]
enum Op {
    Issue(u64),
    /// Land the n-th copy issued so far (mod their number), or, past them, an id never issued.
    Landed(usize),
    ReleaseAll,
}

fn op(cap: u64) -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..=cap * 2 + 3).prop_map(Op::Issue),
        4 => (0usize..64).prop_map(Op::Landed),
        1 => Just(Op::ReleaseAll),
    ]
}

#[derive(Debug, Clone)]
struct Copy {
    nbytes: u64,
    finished: bool,
    src: bool,
}

/// the Python policy's bookkeeping, transcribed.
#[derive(Debug, Default)]
struct Model {
    cap: u64,
    copies: Vec<Copy>,
    held: VecDeque<usize>,
    bytes_in_flight: u64,
    bytes_held: u64,
    peak_in_flight: u64,
    peak_held: u64,
    forced_waits: u64,
    sources_released: u64,
}

impl Model {
    fn issue(&mut self, n: u64) -> (u64, Vec<u64>) {
        let c = self.copies.len();
        self.copies.push(Copy {
            nbytes: n,
            finished: false,
            src: true,
        });
        self.held.push_back(c);
        self.bytes_in_flight += n;
        self.bytes_held += n;
        self.peak_in_flight = self.peak_in_flight.max(self.bytes_in_flight);
        self.peak_held = self.peak_held.max(self.bytes_held);
        let mut victims = Vec::new();
        while self.bytes_held > self.cap && self.held[0] != c {
            let v = self.held.pop_front().unwrap();
            if self.copies[v].src {
                self.copies[v].src = false;
                self.bytes_held -= self.copies[v].nbytes;
                victims.push(v as u64);
            }
        }
        if !victims.is_empty() {
            self.forced_waits += 1;
            self.sources_released += victims.len() as u64;
        }
        (c as u64, victims)
    }

    fn landed(&mut self, c: usize) -> bool {
        let Some(copy) = self.copies.get_mut(c) else {
            return false;
        };
        if copy.finished {
            return false;
        }
        copy.finished = true;
        self.bytes_in_flight -= copy.nbytes;
        if copy.src {
            copy.src = false;
            self.bytes_held -= copy.nbytes;
        }
        true
    }

    fn release_all(&mut self) -> Vec<u64> {
        let mut out = Vec::new();
        for c in self.held.drain(..) {
            if self.copies[c].src {
                self.copies[c].src = false;
                self.bytes_held -= self.copies[c].nbytes;
                out.push(c as u64);
            }
        }
        self.sources_released += out.len() as u64;
        out
    }

    fn front(&self) -> Option<u64> {
        self.copies
            .iter()
            .position(|c| !c.finished)
            .map(|c| c as u64)
    }
}

fn check(l: &Inflight, m: &Model, newest: Option<u64>) -> Result<(), TestCaseError> {
    let flight: Vec<u64> = l.in_flight_ids().collect();
    let held: Vec<u64> = l.held_ids().collect();
    let want_flight: Vec<u64> = (0..m.copies.len() as u64)
        .filter(|&c| !m.copies[c as usize].finished)
        .collect();
    let want_held: Vec<u64> = (0..m.copies.len() as u64)
        .filter(|&c| m.copies[c as usize].src)
        .collect();
    prop_assert_eq!(&flight, &want_flight);
    prop_assert_eq!(&held, &want_held);
    let size = |ids: &[u64]| {
        ids.iter()
            .map(|&c| m.copies[c as usize].nbytes)
            .sum::<u64>()
    };
    // the sums are the sums over the sets, held ⊆ in flight
    prop_assert_eq!(l.bytes_in_flight(), size(&flight));
    prop_assert_eq!(l.bytes_held(), size(&held));
    prop_assert_eq!((l.in_flight(), l.held()), (flight.len(), held.len()));
    prop_assert!(held.iter().all(|c| l.is_in_flight(*c) && l.is_held(*c)));
    // under the cap, unless the newest copy is held alone
    prop_assert!(l.bytes_held() <= l.cap_bytes() || (held.len() == 1 && Some(held[0]) == newest));
    prop_assert_eq!(l.front(), m.front());
    prop_assert_eq!(l.front(), flight.first().copied());
    prop_assert!(l.peak_bytes_in_flight() >= l.bytes_in_flight());
    prop_assert!(l.peak_bytes_held() >= l.bytes_held());
    prop_assert_eq!(
        (l.peak_bytes_in_flight(), l.peak_bytes_held()),
        (m.peak_in_flight, m.peak_held)
    );
    prop_assert_eq!(l.copies(), m.copies.len() as u64);
    prop_assert_eq!(
        (l.forced_waits(), l.sources_released()),
        (m.forced_waits, m.sources_released)
    );
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_ledger_matches_the_model(
        (cap, ops) in (0u64..48).prop_flat_map(|cap| (Just(cap), prop::collection::vec(op(cap), 0..80)))
    ) {
        let mut l = Inflight::new(cap);
        let mut m = Model { cap, ..Model::default() };
        let mut newest = None;
        for o in ops {
            let peaks = (l.peak_bytes_in_flight(), l.peak_bytes_held());
            match o {
                Op::Issue(n) => {
                    let held_before: Vec<u64> = l.held_ids().collect();
                    let i = l.issue(n);
                    let (id, victims) = m.issue(n);
                    prop_assert_eq!(i.id, id);
                    prop_assert_eq!(&i.victims, &victims);
                    // the victims are the oldest held, in order, never the new copy, and no
                    // more than it takes to get under the cap
                    prop_assert!(!i.victims.contains(&i.id));
                    prop_assert_eq!(&held_before[..i.victims.len()], &i.victims[..]);
                    if let Some(&last) = i.victims.last() {
                        prop_assert!(l.bytes_held() + m.copies[last as usize].nbytes > cap);
                    }
                    newest = Some(id);
                }
                Op::Landed(k) => {
                    let c = if m.copies.is_empty() { k } else if k < 48 { k % m.copies.len() } else { m.copies.len() + k };
                    let before = l.clone();
                    let first = l.landed(c as u64);
                    prop_assert_eq!(first, m.landed(c));
                    if !first {
                        prop_assert_eq!(&l, &before); // a repeat changes nothing
                    }
                    prop_assert!(!l.landed(c as u64));
                }
                Op::ReleaseAll => {
                    let held_before: Vec<u64> = l.held_ids().collect();
                    let ids = l.release_all();
                    prop_assert_eq!(&ids, &m.release_all());
                    prop_assert_eq!(&ids, &held_before);
                    prop_assert_eq!((l.held(), l.bytes_held()), (0, 0));
                }
            }
            // peaks never go down
            prop_assert!(l.peak_bytes_in_flight() >= peaks.0 && l.peak_bytes_held() >= peaks.1);
            check(&l, &m, newest)?;
        }
        // everything lands in the end: nothing left in flight or held
        for c in 0..m.copies.len() as u64 {
            l.landed(c);
        }
        prop_assert_eq!((l.in_flight(), l.held(), l.bytes_in_flight(), l.bytes_held()), (0, 0, 0, 0));
        prop_assert_eq!(l.front(), None);
    }
}
