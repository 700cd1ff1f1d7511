"""The GPU's checks of a training step under offload: bitwise gradients under deterministic
algorithms (with the reference against itself as a control), device memory back at its baseline
after backward, peak device memory under a link that cannot keep up, the NVMe tier through a
64 MiB pool. Skip markers, dry run (GPU_DRY_RUN=1), fixtures and helpers: _gpu_common.py.
"""

from __future__ import annotations

import contextlib
import gc
import time

import pytest
import torch
from _gpu_common import (
    CUDA,
    DEV,
    MARKS,
    GiB,
    MiB,
    deterministic,
    differing,
    drain,
    figure,
    fmt,
    gpt,
    offload,
    pool_bytes,
    step,
    sync,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

import spillover

pytestmark = MARKS
__all__ = ["deterministic", "figure"]  # fixtures: pytest finds them in this module's namespace


# ---- bitwise parity -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_control_reference_against_itself(dtype, deterministic, figure):
    """The control: the reference (no offload) run twice is bitwise equal to itself, so a ✗ in
    the parity tests means spillover, not a nondeterministic kernel."""
    model, batch = gpt(dtype)
    a, b = step(model, batch), step(model, batch)
    bad = differing(a, b)
    figure(f"{len(a)} gradients, {len(a) - len(bad)} bitwise equal across two reference runs")
    assert not bad, f"the reference differs from itself in gradients {bad}: kernels, not spillover"


@pytest.mark.parametrize("tier", ["host", "nvme", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_bitwise(tier, dtype, deterministic, figure, tmp_path):
    model, batch = gpt(dtype)
    ref, again = step(model, batch), step(model, batch)
    if differing(ref, again):
        pytest.skip("control failed: the reference differs from itself (see the control test)")
    # NVMe: a pool smaller than the activations, so entries go to disk and come back.
    pool = pool_bytes(256 * MiB if tier == "host" else 16 * MiB if CUDA else 2 * MiB)
    results = []
    for _ in range(2):  # the second step runs with the access order the first one learned
        ctx = offload(tier, pool, tmp_path)
        bad = differing(ref, step(model, batch, ctx))
        results.append((bad, ctx.stats()))
    s = results[-1][1]
    figure(f"{len(ref)} gradients; steps bitwise equal: "
           f"{', '.join('✓' if not b else f'✗ ({len(b)} differ)' for b, _ in results)}; "
           f"offloaded {fmt(s.bytes_offloaded_host)} host + {fmt(s.bytes_offloaded_nvme)} NVMe")
    for bad, _ in results:
        assert not bad, f"gradients {bad} differ from the reference"
    assert s.bytes_offloaded > 0 and s.tensors_unpacked >= s.tensors_offloaded



# ---- device memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "nvme", "auto"])
def test_memory_back_at_baseline_after_backward(tier, figure, tmp_path):
    """After backward, device memory is what it was before forward (gradients included) and the
    pool has every block back."""
    model, batch = gpt(big=True)
    step(model, batch)  # gradients exist from here on; backward accumulates into them
    model.zero_grad(set_to_none=False)
    ctx = offload(tier, pool_bytes(64 * MiB), tmp_path)
    gc.collect()
    sync()
    base = torch.cuda.memory_allocated() if CUDA else 0
    with ctx:
        loss = model(*batch)
    during = torch.cuda.memory_allocated() if CUDA else 0
    loss.backward()
    del loss
    used, waited = drain(ctx)
    after = torch.cuda.memory_allocated() if CUDA else 0
    s = ctx.stats()
    mem = (f"device memory {fmt(base)} before forward, {fmt(during)} after it, "
           f"{after - base:+d} B after backward" if CUDA else "device memory: needs CUDA")
    figure(f"{mem}; pool in use {fmt(used)} (after {waited:.2f} s; peak {fmt(s.pool_peak)}); "
           f"offloaded {fmt(s.bytes_offloaded_host)} host + {fmt(s.bytes_offloaded_nvme)} NVMe")
    assert s.bytes_offloaded > 0
    assert used == 0, f"{used} bytes of the pool still in use after backward"
    assert after == base, f"{after - base} bytes of device memory not returned after backward"


class Cheap(nn.Module):
    """A layer of elementwise ops: it saves two tensors of its input's size and computes next to
    nothing, so forward makes activations far faster than a PCIe link can move them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0001))

    def forward(self, x):
        return x + torch.sin(x * self.w)


def test_host_tier_peak_when_the_link_cannot_keep_up(figure):
    """Peak device memory (max_memory_allocated over a step, above the memory before it) of the
    host tier, against no offload and full checkpointing, in one run, on a model whose forward
    saves ~2 GiB in a few milliseconds (~40 ms of PCIe): the bound on copies in flight must hold
    the host tier well below no offload, in forward and in backward (each phase's peak is
    measured on its own: the counters are reset between them)."""
    layers, numel = (16, 16 * MiB) if CUDA else (4, MiB // 2)
    torch.manual_seed(0)
    model = nn.ModuleList(Cheap() for _ in range(layers)).to(DEV)
    x = torch.randn(numel, device=DEV, requires_grad=True)
    pool = pool_bytes(4 * GiB if CUDA else 64 * MiB)

    def run(mode):
        model.zero_grad(set_to_none=True)
        x.grad = None
        gc.collect()
        sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if CUDA else 0
        ctx = spillover.offload_context("host", host_pool_bytes=pool) if mode == "host" else None
        t0 = time.perf_counter()
        with ctx if ctx is not None else contextlib.nullcontext():
            h = x
            for layer in model:
                h = checkpoint(layer, h, use_reentrant=False) if mode == "full" else layer(h)
            loss = h.square().mean()
        fwd = time.perf_counter() - t0
        fwd_peak = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
        if CUDA:  # the allocator's counters are the host's: no synchronize needed to read them
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        if ctx is not None:
            ctx.synchronize()
        sync()
        dt = time.perf_counter() - t0
        bwd_peak = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
        return ((max(fwd_peak, bwd_peak), fwd_peak, bwd_peak), fwd, dt,
                (ctx.stats() if ctx is not None else None), x.grad.clone())

    run("host")  # warm-up: maps and registers the pool
    res = {m: run(m) for m in ("none", "full", "host")}
    s = res["host"][3]
    saved = 2 * layers * numel * 4
    assert torch.equal(res["none"][4], res["host"][4]), "host tier gradient differs"
    assert s.bytes_offloaded_host > 0
    if not CUDA:
        figure(f"CPU: ran none / full / host on {fmt(saved)} of activations, offloaded "
               f"{fmt(s.bytes_offloaded_host)} (peak device memory needs CUDA)")
        return
    (none, *none_fb), (full, *_), (host, *host_fb) = (res[m][0] for m in ("none", "full", "host"))
    figure(f"{fmt(saved)} saved in {res['none'][1] * 1e3:.1f} ms of forward; peak above "
           f"baseline: none {fmt(none)}, full checkpointing {fmt(full)}, host tier {fmt(host)} "
           f"({host / none:.2f}x none, {host / full:.2f}x full); forward / backward peaks: "
           f"host {fmt(host_fb[0])} / {fmt(host_fb[1])}, none {fmt(none_fb[0])} / "
           f"{fmt(none_fb[1])}; step {res['host'][2] * 1e3:.0f} ms vs none "
           f"{res['none'][2] * 1e3:.0f} ms, stalls {s.stall_seconds:.3f} s")
    assert host < 0.5 * none, "the host tier's peak is not well below no offload's"


def test_backward_frees_what_it_brought_back_in_stream_order(figure):
    """Note [backward's tensors in the compute pool]: backward's tensors brought back over the
    link are made in the pool of the stream that uses them and go as autograd lets go of them,
    not once the host has seen the compute stream pass them: with the host running ahead of a
    link-bound backward, nearly everything brought back stayed alive. Every copy has landed
    before backward, so every unpack crosses the link. The figure gives the reserved bytes
    backward added beside the allocated peak (made on the H2D stream, they had a pool of their
    own)."""
    layers, numel = (16, 16 * MiB) if CUDA else (4, MiB // 2)
    torch.manual_seed(0)
    model = nn.ModuleList(Cheap() for _ in range(layers)).to(DEV)
    x = torch.randn(numel, device=DEV, requires_grad=True)
    cap = 128 * MiB
    ctx = spillover.offload_context("host", host_pool_bytes=pool_bytes(4 * GiB if CUDA else
                                                                       64 * MiB),
                                    copy_inflight_bytes=cap)
    for _ in range(2):  # the first maps and registers the pool
        x.grad = None
        model.zero_grad(set_to_none=True)
        gc.collect()
        sync()
        with ctx:
            h = x
            for layer in model:
                h = layer(h)
            loss = h.square().mean()
        ctx.synchronize()
        sync()
        base = torch.cuda.memory_allocated() if CUDA else 0
        reserved = torch.cuda.memory_reserved() if CUDA else 0
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        sync()
        bwd = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
        bwd_reserved = (torch.cuda.max_memory_reserved() - reserved) if CUDA else 0
    s = ctx.stats()
    saved = 2 * layers * numel * 4
    assert s.bytes_offloaded_host > 0 and s.unpacks_from_source == 0
    if not CUDA:
        figure(f"CPU: offloaded {fmt(s.bytes_offloaded_host)}, unpacked "
               f"{s.tensors_unpacked} tensors (the backward peak needs CUDA)")
        return
    figure(f"backward peak above its start {fmt(bwd)} for {fmt(saved)} brought back "
           f"({bwd / saved:.2f}x), reserved memory it added {fmt(bwd_reserved)}; cap "
           f"{fmt(cap)}, stalls {s.stall_seconds:.3f} s")
    assert bwd < 0.5 * saved, "backward kept most of what it brought back alive"


def test_nvme_tier_64mib_pool_no_overflow_reads(deterministic, figure, tmp_path):
    """~400 MiB of activations through a 64 MiB pool on the NVMe tier: every read back finds a
    block in the pool (no temporary buffers), gradients bitwise equal to the reference."""
    model, batch = gpt(big=True)
    ref = step(model, batch)
    rows = []
    for _ in range(2):
        ctx = offload("nvme", pool_bytes(64 * MiB), tmp_path)
        t0 = time.perf_counter()
        bad = differing(ref, step(model, batch, ctx))
        rows.append((bad, ctx.stats(), time.perf_counter() - t0))
    s = rows[-1][1]
    figure(f"{fmt(s.bytes_packed)} packed, {fmt(s.bytes_offloaded_nvme)} to NVMe through "
           f"{fmt(s.pool_capacity)}; overflow reads {[r[1].overflow_reads for r in rows]}; "
           f"prefetch hits {s.prefetch_hits} / misses {s.prefetch_misses}, pool hits "
           f"{s.host_cache_hits}; stalls {s.stall_seconds:.3f} s; step {rows[-1][2]:.2f} s; "
           f"gradients {'✓' if not any(r[0] for r in rows) else '✗'}")
    assert s.bytes_offloaded_nvme > 0, "nothing went to disk: the test does not test the tier"
    assert all(r[1].overflow_reads == 0 for r in rows)
    assert not any(r[0] for r in rows), "gradients differ from the reference"
