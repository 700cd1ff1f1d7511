//! The CPU AdamW through its public API: the kernel against a scalar reference (every run
//! shape, both dtypes, tails), host and NVMe tiers bit-identical whatever the chunk size,
//! export/import round trips across tiers, the NVMe pipeline's pool use and I/O errors, states
//! sharing one swap, and the checks that refuse bad work lists.

use std::sync::Arc;

use proptest::prelude::*;
use spillover_core::io::{EngineChoice, FaultKind, IoOptions, Swap};
use spillover_core::optim::kernel::{self, Run};
use spillover_core::optim::{
    bf16_to_f32, f32_to_bf16, fma_available, AdamState, Bf16, Dtype, Form, Hyper, Options, Ptr,
    StateBits, Tier, UnitBuffers, UnitStep,
};
use spillover_core::pool::Pool;

mod common;
use common::pool;
use spillover_core::Error;

/// A small deterministic generator (xorshift), values roughly N(0, 1)-sized.
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

/// The update written out once, element by element (Note [torch rounding]).
fn reference(p: f32, g: f32, m: &mut f32, v: &mut f32, h: &Hyper, tail: bool) -> f32 {
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

#[test]
fn kernel_matches_the_scalar_reference_for_every_run_shape() {
    let mut rng = Rng(7);
    for n in [0usize, 1, 15, 16, 17, 100, 1000] {
        for (tail, h) in [(false, hyper(3.0)), (true, hyper(1.0))] {
            let h = Hyper {
                beta1: if n % 2 == 0 { 0.9 } else { 0.3 }, // both lerp forms
                ..h
            };
            let k = h.coeffs();
            let (p0, g, m0) = (rng.vec(n), rng.vec(n), rng.vec(n));
            let v0: Vec<f32> = rng.vec(n).iter().map(|x| x * x).collect();
            let mut want_p = p0.clone();
            let (mut want_m, mut want_v) = (m0.clone(), v0.clone());
            for i in 0..n {
                want_p[i] = reference(p0[i], g[i], &mut want_m[i], &mut want_v[i], &h, tail);
            }
            let apply = |run: Run<'_, f32, f32>, m: &mut [f32], v: &mut [f32]| {
                if tail {
                    kernel::apply_tail(run, m, v, &k)
                } else {
                    kernel::apply(run, m, v, &k)
                }
            };
            // In place.
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            apply(
                Run::InPlace {
                    param: &mut p,
                    grad: &g,
                },
                &mut m,
                &mut v,
            );
            assert_eq!((&p, &m, &v), (&want_p, &want_m, &want_v), "in place, n={n}");
            // Master with an f32 output, and copy.
            let (mut mst, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut out = vec![0f32; n];
            let run = Run::Master {
                master: &mut mst,
                grad: &g,
                out: &mut out,
            };
            apply(run, &mut m, &mut v);
            assert_eq!(
                (&mst, &out, &m),
                (&want_p, &want_p, &want_m),
                "master, n={n}"
            );
            let (mut m, mut v) = (m0.clone(), v0.clone());
            let mut out = vec![0f32; n];
            let run = Run::Copy {
                src: &p0,
                grad: &g,
                out: &mut out,
            };
            apply(run, &mut m, &mut v);
            assert_eq!((&out, &v), (&want_p, &want_v), "copy, n={n}");
        }
    }
}

#[test]
fn bf16_gradients_and_parameters() {
    let mut rng = Rng(9);
    let n = 333;
    let h = hyper(2.0);
    let k = h.coeffs();
    let g: Vec<Bf16> = rng
        .vec(n)
        .into_iter()
        .map(|x| Bf16(f32_to_bf16(x)))
        .collect();
    let mut master = rng.vec(n);
    let (mut m, mut v) = (rng.vec(n), vec![0.25f32; n]);
    let (mut wm, mut wv, mut wp) = (m.clone(), v.clone(), master.clone());
    for i in 0..n {
        wp[i] = reference(
            wp[i],
            bf16_to_f32(g[i].0),
            &mut wm[i],
            &mut wv[i],
            &h,
            false,
        );
    }
    let mut out = vec![Bf16(0); n];
    let run = Run::Master {
        master: &mut master,
        grad: &g,
        out: &mut out,
    };
    kernel::apply(run, &mut m, &mut v, &k);
    assert_eq!(master, wp);
    for i in 0..n {
        assert_eq!(out[i].0, f32_to_bf16(wp[i]));
    }
}

proptest! {
    /// Round to nearest, ties to even, as torch: the result is a closest bf16, and on a tie
    /// the even one.
    #[test]
    fn bf16_rounds_to_nearest_even(bits in any::<u32>()) {
        let x = f32::from_bits(bits);
        prop_assume!(x.is_finite());
        let b = f32_to_bf16(x);
        let lo = f32::from_bits(bits & 0xffff_0000);
        let y = bf16_to_f32(b);
        if lo == x {
            prop_assert_eq!(y, x);
        } else if y.is_finite() {
            let hi_bits = (bits & 0xffff_0000).wrapping_add(0x1_0000);
            let other = if y.to_bits() == lo.to_bits() { f32::from_bits(hi_bits) } else { lo };
            let (dy, dother) = ((x as f64 - y as f64).abs(), (x as f64 - other as f64).abs());
            prop_assert!(dy <= dother, "{x} -> {y}, but {other} is closer");
            if dy == dother {
                prop_assert_eq!(b & 1, 0);
            }
        }
    }
}

/// A model of several parameters whose state straddles chunks, trained for a few steps.
struct Model {
    lens: Vec<usize>,
    params: Vec<Vec<f32>>,
}

impl Model {
    fn new() -> Model {
        let lens = vec![1000, 7, 4099, 1, 256, 2000];
        let mut rng = Rng(3);
        let params = lens.iter().map(|&n| rng.vec(n)).collect();
        Model { lens, params }
    }

    fn grads(&self, step: u64) -> Vec<Vec<f32>> {
        let mut rng = Rng(100 + step);
        self.lens.iter().map(|&n| rng.vec(n)).collect()
    }

    /// `steps` steps; every third step parameter 1 has no gradient (skipped, as in torch).
    fn train(&mut self, st: &mut AdamState, steps: std::ops::Range<u64>, counts: &mut [u64]) {
        for s in steps {
            let grads = self.grads(s);
            let mut work = Vec::new();
            for (u, (p, g)) in self.params.iter_mut().zip(&grads).enumerate() {
                if u == 1 && s % 3 == 0 {
                    continue;
                }
                counts[u] += 1;
                let addr = p.as_mut_ptr() as usize;
                work.push(UnitStep {
                    unit: u,
                    grad: Ptr::new(g.as_ptr() as usize, Dtype::F32),
                    src: Ptr::new(addr, Dtype::F32),
                    out: Ptr::new(addr, Dtype::F32),
                    hyper: hyper(counts[u] as f64),
                    tail: p.len() % 8,
                    predict: false,
                    coef: Ptr::new(0, Dtype::F32),
                    key: 0,
                });
            }
            // SAFETY: every address is a live Vec of the unit's length, not otherwise used.
            unsafe { st.step(&work) }.unwrap();
        }
    }

    fn export(&self, st: &mut AdamState) -> Vec<(Vec<f32>, Vec<f32>)> {
        let mut out: Vec<(Vec<f32>, Vec<f32>)> = self
            .lens
            .iter()
            .map(|&n| (vec![0.0; n], vec![0.0; n]))
            .collect();
        let bufs: Vec<UnitBuffers> = out
            .iter_mut()
            .enumerate()
            .map(|(u, (m, v))| UnitBuffers {
                unit: u,
                master: 0,
                exp_avg: m.as_mut_ptr() as usize,
                exp_avg_sq: v.as_mut_ptr() as usize,
                exp_avg_scale: 0,
                exp_avg_sq_scale: 0,
            })
            .collect();
        // SAFETY: the buffers are live Vecs of each unit's length.
        unsafe { st.export(&bufs, Form::Stored) }.unwrap();
        out
    }
}

fn host(pool: &Pool, lens: &[usize], chunk_elems: usize) -> AdamState {
    let opts = Options {
        master: false,
        bits: StateBits::F32,
        seed: 0,
        chunk_elems,
        task_elems: 512,
        tier: Tier::Host { allow_heap: false },
    };
    AdamState::new(pool, lens, &opts).unwrap()
}

fn open_swap(pool: &Pool, engine: EngineChoice) -> Arc<Swap> {
    let dir = tempfile::tempdir().unwrap();
    let mut io = IoOptions::new([dir.path()]);
    io.engine = engine;
    io.allow_buffered = true;
    io.block_bytes = 64 << 10;
    // The swap file is unlinked at open, so the directory may go now.
    Arc::new(Swap::open(&io, pool).unwrap())
}

fn nvme_in(pool: &Pool, swap: &Arc<Swap>, lens: &[usize], chunk_elems: usize) -> AdamState {
    let opts = Options {
        master: false,
        bits: StateBits::F32,
        seed: 0,
        chunk_elems,
        task_elems: 512,
        tier: Tier::Nvme {
            swap: swap.clone(),
            buffers: 3,
        },
    };
    AdamState::new(pool, lens, &opts).unwrap()
}

fn nvme(pool: &Pool, lens: &[usize], chunk_elems: usize, engine: EngineChoice) -> AdamState {
    nvme_in(pool, &open_swap(pool, engine), lens, chunk_elems)
}

#[test]
fn host_and_nvme_tiers_agree_bitwise_for_any_chunk_size() {
    let p = pool(64 << 20);
    let mut reference = Model::new();
    let lens = reference.lens.clone();
    let mut counts = vec![0; lens.len()];
    let mut st = host(&p, &lens, 1 << 16);
    reference.train(&mut st, 0..6, &mut counts);
    let want_state = reference.export(&mut st);
    let engines = [EngineChoice::Threads, EngineChoice::Auto];
    for (tier, chunk) in [("host", 1024), ("host", 16), ("nvme", 1024), ("nvme", 3072)] {
        for engine in engines.iter().take(if tier == "nvme" { 2 } else { 1 }) {
            let mut m = Model::new();
            let mut counts = vec![0; lens.len()];
            let mut st = match tier {
                "host" => host(&p, &lens, chunk),
                _ => nvme(&p, &lens, chunk, *engine),
            };
            let in_use = p.stats().in_use;
            m.train(&mut st, 0..6, &mut counts);
            assert_eq!(m.params, reference.params, "{tier} chunk {chunk}");
            assert_eq!(m.export(&mut st), want_state, "{tier} chunk {chunk}");
            assert_eq!(st.stats().steps, 6);
            if tier == "nvme" {
                // Between steps the NVMe tier holds no pool memory.
                assert_eq!(p.stats().in_use, in_use);
                let s = st.stats();
                // Every chunk written each step, read each step but the first, and by the export.
                assert_eq!(s.bytes_written, s.bytes_read);
                assert!(s.bytes_written >= 6 * s.state_bytes);
            }
        }
    }
}

#[test]
fn export_then_import_into_the_other_tier_resumes_exactly() {
    let p = pool(64 << 20);
    let mut a = Model::new();
    let lens = a.lens.clone();
    let mut counts = vec![0; lens.len()];
    let mut sa = host(&p, &lens, 2048);
    a.train(&mut sa, 0..3, &mut counts);
    let saved = a.export(&mut sa);

    let mut b = Model {
        lens: lens.clone(),
        params: a.params.clone(),
    };
    let mut sb = nvme(&p, &lens, 1024, EngineChoice::Threads);
    assert!(!sb.is_initialized(0));
    let bufs: Vec<UnitBuffers> = saved
        .iter()
        .enumerate()
        .map(|(u, (m, v))| UnitBuffers {
            unit: u,
            master: 0,
            exp_avg: m.as_ptr() as usize,
            exp_avg_sq: v.as_ptr() as usize,
            exp_avg_scale: 0,
            exp_avg_sq_scale: 0,
        })
        .collect();
    // SAFETY: live Vecs of each unit's length, only read.
    unsafe { sb.import(&bufs, Form::Stored) }.unwrap();
    assert!(sb.is_initialized(0));
    let mut counts_b = counts.clone();
    a.train(&mut sa, 3..6, &mut counts);
    b.train(&mut sb, 3..6, &mut counts_b);
    assert_eq!(a.params, b.params);
    assert_eq!(a.export(&mut sa), b.export(&mut sb));
}

#[test]
fn master_state_starts_from_bf16_parameters_and_writes_them_back() {
    let p = pool(16 << 20);
    let n = 1234;
    let opts = Options {
        master: true,
        bits: StateBits::F32,
        seed: 0,
        chunk_elems: 512,
        task_elems: 100,
        tier: Tier::Host { allow_heap: true },
    };
    let mut st = AdamState::new(&p, &[n], &opts).unwrap();
    let mut rng = Rng(5);
    let mut param: Vec<u16> = rng.vec(n).into_iter().map(f32_to_bf16).collect();
    let mut master: Vec<f32> = param.iter().map(|&b| bf16_to_f32(b)).collect();
    let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
    for s in 1..=4u64 {
        let g: Vec<u16> = rng.vec(n).into_iter().map(f32_to_bf16).collect();
        for i in 0..n {
            let tail = i >= n - n % 8;
            master[i] = reference(
                master[i],
                bf16_to_f32(g[i]),
                &mut m[i],
                &mut v[i],
                &hyper(s as f64),
                tail,
            );
        }
        let work = [UnitStep {
            unit: 0,
            grad: Ptr::new(g.as_ptr() as usize, Dtype::Bf16),
            src: Ptr::new(param.as_ptr() as usize, Dtype::Bf16),
            out: Ptr::new(param.as_mut_ptr() as usize, Dtype::Bf16),
            hyper: hyper(s as f64),
            tail: n % 8,
            predict: false,
            coef: Ptr::new(0, Dtype::F32),
            key: 0,
        }];
        // SAFETY: live Vecs of the unit's length.
        unsafe { st.step(&work) }.unwrap();
        let want: Vec<u16> = master.iter().map(|&x| f32_to_bf16(x)).collect();
        assert_eq!(param, want, "step {s}");
    }
    let (mut em, mut ev, mut emst) = (vec![0f32; n], vec![0f32; n], vec![0f32; n]);
    let bufs = [UnitBuffers {
        unit: 0,
        master: emst.as_mut_ptr() as usize,
        exp_avg: em.as_mut_ptr() as usize,
        exp_avg_sq: ev.as_mut_ptr() as usize,
        exp_avg_scale: 0,
        exp_avg_sq_scale: 0,
    }];
    // SAFETY: live Vecs of the unit's length.
    unsafe { st.export(&bufs, Form::Stored) }.unwrap();
    assert_eq!((emst, em, ev), (master, m, v));
}

fn one_step(st: &mut AdamState, work: &[UnitStep]) -> Result<(), Error> {
    // SAFETY: the tests below pass live buffers of the right length (or ones the checks
    // refuse before any access).
    unsafe { st.step(work) }
}

#[test]
fn bad_work_lists_are_refused_before_anything_is_written() {
    let p = pool(16 << 20);
    let mut st = host(&p, &[64, 64], 1024);
    let mut a = vec![1f32; 64];
    let mut b = vec![1f32; 128];
    let g = vec![0.5f32; 128];
    let unit = |u: usize, grad: usize, out: usize| UnitStep {
        unit: u,
        grad: Ptr::new(grad, Dtype::F32),
        src: Ptr::new(out, Dtype::F32),
        out: Ptr::new(out, Dtype::F32),
        hyper: hyper(1.0),
        tail: 0,
        predict: false,
        coef: Ptr::new(0, Dtype::F32),
        key: 0,
    };
    let (ga, pa, pb) = (
        g.as_ptr() as usize,
        a.as_mut_ptr() as usize,
        b.as_mut_ptr() as usize,
    );
    let msg = |r: Result<(), Error>| match r {
        Err(Error::Invalid(m)) => m,
        other => panic!("expected Invalid, got {other:?}"),
    };
    assert!(msg(one_step(&mut st, &[unit(2, ga, pa)])).contains("out of range"));
    assert!(msg(one_step(&mut st, &[unit(0, ga, pa), unit(0, ga, pb)])).contains("twice"));
    let m = msg(one_step(&mut st, &[unit(0, ga, pb), unit(1, ga, pb + 128)]));
    assert!(m.contains("overlapping"), "{m}");
    assert!(msg(one_step(&mut st, &[unit(0, pa, pa)])).contains("gradient and output"));
    let mut bad = unit(0, ga, pa);
    bad.hyper.lr = f64::NAN;
    assert!(msg(one_step(&mut st, &[bad])).contains("learning rate"));
    bad = unit(0, ga, pa);
    bad.out.dtype = Dtype::Bf16;
    assert!(msg(one_step(&mut st, &[bad])).contains("in one dtype"));
    bad.src.dtype = Dtype::Bf16;
    bad.out = Ptr::new(pb, Dtype::Bf16);
    assert!(msg(one_step(&mut st, &[bad])).contains("updated in place"));
    assert_eq!(a, vec![1f32; 64], "nothing was written");
    assert!(!st.is_initialized(0));
    // Export of a unit that never took a step.
    let mut m = vec![0f32; 64];
    let bufs = [UnitBuffers {
        unit: 0,
        master: 0,
        exp_avg: m.as_mut_ptr() as usize,
        exp_avg_sq: m.as_mut_ptr() as usize,
        exp_avg_scale: 0,
        exp_avg_sq_scale: 0,
    }];
    // SAFETY: refused before any access.
    let r = unsafe { st.export(&bufs, Form::Stored) };
    assert!(msg(r).contains("no state yet"));

    // A master state needs the parameter's value on a unit's first step.
    let opts = Options {
        master: true,
        bits: StateBits::F32,
        seed: 0,
        chunk_elems: 1024,
        task_elems: 512,
        tier: Tier::Host { allow_heap: true },
    };
    let mut st = AdamState::new(&p, &[64], &opts).unwrap();
    let mut w = unit(0, ga, pa);
    w.src = Ptr::NONE;
    assert!(msg(one_step(&mut st, &[w])).contains("source address"));
    // A coefficient buffer (Note [next-gradient prediction]) goes only with a predicted
    // output, in bf16, apart from it and from the gradient.
    let mut c = vec![0u16; 64];
    let mut w = unit(0, ga, pa);
    w.coef = Ptr::new(c.as_mut_ptr() as usize, Dtype::Bf16);
    assert!(msg(one_step(&mut st, &[w])).contains("goes with a predicted output"));
    w.predict = true;
    w.coef.dtype = Dtype::F32;
    assert!(msg(one_step(&mut st, &[w])).contains("in bf16"));
    w.coef = Ptr::new(pa + 4, Dtype::Bf16);
    assert!(msg(one_step(&mut st, &[w])).contains("overlapping"));
    w.coef = Ptr::new(ga, Dtype::Bf16);
    assert!(msg(one_step(&mut st, &[w])).contains("gradient and coefficient"));
    assert_eq!(a, vec![1f32; 64], "nothing was written");
    assert_eq!(c, vec![0u16; 64], "nothing was written");
    assert!(AdamState::new(
        &p,
        &[1],
        &Options {
            chunk_elems: 10,
            ..opts
        }
    )
    .is_err());
}

#[test]
fn nvme_errors_surface_and_a_small_pool_is_named() {
    let p = pool(8 << 20);
    let lens = [3000usize, 5000];
    let mut st = nvme(&p, &lens, 1024, EngineChoice::Threads);
    let mut params: Vec<Vec<f32>> = lens.iter().map(|&n| vec![1.0; n]).collect();
    let g: Vec<Vec<f32>> = lens.iter().map(|&n| vec![0.1; n]).collect();
    let mut work = |step: f64| -> Vec<UnitStep> {
        params
            .iter_mut()
            .zip(&g)
            .enumerate()
            .map(|(u, (p, g))| UnitStep {
                unit: u,
                grad: Ptr::new(g.as_ptr() as usize, Dtype::F32),
                src: Ptr::new(p.as_mut_ptr() as usize, Dtype::F32),
                out: Ptr::new(p.as_mut_ptr() as usize, Dtype::F32),
                hyper: hyper(step),
                tail: 0,
                predict: false,
                coef: Ptr::new(0, Dtype::F32),
                key: 0,
            })
            .collect()
    };
    one_step(&mut st, &work(1.0)).unwrap();
    st.inject_fault(FaultKind::Read, libc_eio(), 1).unwrap();
    match one_step(&mut st, &work(2.0)) {
        Err(Error::Io { op: "read", .. }) => {}
        other => panic!("expected a read error, got {other:?}"),
    }
    // The pipeline's blocks come back to the pool even after an error.
    st.inject_fault(FaultKind::Read, 0, 0).unwrap();
    let mut tries = 0;
    while p.stats().in_use != 0 && tries < 100 {
        std::thread::sleep(std::time::Duration::from_millis(10));
        tries += 1;
    }
    assert_eq!(p.stats().in_use, 0);

    // Chunks larger than the pool: a clear error, not a hang.
    let tiny = pool(32 << 10);
    let mut st = nvme(&tiny, &lens, 8192, EngineChoice::Threads);
    let e = one_step(&mut st, &work(1.0)).unwrap_err();
    assert!(e.to_string().contains("SPILLOVER_HOST_POOL_BYTES"), "{e}");
}

#[test]
fn states_share_one_swap_and_give_their_slots_back_when_dropped() {
    let p = pool(16 << 20);
    let swap = open_swap(&p, EngineChoice::Threads);
    let mut a = Model::new();
    let lens = a.lens.clone();
    let mut b = Model {
        lens: lens.clone(),
        params: a.params.clone(),
    };
    let mut sa = nvme_in(&p, &swap, &lens, 1024);
    let one = swap.stats().swap_in_use;
    assert!(one > 0);
    let mut sb = nvme_in(&p, &swap, &lens, 1024);
    assert_eq!(swap.stats().swap_in_use, 2 * one);
    // Interleaved steps on one engine: each state reads back only what it wrote.
    let (mut ca, mut cb) = (vec![0; lens.len()], vec![0; lens.len()]);
    for s in 0..4 {
        a.train(&mut sa, s..s + 1, &mut ca);
        b.train(&mut sb, s..s + 1, &mut cb);
    }
    assert_eq!(a.params, b.params);
    assert_eq!(a.export(&mut sa), b.export(&mut sb));
    assert_eq!(sa.swap_info(), sb.swap_info());
    drop(sa);
    assert_eq!(swap.stats().swap_in_use, one);
    drop(sb);
    assert_eq!(swap.stats().swap_in_use, 0);
    assert_eq!(p.stats().in_use, 0);
    assert_eq!(Arc::strong_count(&swap), 1);
}

fn libc_eio() -> i32 {
    5
}
