"""Both attention kinds of the built-in GPT (written-out softmax and fused SDPA, what Hugging
Face models use by default): loss and every parameter gradient bitwise equal to the plain
model's in every recompute policy, with no context, a host context and an NVMe context."""

import copy

import pytest
import torch
from conftest import assert_bitwise, grads, loss_cap_of

import spillover
from spillover.models import ATTENTION_KINDS, GPT, GPTConfig, synthetic_batch
from spillover.planner import Machine

aten = torch.ops.aten

# Fixed rates, so no test calibrates the machine.
MACHINE = Machine({"float32": 1e11}, 5e9, 6e9, 6e9, 3e9, 2e9)


def _save_matmuls(op, inputs, output):
    return "save" if op in (aten.addmm.default, aten.mm.default, aten.bmm.default) else "recompute"


POLICIES = ["full", "selective", "offload", "auto", "auto-mix", "callable"]


def _policy(name, measure_peak=True):
    if name == "auto":
        # A budget far below what the model holds: the planner frees all it can.
        return spillover.Planner(budget_bytes=1, machine=MACHINE, measure_peak=measure_peak)
    if name == "auto-mix":
        # Below the plain step's peak, above full recompute's: whatever mix the planner picks.
        return spillover.Planner(budget_bytes=512 << 10, machine=MACHINE)
    if name == "callable":
        return _save_matmuls
    return name


def _context(tier, tmp_path, pool_bytes):
    if tier is None:
        return None
    if tier == "host":
        return spillover.offload_context("host", min_offload_bytes=4096,
                                         host_pool_bytes=pool_bytes)
    # A pool smaller than the activations: some of them go to disk.
    return spillover.offload_context("nvme", min_offload_bytes=4096, host_pool_bytes=pool_bytes,
                                     nvme_path=str(tmp_path))


def _gpt(attn, dropout=0.0):
    torch.manual_seed(0)
    # chunked_loss: the loss wrap gives the model, so the plain reference is the same math
    cfg = GPTConfig(vocab=128, d_model=64, n_heads=2, n_layers=2, seq=64, attn=attn,
                    dropout=dropout, chunked_loss=True)
    return GPT(cfg), synthetic_batch(cfg, batch=2)


def _step(model, batch, ctx=None, seed=None):
    """Loss and gradients of one step; backward after the ``with`` block, as users write it."""
    model.zero_grad(set_to_none=True)
    if seed is not None:
        torch.manual_seed(seed)
    idx, tgt = batch
    if ctx is None:
        loss = model(idx, tgt)
    else:
        with ctx:
            loss = model(idx, tgt)
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("tier", [None, "host", "nvme"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("attn", ATTENTION_KINDS)
def test_gradients_bitwise(attn, policy, tier, tmp_path, private_pool_bytes):
    base, batch = _gpt(attn)
    # Without a context, auto bounds the bytes held, not a measured peak: a process whose RSS
    # does not grow (memory an earlier test freed) measures a peak far below the model's, and a
    # plan corrected by it may keep everything, which this test does not cover.
    model = spillover.wrap(copy.deepcopy(base), policy=_policy(policy, tier is not None))
    # NVMe: a pool of its own, 1 MiB and a few pages, below the ~2 MiB the model saves.
    pool = private_pool_bytes if tier == "host" else private_pool_bytes - (199 << 20)
    # auto: the first step learns, the next ones follow the plan (and its loss chunk: the plain
    # reference runs the same one, loss_cap_of).
    for _ in range(3 if policy.startswith("auto") else 2):
        loss, got = _step(model, batch, _context(tier, tmp_path, pool))
        with spillover.loss.limit_chunk(loss_cap_of(model)):
            ref_loss, ref_grads = _step(base, batch)
        assert torch.equal(loss, ref_loss)
        assert_bitwise(ref_grads, got)
    if policy == "auto":
        # The planner acted (recomputes, or offloads under a context): parity covers a plan.
        decisions = {r["decision"] for r in spillover.explain(model).rows}
        assert any(d.startswith(("recompute", "offload")) for d in decisions), decisions


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("attn", ATTENTION_KINDS)
def test_dropout_replays_the_same_mask(attn, policy):
    """Recompute reruns attention dropout with the forward's random state."""
    base, batch = _gpt(attn, dropout=0.1)
    ref_loss, ref_grads = _step(base, batch, seed=1)
    model = spillover.wrap(copy.deepcopy(base), policy=policy)
    loss, got = _step(model, batch, seed=1)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(ref_grads, got)


def test_the_kinds_agree_and_sdpa_saves_no_scores():
    """The two kinds compute the same function (not bitwise: different kernels)."""
    explicit, batch = _gpt("explicit")
    sdpa, _ = _gpt("sdpa")
    sdpa.load_state_dict(explicit.state_dict())
    torch.testing.assert_close(sdpa(*batch), explicit(*batch), rtol=1e-5, atol=1e-5)
    s = batch[0].shape[1]
    scores = [_saves_scores(m, batch, s) for m in (explicit, sdpa)]
    assert scores == [True, False]


def _saves_scores(model, batch, s):
    """Whether autograd saves a (batch, heads, s, s) tensor in the forward of ``model``."""
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t,
                                                  lambda t: t):
        model(*batch)
    return any(len(sh) == 4 and tuple(sh[-2:]) == (s, s) for sh in shapes)


def test_unknown_attention_kind():
    with pytest.raises(ValueError, match="attn.*'flash'"):
        GPTConfig(attn="flash")
