//! Copying units' state to and from buffers: [`AdamState::export`] and [`AdamState::import`]
//! (what a checkpoint saves and loads, and what the undo copy of an update made during
//! backward holds), as stored ([`Form::Stored`], exact) or as f32 values ([`Form::F32`],
//! a conversion between formats).

use super::quant::{self, BLOCK};
use super::task::{part_mut, state, Moments, Task};
use super::{AdamState, Dtype, Form, Ptr, StateBits, UnitBuffers};
use crate::error::{Error, Result};

impl AdamState {
    /// Copy each listed unit's state into the buffers given, in `form`.
    ///
    /// # Safety
    /// Every address the form and the state's format use (see [`UnitBuffers`]) must be valid
    /// for writes of the unit's elements in that form, not overlapping anything else in the
    /// call, for its duration.
    pub unsafe fn export(&mut self, bufs: &[UnitBuffers], form: Form) -> Result<()> {
        self.check_buffers(bufs, true, form)?;
        let bits = self.bits;
        let copy = |t: &Task| {
            let b = &bufs[t.work];
            // SAFETY: the piece lies inside its chunk; the caller vouches for the buffers.
            unsafe { copy_piece(t, b, bits, form, false) }
        };
        self.for_each_task(bufs.iter().map(|b| b.unit), false, copy)
    }

    /// Set each listed unit's state from the buffers given, in `form`; the units count as
    /// initialized afterwards.
    ///
    /// # Safety
    /// Every address the form and the state's format use must be valid for reads of the
    /// unit's elements in that form for the call.
    pub unsafe fn import(&mut self, bufs: &[UnitBuffers], form: Form) -> Result<()> {
        self.check_buffers(bufs, false, form)?;
        let bits = self.bits;
        let copy = |t: &Task| {
            let b = &bufs[t.work];
            // SAFETY: as in `export`, in the other direction.
            unsafe { copy_piece(t, b, bits, form, true) }
        };
        self.for_each_task(bufs.iter().map(|b| b.unit), true, copy)?;
        for b in bufs {
            self.initialized[b.unit] = true;
        }
        Ok(())
    }

    fn check_buffers(&self, bufs: &[UnitBuffers], need_init: bool, form: Form) -> Result<()> {
        let mut seen = vec![false; self.layout.units()];
        let scales = form == Form::Stored && self.bits.has_scales();
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
            if b.exp_avg == 0
                || b.exp_avg_sq == 0
                || (self.master && b.master == 0)
                || (scales && (b.exp_avg_scale == 0 || b.exp_avg_sq_scale == 0))
            {
                return Err(Error::Invalid(format!(
                    "unit {}: a buffer address is missing",
                    b.unit
                )));
            }
        }
        Ok(())
    }
}

/// A unit's buffer at `addr` as a slice of the task's piece.
///
/// # Safety
/// `addr` must hold at least `t.unit_off + t.len` elements of `T`.
unsafe fn buf<'a, T>(addr: usize, t: &Task) -> &'a mut [T] {
    // SAFETY: the caller's contract; `part_mut` only reads the address.
    unsafe { part_mut::<T>(Ptr::new(addr, Dtype::F32), t) }
}

/// A unit's scale buffer at `addr` as the slice of the task's blocks.
///
/// # Safety
/// `addr` must hold `blocks(len(unit))` f32; the task starts on a block of its unit.
unsafe fn scale_buf<'a>(addr: usize, t: &Task) -> &'a mut [f32] {
    debug_assert_eq!(t.unit_off % BLOCK, 0);
    // SAFETY: the caller's contract: the task's blocks are among the unit's.
    unsafe {
        std::slice::from_raw_parts_mut(
            (addr as *mut f32).add(t.unit_off / BLOCK),
            quant::blocks(t.len),
        )
    }
}

fn copy<T: Copy>(a: &mut [T], b: &mut [T], into_state: bool) {
    if into_state {
        a.copy_from_slice(b)
    } else {
        b.copy_from_slice(a)
    }
}

/// Copy a piece between the state and a unit's buffers (`into_state`: import).
///
/// # Safety
/// As [`state`] for the chunk; the buffers must be valid for the unit in `form`.
unsafe fn copy_piece(t: &Task, b: &UnitBuffers, bits: StateBits, form: Form, into_state: bool) {
    // SAFETY: forwarded contract.
    unsafe {
        let (mst, moments) = state(t, bits);
        if let Some(mst) = mst {
            copy(mst, buf(b.master, t), into_state);
        }
        match (moments, form) {
            (Moments::F32 { m, v }, _) => {
                copy(m, buf(b.exp_avg, t), into_state);
                copy(v, buf(b.exp_avg_sq, t), into_state);
            }
            (Moments::Bf16 { m, v }, Form::Stored) => {
                copy(m, buf(b.exp_avg, t), into_state);
                copy(v, buf(b.exp_avg_sq, t), into_state);
            }
            (Moments::Bf16 { m, v }, Form::F32) => {
                for (col, addr) in [(m, b.exp_avg), (v, b.exp_avg_sq)] {
                    let f = buf::<f32>(addr, t);
                    if into_state {
                        quant::narrow_bf16(f, col); // a conversion: nearest even
                    } else {
                        quant::widen_bf16(col, f);
                    }
                }
            }
            (
                Moments::Q8 {
                    m,
                    v,
                    m_scale,
                    v_scale,
                },
                Form::Stored,
            ) => {
                copy(m, buf(b.exp_avg, t), into_state);
                copy(v, buf(b.exp_avg_sq, t), into_state);
                copy(m_scale, scale_buf(b.exp_avg_scale, t), into_state);
                copy(v_scale, scale_buf(b.exp_avg_sq_scale, t), into_state);
            }
            (
                Moments::Q8 {
                    m,
                    v,
                    m_scale,
                    v_scale,
                },
                Form::F32,
            ) => {
                let (fm, fv) = (buf::<f32>(b.exp_avg, t), buf::<f32>(b.exp_avg_sq, t));
                let mut tmp = [0f32; BLOCK];
                for (bi, lo) in (0..t.len).step_by(BLOCK).enumerate() {
                    let hi = (lo + BLOCK).min(t.len);
                    if into_state {
                        m_scale[bi] = quant::quantize_m(&fm[lo..hi], &mut m[lo..hi]);
                        let r = &mut tmp[..hi - lo];
                        r.copy_from_slice(&fv[lo..hi]);
                        v_scale[bi] = quant::quantize_v(r, &mut v[lo..hi]);
                    } else {
                        quant::dequantize_m(&m[lo..hi], m_scale[bi], &mut fm[lo..hi]);
                        quant::dequantize_v(&v[lo..hi], v_scale[bi], &mut fv[lo..hi]);
                    }
                }
            }
        }
    }
}
