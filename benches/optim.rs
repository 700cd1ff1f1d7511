//! AdamW benches, sizes in the names; `cargo bench --bench optim`.
//!
//! - `adamw_host_16M/*`: one step of the host tier over 16M parameters (rayon, all cores):
//!   fp32 in place (28 bytes of traffic per parameter) and bf16 with an fp32 master (30), next
//!   to `memcpy_2x` (two threads copying the same number of bytes the fp32 step moves, i.e.
//!   the memory bus's roofline for it), measured in the same run; and low-bit state
//!   (`state_bits=16` / `8`): fp32 parameters in place with 8-bit moments (16 bytes), bf16
//!   parameters with an fp32 master and 8-bit or bf16 moments (18 / 22), bf16 parameters
//!   without a master and 8-bit moments (10). Throughput is in parameters.
//! - `adamw_nvme_4M/*`: one step of the NVMe tier over 4M fp32 parameters (32 MiB of state
//!   read and written, 8 MiB chunks through 16 buffers) next to writing and reading those bytes
//!   through the same swap engine (`swap_write_read`): the bar is step ≤ 1.2 × that.
//!
//! SPILLOVER_BENCH_DIR picks the swap directory (default: the temp dir).

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use spillover_core::io::{IoOptions, Swap};
use spillover_core::optim::{AdamState, Dtype, Hyper, Options, Ptr, StateBits, Tier, UnitStep};
use spillover_core::pool::{Pool, PoolOptions};
use std::hint::black_box;
use std::sync::Arc;
use std::time::Duration;

fn pool(capacity: u64) -> Pool {
    let mut o = PoolOptions::new(capacity);
    o.lock = false;
    Pool::new(&o).unwrap()
}

fn hyper(step: f64) -> Hyper {
    Hyper {
        lr: 1e-3,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay: 1e-2,
        step,
        grad_scale: 1.0,
    }
}

/// `units` parameters of `per` elements each, their state in `tier`.
struct Setup {
    state: AdamState,
    params: Vec<Vec<u8>>,
    grads: Vec<Vec<u8>>,
    dtype: Dtype,
    step: f64,
}

impl Setup {
    fn new(pool: &Pool, units: usize, per: usize, dtype: Dtype, tier: Tier, chunk: usize) -> Self {
        Setup::with(pool, units, per, dtype, tier, chunk, StateBits::F32, true)
    }

    /// `master`: keep an fp32 master for bf16 parameters.
    #[allow(clippy::too_many_arguments)]
    fn with(
        pool: &Pool,
        units: usize,
        per: usize,
        dtype: Dtype,
        tier: Tier,
        chunk: usize,
        bits: StateBits,
        master: bool,
    ) -> Self {
        let opts = Options {
            master: dtype == Dtype::Bf16 && master,
            bits,
            seed: 0,
            chunk_elems: chunk,
            task_elems: 1 << 23,
            tier,
        };
        let state = AdamState::new(pool, &vec![per; units], &opts).unwrap();
        let bytes = per * dtype.size();
        let fill = |v: u8| (0..units).map(|_| vec![v; bytes]).collect::<Vec<_>>();
        Setup {
            state,
            params: fill(0x3c),
            grads: fill(0x3a),
            dtype,
            step: 0.0,
        }
    }

    fn step(&mut self) {
        self.step += 1.0;
        let work: Vec<UnitStep> = self
            .params
            .iter_mut()
            .zip(&self.grads)
            .enumerate()
            .map(|(u, (p, g))| UnitStep {
                unit: u,
                grad: Ptr::new(g.as_ptr() as usize, self.dtype),
                src: Ptr::new(p.as_mut_ptr() as usize, self.dtype),
                out: Ptr::new(p.as_mut_ptr() as usize, self.dtype),
                hyper: hyper(self.step),
                tail: 0,
                predict: false,
                coef: Ptr::new(0, Dtype::F32),
                key: 0,
            })
            .collect();
        // SAFETY: every address is a live Vec of the unit's length and dtype, not otherwise
        // used during the call.
        unsafe { self.state.step(&work) }.unwrap();
    }
}

fn host(c: &mut Criterion) {
    const N: usize = 16 << 20;
    let p = pool(512 << 20);
    let mut g = c.benchmark_group("adamw_host_16M");
    g.sample_size(20);
    g.measurement_time(Duration::from_secs(8));
    g.throughput(Throughput::Elements(N as u64));
    let mut f32s = Setup::new(
        &p,
        16,
        N / 16,
        Dtype::F32,
        Tier::Host { allow_heap: false },
        1 << 22,
    );
    f32s.step();
    g.bench_function("f32_in_place", |b| b.iter(|| f32s.step()));
    drop(f32s);
    let mut bf16 = Setup::new(
        &p,
        16,
        N / 16,
        Dtype::Bf16,
        Tier::Host { allow_heap: false },
        1 << 22,
    );
    bf16.step();
    g.bench_function("bf16_master", |b| b.iter(|| bf16.step()));
    drop(bf16);
    let host = || Tier::Host { allow_heap: false };
    for (name, dtype, bits, master) in [
        ("f32_in_place_q8", Dtype::F32, StateBits::Q8, true),
        ("bf16_master_q8", Dtype::Bf16, StateBits::Q8, true),
        ("bf16_master_bf16", Dtype::Bf16, StateBits::Bf16, true),
        ("bf16_no_master_q8", Dtype::Bf16, StateBits::Q8, false),
    ] {
        let mut s = Setup::with(&p, 16, N / 16, dtype, host(), 1 << 22, bits, master);
        s.step();
        g.bench_function(name, |b| b.iter(|| s.step()));
    }
    // The roofline: 28 bytes per parameter copied as 14 read + 14 written, on every core.
    let half = 14 * N / 2;
    let src = vec![1u8; 2 * half];
    let mut dst = vec![0u8; 2 * half];
    g.bench_function("memcpy_2x", |b| {
        b.iter(|| {
            rayon::scope(|s| {
                for (d, sr) in dst.chunks_mut(half / 8).zip(src.chunks(half / 8)) {
                    s.spawn(move |_| d.copy_from_slice(black_box(sr)));
                }
            })
        })
    });
    g.finish();
}

fn nvme(c: &mut Criterion) {
    const N: usize = 4 << 20;
    let dir = match std::env::var_os("SPILLOVER_BENCH_DIR") {
        Some(d) => tempfile::tempdir_in(d).unwrap(),
        None => tempfile::tempdir().unwrap(),
    };
    let p = pool(128 << 20);
    let mut io = IoOptions::new([dir.path()]);
    io.allow_buffered = true;
    let chunk = 1 << 20; // 8 MiB of state per chunk (the Python default)
    let mut g = c.benchmark_group("adamw_nvme_4M");
    g.sample_size(10);
    g.measurement_time(Duration::from_secs(8));
    g.throughput(Throughput::Bytes(2 * 8 * N as u64)); // state bytes read + written

    // One engine for both benches, as in a process (the optimizer shares the tier's swap).
    let swap = Arc::new(Swap::open(&io, &p).unwrap());
    let tier = Tier::Nvme {
        swap: swap.clone(),
        buffers: 16,
    };
    let mut s = Setup::new(&p, 8, N / 8, Dtype::F32, tier, chunk);
    s.step();
    g.bench_function("step", |b| b.iter(|| s.step()));
    drop(s);
    // The engine alone: write then read the same 32 MiB in 8 MiB requests, 4 in flight.
    let slots: Vec<_> = (0..4).map(|_| swap.alloc(8 << 20).unwrap()).collect();
    g.bench_function("swap_write_read", |b| {
        b.iter(|| {
            let blocks: Vec<_> = (0..4).map(|_| p.lease(8 << 20).unwrap()).collect();
            let tickets: Vec<_> = blocks
                .into_iter()
                .zip(&slots)
                .map(|(b, s)| swap.write(b, s))
                .collect();
            let blocks: Vec<_> = tickets.into_iter().map(|t| t.wait().0).collect();
            let tickets: Vec<_> = blocks
                .into_iter()
                .zip(&slots)
                .map(|(b, s)| swap.read(s, b))
                .collect();
            for t in tickets {
                t.wait().1.unwrap();
            }
        })
    });
    g.finish();
}

criterion_group!(benches, host, nvme);
criterion_main!(benches);
