"""One offload_context entered once per step (Note [one context, many steps] in
activations/registry.py): gradients bitwise equal to no offload on every step, per-step counters
that add up to the total, re-entry while active refused, gradient accumulation, and nothing held
once a step's graph is gone."""

import dataclasses
import gc
import threading
import weakref

import pytest
from conftest import assert_bitwise, clone_model, drained, gpt_step, grads

import spillover
from spillover.models import synthetic_batch

TIERS = ["host", "nvme"]


#: The host tests' pool: roomy for the tiny GPT, and one capacity for the whole file (a pool
#: is made once per capacity and kept for the process: a fresh 200 MiB one per test adds up).
HOST_POOL = (64 << 20) + 5 * 4096


def make(tier, tmp_path, pool):
    """A host context with a roomy pool, or an NVMe one with a pool of about 1 MiB (the tiny
    GPT saves several MiB, so most of it goes to disk); ``pool`` makes the NVMe capacity one
    no other test uses."""
    if tier == "host":
        return spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=HOST_POOL)
    small = (1 << 20) + pool % (1 << 16)
    return spillover.offload_context("nvme", min_offload_bytes=0, host_pool_bytes=small,
                                     nvme_path=str(tmp_path))


def settled(ctx, total=False):
    """Stats once the tier's writes and the copies in flight are over."""
    ctx.synchronize()
    gc.collect()
    return ctx.stats(total=total)


COUNTERS = [f.name for f in dataclasses.fields(spillover.OffloadStats)
            if f.name not in ("_lock", "pool_peak", "pool_in_use", "pool_capacity",
                              "swap_in_use", "bytes_in_flight_peak", "stall_seconds")]


@pytest.mark.parametrize("tier", TIERS)
def test_one_context_three_steps_bitwise(tier, tiny_gpt, tmp_path, private_pool_bytes):
    model, _ = tiny_gpt
    batches = [synthetic_batch(model.cfg, batch=4, seed=s) for s in range(3)]
    refs = [gpt_step(model, b) for b in batches]
    ctx = make(tier, tmp_path, private_pool_bytes)
    assert ctx.stats(total=True).steps == 0
    per = []
    for i, (b, ref) in enumerate(zip(batches, refs)):
        assert_bitwise(ref, gpt_step(model, b, ctx))
        s = settled(ctx)
        assert s.steps == 1 and ctx.steps == i + 1
        assert s.tensors_offloaded > 10 and s.tensors_unpacked >= s.tensors_offloaded, s
        if tier == "nvme":
            assert s.bytes_offloaded_nvme > 0, s
        per.append(s)
    total = settled(ctx, total=True)
    assert total.steps == 3
    for name in COUNTERS:
        assert getattr(total, name) == sum(getattr(s, name) for s in per), name
    assert total.stall_seconds == pytest.approx(sum(s.stall_seconds for s in per), abs=1e-6)
    assert total.bytes_in_flight_peak == max(s.bytes_in_flight_peak for s in per)
    # The same model and batch give the same counts step after step.
    assert per[0].bytes_packed == per[1].bytes_packed == per[2].bytes_packed
    assert drained(ctx) == (0, 0)


def test_stats_are_the_latest_step(tiny_gpt, private_pool_bytes, tmp_path):
    model, batch = tiny_gpt
    ctx = make("host", tmp_path, private_pool_bytes)
    gpt_step(model, batch, ctx)
    first = settled(ctx)
    with ctx:
        loss = model(*batch)
    mid = ctx.stats()  # step 2: its forward only
    assert mid.steps == 1 and mid.tensors_packed == first.tensors_packed
    assert mid.tensors_unpacked == 0
    loss.backward()
    assert ctx.stats().tensors_unpacked == first.tensors_unpacked
    assert ctx.stats(total=True).tensors_unpacked == 2 * first.tensors_unpacked


def test_reentering_while_active_raises(tiny_gpt, private_pool_bytes, tmp_path):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    ctx = make("host", tmp_path, private_pool_bytes)
    model.zero_grad(set_to_none=True)
    with ctx:
        with pytest.raises(RuntimeError, match="already active on this thread"):
            ctx.__enter__()
        loss = model(*batch)
    loss.backward()
    assert_bitwise(ref, grads(model))
    assert ctx.steps == 1  # the refused entry began no step
    assert_bitwise(ref, gpt_step(model, batch, ctx))  # and the context still works
    assert ctx.steps == 2


def test_another_thread_may_enter_while_active(tiny_gpt, private_pool_bytes, tmp_path):
    model, batch = tiny_gpt
    other = clone_model(model)
    ref = gpt_step(model, batch)
    ctx = make("host", tmp_path, private_pool_bytes)
    got, errors = [], []
    model.zero_grad(set_to_none=True)

    def work():
        try:
            got.append(gpt_step(other, batch, ctx))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    with ctx:
        loss = model(*batch)
        t = threading.Thread(target=work)
        t.start()
        t.join(timeout=120)
    loss.backward()
    assert not errors, errors
    assert_bitwise(ref, grads(model))
    assert_bitwise(ref, got[0])
    assert settled(ctx, total=True).steps == 2


def two_micro_batches(model, b1, b2, ctx, interleaved):
    """Gradients accumulated over two micro-batches: forward 1, backward 1, forward 2,
    backward 2 -- or, ``interleaved``, forward 1, forward 2, then both backwards."""
    model.zero_grad(set_to_none=True)

    def fwd(b):
        if ctx is None:
            return model(*b)
        with ctx:
            return model(*b)

    if interleaved:
        l1 = fwd(b1)
        l2 = fwd(b2)
        l1.backward()
        l2.backward()
    else:
        fwd(b1).backward()
        fwd(b2).backward()
    return grads(model)


@pytest.mark.parametrize("interleaved", [False, True], ids=["fwd-bwd-fwd-bwd", "fwd-fwd-bwd-bwd"])
@pytest.mark.parametrize("tier", TIERS)
def test_gradient_accumulation(tier, interleaved, tiny_gpt, tmp_path, private_pool_bytes):
    model, _ = tiny_gpt
    b1, b2 = (synthetic_batch(model.cfg, batch=4, seed=s) for s in (1, 2))
    ref = two_micro_batches(model, b1, b2, None, interleaved)
    ctx = make(tier, tmp_path, private_pool_bytes)
    for _ in range(2):  # two optimizer steps' worth, one context
        assert_bitwise(ref, two_micro_batches(model, b1, b2, ctx, interleaved))
    total = settled(ctx, total=True)
    assert total.steps == 4 and total.tensors_unpacked >= total.tensors_offloaded > 0
    assert drained(ctx) == (0, 0)


def test_finished_steps_are_let_go(tiny_gpt, private_pool_bytes, tmp_path):
    """A step's record (and its tier step) goes once its graph is gone and a later step began;
    an abandoned step frees everything too."""
    model, batch = tiny_gpt
    ctx = make("host", tmp_path, private_pool_bytes)
    gpt_step(model, batch, ctx)
    first = weakref.ref(ctx._last)
    with ctx:
        loss = model(*batch)
    del loss  # abandoned: no backward
    gc.collect()
    gpt_step(model, batch, ctx)
    gc.collect()
    assert first() is None
    assert ctx.stats(total=True).steps == 3
    assert len(ctx._records) == 1  # only the latest step is kept
    assert drained(ctx) == (0, 0)
