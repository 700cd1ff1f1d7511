"""What a region's replay holds in backward, on an HF Llama with explicit and fused (SDPA)
attention, bitwise all the same (spillover/recompute/replay.py):

- Note [a kept output goes with its use]: the first replay gives up each kept entry it hands
  back (the recomputed graph holds it from there, and frees it once its reader ran); a second
  backward (``retain_graph=True``) reruns the region in full, bitwise, where torch's own
  selective checkpointing refuses;
- Note [stand-ins share one buffer]: a replay's stand-ins for skipped ops are views of one
  buffer per device and dtype, not one allocation each."""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
from conftest import assert_bitwise, grads

import spillover
from spillover.recompute import modes, replay

transformers = pytest.importorskip("transformers")

#: torch < 2.8 has no hook to see autograd's saves: no op is skipped, nothing dropped after the
#: last save (Note [after the last save] in recompute/modes.py)
SAVES_SEEN = modes.top_hooks is not None
needs_top_hooks = pytest.mark.skipif(not SAVES_SEEN, reason="needs torch 2.8+ (saves not seen)")

MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)


@pytest.fixture
def llama(tiny_hf_llama):
    return tiny_hf_llama


@pytest.fixture
def replays(monkeypatch):
    """Every replay mode a region run made (recording or following its record), in order."""
    made = []
    init = replay._ReplayMode.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(replay._ReplayMode, "__init__", recording)
    return made


def _wrap(model, policy):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # use_cache=False
        return spillover.wrap(model, policy=policy, chunked_loss=False)


def _save_matmuls(op, inputs, out):
    return "save" if op in MATMULS else "recompute"


def _save_softmax(op, inputs, out):
    return "save" if op is torch.ops.aten._softmax.default else "recompute"


def _loss(model, ids, ctx=None):
    with ctx or contextlib.nullcontext():
        return model(input_ids=ids, labels=ids, use_cache=False).loss


def _kept(storage):
    """The kept (plain-reference) entries left in a run's cache, and the given-up ones."""
    kept = given = 0
    for entries in storage.values():
        for e in entries.values():
            if e is replay.CONSUMED:
                given += 1
            elif e is not replay.RECOMPUTE and not isinstance(e, replay._Skip) \
                    and replay._held(e):  # one output or several (fused attention's)
                kept += 1
    return kept, given


def _save_all(op, inputs, out):
    return "save"


@pytest.mark.parametrize("policy", [_save_matmuls, _save_all])
def test_the_first_replay_gives_up_what_it_hands_back(llama, replays, policy):
    base, ids = llama
    ref_m = copy.deepcopy(base)
    _loss(ref_m, ids).backward()
    ref = grads(ref_m)
    model = _wrap(copy.deepcopy(base), policy)
    for _ in range(2):  # the first run records, the second follows the record
        replays.clear()
        model.zero_grad(set_to_none=True)
        loss = _loss(model, ids)
        before = [_kept(r.storage) for r in replays]
        assert sum(k for k, _ in before) > 0 and all(g == 0 for _, g in before)
        loss.backward()
        assert_bitwise(ref, grads(model))
        after = [_kept(r.storage) for r in replays]
        # every kept output the replay handed back was given up, none kept back; without
        # autograd's saves seen (torch < 2.8) the outputs after the last save stay, never
        # asked for (recomputation stops at the last save)
        if SAVES_SEEN:
            assert after == [(0, k) for k, _ in before], (before, after)
        else:
            assert all(g > 0 and k + g == kb for (k, g), (kb, _) in zip(after, before))
        assert all(r.replays == 1 and not r.rerun_all for r in replays)


@pytest.mark.parametrize("tier", [None, "host"])
def test_a_second_backward_reruns_what_the_first_gave_up(llama, replays, tier):
    """retain_graph=True: the second replay of each region runs every op again, skipped and
    kept ones too, from the region's inputs; the gradients are those of two plain backwards.
    Offloaded entries are not given up (the host tier's: the context's to hand back again)."""
    base, ids = llama
    ref_m = copy.deepcopy(base)
    loss = _loss(ref_m, ids)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = grads(ref_m)
    for policy in (_save_matmuls, _save_softmax):
        model = _wrap(copy.deepcopy(base), policy)
        for _ in range(2):
            replays.clear()
            model.zero_grad(set_to_none=True)
            ctx = (spillover.offload_context("host", min_offload_bytes=0,
                                             host_pool_bytes=16 << 20) if tier else None)
            loss = _loss(model, ids, ctx)
            loss.backward(retain_graph=True)
            loss.backward()
            assert_bitwise(ref, grads(model))
            answered = [r for r in replays if r.gave_up]
            # the host tier takes the saved outputs (nothing kept to give up); fused attention
            # has no softmax of its own to save
            sdpa = base.config._attn_implementation == "sdpa"
            if tier is None and not (sdpa and policy is _save_softmax):
                assert answered
            assert all(r.replays == 2 and r.rerun_all for r in answered)


def test_torchs_selective_checkpointing_refuses_a_second_backward():
    """What spillover's replay does instead (above): torch's own gives its cache up too, and
    says so on a second backward. If torch ever keeps it, this note in replay.py is stale."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)

    def ctx():
        return create_selective_checkpoint_contexts(list(MATMULS))

    y = checkpoint(lambda t: torch.nn.functional.gelu(lin(t)), x, use_reentrant=False,
                   context_fn=ctx)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        y.sum().backward()


@needs_top_hooks
def test_stand_ins_share_one_buffer(llama, replays, monkeypatch):
    """With the softmax output saved, the ops before it that only it reads are skipped
    (eager attention: the scores matmul, the scaling and the mask); their stand-ins are views
    of one buffer per replay, device and dtype, not one allocation each."""
    base, ids = llama
    ref_m = copy.deepcopy(base)
    _loss(ref_m, ids).backward()
    ref = grads(ref_m)
    made = []
    make = replay._Skip.make

    def recording(self, scratch):
        t = make(self, scratch)
        made.append((id(scratch), t.dtype, t.untyped_storage().data_ptr(), t.shape))
        return t

    monkeypatch.setattr(replay._Skip, "make", recording)
    model = _wrap(copy.deepcopy(base), _save_softmax)
    for _ in range(2):
        made.clear()
        replays.clear()
        model.zero_grad(set_to_none=True)
        _loss(model, ids).backward()
        assert_bitwise(ref, grads(model))
        if base.config._attn_implementation == "sdpa":
            assert not made  # no softmax of its own to save: nothing skipped
            continue
        assert len(made) >= 2 * len(replays), made  # at least two per block
        buffers = {}
        for scratch, dtype, ptr, _shape in made:
            buffers.setdefault((scratch, dtype), set()).add(ptr)
        assert all(len(ptrs) == 1 for ptrs in buffers.values()), buffers
        assert len({s for s, _ in buffers}) == len(replays)  # one scratch per replay
