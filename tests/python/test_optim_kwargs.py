"""Issue 20, OffloadAdamW next to torch's AdamW options (Note [torch's switches]): nanoGPT's
``fused=True`` just works, ``capturable`` / ``differentiable`` are refused with a reason, and a
state dict loaded into ``torch.optim.AdamW(fused=True)`` keeps it fused."""

from __future__ import annotations

import logging

import pytest
import torch

import spillover

POOL = 96 << 20  # the pool test_optim.py uses (pools are shared per capacity)
F = torch.nn.functional


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(33, 16), torch.nn.GELU(), torch.nn.Linear(16, 5))


def offload(params, **kw):
    kw.setdefault("host_pool_bytes", POOL)
    return spillover.OffloadAdamW(params, **kw)


def train(m, opt, steps, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x, y = torch.randn(16, 33, generator=g), torch.randn(16, 5, generator=g)
        opt.zero_grad()
        F.mse_loss(m(x), y).backward()
        opt.step()


def nanogpt_groups(m, weight_decay=0.1):
    """nanoGPT's configure_optimizers: decay the matrices, not the biases."""
    params = [p for p in m.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


@pytest.mark.parametrize("fused", [True, False, None])
@pytest.mark.parametrize("foreach", [True, False, None])
def test_fused_and_foreach_are_accepted(fused, foreach, caplog):
    """nanoGPT calls torch.optim.AdamW(groups, lr=..., betas=..., fused=True): the same call
    with OffloadAdamW runs, and the update is the same whatever fused/foreach say."""
    a, b = model(), model()
    with caplog.at_level(logging.DEBUG, logger="spillover"):
        oa = offload(nanogpt_groups(a), lr=1e-2, betas=(0.9, 0.95), fused=fused, foreach=foreach)
    ob = offload(nanogpt_groups(b), lr=1e-2, betas=(0.9, 0.95))
    asked_other = fused is False or foreach is True
    assert ("always spillover's CPU kernel" in caplog.text) == asked_other
    for g in oa.param_groups:  # what runs, not what was asked (Note [torch's switches])
        assert (g["fused"], g["foreach"]) == (True, None)
    train(a, oa, 3, seed=1)
    train(b, ob, 3, seed=1)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_capturable_differentiable_and_bad_values_are_refused():
    m = model()
    with pytest.raises(ValueError, match="capturable=True.*CUDA graph"):
        offload(m.parameters(), capturable=True)
    with pytest.raises(ValueError, match="differentiable=True.*outside autograd"):
        offload(m.parameters(), differentiable=True)
    with pytest.raises(ValueError, match="fused must be True, False or None"):
        offload(m.parameters(), fused="yes")
    offload(m.parameters(), capturable=False, differentiable=False)  # the defaults are fine
    opt = offload(list(m[0].parameters()))
    with pytest.raises(ValueError, match="capturable=True"):
        opt.add_param_group({"params": list(m[2].parameters()), "capturable": True})
    opt.add_param_group({"params": list(m[2].parameters()), "fused": False})
    assert opt.param_groups[-1]["fused"] is True


def test_state_dict_into_torch_fused_adamw_stays_fused():
    """Loaded into torch.optim.AdamW(fused=True), OffloadAdamW's state dict keeps fused on, and
    the next steps match OffloadAdamW's own (bitwise where the CPU has FMA)."""
    a, b = model(), model()
    oa = offload(nanogpt_groups(a), lr=1e-2, fused=True)
    train(a, oa, 3, seed=1)
    sd = oa.state_dict()
    torch_keys = set(torch.optim.AdamW(model().parameters()).state_dict()["param_groups"][0])
    assert torch_keys <= set(sd["param_groups"][0])
    b.load_state_dict(a.state_dict())
    tb = torch.optim.AdamW(nanogpt_groups(b), lr=1e-2, fused=True)
    tb.load_state_dict(sd)
    assert all(g["fused"] is True and not g["foreach"] and not g["capturable"]
               and not g["differentiable"] for g in tb.param_groups)
    train(a, oa, 3, seed=2)
    train(b, tb, 3, seed=2)
    exact = spillover._native.AdamState.fma_available()
    for p, q in zip(a.parameters(), b.parameters()):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


def test_checkpoints_without_the_keys_and_from_torch_load():
    """An OffloadAdamW checkpoint from before the keys, and a torch AdamW(capturable=True)
    checkpoint, load; OffloadAdamW keeps its own switches."""
    a, b, c = model(), model(), model()
    oa = offload(a.parameters(), lr=1e-2)
    train(a, oa, 2, seed=1)
    old = oa.state_dict()
    for g in old["param_groups"]:
        for k in ("fused", "foreach", "capturable", "differentiable", "decoupled_weight_decay"):
            del g[k]
    b.load_state_dict(a.state_dict())
    ob = offload(b.parameters(), lr=1.0)
    ob.load_state_dict(old)
    assert ob.param_groups[0]["lr"] == 1e-2 and ob.param_groups[0]["fused"] is True
    train(a, oa, 2, seed=2)
    train(b, ob, 2, seed=2)
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    tc = torch.optim.AdamW(c.parameters(), lr=1e-2)
    train(c, tc, 1, seed=3)
    sd = tc.state_dict()
    sd["param_groups"][0]["capturable"] = True  # as on a GPU (capturable has no CPU kernel)
    oc = offload(model().parameters())
    oc.load_state_dict(sd)
    assert oc.param_groups[0]["capturable"] is False and oc.param_groups[0]["fused"] is True
