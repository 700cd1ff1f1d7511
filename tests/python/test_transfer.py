"""The link's copy policy (python/spillover/activations/link) on the simulated device, on plain
CPU and, when there is one, on CUDA: bitwise copies, back-pressure, source and device-tensor
lifetimes, on_landed exactly once, in-place detection."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from spillover.activations import link

T = link
MiB = 1 << 20
HUGE = 1 << 40


def _bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def _sim(bandwidth=1e9, cap=HUGE, **kw):
    dev = T.SimDevice(bandwidth, **kw)
    return dev, T.Transfers(dev, cap)


class _PollSim(T.SimDevice):
    """A simulated device that, like CUDA, learns of completions only by polling."""

    has_callbacks = False


# ---- device -> host -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sim", "cpu"])
def test_copies_are_bitwise(kind):
    tr = T.Transfers(T.SimDevice(4e9) if kind == "sim" else T.CpuDevice(), HUGE)
    srcs = [_bytes(n, n) for n in (1, 4096, 3 * MiB + 7)]
    dsts = [torch.zeros_like(s) for s in srcs]
    copies = [tr.to_host(s, d) for s, d in zip(srcs, dsts)]
    tr.synchronize()
    assert all(c.done() for c in copies)
    assert tr.bytes_in_flight == 0 and tr.bytes_held == 0 and tr.copies == 3
    for s, d in zip(srcs, dsts):
        assert torch.equal(s, d)


def test_sim_copy_completes_only_after_bytes_over_bandwidth():
    _, tr = _sim(bandwidth=1e9, latency_s=1e-3)
    src, dst = _bytes(8 * MiB), torch.zeros(8 * MiB, dtype=torch.uint8)
    t0 = time.perf_counter()
    c = tr.to_host(src, dst)
    while not c.done():
        time.sleep(1e-4)
    assert time.perf_counter() - t0 >= 8 * MiB / 1e9 + 1e-3
    assert torch.equal(src, dst)
    assert c.wait() == 0.0


def _issue(tr, n_copies, nbytes, check=None):
    dsts = [torch.empty(nbytes, dtype=torch.uint8) for _ in range(n_copies)]
    srcs = [torch.full((nbytes,), i, dtype=torch.uint8) for i in range(n_copies)]
    copies = []
    for i in range(n_copies):
        src = srcs.pop(0)
        copies.append(tr.to_host(src, dsts[i]))
        del src  # the caller lets go: only the policy (and the copy) keeps a source
        if check is not None:
            check()
    return copies, dsts


def test_back_pressure_bounds_held_sources_and_device_memory():
    cap, n = 4 * MiB, 1 * MiB
    dev, tr = _sim(bandwidth=100e6, cap=cap)

    def check():
        assert tr.bytes_held <= cap + n
        assert dev.live_bytes() <= cap + n

    copies, dsts = _issue(tr, 24, n, check)
    assert tr.forced_waits > 0 and tr.sources_released > 0
    assert tr.stall_seconds > 0
    assert tr.peak_bytes_held <= cap + n
    assert dev.peak_live_bytes() <= cap + n
    tr.synchronize()
    for i, d in enumerate(dsts):
        assert bool((d == i).all())
    assert dev.live_bytes() == 0


def test_without_a_cap_every_source_stays():
    n = 1 * MiB
    dev, tr = _sim(bandwidth=100e6)
    copies, _ = _issue(tr, 16, n)
    assert tr.forced_waits == 0 and tr.sources_released == 0
    assert tr.peak_bytes_held >= 8 * n  # issuing outruns a 10 ms copy
    assert dev.peak_live_bytes() >= 8 * n
    assert sum(c.source() is not None for c in copies) >= 8
    tr.release_sources()
    assert tr.bytes_held == 0 and all(c.source() is None for c in copies)
    assert dev.live_bytes() == 0  # only the copy in progress could still hold one: it waited
    assert tr.sources_released >= 8
    tr.synchronize()


def test_source_until_released():
    _, tr = _sim(bandwidth=50e6)
    src = _bytes(2 * MiB)
    c = tr.to_host(src, torch.empty_like(src))
    assert c.source() is src and not c.done()
    tr.release_sources()
    assert c.source() is None
    assert c.done()  # the host (the simulated compute stream) waited for it
    tr.reap()


def test_source_dropped_when_copy_lands():
    dev, tr = _sim(bandwidth=4e9)
    c = tr.to_host(_bytes(MiB), torch.empty(MiB, dtype=torch.uint8))
    c.wait()
    assert c.source() is None and dev.live_bytes() == 0


@pytest.mark.parametrize("dev_cls", [T.SimDevice, _PollSim])
def test_on_landed_once_under_racing_observers(dev_cls):
    tr = T.Transfers(dev_cls(2e9), HUGE)
    calls, finished = {}, set()
    lock = threading.Lock()

    def landed(i):
        def fn():
            with lock:
                calls[i] = calls.get(i, 0) + 1
            time.sleep(2e-4)  # widen the window in which others observe the same copy
            finished.add(i)
        return fn

    n = 24
    copies = [tr.to_host(_bytes(64 << 10, i), torch.empty(64 << 10, dtype=torch.uint8),
                         on_landed=landed(i)) for i in range(n)]
    errors = []

    def observer(k):
        try:
            for _ in range(200):
                for i, c in enumerate(copies):
                    if c.done():
                        assert i in finished  # done() only once on_landed has returned
                if k == 0:
                    tr.reap()
            for i, c in reversed(list(enumerate(copies))):
                c.wait()
                assert i in finished
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=observer, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    tr.synchronize()
    assert calls == {i: 1 for i in range(n)}


def test_on_landed_error_is_raised_by_next_reap():
    _, tr = _sim(bandwidth=4e9)

    def boom():
        raise KeyError("seal failed")

    c = tr.to_host(_bytes(MiB), torch.empty(MiB, dtype=torch.uint8), on_landed=boom)
    while not c.done():
        time.sleep(1e-4)
    with pytest.raises(KeyError, match="seal failed"):
        tr.reap()
    tr.reap()  # reported once
    with pytest.raises(KeyError):
        c.wait()


def test_an_error_goes_to_the_step_that_owns_the_copy():
    """Note [errors go to their owner]: one Transfers serves every context of the process; a
    copy of an abandoned step (here: its seal fails, as on a full disk) must not raise out of
    another step's reap, and does out of its own."""
    _, tr = _sim(bandwidth=4e9)

    def boom():
        raise OSError("disk full")

    abandoned: list = []
    c = tr.to_host(_bytes(MiB), torch.empty(MiB, dtype=torch.uint8), on_landed=boom,
                   errors=abandoned)
    while not c.done():
        time.sleep(1e-4)
    other: list = []
    tr.reap(other)  # another context's step: nothing of its own failed
    tr.reap()
    tr.synchronize(other)
    with pytest.raises(OSError, match="disk full"):
        tr.reap(abandoned)
    tr.reap(abandoned)  # reported once
    assert not abandoned


def test_failed_copy_skips_on_landed_and_raises():
    class Failing(_PollSim):
        def copy(self, dst, src, stream):
            stream.put(lambda: stream.errors.append(OSError("link down")))

    tr = T.Transfers(Failing(1e9), HUGE)
    landed = []
    c = tr.to_host(_bytes(4096), torch.empty(4096, dtype=torch.uint8),
                   on_landed=lambda: landed.append(1))
    with pytest.raises(OSError, match="link down"):
        c.wait()
    tr.reap()  # wait() already reported it
    assert landed == [] and c.done()


def test_modified_detects_inplace_write_before_completion():
    _, tr = _sim(bandwidth=20e6)
    t = torch.zeros(MiB // 4, dtype=torch.float32)
    u = torch.zeros(MiB // 4, dtype=torch.float32)
    as_bytes = [torch.empty(0, dtype=torch.uint8).set_(x.untyped_storage()) for x in (t, u)]
    c1 = tr.to_host(as_bytes[0], torch.empty(MiB, dtype=torch.uint8), watch=t)
    c2 = tr.to_host(as_bytes[1], torch.empty(MiB, dtype=torch.uint8), watch=u)
    t.add_(1)  # before its copy has completed (50 ms at this bandwidth)
    tr.synchronize()
    assert c1.modified and not c2.modified


# ---- host -> device -----------------------------------------------------------------------------


def test_sim_to_device_is_a_distinct_equal_tensor():
    dev, tr = _sim(bandwidth=2e9)
    host = _bytes(2 * MiB, 3)
    out, ev = tr.to_device(host)
    assert out.data_ptr() != host.data_ptr() and torch.equal(out, host)
    assert dev.query(ev)


def test_sim_to_device_waits_for_after():
    _, tr = _sim(bandwidth=200e6)
    src, block = _bytes(2 * MiB, 5), torch.zeros(2 * MiB, dtype=torch.uint8)
    c = tr.to_host(src, block)
    staged = tr.to_device(block, after=c, wait=False)
    assert torch.equal(tr.use(staged), src)  # the H2D stream waited for the D2H copy


def test_handed_out_tensors_go_when_dropped():
    """Note [backward's tensors in the compute pool]: a tensor brought back and used goes as
    soon as its user drops it (the allocator frees it in its stream's order); one staged ahead
    is kept by the policy only until it is used, or dropped unused and collected."""
    n = MiB
    dev, tr = _sim(bandwidth=4e9)
    out, _ = tr.to_device(_bytes(n))
    assert tr.device_tensors_held == 0 and dev.live_bytes() == n
    del out
    assert dev.live_bytes() == 0  # no fence, no event: gone with its last reference
    staged = tr.to_device(_bytes(n, 2), wait=False)
    assert tr.device_tensors_held == 1
    kept = tr.use(staged)
    assert tr.device_tensors_held == 0 and torch.equal(kept, _bytes(n, 2))
    del staged
    dropped = tr.to_device(_bytes(n, 3), wait=False)
    del dropped
    assert tr.device_tensors_held == 1  # nobody else holds it: the next copy collects it
    tr.to_device(_bytes(n, 4))
    assert tr.device_tensors_held == 0 and dev.live_bytes() == n  # only `kept`, the caller's
    tr.end_of_backward()
    del kept
    assert dev.live_bytes() == 0


def test_unused_staged_output_is_freed_once_its_stream_waits():
    """As on CUDA: a tensor staged ahead and dropped by everyone while its copy runs goes once
    the stream whose pool made it was made to wait for the copy."""
    dev, tr = _sim(bandwidth=20e6)
    staged = tr.to_device(_bytes(MiB), wait=False)  # 50 ms of copy
    del staged
    tr.end_of_backward()
    assert tr.device_tensors_held == 0 and dev.live_bytes() == 0
    tr.synchronize()


def test_sim_catches_a_source_freed_before_its_copy_read_it():
    dev = T.SimDevice(50e6)
    stream, src = dev.new_stream(), _bytes(MiB)
    dev.track(src)
    dev.copy(torch.empty(MiB, dtype=torch.uint8), src, stream)
    del src  # a policy bug: nothing orders the allocator's reuse after the copy
    with pytest.raises(RuntimeError, match="source lifetime"):
        dev.synchronize(dev.record(stream))


def test_cpu_to_device_is_the_host_tensor():
    tr = T.Transfers(T.CpuDevice())
    assert tr.host_is_device and tr.cap_bytes == 256 * MiB
    src, block = _bytes(3 * MiB), torch.zeros(3 * MiB, dtype=torch.uint8)
    c = tr.to_host(src, block)
    out, ev = tr.to_device(block, after=c)
    assert out is block and ev is None and c.done() and torch.equal(out, src)


def test_cpu_back_pressure():
    tr = T.Transfers(T.CpuDevice(), cap_bytes=2 * MiB)
    _, dsts = _issue(tr, 12, MiB, lambda: tr.bytes_held <= 3 * MiB or pytest.fail("cap"))
    tr.synchronize()
    assert tr.bytes_held == 0
    assert all(bool((d == i).all()) for i, d in enumerate(dsts))


def test_exit_with_copies_in_flight(tmp_path):
    """Workers are joined at exit: a daemon thread stopped inside copy_ aborts the process."""
    script = tmp_path / "exit.py"
    script.write_text(
        "import torch\n"
        "from spillover.activations import link as T\n"
        "tr = T.Transfers(T.CpuDevice(), 1 << 40)\n"
        "src = torch.ones(32 << 20, dtype=torch.uint8)\n"
        "for _ in range(16):\n"
        "    tr.to_host(src, torch.empty(32 << 20, dtype=torch.uint8))\n"
    )
    r = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-2000:]


def test_default_cap_and_factory(monkeypatch):
    assert T.default_cap_bytes(1e9) == 64 * MiB
    assert T.default_cap_bytes(None) == int(16e9 * 0.02)
    assert T.default_cap_bytes(1e12) == 2048 * MiB
    a = T.transfers_for("cpu")
    assert a is T.transfers_for(torch.device("cpu")) and a.host_is_device
    s = T.transfers_for("cpu", sim_bandwidth=1e9, cap_bytes=8 * MiB)
    assert isinstance(s.dev, T.SimDevice) and not s.host_is_device and s.cap_bytes == 8 * MiB
    monkeypatch.setattr(T.os, "getpid", lambda: -1)  # a forked child makes its own
    assert T.transfers_for("cpu") is not a


# ---- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_policy():
    torch.cuda.synchronize()
    tr = T.Transfers(T.CudaDevice("cuda"), cap_bytes=64 * MiB)
    n, k = 16 * MiB, 24
    base = torch.cuda.memory_allocated()
    dsts = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for _ in range(k)]
    landed, copies = [], []
    for i in range(k):
        src = torch.full((n,), i, dtype=torch.uint8, device="cuda")
        copies.append(tr.to_host(src, dsts[i], on_landed=lambda i=i: landed.append(i)))
        del src
        assert tr.bytes_held <= 64 * MiB + n
        assert torch.cuda.memory_allocated() - base <= 64 * MiB + 2 * n
    assert tr.forced_waits > 0
    tr.release_sources()
    assert tr.bytes_held == 0 and all(c.source() is None for c in copies)
    tr.synchronize()
    assert sorted(landed) == list(range(k))
    assert all(bool((d == i).all()) for i, d in enumerate(dsts))
    outs = [tr.to_device(d, after=c, wait=(i % 2 == 0)) for i, (c, d) in
            enumerate(zip(copies, dsts))]
    vals = [tr.use(o) for o in outs]
    assert all(bool((v == i).all()) for i, v in enumerate(vals))
    del outs, vals
    tr.end_of_backward()
    assert tr.device_tensors_held == 0 and tr.bytes_in_flight == 0
    torch.cuda.synchronize()
    assert tr.stall_seconds > 0  # forced waits on copies not done, timed by events
    probe = torch.empty(1, device="cuda")  # the allocator frees record_stream'd blocks at a malloc
    assert torch.cuda.memory_allocated() - base <= MiB
    del probe


def test_old_import_paths():
    """spillover.context / transfer / guardrails still import, as the same objects."""
    import spillover.context as old_ctx
    import spillover.guardrails as old_guard
    import spillover.transfer as old_tr
    from spillover.activations import context, guardrails

    assert old_ctx.OffloadContext is context.OffloadContext is spillover_ctx()
    assert old_ctx.offload_context is context.offload_context
    assert old_tr.Transfers is T.Transfers and old_tr.transfers_for is T.transfers_for
    assert old_tr.block_tensor is T.block_tensor and old_tr.SimDevice is T.SimDevice
    assert old_guard.Guardrails is guardrails.Guardrails


def spillover_ctx():
    import spillover

    return type(spillover.offload_context("host"))
