"""Found running real model code: parameters recognised by identity, not by an address
remembered for ever (Note [parameters by identity] in activations/registry.py); a default pool that
grows from small and leaves with its context (Note [growing pool] in _growth.py); report() counting
what a recompute policy keeps (Note [kept by a policy]). Guardrails said once:
test_warn_once.py."""

from __future__ import annotations

import copy
import gc

import psutil
import pytest
import torch
from conftest import assert_bitwise, drained, gpt_step, grads

import spillover
from spillover import _growth, _pools, _runtime, _tiers
from spillover.models import GPT, GPTConfig, synthetic_batch

MiB = 1 << 20
N = 1024  # a 1024 x 1024 fp32 tensor: 4 MiB, the size of each weight below


def mlp():
    return torch.nn.Sequential(torch.nn.Linear(N, N, bias=False), torch.nn.GELU(),
                               torch.nn.Linear(N, N, bias=False))


def plain_grads(model, x):
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()
    return grads(model)


# ---- 1. parameters by identity ----------------------------------------------------------------


def test_a_reused_context_keeps_only_the_parameters_of_the_model_it_runs():
    """Six fresh models through one context, each made before the last is freed, so the
    allocator hands the freed weights' addresses to the next model's activations (checked:
    the scenario must happen for the test to mean anything). Per step autograd saves x, the
    GELU's input and output (activations, 12 MiB) and the second weight (4 MiB, as ``w.t()``);
    an address-keyed parameter set kept up to 12 MiB of activations as "parameters". (The
    GELU's output is shipped, not made again at unpack: Note [made again at unpack].)"""
    torch.manual_seed(0)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=256 * MiB,
                                    rederive=False)
    model = mlp()
    old_params: set = set()
    landed = 0
    for _ in range(6):
        x = torch.randn(N, N)
        acts = []
        hook = model[1].register_forward_hook(
            lambda mod, inp, out, acts=acts: acts.extend([inp[0].data_ptr(), out.data_ptr()]))
        with ctx:
            loss = model(x).sum()
        loss.backward()
        hook.remove()
        got = grads(model)
        assert_bitwise(plain_grads(model, x), got)  # after: the plain run must not move things
        landed += len(old_params & (set(acts) | {x.data_ptr()}))
        s = ctx.stats()
        assert s.bytes_kept_parameter == 4 * MiB, s  # the second weight, nothing else
        assert s.bytes_offloaded_host == 12 * MiB, s
        old_params |= {p.data_ptr() for p in model.parameters()}
        nxt = mlp()  # made first: the next step's activations take the freed weights' places
        del loss, x, got
        model, nxt = nxt, None  # the old model goes here
    assert landed, "no activation landed at a freed parameter's address: the test proved nothing"


def test_a_new_storage_at_a_dead_parameters_address_is_an_activation():
    """The same, made certain: tensors over one numpy buffer are new storages at one address.
    Model A's weight is such a storage; A is freed; model B's input is a new storage over the
    same bytes, saved by B's linear for its weight's gradient: an activation, offloaded."""
    torch.manual_seed(0)
    mem = torch.randn(N, N).numpy()
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=256 * MiB)
    a = torch.nn.Linear(N, N, bias=False)
    a.weight = torch.nn.Parameter(torch.from_numpy(mem))
    with ctx:
        loss = a(torch.randn(N, N)).sum()
    loss.backward()
    addr = a.weight.data_ptr()
    del a, loss
    b = torch.nn.Linear(N, N, bias=False)
    x = torch.from_numpy(mem)  # a new storage over the dead weight's bytes
    assert x.data_ptr() == addr
    ref = plain_grads(b, x)
    b.zero_grad(set_to_none=True)
    with ctx:
        loss = b(x).sum()
    loss.backward()
    assert_bitwise(ref, grads(b))
    s = ctx.stats()
    assert s.bytes_kept_parameter == 0 and s.bytes_offloaded_host == 4 * MiB, s


class Frozen(torch.nn.Module):
    """A frozen weight (LoRA's base), a buffer saved through a slice (a rotary table), a
    trainable weight."""

    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(N, N, bias=False).requires_grad_(False)
        self.register_buffer("table", torch.randn(2 * N, N))
        self.head = torch.nn.Linear(N, N, bias=False)

    def forward(self, x):
        h = self.base(x) * self.table[:N]  # mul saves the slice of the buffer
        return self.head(torch.tanh(h))


def test_frozen_weights_buffers_and_their_views_stay_on_the_device():
    torch.manual_seed(0)
    model = Frozen()
    x = torch.randn(N, N, requires_grad=True)
    ref = plain_grads(copy.deepcopy(model), x)
    ref_x, x.grad = x.grad, None
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=256 * MiB)
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        x.grad = None
        with ctx:
            loss = model(x).sum()
        loss.backward()
        assert_bitwise(ref, grads(model))
        assert torch.equal(ref_x, x.grad)
        s = ctx.stats()
        # kept: base.weight (as w.t(), for x's gradient; 4), the table's storage (8, saved as
        # a slice by mul), head.weight (4)
        assert s.bytes_kept_parameter == 16 * MiB, s
        # offloaded: tanh's output (saved by tanh, and by head as its input: one storage)
        assert s.bytes_offloaded_host == 4 * MiB and s.storages_deduplicated == 1, s


# ---- 2. a default pool grows from small, and goes with its context ---------------------------


@pytest.fixture
def default_pool(monkeypatch, private_pool_bytes):
    """No size from the user; a first pool of a capacity no other test leases."""
    monkeypatch.delenv("SPILLOVER_HOST_POOL_BYTES", raising=False)
    gc.collect()
    spillover.empty_cache()  # a new context starts on the largest pool the process keeps
    first = 16 * MiB + private_pool_bytes % (1 << 20)
    monkeypatch.setattr(_growth, "FIRST_POOL", first)
    return first


def rss():
    return psutil.Process().memory_info().rss


def test_a_default_pool_starts_small_is_kept_for_the_next_context_and_emptied(default_pool):
    """Note [the pool lives for the process]: the pool outlives its context (the next one
    starts on it, nothing mapped), and ``spillover.empty_cache()`` gives it back."""
    torch.manual_seed(0)
    model, x = mlp(), torch.randn(N, N)
    ref = plain_grads(copy.deepcopy(model), x)
    before = rss()
    ctx = spillover.offload_context("host", min_offload_bytes=0)
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).sum()
    loss.backward()
    assert_bitwise(ref, grads(model))
    s = ctx.stats()
    # (the GELU's output made again at unpack: Note [made again at unpack])
    assert s.bytes_offloaded_host + s.bytes_rederived == 12 * MiB, s
    assert s.bytes_kept_pool_full == 0, s
    assert s.pool_capacity == default_pool  # what the step used fitted: no growth
    assert "grows up to" in ctx.report()
    quarter = _runtime.node_memory().share // 4
    grew = rss() - before
    assert grew < min(quarter // 4, 256 * MiB), grew  # was a quarter of the node at once
    pool = ctx._pool
    assert _pools.POOLS.leased[default_pool][0] is pool
    del ctx, loss
    gc.collect()
    assert default_pool not in _pools.POOLS.leased and pool in _pools.POOLS.idle  # kept ...
    ctx = spillover.offload_context("host", min_offload_bytes=0)
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(x).sum()
    loss.backward()
    assert_bitwise(ref, grads(model))
    assert ctx._pool is pool and ctx.stats().pool_maps == 0  # ... for the next context
    del ctx, loss, pool
    gc.collect()
    assert spillover.empty_cache() >= default_pool
    assert default_pool not in _pools.POOLS.leased and not _pools.POOLS.idle  # gone ...
    assert rss() < before + grew - default_pool // 2  # ... and its pages with it


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_default_pool_grows_to_what_the_steps_hold(tier, default_pool, tmp_path):
    """A 2-layer GPT holds more than the 16 MiB first pool. Host tier: the first step grows it
    midway (nothing stays on the device for want of room); NVMe tier: the first step spills to
    disk. The second starts on a pool sized for what the first held, and the pools grown past
    go back once their entries are gone."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=8)
    ref = gpt_step(model, batch)
    ctx = spillover.offload_context(tier, min_offload_bytes=0, nvme_path=str(tmp_path))
    caps, steps = [], []
    for _ in range(3):
        assert_bitwise(ref, gpt_step(model, batch, ctx))
        s = ctx.stats()
        assert s.bytes_kept_pool_full == 0, s
        caps.append(s.pool_capacity)
        steps.append(s)
    held = ctx.stats().bytes_offloaded
    assert held > default_pool
    if tier == "host":
        assert caps[0] > default_pool  # grew in the first step
    else:
        assert caps[0] == default_pool and steps[0].bytes_offloaded_nvme > 0
        assert steps[2].bytes_offloaded_nvme < steps[0].bytes_offloaded_nvme
    assert caps[1] == caps[2] == _runtime.sized_for(held) >= held  # then fits, and stays
    assert drained(ctx) == (0, 0)  # in every pool it held
    assert len(ctx._pools.gens) == 1  # the pools grown past were returned ...
    assert sorted(c for c in _pools.POOLS.leased if c in (default_pool, caps[0]) and
                  c != caps[2]) == []  # ... and left the process
    pool = ctx._pool
    del ctx
    gc.collect()
    assert caps[2] not in _pools.POOLS.leased and pool in _pools.POOLS.idle  # kept, idle
    del pool
    assert spillover.empty_cache() >= caps[2]
    assert not _pools.POOLS.idle
    if tier == "nvme":  # its swap engine went with it
        assert not any(k[0][0] == "pool" for k in _tiers._swaps if k and isinstance(k[0], tuple))


def test_an_explicit_size_is_the_cached_pool_as_before(private_pool_bytes):
    size = 32 * MiB + private_pool_bytes % (1 << 20)
    cfg = spillover.Config.load(host_pool_bytes=size)
    ctx = spillover.offload_context("host", host_pool_bytes=size)
    with ctx:
        pass
    assert ctx._pool is _pools.host_pool(cfg) and ctx.pool_limit == size
    assert "grows up to" not in ctx.report()
    del ctx
    gc.collect()
    assert _pools.POOLS.sized[("activations", size)].capacity == size  # kept for the process


# ---- 3. report() counts what a recompute policy keeps -----------------------------------------


def test_report_counts_what_an_auto_policy_keeps(private_pool_bytes):
    """With a budget that lets it keep everything, policy='auto' plans plain-keep regions: the
    step holds what the unwrapped model saves, and report() must say so (it saw a tenth)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=4)
    pool = 128 * MiB + private_pool_bytes % (1 << 20)
    plain_ctx = spillover.offload_context("host", host_pool_bytes=pool)
    ref = gpt_step(model, batch, plain_ctx)
    plain = plain_ctx.stats()
    # chunked_loss=False: the reference's head and loss, so that both save the same tensors
    spillover.wrap(model, policy="auto", budget_bytes="8GiB", chunked_loss=False)
    ctx = spillover.offload_context("host", host_pool_bytes=pool)
    for _ in range(6):  # learning steps, then planned ones
        assert_bitwise(ref, gpt_step(model, batch, ctx))
    s = ctx.stats()
    assert s.bytes_kept_policy > 0, s
    assert "policy" in ctx.report()
    held = s.bytes_offloaded + s.bytes_kept + s.bytes_deduplicated
    truth = plain.bytes_offloaded + plain.bytes_kept + plain.bytes_deduplicated
    assert held >= 0.9 * truth, (held, truth)


def test_op_outputs_a_region_keeps_are_counted_once():
    """The per-op "keep" of a planned region (recompute/modes.py): counted as kept by the
    policy, once per storage, and not offloaded when autograd saves it again outside."""
    from spillover.planner import RegionRecord
    from spillover.recompute import _Run
    from spillover.recompute.policies import _sac

    torch.manual_seed(0)
    w = torch.randn(N, N, requires_grad=True)
    x = torch.randn(N, N, requires_grad=True)

    def region(x):
        return torch.tanh(x @ w)  # mm's output kept; tanh's output (the region's) kept too

    def step(ctx):
        w.grad = x.grad = None
        with ctx:
            record = RegionRecord("r", "r", None, "cpu", "checkpoint")
            h = _sac(region, (x,), {}, _Run(lambda *a: "keep", ctx, record, None).contexts)
            loss = (h * h).sum()  # saves h (twice): the region holds it already
        loss.backward()
        return w.grad, x.grad

    ref_w, ref_x = (x @ w).tanh().square().sum().backward() or (w.grad, x.grad)
    ref_w, ref_x = ref_w.clone(), ref_x.clone()
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=64 * MiB)
    gw, gx = step(ctx)
    assert torch.equal(gw, ref_w) and torch.equal(gx, ref_x)
    s = ctx.stats()
    assert s.bytes_kept_policy == 8 * MiB, s  # mm's and tanh's outputs, 4 MiB each
    assert s.bytes_offloaded_host == 0, s  # x and w are leaves; h is the policy's
    assert s.bytes_kept_parameter == 4 * MiB, s  # x, the region's input (w is not one)
    assert s.storages_deduplicated == 2, s  # h, saved twice by mul: held by the region


def test_the_next_pool_is_made_off_the_critical_path(default_pool, monkeypatch):
    """Note [growth off the critical path]: a default pool three quarters full has its next
    generation mapped (and on CUDA registered) on a background thread, and the growth that
    follows takes it without mapping anything on the thread that packs."""
    import threading

    leases = []
    real = _pools.lease_pool

    def spy(capacity):
        leases.append((threading.current_thread().name, capacity))
        return real(capacity)

    monkeypatch.setattr(_pools, "lease_pool", spy)
    torch.manual_seed(0)
    xs = [torch.randn(MiB // 4, requires_grad=True) for _ in range(96)]  # 96 MiB, 1 MiB each
    ctx = spillover.offload_context("host", min_offload_bytes=0)
    for _ in range(2):
        with ctx:
            loss = sum((x * 2).sigmoid().sum() for x in xs)
        loss.backward()
        s = ctx.stats()
        assert s.bytes_kept_pool_full == 0 and s.tensors_offloaded == 96, s
        assert all(torch.equal(x.grad, torch.autograd.grad((x * 2).sigmoid().sum(), x)[0])
                   for x in xs[:3])
        for x in xs:
            x.grad = None
    grown = [(name, cap) for name, cap in leases if cap > default_pool]
    assert grown and all(name == "spillover-pool-growth" for name, _ in grown), leases
    assert ctx._pools.prepared >= 1
