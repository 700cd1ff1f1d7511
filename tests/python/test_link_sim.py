"""The simulated device behaves like a GPU where it matters for memory (Note [stream ordering]
in activations/link/policy.py): its compute stream runs behind the host, so a host that waits
to *see* compute events keeps what it waits for; each stream has its own allocator pool. On it,
tensors brought back for backward are freed in stream order, as soon as autograd lets go of
them, behind a byte cap, never by the host waiting to see an event."""

from __future__ import annotations

import time

import pytest
import torch

import spillover
from spillover.activations import link as T

MiB = 1 << 20
HUGE = 1 << 40


def _bytes(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_compute_events_fire_after_the_lag():
    dev = T.SimDevice(None, compute_lag_s=0.2)
    t0 = time.monotonic()
    ev = dev.record(dev.current_stream())
    assert not dev.query(ev)  # the host is ahead of the compute stream
    dev.synchronize(ev)
    assert time.monotonic() - t0 >= 0.19
    assert dev.query(ev)
    assert dev.query(T.SimDevice(None).record("host"))  # no lag: fired at once


def test_backward_frees_in_stream_order_when_the_host_runs_ahead():
    """Each block brought back, used and let go: the device holds one at a time, in one pool.
    Freed only once the host had seen a compute event fire, all of them stayed alive for the
    lag; made on the H2D stream and freed behind events and a cap, the cap's worth stayed
    alive, in a second pool (Note [backward's tensors in the compute pool])."""
    dev = T.SimDevice(None, compute_lag_s=0.5)
    tr = T.Transfers(dev, 2 * MiB)
    blocks = [_bytes(MiB, i) for i in range(24)]
    dev.reset_peaks()
    for b in blocks:
        out, _ = tr.to_device(b)
        assert torch.equal(out, b)
        assert tr.device_tensors_held == 0  # used at once: the allocator frees it
        del out  # autograd lets go after the node that used it
        dev.poll()
    assert dev.peak_live_bytes() == MiB, dev.peak_live_bytes() / MiB
    assert dev.peak_reserved_bytes() == MiB, dev.peak_reserved_bytes() / MiB
    tr.end_of_backward()
    tr.synchronize()
    assert tr.device_tensors_held == 0


def test_backward_shares_the_pool_forward_left():
    """Forward's sources live in the compute stream's pool; backward's tensors are made in the
    pool of the stream that uses them, the same one: the device reserves one set, not forward's
    peak plus backward's set in the H2D stream's pool (what CUDA's caching allocator did when
    the link made them on its copy stream)."""
    dev = T.SimDevice(None)
    tr = T.Transfers(dev, HUGE)
    srcs = [_bytes(MiB, i) for i in range(8)]
    dsts = [torch.empty(MiB, dtype=torch.uint8) for _ in srcs]
    dev.reset_peaks()
    for s, d in zip(srcs, dsts):
        tr.to_host(s, d)
    tr.synchronize()
    del srcs, s  # forward's activations are gone
    outs = [tr.to_device(d)[0] for d in dsts]  # backward's set, alive at once
    dev.poll()
    assert all(torch.equal(o, d) for o, d in zip(outs, dsts))
    assert dev.peak_live_bytes() == 8 * MiB
    assert dev.peak_reserved_bytes() == 8 * MiB
    del outs
    tr.end_of_backward()


def test_sim_copies_from_pageable_memory_hold_the_host():
    """As CUDA's driver does when it stages pageable bytes: a copy to the device from pageable
    host memory returns once it ran; from page-locked memory it returns at once."""
    dev = T.SimDevice(5e6)  # 1 MiB: 0.2 s
    stream = dev.new_stream()
    out = dev.empty(MiB, dev.current_stream())
    src = _bytes(MiB)
    assert not dev.is_pinned(src)
    t0 = time.monotonic()
    dev.copy(out, src, stream)
    assert time.monotonic() - t0 >= 0.19
    pinned = dev.pinned_empty(MiB)
    pinned.copy_(_bytes(MiB, 1))
    assert dev.is_pinned(pinned)
    t0 = time.monotonic()
    dev.copy(out, pinned, stream)
    assert time.monotonic() - t0 < 0.1
    dev.synchronize(dev.record(stream))
    assert torch.equal(out, pinned)


def test_pageable_sources_go_through_pinned_memory():
    """Note [pageable sources]: a storage read back into a one-off mapping (not the pool, not
    page-locked) is copied on the host into pinned memory first, so staging it ahead does not
    hold the host for the copy, and its bytes arrive."""
    dev = T.SimDevice(5e6)  # 1 MiB: 0.2 s
    tr = T.Transfers(dev, HUGE)
    host = _bytes(MiB)
    t0 = time.monotonic()
    pair = tr.to_device(host, wait=False)
    assert time.monotonic() - t0 < 0.1
    host.zero_()  # the one-off mapping may go at once: the copy reads the pinned bytes
    assert torch.equal(tr.use(pair), _bytes(MiB))
    tr.end_of_backward()


@pytest.mark.parametrize("pool_mib", [64, 4])
def test_only_one_off_buffers_are_staged_through_pinned_memory(pool_mib, tmp_path):
    """Through the public API on the NVMe tier and the simulated link: storages read back into
    the pool (page-locked) go to the device as they are; with a 4 MiB pool each 4 MiB storage
    goes in pieces and is gathered into a one-off mapping, which goes through pinned memory
    (Note [pageable sources]). Gradients bitwise either way."""
    model, x = _chain(n=6, width=1024), torch.randn(1024, 1024)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    bw = 4e9 + pool_mib  # a link of this test's own
    ctx = spillover.offload_context("nvme", sim_link_bandwidth=bw, min_offload_bytes=0,
                                    host_pool_bytes=pool_mib * MiB, nvme_path=str(tmp_path))
    tr = T.transfers_for("cpu", sim_bandwidth=bw)
    before = tr.pageable_staged
    with ctx:
        loss = model(x).sum()
    ctx.synchronize()
    loss.backward()
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(p.grad, r)
    s = ctx.stats()
    staged = tr.pageable_staged - before
    if pool_mib == 64:
        assert s.overflow_reads == 0 and s.tensors_chunked == 0 and staged == 0, (s, staged)
    else:
        assert s.tensors_chunked > 0 and staged >= s.tensors_chunked, (s, staged)


def _chain(n=16, width=512):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                     torch.nn.ReLU()) for _ in range(n)])


def test_offload_context_backward_peak_with_a_lagging_device():
    """Through the public API on the simulated device whose compute runs 0.4 s behind: the
    device bytes backward brings back stay near one layer's, and gradients are bitwise."""
    model, x = _chain(), torch.randn(512, 512)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    bw = 3e9 + 7  # a device of this test's own (the link's cache is per bandwidth and lag)
    ctx = spillover.offload_context("host", sim_link_bandwidth=bw, sim_compute_lag=0.4,
                                    min_offload_bytes=0, host_pool_bytes=64 * MiB,
                                    copy_inflight_bytes=2 * MiB)
    with ctx:
        loss = model(x).sum()
    ctx.synchronize()  # every copy landed: backward brings each tensor back over the link
    dev = T.transfers_for("cpu", sim_bandwidth=bw, sim_lag=0.4, cap_bytes=2 * MiB).dev
    dev.reset_peaks()
    loss.backward()
    for p, r in zip(model.parameters(), ref):
        assert torch.equal(p.grad, r)
    s = ctx.stats()
    assert s.tensors_unpacked >= 16 and s.unpacks_from_source == 0
    # each layer saves 1 MiB (its input; ReLU its output); one layer's and the staged ahead
    assert dev.peak_live_bytes() <= 8 * MiB, dev.peak_live_bytes() / MiB


def test_full_pool_waits_for_the_device_once_per_step(monkeypatch):
    """Host tier without swap: once the pool is full after its copies landed, later packs keep
    their tensors without waiting for the device again. (Read as a defect -- "every later pack
    synchronises" --, it was not one: the first full pack drains the copies in flight and no
    pack starts one after it; this keeps it so, and the pool-full step no longer tries to grow
    the pool at every later pack either.)"""
    waits = []
    sync = T.Transfers.synchronize

    def counting(self, *a, **k):
        waits.append(1)
        return sync(self, *a, **k)

    monkeypatch.setattr(T.Transfers, "synchronize", counting)
    ctx = spillover.offload_context("host", sim_link_bandwidth=2e9 + 11, min_offload_bytes=0,
                                    host_pool_bytes=4 * MiB)
    xs = [torch.full((MiB // 4,), float(i)) for i in range(16)]
    with ctx:
        hs = [ctx.pack(x) for x in xs]
    s = ctx.stats()
    assert s.tensors_offloaded == 4 and s.bytes_kept_pool_full == 12 * MiB
    assert len(waits) == 1, len(waits)
    for h, x in zip(hs, xs):
        assert torch.equal(ctx.unpack(h), x)


def test_graph_capture_queries_no_event(monkeypatch):
    """Entering and leaving the context while a CUDA graph is being captured queries no event
    (that would invalidate the capture): pack passes through, exit reaps nothing."""
    from spillover.activations import registry

    ctx = spillover.offload_context("host", sim_link_bandwidth=2e9 + 13, min_offload_bytes=0,
                                    host_pool_bytes=8 * MiB)
    x = torch.randn(MiB // 4, requires_grad=True)
    with ctx:  # a first step makes the link
        (x * 2).sigmoid().sum().backward()

    def refuse(*a, **k):
        raise AssertionError("an event was queried under capture")

    monkeypatch.setattr(registry, "capturing", lambda: True)
    monkeypatch.setattr(T.Transfers, "reap", refuse)
    monkeypatch.setattr(T.Transfers, "stall_seconds", property(refuse))
    with ctx:
        pass


def test_autocast_weight_casts_stay_on_the_device():
    """Under autocast the bf16 copy of each weight is saved by the matmul: it is the weight,
    cast, remade every step; kept (as a parameter), not offloaded."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 1024)
    x = torch.randn(512, 1024, requires_grad=True)  # so the matmul saves the weight's cast
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=64 * MiB)
    with ctx, torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    s = ctx.stats()
    # the weight's cast (2 MiB in bf16) is kept as a parameter; the input's cast is offloaded
    assert s.bytes_kept_parameter >= 2 * MiB, s
    assert s.bytes_offloaded == 1 * MiB, s


@pytest.mark.parametrize("tier", ["host", "nvme", "nvme-small", "nvme-pieces"])
@pytest.mark.parametrize("link", ["cpu", "sim", "sim-lagging"])
def test_everything_released_by_the_end_of_backward(tier, link, tmp_path):
    """Right after backward (no synchronize): no source held, no copy in flight, no device
    tensor kept, the pool empty once autograd's handles are collected (a host view held for an
    H2D copy would keep its block in use); the bytes in flight never passed the cap. With
    "nvme-pieces" every storage goes in pieces and comes back gathered into a one-off mapping,
    which a simulated link stages through pinned memory when the source is gone (Note [pageable
    sources])."""
    import gc

    torch.manual_seed(0)
    model, x = _chain(), torch.randn(512, 512)
    cap = 4 * MiB
    bw = {"cpu": None, "sim": 2e9 + 17, "sim-lagging": 2e9 + 19}[link]
    lag = 0.2 if link == "sim-lagging" else 0.0
    kw = dict(min_offload_bytes=0, host_pool_bytes=64 * MiB + 7 * 4096, copy_inflight_bytes=cap)
    if bw:
        kw.update(sim_link_bandwidth=bw, sim_compute_lag=lag)
    if tier == "nvme-small":  # a pool the step overflows: storages written from the tensors
        tier, kw["host_pool_bytes"] = "nvme", 4 * MiB + 7 * 4096
    if tier == "nvme-pieces":  # each 1 MiB storage over half the pool: in pieces, gathered
        tier, kw["host_pool_bytes"] = "nvme", MiB + 7 * 4096
    if tier == "nvme":
        kw["nvme_path"] = str(tmp_path)
    ctx = spillover.offload_context(tier, **kw)
    for _ in range(2):
        with ctx:
            loss = model(x).sum()
        loss.backward()
        del loss
        gc.collect()
        tr = T.transfers_for("cpu", sim_bandwidth=bw, sim_lag=lag, cap_bytes=cap)
        s = ctx.stats()
        assert s.tensors_unpacked >= 16
        assert (tr.bytes_held, tr.bytes_in_flight, tr.device_tensors_held) == (0, 0, 0)
        assert s.pool_in_use == 0 and s.swap_in_use == 0
        assert s.bytes_in_flight_peak <= cap
