//! The swap engine, through both backends: bitwise round trips, striping, parked blocks,
//! injected faults, out of space, and the directory checks.
//!
//! io_uring tests probe first and, where io_uring is refused, print why and return. Set
//! SPILLOVER_TEST_DIR to run against another file system than the temp dir.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use spillover_core::io::{EngineChoice, FaultKind, IoOptions, Swap};
use spillover_core::pool::{Block, Pool};

mod common;
use common::pool;
use spillover_core::Error;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

fn tempdir() -> tempfile::TempDir {
    match std::env::var_os("SPILLOVER_TEST_DIR") {
        Some(d) => tempfile::tempdir_in(d).unwrap(),
        None => tempfile::tempdir().unwrap(),
    }
}

/// Open a swap on `dirs`; `None` (with the reason printed) when io_uring was asked for and is
/// unavailable here.
fn open(
    engine: EngineChoice,
    dirs: &[&Path],
    pool: &Pool,
    tweak: impl FnOnce(&mut IoOptions),
) -> Option<Swap> {
    let mut o = IoOptions::new(dirs.iter().map(|d| d.to_path_buf()));
    o.engine = engine;
    o.allow_buffered = true;
    tweak(&mut o);
    match Swap::open(&o, pool) {
        Ok(s) => {
            match engine {
                EngineChoice::Threads => assert_eq!(s.engine_name(), "threads"),
                EngineChoice::IoUring => assert_eq!(s.engine_name(), "io_uring"),
                EngineChoice::Auto => {}
            }
            if let Some(w) = s.warning() {
                eprintln!("{w}");
            }
            Some(s)
        }
        Err(Error::Invalid(m)) if engine == EngineChoice::IoUring && m.contains("io_uring") => {
            eprintln!("skipping: {m}");
            None
        }
        Err(e) => panic!("Swap::open failed: {e}"),
    }
}

/// splitmix64: deterministic bytes without a rand dependency.
fn fill(block: &mut Block, seed: u64) {
    let mut x = seed;
    for chunk in block.as_mut_slice().chunks_mut(8) {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let n = chunk.len();
        chunk.copy_from_slice(&z.to_le_bytes()[..n]);
    }
}

fn leased(pool: &Pool, len: u64, seed: u64) -> Block {
    let mut b = pool.lease(len).unwrap();
    fill(&mut b, seed);
    b
}

/// A test body per engine: `fn name_threads()` and `fn name_io_uring()`.
macro_rules! both_engines {
    ($body:ident: $($name:ident => $engine:expr),+) => {
        $(#[test]
        fn $name() {
            $body($engine);
        })+
    };
}

const SIZES: &[u64] = &[
    1,
    100,
    4095,
    4096,
    4097,
    12_345,
    64 * KIB,
    MIB - 1,
    MIB,
    MIB + 4096,
    3 * MIB + 777,
    8 * MIB + 1,
];

/// Every size written, all at once (many requests in flight), then read back into fresh blocks,
/// all at once; bytes compared exactly. Once with 1 MiB chunks at depth 32, once with 64 KiB
/// chunks at depth 3 (requests queue behind each other and share the depth).
fn round_trip(engine: EngineChoice) {
    for (block_bytes, qd) in [(MIB, 32), (64 * KIB, 3)] {
        let dir = tempdir();
        let pool = pool(128 * MIB);
        let Some(swap) = open(engine, &[dir.path()], &pool, |o| {
            o.block_bytes = block_bytes;
            o.queue_depth = qd;
        }) else {
            return;
        };
        eprintln!("direct I/O: {}", swap.is_direct());
        let slots: Vec<_> = SIZES.iter().map(|&n| swap.alloc(n).unwrap()).collect();
        let tickets: Vec<_> = SIZES
            .iter()
            .zip(&slots)
            .enumerate()
            .map(|(i, (&n, s))| swap.write(leased(&pool, n, i as u64), s))
            .collect();
        for t in tickets {
            let (_, r) = t.wait();
            r.unwrap();
        }
        let tickets: Vec<_> = SIZES
            .iter()
            .zip(&slots)
            .map(|(&n, s)| swap.read(s, pool.lease(n).unwrap()))
            .collect();
        for (i, (t, &n)) in tickets.into_iter().zip(SIZES).enumerate() {
            let (got, r) = t.wait();
            r.unwrap();
            let want = leased(&pool, n, i as u64);
            assert!(got.as_slice() == want.as_slice(), "size {n}: bytes differ");
        }
        let st = swap.stats();
        assert_eq!(st.writes, SIZES.len() as u64);
        assert_eq!(st.reads, SIZES.len() as u64);
        assert_eq!(st.failed, 0);
        let total: u64 = SIZES.iter().map(|&n| n.div_ceil(4096) * 4096).sum();
        assert_eq!(st.bytes_written, total);
        assert_eq!(st.bytes_read, total);
        assert_eq!(st.swap_in_use, total);
        assert!(st.busy_seconds > 0.0);
        drop(slots);
        assert_eq!(swap.stats().swap_in_use, 0);
        assert_eq!(swap.stats().swap_peak, total);
        drop(swap);
        assert_eq!(pool.stats().live_blocks, 0);
    }
}
both_engines!(round_trip: round_trip_threads => EngineChoice::Threads,
                          round_trip_io_uring => EngineChoice::IoUring);

/// Two directories: a slot's 64 KiB pieces alternate between them, and data survives.
fn striping(engine: EngineChoice) {
    let (a, b) = (tempdir(), tempdir());
    let pool = pool(64 * MIB);
    let Some(swap) = open(engine, &[a.path(), b.path()], &pool, |o| {
        o.block_bytes = 64 * KIB
    }) else {
        return;
    };
    assert_eq!(swap.dirs().len(), 2);
    let slot = swap.alloc(MIB).unwrap();
    assert_eq!(slot.pieces().len(), 16);
    for (k, p) in slot.pieces().iter().enumerate() {
        assert_eq!(p.extent.len, 64 * KIB);
        assert_eq!(
            p.file as usize,
            k % 2,
            "pieces alternate between the directories"
        );
    }
    // The next slot continues the rotation instead of always starting on directory 0.
    let small = swap.alloc(4096).unwrap();
    assert_eq!(small.pieces()[0].file, 0);
    let small2 = swap.alloc(4096).unwrap();
    assert_eq!(small2.pieces()[0].file, 1);

    let (_, r) = swap.write(leased(&pool, MIB, 7), &slot).wait();
    r.unwrap();
    let (got, r) = swap.read(&slot, pool.lease(MIB).unwrap()).wait();
    r.unwrap();
    assert!(got.as_slice() == leased(&pool, MIB, 7).as_slice());
    // The swap files are anonymous: nothing is visible in either directory.
    for d in [a.path(), b.path()] {
        assert_eq!(std::fs::read_dir(d).unwrap().count(), 0, "{}", d.display());
    }
}
both_engines!(striping: striping_threads => EngineChoice::Threads,
                        striping_io_uring => EngineChoice::IoUring);

/// Note [parked blocks]: a ticket dropped while its I/O is in flight neither frees the block
/// early nor cancels the I/O; the block goes back to the pool at completion.
fn dropped_ticket(engine: EngineChoice) {
    let dir = tempdir();
    let pool = pool(128 * MIB);
    let Some(swap) = open(engine, &[dir.path()], &pool, |_| {}) else {
        return;
    };
    let n = 32 * MIB;
    let slot = swap.alloc(n).unwrap();
    drop(swap.write(leased(&pool, n, 42), &slot));
    eprintln!(
        "blocks live right after dropping the ticket: {}",
        pool.stats().live_blocks
    );
    swap.wait_idle();
    assert_eq!(pool.stats().live_blocks, 0, "the parked block went back");
    let (got, r) = swap.read(&slot, pool.lease(n).unwrap()).wait();
    r.unwrap();
    assert!(got.as_slice() == leased(&pool, n, 42).as_slice());
    drop(got);
    // A dropped read, and a dropped slot: both kept alive until the read completes.
    let t = swap.read(&slot, pool.lease(n).unwrap());
    drop(slot);
    drop(t);
    drop(swap); // waits for the read
    assert_eq!(pool.stats().live_blocks, 0);
}
both_engines!(dropped_ticket: dropped_ticket_threads => EngineChoice::Threads,
                              dropped_ticket_io_uring => EngineChoice::IoUring);

fn assert_io(r: Result<(), Error>, op: &str, errno: i32, dir: &Path) {
    match r {
        Err(Error::Io {
            op: o,
            path,
            offset,
            source,
        }) => {
            assert_eq!(o, op);
            assert_eq!(source.raw_os_error(), Some(errno));
            assert!(path.starts_with(dir.canonicalize().unwrap()), "{path:?}");
            assert_eq!(offset % 4096, 0);
        }
        other => panic!("expected an Io error for {op}, got {other:?}"),
    }
}

/// Injected EIO on a write and on a read surfaces as `Error::Io` with op and path, once per
/// request, the block comes back, and the next request succeeds. ENOSPC maps to OutOfSpace.
fn injected_faults(engine: EngineChoice) {
    let dir = tempdir();
    let pool = pool(64 * MIB);
    let Some(swap) = open(engine, &[dir.path()], &pool, |o| o.block_bytes = 256 * KIB) else {
        return;
    };
    let n = 4 * MIB; // 16 chunks: the failing one has others in flight beside it
    let slot = swap.alloc(n).unwrap();

    swap.inject_fault(FaultKind::Write, libc::EIO, 1);
    let (block, r) = swap.write(leased(&pool, n, 1), &slot).wait();
    assert_io(r, "write", libc::EIO, dir.path());
    let (block, r) = swap.write(block, &slot).wait();
    r.unwrap();
    drop(block);

    swap.inject_fault(FaultKind::Read, libc::EIO, 1);
    let (block, r) = swap.read(&slot, pool.lease(n).unwrap()).wait();
    assert_io(r, "read", libc::EIO, dir.path());
    let (block, r) = swap.read(&slot, block).wait();
    r.unwrap();
    assert!(block.as_slice() == leased(&pool, n, 1).as_slice());

    swap.inject_fault(FaultKind::Write, libc::ENOSPC, 1);
    let (block, r) = swap.write(block, &slot).wait();
    assert!(
        matches!(r, Err(Error::OutOfSpace { .. })),
        "ENOSPC on write: {r:?}"
    );
    drop(block);

    // Faults are consumed per chunk, whatever the request: three requests, three failures.
    swap.inject_fault(FaultKind::Read, libc::EIO, 3);
    for _ in 0..3 {
        let (_, r) = swap.read(&slot, pool.lease(4096).unwrap()).wait();
        assert_io(r, "read", libc::EIO, dir.path());
    }
    let (_, r) = swap.read(&slot, pool.lease(4096).unwrap()).wait();
    r.unwrap();
    let st = swap.stats();
    assert_eq!(st.failed, 6);
    assert_eq!(st.in_flight, 0);
    drop(swap);
    assert_eq!(pool.stats().live_blocks, 0);
}
both_engines!(injected_faults: injected_faults_threads => EngineChoice::Threads,
                               injected_faults_io_uring => EngineChoice::IoUring);

/// Short transfers are resubmitted for the rest, and the bytes still round-trip.
fn short_io(engine: EngineChoice) {
    let dir = tempdir();
    let pool = pool(64 * MIB);
    let Some(swap) = open(engine, &[dir.path()], &pool, |_| {}) else {
        return;
    };
    let n = 4 * MIB + 4096;
    let slot = swap.alloc(n).unwrap();
    swap.inject_fault(FaultKind::ShortIo, 0, 6);
    let (_, r) = swap.write(leased(&pool, n, 9), &slot).wait();
    r.unwrap();
    swap.inject_fault(FaultKind::ShortIo, 0, 6);
    let (got, r) = swap.read(&slot, pool.lease(n).unwrap()).wait();
    r.unwrap();
    assert!(got.as_slice() == leased(&pool, n, 9).as_slice());
    let st = swap.stats();
    assert!(st.short_resubmits >= 12, "{st:?}");
    assert_eq!(st.failed, 0);
}
both_engines!(short_io: short_io_threads => EngineChoice::Threads,
                        short_io_io_uring => EngineChoice::IoUring);

/// Many threads submitting at once.
fn concurrent_callers(engine: EngineChoice) {
    let dir = tempdir();
    let pool = pool(256 * MIB);
    let Some(swap) = open(engine, &[dir.path()], &pool, |o| o.queue_depth = 8) else {
        return;
    };
    let swap = Arc::new(swap);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let (swap, pool) = (swap.clone(), pool.clone());
            std::thread::spawn(move || {
                for i in 0..8u64 {
                    let n = (i + 1) * 512 * KIB + t * 4096 + 3;
                    let seed = t * 100 + i;
                    let slot = swap.alloc(n).unwrap();
                    let (_, r) = swap.write(leased(&pool, n, seed), &slot).wait();
                    r.unwrap();
                    let tk = swap.read(&slot, pool.lease(n).unwrap());
                    while !tk.wait_timeout(Duration::from_millis(1)) {}
                    assert!(tk.is_done());
                    let (got, r) = tk.wait();
                    r.unwrap();
                    assert!(got.as_slice() == leased(&pool, n, seed).as_slice());
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(swap.stats().writes, 32);
    assert_eq!(swap.stats().swap_in_use, 0);
}
both_engines!(concurrent_callers: concurrent_callers_threads => EngineChoice::Threads,
                                  concurrent_callers_io_uring => EngineChoice::IoUring);

/// A block from a pool whose arenas are not registered with the ring still works (plain
/// READ/WRITE instead of the fixed variants).
#[test]
fn unregistered_block() {
    let dir = tempdir();
    let registered = pool(16 * MIB);
    let other = pool(16 * MIB);
    let Some(swap) = open(EngineChoice::IoUring, &[dir.path()], &registered, |_| {}) else {
        return;
    };
    let slot = swap.alloc(3 * MIB).unwrap();
    let (_, r) = swap.write(leased(&other, 3 * MIB, 5), &slot).wait();
    r.unwrap();
    let (got, r) = swap.read(&slot, other.lease(3 * MIB).unwrap()).wait();
    r.unwrap();
    assert!(got.as_slice() == leased(&other, 3 * MIB, 5).as_slice());
}

#[test]
fn auto_engine_falls_back_with_one_warning() {
    let dir = tempdir();
    let pool = pool(8 * MIB);
    let swap = open(EngineChoice::Auto, &[dir.path()], &pool, |_| {}).unwrap();
    match swap.engine_name() {
        "io_uring" => {}
        "threads" => {
            let w = swap.warning().expect("a fallback says why");
            assert!(w.contains("io_uring is unavailable"), "{w}");
        }
        other => panic!("unknown engine {other}"),
    }
    assert_eq!(
        "io_uring".parse::<EngineChoice>().unwrap(),
        EngineChoice::IoUring
    );
    assert!("fast".parse::<EngineChoice>().is_err());
}

#[test]
fn misuse_is_reported_through_the_ticket() {
    let dir = tempdir();
    let pool = pool(16 * MIB);
    let swap = open(EngineChoice::Threads, &[dir.path()], &pool, |_| {}).unwrap();
    let other = open(EngineChoice::Threads, &[dir.path()], &pool, |_| {}).unwrap();
    let slot = swap.alloc(8192).unwrap();
    let (block, r) = swap.write(pool.lease(8193).unwrap(), &slot).wait();
    assert!(
        matches!(r, Err(Error::Invalid(ref m)) if m.contains("does not fit")),
        "{r:?}"
    );
    let (_, r) = other.write(block, &slot).wait();
    assert!(
        matches!(r, Err(Error::Invalid(ref m)) if m.contains("another")),
        "{r:?}"
    );
    assert!(matches!(swap.alloc(0), Err(Error::Invalid(_))));
}

/// The allocator's capacity (capacity_per_dir) runs out before the disk does.
#[test]
fn out_of_space_from_capacity() {
    let dir = tempdir();
    let pool = pool(8 * MIB);
    let swap = open(EngineChoice::Threads, &[dir.path()], &pool, |o| {
        o.capacity_per_dir = Some(MIB)
    })
    .unwrap();
    let a = swap.alloc(512 * KIB).unwrap();
    match swap.alloc(MIB) {
        Err(Error::OutOfSpace { path, need, free }) => {
            assert_eq!(need, MIB);
            assert_eq!(free, 512 * KIB);
            assert_eq!(path, dir.path().canonicalize().unwrap());
        }
        other => panic!("expected OutOfSpace, got {other:?}"),
    }
    drop(a);
    let b = swap.alloc(MIB).unwrap();
    assert_eq!(swap.stats().swap_in_use, MIB);
    assert_eq!(swap.stats().swap_capacity, MIB);
    drop(b);
}

/// A full file system: an 8 MiB tmpfs, with a larger virtual capacity, so fallocate itself
/// answers ENOSPC. Needs root and a working mount; otherwise prints why and returns.
#[test]
fn out_of_space_on_a_full_file_system() {
    let dir = tempdir();
    let mnt = dir.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let out = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "spillover-test"])
        .arg(&mnt)
        .output();
    match out {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            eprintln!(
                "skipping: mount -t tmpfs failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            );
            return;
        }
        Err(e) => {
            eprintln!("skipping: cannot run mount: {e}");
            return;
        }
    }
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount")
                .arg("-l")
                .arg(&self.0)
                .status();
        }
    }
    let _unmount = Unmount(mnt.clone());
    let pool = pool(16 * MIB);
    for engine in [EngineChoice::Threads, EngineChoice::IoUring] {
        let Some(swap) = open(engine, &[&mnt], &pool, |o| {
            o.capacity_per_dir = Some(64 * MIB)
        }) else {
            continue;
        };
        let slot = swap.alloc(4 * MIB).unwrap();
        let (_, r) = swap.write(leased(&pool, 4 * MIB, 3), &slot).wait();
        r.unwrap();
        match swap.alloc(16 * MIB) {
            Err(Error::OutOfSpace { path, need, free }) => {
                assert_eq!(path, mnt.canonicalize().unwrap());
                assert!(need > 0);
                assert!(free < 8 * MIB, "free {free}");
            }
            other => panic!("expected OutOfSpace from fallocate, got {other:?}"),
        }
        // What fit is still readable.
        let (got, r) = swap.read(&slot, pool.lease(4 * MIB).unwrap()).wait();
        r.unwrap();
        assert!(got.as_slice() == leased(&pool, 4 * MIB, 3).as_slice());
    }
}

#[test]
fn bad_directories_say_what_to_do() {
    let dir = tempdir();
    let pool = pool(4 * MIB);
    let missing = dir.path().join("nope");
    let err = Swap::open(&IoOptions::new([&missing]), &pool).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Invalid(_)));
    assert!(
        msg.contains("does not exist") && msg.contains(&*missing.to_string_lossy()),
        "{msg}"
    );

    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let err = Swap::open(&IoOptions::new([&file]), &pool).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("is not a directory") && msg.contains("a-file"),
        "{msg}"
    );

    let err = Swap::open(&IoOptions::new(Vec::<PathBuf>::new()), &pool).unwrap_err();
    assert!(err.to_string().contains("SPILLOVER_NVME_PATH"), "{err}");

    let mut o = IoOptions::new([dir.path()]);
    o.block_bytes = 1000;
    let err = Swap::open(&o, &pool).unwrap_err();
    assert!(err.to_string().contains("multiple of 4 KiB"), "{err}");

    // A symlinked directory is followed and reported by its resolved path.
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(dir.path(), &link).unwrap();
    let mut o = IoOptions::new([&link, &dir.path().to_path_buf()]);
    o.engine = EngineChoice::Threads;
    o.allow_buffered = true;
    let swap = Swap::open(&o, &pool).unwrap();
    assert_eq!(swap.dirs(), vec![dir.path().canonicalize().unwrap()]);
}
