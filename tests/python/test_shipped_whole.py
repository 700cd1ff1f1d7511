"""Regions shipped whole (Note [regions shipped whole] in spillover/planner/search.py): the
sets of regions the link keeps pace with, the plans that run them plainly under the context,
and their copies back started at a later region's backward (``OffloadContext.stage_next``).
(On the estimated H200, test_estimate_h200.py: auto at 0.7x none's peak.)"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import assert_bitwise, gpt_step
from test_planner_search import MiB, _step

from spillover.planner import Machine, Planner, explain_records, make_plan
from spillover.planner.variants import shipped_bytes
from spillover.planner.variants import shipped_sets as _shipped_sets

#: a GPU-like machine: 8 ms per synthetic block's forward, a 20 GB/s link (160 MB a block)
GPU = Machine({"float32": 5e12}, 5e11, 2e10, 2e10, 5e9, 5e9, host_seconds_per_offload=20e-6)


def _info(**kw):
    return dict({"tier": "host", "pool_bytes": 64 << 30, "nvme": False, "sim": None,
                 "rederive": True, "inflight_bytes": 64 * MiB}, **kw)


def _in_flight(recs, chosen, machine):
    """The most bytes still in flight at a region's end when ``chosen`` are shipped."""
    backlog = worst = 0.0
    for i, r in enumerate(recs):
        backlog = max(0.0, backlog + (shipped_bytes(r, True) if i in chosen else 0)
                      - machine.link_bytes_per_s * machine.forward_seconds(r.ops))
        worst = max(worst, backlog)
    return worst


@pytest.mark.parametrize("cap_mib,spaced", [(64, 2), (1024, 1)])
def test_the_link_keeps_pace_with_the_regions_shipped(cap_mib, spaced):
    """A block ships 216 MiB in an 8 ms forward that drains 160 MB: with 64 MiB in flight at
    most, every other block; with 1 GiB, consecutive blocks. Never the last (backward needs
    it first); each count the one before and one more; nothing past the pool."""
    recs = _step(8, "cuda:0", _info(inflight_bytes=cap_mib * MiB))
    sets = _shipped_sets(recs, GPU, recs[0].offload, False, True, True)
    assert sets[0] == () and len(sets) > 2
    for a, b in zip(sets, sets[1:]):
        assert len(b) == len(a) + 1
    for s in sets[1:]:
        assert 7 not in s
        assert list(s) == list(range(0, spaced * len(s), spaced))
        assert _in_flight(recs, s, GPU) <= cap_mib * MiB
    small = _step(8, "cuda:0", _info(pool_bytes=500 * MiB))
    assert max(len(s) for s in _shipped_sets(small, GPU, small[0].offload, False, True,
                                              True)) == 2  # 2 x 216 MiB in the pool


def test_nothing_is_shipped_whole_where_it_would_leave_ram_or_frees_nothing():
    for recs, host in ((_step(8, "cuda:0", _info(tier="nvme", nvme=True)), False),
                       (_step(8, "cpu", _info()), True)):
        assert _shipped_sets(recs, GPU, recs[0].offload, host, True, True) == [()]
    auto = _step(8, "cuda:0", _info(tier="auto", nvme=True))  # RAM first: tier auto
    assert len(_shipped_sets(auto, GPU, auto[0].offload, False, True, True)) > 1
    assert _shipped_sets(_step(8, "cuda:0"), GPU, None, False, True, True) == [()]


def test_a_budget_below_none_ships_whole_regions_and_brings_them_back_ahead():
    """At 0.7x what no checkpointing holds the plan runs every block plainly, three of them
    shipped whole, at a fraction of what recomputing costs; each comes back from the start of
    the next block's backward (the one after it outlasts its 11 ms of copies), with that
    block's input when it is checkpointed; the copies in flight beside the forward fit."""
    recs = _step(8, "cuda:0", _info())
    plain = 16 * MiB + sum(r.input_bytes + r.needed_bytes for r in recs)
    budget = int(0.7 * plain)
    plan = make_plan(recs, GPU, budget, 16 * MiB, peak_offset={"learning": 0})
    assert plan.fits and "shipped whole: 0 2 4" in plan.variant, plan.variant
    modes = [r.mode for r in plan.regions]
    assert [i for i, m in enumerate(modes) if m == "plain-offload"] == [0, 2, 4]
    assert plan.returns == {1: shipped_bytes(recs[0], True), 3: shipped_bytes(recs[2], True),
                            5: shipped_bytes(recs[4], True)}
    assert plan.model_peak <= budget
    ex = explain_records(recs, "auto", GPU, plan, 16 * MiB, 0)
    assert ex.summary["shipped whole"] == "; ".join(
        f"blocks.{i}, back from blocks.{i + 1}'s backward" for i in (0, 2, 4))
    without = make_plan(_step(8, "cuda:0", _info(inflight_bytes=0)), GPU, budget, 16 * MiB,
                        peak_offset={"learning": 0})
    assert "shipped whole" not in without.variant
    assert plan.recompute_seconds + plan.transfer_seconds < 0.5 * (
        without.recompute_seconds + without.transfer_seconds)
    # tighter: checkpointed blocks between the shipped ones, whose inputs come back too
    tight = make_plan(_step(8, "cuda:0", _info()), GPU, int(0.6 * plain), 16 * MiB,
                      peak_offset={"learning": 0})
    assert "shipped whole" in tight.variant and tight.fits
    for i, r in enumerate(tight.regions):
        if r.mode != "plain-offload":
            continue
        after = tight.regions[i + 1]  # its backward (16 ms) outlasts the copies (11 ms)
        assert tight.returns[i + 1] == shipped_bytes(r.record, True) + (
            after.record.input_bytes if after.mode == "checkpoint" else 0)


def _shipping_plan(plan, returns):
    """``plan`` with its first block shipped whole and the others run plainly."""
    regions = [dataclasses.replace(r, mode="plain-offload" if i == 0 else "plain-keep",
                                   remake=False) for i, r in enumerate(plan.regions)]
    return dataclasses.replace(plan, regions=regions, returns=returns, keep_all=False,
                               keep_tail=False, variant="test: first shipped whole")


def _gpt():
    from spillover.models import GPT, GPTConfig, synthetic_batch

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=512, d_model=128, n_heads=4, n_layers=4, seq=256)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=4)

    def step(m, ctx=None):
        if ctx is None:
            return gpt_step(m, batch)
        return gpt_step(m, batch, ctx)
    return model, step


def _llama():
    transformers = pytest.importorskip("transformers")
    from conftest import grads

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512,
                                   num_hidden_layers=4, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="sdpa")
    ids = torch.randint(0, 32000, (2, 256))

    def step(m, ctx=None):
        m.zero_grad(set_to_none=True)
        if ctx is None:
            m(input_ids=ids, labels=ids).loss.backward()
        else:
            with ctx:
                m(input_ids=ids, labels=ids).loss.backward()
        return grads(m)
    return model, step


@pytest.mark.parametrize("family", ["gpt", "hf llama"])
def test_a_region_shipped_whole_comes_back_ahead_on_the_simulated_device(family, monkeypatch):
    """The built-in GPT and an HF Llama (SDPA, RMSNorm, SiLU MLP, vocabulary 32000) on the
    simulated H200, the Quick start's loop, a plan that ships the first block whole and runs
    the others plainly: bitwise to no checkpointing at every step, and more of its unpacks are
    started ahead from the third block's backward (``stage_next``, once a step, copies started),
    not without the plan's ``returns``."""
    from test_sim_device_plans import _ctx, _quiet_wrap

    from spillover.activations.context import OffloadContext

    started = []
    stage_next = OffloadContext.stage_next

    def counted(self, nbytes):
        started.append(stage_next(self, nbytes))
        return started[-1]

    monkeypatch.setattr(OffloadContext, "stage_next", counted)
    base, step = _gpt() if family == "gpt" else _llama()
    ref = step(base)
    planner = Planner(budget_bytes=1 << 40, seed_from_trace=False)
    model = _quiet_wrap(copy.deepcopy(base), policy=planner)
    for _ in range(2):  # learn (everything fits: all plain)
        assert_bitwise(ref, step(model, _ctx()))
    learned = planner.plan
    assert len(learned.regions) == 4
    for returns in ({2: 1 << 40}, {}):
        planner.use_plan(_shipping_plan(learned, returns))
        started.clear()
        for _ in range(3):
            ctx = _ctx()
            assert_bitwise(ref, step(model, ctx))
            s = ctx.stats()
            assert s.tensors_offloaded > 0 and s.unpacks_staged > 0, s
        if returns:  # the first block's saves: all but those its sources still answer
            assert len(started) == 3 and min(started) > 0, started
        else:
            assert started == []
