//! The fused AdamW kernel: one pass over a run of elements reads the gradient, the fp32 master
//! (or the fp32 parameter itself), `exp_avg` and `exp_avg_sq`, and writes them and the
//! model-dtype parameter.
//!
//! # Note [torch rounding]
//! The arithmetic is torch's fused CPU AdamW (`aten/src/ATen/native/cpu/FusedAdamKernel.cpp`)
//! operation for operation, in f32, with the per-step scalars computed in f64 and then rounded
//! to f32 as torch does:
//!
//! ```text
//! p   = p * f32(1 - lr * wd)
//! m   = fma(c, g - m, m)            c = f32(1 - beta1); if |c| >= 0.5: fma(c - 1, g - m, g)
//! v   = fma(f32(1 - beta2) * g, g, v * f32(beta2))
//! p   = p + (f32(-lr / bc1) * m) / (sqrt(v) / f32(sqrt(bc2)) + f32(eps))
//! ```
//!
//! torch's x86 builds contract the lerp and the `exp_avg_sq` update into FMAs (measured: the
//! plain forms differ from `torch.optim.AdamW(fused=True)` in 30% and 8% of elements). The
//! last `numel % 8` elements of each tensor go through torch's scalar remainder loop, which the
//! compiler contracted the other way, `v = fma(v, beta2, (1 - beta2) * g * g)` (AVX2 and AVX-512
//! builds alike: the AVX-512 remainder is itself vectorised 8 lanes at a time; measured with
//! `ATEN_CPU_CAPABILITY=avx2|avx512`); callers mark those elements as a unit's *tail*. With FMA
//! hardware (detected at run time) this kernel uses the same FMAs and matches torch's fused
//! kernel bit for bit; without it the plain forms are used and results agree to a few ulp.
//! torch's `foreach` and for-loop implementations round differently from its own fused kernel
//! (by a few ulp per step); `tests/python/test_optim.py` states the tolerances.
//!
//! bf16 is converted as torch converts it (dtype.rs).

/// Per-step constants of one parameter, derived from its hyper-parameters and step count.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Coeffs {
    /// `1 - lr * weight_decay` (decoupled weight decay).
    pub decay: f32,
    /// The lerp weight's coefficient and whether the lerp runs from `m` (|1 - beta1| < 0.5).
    pub lerp: f32,
    pub lerp_from_m: bool,
    pub beta2: f32,
    pub one_minus_beta2: f32,
    pub bc2_sqrt: f32,
    pub eps: f32,
    /// `-lr / (1 - beta1^step)`.
    pub neg_step_size: f32,
    /// Applied to the gradient first: `1/world` for a summed reduce-scatter, `-1` to maximize.
    pub grad_scale: f32,
}

/// AdamW hyper-parameters of one parameter for one step, in torch's units.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Hyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// The step count *after* this step's increment (1 on the first step).
    pub step: f64,
    pub grad_scale: f64,
}

impl Hyper {
    /// Check the values torch's AdamW checks, with messages that name them.
    pub fn validate(&self) -> Result<(), String> {
        // `(lo..).contains` is false for NaN, like torch's `0.0 <= x` checks.
        let checks = [
            (
                "learning rate",
                self.lr,
                (0.0..f64::INFINITY).contains(&self.lr),
            ),
            (
                "epsilon value",
                self.eps,
                (0.0..f64::INFINITY).contains(&self.eps),
            ),
            (
                "beta parameter at index 0",
                self.beta1,
                (0.0..1.0).contains(&self.beta1),
            ),
            (
                "beta parameter at index 1",
                self.beta2,
                (0.0..1.0).contains(&self.beta2),
            ),
            (
                "weight_decay value",
                self.weight_decay,
                (0.0..f64::INFINITY).contains(&self.weight_decay),
            ),
            (
                "step count (>= 1 after the increment)",
                self.step,
                (1.0..).contains(&self.step),
            ),
            (
                "gradient scale",
                self.grad_scale,
                self.grad_scale.is_finite(),
            ),
        ];
        match checks.iter().find(|c| !c.2) {
            Some((what, v, _)) => Err(format!("invalid {what}: {v}")),
            None => Ok(()),
        }
    }

    /// The f32 constants, computed in f64 and rounded as torch's fused kernel does.
    pub fn coeffs(&self) -> Coeffs {
        let bc1 = 1.0 - self.beta1.powf(self.step);
        let bc2 = 1.0 - self.beta2.powf(self.step);
        let lerp = (1.0 - self.beta1) as f32;
        let lerp_from_m = lerp.abs() < 0.5;
        Coeffs {
            decay: (1.0 - self.lr * self.weight_decay) as f32,
            lerp: if lerp_from_m { lerp } else { lerp - 1.0 },
            lerp_from_m,
            beta2: self.beta2 as f32,
            one_minus_beta2: (1.0 - self.beta2) as f32,
            bc2_sqrt: bc2.sqrt() as f32,
            eps: self.eps as f32,
            neg_step_size: (-(self.lr / bc1)) as f32,
            grad_scale: self.grad_scale as f32,
        }
    }
}

pub use super::dtype::{bf16_to_f32, f32_to_bf16, widen_into, Bf16, Grad, Param};

#[inline(always)]
fn mul_add<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// One element: returns the new parameter, updates `m` and `v`. `TAIL`: the form of torch's
/// scalar remainder loop (Note [torch rounding]).
#[inline(always)]
pub(crate) fn update<const FMA: bool, const TAIL: bool>(
    p: f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    k: &Coeffs,
) -> f32 {
    update_sqrt::<FMA, TAIL>(p, g, m, v, k).0
}

/// As [`update`], also returning `sqrt(v)` of the new `v`, which the update computes anyway
/// (8-bit state stores `exp_avg_sq` as its square root: Note [8-bit moments] in quant.rs).
#[inline(always)]
pub(crate) fn update_sqrt<const FMA: bool, const TAIL: bool>(
    p: f32,
    g: f32,
    m: &mut f32,
    v: &mut f32,
    k: &Coeffs,
) -> (f32, f32) {
    let g = g * k.grad_scale;
    let p = p * k.decay;
    let base = if k.lerp_from_m { *m } else { g };
    let m1 = mul_add::<FMA>(k.lerp, g - *m, base);
    let v1 = if TAIL {
        mul_add::<FMA>(*v, k.beta2, k.one_minus_beta2 * g * g)
    } else {
        mul_add::<FMA>(k.one_minus_beta2 * g, g, *v * k.beta2)
    };
    let r = v1.sqrt();
    let denom = r / k.bc2_sqrt + k.eps;
    *m = m1;
    *v = v1;
    (p + (k.neg_step_size * m1) / denom, r)
}

/// Where the kernel reads the fp32 value being optimized and writes the results.
pub enum Run<'a, G: Grad, P: Param> {
    /// fp32 parameter updated in place (it is its own master copy).
    InPlace { param: &'a mut [f32], grad: &'a [G] },
    /// An fp32 master in the optimizer state; the model-dtype parameter is written to `out`
    /// (which may be empty when nobody needs it).
    Master {
        master: &'a mut [f32],
        grad: &'a [G],
        out: &'a mut [P],
    },
    /// As `Master`, writing to `out` the parameter predicted for the next step (Note [weight
    /// prediction] in predict.rs); with a non-empty `coef`, without the next gradient's term
    /// and the next denominator's `v` part to `coef` (Note [next-gradient prediction]).
    Predict {
        master: &'a mut [f32],
        grad: &'a [G],
        out: &'a mut [P],
        coef: &'a mut [Bf16],
        pred: super::predict::Pred,
    },
    /// Read the fp32 parameter from `src`, write the result to `out` (sharded fp32: the
    /// parameter stays untouched until the all-gather brings the new value back).
    Copy {
        src: &'a [f32],
        grad: &'a [G],
        out: &'a mut [P],
    },
}

/// Apply one AdamW step to a run. Every slice has the same length as `m` and `v` (checked).
pub fn apply<G: Grad, P: Param>(run: Run<'_, G, P>, m: &mut [f32], v: &mut [f32], k: &Coeffs) {
    dispatch::<G, P, false>(run, m, v, k)
}

/// As [`apply`], in the rounding of torch's scalar remainder loop, which its fused kernel
/// runs on the last `numel % vector width` elements of each tensor (Note [torch rounding]).
pub fn apply_tail<G: Grad, P: Param>(run: Run<'_, G, P>, m: &mut [f32], v: &mut [f32], k: &Coeffs) {
    dispatch::<G, P, true>(run, m, v, k)
}

fn dispatch<G: Grad, P: Param, const TAIL: bool>(
    run: Run<'_, G, P>,
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    #[cfg(target_arch = "x86_64")]
    {
        if fma_available() {
            // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
            unsafe { apply_avx2_fma::<G, P, TAIL>(run, m, v, k) };
            return;
        }
    }
    apply_generic::<G, P, false, TAIL>(run, m, v, k)
}

/// Whether the FMA path (bitwise equal to torch's x86 fused kernel) is used on this CPU.
pub fn fma_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn apply_avx2_fma<G: Grad, P: Param, const TAIL: bool>(
    run: Run<'_, G, P>,
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    apply_generic::<G, P, true, TAIL>(run, m, v, k)
}

/// Lanes per iteration: loops over fixed-size chunks let LLVM vectorise without a remainder
/// check inside the body.
pub(crate) const LANES: usize = 16;

#[inline(always)]
fn apply_generic<G: Grad, P: Param, const FMA: bool, const TAIL: bool>(
    run: Run<'_, G, P>,
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    let n = m.len();
    assert_eq!(v.len(), n, "exp_avg and exp_avg_sq lengths differ");
    match run {
        Run::InPlace { param, grad } => in_place::<G, FMA, TAIL>(param, grad, m, v, k),
        Run::Master {
            master,
            grad,
            out: [],
        } => in_place::<G, FMA, TAIL>(master, grad, m, v, k),
        Run::Master { master, grad, out } => {
            with_master::<G, P, FMA, TAIL>(master, grad, out, m, v, k)
        }
        Run::Predict {
            master,
            grad,
            out,
            coef,
            pred,
        } => super::predict::with_master_predicting::<G, P, FMA, TAIL>(
            master, grad, out, coef, m, v, k, &pred,
        ),
        Run::Copy { src, grad, out } => copy::<G, P, FMA, TAIL>(src, grad, out, m, v, k),
    }
}

#[inline(always)]
fn in_place<G: Grad, const FMA: bool, const TAIL: bool>(
    param: &mut [f32],
    grad: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    assert!(
        param.len() == m.len() && grad.len() == m.len(),
        "run lengths differ"
    );
    let mut pc = param.chunks_exact_mut(LANES);
    let mut gc = grad.chunks_exact(LANES);
    let mut mc = m.chunks_exact_mut(LANES);
    let mut vc = v.chunks_exact_mut(LANES);
    for (((p, g), m), v) in (&mut pc).zip(&mut gc).zip(&mut mc).zip(&mut vc) {
        for i in 0..LANES {
            p[i] = update::<FMA, TAIL>(p[i], g[i].widen(), &mut m[i], &mut v[i], k);
        }
    }
    let rest = pc.into_remainder().iter_mut().zip(gc.remainder());
    let rest = rest.zip(mc.into_remainder().iter_mut().zip(vc.into_remainder()));
    for ((p, g), (m, v)) in rest {
        *p = update::<FMA, TAIL>(*p, g.widen(), m, v, k);
    }
}

#[inline(always)]
fn with_master<G: Grad, P: Param, const FMA: bool, const TAIL: bool>(
    master: &mut [f32],
    grad: &[G],
    out: &mut [P],
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
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
            p[i] = update::<FMA, TAIL>(p[i], g[i].widen(), &mut m[i], &mut v[i], k);
            o[i] = P::narrow(p[i]);
        }
    }
    let rest = pc.into_remainder().iter_mut().zip(gc.remainder());
    let rest = rest.zip(mc.into_remainder().iter_mut().zip(vc.into_remainder()));
    for (((p, g), (m, v)), o) in rest.zip(oc.into_remainder()) {
        *p = update::<FMA, TAIL>(*p, g.widen(), m, v, k);
        *o = P::narrow(*p);
    }
}

#[inline(always)]
fn copy<G: Grad, P: Param, const FMA: bool, const TAIL: bool>(
    src: &[f32],
    grad: &[G],
    out: &mut [P],
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    let n = m.len();
    assert!(
        src.len() == n && grad.len() == n && out.len() == n,
        "run lengths differ"
    );
    let mut sc = src.chunks_exact(LANES);
    let mut gc = grad.chunks_exact(LANES);
    let mut mc = m.chunks_exact_mut(LANES);
    let mut vc = v.chunks_exact_mut(LANES);
    let mut oc = out.chunks_exact_mut(LANES);
    for ((((s, g), m), v), o) in (&mut sc)
        .zip(&mut gc)
        .zip(&mut mc)
        .zip(&mut vc)
        .zip(&mut oc)
    {
        for i in 0..LANES {
            o[i] = P::narrow(update::<FMA, TAIL>(
                s[i],
                g[i].widen(),
                &mut m[i],
                &mut v[i],
                k,
            ));
        }
    }
    let rest = sc.remainder().iter().zip(gc.remainder());
    let rest = rest.zip(mc.into_remainder().iter_mut().zip(vc.into_remainder()));
    for (((s, g), (m, v)), o) in rest.zip(oc.into_remainder()) {
        *o = P::narrow(update::<FMA, TAIL>(*s, g.widen(), m, v, k));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_follow_torch() {
        let h = Hyper {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 1e-2,
            step: 3.0,
            grad_scale: 1.0,
        };
        let k = h.coeffs();
        assert!(k.lerp_from_m);
        assert_eq!(k.lerp, 0.1f64 as f32);
        assert_eq!(k.decay, (1.0 - 1e-5f64) as f32);
        assert_eq!(k.neg_step_size, (-1e-3 / (1.0 - 0.9f64.powf(3.0))) as f32);
        let h2 = Hyper { beta1: 0.2, ..h };
        let k2 = h2.coeffs();
        assert!(!k2.lerp_from_m);
        assert_eq!(k2.lerp, 0.8f32 - 1.0);
        assert!(Hyper { lr: -1.0, ..h }.validate().is_err());
        assert!(Hyper { beta2: 1.0, ..h }.validate().is_err());
        assert!(Hyper { step: 0.0, ..h }.validate().is_err());
        assert!(h.validate().is_ok());
    }
}
