"""Note [no panic across the boundary] (rust/py/errors.rs) and Note [plans are snapshots]
(rust/tier/mod.rs), seen from Python: an engine panic is a catchable ``spillover.InternalError``
that fails the step which hit it and leaves the next step bitwise; one storage saved through
several views on the NVMe tier trains for many steps (it panicked in the second step)."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise, gpt_step

import spillover


def nvme(tmp_path, pool, **kw):
    return spillover.offload_context(
        "nvme", host_pool_bytes=pool, nvme_path=str(tmp_path), io_engine="threads", **kw
    )


def test_engine_panic_is_an_internal_error_and_the_next_step_works(tiny_gpt, tmp_path):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    c = nvme(tmp_path, (2 << 20) + 7 * 4096, min_offload_bytes=0)
    assert_bitwise(gpt_step(model, batch, c), ref)
    idx, tgt = batch
    model.zero_grad(set_to_none=True)
    with c:
        loss = model(idx, tgt)
    c.synchronize()
    c._tier.spill_all()  # backward must ask the engine for the bytes
    c._tier.inject_panic(1)
    with pytest.raises(spillover.InternalError) as e:
        loss.backward()
    # A plain `except Exception` (HF Trainer's, Lightning's) catches it; it says what to do.
    assert isinstance(e.value, Exception) and isinstance(e.value, spillover.SpilloverError)
    assert "injected panic" in str(e.value) and "report" in str(e.value)
    del loss, e
    for _ in range(3):  # the tier is usable: the next steps are bitwise
        assert_bitwise(gpt_step(model, batch, c), ref)


def rmsnorm_chain(x, ws):
    y = x
    for w in ws:
        # One storage saved through several views: `y` by pow and by mul, the rsqrt output
        # broadcast (an expand of it) by mul.
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
        y = y @ w
    return y.square().mean()


@pytest.mark.parametrize("pool", ["4MiB", "6MiB"])
def test_views_of_one_storage_train_for_many_steps(tmp_path, pool):
    torch.manual_seed(0)
    x = torch.randn(1024, 256, requires_grad=True)
    ws = [torch.randn(256, 256, requires_grad=True) for _ in range(8)]
    leaves = [x, *ws]

    def grads(ctx):
        for t in leaves:
            t.grad = None
        if ctx is None:
            loss = rmsnorm_chain(x, ws)
        else:
            with ctx:
                loss = rmsnorm_chain(x, ws)
        loss.backward()
        return [t.grad.clone() for t in leaves]

    ref = grads(None)
    c = nvme(tmp_path, pool, min_offload_bytes=4096)
    for _ in range(6):
        assert_bitwise(grads(c), ref)
    s = c.stats(total=True)
    assert s.bytes_offloaded_nvme > 0 and s.prefetch_hits > 0
