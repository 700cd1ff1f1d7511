"""Host tier: gradients bitwise equal to no offload, and the sharp edges (views, dtypes,
retain_graph, threads, nesting, abandoned steps, pool exhaustion, verification)."""

import gc
import threading

import numpy as np
import pytest
import torch
from conftest import assert_bitwise, clone_model, gpt_step, grads

import spillover
from spillover.models import synthetic_batch


def ctx(**kw):
    kw.setdefault("min_offload_bytes", 0)
    kw.setdefault("host_pool_bytes", "256MiB")
    return spillover.offload_context("host", **kw)


@pytest.mark.parametrize("outside", [True, False], ids=["backward-outside", "backward-inside"])
def test_gpt_gradients_bitwise(tiny_gpt, outside):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    c = ctx()
    got = gpt_step(model, batch, c, outside=outside)
    assert_bitwise(ref, got)
    s = c.stats()
    assert s.bytes_offloaded_host > 0 and s.tensors_offloaded > 10
    assert s.tensors_unpacked >= s.tensors_offloaded
    assert s.bytes_kept_parameter > 0  # weights stay where they are


def test_default_threshold_keeps_small_tensors(tiny_gpt):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    c = spillover.offload_context("host", host_pool_bytes="256MiB", min_offload_bytes="64KiB")
    assert_bitwise(ref, gpt_step(model, batch, c))
    s = c.stats()
    assert s.bytes_kept_small > 0 and s.bytes_offloaded_host > 0


def test_bf16_gpt(tiny_gpt):
    model, batch = tiny_gpt
    model = model.to(torch.bfloat16)
    ref = gpt_step(model, batch)
    c = ctx()
    assert_bitwise(ref, gpt_step(model, batch, c))
    assert c.stats().bytes_offloaded_host > 0


def test_views_of_one_storage_are_offloaded_once():
    torch.manual_seed(1)
    x = torch.randn(64, 64, requires_grad=True)
    w1, w2, w3 = (torch.randn(64, 64, requires_grad=True) for _ in range(3))
    w4 = torch.randn(3, 64, 64, requires_grad=True)

    def f():
        h = x * 2.0  # one storage, saved below through four different views
        return ((h.t() * w1).sum() + (h[1:] * w2[1:]).sum()
                + (h.expand(3, 64, 64) * w4).sum() + (h[:, ::2] * w3[:, ::2]).sum())

    f().backward()
    ref = [t.grad.clone() for t in (x, w1, w2, w3, w4)]
    for t in (x, w1, w2, w3, w4):
        t.grad = None
    c = ctx()
    with c:
        loss = f()
    loss.backward()
    assert_bitwise(ref, [t.grad for t in (x, w1, w2, w3, w4)])
    s = c.stats()
    assert s.storages_deduplicated >= 3, s
    assert s.bytes_offloaded_host == 64 * 64 * 4  # h once; x and w* are leaves


def test_index_and_mask_tensors_saved_by_ops():
    torch.manual_seed(2)
    src = torch.randn(256, 512, requires_grad=True)
    idx = torch.randint(0, 512, (256, 64))
    mask_src = torch.randn(256, 512)

    def f():
        h = src * 1.5
        picked = torch.gather(h, 1, idx)  # saves int64 idx
        mask = mask_src > 0  # bool mask made in forward
        kept = torch.where(mask, h, torch.zeros(()))  # saves the bool mask
        return picked.sum() + (kept * kept).sum()

    f().backward()
    ref = src.grad.clone()
    src.grad = None
    c = ctx()
    seen = []
    orig = c._pack

    def spy(t):
        r = orig(t)
        seen.append((t.dtype, isinstance(r, torch.Tensor)))
        return r

    c._pack = spy
    with c:
        loss = f()
    loss.backward()
    assert torch.equal(src.grad, ref)
    assert (torch.int64, False) in seen, seen  # offloaded, not kept
    assert (torch.bool, False) in seen, seen


def test_retain_graph_unpacks_twice(tiny_gpt):
    model, (idx, tgt) = tiny_gpt
    model.zero_grad()
    loss = model(idx, tgt)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = grads(model)
    model.zero_grad()
    c = ctx()
    with c:
        loss = model(idx, tgt)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise(ref, grads(model))
    s = c.stats()
    assert s.tensors_unpacked >= 2 * s.tensors_offloaded


def test_three_threads_each_with_their_own_context(tiny_gpt):
    model, batch = tiny_gpt
    models = [clone_model(model) for _ in range(3)]
    batches = [synthetic_batch(model.cfg, batch=4, seed=s) for s in range(3)]
    refs = [gpt_step(m, b) for m, b in zip(models, batches)]
    results, errors = [None] * 3, []

    def work(i):
        try:
            for _ in range(3):
                results[i] = gpt_step(models[i], batches[i], ctx())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for r, g in zip(refs, results):
        assert_bitwise(r, g)


def test_nested_contexts(tiny_gpt):
    model, (idx, tgt) = tiny_gpt
    ref = gpt_step(model, (idx, tgt))
    model.zero_grad(set_to_none=True)
    outer, inner = ctx(), ctx()
    with outer:
        x = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
        x = model.blocks[0](x)
        with inner:
            x = model.blocks[1](x)
        loss = torch.nn.functional.cross_entropy(
            model.head(model.ln_f(x)).flatten(0, 1), tgt.flatten()
        )
    loss.backward()
    assert_bitwise(ref, grads(model))
    assert outer.stats().bytes_offloaded_host > 0
    assert inner.stats().bytes_offloaded_host > 0


def test_abandoned_steps_free_everything(tiny_gpt, private_pool_bytes):
    model, (idx, tgt) = tiny_gpt
    for _ in range(3):
        c = ctx(host_pool_bytes=private_pool_bytes)
        with c:
            loss = model(idx, tgt)
        assert c.stats().pool_in_use > 0
        del loss  # forward without backward: the graph (and its handles) go away
        c.synchronize()
        gc.collect()
        st = c.stats()
        assert st.pool_in_use == 0, st
    # after a completed step too
    c = ctx(host_pool_bytes=private_pool_bytes)
    gpt_step(model, (idx, tgt), c)
    c.synchronize()
    gc.collect()
    assert c.stats().pool_in_use == 0
    assert c.stats().pool_peak > 0


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_saved_tensor_freed_once_copied(tier, private_pool_bytes, tmp_path):
    """Note [sources held] (rust/link/mod.rs): the original goes when its copy is done,
    without anyone polling the copy -- the last tensors of a forward must not stay beside their
    copies until backward (they did: 32 MiB of logits on the GPT benchmark)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    x = torch.randn(1 << 20, requires_grad=True)
    c = spillover.offload_context(tier, min_offload_bytes=0, host_pool_bytes=private_pool_bytes,
                                  nvme_path=str(tmp_path))
    with c:
        y = x.exp()  # saves its output
    ref = StorageWeakRef(y.untyped_storage())
    total = y.sum()
    del y
    c.synchronize()
    assert ref.expired()
    total.backward()
    assert torch.equal(x.grad, x.detach().exp())


def test_pool_full_keeps_tensors_in_place(tiny_gpt):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    c = ctx(host_pool_bytes="1MiB")
    assert_bitwise(ref, gpt_step(model, batch, c))
    s = c.stats()
    assert s.bytes_kept_pool_full > 0 and s.bytes_offloaded_host > 0


def test_module_buffers_are_kept():
    class Scaled(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("scale", torch.randn(256, 256))

        def forward(self, x):
            y = x * self.scale  # saves the buffer (x needs no saving: scale needs no grad)
            return (y * y).sum()  # saves y

    m = Scaled()
    x = torch.randn(256, 256, requires_grad=True)
    c = ctx()
    with c:
        h = x * 1.0
        loss = m(h)
    loss.backward()
    s = c.stats()
    assert s.bytes_kept_parameter == 256 * 256 * 4, s  # the buffer, saved by mul, stays put
    assert s.bytes_offloaded_host == 256 * 256 * 4  # y goes


def test_keep_marks_a_tensor():
    x = torch.randn(256, 256, requires_grad=True)
    c = ctx()
    with c:
        h = spillover.keep(x * 2.0)
        loss = (h * h).sum()
    loss.backward()
    assert torch.equal(x.grad, 8.0 * x.detach())
    s = c.stats()
    assert s.bytes_kept_marked > 0 and s.bytes_offloaded_host == 0


def test_verify_detects_corruption():
    x = torch.randn(512, 512, requires_grad=True)
    c = ctx(verify=True)
    packed = []
    orig = c._pack
    c._pack = lambda t: packed.append(orig(t)) or packed[-1]
    with c:
        h = x * 3.0
        loss = (h * h).sum()
    entries = [p.stored.entry for p in packed if not isinstance(p, torch.Tensor)]
    assert entries
    c.synchronize()
    view = entries[0].try_get()
    np.asarray(view)[100] ^= 0xFF  # flip bits behind spillover's back
    del view
    with pytest.raises(spillover.IntegrityError, match="checksum"):
        loss.backward()


def test_verify_passes_when_untouched(tiny_gpt):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    assert_bitwise(ref, gpt_step(model, batch, ctx(verify=True)))


def test_context_is_reusable_but_not_reentrant():
    c = ctx()
    with c:
        pass
    # once per step, any number of times (test_context_reuse.py), but not nested
    with c, pytest.raises(RuntimeError, match="already active on this thread"):
        c.__enter__()


@pytest.mark.parametrize("when", ["during-forward", "after-forward"])
def test_inplace_after_save_is_an_error(when):
    # Without hooks autograd raises here; under saved_tensors_hooks it cannot see the change, so
    # spillover must (Note [in-place after pack]) instead of returning torn or stale bytes.
    x = torch.randn(1024, 1024, requires_grad=True)
    with ctx():
        h = x * 2
        y = h.sigmoid()  # saves its output y
        z = (y * 1.0).sum()
        if when == "during-forward":
            y.mul_(2)
    if when == "after-forward":
        y.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_a_storage_written_after_its_pack_is_packed_again():
    """One step saves ``a`` (for ``y``, whose backward never runs), writes ``a`` in place, and
    saves it again (for ``z``): the second save must be the written bytes, not a view of the
    first save's copy (a dedup by storage address alone handed back the stale bytes)."""
    torch.manual_seed(0)
    x = torch.randn(64, 256, requires_grad=True)

    def step(ctx=None):
        x.grad = None
        with ctx if ctx is not None else torch.enable_grad():
            a = x * 2
            y = a.sin()  # saves a; y's backward never runs
            a.mul_(3)
            z = a.cos().sum()  # saves a again, written
        z.backward()
        del y
        return x.grad.clone()

    ref = step()
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=16 << 20)
    for _ in range(2):
        assert torch.equal(step(ctx), ref)
    assert ctx.stats(total=True).tensors_offloaded > 0
