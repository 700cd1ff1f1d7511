//! Low-bit optimizer state at its edges: the stagnation stochastic rounding prevents, bytes
//! per parameter and NVMe traffic per format, bf16 parameters without a master moving by
//! steps under half an ulp, a NaN gradient's block, and the requests refused.

use spillover_core::optim::{
    bf16_to_f32, f32_to_bf16, AdamState, Bf16, Dtype, Form, Options, StateBits, UnitBuffers, BLOCK,
};
use spillover_core::Error;

mod common;
use common::adam::*;
use common::pool;

#[test]
fn nearest_rounding_freezes_a_decaying_exp_avg_sq_and_stochastic_rounding_does_not() {
    let (beta2, steps) = (0.999f32, 1000);
    let want = 0.001f64 * 0.999f64.powi(steps);
    let mut rne = f32_to_bf16(0.001);
    for _ in 0..steps {
        rne = f32_to_bf16(bf16_to_f32(rne) * beta2);
    }
    assert_eq!(
        bf16_to_f32(rne),
        bf16_to_f32(f32_to_bf16(0.001)),
        "nearest: frozen"
    );
    // The same through the optimizer: bf16 moments, one step with g = 1, then zeros.
    let p = pool(16 << 20);
    let n = 4096;
    let mut st = state(&p, &[n], false, StateBits::Bf16, 1024, 512, host_tier());
    let mut param = vec![0f32; n];
    for s in 1..=steps as u64 + 1 {
        let g = vec![if s == 1 { 1.0f32 } else { 0.0 }; n];
        let mut h = hyper(s as f64);
        h.lr = 0.0;
        h.weight_decay = 0.0;
        let w = unit_step(
            0,
            &g,
            Dtype::F32,
            param.as_mut_ptr() as usize,
            Dtype::F32,
            h,
            0,
        );
        // SAFETY: live Vecs of the unit's length.
        unsafe { st.step(&[w]) }.unwrap();
    }
    let (_, v) = export_f32(&mut st, &[n], false);
    let mean = v[0].iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    assert!(((mean - want) / want).abs() < 0.02, "{mean} vs {want}");
}

#[test]
fn bytes_per_parameter_and_nvme_traffic_follow_the_format() {
    let p = pool(64 << 20);
    let swap = open_swap(&p);
    let n = 1 << 20;
    // (bits, master): bytes per parameter as stored, within the padding of columns.
    for (bits, master, want) in [
        (StateBits::F32, true, 12.0),
        (StateBits::F32, false, 8.0),
        (StateBits::Bf16, true, 8.0),
        (StateBits::Bf16, false, 4.0),
        (StateBits::Q8, true, 6.0 + 8.0 / 256.0),
        (StateBits::Q8, false, 2.0 + 8.0 / 256.0),
    ] {
        let st = state(&p, &[n], master, bits, 1 << 19, 1 << 20, host_tier());
        let per = st.stats().state_bytes as f64 / n as f64;
        assert!(
            per >= want && per < want + 0.015,
            "{bits:?} {master}: {per}"
        );
        let mut st = state(&p, &[n], master, bits, 1 << 19, 1 << 20, nvme_tier(&swap));
        let bytes = st.stats().state_bytes;
        let g = vec![0.25f32; n];
        let mut prm = vec![0.5f32; n];
        let mut bp = vec![Bf16(0x3f00); n];
        for s in 1..=3 {
            let w = if master || bits == StateBits::F32 {
                unit_step(
                    0,
                    &g,
                    Dtype::F32,
                    prm.as_mut_ptr() as usize,
                    Dtype::F32,
                    hyper(s as f64),
                    0,
                )
            } else {
                unit_step(
                    0,
                    &g,
                    Dtype::F32,
                    bp.as_mut_ptr() as usize,
                    Dtype::Bf16,
                    hyper(s as f64),
                    0,
                )
            };
            // SAFETY: live Vecs of the unit's length.
            unsafe { st.step(&[w]) }.unwrap();
        }
        let s = st.stats();
        // Every chunk written at every step and read from the second on (in pool blocks,
        // whole 4 KiB pages).
        let chunks = n.div_ceil(1 << 19) as u64;
        let (w, r) = (s.bytes_written / 3, s.bytes_read / 2);
        assert!(
            w == r && w >= bytes && w < bytes + 4096 * chunks,
            "{bits:?} {w} {r} {bytes}"
        );
    }
}

#[test]
fn bf16_parameters_without_a_master_move_by_small_steps_on_average() {
    // lr 1e-4 on parameters at 1.0 (half an ulp is 2^-9 = 0.002): to nearest they never move.
    let p = pool(16 << 20);
    let n = 1 << 14;
    let mut means = Vec::new();
    for seed_shift in [0u64, 1] {
        let mut st = AdamState::new(
            &p,
            &[n],
            &Options {
                master: false,
                bits: StateBits::Q8,
                seed: 11 + seed_shift,
                chunk_elems: 1 << 14,
                task_elems: 1 << 12,
                tier: host_tier(),
            },
        )
        .unwrap();
        let mut bp = vec![Bf16(f32_to_bf16(1.0)); n];
        let g = vec![1.0f32; n];
        for s in 1..=100 {
            let mut h = hyper(s as f64);
            h.lr = 1e-4;
            h.weight_decay = 0.0;
            let w = unit_step(
                0,
                &g,
                Dtype::F32,
                bp.as_mut_ptr() as usize,
                Dtype::Bf16,
                h,
                0,
            );
            // SAFETY: live Vecs of the unit's length.
            unsafe { st.step(&[w]) }.unwrap();
        }
        let mean = bp.iter().map(|b| bf16_to_f32(b.0) as f64).sum::<f64>() / n as f64;
        // Adam with a constant gradient steps by lr: 100 steps of 1e-4.
        assert!((mean - 0.99).abs() < 0.0005, "mean {mean}");
        means.push(bp);
    }
    assert!(means[0] != means[1], "another seed, other roundings");
}

#[test]
fn a_nan_gradient_shows_in_its_block_not_beyond() {
    let p = pool(16 << 20);
    let n = 3 * BLOCK;
    let mut st = state(&p, &[n], false, StateBits::Q8, 1024, 1024, host_tier());
    let mut prm = vec![0.5f32; n];
    let mut g = vec![0.25f32; n];
    g[BLOCK + 3] = f32::NAN;
    let w = unit_step(
        0,
        &g,
        Dtype::F32,
        prm.as_mut_ptr() as usize,
        Dtype::F32,
        hyper(1.0),
        0,
    );
    // SAFETY: live Vecs of the unit's length.
    unsafe { st.step(&[w]) }.unwrap();
    g[BLOCK + 3] = 0.25;
    let w = unit_step(
        0,
        &g,
        Dtype::F32,
        prm.as_mut_ptr() as usize,
        Dtype::F32,
        hyper(2.0),
        0,
    );
    // SAFETY: as above.
    unsafe { st.step(&[w]) }.unwrap();
    assert!(prm[..BLOCK].iter().all(|x| x.is_finite()));
    assert!(prm[BLOCK..2 * BLOCK].iter().all(|x| x.is_nan()));
    assert!(prm[2 * BLOCK..].iter().all(|x| x.is_finite()));
}

#[test]
fn bad_low_bit_requests_are_refused() {
    let p = pool(16 << 20);
    let opts = Options {
        master: false,
        bits: StateBits::Q8,
        seed: 0,
        chunk_elems: 1000 / 16 * 16,
        task_elems: 512,
        tier: host_tier(),
    };
    let e = AdamState::new(&p, &[10], &opts).unwrap_err();
    assert!(
        matches!(&e, Error::Invalid(m) if m.contains("multiple of 256")),
        "{e}"
    );
    let mut st = state(&p, &[300], false, StateBits::Q8, 1024, 512, host_tier());
    let (m, v, vs) = (vec![0i8; 300], vec![0u8; 300], vec![0f32; 2]);
    let b = UnitBuffers {
        unit: 0,
        master: 0,
        exp_avg: m.as_ptr() as usize,
        exp_avg_sq: v.as_ptr() as usize,
        exp_avg_scale: 0, // missing
        exp_avg_sq_scale: vs.as_ptr() as usize,
    };
    // SAFETY: refused before any access.
    let r = unsafe { st.import(&[b], Form::Stored) };
    assert!(
        matches!(&r, Err(Error::Invalid(m)) if m.contains("missing")),
        "{r:?}"
    );
}
