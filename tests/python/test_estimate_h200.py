"""``spillover.estimate(device="h200")`` against what an H200 measured (issue 40, item 3): the GPU
probe's 1B Llama (benches/gpu/llama.py; seq 4096, bf16, batch 1, forward and backward), each
mode's step time within 10 % and its peak ``max_memory_allocated`` within 5 % of the probe's
``step`` table (../shared/gpu-2026-12-04/probe-step.json, copied below). The model is built on
``meta``: nothing is allocated. benches/python/estimate_h200.py prints the same table.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benches", "gpu"))

from llama import Llama  # noqa: E402

import spillover  # noqa: E402
from spillover.planner.search import KEPT_START  # noqa: E402

DIMS = dict(vocab=32000, d=2048, layers=16, heads=16, ffn=5632, seq=4096)
# probe-step.json of 2026-12-04: median forward + backward (s), peak max_memory_allocated (B)
MEASURED = {
    "none": (0.08614, 11708109824),
    "full": (0.12699, 4301883392),
    "host": (0.32236, 4004075520),
}


def _estimate(modes, budget=None, pool="16GiB", rederive=None, chunked_loss=False):
    """``spillover.estimate(device="h200")`` of the probe's 1B Llama, built on ``meta``."""
    with torch.device("meta"):
        model = Llama(**DIMS).to(torch.bfloat16)
    model.chunked_loss = chunked_loss
    idx = torch.zeros(1, DIMS["seq"], dtype=torch.long, device="meta")
    kw = {} if pool is None else {"host_pool_bytes": pool}
    return spillover.estimate(model, idx, idx, device="h200", optimizer="none", modes=modes,
                              budget=budget, rederive=rederive, **kw)


@pytest.fixture(scope="module")
def est():
    # the probe ran before Note [made again at unpack] (activations/rederive.py): its host
    # mode shipped every saved tensor
    return _estimate(list(MEASURED), rederive=False)


def test_h200_host_mode_makes_cheap_tensors_again(est):
    """Note [made again at unpack]: the 1B Llama's MLP activations and products and its norms'
    outputs (120 of 440 MiB a layer) are not shipped but made again at unpack: the host mode's
    link-bound step is faster by what they would have cost the link, at the same peak."""
    shipped = est["host"]
    made = _estimate(["host"])["host"]
    assert made.trace.extra["offloaded"] <= 0.8 * shipped.trace.extra["offloaded"]
    assert made.step_seconds <= 0.85 * shipped.step_seconds
    assert abs(made.device_peak_bytes - shipped.device_peak_bytes) \
        <= 0.02 * shipped.device_peak_bytes


@pytest.mark.parametrize("mode", list(MEASURED))
def test_h200_estimate_matches_the_probe(est, mode):
    seconds, peak = MEASURED[mode]
    e = est[mode]
    assert abs(e.step_seconds - seconds) <= 0.10 * seconds, (mode, e.step_seconds, seconds)
    assert abs(e.device_peak_bytes - peak) <= 0.05 * peak, (mode, e.device_peak_bytes, peak)


def test_h200_host_mode_is_link_bound(est):
    """What the probe's host mode showed: 8.68 GB offloaded, each way over a 54 GB/s link, and
    the step no faster than the bytes each way allow."""
    e = est["host"]
    assert e.trace.extra["offloaded"] == 8678014976
    assert e.step_seconds >= 2 * 8678014976 / 54e9 * 0.9


def test_h200_auto_at_full_budget_checkpoints(est):
    """Note [a family's own offset] (planner/trials.py): at full checkpointing's peak the
    plain-offload learning step's offset no longer rules the checkpoint family out; auto
    settles on a checkpoint plan within its budget, well under plain offload's time (the host
    mode's), where it ran plain offload at 2.5x full's time before. Note [the tail stays]
    (planner/search.py): the plan keeps the loss's 0.5 GB on the device as full does, within
    1.05x full's time (1.10x when the context shipped it)."""
    full = est["full"]
    budget = full.device_peak_bytes - full.trace.base
    au = _estimate(["auto"], budget=budget)["auto"]
    assert au.plan is not None and au.plan.variant.startswith("checkpoint"), au.note
    assert au.device_peak_bytes - au.trace.base <= budget, au.note
    assert "checkpoint" in au.planner.peak_offsets
    assert au.step_seconds < 0.5 * est["host"].step_seconds
    assert au.plan.keep_tail, au.note
    # Issue 40: never slower than the fastest fixed mode that fits its budget (full here).
    # Note [a kept trial] (planner/trials.py): the plan that ships measured within the budget,
    # so one tuning step tried shipping nothing, as full does, and its peak fit: before, auto
    # settled on the shipping plan at 1.02x full's time (the context's 16 input packs and
    # staging), and before Note [a replay's host time is the region's] (planner/machine.py)
    # on one that offloaded the rotary outputs to skip ops whose dispatch the replay pays.
    # (Note [a plain tail makes its cheap saves again] in planner/search.py may add a last
    # layer run plainly with its cheap saves made again, where its peak measured within)
    assert au.plan.variant.startswith("checkpoint, all kept") and au.plan.keep_all, au.note
    assert "kept" in au.planner.peak_offsets
    assert au.step_seconds <= full.step_seconds, (au.step_seconds, au.note)
    # Note [gradients as backward goes] (planner/search.py): the kept plan's start of backward
    # measured apart from its rebuilt regions (offsets of ~420 and ~250 MiB here), the room
    # at the start (365 MiB) runs the last layer plainly with its cheap saves made again: 0.98x
    # full's time, where one offset for both left full recomputation (1.00x)
    assert KEPT_START in au.planner.peak_offsets
    assert au.step_seconds <= 0.99 * full.step_seconds, (au.step_seconds, au.note)


def test_h200_auto_with_the_chunked_loss_at_full_budget(est):
    """Issue 40's estimate goal at torch's full checkpointing's peak (<= 0.95x its time), for
    the same model with its head and loss by ``spillover.loss.chunked_cross_entropy``: the
    start of backward no longer holds the fp32 logits' backward (0.58 GiB over the step's start
    against 1.84 GiB), and the kept family, tried with its own offsets' plain tails (Note
    [gradients as backward goes] in planner/search.py), runs the last 4 layers plainly within
    full's peak: 0.89x full's time on 2026-12-07 (the plain tails were bounded by the checkpoint
    family's offset before: one layer, 0.97x)."""
    full = est["full"]
    budget = full.device_peak_bytes - full.trace.base
    au = _estimate(["auto"], budget=budget, chunked_loss=True)["auto"]
    assert au.device_peak_bytes - au.trace.base <= budget, au.note
    assert au.plan.keep_all, au.note
    assert au.step_seconds <= 0.95 * full.step_seconds, (au.step_seconds, au.note)


def test_h200_auto_at_0_7_of_none_fits_and_prices_its_hooks(est):
    """Note [two clocks in the plan] (planner/machine.py): at 0.7x none's peak auto's plan stays
    within its budget (cuBLAS's workspace counted as the estimate counts it), and with the
    hooks' dispatch priced it checkpoints fewer layers, and it keeps the tail (Note [the tail
    stays] in planner/search.py): under 1.14x none's predicted time (1.45x before the hooks were
    priced, 1.32x before the tail stayed; 1.24x since a replay's kept ops pay their dispatch,
    Note [a replay's host time is the region's] in planner/machine.py; 1.13x since a plain tail
    makes its cheap saves again at unpack, Note [a plain tail makes its cheap saves again] in
    planner/search.py: 11 layers plain instead of 8, and 1.16x with 10 in the runs whose tail
    missed the loss's log-probabilities, Note [a storage's key is its own while it lives] in
    recompute/blocks.py; 1.11x since every fourth layer is shipped whole, Note [regions shipped
    whole] there: 4 layers neither held nor recomputed, where shipping the first 4 stalled the
    link to 1.15x; the issue's goal, 1.01x, is not met: every checkpointed layer adds its hooks'
    dispatch to a host-bound forward and its replay's to backward, every layer made again four
    kernels, every layer shipped 107 us of host time per tensor), and faster than the fixed
    modes that fit (full and selective)."""
    none = est["none"]
    peak = int(0.7 * none.device_peak_bytes)
    budget = peak - none.trace.base
    au = _estimate(["auto"], budget=budget)["auto"]
    assert au.device_peak_bytes <= peak, au.note
    assert au.step_seconds <= 1.14 * none.step_seconds, (au.step_seconds, au.note)
    assert "made again" in au.note and "shipped whole" in au.note, au.note
    # the tail holds the loss's fp32 log-probabilities (4096 x 32000), in every run
    assert au.planner.tail_bytes >= DIMS["seq"] * DIMS["vocab"] * 4
    # never slower than the fastest fixed mode that fits (issue 40): full and selective do
    fixed = _estimate(["full", "selective"], pool=None)
    # Note [a replay's host time is the region's]: selective's replay dispatches every op
    # before each region's stop, as full's does, though it runs fewer of them on the device
    # (a stand-in is one op as the op it stands in for is; each replay also makes its
    # stand-ins' buffer, Note [stand-ins share one buffer] in recompute/replay.py)
    rec = {m: [o.name for o in fixed[m].trace.ops if o.phase == "recompute"]
           for m in ("full", "selective")}
    buffers = rec["selective"].count("empty.memory_format")
    assert 0 < buffers <= 2 * DIMS["layers"]
    assert len(rec["selective"]) - buffers == len(rec["full"])
    assert fixed["selective"].recompute_flops < fixed["full"].recompute_flops
    fitting = [fixed[m].step_seconds for m in ("full", "selective")
               if fixed[m].device_peak_bytes <= peak]
    assert fitting and au.step_seconds <= min(fitting), (au.step_seconds, fitting)


def test_h200_auto_without_a_budget_is_none(est):
    """Without a budget everything fits: auto runs every layer plainly and keeps the tail (Note
    [the tail stays] in planner/search.py), so it peaks no higher than none and takes its time
    (1.12x none's when the context shipped the loss's 0.5 GB there and back)."""
    none = est["none"]
    au = _estimate(["auto"])["auto"]
    assert au.plan is not None and au.plan.variant == "plain" and au.plan.keep_tail, au.note
    assert au.device_peak_bytes <= none.device_peak_bytes
    assert au.step_seconds <= 1.01 * none.step_seconds, (au.step_seconds, none.step_seconds)


def test_h200_no_kept_trial_past_the_devices_room(est, monkeypatch):
    """Note [a kept trial] (planner/trials.py): a trial may pass the budget for one step, never
    the device's memory: with no room for its worst case (the shipping plan's measured peak
    plus what the kept plan holds that it shipped) the kept plan is not tried."""
    from spillover.planner import trials

    monkeypatch.setattr(trials, "device_room", lambda device: 0)
    full = est["full"]
    budget = full.device_peak_bytes - full.trace.base
    au = _estimate(["auto"], budget=budget)["auto"]
    assert "kept" not in au.planner.peak_offsets
    assert not au.plan.keep_all and au.device_peak_bytes - au.trace.base <= budget, au.note


def test_h200_auto_with_free_offloads_is_not_slower_than_full(est, monkeypatch):
    """Note [a traced step is timed] (planner/tuner.py): with the device's host time per
    offload set to 0 the planner's model counts shipping 112 MiB of norm and rotary outputs a
    layer as hidden, while the trace stalls 18.8 ms a step on the copy cap and late copies
    back; auto settled there at 1.13x full's time. The trace's step times decide: the kept
    trial runs and auto is no slower than full at full's peak."""
    import dataclasses

    from spillover.estimate import devices

    monkeypatch.setitem(devices.DEVICES, "h200", dataclasses.replace(
        devices.DEVICES["h200"], host_seconds_per_offload=0.0))
    full = est["full"]
    budget = full.device_peak_bytes - full.trace.base
    au = _estimate(["auto"], budget=budget)["auto"]
    assert au.device_peak_bytes - au.trace.base <= budget, au.note
    assert au.step_seconds <= full.step_seconds, (au.step_seconds / full.step_seconds, au.note)
    timed = au.planner.measured_seconds
    assert au.planner.measured and all(id(p) in timed for p, _ in au.planner.measured)


def test_h200_full_step_phases(est):
    """benches/python/estimate_h200.py --headroom: full checkpointing's traced step is read at
    the end of forward, at the start of backward (the loss's whole-vocabulary backward done,
    no region rebuilt yet) and at its peak, which is backward's end (the first region rebuilt
    beside every weight's gradient) -- so what a plan keeps beyond full's saves, held at the
    start of backward, has only the room between the two (issue 40's goal at full's peak)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benches", "python"))
    from estimate_h200 import phases

    at = phases(est["none"], est["full"])
    start = est["none"].trace.base
    assert at["peak"] == est["full"].device_peak_bytes - start
    assert at["end of forward"] < at["start of backward"] < at["peak"]
    room = at["peak"] - at["start of backward"]
    assert 0.1 * at["peak"] < room < 0.25 * at["peak"]  # 365 MiB of 2.2 GiB on 2026-12-07
