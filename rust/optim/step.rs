//! The AdamW step: checking a step's work list, then each task's update through the kernel
//! (a unit's first step initializes its state; its tail takes torch's remainder rounding).
//! fp32 state over fp32 values goes through [`kernel::apply`]; low-bit state and bf16
//! parameters without a master through [`lowbit::run`] (Note [one pass per block]).

use std::time::Instant;

use super::kernel::{self, Bf16, Coeffs, Grad, Run};
use super::lowbit::{self, Out, Params};
use super::task::{columns, part, part_mut, state, Task};
use super::{AdamState, Dtype, StateBits, UnitStep};
use crate::error::{Error, Result};

/// What every task of one unit's step shares.
struct UnitCtx {
    k: Coeffs,
    init: bool,
    tail_from: usize,
}

/// What every task of a step shares.
#[derive(Clone, Copy)]
struct StateCtx {
    master: bool,
    bits: StateBits,
    seed: u64,
}

impl AdamState {
    /// One AdamW step for each unit in `work` (units not listed are untouched). On error
    /// nothing has been written when the error is a validation error; an I/O error leaves the
    /// units of the chunks in flight unspecified.
    ///
    /// # Safety
    /// Every non-null address in `work` must be valid for `len(unit)` elements of its dtype
    /// (reads for `grad` and `src`, writes for `out`) for the duration of the call, and no one
    /// else may write them meanwhile (reading `grad` or `src` concurrently is fine). Overlaps
    /// between units, and between a unit's gradient and its output, are checked and refused.
    pub unsafe fn step(&mut self, work: &[UnitStep]) -> Result<()> {
        let t0 = Instant::now();
        let coeffs = self.validate(work)?;
        let init: Vec<bool> = work.iter().map(|w| !self.initialized[w.unit]).collect();
        for (w, &init) in work.iter().zip(&init) {
            if init && self.master && w.src.is_none() {
                return Err(Error::Invalid(format!(
                    "unit {}: its first step needs the parameter's value to start the fp32 \
                     master from, but no source address was given",
                    w.unit
                )));
            }
        }
        let units: Vec<UnitCtx> = work
            .iter()
            .zip(coeffs)
            .zip(&init)
            .map(|((w, k), &init)| {
                let len = self.layout.unit_len(w.unit);
                UnitCtx {
                    k,
                    init,
                    tail_from: len - w.tail.min(len),
                }
            })
            .collect();
        let st = StateCtx {
            master: self.master,
            bits: self.bits,
            seed: self.seed,
        };
        let run = |t: &Task| {
            let i = t.work;
            // SAFETY: the task's ranges are valid and exclusive (see `Task` and this fn's
            // contract); the constants belong to the same unit.
            unsafe { run_task(t, &work[i], &units[i], st) }
        };
        self.for_each_task(work.iter().map(|w| w.unit), true, run)?;
        for w in work {
            self.initialized[w.unit] = true;
        }
        self.stats.steps += 1;
        self.stats.last_step_seconds = t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Check a step's work list; returns each unit's constants.
    fn validate(&self, work: &[UnitStep]) -> Result<Vec<Coeffs>> {
        let mut seen = vec![false; self.layout.units()];
        let mut outs: Vec<(usize, usize, usize)> = Vec::with_capacity(work.len());
        let mut coeffs = Vec::with_capacity(work.len());
        for w in work {
            let u = w.unit;
            self.check_unit(u)?;
            if std::mem::replace(&mut seen[u], true) {
                return Err(Error::Invalid(format!("unit {u} listed twice in one step")));
            }
            let bad = |what: &str| Err(Error::Invalid(format!("unit {u}: {what}")));
            w.hyper
                .validate()
                .map_err(|e| Error::Invalid(format!("unit {u}: {e}")))?;
            let len = self.layout.unit_len(u);
            if w.grad.is_none() {
                return bad("no gradient address");
            }
            if !self.master {
                if w.src.is_none() || w.out.is_none() || w.src.dtype != w.out.dtype {
                    return bad(
                        "without a master column the parameter must be both the source and the \
                         output, in one dtype",
                    );
                }
                if w.src.dtype == Dtype::Bf16 && w.src.addr != w.out.addr {
                    return bad(
                        "without a master column a bf16 parameter is updated in place: source \
                         and output must be the same buffer",
                    );
                }
                if w.src.addr != w.out.addr && overlaps(w.src.range(len), w.out.range(len)) {
                    return bad("source and output overlap without being the same buffer");
                }
            }
            if w.predict && (!self.master || self.bits != StateBits::F32 || w.out.is_none()) {
                return bad(
                    "a predicted output (Note [weight prediction]) needs an fp32 master, fp32 \
                     moments and an output address",
                );
            }
            if !w.coef.is_none() {
                if !w.predict || w.coef.dtype != Dtype::Bf16 {
                    return bad(
                        "a coefficient buffer (Note [next-gradient prediction]) goes with a \
                         predicted output, in bf16",
                    );
                }
                let (a, b) = w.coef.range(len);
                if overlaps((a, b), w.grad.range(len)) {
                    return bad("gradient and coefficient overlap");
                }
                if len > 0 {
                    outs.push((a, b, u));
                }
            }
            if !w.out.is_none() {
                let (a, b) = w.out.range(len);
                if overlaps((a, b), w.grad.range(len)) {
                    return bad("gradient and output overlap");
                }
                if len > 0 {
                    outs.push((a, b, u));
                }
            }
            coeffs.push(w.hyper.coeffs());
        }
        outs.sort_unstable();
        for pair in outs.windows(2) {
            if pair[1].0 < pair[0].1 {
                return Err(Error::Invalid(format!(
                    "units {} and {} write overlapping outputs",
                    pair[0].2, pair[1].2
                )));
            }
        }
        Ok(coeffs)
    }
}

fn overlaps(a: (usize, usize), b: (usize, usize)) -> bool {
    a.0 < b.1 && b.0 < a.1 && a.0 < a.1 && b.0 < b.1
}

/// # Safety
/// See `AdamState::step`: the task's state and the unit's buffers are valid and exclusive.
unsafe fn run_task(t: &Task, w: &UnitStep, u: &UnitCtx, st: StateCtx) {
    let bf16_in_place = !st.master && w.src.dtype == Dtype::Bf16;
    // SAFETY: forwarded contract.
    unsafe {
        if st.bits != StateBits::F32 || bf16_in_place {
            return match w.grad.dtype {
                Dtype::F32 => run_lowbit::<f32>(t, w, u, st),
                Dtype::Bf16 => run_lowbit::<Bf16>(t, w, u, st),
            };
        }
        // Elements from `split` on are in the unit's tail (`UnitStep::tail`).
        let split = u.tail_from.saturating_sub(t.unit_off).min(t.len);
        let main = Task { len: split, ..*t };
        let tail = Task {
            chunk_off: t.chunk_off + split,
            unit_off: t.unit_off + split,
            len: t.len - split,
            ..*t
        };
        for (part, is_tail) in [(main, false), (tail, true)] {
            if part.len == 0 {
                continue;
            }
            match w.grad.dtype {
                Dtype::F32 => run_typed::<f32>(&part, w, &u.k, u.init, is_tail),
                Dtype::Bf16 => run_typed::<Bf16>(&part, w, &u.k, u.init, is_tail),
            }
        }
    }
}

/// A unit's first step with an fp32 master: the master starts from the parameter.
///
/// # Safety
/// As `run_task`.
unsafe fn init_master(t: &Task, w: &UnitStep, mst: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe {
        match w.src.dtype {
            Dtype::F32 => mst.copy_from_slice(part::<f32>(w.src, t)),
            Dtype::Bf16 => kernel::widen_into(part::<Bf16>(w.src, t), mst),
        }
    }
}

/// Low-bit state, or a bf16 parameter without a master: Note [one pass per block].
///
/// # Safety
/// As `run_task`.
unsafe fn run_lowbit<G: Grad>(t: &Task, w: &UnitStep, u: &UnitCtx, st: StateCtx) {
    // SAFETY: forwarded contract.
    unsafe {
        let grad = part::<G>(w.grad, t);
        let (mst, moments) = state(t, st.bits);
        let params = match mst {
            Some(master) => {
                if u.init {
                    init_master(t, w, master);
                }
                let out = match (w.out.is_none(), w.out.dtype) {
                    (true, _) => Out::None,
                    (false, Dtype::F32) => Out::F32(part_mut(w.out, t)),
                    (false, Dtype::Bf16) => Out::Bf16(part_mut(w.out, t)),
                };
                Params::Master { master, out }
            }
            None => match w.src.dtype {
                Dtype::Bf16 => Params::Bf16(part_mut(w.out, t)),
                Dtype::F32 if w.src.addr == w.out.addr => Params::InPlace(part_mut(w.out, t)),
                Dtype::F32 => Params::Copy {
                    src: part(w.src, t),
                    out: part_mut(w.out, t),
                },
            },
        };
        let c = lowbit::Ctx {
            k: u.k,
            init: u.init,
            unit_off: t.unit_off,
            tail_from: u.tail_from,
            seed: st.seed,
            step: w.hyper.step as u64,
            key: w.key,
        };
        lowbit::run(grad, params, moments, &c)
    }
}

/// A predicting run's coefficient slice (empty: the plain prediction) and constants (Note
/// [next-gradient prediction] in predict.rs).
///
/// # Safety
/// As `run_task`: `w.coef`, when set, is valid and exclusive for the unit.
unsafe fn predicting<'a>(t: &Task, w: &UnitStep) -> (&'a mut [Bf16], super::predict::Pred) {
    if w.coef.is_none() {
        (&mut [], w.hyper.prediction())
    } else {
        // SAFETY: forwarded contract.
        (
            unsafe { part_mut::<Bf16>(w.coef, t) },
            w.hyper.gradient_prediction(),
        )
    }
}

/// fp32 state over fp32 values, through [`kernel::apply`].
///
/// # Safety
/// As `run_task`.
unsafe fn run_typed<G: Grad>(t: &Task, w: &UnitStep, k: &Coeffs, init: bool, tail: bool) {
    // SAFETY: forwarded contract.
    unsafe {
        let grad = part::<G>(w.grad, t);
        let (mut mst, m, v) = columns(t);
        if init {
            m.fill(0.0);
            v.fill(0.0);
            if let Some(mst) = mst.as_deref_mut() {
                init_master(t, w, mst);
            }
        }
        match (mst, w.out.is_none(), w.out.dtype) {
            (Some(master), true, _) => {
                let run: Run<'_, G, f32> = Run::Master {
                    master,
                    grad,
                    out: &mut [],
                };
                go(tail, run, m, v, k)
            }
            (Some(master), false, Dtype::F32) if w.predict => {
                let out = part_mut::<f32>(w.out, t);
                let (coef, pred) = predicting(t, w);
                go(
                    tail,
                    Run::Predict {
                        master,
                        grad,
                        out,
                        coef,
                        pred,
                    },
                    m,
                    v,
                    k,
                )
            }
            (Some(master), false, Dtype::Bf16) if w.predict => {
                let out = part_mut::<Bf16>(w.out, t);
                let (coef, pred) = predicting(t, w);
                go(
                    tail,
                    Run::Predict {
                        master,
                        grad,
                        out,
                        coef,
                        pred,
                    },
                    m,
                    v,
                    k,
                )
            }
            (Some(master), false, Dtype::F32) => {
                let out = part_mut::<f32>(w.out, t);
                go(tail, Run::Master { master, grad, out }, m, v, k)
            }
            (Some(master), false, Dtype::Bf16) => {
                let out = part_mut::<Bf16>(w.out, t);
                go(tail, Run::Master { master, grad, out }, m, v, k)
            }
            (None, _, _) if w.src.addr == w.out.addr => {
                let param = part_mut::<f32>(w.out, t);
                let run: Run<'_, G, f32> = Run::InPlace { param, grad };
                go(tail, run, m, v, k)
            }
            (None, _, _) => {
                let src = part::<f32>(w.src, t);
                let out = part_mut::<f32>(w.out, t);
                go(tail, Run::Copy { src, grad, out }, m, v, k)
            }
        }
    }
}

fn go<G: Grad, P: kernel::Param>(
    tail: bool,
    run: Run<'_, G, P>,
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    if tail {
        kernel::apply_tail(run, m, v, k)
    } else {
        kernel::apply(run, m, v, k)
    }
}
