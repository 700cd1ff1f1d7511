//! The swap engine against fio on the same file system, in one run.
//!
//! Writes then reads SPILLOVER_BENCH_BYTES (default 2 GiB) sequentially through the engine from
//! pool blocks (64 MiB requests, several outstanding, split into 1 MiB chunks at queue depth
//! 32), and runs `fio --ioengine=io_uring --direct=1 --bs=1M --iodepth=32` over the same size in
//! the same directory, interleaved A/B/A/B for SPILLOVER_BENCH_ROUNDS rounds (default 3). A
//! fresh swap file (and a fresh fio file) every round, so both pay for first writes into
//! preallocated space alike, and the order of the contenders rotates each round so none always
//! runs first. fio runs twice per round: plain (the stated baseline) and with
//! `--fixedbufs --registerfiles` (what the engine itself does). Prints GB/s per round, medians
//! and engine/fio ratios, then (unless SPILLOVER_BENCH_TUNE=0) engine variants run in the same
//! rounds: larger chunks, deeper queues, two files per directory, the thread pool.
//!
//! `cargo bench --bench swap_vs_fio`; SPILLOVER_NVME_PATH picks the directories
//! (comma-separated; default /tmp). Without fio on PATH only the engine figures are printed.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use spillover_core::io::{EngineChoice, IoOptions, Slot, Swap};
use spillover_core::pool::{Block, Pool, PoolOptions};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
/// Bytes per engine request (a large activation), and how many are outstanding at once.
const REQUEST: u64 = 64 * MIB;
const WINDOW: usize = 4;

fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number of bytes")),
        Err(_) => default,
    }
}

#[derive(Clone, Copy, Default)]
struct Pass {
    write: f64,
    read: f64,
}

fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs / 1e9
}

struct EngineRun<'a> {
    label: &'static str,
    opts: IoOptions,
    pool: &'a Pool,
}

impl EngineRun<'_> {
    /// One round: a fresh swap, write `bytes` then read them back; GB/s of each.
    fn pass(&self, bytes: u64) -> Pass {
        let swap = Swap::open(&self.opts, self.pool).unwrap_or_else(|e| panic!("{e}"));
        let slots: Vec<Slot> = (0..bytes.div_ceil(REQUEST))
            .map(|_| swap.alloc(REQUEST).unwrap_or_else(|e| panic!("{e}")))
            .collect();
        let mut blocks: Vec<Block> = (0..WINDOW)
            .map(|_| self.pool.lease(REQUEST).unwrap())
            .collect();
        for (i, b) in blocks.iter_mut().enumerate() {
            b.as_mut_slice().fill(0x5a ^ i as u8);
        }
        let moved = slots.len() as u64 * REQUEST;
        let t = Instant::now();
        run_window(&swap, &slots, &mut blocks, true);
        let write = gbps(moved, t.elapsed().as_secs_f64());
        let t = Instant::now();
        run_window(&swap, &slots, &mut blocks, false);
        let read = gbps(moved, t.elapsed().as_secs_f64());
        Pass { write, read }
    }
}

/// Every slot once, in order, `WINDOW` requests outstanding.
fn run_window(swap: &Swap, slots: &[Slot], blocks: &mut Vec<Block>, write: bool) {
    let mut outstanding = VecDeque::new();
    for slot in slots {
        let block = match blocks.pop() {
            Some(b) => b,
            None => {
                let t: spillover_core::io::Ticket = outstanding.pop_front().unwrap();
                let (b, r) = t.wait();
                r.unwrap_or_else(|e| panic!("{e}"));
                b
            }
        };
        outstanding.push_back(if write {
            swap.write(block, slot)
        } else {
            swap.read(slot, block)
        });
    }
    for t in outstanding {
        let (b, r) = t.wait();
        r.unwrap_or_else(|e| panic!("{e}"));
        blocks.push(b);
    }
}

fn fio_available() -> bool {
    Command::new("fio")
        .arg("--version")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// The number after `"field" : ` inside the `"section" : {` object of fio's JSON output.
fn fio_field(json: &str, section: &str, field: &str) -> Option<f64> {
    let s = json.find(&format!("\"{section}\" : {{"))?;
    let rest = &json[s..];
    let f = rest.find(&format!("\"{field}\" : "))? + field.len() + 5;
    let num: String = rest[f..]
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    num.parse().ok()
}

/// One fio round over fresh files in `dirs`: write then read; GB/s of each.
fn fio_pass(dirs: &[PathBuf], bytes: u64, extra: &[&str]) -> Pass {
    let files: Vec<PathBuf> = dirs.iter().map(|d| d.join("spillover-fio.tmp")).collect();
    let names = files
        .iter()
        .map(|f| f.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(":");
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    let mut out = Pass::default();
    for rw in ["write", "read"] {
        let o = Command::new("fio")
            .args([
                "--name=spillover",
                "--ioengine=io_uring",
                "--direct=1",
                "--bs=1M",
                "--iodepth=32",
                "--numjobs=1",
                "--output-format=json",
            ])
            .args(extra)
            .arg(format!("--rw={rw}"))
            .arg(format!("--size={bytes}"))
            .arg(format!("--filename={names}"))
            .output()
            .expect("run fio");
        let text = String::from_utf8_lossy(&o.stdout);
        let json = &text[text.find('{').unwrap_or(0)..];
        let bw = fio_field(json, rw, "bw_bytes").unwrap_or_else(|| {
            panic!(
                "fio gave no {rw} bandwidth: {}\n{}",
                text,
                String::from_utf8_lossy(&o.stderr)
            )
        });
        if rw == "write" {
            out.write = bw / 1e9;
        } else {
            out.read = bw / 1e9;
        }
    }
    for f in &files {
        let _ = std::fs::remove_file(f);
    }
    out
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn fs_type(dir: &Path) -> String {
    Command::new("stat")
        .args(["-f", "-c", "%T"])
        .arg(dir)
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".into())
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument, if any, is ignored.
    let bytes = env_u64("SPILLOVER_BENCH_BYTES", 2 * GIB).div_ceil(REQUEST) * REQUEST;
    let rounds = env_u64("SPILLOVER_BENCH_ROUNDS", 3).max(1) as usize;
    let tune = std::env::var("SPILLOVER_BENCH_TUNE").map_or(true, |v| v != "0");
    let dirs: Vec<PathBuf> = std::env::var("SPILLOVER_NVME_PATH")
        .unwrap_or_else(|_| "/tmp".into())
        .split(',')
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .collect();

    let mut popts = PoolOptions::new(WINDOW as u64 * REQUEST);
    popts.lock = false;
    let pool = Pool::new(&popts).expect("host pool");

    let mut base = IoOptions::new(dirs.clone());
    base.engine = EngineChoice::IoUring;
    let probe = Swap::open(&base, &pool);
    if let Err(e) = &probe {
        eprintln!("io_uring engine unavailable ({e}); benching the thread pool instead");
        base.engine = EngineChoice::Threads;
    }
    let probe = Swap::open(&base, &pool).unwrap_or_else(|e| panic!("{e}"));
    let (engine_name, direct) = (probe.engine_name(), probe.is_direct());
    if let Some(w) = probe.warning() {
        eprintln!("{w}");
    }
    drop(probe);

    let fio = fio_available();
    let dir_list = dirs
        .iter()
        .map(|d| format!("{} ({})", d.display(), fs_type(d)))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "swap engine vs fio: {:.2} GiB sequential, 1 MiB blocks, queue depth 32, {dir_list}",
        bytes as f64 / GIB as f64
    );
    println!(
        "engine: {engine_name}, O_DIRECT {direct}, {} MiB requests x {WINDOW} outstanding; \
         fio: ioengine=io_uring direct=1 bs=1M iodepth=32",
        REQUEST / MIB
    );
    if !fio {
        println!("fio is missing (apt-get install -y fio): engine figures only");
    }

    // Contenders, each run once per round, interleaved, so drift in the device (or its host)
    // hits all of them alike. The first engine run and plain fio are the headline pair.
    let sub: Vec<PathBuf> = dirs
        .iter()
        .flat_map(|d| [d.join("spillover-bench-a"), d.join("spillover-bench-b")])
        .collect();
    let variant = |label: &'static str, f: &dyn Fn(&mut IoOptions)| {
        let mut o = base.clone();
        f(&mut o);
        EngineRun {
            label,
            opts: o,
            pool: &pool,
        }
    };
    let mut engines = vec![variant("1 MiB chunks, qd 32 (default)", &|_| {})];
    if tune {
        for d in &sub {
            std::fs::create_dir_all(d).expect("make a bench subdirectory");
        }
        engines.extend([
            variant("4 MiB chunks, qd 32", &|o| o.block_bytes = 4 * MIB),
            variant("1 MiB chunks, qd 64", &|o| o.queue_depth = 64),
            variant("256 KiB chunks, qd 128", &|o| {
                o.block_bytes = 256 << 10;
                o.queue_depth = 128
            }),
            variant("2 files per dir, 1 MiB, qd 32", &|o| o.dirs = sub.clone()),
            variant("thread pool (8 workers), 1 MiB", &|o| {
                o.engine = EngineChoice::Threads
            }),
        ]);
    }
    let fio_kinds: &[(&str, &[&str])] = if fio {
        &[
            ("fio", &[]),
            (
                "fio fixedbufs+registerfiles",
                &["--fixedbufs", "--registerfiles"],
            ),
        ]
    } else {
        &[]
    };
    let mut eng: Vec<Vec<Pass>> = vec![Vec::new(); engines.len()];
    let mut fios: Vec<Vec<Pass>> = vec![Vec::new(); fio_kinds.len()];

    println!();
    println!(
        "{:<7} {:>13} {:>10} {:>12} {:>9} {:>11} {:>10}   (GB/s)",
        "round",
        "engine write",
        "fio write",
        "engine read",
        "fio read",
        "fio+fixed w",
        "fio+fixed r"
    );
    let cell = |v: &[Pass], i: usize, w: bool| {
        v.get(i).map_or("-".to_string(), |p| {
            format!("{:.2}", if w { p.write } else { p.read })
        })
    };
    for r in 0..rounds {
        // Rotate the order every round: a device (or its host's cache) that slows down as a
        // round writes more would otherwise always favour whoever runs first.
        let n = engines.len() + fio_kinds.len();
        for k in (0..n).map(|j| (j + r) % n) {
            if k < engines.len() {
                eng[k].push(engines[k].pass(bytes));
            } else {
                let f = k - engines.len();
                fios[f].push(fio_pass(&dirs, bytes, fio_kinds[f].1));
            }
        }
        let none = Vec::new();
        let (f0, f1) = (fios.first().unwrap_or(&none), fios.get(1).unwrap_or(&none));
        println!(
            "{:<7} {:>13} {:>10} {:>12} {:>9} {:>11} {:>10}",
            r + 1,
            cell(&eng[0], r, true),
            cell(f0, r, true),
            cell(&eng[0], r, false),
            cell(f0, r, false),
            cell(f1, r, true),
            cell(f1, r, false),
        );
    }
    let med = |v: &[Pass]| {
        (
            median(v.iter().map(|p| p.write).collect()),
            median(v.iter().map(|p| p.read).collect()),
        )
    };
    let (ew, er) = med(&eng[0]);
    let fio_med: Vec<(f64, f64)> = fios.iter().map(|v| med(v)).collect();
    let show = |x: Option<f64>| x.map_or("-".into(), |v| format!("{v:.2}"));
    println!(
        "{:<7} {:>13.2} {:>10} {:>12.2} {:>9} {:>11} {:>10}",
        "median",
        ew,
        show(fio_med.first().map(|m| m.0)),
        er,
        show(fio_med.first().map(|m| m.1)),
        show(fio_med.get(1).map(|m| m.0)),
        show(fio_med.get(1).map(|m| m.1)),
    );
    for ((name, _), (fw, fr)) in fio_kinds.iter().zip(&fio_med) {
        println!("engine/{name}: write {:.2}x, read {:.2}x", ew / fw, er / fr);
    }

    if tune {
        let (fw, fr) = fio_med
            .first()
            .map_or((None, None), |m| (Some(m.0), Some(m.1)));
        println!();
        println!(
            "{:<34} {:>7} {:>7} {:>9} {:>9}   (medians of {rounds}, GB/s, same rounds)",
            "engine variant", "write", "read", "w/fio", "r/fio"
        );
        for (e, passes) in engines.iter().zip(&eng) {
            let (w, r) = med(passes);
            let ratio = |x: f64, f: Option<f64>| f.map_or("-".into(), |f| format!("{:.2}x", x / f));
            println!(
                "{:<34} {:>7.2} {:>7.2} {:>9} {:>9}",
                e.label,
                w,
                r,
                ratio(w, fw),
                ratio(r, fr)
            );
        }
        for d in &sub {
            let _ = std::fs::remove_dir(d);
        }
    }
}
