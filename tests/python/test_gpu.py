"""CUDA paths: side streams, events, pinned registration, bitwise parity on the device.
Skipped without CUDA; benches/gpu/run.sh runs them on a GPU host."""

import pytest
import torch
from conftest import assert_bitwise, gpt_step

import spillover
from spillover import _runtime
from spillover.models import GPT, GPTConfig, synthetic_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def cuda_gpt(dtype=torch.float32):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=256, n_heads=8, n_layers=3, seq=256)
    model = GPT(cfg).cuda().to(dtype)
    idx, tgt = synthetic_batch(cfg, batch=4, device="cuda")
    return model, (idx, tgt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_parity_on_cuda(dtype):
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    model, batch = cuda_gpt(dtype)
    ref = gpt_step(model, batch)
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="1GiB")
    got = gpt_step(model, batch, c)
    torch.cuda.synchronize()
    assert_bitwise(ref, got)
    s = c.stats()
    assert s.bytes_offloaded_host > 0 and s.tensors_unpacked >= s.tensors_offloaded


def test_pool_is_registered_with_cuda():
    c = spillover.offload_context("host", host_pool_bytes="256MiB")
    with c:
        pass
    assert _runtime.register_with_cuda(c._pool) is True


def test_no_device_synchronize_on_the_compute_path():
    model, (idx, tgt) = cuda_gpt()
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="1GiB")
    gpt_step(model, (idx, tgt), spillover.offload_context("host", host_pool_bytes="1GiB"))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with c:
            loss = model(idx, tgt)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_source_memory_is_not_reused_before_its_copy_completes():
    # Note [source lifetime]: after pack, forward drops its references and the caching allocator
    # would hand the bytes to the next allocation; the copy must still read the old values.
    torch.manual_seed(0)
    x = torch.randn(4096, 4096, device="cuda", requires_grad=True)
    def f():
        h = (x * 2.0).sin()  # sin saves its input (x*2.0), which forward then forgets
        junk = [torch.full((4096, 4096), 7.0, device="cuda") for _ in range(4)]
        del junk
        return h.sum()
    f().backward()
    ref = x.grad.clone()
    x.grad = None
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="1GiB")
    with c:
        loss = f()
    loss.backward()
    torch.cuda.synchronize()
    assert torch.equal(ref, x.grad)
    assert c.stats().bytes_offloaded_host >= 4096 * 4096 * 4
