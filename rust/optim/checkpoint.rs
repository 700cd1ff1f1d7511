//! Copying units' state to and from f32 buffers: [`AdamState::export`] and
//! [`AdamState::import`] (what a checkpoint saves and loads).

use super::task::{columns, part, part_mut, Task};
use super::{AdamState, Dtype, Ptr, UnitBuffers};
use crate::error::{Error, Result};

impl AdamState {
    /// Copy each listed unit's state into the f32 buffers given.
    ///
    /// # Safety
    /// Every non-zero address must be valid for writes of `len(unit)` f32, not overlapping
    /// anything else in the call, for its duration.
    pub unsafe fn export(&mut self, bufs: &[UnitBuffers]) -> Result<()> {
        self.check_buffers(bufs, true)?;
        let master = self.master;
        let copy = |t: &Task| {
            let b = &bufs[t.work];
            // SAFETY: the piece lies inside its chunk; the caller vouches for the buffers.
            unsafe { copy_piece(t, b, master, false) }
        };
        self.for_each_task(bufs.iter().map(|b| b.unit), false, copy)
    }

    /// Set each listed unit's state from the f32 buffers given; the units count as
    /// initialized afterwards.
    ///
    /// # Safety
    /// Every non-zero address must be valid for reads of `len(unit)` f32 for the call.
    pub unsafe fn import(&mut self, bufs: &[UnitBuffers]) -> Result<()> {
        self.check_buffers(bufs, false)?;
        let master = self.master;
        let copy = |t: &Task| {
            let b = &bufs[t.work];
            // SAFETY: as in `export`, in the other direction.
            unsafe { copy_piece(t, b, master, true) }
        };
        self.for_each_task(bufs.iter().map(|b| b.unit), true, copy)?;
        for b in bufs {
            self.initialized[b.unit] = true;
        }
        Ok(())
    }

    fn check_buffers(&self, bufs: &[UnitBuffers], need_init: bool) -> Result<()> {
        let mut seen = vec![false; self.layout.units()];
        for b in bufs {
            self.check_unit(b.unit)?;
            if std::mem::replace(&mut seen[b.unit], true) {
                return Err(Error::Invalid(format!("unit {} listed twice", b.unit)));
            }
            if need_init && !self.initialized[b.unit] {
                return Err(Error::Invalid(format!(
                    "unit {} has no state yet (it has not taken a step)",
                    b.unit
                )));
            }
            if b.exp_avg == 0 || b.exp_avg_sq == 0 || (self.master && b.master == 0) {
                return Err(Error::Invalid(format!(
                    "unit {}: a buffer address is missing",
                    b.unit
                )));
            }
        }
        Ok(())
    }
}

/// Copy a piece between the state and a unit's f32 buffers (`into_state`: import).
///
/// # Safety
/// As [`columns`] for the state; the buffers must be valid for `unit_off + len` f32.
unsafe fn copy_piece(t: &Task, b: &UnitBuffers, master: bool, into_state: bool) {
    // SAFETY: forwarded contract.
    unsafe {
        let (mst, m, v) = columns(t, master);
        let pairs = [
            (mst, b.master),
            (Some(m), b.exp_avg),
            (Some(v), b.exp_avg_sq),
        ];
        for (col, addr) in pairs {
            let Some(col) = col else { continue };
            let p = Ptr::new(addr, Dtype::F32);
            if into_state {
                col.copy_from_slice(part::<f32>(p, t));
            } else {
                part_mut::<f32>(p, t).copy_from_slice(col);
            }
        }
    }
}
