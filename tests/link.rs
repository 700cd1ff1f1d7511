//! The device link over the simulated device (rust/link): copies land bitwise and only after
//! their bytes over the bandwidth, the ledger's victims, urgent and staged copies back, the
//! calls each costs (Note [device calls]), and injected faults.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use spillover_core::link::sim::{Fault, SimDevice, SimOptions, COMPUTE};
use spillover_core::link::{Device, Dir, Keep, Link, StageItem};
use spillover_core::tier::Issued;

fn sim(opts: SimOptions) -> Arc<SimDevice> {
    Arc::new(SimDevice::new(opts).unwrap())
}

fn link(dev: &Arc<SimDevice>, cap: u64) -> Link {
    Link::new(dev.clone(), cap).unwrap()
}

fn addr(v: &[u8]) -> u64 {
    v.as_ptr() as u64
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Copy `nbytes` of `src` into `dst` over `l`, after the compute stream's work, nothing held
/// or kept by the link.
///
/// # Safety
/// Both buffers outlive the copy.
unsafe fn copy_out(l: &Link, src: &[u8], dst: &[u8], nbytes: u64) -> Issued {
    // SAFETY: the caller's contract.
    unsafe {
        l.d2h(
            addr(src),
            addr(dst),
            nbytes,
            COMPUTE,
            None,
            None,
            None,
            None,
        )
    }
    .unwrap()
}

/// A staged copy of all of `dst` from `src` (after the D2H copy `after`), the link holding
/// `hold` until it ran.
fn stage_item(dst: &[u8], src: &[u8], after: Option<u64>, hold: Option<Keep>) -> StageItem {
    StageItem {
        dst: addr(dst),
        src: addr(src),
        nbytes: dst.len() as u64,
        after,
        hold,
        keep: None,
    }
}

fn poll_until_landed(l: &Link, id: u64) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut seen = Vec::new();
    while l.in_flight(id) {
        for x in l.poll().unwrap() {
            assert!(x.error.is_none(), "{:?}", x.error);
            seen.push(x.id);
        }
        assert!(Instant::now() < deadline, "copy {id} never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    seen
}

#[test]
fn a_copy_there_and_back_is_bitwise_and_lands_after_its_bytes() {
    let dev = sim(SimOptions {
        bandwidth: Some(10e6), // 1 MB: 0.1 s
        ..Default::default()
    });
    let l = link(&dev, u64::MAX);
    let src = pattern(1 << 20, 7);
    let dst = vec![0u8; 1 << 20];
    let landed = Arc::new(AtomicUsize::new(0));
    let seen = landed.clone();
    let t0 = Instant::now();
    // SAFETY: both buffers outlive the copy (the test waits for it below).
    let issued = unsafe {
        l.d2h(
            addr(&src),
            addr(&dst),
            src.len() as u64,
            COMPUTE,
            None,
            None,
            Some(Box::new(move || {
                seen.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })),
            None,
        )
    }
    .unwrap();
    assert!(issued.victims.is_empty());
    assert!(l.in_flight(issued.id));
    assert!(l.poll().unwrap().is_empty(), "held back for its group");
    l.flush().unwrap(); // Note [grouped copies]: the end of forward issues it
    assert!(
        l.poll().unwrap().is_empty(),
        "landed before its bytes moved"
    );
    assert_eq!(poll_until_landed(&l, issued.id), vec![issued.id]);
    assert!(t0.elapsed() >= Duration::from_millis(90));
    assert_eq!(dst, src);
    assert_eq!(landed.load(Ordering::SeqCst), 1);
    assert!(l.poll().unwrap().is_empty(), "a copy lands once");
    // back, urgent: on the compute stream (the host), done when the call returns
    let back = vec![0u8; 1 << 20];
    // SAFETY: both buffers outlive the copy, which runs on the calling thread.
    unsafe {
        l.to_device(
            addr(&back),
            addr(&dst),
            dst.len() as u64,
            COMPUTE,
            None,
            None,
            None,
        )
    }
    .unwrap();
    assert_eq!(back, src);
}

#[test]
fn a_group_of_packs_costs_one_device_call_each_and_three_more_and_an_urgent_unpack_two() {
    let dev = sim(SimOptions::default());
    let l = link(&dev, u64::MAX);
    let src = pattern(4096, 1);
    let dst = vec![0u8; 4096];
    // the first packs also make the link's events (pooled from then on)
    for _ in 0..2 {
        // SAFETY: both buffers outlive the copy (synchronized below).
        unsafe { copy_out(&l, &src, &dst, 4096) };
    }
    l.synchronize().unwrap();
    let before = dev.calls();
    let mut ids = Vec::new();
    for _ in 0..7 {
        // SAFETY: both buffers outlive the copy (synchronized below).
        let id = unsafe { copy_out(&l, &src, &dst, 4096) }.id;
        ids.push(id);
    }
    assert_eq!(dev.calls() - before, 0, "held back for their group");
    let big = pattern(1 << 20, 2);
    let big_dst = vec![0u8; 1 << 20];
    // SAFETY: both buffers outlive the copy (synchronized below).
    unsafe { copy_out(&l, &big, &big_dst, 1 << 20) };
    // the eighth completes the group: record (compute), wait (D2H), 8 copies, one event
    assert_eq!(dev.calls() - before, 11, "Note [device calls]");
    let huge = vec![0u8; 9 << 20];
    let huge_dst = vec![0u8; 9 << 20];
    l.synchronize().unwrap(); // the group's event back in the link's pool
    let before = dev.calls();
    // six of 8 MiB make a group of 48 MiB: one record, one wait, one event for them all
    for i in 0..6 {
        if i == 5 {
            assert_eq!(
                dev.calls() - before,
                0,
                "five of 8 MiB held back for their group"
            );
        }
        // SAFETY: both buffers outlive the copy (synchronized below).
        unsafe { copy_out(&l, &huge, &huge_dst, 8 << 20) };
    }
    assert_eq!(
        dev.calls() - before,
        9,
        "Note [grouped copies]: six of 8 MiB"
    );
    l.synchronize().unwrap();
    let before = dev.calls();
    // a copy past the group's bytes waits for the next one: two of 40 MiB share 5 calls
    let whole = vec![0u8; 40 << 20];
    let whole_dst = vec![0u8; 40 << 20];
    for i in 0..2 {
        // SAFETY: both buffers outlive the copy (synchronized below).
        unsafe { copy_out(&l, &whole, &whole_dst, 40 << 20) };
        let want = if i == 0 { 0 } else { 5 };
        assert_eq!(dev.calls() - before, want, "Note [grouped copies]: 40 MiB");
    }
    l.synchronize().unwrap();
    assert!(ids.iter().all(|&id| !l.in_flight(id)));
    let back = vec![0u8; 4096];
    let before = dev.calls();
    // SAFETY: as above.
    unsafe { l.to_device(addr(&back), addr(&dst), 4096, COMPUTE, None, None, None) }.unwrap();
    assert_eq!(dev.calls() - before, 2);
}

#[test]
fn past_the_cap_the_oldest_sources_are_released_after_the_compute_stream_waits() {
    let dev = sim(SimOptions {
        bandwidth: Some(20e6), // 1 MiB: ~50 ms
        ..Default::default()
    });
    let l = link(&dev, 2 << 20);
    let srcs: Vec<Vec<u8>> = (0..4).map(|i| pattern(1 << 20, i)).collect();
    let dsts: Vec<Vec<u8>> = (0..4).map(|_| vec![0u8; 1 << 20]).collect();
    let mut victims = Vec::new();
    for (s, d) in srcs.iter().zip(&dsts) {
        // SAFETY: both buffers outlive the copies (synchronized below).
        let i =
            unsafe { l.d2h(addr(s), addr(d), 1 << 20, COMPUTE, None, None, None, None) }.unwrap();
        victims.push(i.victims);
    }
    assert_eq!(victims, vec![vec![], vec![], vec![0], vec![1]]);
    // the compute stream (the host) waited for copy 0 before the third pack returned
    let (ledger, stats) = l.counters();
    assert!(
        ledger.bytes_held <= 2 << 20 && ledger.forced_waits == 2,
        "{ledger:?}"
    );
    assert!(stats.host_wait_seconds > 0.05, "{stats:?}");
    l.synchronize().unwrap();
    assert_eq!(dsts, srcs);
}

#[test]
fn staged_copies_wait_for_their_d2h_copy_and_are_used_or_dropped() {
    let dev = sim(SimOptions {
        bandwidth: Some(50e6),
        ..Default::default()
    });
    let l = link(&dev, u64::MAX);
    let src = pattern(1 << 20, 3);
    let host = vec![0u8; 1 << 20];
    // SAFETY: both buffers outlive the copy.
    let id = unsafe { copy_out(&l, &src, &host, 1 << 20) }.id;
    let a = vec![0u8; 1 << 20];
    let b = vec![0u8; 1 << 20];
    // their bytes are not in the host block yet: the H2D stream waits
    let items = vec![
        stage_item(&a, &host, Some(id), None),
        stage_item(&b, &host, Some(id), None),
    ];
    // SAFETY: all buffers outlive the copies (used below, synchronized at the end).
    let evs = unsafe { l.stage(COMPUTE, items) }.unwrap();
    assert_eq!(evs.len(), 2);
    l.use_staged(evs[0], COMPUTE).unwrap(); // the host (compute) waits for the copy
    assert_eq!(a, src);
    l.drop_staged(evs[1], COMPUTE).unwrap();
    assert_eq!(b, src);
    l.synchronize().unwrap();
    assert_eq!(l.counters().0.staged, 0);
    assert!(l.use_staged(12345, COMPUTE).is_err());
}

#[test]
fn a_failed_copy_is_reported_with_its_id() {
    let dev = sim(SimOptions::default());
    let l = link(&dev, u64::MAX);
    let src = pattern(4096, 9);
    let dst = vec![0u8; 4096];
    dev.inject(Fault::Fail, Dir::ToHost);
    // SAFETY: both buffers outlive the copies.
    let bad = unsafe { copy_out(&l, &src, &dst, 4096) }.id;
    let landed = l.synchronize().unwrap();
    assert_eq!(landed.len(), 1);
    assert_eq!(landed[0].id, bad);
    assert!(landed[0].error.is_some());
    // the next copy is fine
    // SAFETY: as above.
    let ok = unsafe { copy_out(&l, &src, &dst, 4096) }.id;
    let landed = l.synchronize().unwrap();
    assert_eq!(landed.len(), 1);
    assert_eq!(landed[0].id, ok);
    assert!(landed[0].error.is_none());
    assert_eq!(dst, src);
}

#[test]
fn injected_races_change_the_bytes_as_a_race_would() {
    let dev = sim(SimOptions::default());
    let l = link(&dev, u64::MAX);
    let src = pattern(4096, 5);
    let dst = vec![0u8; 4096];
    dev.inject(Fault::StaleSource, Dir::ToHost);
    // SAFETY: both buffers outlive the copy.
    unsafe { copy_out(&l, &src, &dst, 4096) };
    l.synchronize().unwrap();
    assert_ne!(dst, src);
    // a staged copy whose bytes land after its event: used at once, it reads the old bytes
    let out = vec![0u8; 4096];
    dev.inject(Fault::LateLanding, Dir::ToDevice);
    let item = stage_item(&out, &src, None, None);
    // SAFETY: the buffers outlive the late write (the test sleeps past it before returning).
    let ev = unsafe { l.stage(COMPUTE, vec![item]) }.unwrap()[0];
    l.use_staged(ev, COMPUTE).unwrap();
    assert_eq!(out, vec![0u8; 4096], "read before the late bytes landed");
    std::thread::sleep(Duration::from_millis(120));
    assert_eq!(out, src);
}

#[test]
fn the_compute_stream_lags_the_host() {
    let dev = sim(SimOptions {
        compute_lag: 0.1,
        ..Default::default()
    });
    let ev = dev.new_event().unwrap();
    dev.record(ev, COMPUTE).unwrap();
    assert!(!dev.query(ev).unwrap());
    let t0 = Instant::now();
    dev.synchronize(ev).unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(90));
    assert!(dev.query(ev).unwrap());
}

#[test]
fn each_call_costs_the_host_what_it_is_told() {
    let dev = sim(SimOptions {
        call_cost: 200e-6,
        ..Default::default()
    });
    let ev = dev.new_event().unwrap();
    let t0 = Instant::now();
    for _ in 0..50 {
        dev.record(ev, COMPUTE).unwrap();
    }
    assert!(t0.elapsed() >= Duration::from_millis(10));
}

#[test]
fn bad_options_are_refused() {
    for opts in [
        SimOptions {
            bandwidth: Some(0.0),
            ..Default::default()
        },
        SimOptions {
            compute_lag: -1.0,
            ..Default::default()
        },
        SimOptions {
            call_cost: f64::NAN,
            ..Default::default()
        },
    ] {
        assert!(SimDevice::new(opts).is_err(), "{opts:?}");
    }
}

#[test]
fn cuda_is_refused_cleanly_without_a_driver() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return; // a GPU host: the driver is there (benches/gpu covers it)
    }
    match spillover_core::link::cuda::CudaDevice::open(0) {
        Ok(_) => panic!("a CUDA device without /dev/nvidiactl"),
        Err(e) => assert!(
            e.to_string().contains("device load failed") || e.to_string().contains("device cu"),
            "{e}"
        ),
    }
}

#[test]
fn verify_mode_catches_a_source_written_before_its_copy_read_it() {
    use spillover_core::link::checksum::checksum;
    use spillover_core::link::Verify;

    let dev = sim(SimOptions::default());
    let l = link(&dev, u64::MAX);
    let src = pattern(10_000, 3);
    let dst = vec![0u8; 10_000];
    let cs: u64 = checksum(&src) as u64; // the device's checksum, taken before the copy
    let verify = |host: &Vec<u8>| {
        Some(Verify {
            checksum: &cs as *const u64 as u64,
            host: addr(host),
            len: 10_000,
            keep: None,
        })
    };
    // SAFETY: every buffer outlives the copies (synchronized below).
    let ok = unsafe {
        l.d2h(
            addr(&src),
            addr(&dst),
            10_000,
            COMPUTE,
            None,
            None,
            None,
            verify(&dst),
        )
    }
    .unwrap()
    .id;
    let landed = l.synchronize().unwrap();
    assert_eq!((landed[0].id, landed[0].error.is_none()), (ok, true));
    dev.inject(Fault::StaleSource, Dir::ToHost);
    let dst2 = vec![0u8; 10_000];
    // SAFETY: as above.
    let bad = unsafe {
        l.d2h(
            addr(&src),
            addr(&dst2),
            10_000,
            COMPUTE,
            None,
            None,
            None,
            verify(&dst2),
        )
    }
    .unwrap()
    .id;
    let landed = l.synchronize().unwrap();
    assert_eq!(landed[0].id, bad);
    let e = landed[0]
        .error
        .as_ref()
        .expect("the stale bytes are caught");
    assert!(
        e.to_string().contains("written before its copy read it"),
        "{e}"
    );
}

#[test]
fn a_poll_finds_the_copies_landed_by_halving() {
    // Note [polls in order]: 16 groups of 8 copies of 4 KiB, 10 ms a group on the link
    let dev = sim(SimOptions {
        bandwidth: Some(3.2e6),
        ..Default::default()
    });
    let l = link(&dev, u64::MAX);
    let src = pattern(4096, 3);
    let dst = vec![0u8; 4096];
    let mut ids = Vec::new();
    for _ in 0..16 * 8 {
        // SAFETY: both buffers outlive the copies (synchronized below).
        let id = unsafe { copy_out(&l, &src, &dst, 4096) }.id;
        ids.push(id);
    }
    std::thread::sleep(Duration::from_millis(75));
    let q0 = l.counters().1.queries;
    let landed = l.poll().unwrap().len();
    let asked = l.counters().1.queries - q0;
    // the oldest, the newest, then at most four halvings of the 14 between: one query a group
    // landed and one for the first that had not was 17 at the worst
    assert!(asked <= 6, "{asked} queries for {landed} copies landed");
    assert_eq!(landed % 8, 0, "a group lands whole");
    assert!(ids[..landed].iter().all(|&id| !l.in_flight(id)));
    assert!(ids[landed..].iter().all(|&id| l.in_flight(id)));
    std::thread::sleep(Duration::from_millis(150));
    let q0 = l.counters().1.queries;
    let rest = l.poll().unwrap().len();
    assert_eq!(
        l.counters().1.queries - q0,
        2,
        "all landed: the oldest and the newest"
    );
    assert_eq!(landed + rest, ids.len());
}

/// Drops set the flag: what a staged copy held.
struct Flag(Arc<AtomicUsize>);

impl Drop for Flag {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

#[test]
fn a_staged_copy_seen_landed_lets_go_of_its_views_and_its_use_makes_no_wait() {
    // Note [staged copies seen landed]: three runs (one stage call each), then a poll once
    // they ran. Before it: the views held until each tensor was used, and a wait per use.
    let dev = sim(SimOptions {
        bandwidth: Some(1e9),
        ..Default::default()
    });
    let l = link(&dev, u64::MAX);
    let host = pattern(1 << 20, 5);
    let bufs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; 1 << 20]).collect();
    let dropped = Arc::new(AtomicUsize::new(0));
    let mut evs = Vec::new();
    for b in &bufs {
        let item = stage_item(b, &host, None, Some(Box::new(Flag(dropped.clone()))));
        // SAFETY: all buffers outlive the copies (seen landed below).
        evs.extend(unsafe { l.stage(COMPUTE, vec![item]) }.unwrap());
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    while dropped.load(Ordering::SeqCst) < 3 {
        assert!(
            Instant::now() < deadline,
            "the staged copies were never seen landed"
        );
        std::thread::sleep(Duration::from_millis(2));
        l.poll().unwrap();
    }
    let c0 = dev.calls();
    for (ev, b) in evs.iter().zip(&bufs) {
        l.use_staged(*ev, COMPUTE).unwrap();
        assert_eq!(*b, host);
    }
    assert_eq!(
        dev.calls() - c0,
        0,
        "a use of a copy seen landed waits for nothing"
    );
    l.poll().unwrap();
    assert_eq!(l.counters().0.staged, 0);
}

#[test]
fn under_cudas_default_cap_two_copies_of_44_mib_share_a_group() {
    // Note [grouped copies]: the probe's 1B Llama saves up to 44 MiB at seq 4096. Under CUDA's
    // default cap (16 GB/s x 20 ms) such a copy passed an eighth of it and went alone, 4 calls
    let dev = sim(SimOptions::default());
    let l = link(&dev, 320_000_000);
    let src = vec![1u8; 44 << 20];
    let dst = vec![0u8; 44 << 20];
    // SAFETY: both buffers outlive the copies (synchronized below).
    unsafe { copy_out(&l, &src, &dst, 4096) };
    l.synchronize().unwrap(); // the link's first events made
    let before = dev.calls();
    // SAFETY: as above.
    unsafe { copy_out(&l, &src, &dst, 44 << 20) };
    assert_eq!(dev.calls() - before, 0, "held back for the next");
    // SAFETY: as above.
    unsafe { copy_out(&l, &src, &dst, 44 << 20) };
    assert_eq!(
        dev.calls() - before,
        5,
        "record, wait, two copies, one event"
    );
    l.synchronize().unwrap();
    assert_eq!(dst, src);
}
