//! The step over 8-bit state (not a unit's first step), software-pipelined: Note [one pass
//! per block] in lowbit.rs, Note [8-bit moments] in quant.rs.

use super::kernel::{self, Coeffs, Grad};
use super::lowbit::{param_slice, store_param, Ctx, Params};
use super::quant::{self, BLOCK};

/// 8-bit state (not a unit's first step): Note [one pass per block]. Block `b`'s update loop
/// also writes block `b - 1`'s codes, whose scales it knows by then: the update waits on the
/// divider (a square root and two divisions per element) and the coding fits beside it.
#[inline(always)]
pub(super) fn run<G: Grad, const FMA: bool>(
    grad: &[G],
    params: &mut Params<'_>,
    codes: (&mut [i8], &mut [u8]),
    scales: (&mut [f32], &mut [f32]),
    c: &Ctx,
) {
    let n = grad.len();
    let (sm, sv) = codes;
    let (m_scale, v_scale) = scales;
    let mut pb = [0f32; BLOCK];
    // The updated exp_avg and sqrt(exp_avg_sq) of the current and of the previous block.
    let mut bufs = [[[0f32; BLOCK]; 2]; 2];
    // The previous block, its codes not yet written: (start, inverse steps).
    let mut pending: Option<(usize, (f32, f32))> = None;
    for (bi, lo) in (0..n).step_by(BLOCK).enumerate() {
        let hi = (lo + BLOCK).min(n);
        let len = hi - lo;
        let p = param_slice(params, lo, hi, &mut pb[..len]);
        let g = &grad[lo..hi];
        // Elements from `split` on are in the unit's tail (UnitStep::tail).
        let split = c.tail_from.saturating_sub(c.unit_off + lo).min(len);
        let d = (quant::m_step(m_scale[bi]), quant::v_step(v_scale[bi]));
        let (b0, b1) = bufs.split_at_mut(1);
        let (cur, prev) = if bi % 2 == 0 {
            (&mut b0[0], &b1[0])
        } else {
            (&mut b1[0], &b0[0])
        };
        let (cm_buf, cr_buf) = cur.split_at_mut(1);
        let (m, r) = (&mut cm_buf[0][..len], &mut cr_buf[0][..len]);
        // Codes before `lo` are the previous block's (a full block), from `lo` on this one's.
        let (pm_codes, cm) = sm.split_at_mut(lo);
        let (pv_codes, cv) = sv.split_at_mut(lo);
        let (cm, cv) = (&cm[..len], &cv[..len]);
        let mut max = (0u32, 0u32);
        let (p0, p1) = p.split_at_mut(split);
        let (g0, g1) = g.split_at(split);
        let (cm0, cm1) = cm.split_at(split);
        let (cv0, cv1) = cv.split_at(split);
        let (m0, m1) = m.split_at_mut(split);
        let (r0, r1) = r.split_at_mut(split);
        match pending {
            Some((plo, inv)) => {
                let (qm, qr) = (&prev[0][..len], &prev[1][..len]);
                let (qm0, qm1) = qm.split_at(split);
                let (qr0, qr1) = qr.split_at(split);
                let (om, ov) = (&mut pm_codes[plo..plo + len], &mut pv_codes[plo..plo + len]);
                let (om0, om1) = om.split_at_mut(split);
                let (ov0, ov1) = ov.split_at_mut(split);
                let d0 = ((qm0, qr0), (om0, ov0), inv);
                q8_run::<G, FMA, false, true>(p0, g0, (cm0, cv0), (m0, r0), d, &mut max, d0, &c.k);
                let d1 = ((qm1, qr1), (om1, ov1), inv);
                q8_run::<G, FMA, true, true>(p1, g1, (cm1, cv1), (m1, r1), d, &mut max, d1, &c.k);
                // This block may be the last, shorter one: the rest of the previous.
                let rest = plo + len..plo + BLOCK;
                code_block(
                    &prev[0][len..],
                    &prev[1][len..],
                    &mut pm_codes[rest.clone()],
                    &mut pv_codes[rest],
                    inv,
                );
            }
            None => {
                let d0 = ((&[][..], &[][..]), (&mut [][..], &mut [][..]), (0.0, 0.0));
                q8_run::<G, FMA, false, false>(p0, g0, (cm0, cv0), (m0, r0), d, &mut max, d0, &c.k);
                let d1 = ((&[][..], &[][..]), (&mut [][..], &mut [][..]), (0.0, 0.0));
                q8_run::<G, FMA, true, false>(p1, g1, (cm1, cv1), (m1, r1), d, &mut max, d1, &c.k);
            }
        }
        store_param(params, lo, hi, &pb[..len], c);
        // This block's scales; its codes are written by the next block's loop, or now.
        pending = match (quant::m_scale(max.0), quant::v_scale(max.1)) {
            (Ok((s_m, inv_m)), Ok((s_v, inv_v))) => {
                m_scale[bi] = s_m;
                v_scale[bi] = s_v;
                Some((lo, (inv_m, inv_v)))
            }
            _ => {
                // A zero or non-finite block (rare): written now, as quantize_* write it.
                m_scale[bi] = quant::quantize_m_max(m, max.0, &mut sm[lo..hi]);
                v_scale[bi] = quant::quantize_v_sqrt_max(r, max.1, &mut sv[lo..hi]);
                None
            }
        };
        if hi == n {
            if let Some((plo, inv)) = pending {
                let (m, r) = (&cur[0][..len], &cur[1][..len]);
                code_block(m, r, &mut sm[plo..hi], &mut sv[plo..hi], inv);
            }
        }
    }
}

/// Write the codes of a block's (part's) updated `exp_avg` and `sqrt(exp_avg_sq)`.
#[inline(always)]
fn code_block(m: &[f32], r: &[f32], om: &mut [i8], ov: &mut [u8], inv: (f32, f32)) {
    for (o, &x) in om.iter_mut().zip(m) {
        *o = quant::code_m(x, inv.0);
    }
    for (o, &x) in ov.iter_mut().zip(r) {
        *o = quant::code_v(x, inv.1);
    }
}

/// The codes a run writes of the previous block: its updated values, where they go, and the
/// inverse steps.
type Prev<'a, 'b> = (
    (&'a [f32], &'a [f32]),
    (&'b mut [i8], &'b mut [u8]),
    (f32, f32),
);

/// The update over a run of 8-bit state: codes dequantized with the steps `d`, the updated
/// `exp_avg` and `sqrt(exp_avg_sq)` left in `out` and their largest [`quant::abs_bits`] in
/// `max`; with `PREV`, the same run of the previous block coded (Note [one pass per block]).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn q8_run<G: Grad, const FMA: bool, const TAIL: bool, const PREV: bool>(
    p: &mut [f32],
    g: &[G],
    codes: (&[i8], &[u8]),
    out: (&mut [f32], &mut [f32]),
    d: (f32, f32),
    max: &mut (u32, u32),
    prev: Prev<'_, '_>,
    k: &Coeffs,
) {
    let n = p.len();
    let (cm, cv) = codes;
    let (mo, ro) = out;
    let ((qm, qr), (om, ov), inv) = prev;
    assert!(g.len() == n && cm.len() == n && cv.len() == n && mo.len() == n && ro.len() == n);
    assert!(!PREV || (qm.len() == n && qr.len() == n && om.len() == n && ov.len() == n));
    let (mut am, mut ar) = *max;
    for i in 0..n {
        let mut m = quant::dequant_m(cm[i], d.0);
        let mut v = quant::dequant_v(cv[i], d.1);
        let (x, r) = kernel::update_sqrt::<FMA, TAIL>(p[i], g[i].widen(), &mut m, &mut v, k);
        p[i] = x;
        mo[i] = m;
        ro[i] = r;
        am = am.max(quant::abs_bits(m));
        ar = ar.max(quant::abs_bits(r));
        if PREV {
            om[i] = quant::code_m(qm[i], inv.0);
            ov[i] = quant::code_v(qr[i], inv.1);
        }
    }
    *max = (am, ar);
}
