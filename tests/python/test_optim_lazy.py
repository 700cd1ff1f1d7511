"""OffloadAdamW's lazy state (Note [lazy state] in spillover/optim/store.py): a frozen parameter,
or one that never receives a gradient, holds no state (no pool or swap bytes, no state_dict entry);
a parameter whose first gradient comes later gets its state then and matches torch's AdamW. And
torch.amp.GradScaler (Note [GradScaler]): an inf/NaN step leaves parameters and state unchanged
(and creates none), normal scaled steps equal torch's AdamW under the same scaler; with two gloo
ranks, sharded, ShardedGradScaler skips on every rank together.

Run as a script, this file is one rank of the two-rank test (torchrun's environment)."""

from __future__ import annotations

import gc
import os
import sys

import pytest
import torch
from _ranks import run_ranks
from dist_optim_worker import make_model

import spillover
from spillover import _native

POOL = 80 << 20  # this file's own pool (pools are shared per capacity)
FMA = _native.AdamState.fma_available()
TIERS = ["host", "nvme"]
F = torch.nn.functional
SCALE = 2.0**10
STEPS = 6


def offload(params, **kw):
    kw.setdefault("host_pool_bytes", POOL)
    return spillover.OffloadAdamW(params, **kw)


class Late(torch.nn.Module):
    """make_model() plus `extra` (parameter 0: a module's own parameters come first), an output
    bias used only from step `start` on: no gradient before."""

    def __init__(self, start: int = 1):
        super().__init__()
        self.body = make_model()
        self.extra = torch.nn.Parameter(torch.full((5,), 0.1))
        self.start = start
        self.step = 0

    def forward(self, x):
        y = self.body(x)
        return y + self.extra if self.step >= self.start else y


def late_frozen(start: int) -> Late:
    """Late with its first layer frozen: state for parameters 3, 4, then 0 (`extra`)."""
    m = Late(start)
    m.body[0].requires_grad_(False)
    return m


def data(steps, seed=0, batch=16):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        out.append((torch.randn(batch, 33, generator=g), torch.randn(batch, 5, generator=g)))
    return out


def train(model, opt, steps=STEPS, seed=0, scaler=None, inf_at=(), first=0, clip=None):
    """Steps `first`, ..., `first + steps - 1`; with `scaler`, the standard AMP pattern, and
    at the steps in `inf_at` an inf in the first gradient there is (after backward, as an
    overflow would leave it). `clip`: ``scaler.unscale_`` before the step, and at odd steps
    clip the gradients' norm to `clip`."""
    for i, (x, y) in enumerate(data(steps, seed), start=first):
        if isinstance(model, Late):
            model.step = i
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        if scaler is None:
            loss.backward()
            opt.step()
            continue
        scaler.scale(loss).backward()
        if i in inf_at:
            g = next(p.grad for p in model.parameters() if p.grad is not None)
            g.view(-1)[0] = float("inf")
        if clip is not None:
            scaler.unscale_(opt)
            if i % 2:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()


def assert_params(a, b, exact=FMA):
    for i, (x, y) in enumerate(zip(a.parameters(), b.parameters())):
        if exact:
            assert torch.equal(x, y), f"param {i}: max |d| = {(x - y).abs().max()}"
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"param {i}")


def assert_state(ours, ref, exact=FMA):
    """`ours` (OffloadAdamW.state_dict()) holds state for exactly the parameters `ref` (torch's
    AdamW state_dict) does, with the same steps and moments."""
    sd, rsd = ours["state"], ref["state"]
    assert sorted(sd) == sorted(rsd)
    for i, r in rsd.items():
        assert float(sd[i]["step"]) == float(r["step"]), i
        for name in ("exp_avg", "exp_avg_sq"):
            if exact:
                assert torch.equal(sd[i][name], r[name]), (i, name)
            else:
                torch.testing.assert_close(sd[i][name], r[name], rtol=1e-5, atol=1e-6)


def half_frozen():
    model = make_model()
    model[0].requires_grad_(False)
    return model


def n_params(opt):
    return sum(len(g["params"]) for g in opt.param_groups)


def held(opt):
    """Bytes the optimizer's tier holds now: pool bytes (host), swap bytes (NVMe)."""
    gc.collect()
    if opt._swap is not None:
        return opt._swap.stats()["swap_in_use"]
    return opt._pool.stats()["in_use"]


@pytest.mark.parametrize("tier", TIERS)
def test_half_frozen_model_has_state_for_the_trainable_half_only(tier, tmp_path):
    """Frozen parameters given to the optimizer cost nothing: the state (state_dict, state
    bytes, pool or swap bytes in use) is that of an optimizer given only the trainable half,
    none exists before the first step, and the training equals torch's AdamW."""
    kw = dict(tier=tier, nvme_path=str(tmp_path), chunk_bytes=8192)
    model, ref, alone = half_frozen(), half_frozen(), half_frozen()
    frozen = [p.detach().clone() for p in model[0].parameters()]
    opt = offload(model.parameters(), **kw)
    before = held(opt)
    assert opt.stats()["state_bytes"] == 0 and opt.stats()["steps"] == 0
    assert opt.state_dict()["state"] == {} and not any(map(opt.has_state, range(n_params(opt))))
    ropt = torch.optim.AdamW(ref.parameters(), fused=True)
    train(model, opt)
    train(ref, ropt)
    ours = held(opt) - before
    assert_params(model, ref)
    assert all(torch.equal(a, b) for a, b in zip(model[0].parameters(), frozen))
    assert_state(opt.state_dict(), ropt.state_dict())
    assert sorted(opt.state_dict()["state"]) == [2, 3]  # model[2]'s weight and bias
    # An optimizer given just the trainable half holds the same bytes.
    aopt = offload(alone[2].parameters(), **kw)
    a0 = held(aopt)
    train(alone, aopt)
    assert held(aopt) - a0 == ours
    assert aopt.stats()["state_bytes"] == opt.stats()["state_bytes"] > 0
    assert ours >= opt.stats()["state_bytes"]  # blocks or slots, rounded up
    # ... and less than one given the whole model trained.
    full = make_model()
    fopt = offload(full.parameters(), **kw)
    train(full, fopt, steps=1)
    assert fopt.stats()["state_bytes"] > 2 * opt.stats()["state_bytes"]


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_first_gradient_at_step_two_gets_state_then(tier, staged, tmp_path):
    """A parameter without a gradient at step 1 has no state after it; at step 2 it gets state
    (a second state space, hooks included on the staged path) and the run equals torch's."""
    ours, ref = Late(start=1), Late(start=1)
    opt = offload(ours.parameters(), lr=1e-2, tier=tier, nvme_path=str(tmp_path),
                  chunk_bytes=4096, _force_staging=staged)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    train(ours, opt, steps=1)
    train(ref, ropt, steps=1)
    assert sorted(opt.state_dict()["state"]) == [1, 2, 3, 4]
    one = opt.stats()["state_bytes"]
    assert len(opt._spaces) == 1
    train(ours, opt, steps=STEPS - 1, seed=1, first=1)
    train(ref, ropt, steps=STEPS - 1, seed=1, first=1)
    assert len(opt._spaces) == 2 and opt.stats()["state_bytes"] > one
    assert_params(ours, ref)
    assert_state(opt.state_dict(), ropt.state_dict())
    assert float(opt.state_dict()["state"][0]["step"]) == STEPS - 1
    assert opt.stats()["steps"] == STEPS


@pytest.mark.parametrize("save_tier,load_tier", [("host", "nvme"), ("nvme", "host")])
def test_lazy_checkpoints_round_trip_across_tiers(save_tier, load_tier, tmp_path):
    """A checkpoint holds state only for the parameters that had it; loaded into a fresh
    optimizer on the other tier it recreates exactly that state, and loaded into one that has
    state for more parameters it drops the rest (their bytes too). Both continue like the
    original."""
    a = late_frozen(start=3)
    oa = offload(a.parameters(), tier=save_tier, nvme_path=str(tmp_path), chunk_bytes=4096)
    train(a, oa, steps=2)  # `extra` has no gradient yet
    sd = oa.state_dict()
    assert sorted(sd["state"]) == [3, 4]
    b = late_frozen(start=3)
    b.load_state_dict(a.state_dict())
    ob = offload(b.parameters(), tier=load_tier, nvme_path=str(tmp_path), chunk_bytes=2048)
    ob.load_state_dict(sd)
    assert sorted(ob.state_dict()["state"]) == [3, 4]
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(v, ob.state_dict()["state"][i][k]), (i, k)
    c = late_frozen(start=3)
    c.load_state_dict(a.state_dict())
    oc = offload(c.parameters(), tier=load_tier, nvme_path=str(tmp_path), chunk_bytes=2048)
    c.step = 5
    F.mse_loss(c(torch.randn(4, 33)), torch.randn(4, 5)).backward()
    oc.step()  # every trainable parameter of c now has state ...
    more = oc.stats()["state_bytes"]
    with torch.no_grad():  # (undo that step's update, so c equals a again)
        for p, q in zip(c.parameters(), a.parameters()):
            p.copy_(q)
    oc.load_state_dict(sd)  # ... and after loading only the checkpoint's do
    assert sorted(oc.state_dict()["state"]) == [3, 4]
    assert 0 < oc.stats()["state_bytes"] < more
    for m, o in ((a, oa), (b, ob), (c, oc)):
        for i, (x, y) in enumerate(data(4, seed=5)):
            m.step = 2 + i  # `extra` gets its first gradient at the second of these
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    assert_params(a, b, exact=True)
    assert_params(a, c, exact=True)
    assert sorted(oa.state_dict()["state"]) == [0, 3, 4]


@pytest.mark.parametrize("tier", TIERS)
def test_grad_scaler_inf_step_leaves_params_and_state_unchanged(tier, tmp_path):
    """An inf in a gradient: GradScaler skips the step (and halves its scale); parameters,
    state and step counts are unchanged. On the very first step no state is created."""
    model = half_frozen()
    opt = offload(model.parameters(), lr=1e-2, tier=tier, nvme_path=str(tmp_path),
                  chunk_bytes=4096)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
    before = held(opt)
    train(model, opt, steps=1, scaler=scaler, inf_at=(0,))
    assert scaler.get_scale() == SCALE / 2
    assert opt.state_dict()["state"] == {} and not any(map(opt.has_state, range(n_params(opt))))
    assert opt.stats()["state_bytes"] == 0 and held(opt) == before
    train(model, opt, steps=3, seed=1, scaler=scaler)
    params = [p.detach().clone() for p in model.parameters()]
    sd = opt.state_dict()
    assert sorted(sd["state"]) == [2, 3] and float(sd["state"][2]["step"]) == 3
    stats = opt.stats()
    train(model, opt, steps=1, seed=2, scaler=scaler, inf_at=(0,))
    assert scaler.get_scale() == SCALE / 4
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), params))
    after = opt.state_dict()
    for i, st in sd["state"].items():
        for k, v in st.items():
            assert torch.equal(after["state"][i][k], v), (i, k)
    assert opt.stats()["steps"] == stats["steps"] == 3


@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_grad_scaler_steps_match_torch(tier, staged, tmp_path):
    """The standard pattern (scale, backward, scaler.step, update) with a growing scale and
    inf steps in between equals torch's fused AdamW under its own, identical GradScaler
    (bitwise where the kernel uses FMA) — including a parameter whose first gradient comes
    after a skipped step."""
    ours, ref = Late(start=3), Late(start=3)
    opt = offload(ours.parameters(), lr=1e-2, tier=tier, nvme_path=str(tmp_path),
                  chunk_bytes=4096, _force_staging=staged)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    scalers = [torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2) for _ in "ab"]
    inf_at = (2, 3, 6)
    train(ours, opt, steps=10, scaler=scalers[0], inf_at=inf_at)
    train(ref, ropt, steps=10, scaler=scalers[1], inf_at=inf_at)
    assert scalers[0].get_scale() == scalers[1].get_scale()
    assert_params(ours, ref)
    assert_state(opt.state_dict(), ropt.state_dict())
    assert float(opt.state_dict()["state"][0]["step"]) == 5  # 3..9 without 3 and 6
    # torch's default (for-loop) AdamW also lets GradScaler unscale first, as we do.
    loop = Late(start=3)
    lopt = torch.optim.AdamW(loop.parameters(), lr=1e-2, foreach=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=2)
    train(loop, lopt, steps=10, scaler=scaler, inf_at=inf_at)
    assert_params(ours, loop, exact=False)


@pytest.mark.parametrize("staged", [False, True], ids=["in-place", "staged"])
def test_grad_scaler_unscale_before_step_matches_torch(staged):
    """``scaler.unscale_(opt)`` before ``scaler.step(opt)`` (to clip, here at every other
    step): the unscaled gradients are used, though unscaling does not move their version
    counters (the staged copies are taken again: Note [GradScaler])."""
    ours, ref = Late(start=1), Late(start=1)
    opt = offload(ours.parameters(), lr=1e-2, _force_staging=staged)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for m, o in ((ours, opt), (ref, ropt)):
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE)
        train(m, o, steps=STEPS, scaler=scaler, inf_at=(2,), clip=0.05)
    assert_params(ours, ref)
    assert_state(opt.state_dict(), ropt.state_dict())


# ---- two gloo ranks ----

DIST_STEPS, DIST_INF = 6, 3  # rank 0 alone sees an inf at step DIST_INF


def _dist_reference():
    """One process, unsharded: the mean of the two ranks' unscaled half-batch gradients, the
    inf step skipped — what the two ranks must compute."""
    model = late_frozen(start=2)
    opt = offload(model.parameters(), lr=1e-2, chunk_bytes=4096)
    for i, (x, y) in enumerate(data(DIST_STEPS, batch=8)):
        model.step = i
        if i == DIST_INF:
            continue
        scale = SCALE if i < DIST_INF else SCALE / 2
        halves = []
        for r in range(2):
            model.zero_grad()
            (F.mse_loss(model(x[r * 4 : (r + 1) * 4]), y[r * 4 : (r + 1) * 4]) * scale).backward()
            halves.append([None if p.grad is None else p.grad * (1 / scale) for p in
                           model.parameters()])
        for p, g0, g1 in zip(model.parameters(), *halves):
            p.grad = None if g0 is None else (g0 + g1) * 0.5
        opt.step()
    return model, opt


def test_two_ranks_lazy_sharded_state_and_sharded_grad_scaler(tmp_path):
    """2 CPU ranks (gloo), state sharded: frozen parameters get no state, `extra` joins at its
    first gradient, and an inf on rank 0 alone makes both ranks skip (ShardedGradScaler);
    parameters and the gathered state equal one process bit for bit."""
    run_ranks(__file__, [str(tmp_path)], timeout=180)
    r0, r1 = (torch.load(tmp_path / f"lazy-rank{r}.pt") for r in range(2))
    ref, ropt = _dist_reference()
    rsd = ropt.state_dict()
    assert sorted(rsd["state"]) == [0, 3, 4]
    for a, b, c in zip(r0["params"], r1["params"], ref.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c.detach()), (a - c).abs().max()
    for r in (r0, r1):
        assert r["scale"] == SCALE / 2
        assert r["spaces"] == 2 and r["state_after_1"] == [3, 4]
        assert sorted(r["state_dict"]["state"]) == [0, 3, 4]
        for i, st in rsd["state"].items():
            for k, v in st.items():
                assert torch.equal(r["state_dict"]["state"][i][k], v), (i, k)


def _rank_main(out_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        model = late_frozen(start=2)
        opt = offload(model.parameters(), lr=1e-2, chunk_bytes=4096)
        assert opt._world == 2, "expected the optimizer to shard"
        scaler = ShardedGradScaler("cpu", init_scale=SCALE)
        after_1 = None
        for i, (x, y) in enumerate(data(DIST_STEPS, batch=8)):
            model.step = i
            opt.zero_grad()
            loss = F.mse_loss(model(x[rank * 4 : (rank + 1) * 4]), y[rank * 4 : (rank + 1) * 4])
            scaler.scale(loss).backward()
            if i == DIST_INF and rank == 0:
                model.body[2].weight.grad.view(-1)[0] = float("inf")
            scaler.step(opt)
            scaler.update()
            if i == 0:
                after_1 = sorted(opt.state_dict()["state"])
        out = {
            "params": [p.detach().clone() for p in model.parameters()],
            "state_dict": opt.state_dict(),
            "state_after_1": after_1,
            "spaces": len(opt._spaces),
            "scale": scaler.get_scale(),
        }
        torch.save(out, os.path.join(out_dir, f"lazy-rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
