//! Low-bit optimizer state: how `exp_avg` and `exp_avg_sq` are stored when they are not fp32
//! (`state_bits=16` and `8`), and the rounding that writes a bf16 parameter without an fp32
//! master. Pure functions over slices and numbers: no memory of their own, no threads.
//!
//! # Note [stochastic rounding]
//! bf16 keeps 8 significant bits: one ulp is 2^-7 to 2^-8 of the value. AdamW's `exp_avg_sq`
//! moves by `(1 - beta2) * (g² - v)` a step, at `beta2 = 0.999` a tenth of a percent of `v`,
//! under half an ulp: rounded to nearest even (torch's rounding) a decaying `v` never moves
//! (`tests/optim_lowbit.rs` shows it frozen after 1,000 steps of zero gradient, where fp32
//! decays by 0.999^1000 = 0.37), and a bf16 parameter without an fp32 master does not move
//! under a learning rate of 1e-4 at all. So every bf16 value this module writes in a step —
//! moments of `state_bits=16` and parameters without a master — is rounded *stochastically*:
//! up with probability equal to the fraction of an ulp cut off, so the rounding is unbiased
//! and small increments survive on average. Its noise does not build up beyond a few ulps
//! (each step's error is independent and the moment decays by beta each step).
//!
//! The random bits come from a counter-based generator, not a stateful one. Every element has
//! a *key*, `K`: where it sits in its parameter (Python gives each unit the key of its first
//! element: the parameter's index times 2^40 plus the unit's offset in it). At step `t`, for
//! value `s` (exp_avg, exp_avg_sq or the parameter), it draws
//! `lowbias32(block_seed(seed, t, s, K - K % 256) + (K % 256) * 0x9E3779B9)` ([`draw_keyed`]):
//! one splitmix64 hash per 256 keys and one 32-bit mix per element. So a result depends on
//! the seed, the step count and the element's place in its parameter, never on threads,
//! tasks, chunks, the layout, the tier or the world size: the host and NVMe tiers and one or
//! two ranks agree bit for bit (tested), and a run resumed from a checkpoint with the same
//! seed repeats an unbroken one.
//!
//! Conversions (an fp32 checkpoint loaded into bf16 state) round to nearest even: they happen
//! once, and stagnation is a matter of repeated small steps.
//!
//! # Note [8-bit moments]
//! `state_bits=8` stores each moment as one byte per element and one fp32 scale per block of
//! [`BLOCK`] elements (256: a multiple of every SIMD width, a divisor of every chunk and of
//! the NVMe tier's I/O units; 8 bytes of scales per 256 elements, 0.03 bytes per parameter).
//!
//! - `exp_avg`, signed: `m ≈ c · s / 127`, `c` in [-127, 127], `s` the block's largest `|m|`.
//! - `exp_avg_sq` in its square root, unsigned and without a zero: `√v ≈ (c + 1) · s / 256`,
//!   `c` in [0, 255], `s` the block's largest `√v`. The square root halves the exponent
//!   range, so small values keep more resolution than in `v` itself; and the smallest code
//!   stands for `s/256`, not 0, because `v` read back as 0 while `m` is not would turn the
//!   update into `m / eps` (the zero-point problem of low-bit Adam: Li et al. 2023, "Memory
//!   Efficient Optimizers with 4-bit States"). A tiny `v` read back too large only shrinks
//!   that element's step.
//!
//! Both are linear maps, rounded to nearest even: dequantizing is one multiply (and a square
//! for `v`) in the kernel's registers, where a dynamic (bitsandbytes-style) map needs a table
//! lookup per element. Stochastic rounding is not used here: at 8 bits a code is ~1/128 of
//! the block's largest value, and the noise of rounding it randomly at every step would
//! accumulate to about ten codes in `exp_avg_sq` (each step's error decays only by 0.9995 in
//! the square root), larger than the small values the map is meant to keep. Nearest rounding
//! is deterministic and its error stays within half a code; a moment's common decay still
//! happens, through the block's scale. `benches/python/lowbit_quality.py` measures the
//! validation loss this gives against fp32.
//!
//! The scale is recomputed from the updated values at every step, so it follows the block.
//! A block whose largest value is below [`MIN_SCALE`] (1e-30; zero, or denormal) is stored
//! as zeros with scale 0. A block holding inf or NaN is stored with a NaN scale: the whole
//! block reads back NaN, so the failure shows in the parameters, as it would in fp32 state
//! (the one element would be NaN there), instead of being rounded into a finite code.

/// Elements per block of 8-bit state.
pub const BLOCK: usize = 256;

/// Smallest block scale kept; below it a block is stored as zeros (Note [8-bit moments]).
pub const MIN_SCALE: f32 = 1e-30;

const M_LEVELS: f32 = 127.0;
const V_LEVELS: f32 = 256.0;

/// 1.5 * 2^23: `x + ROUNDER` leaves `x` rounded to an integer, ties to even (the FPU's
/// rounding), in the low mantissa bits, for |x| < 2^22. Unlike `round_ties_even` followed
/// by a saturating `as` cast, it vectorises (the casts became a scalar loop with NaN checks).
const ROUNDER: f32 = 12_582_912.0;
const ROUNDER_BITS: i32 = 0x4b40_0000;

/// `x` (|x| < 2^22, or anything: clamped after) to the nearest integer, ties to even.
#[inline(always)]
fn round_to_int(x: f32) -> i32 {
    ((x + ROUNDER).to_bits() as i32).wrapping_sub(ROUNDER_BITS)
}

/// How `exp_avg` and `exp_avg_sq` are stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateBits {
    /// fp32, torch's AdamW state.
    F32,
    /// bf16, stochastically rounded (Note [stochastic rounding]).
    Bf16,
    /// One byte per element and an fp32 scale per block (Note [8-bit moments]).
    Q8,
}

impl StateBits {
    /// From `state_bits=` (32, 16 or 8).
    pub fn from_bits(bits: u32) -> Option<StateBits> {
        match bits {
            32 => Some(StateBits::F32),
            16 => Some(StateBits::Bf16),
            8 => Some(StateBits::Q8),
            _ => None,
        }
    }

    pub fn bits(self) -> u32 {
        match self {
            StateBits::F32 => 32,
            StateBits::Bf16 => 16,
            StateBits::Q8 => 8,
        }
    }

    /// Bytes of one moment element as stored.
    pub fn moment_size(self) -> usize {
        match self {
            StateBits::F32 => 4,
            StateBits::Bf16 => 2,
            StateBits::Q8 => 1,
        }
    }

    /// Whether each moment has a column of per-block scales.
    pub fn has_scales(self) -> bool {
        self == StateBits::Q8
    }
}

/// Blocks of [`BLOCK`] elements covering `len` elements.
pub fn blocks(len: usize) -> usize {
    len.div_ceil(BLOCK)
}

/// Which value a random draw rounds (Note [stochastic rounding]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    ExpAvg = 1,
    ExpAvgSq = 2,
    Param = 3,
}

/// splitmix64's finalizer: a bijection of u64 that mixes every bit.
#[inline]
pub fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A 32-bit bijection with low bias (Chris Wellons' `lowbias32`).
#[inline(always)]
pub fn lowbias32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7feb_352d);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846c_a68b);
    x ^ (x >> 16)
}

/// The seed of the 256 keys from `key` (a multiple of 256), for `stream` at `step`.
#[inline]
pub fn block_seed(seed: u64, step: u64, stream: Stream, key: u64) -> u32 {
    let a = splitmix64(key);
    let b = splitmix64(a ^ step.wrapping_mul(4).wrapping_add(stream as u64));
    (splitmix64(b ^ seed) >> 32) as u32
}

/// The random 32 bits of the element `j` keys into a run of 256 of seed `base`.
#[inline(always)]
pub fn draw(base: u32, j: usize) -> u32 {
    lowbias32(base.wrapping_add((j as u32).wrapping_mul(0x9E37_79B9)))
}

/// The random 32 bits of the element of key `key` (Note [stochastic rounding]).
pub fn draw_keyed(seed: u64, step: u64, stream: Stream, key: u64) -> u32 {
    draw(
        block_seed(seed, step, stream, key & !0xff),
        (key & 0xff) as usize,
    )
}

/// Where stochastic rounding draws from: the seed, the step count, the value rounded.
#[derive(Debug, Clone, Copy)]
pub struct Draws {
    pub seed: u64,
    pub step: u64,
    pub stream: Stream,
}

impl Draws {
    /// The runs of keys `key..key + n` that share a seed: `(start, end, seed, j0)`, elements
    /// `start..end` drawing `draw(seed, j0 + (i - start))` (Note [stochastic rounding]).
    #[inline(always)]
    pub fn runs(
        &self,
        key: u64,
        n: usize,
    ) -> impl Iterator<Item = (usize, usize, u32, usize)> + '_ {
        let mut i = 0;
        std::iter::from_fn(move || {
            if i >= n {
                return None;
            }
            let k = key.wrapping_add(i as u64);
            let j0 = (k & 0xff) as usize;
            let end = n.min(i + (256 - j0));
            let base = block_seed(self.seed, self.step, self.stream, k & !0xff);
            let run = (i, end, base, j0);
            i = end;
            Some(run)
        })
    }
}

/// bf16 bits of `x` rounded stochastically with random bits `r` (their low 16 are used):
/// up with probability (cut-off bits) / 2^16. NaN becomes 0x7fc0, as in
/// [`super::kernel::f32_to_bf16`]; infinities stay.
#[inline(always)]
pub fn f32_to_bf16_sr(x: f32, r: u32) -> u16 {
    let rounded = (x.to_bits().wrapping_add(r & 0xffff) >> 16) as u16;
    if x.is_nan() {
        0x7fc0
    } else {
        rounded
    }
}

/// Round `x` into bf16 `out` stochastically, with the draws of keys `key..` (Note
/// [stochastic rounding]).
#[inline(always)]
pub fn narrow_bf16_sr(x: &[f32], out: &mut [u16], d: &Draws, key: u64) {
    debug_assert_eq!(x.len(), out.len());
    for (a, b, base, j0) in d.runs(key, x.len()) {
        for (j, (o, &v)) in (j0..).zip(out[a..b].iter_mut().zip(&x[a..b])) {
            *o = f32_to_bf16_sr(v, draw(base, j));
        }
    }
}

/// Round `x` into bf16 `out` to nearest even (conversions).
#[inline(always)]
pub fn narrow_bf16(x: &[f32], out: &mut [u16]) {
    for (o, &v) in out.iter_mut().zip(x) {
        *o = super::kernel::f32_to_bf16(v);
    }
}

#[inline(always)]
pub fn widen_bf16(x: &[u16], out: &mut [f32]) {
    for (o, &b) in out.iter_mut().zip(x) {
        *o = super::kernel::bf16_to_f32(b);
    }
}

/// `|x|` as its bit pattern: for non-negative floats the integer order is the float order, and
/// inf and NaN sort above every finite value, so the largest of these is the block's largest
/// magnitude, or tells that the block is not finite, with integer maxima that vectorise.
#[inline(always)]
pub fn abs_bits(x: f32) -> u32 {
    x.to_bits() & 0x7fff_ffff
}

/// The largest [`abs_bits`] of `x`, in lanes of integer maxima.
#[inline(always)]
pub fn absmax_bits(x: &[f32]) -> u32 {
    const L: usize = 16;
    let mut acc = [0u32; L];
    let mut chunks = x.chunks_exact(L);
    for c in &mut chunks {
        for i in 0..L {
            acc[i] = acc[i].max(abs_bits(c[i]));
        }
    }
    let mut m = 0;
    for &v in chunks.remainder() {
        m = m.max(abs_bits(v));
    }
    acc.iter().fold(m, |a, &b| a.max(b))
}

/// The scale of a block whose largest magnitude has bits `bits` (Note [8-bit moments]):
/// `Some(s)` to quantize with, or the scale to store for an all-zero block (`0.0`) or a
/// non-finite one (NaN).
#[inline(always)]
fn scale_of(bits: u32) -> Result<f32, f32> {
    let s = f32::from_bits(bits);
    if bits >= 0x7f80_0000 {
        Err(f32::NAN)
    } else if s < MIN_SCALE {
        Err(0.0)
    } else {
        Ok(s)
    }
}

/// Quantize one block of `exp_avg` (Note [8-bit moments]); returns its scale.
#[inline(always)]
pub fn quantize_m(x: &[f32], codes: &mut [i8]) -> f32 {
    quantize_m_max(x, absmax_bits(x), codes)
}

/// [`quantize_m`] of a block whose [`absmax_bits`] is `max` (computed on the way).
#[inline(always)]
pub fn quantize_m_max(x: &[f32], max: u32, codes: &mut [i8]) -> f32 {
    debug_assert!(x.len() == codes.len() && x.len() <= BLOCK);
    match m_scale(max) {
        Ok((s, inv)) => {
            for (c, &v) in codes.iter_mut().zip(x) {
                *c = code_m(v, inv);
            }
            s
        }
        Err(s) => {
            codes.fill(0);
            s
        }
    }
}

/// How a block of `exp_avg` whose [`absmax_bits`] is `max` is written: `Ok((scale, inv))`,
/// each element as [`code_m`]`(x, inv)`; or `Err(scale)` for a zero or non-finite block,
/// every code 0 (Note [8-bit moments]).
#[inline(always)]
pub fn m_scale(max: u32) -> Result<(f32, f32), f32> {
    scale_of(max).map(|s| (s, M_LEVELS / s))
}

/// One code of `exp_avg`: `x * inv` to nearest, within [-127, 127] (|x| is at most the scale,
/// so `|x * inv|` is at most 127 up to rounding; the clamp keeps the codes).
#[inline(always)]
pub fn code_m(x: f32, inv: f32) -> i8 {
    round_to_int(x * inv).clamp(-127, 127) as i8
}

/// As [`m_scale`], for `sqrt(exp_avg_sq)`.
#[inline(always)]
pub fn v_scale(max: u32) -> Result<(f32, f32), f32> {
    scale_of(max).map(|s| (s, V_LEVELS / s))
}

/// One code of `exp_avg_sq` from its square root `r`: `r * inv` to nearest, minus one (the
/// smallest code stands for one step, not 0), within [0, 255].
#[inline(always)]
pub fn code_v(r: f32, inv: f32) -> u8 {
    (round_to_int(r * inv) - 1).clamp(0, 255) as u8
}

/// The factor [`dequantize_m`] multiplies the codes of a block of scale `s` by.
#[inline(always)]
pub fn m_step(s: f32) -> f32 {
    s / M_LEVELS
}

/// One element of [`dequantize_m`]: `d` from [`m_step`].
#[inline(always)]
pub fn dequant_m(c: i8, d: f32) -> f32 {
    c as f32 * d
}

#[inline(always)]
pub fn dequantize_m(codes: &[i8], s: f32, out: &mut [f32]) {
    let d = m_step(s);
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = dequant_m(c, d);
    }
}

/// Quantize one block of `exp_avg_sq` given as its square roots `r` (Note [8-bit moments]);
/// returns its scale.
#[inline(always)]
pub fn quantize_v_sqrt(r: &[f32], codes: &mut [u8]) -> f32 {
    quantize_v_sqrt_max(r, absmax_bits(r), codes)
}

/// [`quantize_v_sqrt`] of a block whose [`absmax_bits`] is `max` (computed on the way).
#[inline(always)]
pub fn quantize_v_sqrt_max(r: &[f32], max: u32, codes: &mut [u8]) -> f32 {
    debug_assert!(r.len() == codes.len() && r.len() <= BLOCK);
    match v_scale(max) {
        Ok((s, inv)) => {
            for (c, &v) in codes.iter_mut().zip(r) {
                *c = code_v(v, inv);
            }
            s
        }
        Err(s) => {
            codes.fill(0);
            s
        }
    }
}

/// Quantize one block of `exp_avg_sq` (its square roots are taken here, in place in `v`).
#[inline(always)]
pub fn quantize_v(v: &mut [f32], codes: &mut [u8]) -> f32 {
    for x in v.iter_mut() {
        *x = x.sqrt();
    }
    quantize_v_sqrt(v, codes)
}

/// The factor [`dequantize_v`] multiplies the codes (plus one) of a block of scale `s` by.
#[inline(always)]
pub fn v_step(s: f32) -> f32 {
    s / V_LEVELS
}

/// One element of [`dequantize_v`]: `d` from [`v_step`].
#[inline(always)]
pub fn dequant_v(c: u8, d: f32) -> f32 {
    let r = (c as f32 + 1.0) * d;
    r * r
}

#[inline(always)]
pub fn dequantize_v(codes: &[u8], s: f32, out: &mut [f32]) {
    let d = v_step(s);
    for (o, &c) in out.iter_mut().zip(codes) {
        *o = dequant_v(c, d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn state_bits_round_trip_their_names() {
        for b in [32, 16, 8] {
            assert_eq!(StateBits::from_bits(b).unwrap().bits(), b);
        }
        assert_eq!(StateBits::from_bits(4), None);
        assert_eq!(blocks(0), 0);
        assert_eq!(blocks(257), 2);
    }

    #[test]
    fn stochastic_rounding_is_exact_on_bf16_values_and_keeps_specials() {
        for b in [0u16, 0x8000, 0x3f80, 0xc2f7, 0x0001, 0x7f7f, 0x7f80, 0xff80] {
            let x = crate::optim::bf16_to_f32(b);
            for r in [0, 1, 0x7fff, 0xffff, u32::MAX] {
                assert_eq!(f32_to_bf16_sr(x, r), b, "{b:#x} r={r:#x}");
            }
        }
        assert_eq!(f32_to_bf16_sr(f32::NAN, 0xffff), 0x7fc0);
        // The largest finite f32 rounds up to inf with the probability of its cut-off bits.
        assert_eq!(f32_to_bf16_sr(f32::MAX, 0xffff), 0x7f80);
        assert_eq!(f32_to_bf16_sr(f32::MAX, 0), 0x7f7f);
    }

    #[test]
    fn rounding_to_integers_is_to_nearest_even() {
        for (x, want) in [
            (0.5f32, 0),
            (1.5, 2),
            (2.5, 2),
            (-0.5, 0),
            (-1.5, -2),
            (126.49, 126),
            (-127.0, -127),
            (255.5, 256),
            (0.0, 0),
            (-0.0, 0),
        ] {
            assert_eq!(round_to_int(x), want, "{x}");
            assert_eq!(round_to_int(x), x.round_ties_even() as i32, "{x}");
        }
    }

    #[test]
    fn zero_tiny_and_non_finite_blocks() {
        let mut c = [1i8; 4];
        assert_eq!(quantize_m(&[0.0; 4], &mut c), 0.0);
        assert_eq!(c, [0; 4]);
        // Denormal: below MIN_SCALE, stored as zeros.
        assert_eq!(quantize_m(&[1e-40, -1e-39, 0.0, 0.0], &mut c), 0.0);
        let mut out = [9.0f32; 4];
        dequantize_m(&c, 0.0, &mut out);
        assert_eq!(out, [0.0; 4]);
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let s = quantize_m(&[1.0, bad, 2.0, 0.0], &mut c);
            assert!(s.is_nan());
            dequantize_m(&c, s, &mut out);
            assert!(out.iter().all(|x| x.is_nan()), "{bad}: {out:?}");
            let mut u = [0u8; 4];
            let s = quantize_v(&mut [1.0, bad.abs(), 2.0, 0.0], &mut u);
            assert!(s.is_nan());
            dequantize_v(&u, s, &mut out);
            assert!(out.iter().all(|x| x.is_nan()));
        }
        let mut u = [7u8; 3];
        assert_eq!(quantize_v(&mut [0.0; 3], &mut u), 0.0);
        dequantize_v(&u, 0.0, &mut out[..3]);
        assert_eq!(&out[..3], &[0.0; 3]);
    }

    #[test]
    fn the_largest_element_is_exact_and_small_v_never_reads_back_zero() {
        let x = [0.5f32, -3.0, 1e-3, 2.9];
        let mut c = [0i8; 4];
        let s = quantize_m(&x, &mut c);
        assert_eq!((s, c[1]), (3.0, -127));
        let v = [9.0f32, 1e-12, 0.0, 4.0];
        let mut u = [0u8; 4];
        let s = quantize_v(&mut v.clone(), &mut u);
        assert_eq!((s, u[0]), (3.0, 255));
        let mut back = [0f32; 4];
        dequantize_v(&u, s, &mut back);
        assert_eq!(back[0], 9.0);
        // The smallest code stands for (s/256)², never 0 (Note [8-bit moments]).
        assert_eq!(back[1], (3.0f32 / 256.0) * (3.0 / 256.0));
        assert!(back[2] > 0.0);
    }
}
