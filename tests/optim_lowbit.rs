//! Low-bit optimizer state through the public API: the 8-bit codes' error bounds, block
//! edges, zeros, denormals and non-finite blocks (property tests); stochastic rounding's
//! bias and the stagnation it prevents; the step over bf16 and 8-bit state, and over bf16
//! parameters without a master, against a scalar reference written out here; host and NVMe
//! tiers, chunk and task sizes bit for bit; stored and f32 export/import; bytes per parameter.

use proptest::prelude::*;
use spillover_core::io::{EngineChoice, IoOptions, Swap};
use spillover_core::optim::quant::{self, Stream};
use spillover_core::optim::{
    bf16_to_f32, f32_to_bf16, fma_available, AdamState, Bf16, Dtype, Form, Hyper, Options, Ptr,
    StateBits, Tier, UnitBuffers, UnitStep, BLOCK,
};
use spillover_core::pool::Pool;
use spillover_core::Error;
use std::sync::Arc;

mod common;
use common::pool;

struct Rng(u64);

impl Rng {
    fn f32(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 3.0
    }
    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }
}

fn hyper(step: f64) -> Hyper {
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
fn update(p: f32, g: f32, m: &mut f32, v: &mut f32, h: &Hyper, tail: bool) -> f32 {
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

// ---- the step ----

fn host_tier() -> Tier {
    Tier::Host { allow_heap: false }
}

fn state(
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

fn unit_step(
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
        key: (u as u64) << 40,
    }
}

/// How the parameter is held: fp32 (its own master), bf16 with an fp32 master, bf16 alone.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Mode {
    F32InPlace,
    Bf16Master,
    Bf16NoMaster,
}

/// The stored moments of one unit, as the reference keeps them.
#[derive(Clone, Debug, PartialEq)]
enum Moments {
    F32(Vec<f32>, Vec<f32>),
    Bf16(Vec<u16>, Vec<u16>),
    Q8(Vec<i8>, Vec<u8>, Vec<f32>, Vec<f32>),
}

impl Moments {
    fn new(bits: StateBits, n: usize) -> Moments {
        match bits {
            StateBits::F32 => Moments::F32(vec![0.0; n], vec![0.0; n]),
            StateBits::Bf16 => Moments::Bf16(vec![0; n], vec![0; n]),
            StateBits::Q8 => {
                let b = quant::blocks(n);
                Moments::Q8(vec![0; n], vec![0; n], vec![0.0; b], vec![0.0; b])
            }
        }
    }

    fn buffers(&mut self, unit: usize, master: usize) -> UnitBuffers {
        let (m, v, ms, vs) = match self {
            Moments::F32(m, v) => (m.as_mut_ptr() as usize, v.as_mut_ptr() as usize, 0, 0),
            Moments::Bf16(m, v) => (m.as_mut_ptr() as usize, v.as_mut_ptr() as usize, 0, 0),
            Moments::Q8(m, v, ms, vs) => (
                m.as_mut_ptr() as usize,
                v.as_mut_ptr() as usize,
                ms.as_mut_ptr() as usize,
                vs.as_mut_ptr() as usize,
            ),
        };
        UnitBuffers {
            unit,
            master,
            exp_avg: m,
            exp_avg_sq: v,
            exp_avg_scale: ms,
            exp_avg_sq_scale: vs,
        }
    }
}

/// The scalar reference of one unit's step over low-bit state (Note [one pass per block]).
#[allow(clippy::too_many_arguments)]
fn reference_step(
    st: &mut Moments,
    p: &mut [f32],
    bf16_param: Option<&mut [u16]>,
    g: &[f32],
    h: &Hyper,
    tail: usize,
    key: u64,
    seed: u64,
    init: bool,
) {
    let n = g.len();
    let step = h.step as u64;
    let mut bf16_param = bf16_param;
    for (b, lo) in (0..n).step_by(BLOCK).enumerate() {
        let hi = (lo + BLOCK).min(n);
        let len = hi - lo;
        let (mut m, mut v) = (vec![0f32; len], vec![0f32; len]);
        if !init {
            match st {
                Moments::F32(sm, sv) => {
                    m.copy_from_slice(&sm[lo..hi]);
                    v.copy_from_slice(&sv[lo..hi]);
                }
                Moments::Bf16(sm, sv) => {
                    for j in 0..len {
                        m[j] = bf16_to_f32(sm[lo + j]);
                        v[j] = bf16_to_f32(sv[lo + j]);
                    }
                }
                Moments::Q8(sm, sv, ms, vs) => {
                    quant::dequantize_m(&sm[lo..hi], ms[b], &mut m);
                    quant::dequantize_v(&sv[lo..hi], vs[b], &mut v);
                }
            }
        }
        // Every element's own draw, from its key (Note [stochastic rounding]).
        let draw = |s: Stream, j: usize| quant::draw_keyed(seed, step, s, key + (lo + j) as u64);
        for j in 0..len {
            let i = lo + j;
            let x = match &bf16_param {
                Some(bp) => bf16_to_f32(bp[i]),
                None => p[i],
            };
            let y = update(x, g[i], &mut m[j], &mut v[j], h, i >= n - tail.min(n));
            match &mut bf16_param {
                Some(bp) => bp[i] = quant::f32_to_bf16_sr(y, draw(Stream::Param, j)),
                None => p[i] = y,
            }
        }
        match st {
            Moments::F32(sm, sv) => {
                sm[lo..hi].copy_from_slice(&m);
                sv[lo..hi].copy_from_slice(&v);
            }
            Moments::Bf16(sm, sv) => {
                for j in 0..len {
                    sm[lo + j] = quant::f32_to_bf16_sr(m[j], draw(Stream::ExpAvg, j));
                    sv[lo + j] = quant::f32_to_bf16_sr(v[j], draw(Stream::ExpAvgSq, j));
                }
            }
            Moments::Q8(sm, sv, ms, vs) => {
                ms[b] = quant::quantize_m(&m, &mut sm[lo..hi]);
                vs[b] = quant::quantize_v(&mut v, &mut sv[lo..hi]);
            }
        }
    }
}

const LENS: [usize; 7] = [1000, 7, 4099, 1, 256, 2000, 300];

/// A model of several parameters trained by the optimizer, with what it should hold.
struct Model {
    mode: Mode,
    bits: StateBits,
    /// fp32 values (fp32 parameters, or the masters of bf16 ones), bf16 parameters.
    p: Vec<Vec<f32>>,
    bp: Vec<Vec<u16>>,
    steps: Vec<u64>,
}

impl Model {
    fn new(mode: Mode, bits: StateBits) -> Model {
        let mut rng = Rng(3);
        let p: Vec<Vec<f32>> = LENS.iter().map(|&n| rng.vec(n)).collect();
        let bp = p
            .iter()
            .map(|u| u.iter().map(|&x| f32_to_bf16(x)).collect())
            .collect();
        Model {
            mode,
            bits,
            p,
            bp,
            steps: vec![0; LENS.len()],
        }
    }

    fn master(&self) -> bool {
        self.mode == Mode::Bf16Master
    }

    fn grads(step: u64) -> Vec<Vec<f32>> {
        let mut rng = Rng(100 + step);
        LENS.iter().map(|&n| rng.vec(n)).collect()
    }

    /// Steps `range` through `st`; every third step unit 1 has no gradient.
    fn train(&mut self, st: &mut AdamState, range: std::ops::Range<u64>) {
        for s in range {
            let grads = Self::grads(s);
            let mut work = Vec::new();
            for u in 0..LENS.len() {
                if u == 1 && s % 3 == 0 {
                    continue;
                }
                self.steps[u] += 1;
                let h = hyper(self.steps[u] as f64);
                let tail = LENS[u] % 8;
                let w = match self.mode {
                    Mode::F32InPlace => {
                        let a = self.p[u].as_mut_ptr() as usize;
                        unit_step(u, &grads[u], Dtype::F32, a, Dtype::F32, h, tail)
                    }
                    Mode::Bf16Master | Mode::Bf16NoMaster => {
                        let a = self.bp[u].as_mut_ptr() as usize;
                        unit_step(u, &grads[u], Dtype::F32, a, Dtype::Bf16, h, tail)
                    }
                };
                work.push(w);
            }
            // SAFETY: every address is a live Vec of the unit's length and dtype.
            unsafe { st.step(&work) }.unwrap();
        }
    }

    /// The same steps in the scalar reference.
    fn reference(&mut self, moments: &mut [Moments], range: std::ops::Range<u64>, seed: u64) {
        for s in range {
            let grads = Self::grads(s);
            for u in 0..LENS.len() {
                if u == 1 && s % 3 == 0 {
                    continue;
                }
                self.steps[u] += 1;
                let h = hyper(self.steps[u] as f64);
                let init = self.steps[u] == 1;
                let key = (u as u64) << 40;
                let tail = LENS[u] % 8;
                match self.mode {
                    Mode::F32InPlace => reference_step(
                        &mut moments[u],
                        &mut self.p[u],
                        None,
                        &grads[u],
                        &h,
                        tail,
                        key,
                        seed,
                        init,
                    ),
                    Mode::Bf16Master => {
                        if init {
                            self.p[u] = self.bp[u].iter().map(|&b| bf16_to_f32(b)).collect();
                        }
                        reference_step(
                            &mut moments[u],
                            &mut self.p[u],
                            None,
                            &grads[u],
                            &h,
                            tail,
                            key,
                            seed,
                            init,
                        );
                        self.bp[u] = self.p[u].iter().map(|&x| f32_to_bf16(x)).collect();
                    }
                    Mode::Bf16NoMaster => reference_step(
                        &mut moments[u],
                        &mut self.p[u],
                        Some(&mut self.bp[u]),
                        &grads[u],
                        &h,
                        tail,
                        key,
                        seed,
                        init,
                    ),
                }
            }
        }
    }

    /// The state as stored, and the masters.
    fn export(&self, st: &mut AdamState) -> (Vec<Moments>, Vec<Vec<f32>>) {
        let mut moments: Vec<Moments> = LENS.iter().map(|&n| Moments::new(self.bits, n)).collect();
        let mut masters: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![0f32; n]).collect();
        let bufs: Vec<UnitBuffers> = moments
            .iter_mut()
            .zip(&mut masters)
            .enumerate()
            .map(|(u, (m, mst))| m.buffers(u, mst.as_mut_ptr() as usize))
            .collect();
        // SAFETY: the buffers are live Vecs of each unit's length (scales: its blocks).
        unsafe { st.export(&bufs, Form::Stored) }.unwrap();
        (moments, masters)
    }
}

fn export_f32(st: &mut AdamState, lens: &[usize], master: bool) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
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

const MODES: [Mode; 3] = [Mode::F32InPlace, Mode::Bf16Master, Mode::Bf16NoMaster];
const BITS: [StateBits; 3] = [StateBits::F32, StateBits::Bf16, StateBits::Q8];

#[test]
fn low_bit_steps_equal_the_scalar_reference() {
    let p = pool(64 << 20);
    for mode in MODES {
        for bits in BITS {
            if bits == StateBits::F32 && mode != Mode::Bf16NoMaster {
                continue; // the fp32 kernel's own tests (tests/optim.rs)
            }
            let mut ours = Model::new(mode, bits);
            let mut st = state(&p, &LENS, ours.master(), bits, 2048, 512, host_tier());
            ours.train(&mut st, 0..6);
            let mut want = Model::new(mode, bits);
            let mut moments: Vec<Moments> = LENS.iter().map(|&n| Moments::new(bits, n)).collect();
            want.reference(&mut moments, 0..6, 11);
            let (got, masters) = ours.export(&mut st);
            assert_eq!(got, moments, "{mode:?} {bits:?}: state");
            match mode {
                Mode::F32InPlace => assert_eq!(ours.p, want.p, "{mode:?} {bits:?}"),
                Mode::Bf16Master => {
                    assert_eq!(masters, want.p, "{mode:?} {bits:?}: masters");
                    assert_eq!(ours.bp, want.bp, "{mode:?} {bits:?}: bf16 out");
                }
                Mode::Bf16NoMaster => assert_eq!(ours.bp, want.bp, "{mode:?} {bits:?}"),
            }
            // The parameters moved: the update is not lost to rounding.
            let start = Model::new(mode, bits);
            let moved = match mode {
                Mode::F32InPlace => ours.p != start.p,
                _ => ours.bp != start.bp,
            };
            assert!(moved, "{mode:?} {bits:?}: the parameters did not move");
        }
    }
}

fn open_swap(pool: &Pool) -> Arc<Swap> {
    let dir = tempfile::tempdir().unwrap();
    let mut io = IoOptions::new([dir.path()]);
    io.engine = EngineChoice::Threads;
    io.allow_buffered = true;
    io.block_bytes = 64 << 10;
    Arc::new(Swap::open(&io, pool).unwrap())
}

fn nvme_tier(swap: &Arc<Swap>) -> Tier {
    Tier::Nvme {
        swap: swap.clone(),
        buffers: 3,
    }
}

#[test]
fn tiers_chunks_and_tasks_agree_bit_for_bit() {
    let p = pool(64 << 20);
    let swap = open_swap(&p);
    for bits in BITS {
        for mode in MODES {
            if bits == StateBits::F32 && mode != Mode::Bf16NoMaster {
                continue; // tests/optim.rs
            }
            let mut first: Option<(Model, Vec<Moments>)> = None;
            let mut shapes = vec![
                (1 << 20, 1 << 20, false),
                (256, 256, false),
                (1024, 512, true),
                (4096, 1 << 20, true),
            ];
            if bits != StateBits::Q8 {
                // No blocks: units, chunks and tasks anywhere on 16 elements.
                shapes.extend([(1040, 48, false), (208, 16, true)]);
            }
            for (chunk, task, nvme) in shapes {
                let mut m = Model::new(mode, bits);
                let tier = if nvme { nvme_tier(&swap) } else { host_tier() };
                let mut st = state(&p, &LENS, m.master(), bits, chunk, task, tier);
                m.train(&mut st, 0..5);
                let (got, _) = m.export(&mut st);
                match &first {
                    None => first = Some((m, got)),
                    Some((m0, g0)) => {
                        assert_eq!(&got, g0, "{bits:?} {mode:?} chunk {chunk} task {task}");
                        assert_eq!((&m.p, &m.bp), (&m0.p, &m0.bp));
                    }
                }
            }
        }
    }
}

#[test]
fn stored_export_import_across_tiers_resumes_exactly_and_f32_form_converts() {
    let p = pool(64 << 20);
    let swap = open_swap(&p);
    for bits in [StateBits::Bf16, StateBits::Q8] {
        let mode = Mode::Bf16Master;
        let mut a = Model::new(mode, bits);
        let mut sa = state(&p, &LENS, true, bits, 2048, 512, host_tier());
        a.train(&mut sa, 0..4);
        let (mut saved, mut masters) = a.export(&mut sa);
        let mut sb = state(&p, &LENS, true, bits, 1024, 256, nvme_tier(&swap));
        let bufs: Vec<UnitBuffers> = saved
            .iter_mut()
            .zip(&mut masters)
            .enumerate()
            .map(|(u, (m, mst))| m.buffers(u, mst.as_mut_ptr() as usize))
            .collect();
        // SAFETY: live Vecs of each unit's length.
        unsafe { sb.import(&bufs, Form::Stored) }.unwrap();
        let mut b = Model {
            mode,
            bits,
            p: a.p.clone(),
            bp: a.bp.clone(),
            steps: a.steps.clone(),
        };
        assert_eq!(a.export(&mut sa), b.export(&mut sb));
        a.train(&mut sa, 4..8);
        b.train(&mut sb, 4..8);
        assert_eq!(a.export(&mut sa), b.export(&mut sb), "{bits:?}");
        assert_eq!(a.bp, b.bp);

        // The f32 form is the dequantized state; importing it quantizes (nearest).
        let (m, v) = export_f32(&mut sa, &LENS, true);
        let (stored, _) = a.export(&mut sa);
        for (u, s) in stored.iter().enumerate() {
            let n = LENS[u];
            let (mut wm, mut wv) = (vec![0f32; n], vec![0f32; n]);
            match s {
                Moments::Bf16(sm, sv) => {
                    for i in 0..n {
                        wm[i] = bf16_to_f32(sm[i]);
                        wv[i] = bf16_to_f32(sv[i]);
                    }
                }
                Moments::Q8(sm, sv, ms, vs) => {
                    for (b, lo) in (0..n).step_by(BLOCK).enumerate() {
                        let hi = (lo + BLOCK).min(n);
                        quant::dequantize_m(&sm[lo..hi], ms[b], &mut wm[lo..hi]);
                        quant::dequantize_v(&sv[lo..hi], vs[b], &mut wv[lo..hi]);
                    }
                }
                Moments::F32(..) => unreachable!(),
            }
            assert_eq!((&m[u], &v[u]), (&wm, &wv), "{bits:?} unit {u}");
        }
        let mut rng = Rng(5);
        let fm: Vec<Vec<f32>> = LENS.iter().map(|&n| rng.vec(n)).collect();
        let fv: Vec<Vec<f32>> = LENS
            .iter()
            .map(|&n| rng.vec(n).iter().map(|x| x * x).collect())
            .collect();
        let mut mst: Vec<Vec<f32>> = LENS.iter().map(|&n| vec![1.0; n]).collect();
        let bufs: Vec<UnitBuffers> = (0..LENS.len())
            .map(|u| UnitBuffers {
                unit: u,
                master: mst[u].as_mut_ptr() as usize,
                exp_avg: fm[u].as_ptr() as usize,
                exp_avg_sq: fv[u].as_ptr() as usize,
                exp_avg_scale: 0,
                exp_avg_sq_scale: 0,
            })
            .collect();
        // SAFETY: live f32 Vecs of each unit's length, only read.
        unsafe { sb.import(&bufs, Form::F32) }.unwrap();
        let (got, _) = b.export(&mut sb);
        for (u, s) in got.iter().enumerate() {
            let n = LENS[u];
            let want = match bits {
                StateBits::Bf16 => Moments::Bf16(
                    fm[u].iter().map(|&x| f32_to_bf16(x)).collect(),
                    fv[u].iter().map(|&x| f32_to_bf16(x)).collect(),
                ),
                _ => {
                    let mut w = Moments::new(bits, n);
                    if let Moments::Q8(cm, cv, ms, vs) = &mut w {
                        for (b, lo) in (0..n).step_by(BLOCK).enumerate() {
                            let hi = (lo + BLOCK).min(n);
                            ms[b] = quant::quantize_m(&fm[u][lo..hi], &mut cm[lo..hi]);
                            vs[b] = quant::quantize_v(&mut fv[u][lo..hi].to_vec(), &mut cv[lo..hi]);
                        }
                    }
                    w
                }
            };
            assert_eq!(s, &want, "{bits:?} unit {u}");
        }
    }
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
    let mut m = Moments::new(StateBits::Q8, 300);
    let mut b = m.buffers(0, 0);
    b.exp_avg_scale = 0;
    // SAFETY: refused before any access.
    let r = unsafe { st.import(&[b], Form::Stored) };
    assert!(
        matches!(&r, Err(Error::Invalid(m)) if m.contains("missing")),
        "{r:?}"
    );
}
