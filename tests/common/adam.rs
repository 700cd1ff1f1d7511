//! Helpers of the optimizer tests over low-bit state (tests/optim_lowbit.rs,
//! tests/optim_lowbit_edges.rs): data, the update written out, states on either tier.
#![allow(dead_code)] // not every test binary uses every helper

use std::sync::Arc;

use spillover_core::io::{EngineChoice, IoOptions, Swap};
use spillover_core::optim::{
    fma_available, AdamState, Dtype, Form, Hyper, Options, Ptr, StateBits, Tier, UnitBuffers,
    UnitStep,
};
use spillover_core::pool::Pool;

/// A small deterministic generator (xorshift), values roughly N(0, 1)-sized.
pub struct Rng(pub u64);

impl Rng {
    pub fn f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
    }
    pub fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

pub fn hyper(step: f64) -> Hyper {
    Hyper {
        lr: 1e-2,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 0.05,
        step,
        grad_scale: 1.0,
    }
}

/// The update, element by element (Note [torch rounding]).
pub fn update(p: f32, g: f32, m: &mut f32, v: &mut f32, h: &Hyper, tail: bool) -> f32 {
    let k = h.coeffs();
    let fma = |a: f32, b: f32, c: f32| {
        if fma_available() {
            a.mul_add(b, c)
        } else {
            a * b + c
        }
    };
    let g = g * k.grad_scale;
    let p = p * k.decay;
    *m = fma(k.lerp, g - *m, if k.lerp_from_m { *m } else { g });
    *v = if tail {
        fma(*v, k.beta2, k.one_minus_beta2 * g * g)
    } else {
        fma(k.one_minus_beta2 * g, g, *v * k.beta2)
    };
    p + (k.neg_step_size * *m) / (v.sqrt() / k.bc2_sqrt + k.eps)
}

pub fn host_tier() -> Tier {
    Tier::Host { allow_heap: false }
}

pub fn state(
    pool: &Pool,
    lens: &[usize],
    master: bool,
    bits: StateBits,
    chunk_elems: usize,
    task_elems: usize,
    tier: Tier,
) -> AdamState {
    let opts = Options {
        master,
        bits,
        seed: 11,
        chunk_elems,
        task_elems,
        tier,
    };
    AdamState::new(pool, lens, &opts).unwrap()
}

pub fn unit_step(
    u: usize,
    g: &[f32],
    gd: Dtype,
    p: usize,
    pd: Dtype,
    h: Hyper,
    tail: usize,
) -> UnitStep {
    UnitStep {
        unit: u,
        grad: Ptr::new(g.as_ptr() as usize, gd),
        src: Ptr::new(p, pd),
        out: Ptr::new(p, pd),
        hyper: h,
        tail,
        predict: false,
        coef: Ptr::new(0, Dtype::F32),
        key: (u as u64) << 40,
    }
}

pub fn export_f32(
    st: &mut AdamState,
    lens: &[usize],
    master: bool,
) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let mut m: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0f32; n]).collect();
    let mut v = m.clone();
    let mut mst = m.clone();
    let bufs: Vec<UnitBuffers> = (0..lens.len())
        .map(|u| UnitBuffers {
            unit: u,
            master: if master {
                mst[u].as_mut_ptr() as usize
            } else {
                0
            },
            exp_avg: m[u].as_mut_ptr() as usize,
            exp_avg_sq: v[u].as_mut_ptr() as usize,
            exp_avg_scale: 0,
            exp_avg_sq_scale: 0,
        })
        .collect();
    // SAFETY: live f32 Vecs of each unit's length.
    unsafe { st.export(&bufs, Form::F32) }.unwrap();
    (m, v)
}

pub fn open_swap(pool: &Pool) -> Arc<Swap> {
    let dir = tempfile::tempdir().unwrap();
    let mut io = IoOptions::new([dir.path()]);
    io.engine = EngineChoice::Threads;
    io.allow_buffered = true;
    io.block_bytes = 64 << 10;
    Arc::new(Swap::open(&io, pool).unwrap())
}

pub fn nvme_tier(swap: &Arc<Swap>) -> Tier {
    Tier::Nvme {
        swap: swap.clone(),
        buffers: 3,
    }
}
