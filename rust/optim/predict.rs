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
//!
//! # Note [next-gradient prediction]
//! The momentum stands in for the next gradient only because that gradient is not known when
//! the pass runs. It is known, on the device, when the prediction is applied: `step()` t+1
//! copies the parameters back with step t+1's gradient `g'` in hand. The next update is
//!
//! ```text
//! p' = p*decay - lr/bc1' * (beta1*m + (1-beta1)*g') / den',   den' = sqrt(v'/bc2') + eps,
//! v' = beta2*v + (1-beta2)*g'^2
//! ```
//!
//! So with a `coef` buffer the pass writes to `out` the part without `g'`, its momentum over
//! this step's denominator, and to `coef` the `v` part of the next denominator:
//!
//! ```text
//! out  = p * f32(1 - lr*wd) + (f32(-lr*beta1/bc1') * m) / (sqrt(v) / f32(sqrt(bc2')) + f32(eps))
//! coef = v * f32(beta2 / bc2')
//! ```
//!
//! (`coef` in bf16 whatever the parameters' dtype: it only scales the gradient's term, and
//! its 2 bytes per parameter are all the prediction adds to what crosses the link), and the
//! device sets, at the next `step()`, `p = out - (lr*(1-beta1)/bc1') * g' /
//! (sqrt(coef + (1-beta2)/bc2' * g'^2) + eps)` with that step's hyper-parameters and
//! gradient (spillover/optim/delayed.py, `Delayed._send_predicted`). That is the next
//! update exactly but for the momentum's denominator, `den` for `den'`: what the device
//! computes its gradients at is the exact update's but for `v`'s one-step change in one term.
//! A form linear in `g'` (`v'` taken as `v`) needs no more bytes, but its steps are unbounded
//! where `g'^2` is far above `v`: on tests/python/test_optim_delayed.py's model (lr 1e-2, no
//! warm-up) its second step put the parameters 12.5 (in norm) from the exact update's, where
//! the momentum's prediction was 0.28 away and this form is 0.15; this one's gradient term is
//! bounded as Adam's is.

use super::kernel::{update_sqrt, Bf16, Grad, Hyper, Param, LANES};
use super::task::{part_mut, state};
use super::{AdamState, Dtype, UnitStep};
use crate::error::{Error, Result};

/// The f32 constants of the predicted next step (computed in f64, rounded as [`Hyper::coeffs`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pred {
    pub decay: f32,
    /// The momentum's factor: `-lr/bc1'`, or `-lr*beta1/bc1'` without the next gradient's term.
    pub neg_step_size: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `beta2/bc2'`, the factor of `v` in the next denominator's square (Note [next-gradient
    /// prediction]); 0 in the plain prediction, which writes no coefficient.
    pub vscale: f32,
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
            vscale: 0.0,
        }
    }

    /// As [`Hyper::prediction`], without the next gradient's term (Note [next-gradient
    /// prediction]).
    pub fn gradient_prediction(&self) -> Pred {
        let next = self.step + 1.0;
        let bc1 = 1.0 - self.beta1.powf(next);
        let bc2 = 1.0 - self.beta2.powf(next);
        Pred {
            neg_step_size: (-(self.lr * self.beta1 / bc1)) as f32,
            vscale: (self.beta2 / bc2) as f32,
            ..self.prediction()
        }
    }
}

/// One element's predicted parameter from the new master `p`, `m` and `sqrt(v)`.
#[inline(always)]
pub(crate) fn predicted(p: f32, m: f32, r: f32, q: &Pred) -> f32 {
    p * q.decay + (q.neg_step_size * m) / (r / q.bc2_sqrt + q.eps)
}

/// One element's prediction without the next gradient's term, and its coefficient (Note
/// [next-gradient prediction]).
#[inline(always)]
pub(crate) fn without_gradient(p: f32, m: f32, v: f32, r: f32, q: &Pred) -> (f32, f32) {
    (predicted(p, m, r, q), v * q.vscale)
}

/// As the kernel's master run, writing the predicted parameter to `out`, and with a non-empty
/// `coef` the one without the next gradient's term and its coefficient (Note [next-gradient
/// prediction]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn with_master_predicting<G: Grad, P: Param, const FMA: bool, const TAIL: bool>(
    master: &mut [f32],
    grad: &[G],
    out: &mut [P],
    coef: &mut [Bf16],
    m: &mut [f32],
    v: &mut [f32],
    k: &super::kernel::Coeffs,
    q: &Pred,
) {
    if !coef.is_empty() {
        return with_master_coef::<G, P, FMA, TAIL>(master, grad, out, coef, m, v, k, q);
    }
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

/// [`with_master_predicting`] with a coefficient buffer.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn with_master_coef<G: Grad, P: Param, const FMA: bool, const TAIL: bool>(
    master: &mut [f32],
    grad: &[G],
    out: &mut [P],
    coef: &mut [Bf16],
    m: &mut [f32],
    v: &mut [f32],
    k: &super::kernel::Coeffs,
    q: &Pred,
) {
    let n = m.len();
    assert!(
        master.len() == n && grad.len() == n && out.len() == n && coef.len() == n,
        "run lengths differ"
    );
    let mut pc = master.chunks_exact_mut(LANES);
    let mut gc = grad.chunks_exact(LANES);
    let mut mc = m.chunks_exact_mut(LANES);
    let mut vc = v.chunks_exact_mut(LANES);
    let mut oc = out.chunks_exact_mut(LANES);
    let mut cc = coef.chunks_exact_mut(LANES);
    for (((((p, g), m), v), o), c) in (&mut pc)
        .zip(&mut gc)
        .zip(&mut mc)
        .zip(&mut vc)
        .zip(&mut oc)
        .zip(&mut cc)
    {
        for i in 0..LANES {
            let (p1, r) = update_sqrt::<FMA, TAIL>(p[i], g[i].widen(), &mut m[i], &mut v[i], k);
            p[i] = p1;
            let (pred, cf) = without_gradient(p1, m[i], v[i], r, q);
            o[i] = P::narrow(pred);
            c[i] = Bf16::narrow(cf);
        }
    }
    let rest = pc.into_remainder().iter_mut().zip(gc.remainder());
    let rest = rest.zip(mc.into_remainder().iter_mut().zip(vc.into_remainder()));
    let outs = oc.into_remainder().iter_mut().zip(cc.into_remainder());
    for (((p, g), (m, v)), (o, c)) in rest.zip(outs) {
        let (p1, r) = update_sqrt::<FMA, TAIL>(*p, g.widen(), m, v, k);
        *p = p1;
        let (pred, cf) = without_gradient(p1, *m, *v, r, q);
        *o = P::narrow(pred);
        *c = Bf16::narrow(cf);
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

    #[test]
    fn with_its_gradient_the_prediction_is_the_next_step_but_for_the_momentums_denominator() {
        let h = Hyper {
            lr: 2e-3,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            step: 4.0,
            grad_scale: 1.0,
        };
        let q = h.gradient_prediction();
        let plain = h.prediction();
        assert_eq!(
            (q.decay, q.bc2_sqrt, q.eps),
            (plain.decay, plain.bc2_sqrt, plain.eps)
        );
        let (bc1, bc2) = (1.0 - 0.9f64.powi(5), 1.0 - 0.95f64.powi(5));
        // the device's part, in f64, with the next step's constants
        let apply = |pred: f32, w: f32, g: f64| {
            let den = (w as f64 + 0.05 / bc2 * g * g).sqrt() + 1e-8;
            pred as f64 - 2e-3 * 0.1 / bc1 * g / den
        };
        let next = |p: f64, m: f64, v: f64, g: f64| {
            let (m1, v1) = (0.9 * m + 0.1 * g, 0.95 * v + 0.05 * g * g);
            p * (1.0 - 2e-3 * 0.1) - 2e-3 / bc1 * m1 / ((v1 / bc2).sqrt() + 1e-8)
        };
        let (p, v) = (0.5f64, 4e-4f64);
        for g in [0.03f64, -0.5, 40.0] {
            // no momentum: the exact next step, whatever the gradient's size against v
            let (pred, w) = without_gradient(p as f32, 0.0, v as f32, (v as f32).sqrt(), &q);
            let (got, want) = (apply(pred, w, g), next(p, 0.0, v, g));
            assert!(
                (got - want).abs() < 1e-6 * want.abs(),
                "{got} against {want}"
            );
        }
        // with momentum the gradient term is exact and bounded: a huge gradient moves p by at
        // most the update's bound, lr/bc1' * (1-beta1) * sqrt(bc2'/(1-beta2))
        let (pred, w) = without_gradient(p as f32, -0.01, v as f32, (v as f32).sqrt(), &q);
        let far = apply(pred, w, 1e6) - pred as f64;
        let bound = 2e-3 / bc1 * 0.1 * (bc2 / 0.05).sqrt();
        assert!(
            far < 0.0 && -far <= bound * (1.0 + 1e-6),
            "{far} against {bound}"
        );
    }
}
