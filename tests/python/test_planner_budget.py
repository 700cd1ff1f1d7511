"""The budget holds from the first step (issue 22): no step of ``policy="auto"`` over it, the
learning and tuning steps included (Note [learning frugally] in spillover/planner/tuner.py),
and no plan beaten on both peak and time by a fixed mode the planner could have chosen.

The planners here pass ``seed_from_trace=False``: these tests drive the learning step and the
tuning after it (scripted peaks, measured peaks), which a plan made from a trace of the first
step on fake tensors skips (Note [seeded plan] in spillover/estimate/seed.py; that path:
test_estimate_seed.py)."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import assert_bitwise, gpt_step, same_loss_ref
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover
from spillover.planner import (
    Machine,
    OpRecord,
    Phase,
    Planner,
    RegionRecord,
    fixed_modes,
    learning_peak,
    make_plan,
)
from spillover.planner.search import TIME_SLACK

MiB = 1 << 20
CPU = Machine({"float32": 1e11}, 5e9, 1e10, 1e10, 2e9, 2e9)
GPU = Machine({"float32": 5e12}, 5e11, 2e10, 2e10, 5e9, 5e9)


# ---- the search is never beaten by a fixed mode (model values, pure) -------------------------


@st.composite
def _steps(draw):
    """One step's records: 1-5 blocks of 2-7 ops with drawn sizes and FLOPs, a context (none,
    a CPU host's NVMe tier, a GPU's host or NVMe tier), measured offsets and a budget."""
    where = draw(st.sampled_from(["cpu", "cpu-nvme", "gpu-host", "gpu-nvme"]))
    device = "cpu" if where.startswith("cpu") else "cuda:0"
    pool = draw(st.integers(8, 512)) * MiB
    ctx = None if where == "cpu" else {
        "tier": "nvme" if where.endswith("nvme") else "host", "pool_bytes": pool,
        "nvme": where.endswith("nvme")}
    n_ops = draw(st.integers(2, 7))
    sizes = [draw(st.integers(0, 96)) for _ in range(n_ops)]
    fpb = [draw(st.sampled_from([0.25, 1.0, 32.0, 256.0, 1024.0])) for _ in range(n_ops)]
    needed = [draw(st.booleans()) for _ in range(n_ops)]
    needed[0] = True  # autograd saves something in every block
    regions = []
    for ri in range(draw(st.integers(1, 5))):
        ops = []
        for i in range(n_ops):
            nbytes = sizes[i] * MiB
            ops.append(OpRecord(
                index=i, name=f"op{i}", shape=(nbytes // 4,), dtype="float32", bytes=nbytes,
                flops=int(fpb[i] * nbytes), moved_bytes=2 * nbytes, compute_bound=fpb[i] > 1,
                needed=needed[i] and nbytes > 0, after_stop=i == n_ops - 1 and n_ops > 2,
                readers=(i + 1,) if i + 1 < n_ops else ()))
        regions.append(RegionRecord(
            key=ri, name=f"b{ri}", signature=ri, device=device, mode="checkpoint",
            input_bytes=draw(st.integers(1, 16)) * MiB, ops=ops,
            needed_bytes=sum(o.bytes for o in ops if o.needed), stop=n_ops - 1, offload=ctx))
    offsets = {"learning": draw(st.integers(0, 64)) * MiB}
    for fam in ("checkpoint", "plain-offload", "plain"):
        if draw(st.booleans()):
            offsets[fam] = draw(st.integers(0, 64)) * MiB
    outside = draw(st.integers(0, 32)) * MiB
    loss = draw(st.sampled_from([0, 0, 4, 48, 160])) * MiB  # the loss region's transient
    machine = CPU if device == "cpu" else GPU
    fixed = fixed_modes(regions, machine, outside, offsets, loss)
    hi = max(p for p, _ in fixed.values())
    budget = draw(st.integers(0, hi + 64 * MiB))
    return regions, machine, outside, offsets, budget, loss


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps())
def test_auto_is_never_beaten_by_a_fixed_mode(step):
    regions, machine, outside, offsets, budget, loss = step
    fixed = fixed_modes(regions, machine, outside, offsets, loss)
    assert "none" in fixed and "full" in fixed
    plan = make_plan(copy.deepcopy(regions), machine, budget, outside, dict(offsets),
                     loss_bytes=loss)
    peak = plan.model_peak + (plan.peak_offset or 0)
    seconds = plan.recompute_seconds + plan.transfer_seconds
    fitting = {m: v for m, v in fixed.items() if v[0] <= budget}
    # Note [near ties go to memory]: on a CPU host a plan may be this much slower than the
    # fastest fitting mode, for a lower peak
    slack = TIME_SLACK * 3 * sum(machine.op_seconds(o) for r in regions for o in r.ops) \
        if regions[0].device == "cpu" else 0.0
    if plan.fits:
        assert peak <= budget
        for mode, (p, t) in fitting.items():
            assert seconds <= t * (1 + 1e-9) + 1e-12 or peak < p, (mode, seconds, t, peak, p)
            assert seconds <= t * (1 + 1e-9) + slack + 1e-12, (mode, seconds, t, plan.variant)
    else:
        # nothing fits: the least peak there is, and no fixed mode fits either
        assert not fitting
        assert peak <= min(p for p, _ in fixed.values()), (peak, fixed, plan.variant)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_steps())
def test_search_is_a_pure_function(step):
    """Determinism: the same records, rates, budget and offsets give the same plan; a larger
    budget never gives a plan that needs more time."""
    regions, machine, outside, offsets, budget, loss = step
    a = make_plan(copy.deepcopy(regions), machine, budget, outside, dict(offsets),
                  loss_bytes=loss)
    b = make_plan(copy.deepcopy(regions), machine, budget, outside, dict(offsets),
                  loss_bytes=loss)
    assert [(r.mode, r.actions) for r in a.regions] == [(r.mode, r.actions) for r in b.regions]
    assert (a.model_peak, a.recompute_seconds, a.transfer_seconds) == (
        b.model_peak, b.recompute_seconds, b.transfer_seconds)
    more = make_plan(copy.deepcopy(regions), machine, budget + 256 * MiB, outside,
                     dict(offsets), loss_bytes=loss)
    if a.fits:
        assert more.fits
        assert (more.recompute_seconds + more.transfer_seconds
                <= (a.recompute_seconds + a.transfer_seconds) * (1 + 1e-9) + 1e-12)


def test_fixed_modes_count_as_the_plans_do():
    nvme = {"tier": "nvme", "pool_bytes": 32 * MiB, "nvme": True}
    from test_planner_search import _step

    recs = _step(device="cpu", offload=nvme)
    fixed = fixed_modes(recs, CPU, 16 * MiB, {"learning": 8 * MiB})
    assert set(fixed) == {"none", "full", "offload"}
    assert fixed["none"][1] == 0 and fixed["full"][1] > 0
    # full's modeled peak is the learning step's model (every region recomputed) + its offset
    assert fixed["full"][0] == learning_peak(recs, CPU, 16 * MiB) + 8 * MiB
    assert fixed["offload"][0] == learning_peak(recs, CPU, 16 * MiB, "plain-offload") + 8 * MiB
    # run plainly under the context, a region reloads one tensor at a time: the lowest peak
    assert fixed["offload"][0] < fixed["full"][0] < fixed["none"][0]
    # no context on a CPU host: offloading is no choice
    assert set(fixed_modes(_step(), CPU, 16 * MiB)) == {"none", "full"}


def test_a_budget_under_the_pool_says_so():
    """On a CPU host the context's pool is the memory the budget counts: when no plan fits,
    explain's note names it (the fix is the user's: a smaller pool)."""
    from test_planner_search import _step

    nvme = {"tier": "nvme", "pool_bytes": 64 * MiB, "nvme": True}
    plan = make_plan(_step(device="cpu", offload=nvme), CPU, budget=64 * MiB,
                     outside_bytes=16 * MiB, peak_offset=0)
    assert not plan.fits and "64.0 MiB pool is this host's memory" in plan.note
    # within the budget there is nothing to say
    assert make_plan(_step(device="cpu", offload=nvme), CPU, budget=2 << 30,
                     outside_bytes=16 * MiB, peak_offset=0).note == ""


def test_a_plain_region_counts_its_backward():
    """Note [plain backward]: a region run plainly holds what it saved while its backward
    computes gradients; a plan with one such region models that much more than it holds."""
    from test_planner_search import _step

    recs = _step()
    # room for the last block run plainly with its 128 MiB softmax's gradient, not without
    plan = make_plan(recs, CPU, budget=900 * MiB, outside_bytes=16 * MiB, peak_offset=0)
    assert plan.fits and recs[-1].mode == "plain-keep"
    held = plan.planned_bytes
    assert plan.model_peak >= held + 128 * MiB
    assert plan.model_peak <= 900 * MiB
    # all plain: the same for the whole step
    recs = _step()
    plain = make_plan(recs, CPU, budget=10 << 30, outside_bytes=16 * MiB, peak_offset=0)
    assert plain.variant == "plain" and plain.model_peak == plain.plain_bytes + 128 * MiB


def test_the_loss_region_counts_in_the_planned_peak():
    """Note [loss transient]: the loss region's backward runs first, on top of what the step
    holds after forward; a plan counts it, and one that fit without it moves down."""
    from test_planner_search import _step

    plain = make_plan(_step(), CPU, budget=10 << 30, outside_bytes=16 * MiB, peak_offset=0,
                      loss_bytes=300 * MiB)
    assert plain.variant == "plain" and plain.model_peak == plain.plain_bytes + 300 * MiB
    # under the 128 MiB softmax gradient of the plain tail, the larger of the two counts
    small = make_plan(_step(), CPU, budget=10 << 30, outside_bytes=16 * MiB, peak_offset=0,
                      loss_bytes=8 * MiB)
    assert small.model_peak == small.plain_bytes + 128 * MiB
    without = make_plan(_step(), CPU, budget=900 * MiB, outside_bytes=16 * MiB, peak_offset=0)
    counted = make_plan(_step(), CPU, budget=900 * MiB, outside_bytes=16 * MiB, peak_offset=0,
                        loss_bytes=256 * MiB)
    assert without.fits and counted.fits and counted.model_peak <= 900 * MiB
    assert counted.planned_bytes < without.planned_bytes
    assert learning_peak(_step(), CPU, 16 * MiB, loss_bytes=512 * MiB) > learning_peak(
        _step(), CPU, 16 * MiB)


def test_a_loss_chunk_that_fits_no_plan_is_shrunk_until_one_fits():
    """Note [loss chunk under a budget]: the speed rule's chunk while some plan fits with it
    (no cap); below that, the plan made with the smallest chunk, what it leaves of the budget
    given back to the chunk, the peak with the grown chunk still within the budget."""
    from test_planner_search import _step

    big, least = 600 * MiB, 24 * MiB

    def plan(budget, loss, loss_min=0):
        return make_plan(_step(), CPU, budget=budget, outside_bytes=16 * MiB,
                         peak_offset=10 * MiB, loss_bytes=loss, loss_min_bytes=loss_min)

    floor_big, floor_least = plan(1, big).model_peak, plan(1, least).model_peak
    assert floor_least < floor_big
    budget = (floor_least + floor_big) // 2 + 10 * MiB
    assert not plan(budget, big).fits  # the speed rule's chunk fits no plan
    p = plan(budget, big, least)
    assert p.fits and p.loss_cap is not None and least <= p.loss_cap < big
    assert p.model_peak + p.peak_offset <= budget
    # a budget the speed rule's chunk fits: no cap, the same plan as without the smallest
    roomy = plan(floor_big + 10 * MiB + 50 * MiB, big, least)
    assert roomy.fits and roomy.loss_cap is None
    assert [(r.mode, r.actions) for r in roomy.regions] == [
        (r.mode, r.actions) for r in plan(floor_big + 60 * MiB, big).regions]
    # nothing fits even with the smallest chunk: the smallest it is
    tight = plan(floor_least // 2, big, least)
    assert not tight.fits and tight.loss_cap == least


def test_wrap_runs_the_loss_chunk_its_plan_capped(tiny_gpt_cl, chunk_rows_seen):
    """End to end, with measured peaks given (test_planner's fake meter): a budget no plan fits
    with the speed rule's chunk; the wrapped model's next steps run the capped chunk (fewer
    rows) and equal the plain model run with that cap, bit for bit."""
    from test_planner import _metered_steps

    base, batch = tiny_gpt_cl
    rows = chunk_rows_seen
    planner, plans = _metered_steps(base, batch, 3 * MiB, [4 * MiB, 3 * MiB], steps=3)
    cap = plans[-1].loss_cap
    assert cap is not None and planner.loss_min_bytes <= cap < planner.loss_bytes
    # each step: the wrapped model, then its plain reference; the first step learns
    assert rows[0] == rows[1] == 1024 and rows[-2] == rows[-1] < 256  # 256 tokens: one chunk


def test_auto_learns_the_loss_region_of_a_wrapped_model():
    """wrap(policy="auto") on the built-in GPT turns its chunked loss on; the learning step
    reports the loss's transient (one fp32 logits chunk + the hidden states' gradient) to the
    planner, and explain() shows it in the planned peak."""
    from spillover.loss import chunk_rows
    from spillover.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab=4096, d_model=64, n_heads=4, n_layers=2, seq=64)
    model = spillover.wrap(GPT(cfg), policy="auto", budget_bytes="1GiB")
    batch = synthetic_batch(cfg, batch=4)
    for _ in range(2):
        gpt_step(model, batch)
    planner = model._spillover_state.policy.planner
    tokens = 4 * cfg.seq
    assert planner.loss_bytes == min(chunk_rows(cfg.vocab), tokens) * cfg.vocab * 4 \
        + tokens * cfg.d_model * 4
    assert planner.loss_min_bytes == 64 * cfg.vocab * 4 + tokens * cfg.d_model * 4
    ex = spillover.explain(model)
    assert ex.summary["loss region in the peak"] == spillover.config.format_size(
        planner.loss_bytes)
    assert planner.plan.loss_cap is None and "loss chunk" not in ex.summary  # 1 GiB: it fits
    # chunked_loss=False: no loss region, nothing counted
    plain = spillover.wrap(GPT(cfg), policy="auto", budget_bytes="1GiB", chunked_loss=False)
    for _ in range(2):
        gpt_step(plain, batch)
    assert plain._spillover_state.policy.planner.loss_bytes == 0


# ---- the learning step runs the most frugal way (real runs) -----------------------------------


def _nvme(tmp_path, pool="4MiB"):
    return spillover.offload_context("nvme", host_pool_bytes=pool, nvme_path=str(tmp_path),
                                     min_offload_bytes=4096)


def test_learning_under_nvme_runs_plainly_and_records_the_same_ops(tiny_gpt_cl, tmp_path):
    """Note [learning frugally]: under the NVMe tier the learning step runs its regions plainly
    (the context takes what autograd saves); its records are those a fully recomputed learning
    step makes, the gradients stay bitwise, and the plans that follow run without relearning."""
    base, batch = tiny_gpt_cl
    ref = gpt_step(base, batch)

    def learn(ctx_of):
        planner = Planner(budget_bytes=1, machine=CPU, measure_peak=False, seed_from_trace=False)
        model = spillover.wrap(copy.deepcopy(base), policy=planner)
        assert_bitwise(ref, gpt_step(model, batch, ctx_of()))
        assert planner.learning
        assert_bitwise(ref, gpt_step(model, batch, ctx_of()))  # planned from the first
        return planner, model

    plain, model = learn(lambda: _nvme(tmp_path))
    recs = plain.planned_records
    assert recs and plain.phase is Phase.SETTLED
    full, _ = learn(lambda: None)  # no context: every region recomputed in full
    assert [[(o.name, o.bytes, o.needed, o.after_stop, o.readers) for o in r.ops]
            for r in recs] == [[(o.name, o.bytes, o.needed, o.after_stop, o.readers)
                                for o in r.ops] for r in full.planned_records]
    # what the regions save is not counted as outside them (at most: the counting hooks key
    # storages by address, and a packed tensor's freed address can be reused)
    assert 0 < plain.outside_bytes <= full.outside_bytes
    # budget 1: everything is freed; the plan is followed step after step, no relearning
    replans = plain.replans
    for _ in range(2):
        assert_bitwise(ref, gpt_step(model, batch, _nvme(tmp_path)))
    assert plain.replans == replans and not plain.learning


class _Physics:
    """A peak meter whose "measured" peak is the model of what the step ran plus what the
    model cannot see (``hidden``: the loss region, gradients; the same for every variant)."""

    device = "cpu"

    def __init__(self, planner, hidden):
        self.planner, self.hidden, self.peaks = planner, hidden, []

    def start(self):
        return True

    def read(self):
        p = self.planner
        if p.learning:
            recs = p._records
            kind = "plain-offload" if recs[0].mode == "plain-offload" else "checkpoint"
            peak = learning_peak(recs, CPU, p.outside_bytes, kind) + self.hidden
        else:
            peak = p.plan.model_peak + self.hidden
        self.peaks.append(peak)
        return peak


def test_no_modeled_step_over_full_checkpointings_peak(tiny_gpt_cl, tmp_path):
    """Budget = full checkpointing's peak without a context; auto under the NVMe tier with a
    pool that full recomputation under the context cannot afford: the learning step runs the
    frugal way, and no tuning step moves above the budget."""
    base, batch = tiny_gpt_cl
    hidden = 4 * MiB
    probe = Planner(budget_bytes=1, machine=CPU, measure_peak=False, seed_from_trace=False)
    m = spillover.wrap(copy.deepcopy(base), policy=probe)
    gpt_step(m, batch)
    gpt_step(m, batch)  # plans from the first: its records
    recs = probe.planned_records
    assert recs
    budget = learning_peak(recs, CPU, probe.outside_bytes) + hidden  # full, no context
    pool = 1 * MiB
    nvme = [dict(tier="nvme", pool_bytes=pool, nvme=True)]
    under_ctx = copy.deepcopy(recs)
    for r in under_ctx:
        r.offload = nvme[0]
    # full recomputation under this context would be over the budget
    assert learning_peak(under_ctx, CPU, probe.outside_bytes) + hidden > 1.05 * budget
    planner = Planner(budget_bytes=budget, machine=CPU, seed_from_trace=False)
    meter = planner._meter = _Physics(planner, hidden)
    model = spillover.wrap(copy.deepcopy(base), policy=planner)
    for _ in range(planner.TUNING_STEPS + 3):
        ctx = spillover.offload_context("nvme", host_pool_bytes=pool, nvme_path=str(tmp_path),
                                        min_offload_bytes=4096)
        got = gpt_step(model, batch, ctx)
        assert_bitwise(same_loss_ref(base, batch, model), got)
    assert planner.tuned and len(meter.peaks) >= 2
    assert all(p <= 1.05 * budget for p in meter.peaks), ([p / budget for p in meter.peaks],
                                                          planner.plan.variant)


_WHOLE_RUN = textwrap.dedent("""
    import ctypes, gc, json, sys, tempfile
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD 64 KiB: freed tensors leave RSS at once
    import torch
    import spillover
    from spillover._peak import high_water, reset_high_water, rss
    from spillover.models import GPT, GPTConfig, synthetic_batch
    from spillover.planner import Machine, Planner
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab=2048, d_model=256, n_heads=4, n_layers=4, seq=512, attn="explicit")
    base = GPT(cfg)
    idx, tgt = synthetic_batch(cfg, 4)
    tmp = tempfile.mkdtemp()
    pool = sys.argv[1]

    def peak_of(model, ctx=None):
        model.zero_grad(set_to_none=True)
        gc.collect(); libc.malloc_trim(0)
        before = rss(); reset_high_water()
        if ctx is not None:
            with ctx:
                loss = model(idx, tgt)
        else:
            loss = model(idx, tgt)
        loss.backward()
        peak = high_water() - before
        return peak + (ctx.stats().pool_capacity if ctx is not None else 0)

    def wrapped(policy):
        m = GPT(cfg); m.load_state_dict(base.state_dict())
        return spillover.wrap(m, policy=policy)

    def nvme():
        return spillover.offload_context("nvme", host_pool_bytes=pool, nvme_path=tmp)

    full = wrapped("full")
    offload = wrapped("offload")
    peaks = {"full": [peak_of(full) for _ in range(2)],
             "full-nvme": [peak_of(full, nvme()) for _ in range(2)],
             "offload-nvme": [peak_of(offload, nvme()) for _ in range(3)]}
    budget = min(peaks["offload-nvme"][1:])  # after its first step (the context's first use)
    machine = Machine({"float32": 2e10}, 4e9, 6e9, 6e9, 2e9, 2e9)
    planner = Planner(budget_bytes=budget, machine=machine, seed_from_trace=False)
    auto = wrapped(planner)
    steps = []
    for _ in range(6):
        steps.append([peak_of(auto, nvme()), planner.plan.variant if planner.plan else "-"])
    print(json.dumps({"budget": budget, "peaks": peaks, "steps": steps}))
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM is Linux's")
def test_no_step_over_the_budget_from_the_first(tmp_path):
    """Measured as the benches measure (RSS high-water mark of the whole step, allocator
    pinned, the pool counted), with the least budget a fixed mode meets under an NVMe context
    (the offload policy's peak: full recomputation under the context peaks higher) every step
    of auto, the learning and tuning steps included, stays within 1.05x of it. Before Note
    [learning frugally] the learning step recomputed every region in full under the context.

    (Not torch's full checkpointing's peak: at this size the step's fixed part (loss, logits,
    the pool) dominates, and every mode under the context peaks above it.)"""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("/proc/self/clear_refs is not writable here")
    script = tmp_path / "whole_run.py"
    script.write_text(_WHOLE_RUN)
    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path))
    out = subprocess.run([sys.executable, str(script), "16MiB"], env=env, check=True,
                         capture_output=True, text=True, timeout=600)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    budget = res["budget"]
    seen = ([(round(p / budget, 3), v) for p, v in res["steps"]],
            {k: [round(p / budget, 3) for p in v] for k, v in res["peaks"].items()})
    # the budget is below what full recomputation reaches under the context: a learning step
    # that recomputes every region cannot hold it
    assert min(res["peaks"]["full-nvme"]) > 1.05 * budget, seen
    assert all(p <= 1.05 * budget for p, _ in res["steps"]), seen
