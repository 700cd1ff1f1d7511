"""The kept family's peak (Note [a kept backward frees as it goes] in planner/search.py) and the
model's compute scaled by what a learning step measured (Note [measured compute] in
planner/machine.py): synthetic steps for the search, a real CPU step for the measurement."""

from __future__ import annotations

import copy
import dataclasses
import warnings

import torch
from conftest import assert_bitwise, gpt_step
from test_planner_search import GPU, MiB, _step

import spillover
from spillover.planner import Machine, Planner, make_plan
from spillover.planner.cost import transient_bytes
from spillover.planner.machine import MIN_SCALE, measured_scale
from spillover.planner.search import KEPT, KEPT_START

HOST = {"tier": "host", "pool_bytes": 4 << 30, "nvme": False}
OUTSIDE = 16 * MiB


def _staged_peak(recs, plan, start_grad=0):
    """The step's peak walked region by region, as backward runs: a region run plainly (the
    last ones) holds what autograd saved in it, and its backward adds its largest such output;
    a region rebuilt holds what the regions before it kept, what it kept that autograd does
    not save, and what it rebuilds; the regions after it are done. At backward's start
    everything kept is held, with what backward adds first."""
    fixed = OUTSIDE + sum(r.input_bytes for r in recs)
    held, unsaved, plain_grad = [], [], 0
    for r, rp in zip(recs, plan.regions):
        if rp.mode == "plain-keep":
            held.append(r.needed_bytes)
            unsaved.append(0)
            plain_grad = max([plain_grad] + [o.bytes for o in r.ops if o.needed])
            continue
        kept = [o for o in r.ops if rp.actions[o.index][1] == "keep"]
        held.append(sum(o.bytes for o in kept))
        unsaved.append(sum(o.bytes for o in kept if not o.needed))
    peaks = [fixed + sum(held) + max(start_grad, plain_grad)]
    for i, (r, rp) in enumerate(zip(recs, plan.regions)):
        if rp.mode != "plain-keep":
            peaks.append(fixed + sum(held[:i]) + unsaved[i] + r.needed_bytes
                         + transient_bytes(r))
    return max(peaks)


def test_a_kept_backward_frees_as_it_goes():
    """Under a budget where the old model (everything kept on top of the largest region
    rebuilt) fits nothing but full recomputation, the staged one keeps outputs: the region
    rebuilt first holds its own saved outputs anyway, and each region's kept outputs are gone
    before the regions before it are rebuilt."""
    recs = _step(device="cuda:0", offload=HOST)
    least = make_plan(recs, GPU, budget=0, outside_bytes=OUTSIDE, peak_offset=0,
                      kinds=(KEPT,))
    # nothing fits under 0: the least peak there is, every output recomputed (where the
    # rebuilt terms tie, the cheapest of the rest is freed all the same)
    assert least.keep_all and not least.fits
    assert all(a[1] != "keep" for rp in least.regions for a in rp.actions.values())
    budget = least.model_peak + 48 * MiB
    recs = _step(device="cuda:0", offload=HOST)
    plan = make_plan(recs, GPU, budget=budget, outside_bytes=OUTSIDE, peak_offset=0,
                     kinds=(KEPT,))
    assert plan.fits and plan.keep_all and plan.model_peak <= budget
    assert plan.model_peak == _staged_peak(recs, plan)
    keeps = [r.needed_bytes if rp.mode == "plain-keep" else
             sum(o.bytes for o in r.ops if rp.actions[o.index][1] == "keep")
             for r, rp in zip(recs, plan.regions)]
    # the last block (backwarded first) keeps what autograd saves in it, plainly or rebuilt;
    # the blocks rebuilt after it share the room the budget leaves
    assert keeps[-1] == recs[-1].needed_bytes, (plan.variant, keeps)
    assert sum(keeps[:-1]) > 0, (plan.variant, keeps)
    # the old model counts every kept byte on top of the largest region rebuilt: over
    old = OUTSIDE + sum(r.input_bytes for r in recs) + sum(keeps) + max(
        r.needed_bytes + transient_bytes(r) for r in recs)
    assert old > budget
    assert plan.recompute_seconds < least.recompute_seconds


def test_the_start_of_backward_binds_a_kept_plan():
    """What backward adds at its start (the tail's gradient, as large as the tail) is held
    with everything kept: with a large tail the plan keeps less than without one."""
    tail = 256 * MiB
    plans = {}
    for t in (0, tail):  # the same room over each step's least peak
        least = make_plan(_step(device="cuda:0", offload=HOST), GPU, budget=0,
                          outside_bytes=OUTSIDE + t, peak_offset=0, kinds=(KEPT,), tail_bytes=t)
        budget = least.model_peak + 200 * MiB
        recs = _step(device="cuda:0", offload=HOST)
        plans[t] = make_plan(recs, GPU, budget=budget, outside_bytes=OUTSIDE + t,
                             peak_offset=0, kinds=(KEPT,), tail_bytes=t)
        assert plans[t].fits and plans[t].model_peak <= budget
    assert plans[tail].recompute_seconds > plans[0].recompute_seconds


def _with_grads(g):
    return [dataclasses.replace(r, grad_bytes=g) for r in _step(device="cuda:0", offload=HOST)]


def test_gradients_as_backward_goes():
    """Note [gradients as backward goes]: when backward rebuilds a region, the regions after it
    are done -- their parameters' gradients made, their inputs freed -- and so is the model's
    tail; a kept plan carries its two modeled terms (the start of backward, the rebuilt
    regions) for the tuner to measure apart."""
    g, tail = 64 * MiB, 32 * MiB
    recs = _with_grads(g)
    least = make_plan(recs, GPU, budget=0, outside_bytes=OUTSIDE + tail, peak_offset=0,
                      kinds=(KEPT,), tail_bytes=tail)
    assert least.keep_all and all(rp.mode == "checkpoint" for rp in least.regions)
    assert least.terms is not None
    start, rebuilt = least.terms
    ins = [r.input_bytes for r in recs]
    held = OUTSIDE + tail + sum(ins)
    assert start == held + tail  # the tail's gradient counted as large as the tail
    n = len(recs)
    assert rebuilt == held + max(
        r.needed_bytes + transient_bytes(r) + (n - 1 - i) * g - sum(ins[i + 1:]) - tail
        for i, r in enumerate(recs))
    assert least.model_peak == max(start, rebuilt)


def test_a_kept_plan_keeps_what_the_start_of_backward_has_room_for():
    """Note [gradients as backward goes]: with the start of backward's offset measured apart
    (100 MiB under the rebuilt regions'), the same budget keeps more than with one offset for
    both, and each term with its own offset stays within the budget."""
    g, off = 8 * MiB, 64 * MiB
    least = make_plan(_with_grads(g), GPU, budget=0, outside_bytes=OUTSIDE, peak_offset=0,
                      kinds=(KEPT,))
    budget = max(least.terms) + off + 48 * MiB
    plans = {}
    for start_off in (off, off - 100 * MiB):
        offsets = {"learning": off, "kept": off, KEPT_START: start_off}
        plan = make_plan(_with_grads(g), GPU, budget=budget, outside_bytes=OUTSIDE,
                         peak_offset=offsets, kinds=(KEPT,))
        assert plan.fits and plan.terms is not None
        start, rebuilt = plan.terms
        assert start + start_off <= budget and rebuilt + off <= budget
        assert plan.model_peak + plan.peak_offset == max(start + start_off, rebuilt + off)
        plans[start_off] = plan
    assert plans[off - 100 * MiB].recompute_seconds < plans[off].recompute_seconds


def test_a_kept_familys_plain_tails_are_bounded_by_its_own_offsets():
    """Note [gradients as backward goes]: which plain tails are tried is bounded by the least
    offset they can be charged -- the kept family's own where measured, not the shipping
    checkpoint family's, whose copies in flight and staged back the kept plan never holds. On
    the H200 estimate with the chunked loss the checkpoint family's 1,719 MiB ruled out every
    tail past one layer, where the kept family's 249 MiB left room for four."""
    recs = _with_grads(8 * MiB)
    least = make_plan(recs, GPU, budget=0, outside_bytes=OUTSIDE, peak_offset=0, kinds=(KEPT,))
    budget = max(least.terms) + 2 * (recs[-1].input_bytes + recs[-1].needed_bytes)
    offsets = {"learning": budget, "checkpoint": budget, "kept": 0, KEPT_START: 0}
    plan = make_plan(_with_grads(8 * MiB), GPU, budget=budget, outside_bytes=OUTSIDE,
                     peak_offset=offsets, kinds=(KEPT,))
    assert plan.fits and plan.keep_all and "plain" in plan.variant, plan.variant
    assert any(rp.mode == "plain-keep" for rp in plan.regions)


def _record(seconds, ops):
    return dataclasses.replace(_step(1)[0], forward_seconds=seconds, ops=ops)


def test_measured_scale_lowers_the_models_compute_only():
    cpu = Machine({"float32": 1e11}, 5e9, 1e10, 1e10)
    rec = _step(1)[0]
    modeled = sum(cpu.op_seconds(o) for o in rec.ops)
    assert measured_scale(cpu, [rec]) == 1.0  # not measured
    assert measured_scale(cpu, [_record(modeled / 2, rec.ops)]) == 0.5
    assert measured_scale(cpu, [_record(modeled * 3, rec.ops)]) == 1.0  # never up
    assert measured_scale(cpu, [_record(modeled / 100, rec.ops)]) == MIN_SCALE
    half = dataclasses.replace(cpu, compute_scale=0.5)
    op = rec.ops[3]
    assert half.op_seconds(op) == 0.5 * cpu.op_seconds(op)
    assert half.link_bytes_per_s == cpu.link_bytes_per_s


def _quiet_wrap(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return spillover.wrap(model, chunked_loss=False, **kw)


def test_a_learning_step_times_its_regions(tiny_gpt):
    """On real CPU tensors the learning step's regions carry their forward's seconds and the
    planner's machine is scaled by them; with a machine given, its figures stand."""
    base, batch = tiny_gpt
    ref = gpt_step(base, batch)
    planner = Planner(budget_bytes=1, seed_from_trace=False)
    model = _quiet_wrap(copy.deepcopy(base), policy=planner)
    assert_bitwise(ref, gpt_step(model, batch))  # learning
    assert_bitwise(ref, gpt_step(model, batch))  # planned from it
    recs = planner.planned_records
    assert recs and all(r.forward_seconds > 0 for r in recs)
    assert MIN_SCALE <= planner.compute_scale <= 1.0
    assert planner.machine_of(recs).compute_scale == planner.compute_scale
    given = Machine({"float32": 1e11}, 5e9, 1e10, 1e10)
    planner = Planner(budget_bytes=1, machine=given, seed_from_trace=False)
    model = _quiet_wrap(copy.deepcopy(base), policy=planner)
    for _ in range(2):
        assert_bitwise(ref, gpt_step(model, batch))
    assert planner.planned_records
    assert planner.compute_scale == 1.0 and planner.machine_of(planner.planned_records) is given


def test_an_estimates_fake_regions_are_not_timed(tiny_gpt):
    base, batch = tiny_gpt
    with torch.device("meta"):
        model = copy.deepcopy(base).to("meta")
    idx = torch.zeros_like(batch[0], device="meta")
    est = spillover.estimate(model, idx, idx, device="h200", optimizer="none", modes=["auto"],
                             budget=1 << 20)
    recs = est["auto"].planner.planned_records
    assert recs and all(r.forward_seconds == 0 for r in recs)
    assert est["auto"].planner.compute_scale == 1.0
