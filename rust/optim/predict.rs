//! Weight prediction for the one-step delayed update (`OffloadAdamW(overlap="delayed")`).
//!
//! # Note [weight prediction]
//! With the delayed update the device's forward and backward of step t+1 run while the host
//! computes step t's update, on parameters one update behind the exact ones: the gradient an
//! update applies was computed at `p[t-1]`, not `p[t]` (Note [delayed update] in
//! spillover/optim/delayed.py). On `benches/python/lowbit_quality.py` that cost 4 % of the
//! final validation loss. The delayed update's own pass knows, once it has computed step t's
//! master and moments, most of what step t+1 will do: Adam's direction is `m / sqrt(v)`, and
//! the next `m` is 90 % (`beta1`) this one. So the pass writes to the output buffer (what the
//! device gets) not the master but the master moved by the next step as predicted from the
//! state it just wrote:
//!
//! ```text
//! out = p * f32(1 - lr * wd) + (f32(-lr / (1 - beta1^(s+1))) * m) / (sqrt(v) / f32(sqrt(1 - beta2^(s+1))) + f32(eps))
//! ```
//!
//! with `p`, `m`, `v` the values step `s` (this pass) just wrote and this step's learning rate
//! and weight decay (the next one's are not known yet): the next update with its gradient
//! taken to be the momentum, as pipelined training predicts future weights (SpecTrain, Chen
//! et al. 2018; XPipe's Adam-based prediction, Guan et al. 2019). The master is the exact
//! delayed update's: only what the device computes its gradients at moves. Each operation is
//! one f32 rounding, no FMA, so numpy in f32 reproduces it bit for bit
//! (tests/python/test_optim_delayed.py). It needs an fp32 master (the output buffer is not the
//! value updated) and fp32 moments (the low-bit paths do not compute it: refused). Before the
//! parameters must be the master's again (`flush()`, a checkpoint), [`AdamState::write_params`]
//! writes the master to the output buffers.

use super::kernel::{update_sqrt, Bf16, Grad, Hyper, Param, LANES};
use super::task::{part_mut, state};
use super::{AdamState, Dtype, UnitStep};
use crate::error::{Error, Result};

/// The f32 constants of the predicted next step (computed in f64, rounded as [`Hyper::coeffs`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pred {
    pub decay: f32,
    pub neg_step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
}

impl Hyper {
    /// The constants of the step after this one, with this one's hyper-parameters.
    pub fn prediction(&self) -> Pred {
        let next = self.step + 1.0;
        let bc1 = 1.0 - self.beta1.powf(next);
        let bc2 = 1.0 - self.beta2.powf(next);
        Pred {
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            neg_step_size: (-(self.lr / bc1)) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
        }
    }
}

/// One element's predicted parameter from the new master `p`, `m` and `sqrt(v)`.
#[inline(always)]
pub(crate) fn predicted(p: f32, m: f32, r: f32, q: &Pred) -> f32 {
    p * q.decay + (q.neg_step_size * m) / (r / q.bc2_sqrt + q.eps)
}

/// As the kernel's master run, writing the predicted parameter to `out`.
#[inline(always)]
pub(crate) fn with_master_predicting<G: Grad, P: Param, const FMA: bool, const TAIL: bool>(
    master: &mut [f32],
    grad: &[G],
    out: &mut [P],
    m: &mut [f32],
    v: &mut [f32],
    k: &super::kernel::Coeffs,
    q: &Pred,
) {
    let n = m.len();
    assert!(
        master.len() == n && grad.len() == n && out.len() == n,
        "run lengths differ"
    );
    let mut pc = master.chunks_exact_mut(LANES);
    let mut gc = grad.chunks_exact(LANES);
    let mut mc = m.chunks_exact_mut(LANES);
    let mut vc = v.chunks_exact_mut(LANES);
    let mut oc = out.chunks_exact_mut(LANES);
    for ((((p, g), m), v), o) in (&mut pc)
        .zip(&mut gc)
        .zip(&mut mc)
        .zip(&mut vc)
        .zip(&mut oc)
    {
        for i in 0..LANES {
            let (p1, r) = update_sqrt::<FMA, TAIL>(p[i], g[i].widen(), &mut m[i], &mut v[i], k);
            p[i] = p1;
            o[i] = P::narrow(predicted(p1, m[i], r, q));
        }
    }
    let rest = pc.into_remainder().iter_mut().zip(gc.remainder());
    let rest = rest.zip(mc.into_remainder().iter_mut().zip(vc.into_remainder()));
    for (((p, g), (m, v)), o) in rest.zip(oc.into_remainder()) {
        let (p1, r) = update_sqrt::<FMA, TAIL>(*p, g.widen(), m, v, k);
        *p = p1;
        *o = P::narrow(predicted(p1, *m, r, q));
    }
}

impl AdamState {
    /// Write each listed unit's fp32 master to its `out` buffer in the model's dtype (the
    /// gradient and the hyper-parameters are not read): after predicted outputs (Note [weight
    /// prediction]), the parameters the model must hold at a flush or a checkpoint.
    ///
    /// # Safety
    /// Every `out` in `work` must be valid for writes of `len(unit)` elements of its dtype for
    /// the duration of the call, and no one else may touch it meanwhile.
    pub unsafe fn write_params(&mut self, work: &[UnitStep]) -> Result<()> {
        if !self.master {
            return Err(Error::Invalid(
                "write_params: this state has no master column (its output buffers are the \
                 values updated)"
                    .into(),
            ));
        }
        for w in work {
            self.check_unit(w.unit)?;
            if w.out.is_none() {
                return Err(Error::Invalid(format!(
                    "unit {}: no output address",
                    w.unit
                )));
            }
            if !self.initialized[w.unit] {
                return Err(Error::Invalid(format!(
                    "unit {}: no step has run, so it has no master to write",
                    w.unit
                )));
            }
        }
        let bits = self.bits;
        let run = |t: &super::task::Task| {
            let w = &work[t.work];
            // SAFETY: the task's state is valid and exclusive; `out` is the caller's contract.
            unsafe {
                let Some(master) = state(t, bits).0 else {
                    return;
                };
                match w.out.dtype {
                    Dtype::F32 => part_mut::<f32>(w.out, t).copy_from_slice(master),
                    Dtype::Bf16 => {
                        for (o, p) in part_mut::<Bf16>(w.out, t).iter_mut().zip(master.iter()) {
                            *o = Bf16::narrow(*p);
                        }
                    }
                }
            }
        };
        self.for_each_task(work.iter().map(|w| w.unit), false, run)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prediction_is_the_next_step_with_the_momentum_for_its_gradient() {
        let h = Hyper {
            lr: 2e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 4.0,
            grad_scale: 1.0,
        };
        let q = h.prediction();
        let k5 = Hyper { step: 5.0, ..h }.coeffs();
        assert_eq!(q.decay, k5.decay);
        assert_eq!(q.neg_step_size, k5.neg_step_size);
        assert_eq!(q.bc2_sqrt, k5.bc2_sqrt);
        assert_eq!(q.eps, k5.eps);
        let (p, m, v) = (0.5f32, -0.01f32, 4e-4f32);
        let want = p * k5.decay + (k5.neg_step_size * m) / (v.sqrt() / k5.bc2_sqrt + k5.eps);
        assert_eq!(predicted(p, m, v.sqrt(), &q), want);
        assert!(
            predicted(p, m, v.sqrt(), &q) > p * q.decay,
            "a negative momentum moves p up"
        );
    }
}
