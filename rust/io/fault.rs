//! Fault injection, for tests (Rust and Python): make the next chunk operations fail or come
//! back short, so error paths and resubmission are exercised without a failing disk.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::Op;
use crate::extent::GRANULE;

/// What [`super::Swap::inject_fault`] makes go wrong. For tests only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FaultKind {
    /// The next chunk reads fail with the given errno.
    Read,
    /// The next chunk writes fail with the given errno (ENOSPC maps to `Error::OutOfSpace`).
    Write,
    /// The next chunk operations (either kind, of at least 8 KiB) are submitted for only half
    /// their bytes (rounded down to 4 KiB), so the engine sees a short transfer and must
    /// resubmit the rest. The errno is ignored.
    ShortIo,
}

/// What the engine must do instead of (or to) the next chunk operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Injected {
    /// Fail it with this errno without issuing it.
    Errno(i32),
    /// Issue it for only this many bytes.
    Short(usize),
}

#[derive(Default)]
pub(crate) struct Faults {
    armed: AtomicBool,
    state: Mutex<FaultState>,
}

#[derive(Default)]
struct FaultState {
    read: (i32, u32),
    write: (i32, u32),
    short: u32,
}

impl FaultState {
    fn any(&self) -> bool {
        self.read.1 > 0 || self.write.1 > 0 || self.short > 0
    }
}

impl Faults {
    /// Arm `count` faults of `kind` (replacing what was armed for that kind; 0 disarms it).
    pub fn inject(&self, kind: FaultKind, errno: i32, count: u32) {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        match kind {
            FaultKind::Read => st.read = (errno, count),
            FaultKind::Write => st.write = (errno, count),
            FaultKind::ShortIo => st.short = count,
        }
        self.armed.store(st.any(), Ordering::Release);
    }

    /// Consume one fault for an operation of `op` about to move `len` bytes, if one is armed.
    pub fn take(&self, op: Op, len: usize) -> Option<Injected> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let errs = match op {
            Op::Read => &mut st.read,
            Op::Write => &mut st.write,
        };
        let out = if errs.1 > 0 {
            errs.1 -= 1;
            Some(Injected::Errno(errs.0))
        } else {
            let half = len / 2 / GRANULE as usize * GRANULE as usize;
            if st.short > 0 && half > 0 {
                st.short -= 1;
                Some(Injected::Short(half))
            } else {
                None
            }
        };
        self.armed.store(st.any(), Ordering::Release);
        out
    }
}
