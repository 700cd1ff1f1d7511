//! Low-bit optimizer state through the public API: the step over bf16 and 8-bit state, and
//! over bf16 parameters without a master, against a scalar reference written out here; host
//! and NVMe tiers, chunk and task sizes bit for bit; stored and f32 export/import. The codes
//! themselves: tests/optim_quant.rs; bytes, NaN, refusals: tests/optim_lowbit_edges.rs.

use spillover_core::optim::quant::{self, Stream};
use spillover_core::optim::{
    bf16_to_f32, f32_to_bf16, AdamState, Dtype, Form, Hyper, StateBits, UnitBuffers, BLOCK,
};

mod common;
use common::adam::*;
use common::pool;

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
