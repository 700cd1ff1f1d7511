"""The GPU's checks of stream ordering: bitwise gradients with offload and reload on side streams
(test_stream_gradients_bitwise[host] also runs under TORCH_CUDA_SANITIZER=1 in
benches/gpu/run.sh, which says why only that one), no synchronize on the compute path, source
memory not reused before its copy completes. Skip markers, dry run (GPU_DRY_RUN=1), fixtures and
helpers: _gpu_common.py.
"""

from __future__ import annotations

import os

import pytest
import torch
from _gpu_common import (
    CUDA,
    DEV,
    MARKS,
    GiB,
    MiB,
    differing,
    figure,
    fmt,
    gpt,
    need_cuda,
    offload,
    pool_bytes,
    step,
    sync,
)

import spillover

pytestmark = MARKS
__all__ = ["figure"]  # the fixture: pytest finds it in this module's namespace


# ---- stream ordering (also under TORCH_CUDA_SANITIZER=1) ----------------------------------------


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_stream_gradients_bitwise(tier, figure, tmp_path):
    """Offload and reload on side streams, the compute stream using each tensor as soon as it is
    back: bitwise gradients (without deterministic mode: under the sanitizer a race is found
    as such, and kernels of these shapes are deterministic anyway)."""
    model, batch = gpt()
    ref = step(model, batch)
    ctx = offload(tier, pool_bytes(64 * MiB), tmp_path)
    bad = differing(ref, step(model, batch, ctx))
    s = ctx.stats()
    figure(f"gradients {'✓' if not bad else f'✗ {bad}'}; "
           f"{s.tensors_offloaded} tensors offloaded, {s.tensors_unpacked} unpacked; "
           f"sanitizer {'on' if os.environ.get('TORCH_CUDA_SANITIZER') else 'off'}")
    assert not bad


def test_stream_no_device_synchronize_on_the_compute_path(figure):
    """Forward and backward under offload with torch's sync debug mode set to error: no
    device-wide or stream synchronize on the compute path."""
    need_cuda("torch.cuda.set_sync_debug_mode")
    model, (idx, tgt) = gpt()
    pool = pool_bytes(256 * MiB)
    step(model, (idx, tgt), spillover.offload_context("host", host_pool_bytes=pool))  # warm-up
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with c:
            loss = model(idx, tgt)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    figure(f"{c.stats().tensors_offloaded} tensors offloaded and back, no synchronize")


def test_stream_source_memory_is_not_reused_before_its_copy_completes(figure):
    # Note [sources held] (rust/link/mod.rs): after pack, forward drops its references and the
    # caching allocator would hand the bytes to the next allocation; the copy must still read the
    # old values.
    n = 4096 if CUDA else 512
    torch.manual_seed(0)
    x = torch.randn(n, n, device=DEV, requires_grad=True)

    def f():
        h = (x * 2.0).sin()  # sin saves its input (x*2.0), which forward then forgets
        junk = [torch.full((n, n), 7.0, device=DEV) for _ in range(4)]
        del junk
        return h.sum()

    f().backward()
    ref = x.grad.clone()
    x.grad = None
    pool = pool_bytes(GiB if CUDA else 64 * MiB)
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=pool)
    with c:
        loss = f()
    loss.backward()
    sync()
    same = torch.equal(ref, x.grad)
    figure(f"gradient {'✓' if same else '✗'} with the source's memory reallocated at once; "
           f"{fmt(c.stats().bytes_offloaded_host)} offloaded")
    assert same
    assert c.stats().bytes_offloaded_host >= n * n * 4
