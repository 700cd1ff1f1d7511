//! The AdamW step over low-bit state (`state_bits=16` or `8`), and over bf16 parameters
//! without an fp32 master, a block at a time.
//!
//! # Note [one pass per block]
//! For each block of [`BLOCK`] elements of a task, in one pass: the moments are read as
//! stored and widened (bf16) or dequantized (8-bit: codes times the block's scale) into two
//! f32 buffers on the stack, the value being optimized (the fp32 master, the fp32 parameter,
//! or the bf16 parameter widened) into a third; [`kernel::update`] — torch's fused arithmetic
//! operation for operation, Note [torch rounding] — runs over them; and the results are
//! narrowed back (requantized with the block's new scale, or rounded stochastically: Note
//! [stochastic rounding], Note [8-bit moments] in quant.rs) and written. The three buffers
//! (3 KiB) stay in L1 for the block, so memory sees each stored byte read once and written
//! once: an 8-bit step with an fp32 master moves 2 + 4 + 1 + 1 bytes per parameter in and
//! 4 + 1 + 1 (+ 2 for a bf16 output) out, where fp32 state moves 2 + 12 in and 12 (+ 2) out.
//!
//! For 8-bit state ([`super::q8`]) the dequantization, the update and the search for the
//! block's new largest values are one loop, which also writes the previous block's codes
//! (their scales are known by then): the update waits on the divider for its square root and
//! two divisions per element, and the rest of the work fits beside it.
//!
//! A unit's first step starts its moments at zero here (nothing is read); its master was
//! copied from the parameter before (as for fp32 state). The last `tail` elements of a unit
//! take the rounding of torch's scalar remainder loop, as in the fp32 kernel. fp32 state with
//! an fp32 parameter, master or not, never comes here: it keeps [`kernel::apply`], bitwise
//! equal to torch's fused AdamW.

use super::kernel::{self, fma_available, Bf16, Coeffs, Grad};
use super::q8;
use super::quant::{self, Draws, Stream, BLOCK};
use super::task::Moments;

/// The value a task optimizes and where the result goes.
pub(super) enum Params<'a> {
    /// An fp32 parameter that is its own master, updated in place.
    InPlace(&'a mut [f32]),
    /// An fp32 master in the state; the parameter written in the model's dtype (rounded to
    /// nearest even for bf16, as torch's `.to(bfloat16)`), or not at all.
    Master { master: &'a mut [f32], out: Out<'a> },
    /// Read the fp32 parameter from `src`, write the result to `out`.
    Copy { src: &'a [f32], out: &'a mut [f32] },
    /// A bf16 parameter without a master, updated in place with stochastic rounding.
    Bf16(&'a mut [Bf16]),
}

pub(super) enum Out<'a> {
    None,
    F32(&'a mut [f32]),
    Bf16(&'a mut [Bf16]),
}

/// What a task's blocks share.
pub(super) struct Ctx {
    pub k: Coeffs,
    /// The unit's first step: the moments start at zero.
    pub init: bool,
    /// Offset in the unit of the task's first element, and of the unit's tail.
    pub unit_off: usize,
    pub tail_from: usize,
    /// Stochastic rounding: the state's seed, the step count, the unit's first key.
    pub seed: u64,
    pub step: u64,
    pub key: u64,
}

impl Ctx {
    /// The draws for `stream`, and the key of the element `lo` into the task.
    #[inline(always)]
    fn draws(&self, stream: Stream, lo: usize) -> (Draws, u64) {
        let d = Draws {
            seed: self.seed,
            step: self.step,
            stream,
        };
        (d, self.key.wrapping_add((self.unit_off + lo) as u64))
    }
}

/// One step over a task: Note [one pass per block]. Every slice has the task's length
/// (checked); the task starts on a block of its unit.
pub(super) fn run<G: Grad>(grad: &[G], params: Params<'_>, moments: Moments<'_>, c: &Ctx) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx512_available() {
            // SAFETY: the CPU supports these features (checked at run time just above).
            unsafe { run_avx512(grad, params, moments, c) };
            return;
        }
        if fma_available() {
            // SAFETY: the CPU supports AVX2 and FMA (checked at run time just above).
            unsafe { run_avx2_fma(grad, params, moments, c) };
            return;
        }
    }
    run_generic::<G, false>(grad, params, moments, c)
}

/// Whether the low-bit path runs 16 lanes wide. Only the width changes: the FMAs are those
/// of [`fma_available`], so the results are the AVX2 path's, bit for bit (both meet the
/// scalar reference of tests/optim_lowbit.rs).
#[cfg(target_arch = "x86_64")]
fn avx512_available() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
        && fma_available()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn run_avx2_fma<G: Grad>(grad: &[G], params: Params<'_>, moments: Moments<'_>, c: &Ctx) {
    run_generic::<G, true>(grad, params, moments, c)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn run_avx512<G: Grad>(grad: &[G], params: Params<'_>, moments: Moments<'_>, c: &Ctx) {
    run_generic::<G, true>(grad, params, moments, c)
}

fn params_len(p: &Params<'_>) -> usize {
    match p {
        Params::InPlace(x) => x.len(),
        Params::Master { master, out } => {
            let n = master.len();
            match out {
                Out::None => n,
                Out::F32(o) if o.len() == n => n,
                Out::Bf16(o) if o.len() == n => n,
                _ => usize::MAX,
            }
        }
        Params::Copy { src, out } if src.len() == out.len() => src.len(),
        Params::Copy { .. } => usize::MAX,
        Params::Bf16(x) => x.len(),
    }
}

fn moments_len(m: &Moments<'_>) -> usize {
    match m {
        Moments::F32 { m, v } if m.len() == v.len() => m.len(),
        Moments::Bf16 { m, v } if m.len() == v.len() => m.len(),
        Moments::Q8 {
            m,
            v,
            m_scale,
            v_scale,
        } if m.len() == v.len()
            && m_scale.len() == quant::blocks(m.len())
            && v_scale.len() == m_scale.len() =>
        {
            m.len()
        }
        _ => usize::MAX,
    }
}

#[inline(always)]
fn run_generic<G: Grad, const FMA: bool>(
    grad: &[G],
    mut params: Params<'_>,
    mut moments: Moments<'_>,
    c: &Ctx,
) {
    let n = grad.len();
    assert!(
        params_len(&params) == n && moments_len(&moments) == n,
        "run lengths differ"
    );
    if let (
        Moments::Q8 {
            m,
            v,
            m_scale,
            v_scale,
        },
        false,
    ) = (&mut moments, c.init)
    {
        return q8::run::<G, FMA>(grad, &mut params, (m, v), (m_scale, v_scale), c);
    }
    // 8-bit state keeps exp_avg_sq as its square root, which the update computes anyway.
    let sqrt = matches!(moments, Moments::Q8 { .. });
    let mut pb = [0f32; BLOCK];
    let mut mb = [0f32; BLOCK];
    let mut vb = [0f32; BLOCK];
    for (bi, lo) in (0..n).step_by(BLOCK).enumerate() {
        let hi = (lo + BLOCK).min(n);
        let len = hi - lo;
        let p = param_slice(&mut params, lo, hi, &mut pb[..len]);
        let g = &grad[lo..hi];
        // Elements from `split` on are in the unit's tail (UnitStep::tail).
        let split = c.tail_from.saturating_sub(c.unit_off + lo).min(len);
        if let (Moments::Bf16 { m: sm, v: sv }, false) = (&mut moments, c.init) {
            let (sm, sv) = (&mut sm[lo..hi], &mut sv[lo..hi]);
            let (dm, key) = c.draws(Stream::ExpAvg, lo);
            let (dv, _) = c.draws(Stream::ExpAvgSq, lo);
            for (a, b, base, j0) in dm.runs(key, len) {
                let bv = quant::block_seed(dv.seed, dv.step, dv.stream, (key + a as u64) & !0xff);
                // The run's part before the tail, then the rest (UnitStep::tail).
                let t = split.clamp(a, b);
                let (x, y) = (a..t, t..b);
                let seeds = ((base, bv), j0);
                let (bm, bvv) = (&mut sm[x.clone()], &mut sv[x.clone()]);
                bf16_run::<G, FMA, false>(&mut p[x.clone()], &g[x], (bm, bvv), seeds, &c.k);
                let seeds = ((base, bv), j0 + (t - a));
                let (bm, bvv) = (&mut sm[y.clone()], &mut sv[y.clone()]);
                bf16_run::<G, FMA, true>(&mut p[y.clone()], &g[y], (bm, bvv), seeds, &c.k);
            }
            store_param(&mut params, lo, hi, &pb[..len], c);
            continue;
        }
        let (m, v) = load_moments(&mut moments, bi, lo, hi, &mut mb, &mut vb, c.init);
        let (p0, p1) = p.split_at_mut(split);
        let (m0, m1) = m.split_at_mut(split);
        let (v0, v1) = v.split_at_mut(split);
        let (g0, g1) = g.split_at(split);
        if sqrt {
            update_run::<G, FMA, false, true>(p0, g0, m0, v0, &c.k);
            update_run::<G, FMA, true, true>(p1, g1, m1, v1, &c.k);
        } else {
            update_run::<G, FMA, false, false>(p0, g0, m0, v0, &c.k);
            update_run::<G, FMA, true, false>(p1, g1, m1, v1, &c.k);
        }
        store_param(&mut params, lo, hi, &pb[..len], c);
        store_moments(&mut moments, bi, lo, hi, &mut mb[..len], &mut vb[..len], c);
    }
}

/// The update over a run of bf16 state sharing the draw seeds `seeds.0` (exp_avg,
/// exp_avg_sq) from key offset `seeds.1` on: widen, update, round stochastically, in one
/// loop (Note [one pass per block]).
#[inline(always)]
fn bf16_run<G: Grad, const FMA: bool, const TAIL: bool>(
    p: &mut [f32],
    g: &[G],
    st: (&mut [u16], &mut [u16]),
    seeds: ((u32, u32), usize),
    k: &Coeffs,
) {
    let ((bm, bv), j0) = seeds;
    let it = p
        .iter_mut()
        .zip(g)
        .zip(st.0.iter_mut().zip(st.1.iter_mut()));
    for (j, ((p, g), (sm, sv))) in (j0..).zip(it) {
        let mut m = kernel::bf16_to_f32(*sm);
        let mut v = kernel::bf16_to_f32(*sv);
        *p = kernel::update::<FMA, TAIL>(*p, g.widen(), &mut m, &mut v, k);
        *sm = quant::f32_to_bf16_sr(m, quant::draw(bm, j));
        *sv = quant::f32_to_bf16_sr(v, quant::draw(bv, j));
    }
}

/// The update over a run; with `SQRT`, `v` is left holding `sqrt(v)`.
#[inline(always)]
fn update_run<G: Grad, const FMA: bool, const TAIL: bool, const SQRT: bool>(
    p: &mut [f32],
    g: &[G],
    m: &mut [f32],
    v: &mut [f32],
    k: &Coeffs,
) {
    for (((p, g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        let (x, r) = kernel::update_sqrt::<FMA, TAIL>(*p, g.widen(), m, v, k);
        *p = x;
        if SQRT {
            *v = r;
        }
    }
}

/// The block's moments as f32 to update: the state's own fp32 columns, or `mb` and `vb`
/// filled by widening or dequantizing (zeros on a unit's first step).
#[inline(always)]
fn load_moments<'a>(
    mo: &'a mut Moments<'_>,
    bi: usize,
    lo: usize,
    hi: usize,
    mb: &'a mut [f32; BLOCK],
    vb: &'a mut [f32; BLOCK],
    init: bool,
) -> (&'a mut [f32], &'a mut [f32]) {
    let len = hi - lo;
    let (m, v) = match mo {
        Moments::F32 { m, v } => return init_or(&mut m[lo..hi], &mut v[lo..hi], init),
        _ => (&mut mb[..len], &mut vb[..len]),
    };
    if init {
        return init_or(m, v, true);
    }
    match mo {
        Moments::F32 { .. } => {}
        Moments::Bf16 { m: sm, v: sv } => {
            quant::widen_bf16(&sm[lo..hi], m);
            quant::widen_bf16(&sv[lo..hi], v);
        }
        Moments::Q8 {
            m: sm,
            v: sv,
            m_scale,
            v_scale,
        } => {
            quant::dequantize_m(&sm[lo..hi], m_scale[bi], m);
            quant::dequantize_v(&sv[lo..hi], v_scale[bi], v);
        }
    }
    (m, v)
}

#[inline(always)]
fn init_or<'a>(m: &'a mut [f32], v: &'a mut [f32], init: bool) -> (&'a mut [f32], &'a mut [f32]) {
    if init {
        m.fill(0.0);
        v.fill(0.0);
    }
    (m, v)
}

/// Narrow the updated moments back into the state (fp32 moments were updated in place).
#[inline(always)]
fn store_moments(
    mo: &mut Moments<'_>,
    bi: usize,
    lo: usize,
    hi: usize,
    m: &mut [f32],
    v: &mut [f32],
    c: &Ctx,
) {
    match mo {
        Moments::F32 { .. } => {}
        Moments::Bf16 { m: sm, v: sv } => {
            let (dm, key) = c.draws(Stream::ExpAvg, lo);
            quant::narrow_bf16_sr(m, &mut sm[lo..hi], &dm, key);
            let (dv, key) = c.draws(Stream::ExpAvgSq, lo);
            quant::narrow_bf16_sr(v, &mut sv[lo..hi], &dv, key);
        }
        Moments::Q8 {
            m: sm,
            v: sv,
            m_scale,
            v_scale,
        } => {
            m_scale[bi] = quant::quantize_m(m, &mut sm[lo..hi]);
            v_scale[bi] = quant::quantize_v_sqrt(v, &mut sv[lo..hi]);
        }
    }
}

/// The f32 values the block updates in place: the parameter or master itself, the output
/// (after copying the source into it), or `pb` holding the bf16 parameter widened.
#[inline(always)]
pub(super) fn param_slice<'a>(
    params: &'a mut Params<'_>,
    lo: usize,
    hi: usize,
    pb: &'a mut [f32],
) -> &'a mut [f32] {
    match params {
        Params::InPlace(x) => &mut x[lo..hi],
        Params::Master { master, .. } => &mut master[lo..hi],
        Params::Copy { src, out } => {
            out[lo..hi].copy_from_slice(&src[lo..hi]);
            &mut out[lo..hi]
        }
        Params::Bf16(x) => {
            for (d, s) in pb.iter_mut().zip(&x[lo..hi]) {
                *d = kernel::bf16_to_f32(s.0);
            }
            pb
        }
    }
}

/// Write what the block's update left in the master or in `pb` where it goes.
#[inline(always)]
pub(super) fn store_param(params: &mut Params<'_>, lo: usize, hi: usize, pb: &[f32], c: &Ctx) {
    match params {
        Params::InPlace(_) | Params::Copy { .. } | Params::Master { out: Out::None, .. } => {}
        Params::Master {
            master,
            out: Out::F32(o),
        } => o[lo..hi].copy_from_slice(&master[lo..hi]),
        Params::Master {
            master,
            out: Out::Bf16(o),
        } => {
            for (d, &s) in o[lo..hi].iter_mut().zip(&master[lo..hi]) {
                *d = Bf16(kernel::f32_to_bf16(s));
            }
        }
        Params::Bf16(x) => {
            let (d, key) = c.draws(Stream::Param, lo);
            let x = &mut x[lo..hi];
            for (a, b, base, j0) in d.runs(key, pb.len()) {
                for (j, (o, &s)) in (j0..).zip(x[a..b].iter_mut().zip(&pb[a..b])) {
                    *o = Bf16(quant::f32_to_bf16_sr(s, quant::draw(base, j)));
                }
            }
        }
    }
}
