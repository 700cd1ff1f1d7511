"""The Quick start's loop -- a new ``offload_context`` every step, the default pool -- costs what
one context entered every step costs (Note [the pool lives for the process] in _pools.py). On
the H200 each step's new context re-mapped, pre-faulted and re-registered its pool on its way up
to ~8 GiB: 4.86 s for a step of ~0.4 s. Here the process's pool counters (``pool_maps``,
``pool_registrations`` in ``ctx.stats()``) must be 0 from the third step on: on the CPU, and on
the simulated device, whose registration costs the host what the H200's did (Note [simulated
registration]). Before, every step of this loop mapped (and on a device registered) again."""

from __future__ import annotations

import contextlib
import copy
import gc
import threading
import time
import types
import warnings

import pytest
import torch
from conftest import assert_bitwise, gpt_step, loss_cap_of

import spillover
from spillover import _growth, _native, _pools
from spillover.estimate.measured import allocator_events, peak_of
from spillover.models import GPT, GPTConfig, synthetic_batch

MiB = 1 << 20


@pytest.fixture
def small_first_pool(monkeypatch, private_pool_bytes):
    """No size from the user, nothing kept from other tests, and a first pool small enough that
    the first step must grow it (a capacity no other test leases)."""
    monkeypatch.delenv("SPILLOVER_HOST_POOL_BYTES", raising=False)
    gc.collect()
    spillover.empty_cache()
    first = 16 * MiB + private_pool_bytes % (1 << 20)
    monkeypatch.setattr(_growth, "FIRST_POOL", first)
    return first


def _quick_start_loop(tier, steps, tmp_path, **kw):
    """The README's Quick start on a 2-layer GPT: a new context around every step."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=8)
    ref = gpt_step(model, batch)
    out = []
    for _ in range(steps):
        ctx = spillover.offload_context(tier, min_offload_bytes=0, nvme_path=str(tmp_path), **kw)
        t0 = time.perf_counter()
        assert_bitwise(ref, gpt_step(model, batch, ctx))
        s = ctx.stats()
        out.append((s, time.perf_counter() - t0))
        del ctx
    return out


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_a_new_context_every_step_maps_nothing_from_the_third_step(tier, small_first_pool,
                                                                    tmp_path):
    steps = _quick_start_loop(tier, 10, tmp_path)
    maps = [s.pool_maps for s, _ in steps]
    caps = [s.pool_capacity for s, _ in steps]
    assert maps[0] >= 1  # the first step maps its pool (and grows it: host tier)
    assert maps[2:] == [0] * 8, maps
    assert len(set(caps[2:])) == 1 and caps[2] > small_first_pool, caps  # the size steps used
    assert all(s.bytes_kept_pool_full == 0 for s, _ in steps[2:])


def test_on_the_simulated_device_nothing_is_registered_from_the_third_step(small_first_pool,
                                                                            tmp_path):
    """Note [simulated registration]: each pool is registered once for the process."""
    steps = _quick_start_loop("host", 10, tmp_path, sim_link_bandwidth=20e9 + 17)
    regs = [s.pool_registrations for s, _ in steps]
    assert regs[0] >= 1 and regs[2:] == [0] * 8, regs
    assert [s.pool_maps for s, _ in steps][2:] == [0] * 8


def test_empty_cache_gives_the_kept_pool_back_and_the_next_context_maps_again(small_first_pool,
                                                                               tmp_path):
    steps = _quick_start_loop("host", 2, tmp_path)
    cap = steps[-1][0].pool_capacity
    gc.collect()
    assert [p.capacity for p in _pools.POOLS.idle] == [cap]
    assert spillover.empty_cache() >= cap
    assert not _pools.POOLS.idle
    again = _quick_start_loop("host", 1, tmp_path)
    assert again[0][0].pool_maps >= 1  # mapped anew: nothing was kept


def test_a_registered_pool_is_never_unmapped_while_registered():
    """Note [registered, never unmapped]: a pool registered and then dropped by its user (the
    probe's ``pool`` check) stays mapped, held by the owner, until it is unregistered --
    ``empty_cache`` does both, in that order."""
    gc.collect()
    spillover.empty_cache()
    pool = _native.Pool(8 * MiB)
    assert _pools.POOLS.register(pool, sim=True)
    arenas = list(pool.arenas())
    before = _pools.POOLS.unregistrations
    del pool
    gc.collect()
    held = [list(p.arenas()) for p in _pools.POOLS.sim_registered.values()]
    assert arenas in held  # still mapped: held by the owner (other tests' pools may be too)
    del held
    assert spillover.empty_cache() >= 8 * MiB
    assert _pools.POOLS.unregistrations >= before + 1
    assert all(list(p.arenas()) != arenas for p in _pools.POOLS.sim_registered.values())


def test_auto_uses_ram_before_the_drive(small_first_pool, tmp_path):
    """Note [RAM before the drive] in _growth.py: tier auto (the default) on a host with RAM to
    spare writes nothing to the drive once its pool holds the step; tier nvme, asked for, still
    writes behind. Before, auto wrote all but a quarter of the pool every step."""
    auto = _quick_start_loop("auto", 4, tmp_path)
    assert [s.bytes_offloaded_nvme for s, _ in auto][2:] == [0, 0], [
        s.bytes_offloaded_nvme for s, _ in auto]
    assert all(s.bytes_offloaded_host > 0 for s, _ in auto[2:])
    nvme = _quick_start_loop("nvme", 3, tmp_path)
    assert nvme[2][0].bytes_offloaded_nvme > 0
    cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128)
    ctx = spillover.offload_context("auto", min_offload_bytes=0, nvme_path=str(tmp_path))
    gpt_step(GPT(cfg), synthetic_batch(cfg, batch=8), ctx)
    assert ctx.nvme  # the swap is open: past the pool's cap, auto still spills


@pytest.mark.parametrize("sim", [None, 4e9 + 41], ids=["cpu", "simulated-device"])
def test_the_second_step_runs_on_a_pool_sized_for_the_first(small_first_pool, tmp_path, sim):
    """Note [growth off the critical path] in _growth.py: at the end of the first forward the
    pool made ahead is sized for every byte that forward offloaded, the entries still being
    written to the drive too, and a larger size asked for while a smaller one is being made
    is made next. Before, the Quick start's second step on this GPT (2x256, seq 512, vocab
    8192: 164 MiB a step) ran on a 128 MiB pool, mapped once more and wrote 136 MiB to the
    drive; now it maps nothing and writes nothing, and the first step writes nothing either."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8192, d_model=256, n_heads=4, n_layers=2, seq=512)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=4)
    ref = gpt_step(model, batch)
    rows = []
    for _ in range(2):
        ctx = spillover.offload_context("auto", min_offload_bytes=0, nvme_path=str(tmp_path),
                                        sim_link_bandwidth=sim)
        assert_bitwise(ref, gpt_step(model, batch, ctx))
        rows.append(ctx.stats())
        del ctx
    first, second = rows
    # Note [writes wait for growth] (rust/tier/room.rs): the 16 MiB first pool grows inside
    # the first step instead of writing what passed it (before: the first step spilled)
    assert first.bytes_offloaded_nvme == 0 and first.pool_maps >= 2, first
    assert first.bytes_kept_pool_full == 0 and first.overflow_reads == 0, first
    assert second.bytes_offloaded_nvme == 0 and second.pool_maps == 0, second
    assert second.pool_capacity >= second.bytes_offloaded, second


def test_auto_at_its_cap_writes_what_passes_its_pool(small_first_pool, monkeypatch, tmp_path):
    """Note [writes wait for growth]: a pool that cannot grow any more (here the default's cap
    at 32 MiB, for a step offloading 164 MiB) writes what passes it to the drive, as before:
    nothing stays on the device, gradients bitwise."""
    cap = 32 * MiB
    monkeypatch.setattr(_growth._runtime, "default_size", lambda purpose: cap)
    monkeypatch.setattr(_growth._runtime, "default_pool_bytes", lambda mem=None: cap)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8192, d_model=256, n_heads=4, n_layers=2, seq=512)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=4)
    ref = gpt_step(model, batch)
    for _ in range(2):
        ctx = spillover.offload_context("auto", min_offload_bytes=0, nvme_path=str(tmp_path))
        assert_bitwise(ref, gpt_step(model, batch, ctx))
        s = ctx.stats()
        assert s.pool_capacity <= cap, s
        assert s.bytes_offloaded_nvme > 0 and s.bytes_kept_pool_full == 0, s
        del ctx


def test_a_larger_size_asked_while_one_is_made_is_made_next(small_first_pool, monkeypatch):
    """Note [growth off the critical path]: the forward's end asks for what its entries need
    while an earlier, smaller generation is still being made; that size is made next by the
    same thread and the smaller one goes back (before, the request was dropped)."""
    ctx = spillover.offload_context("host", min_offload_bytes=0)
    with ctx:
        torch.ones(1 << 18, requires_grad=True).exp().sum()
    pools = ctx._pools
    cap = pools.pool.capacity
    gate, made, returned = threading.Event(), [], []

    def lease_pool(size):
        gate.wait(10)
        made.append(types.SimpleNamespace(capacity=size))
        return made[-1]

    monkeypatch.setattr(_pools, "lease_pool", lease_pool)
    monkeypatch.setattr(_pools, "return_pool", returned.append)
    monkeypatch.setattr(pools, "_room", lambda: 1 << 40)
    pools.maybe_prepare(held=cap, size=2 * cap)  # the thread starts making 2x, held at the gate
    pools.maybe_prepare(held=cap, size=8 * cap)  # asked for while it runs
    thread = pools._next_thread
    gate.set()
    thread.join(10)
    assert [m.capacity for m in made] == [2 * cap, 8 * cap]
    assert returned == [made[0]] and pools._next is made[1]
    pools._next = None  # not a real pool: nothing to give back
    monkeypatch.undo()  # the context's real lease goes back to the process's owner, not to
    pools.close()  # ``returned`` (a lease kept would be where the next test's context starts)


@pytest.mark.parametrize("tier", ["auto", "host"])
def test_auto_policy_on_a_cpu_host_ships_nothing_and_grows_no_pool(tier, small_first_pool,
                                                                   tiny_hf_llama):
    """Note [a CPU host ships nothing] in planner/records.py: the Quick start's loop with
    ``policy="auto"`` and no budget, on an HF Llama (vocab 32000, SDPA and eager attention):
    what the context would take is kept in place from the learning step on (that pool is the
    RAM the budget counts, and it would stay with the process at the most it held), so the
    pool stays at the first one, and gradients are bitwise. Before, the learning step under
    tier auto shipped every saved tensor and the pool grew for it, and the plans after it
    shipped the tail on every step (GPT 4x256, vocab 8192: a 512 MiB pool kept for a plan
    shipping 2 MiB, the step's peak 1.93x no checkpointing's with the pool counted)."""
    model, ids = tiny_hf_llama

    def step(m, ctx=None):
        m.zero_grad(set_to_none=True)
        with ctx if ctx is not None else contextlib.nullcontext():
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return {n: p.grad.clone() for n, p in m.named_parameters()}

    ref = step(model)
    planner = spillover.Planner(measure_peak=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache=False
        wrapped = spillover.wrap(copy.deepcopy(model), policy=planner, chunked_loss=False)
    rows = []
    for _ in range(5):
        ctx = spillover.offload_context(tier)  # defaults, as the Quick start writes it
        got = step(wrapped, ctx)
        assert got.keys() == ref.keys() and all(torch.equal(got[k], ref[k]) for k in ref)
        rows.append(ctx.stats())
        del ctx
    assert planner.plan is not None and not planner.learning
    assert [s.bytes_offloaded for s in rows] == [0] * 5, [s.bytes_offloaded for s in rows]
    caps = [s.pool_capacity for s in rows]  # the pool it started on (another test's may
    assert caps == [caps[0]] * 5 and caps[0] <= 64 * MiB, caps  # still be held): never grown
    assert [s.pool_maps for s in rows][1:] == [0] * 4
    assert all(s.bytes_kept_policy > 0 for s in rows)  # kept, counted as kept by a policy


@pytest.mark.parametrize("measure", [False, True], ids=["modeled", "measured"])
def test_auto_on_a_cpu_host_meets_its_budget_under_the_default_context(small_first_pool,
                                                                        measure):
    """Note [a CPU host ships nothing]: under the Quick start's default context a CPU host's
    plan charges the pool mapped now (the context keeps in place what it would take, so the
    pool does not grow), not the cap a default pool could grow to (several GiB here): a budget
    between full recomputation's peak (with the pool) and no checkpointing's is met, the whole
    step's live storages plus the pool measured, gradients bitwise. Before, every plan looked
    over any such budget by the cap, auto fell back to running plainly, and the step peaked at
    1.21x the budget (GPT 4x128, seq 256, vocab 8192; the midpoint budget).

    measured: the tuning steps' peaks are read as the budget counts them (Note [a CPU step's
    peak is its storages'] in planner/metering.py), the seeded first step's included: each
    reading is the step's live storages plus the pool. Before, this host's RSS meter read the
    steps low (a process's freed heap stays resident and is reused uncounted), and the plans it
    kept peaked up to 1.9x their budget (GPT 4x256, seq 512: 279 MiB at 150)."""
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=8192, d_model=128, n_heads=4, n_layers=4, seq=256)
    base, batch = GPT(cfg), synthetic_batch(cfg, batch=4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = spillover.wrap(copy.deepcopy(base), policy="full")
    gpt_step(base, batch)
    gpt_step(full, batch)
    none_peak = peak_of(allocator_events(lambda: gpt_step(base, batch)))
    full_peak = peak_of(allocator_events(lambda: gpt_step(full, batch)))
    floor = full_peak + small_first_pool
    assert floor < none_peak
    budget = (floor + none_peak) // 2
    planner = spillover.Planner(budget_bytes=budget, measure_peak=measure)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spillover.wrap(copy.deepcopy(base), policy=planner)
    for _ in range(4):
        got = gpt_step(model, batch, spillover.offload_context())
        # full recomputation's step through wrap's loss region, in the chunks that step ran
        # (Note [loss chunk under a budget] in spillover/loss/chunked.py)
        with spillover.loss.limit_chunk(loss_cap_of(model)):
            assert_bitwise(gpt_step(full, batch), got)
    ctx = spillover.offload_context()
    peak = peak_of(allocator_events(lambda: gpt_step(model, batch, ctx)))
    s = ctx.stats()
    assert s.bytes_offloaded == 0, s
    assert peak + s.pool_capacity <= budget, (peak, s.pool_capacity, budget,
                                              planner.plan.variant)
    if measure:  # the settled plan was read, while tuning, as its step's storages and pool
        assert planner.seeded is not None and planner.first_peaks, planner.seeded
        reads = [m for p, m in planner.measured if p is planner.plan]
        # a read low lets auto pass its budget (RSS read 105.0 + 16.8 MiB as 105.5 here):
        # within 2 % below; a read high only makes auto careful, and on 2026-12-07 one local
        # CI run and one of two whole-file runs read 4.8 and 5.3 MB (~6 % of the budget) over
        # the step measured after (cause not traced): within 10 % above
        want = peak + s.pool_capacity
        assert reads and all(-0.02 * budget <= r - want <= 0.10 * budget
                             for r in reads), (reads, peak, s.pool_capacity)
    assert planner.plan.variant != "plain", planner.plan.variant  # it planned recomputation


def test_a_planners_meter_left_running_is_stopped(small_first_pool):
    """Note [a stale profiler] (spillover/_peak.py): the first step of auto under the Quick
    start's default context on a CPU host follows the seeded plan and is metered by torch's
    profiler until the next step reads it; with no next step the profiler went on running in
    the process. ``spillover.empty_cache()`` (and any later meter or ``allocator_events``)
    stops it."""
    from spillover import _peak

    def _is_profiler_enabled():
        return torch._C._autograd._profiler_enabled()

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, d_model=64, n_heads=4, n_layers=2, seq=64)
    base, batch = GPT(cfg), synthetic_batch(cfg, batch=2)
    planner = spillover.Planner(budget_bytes=1 << 30)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spillover.wrap(copy.deepcopy(base), policy=planner)
    gpt_step(model, batch, spillover.offload_context())
    assert planner.seeded is not None and planner.phase.value == "tuning"
    assert _is_profiler_enabled() and list(_peak._RUNNING)  # metered, not read yet
    spillover.empty_cache()
    assert not _is_profiler_enabled() and not list(_peak._RUNNING)


def test_a_dropped_planners_meter_is_stopped():
    """Note [a stale profiler]: auto without a context on a CPU host meters its tuning steps
    by torch's profiler; a model dropped after such a step (a test's, an evaluation's) left a
    profiler no one could stop, recording every later allocation, until the exit crashed."""
    from spillover import _peak

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, d_model=64, n_heads=4, n_layers=2, seq=64)
    base, batch = GPT(cfg), synthetic_batch(cfg, batch=2)
    planner = spillover.Planner(budget_bytes=1 << 30, seed_from_trace=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spillover.wrap(copy.deepcopy(base), policy=planner)
    gpt_step(model, batch)
    assert torch._C._autograd._profiler_enabled() and list(_peak._RUNNING)
    del model, planner
    gc.collect()
    assert not torch._C._autograd._profiler_enabled() and not list(_peak._RUNNING)


def test_a_process_exits_cleanly_with_a_meter_running():
    """Note [a stale profiler]: a planner's last metered step with nothing after it, then the
    interpreter's exit: a profiler still running there crashed it (status 139, after torch's
    "Requested callback is not found"), the test suite's own exit included."""
    import subprocess
    import sys

    code = ("import torch\n"
            "from spillover._peak import StorageMeter\n"
            "m = StorageMeter()\n"
            "assert m.start()\n"
            "x = torch.randn(1000) * 2\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
