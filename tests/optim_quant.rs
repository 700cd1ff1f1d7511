//! The codes of low-bit optimizer state (Note [8-bit moments], Note [stochastic rounding] in
//! rust/optim/quant.rs): error bounds over random blocks, block edges, zeros, denormals and
//! non-finite values (property tests); stochastic rounding's bias.

use proptest::prelude::*;
use spillover_core::optim::quant::{self, Stream};
use spillover_core::optim::{bf16_to_f32, BLOCK};

// ---- the codes (Note [8-bit moments]) ----

/// Values spread over many binades, with zeros: what moments look like.
fn block_values(signed: bool) -> impl Strategy<Value = Vec<f32>> {
    let one = (any::<bool>(), -30i32..10, 0.0f32..1.0, 0u8..8).prop_map(move |(neg, e, f, z)| {
        if z == 0 {
            0.0
        } else {
            let x = (1.0 + f) * 2f32.powi(e);
            if signed && neg {
                -x
            } else {
                x
            }
        }
    });
    proptest::collection::vec(one, 1..=BLOCK)
}

proptest! {
    /// exp_avg: every element within half a code (s/254) of its value, plus f32 rounding; the
    /// sign kept (or zero); the scale is the largest magnitude.
    #[test]
    fn exp_avg_codes_are_within_half_a_step(x in block_values(true)) {
        let mut c = vec![0i8; x.len()];
        let s = quant::quantize_m(&x, &mut c);
        let max = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        prop_assert_eq!(s, if max < quant::MIN_SCALE { 0.0 } else { max });
        let mut back = vec![0f32; x.len()];
        quant::dequantize_m(&c, s, &mut back);
        for (&a, &b) in x.iter().zip(&back) {
            prop_assert!((a - b).abs() <= s / 254.0 * (1.0 + 1e-5), "{a} -> {b} (scale {s})");
            prop_assert!(b == 0.0 || (a > 0.0) == (b > 0.0));
        }
    }

    /// exp_avg_sq in its square root: within half a code of √v where √v is at least one code,
    /// never below it where it is smaller (never zero when the block is not), never negative.
    #[test]
    fn exp_avg_sq_codes_keep_small_values_and_never_read_zero(x in block_values(false)) {
        let mut c = vec![0u8; x.len()];
        let s = quant::quantize_v(&mut x.clone(), &mut c);
        let mut back = vec![0f32; x.len()];
        quant::dequantize_v(&c, s, &mut back);
        let step = s / 256.0;
        for (&a, &b) in x.iter().zip(&back) {
            let (ra, rb) = (a.sqrt(), b.sqrt());
            prop_assert!(b >= 0.0);
            if s > 0.0 {
                prop_assert!(b > 0.0, "{a} read back as 0 in a block of scale {s}");
            }
            if ra >= step {
                prop_assert!((ra - rb).abs() <= step / 2.0 * (1.0 + 1e-4), "√{a} -> √{b}");
            } else {
                prop_assert!(rb >= ra && rb <= step * (1.0 + 1e-6), "√{a} -> √{b} (step {step})");
            }
        }
    }

    /// A non-finite value anywhere makes the whole block read back NaN.
    #[test]
    fn a_non_finite_element_poisons_its_block(mut x in block_values(true), at in any::<usize>(),
                                              bad in prop_oneof![Just(f32::NAN),
                                                                 Just(f32::INFINITY)]) {
        let i = at % x.len();
        x[i] = bad;
        let mut c = vec![0i8; x.len()];
        let s = quant::quantize_m(&x, &mut c);
        let mut back = vec![0f32; x.len()];
        quant::dequantize_m(&c, s, &mut back);
        prop_assert!(back.iter().all(|v| v.is_nan()));
        let mut v: Vec<f32> = x.iter().map(|a| a.abs()).collect();
        let mut u = vec![0u8; x.len()];
        let s = quant::quantize_v(&mut v, &mut u);
        quant::dequantize_v(&u, s, &mut back);
        prop_assert!(back.iter().all(|v| v.is_nan()));
    }
}

// ---- stochastic rounding (Note [stochastic rounding]) ----

#[test]
fn stochastic_rounding_is_unbiased() {
    // 1 + 0.3 ulp and its negative, over 2^16 draws of one block seed each.
    let x = f32::from_bits(0x3f80_0000 + (0.3 * 65536.0) as u32);
    for x in [x, -x] {
        let mut sum = 0f64;
        let n = 1 << 16;
        for i in 0..n {
            let base = quant::block_seed(7, i as u64, Stream::ExpAvg, 0);
            sum += bf16_to_f32(quant::f32_to_bf16_sr(x, quant::draw(base, 3))) as f64;
        }
        let mean = sum / n as f64;
        let ulp = 2f64.powi(-7);
        assert!((mean - x as f64).abs() < 0.01 * ulp, "{x}: mean {mean}");
    }
}
