//! Pool benches: lease+return latency (target ≤ 1 µs median) and copy bandwidth into a leased
//! block next to a plain memcpy between two pre-faulted buffers, measured in the same run.
//! Sizes are in the names. `cargo bench --bench pool`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use spillover_core::pool::{Pool, PoolOptions};
use std::hint::black_box;

fn lease_return(c: &mut Criterion) {
    let mut opts = PoolOptions::new(256 << 20);
    opts.lock = false;
    let pool = Pool::new(&opts).unwrap();
    // Some live blocks so the free lists are not trivially one extent.
    let _held: Vec<_> = (0..64)
        .map(|i| pool.lease(4096 * (1 + i % 7)).unwrap())
        .collect();
    let mut g = c.benchmark_group("lease_return");
    for size in [4 << 10, 1 << 20, 16 << 20] {
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, &s| {
            b.iter(|| drop(black_box(pool.lease(s).unwrap())))
        });
    }
    g.finish();
}

fn copy_bandwidth(c: &mut Criterion) {
    const N: usize = 64 << 20;
    let mut opts = PoolOptions::new(2 * N as u64);
    opts.lock = false;
    let pool = Pool::new(&opts).unwrap();
    let src = vec![7u8; N];
    let mut dst = vec![1u8; N];
    let block = pool.lease(N as u64).unwrap();
    let mut g = c.benchmark_group("copy_64MiB");
    g.throughput(Throughput::Bytes(N as u64));
    g.sample_size(30);
    g.bench_function("memcpy_vec_to_vec", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)))
    });
    g.bench_function("into_block", |b| {
        // SAFETY: `src` is N readable bytes, disjoint from the block; nothing else writes it.
        b.iter(|| unsafe { block.copy_from_raw(black_box(src.as_ptr()), N, 0) }.unwrap())
    });
    g.finish();
}

criterion_group!(benches, lease_return, copy_bandwidth);
criterion_main!(benches);
