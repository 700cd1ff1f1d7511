"""What a region's dispatch costs the host, on an HF Llama with fused (SDPA) and explicit
attention, bitwise all the same:

- Note [a replay with nothing to answer] (spillover/recompute/modes.py): a region whose every op
  is recomputed replays without spillover's dispatch mode, and a region auto planned to
  recompute in full runs as torch's full checkpointing, modes off in its forward too;
- Note [a forward that follows its record] (spillover/recompute/follow.py): a region auto
  planned to save some ops, or run by selective after its first refined run, records none of
  its ops, skips in its replay what the recording mode skips, and hands back to recording
  (auto's planner to learning) when its ops change."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from conftest import assert_bitwise, grads

import spillover
from spillover.planner import Machine, Planner
from spillover.recompute import modes

transformers = pytest.importorskip("transformers")

MACHINE = Machine(matmul_flops={"float32": 1e11}, elementwise_bytes_per_s=1e10,
                  d2h_bytes_per_s=5e9, h2d_bytes_per_s=5e9)


@pytest.fixture
def llama(tiny_hf_llama):
    return tiny_hf_llama


@pytest.fixture
def dispatched(monkeypatch):
    """Ops each of spillover's two modes saw, counted."""
    seen = {"save": 0, "replay": 0}
    for name, cls in (("save", modes._SaveMode), ("replay", modes._ReplayMode)):
        inner = cls.__torch_dispatch__

        def counting(self, func, types, args=(), kwargs=None, _inner=inner, _name=name):
            seen[_name] += 1
            return _inner(self, func, types, args, kwargs)

        monkeypatch.setattr(cls, "__torch_dispatch__", counting)
    return seen


@pytest.fixture
def records(monkeypatch):
    """Ops the recording mode recorded, and stand-ins the replays made, counted."""
    seen = {"recorded": 0, "skipped": 0}
    record, make = modes._SaveMode._record, modes._Skip.make

    def counting_record(self, *a, **kw):
        seen["recorded"] += 1
        return record(self, *a, **kw)

    def counting_make(self, *a):
        seen["skipped"] += 1
        return make(self, *a)

    monkeypatch.setattr(modes._SaveMode, "_record", counting_record)
    monkeypatch.setattr(modes._Skip, "make", counting_make)
    return seen


def _step(model, ids, ctx=None):
    model.zero_grad(set_to_none=True)
    with ctx or contextlib.nullcontext():
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return grads(model)


def _wrap(model, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache=False
        return spillover.wrap(model, policy=policy, chunked_loss=False)


def _ctx():
    return spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=16 << 20)


@pytest.mark.parametrize("tier", [None, "host"])
def test_a_region_that_saves_nothing_replays_without_the_mode(llama, dispatched, tier):
    base, ids = llama
    ref = _step(base, ids)
    nothing = _wrap(copy.deepcopy(base), lambda op, inputs, out: "recompute")
    assert_bitwise(ref, _step(nothing, ids, _ctx() if tier else None))
    assert dispatched["save"] > 0  # the forward still ran under the save mode
    assert dispatched["replay"] == 0
    # the count can fail: a policy that saves the matmuls replays under the mode
    matmuls = _wrap(copy.deepcopy(base), lambda op, inputs, out: "save"
                    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                    else "recompute")
    assert_bitwise(ref, _step(matmuls, ids, _ctx() if tier else None))
    assert dispatched["replay"] > 0


def test_auto_planned_to_recompute_all_runs_as_torchs_full_checkpointing(llama, dispatched):
    """A budget nothing fits in: every region recomputed in full. From the first planned step
    on, neither mode sees an op (the learning step ran under both)."""
    base, ids = llama
    ref = _step(base, ids)
    planner = Planner(budget_bytes=1, machine=MACHINE, seed_from_trace=False)
    model = _wrap(copy.deepcopy(base), planner)
    assert_bitwise(ref, _step(model, ids, _ctx()))  # learning
    assert dispatched["save"] > 0 and dispatched["replay"] == 0
    assert_bitwise(ref, _step(model, ids, _ctx()))  # the first planned step
    assert planner.plan is not None
    assert all(r.recomputes_all for r in planner.plan.regions), planner.plan.regions
    dispatched["save"] = 0
    for _ in range(3):
        assert_bitwise(ref, _step(model, ids, _ctx()))
    assert dispatched == {"save": 0, "replay": 0}
    assert planner.plan is not None and not planner._dirty


def _partial(base, ids, ref):
    """auto at a budget where its first block saves some ops and recomputes the rest (found by
    budget: the vocabulary's logits set the scale), after its learning step."""
    for budget in range(7_000_000, 12_000_001, 250_000):
        planner = Planner(budget_bytes=budget, machine=MACHINE, measure_peak=False,
                          seed_from_trace=False)
        model = _wrap(copy.deepcopy(base), planner)
        assert_bitwise(ref, _step(model, ids))  # learning
        assert_bitwise(ref, _step(model, ids))  # planned
        if any(r.mode == "checkpoint" and not r.recomputes_all for r in planner.plan.regions):
            return planner, model
    pytest.fail("no budget gave a block that saves some ops and recomputes others")


def test_a_planned_forward_records_nothing(llama, records, monkeypatch):
    base, ids = llama
    ref = _step(base, ids)
    planner, model = _partial(base, ids, ref)
    records.update(recorded=0, skipped=0)
    for _ in range(2):
        assert_bitwise(ref, _step(model, ids))
    assert records["recorded"] == 0
    lean = records["skipped"]
    assert lean > 0  # the plan saves what lets the replay skip ops
    # the recording mode's forward, on the same plan, skips the same ops in its replays
    from spillover.recompute import follow

    monkeypatch.setattr(follow, "following_contexts", lambda run, *a: run.contexts)
    records.update(recorded=0, skipped=0)
    for _ in range(2):
        assert_bitwise(ref, _step(model, ids))
    assert records["recorded"] > 0
    assert records["skipped"] == lean
    assert not planner._dirty


def test_a_planned_forward_whose_ops_change_records_again(llama, records):
    """The block's activation swapped after planning (same shapes, other ops): the run is
    bitwise to the swapped model's, the planner learns again, and the next plan is followed."""
    base, ids = llama
    planner, model = _partial(base, ids, _step(base, ids))
    for m in (base, model):
        for layer in m.model.layers:
            layer.mlp.act_fn = torch.nn.GELU()
    ref = _step(base, ids)
    records.update(recorded=0)
    assert_bitwise(ref, _step(model, ids))
    assert records["recorded"] > 0  # the rest of the run went through the recording mode
    assert planner._dirty
    for _ in range(3):
        assert_bitwise(ref, _step(model, ids))
    assert planner.plan is not None and not planner._dirty


def test_selective_follows_its_first_refined_run(llama, records, monkeypatch):
    """selective (the default policy): its first call learns what pays to save, its second is
    recorded, the calls after it follow that record -- also under an offload context, where
    the first call under it decides offload where the record says keep, and records again."""
    base, ids = llama
    ref = _step(base, ids)
    model = _wrap(copy.deepcopy(base), spillover.SelectivePolicy(machine=MACHINE))
    for _ in range(2):
        assert_bitwise(ref, _step(model, ids))
    records.update(recorded=0, skipped=0)
    for _ in range(2):
        assert_bitwise(ref, _step(model, ids))
    assert records["recorded"] == 0
    followed = records["skipped"]
    assert "recompute" in str(spillover.explain(model))
    for expect_recorded in (False, True, False):  # decided offload: changed; recorded; followed
        records.update(recorded=0)
        assert_bitwise(ref, _step(model, ids, _ctx()))
        assert (records["recorded"] > 0) is expect_recorded
    from spillover.recompute import follow

    monkeypatch.setattr(follow, "following_contexts", lambda run, *a: run.contexts)
    records.update(recorded=0, skipped=0)
    for _ in range(2):
        assert_bitwise(ref, _step(model, ids))
    assert records["recorded"] > 0 and records["skipped"] == followed


def test_selective_whose_ops_change_records_again(llama, records):
    base, ids = llama
    model = _wrap(copy.deepcopy(base), spillover.SelectivePolicy(machine=MACHINE))
    for _ in range(3):
        _step(model, ids)
    for m in (base, model):
        for layer in m.model.layers:
            layer.mlp.act_fn = torch.nn.GELU()
    ref = _step(base, ids)
    for expect_recorded in (True, True, False):  # diverged; recorded; followed
        records.update(recorded=0)
        assert_bitwise(ref, _step(model, ids))
        assert (records["recorded"] > 0) is expect_recorded


def test_a_callable_policy_follows_its_first_run_while_it_decides_the_same(llama, records):
    """A user's policy is asked for every op of every run; the record only spares the
    bookkeeping. One that changes its mind (here: every op saved from the fourth step on) makes
    the run after it record again."""
    base, ids = llama
    ref = _step(base, ids)
    state = {"all": False}

    def policy(op, inputs, out):
        return "save" if state["all"] or op is torch.ops.aten.mm.default else "recompute"

    model = _wrap(copy.deepcopy(base), policy)
    for step, expect_recorded in enumerate((True, False, False, False, True, False)):
        state["all"] = step >= 3
        records.update(recorded=0)
        assert_bitwise(ref, _step(model, ids))
        assert (records["recorded"] > 0) is expect_recorded, step
