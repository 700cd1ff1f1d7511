"""OffloadAdamW(update_in_backward=True) (Note [update in backward] in spillover/optim/inbwd.py),
run on CPU tensors with ``_force_staging=True`` (the GPU path's staging buffers, hooks and copies,
synchronous): each bucket's CPU update runs on a worker thread during backward, as soon as its
gradients are staged; results equal torch's fused AdamW (bitwise where the CPU has FMA); the
updates start before backward returns; a gradient changed after backward, or a second backward,
undoes them exactly; every refusal says what to use instead. Clipping, GradScaler and accumulation
parity: test_optim_inbwd_clip.py."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from dist_optim_worker import make_model
from test_optim_staged import assert_params, data

import spillover
from spillover import _native
from spillover import optim as so

POOL = 72 << 20  # this file's own pool (pools are shared per capacity)
WAIT = 30.0  # seconds the overlap test's hook waits for the worker
FMA = _native.AdamState.fma_available()
F = torch.nn.functional


def offload(params, **kw):
    kw.setdefault("host_pool_bytes", POOL)
    kw.setdefault("_force_staging", True)
    kw.setdefault("update_in_backward", True)
    return spillover.OffloadAdamW(params, **kw)


def groups_of(model):
    return [
        {"params": list(model[0].parameters()), "lr": 1e-2, "betas": (0.8, 0.99)},
        {"params": list(model[2].parameters()), "lr": 3e-2, "weight_decay": 0.1},
    ]


def one_step(model, opt, s):
    x, y = data(s)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def mid_step():
    """A model and its optimizer after one step (made at step(): Note [lazy state]) and the
    next backward, whose updates ran during it; step() not called yet. (model, opt, x, y)."""
    model = make_model()
    opt = offload(model.parameters(), lr=1e-2)
    one_step(model, opt, 0)
    x, y = data(1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    return model, opt, x, y


@pytest.mark.parametrize("bucket", [so.layout._BUCKET_ELEMS, 1, 200], ids=["one", "each", "some"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_matches_torch_fused_with_scheduler(monkeypatch, bucket, tier):
    """Several steps with a StepLR stepping after each step, parameters in one bucket, one
    bucket each, or buckets that split parameters (_UNIT_MAX small): equal to torch's fused
    AdamW; after the first step (made at step(): Note [lazy state]) the buckets are updated
    during backward, the last layer's first."""
    monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", bucket)
    if bucket == 200:
        monkeypatch.setattr(so.layout, "_UNIT_MAX", 160)
    ours, ref = make_model(), make_model()
    opt = offload(groups_of(ours), tier=tier, chunk_bytes=16384)
    ropt = torch.optim.AdamW(groups_of(ref), fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=2, gamma=0.5)
    for s in range(6):
        for model, o, sc in ((ours, opt, sched), (ref, ropt, rsched)):
            one_step(model, o, s)
            sc.step()
        space = opt._spaces[0]
        if s == 0:
            assert space.inbwd_log == []  # the first step makes the state, at step()
        else:
            done = [b for b, _, _ in space.inbwd_log]
            assert sorted(done) == list(range(len(space.buckets))), done
            if bucket == 1:  # the last layer's (members 2, 3) come first
                assert set(space.bucket_members[done[0]]) <= {2, 3}, done
                assert set(space.bucket_members[done[1]]) <= {2, 3}, done
        assert_params(ours, ref)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**3)
    assert opt.stats()["steps"] == 6
    sd = opt.state_dict()["state"]
    for i, r in enumerate(ropt.state.values()):
        assert float(sd[i]["step"]) == float(r["step"]) == 6
        if FMA:
            assert torch.equal(sd[i]["exp_avg_sq"], r["exp_avg_sq"]), i


def test_updates_start_before_backward_returns(monkeypatch):
    """A hook on the first layer's weight (its gradient comes last in backward) waits for the
    worker to finish the last layer's bucket: it can only be set if that update runs during
    backward. Deterministic: with updates only at step() the wait times out and the test
    fails."""
    monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 1)  # one bucket per parameter
    model, ref = make_model(), make_model()
    opt = offload(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    last_done = threading.Event()
    original = so.staged.StagedSpace._update_bucket
    last_param = model[2].weight

    def spy(self, b, *args):
        original(self, b, *args)
        if any(self.params[k] is last_param for k in self.bucket_members[b]):
            last_done.set()

    monkeypatch.setattr(so.staged.StagedSpace, "_update_bucket", spy)
    seen, wait = [], [0.0]
    model[0].weight.register_post_accumulate_grad_hook(
        lambda _p: seen.append(last_done.wait(timeout=wait[0]))
    )
    for s in range(4):
        wait[0] = WAIT if s else 0.0  # the first step makes the state at step(): no wait
        last_done.clear()
        seen.clear()
        x, y = data(s)
        for m, o in ((model, opt), (ref, ropt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
        if s:  # the first step makes the state at step()
            assert seen == [True], "the last layer was not updated during backward"
            space = opt._spaces[0]
            starts = {b: t for b, t, _ in space.inbwd_log}
            assert len(starts) == len(space.buckets)
        assert_params(model, ref)


def test_gradient_changed_after_backward_is_redone():
    """A gradient changed between backward and step() (a .data write, which does not move the
    version counter): the bucket updated with the old gradient is undone and redone at step()
    (Note [speculative update] in optim/inbwd.py); equal to torch with the same write."""
    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for s in range(3):
        x, y = data(s)
        for m, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            m[2].weight.grad.data.mul_(2)
            o.step()
        assert_params(ours, ref)
    st = opt.stats()
    assert st["steps"] == 3 and st["steps_redone"] == 2 and st["inbwd_buckets_redone"] >= 2


@pytest.mark.parametrize("slow", [False, True], ids=["worker", "slow-worker"])
def test_second_backward_undoes_from_the_hook(monkeypatch, slow):
    """A second backward without step() undoes, from its hook, the updates the first one made
    (after waiting for the worker: with a slow worker too, 0.3 s a bucket); the forward in
    between saw the parameters as they were (they are written only at step()), so the result
    equals torch's AdamW on the accumulated gradients."""
    if slow:
        update = so.staged.StagedSpace._update_bucket
        monkeypatch.setattr(
            so.staged.StagedSpace,
            "_update_bucket",
            lambda self, *a: (time.sleep(0.3), update(self, *a)),
        )
    model, opt, x, y = mid_step()
    ref = make_model()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    one_step(ref, ropt, 0)
    ropt.zero_grad()
    F.mse_loss(ref(x), y).backward()
    (space,) = opt._spaces
    # backward does not wait for the worker (Note [update in backward]): with a slow worker
    # its updates are still running here, and the second backward's hooks wait for them
    assert space.futures and (not slow or not all(f.done() for f in space.futures))
    for m in (model, ref):
        F.mse_loss(m(x), y).backward()
    assert opt.stats()["inbwd_buckets_undone"] == len(space.buckets)
    opt.step()
    ropt.step()
    assert_params(model, ref)


def test_dtensors_are_refused():
    from torch.distributed.tensor import DTensor

    class FakeDTensor(torch.nn.Parameter):  # only to_local() is looked at
        def to_local(self):
            return self.data

    assert not isinstance(FakeDTensor(torch.zeros(3)), DTensor)
    with pytest.raises(ValueError, match="DTensor.*default mode"):
        offload([FakeDTensor(torch.zeros(3))])


def test_sharded_is_refused(monkeypatch):
    """The sharding check, without starting ranks: a world of 2 as _setup_distributed sets."""

    def two_ranks(self, shard, pg):
        self._pg, self._world, self._rank = pg, 2, 0

    monkeypatch.setattr(spillover.OffloadAdamW, "_setup_distributed", two_ranks)
    with pytest.raises(ValueError, match="shard=False"):
        offload(make_model().parameters())


@pytest.mark.parametrize("shared", [False, True], ids=["own-bucket", "shared-bucket"])
def test_grads_set_by_hand_and_unused_parameters_update_at_step(monkeypatch, shared):
    """A gradient no hook staged (set by hand on a parameter without requires_grad) is updated
    at step(), the others during backward; in its own bucket, or (shared) in a bucket whose
    other units were updated during backward; still equal to torch."""
    if shared:  # units of 160, buckets of >= 200 elements: the bias shares a bucket
        monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 200)
        monkeypatch.setattr(so.layout, "_UNIT_MAX", 160)
    else:
        monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 1)
    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for m in (ours, ref):
        m[0].bias.requires_grad_(False)  # no hook fires for it: its gradient is set by hand
    for s in range(3):
        x, y = data(s)
        for m, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            m[0].bias.grad = torch.full_like(m[0].bias, 0.5 + s)
            o.step()
        assert_params(ours, ref)
    space = opt._spaces[0]
    bias_bucket = space.buckets_of[1][0]
    in_backward = [b for b, _, _ in space.inbwd_log]
    assert space.order[-1] == bias_bucket  # its update was at step()
    assert (bias_bucket in in_backward) == shared  # shared: the others' units were done before


def test_state_dict_between_backward_and_step_is_refused():
    model, opt, x, y = mid_step()
    with pytest.raises(RuntimeError, match="call step\\(\\) first"):
        opt.state_dict()
    opt.step()
    sd = opt.state_dict()
    assert all(float(st["step"]) == 2 for st in sd["state"].values())
    # load_state_dict waits for the worker and discards a round in progress.
    F.mse_loss(model(x), y).backward()
    opt.load_state_dict(sd)
    opt.zero_grad()
    one_step(model, opt, 2)
    assert all(float(st["step"]) == 3 for st in opt.state_dict()["state"].values())


def test_worker_exception_surfaces_at_step(monkeypatch):
    model = make_model()
    opt = offload(model.parameters(), lr=1e-2)
    one_step(model, opt, 0)

    def boom(self, *args):
        raise OSError("injected")

    monkeypatch.setattr(so.staged.StagedSpace, "_update_bucket", boom)
    x, y = data(1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    with pytest.raises(OSError, match="injected"):
        opt.step()


def test_default_mode_has_no_worker():
    model = make_model()
    opt = spillover.OffloadAdamW(model.parameters(), host_pool_bytes=POOL, _force_staging=True)
    for s in range(2):
        one_step(model, opt, s)
    assert opt._worker is None and opt._spaces[0].inbwd_log == []


def test_backward_returns_before_the_last_updates_and_step_waits_for_them(monkeypatch):
    """Note [update in backward]: backward no longer waits for the worker; the updates of the
    buckets that complete last overlap what follows backward, and step() waits for them. The
    result is torch's fused AdamW's all the same."""
    from spillover.optim import inbwd

    real = inbwd.InBackward._update_bucket
    slow = threading.Event()

    def slow_update(self, b, rows, waits, hyper):
        slow.wait(0.5)  # the worker is behind: backward must not wait for it
        return real(self, b, rows, waits, hyper)

    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    for s in range(3):
        if s == 2:
            monkeypatch.setattr(inbwd.InBackward, "_update_bucket", slow_update)
        x, y = data(s)
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            t0 = time.perf_counter()
            F.mse_loss(model(x), y).backward()
            backward_s = time.perf_counter() - t0
            o.step()
            if s == 2 and o is opt:
                assert backward_s < 0.4, backward_s  # it did not wait for the 0.5 s updates
                assert opt.stats()["steps_in_backward"] >= 1
    assert_params(ours, ref, exact=FMA)
