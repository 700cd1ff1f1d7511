"""OffloadAdamW's staged-gradient path (Note [staged gradients] in spillover/optim/staged.py),
run on CPU tensors with ``_force_staging=True`` (the GPU path's staging buffers, hooks and copies,
synchronous): a gradient changed without moving its version counter — a write through
``p.grad.data``, an in-place c10d all-reduce on two gloo ranks — is copied again (the
fingerprint), never used stale; gradient accumulation copies each gradient once per step;
buckets are stepped in the order their gradients arrived. Every result equals torch's fused
AdamW (bitwise where the CPU has FMA, as in test_optim.py).

Run as a script, this file is one rank of the two-rank test (torchrun's environment)."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from _ranks import run_ranks
from dist_optim_worker import make_model

import spillover
from spillover import _native
from spillover import optim as so
from spillover.optim import fingerprint as fp

POOL = 72 << 20  # this file's own pool (pools are shared per capacity)
FMA = _native.AdamState.fma_available()
F = torch.nn.functional


def offload(params, **kw):
    kw.setdefault("host_pool_bytes", POOL)
    kw.setdefault("_force_staging", True)
    kw.setdefault("_hook_copies", True)  # this file tests the hooks' copies (not the default)
    return spillover.OffloadAdamW(params, **kw)


def assert_params(a, b, exact=FMA):
    for i, (x, y) in enumerate(zip(a.parameters(), b.parameters())):
        if exact:
            assert torch.equal(x, y), f"param {i}: max |d| = {(x - y).abs().max()}"
        else:
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6, msg=f"param {i}")


def data(step, n=16, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(n, 33, generator=g), torch.randn(n, 5, generator=g)


# ---- the fingerprint ----


def _reference_fingerprint(t: torch.Tensor) -> tuple:
    """The same function in Python integers, modulo 2**64 (no wrapping arithmetic at all)."""
    b = t.detach().reshape(-1).contiguous().view(torch.int8).numpy().astype(np.int64)
    a_w, r_w = fp._fp_weights(torch.device("cpu"))
    a = a_w.numpy().astype(np.int64)
    r = r_w.numpy().view(np.uint64)
    out = [0] * fp._FP_LANES
    for c, lo in enumerate(range(0, len(b), fp._FP_CHUNK)):
        chunk = b[lo : lo + fp._FP_CHUNK]
        for ri, ro in enumerate(range(0, len(chunk), fp._FP_ROW)):
            row = chunk[ro : ro + fp._FP_ROW]
            for s in range(fp._FP_LANES):
                p = sum(int(x) * int(w) for x, w in zip(row, a[: len(row), s]))
                out[s] += fp._fp_chunk_multiplier(s, c) * int(r[ri, s]) * p
    return tuple(v % (1 << 64) for v in out)


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 20 rows of 64 bytes and a partial row (padded), and small tails (padded to 17
    rows)."""
    monkeypatch.setattr(fp, "_FP_ROW", 64)
    monkeypatch.setattr(fp, "_FP_CHUNK", 64 * 20 + 40)
    fp._FP_CACHE.clear()
    yield
    fp._FP_CACHE.clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fingerprint_wraps_like_exact_integers(small_chunks, dtype):
    """torch's int64 products and sums wrap modulo 2**64 (checked here against Python's exact
    integers), over several chunks, whole and partial rows and chunks under 17 rows (both
    zero-padded), so the function is defined on every device."""
    for n in (3001, 301, 7):  # several chunks; one chunk under 16 rows; a partial row only
        t = (torch.randn(n) * 1e30).to(dtype)  # large words: products overflow int64
        t[::7] = float("-inf")
        assert fp._fingerprint(t) == _reference_fingerprint(t), n


def test_fingerprint_costs_a_fixed_number_of_ops_per_chunk():
    """Note [gradient fingerprint]: the ops per chunk, whatever its size, counted by torch's
    dispatcher (the benchmark's ops per bucket use this count)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.__name__.startswith(("view", "_unsafe_view", "slice", "detach")):
                Count.n += 1
            return func(*args, **(kwargs or {}))

    for nbytes in (fp._FP_CHUNK, fp._FP_CHUNK - 100):
        b = torch.randint(-128, 127, (nbytes,), dtype=torch.int8)
        fp._fp_chunk(b)  # the weights made first
        Count.n = 0
        with Count():
            fp._fp_chunk(b)
        assert 0 < Count.n <= fp.FP_OPS_PER_CHUNK, Count.n


def test_fingerprint_sees_small_and_structured_changes(small_chunks):
    g = torch.randn(4099)
    base = fp._fingerprint(g)
    changed = [
        g.neg(),  # every sign bit
        g.roll(1),  # a permutation
        torch.cat([g[2048:], g[:2048]]),  # two halves swapped
        g * 2,  # every exponent
        torch.zeros_like(g),
    ]
    one = g.clone()
    one.view(torch.int32)[17] ^= 1  # one bit
    changed.append(one)
    for ratio in (1, 3, 5):  # the same byte of two chunks, changed by -ratio and +1
        pair = g.clone()
        pair.view(torch.int8)[5] -= ratio
        pair.view(torch.int8)[fp._FP_CHUNK + 5] += 1
        changed.append(pair)
    swap = torch.tensor([1.0, -1.0, -1.0, 1.0])
    assert fp._fingerprint(swap) != fp._fingerprint(swap.neg())
    for c in changed:
        assert fp._fingerprint(c) != base
    assert fp._fingerprint(g.clone()) == base


def test_staged_fingerprint_is_of_the_staged_bytes(monkeypatch):
    """The hook copies through snapshots of one fingerprint chunk each: with chunks and units
    that straddle each other, the staged copy holds the gradient and its fingerprint equals the
    gradient's own; the result still equals torch's."""
    monkeypatch.setattr(fp, "_FP_ROW", 8)
    monkeypatch.setattr(fp, "_FP_CHUNK", 200)  # chunks of 50 fp32 elements (25 rows)
    monkeypatch.setattr(so.layout, "_UNIT_MAX", 80)  # units of 80 elements
    fp._FP_CACHE.clear()
    try:
        ours, ref = make_model(), make_model()
        opt = offload(ours.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for s in range(3):
            x, y = data(s)
            for model, o in ((ours, opt), (ref, ropt)):
                o.zero_grad()
                F.mse_loss(model(x), y).backward()
            if s:  # the space exists from the first step on: the hooks have staged
                space = opt._spaces[0]
                for k, p in enumerate(ours.parameters()):
                    lo, hi = space.fp_rows[k]
                    assert fp._fp_combine(space.fp_host[lo:hi].numpy()) == fp._fingerprint(p.grad)
                    staged = torch.cat([space.grad_view[ui] for ui in space.units_of[k]])
                    assert torch.equal(staged, p.grad.reshape(-1))
                assert len(space.units) > 20
            if s == 2:
                for model in (ours, ref):
                    model[2].weight.grad.data[0, :3] = 1.0
            opt.step()
            ropt.step()
        assert_params(ours, ref)
        assert opt.stats()["grad_stale_copies"] > 0
    finally:
        fp._FP_CACHE.clear()


# ---- never stale ----


def _train_with_edit(model, opt, edit, steps=6, zero_to_none=True):
    for s in range(steps):
        x, y = data(s)
        opt.zero_grad(set_to_none=zero_to_none)
        F.mse_loss(model(x), y).backward()
        edit(model, s)
        opt.step()


@pytest.mark.parametrize("zero_to_none", [True, False], ids=["none", "zeroed"])
def test_writes_through_data_are_not_missed(zero_to_none):
    """A write through ``p.grad.data`` does not move the version counter; the staged copy is
    found stale by the fingerprint and copied again."""

    def edit(model, s):
        for i, p in enumerate(model.parameters()):
            if (i + s) % 2 == 0:
                p.grad.data.mul_(0.25)
            if i == 1 and s % 3 == 0:
                p.grad.data.copy_(torch.full_like(p.grad, 0.5))

    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train_with_edit(ours, opt, edit, zero_to_none=zero_to_none)
    _train_with_edit(ref, ropt, edit, zero_to_none=zero_to_none)
    assert_params(ours, ref)
    st = opt.stats()
    assert st["grad_stale_copies"] > 0  # the fingerprint, not the version, caught them


def test_unchanged_staged_gradients_are_reused():
    """No edit: every gradient is copied once, by its hook, and reused at step()."""
    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train_with_edit(ours, opt, lambda m, s: None)
    _train_with_edit(ref, ropt, lambda m, s: None)
    assert_params(ours, ref)
    st = opt.stats()
    n_units = len(opt.state_units())
    assert st["grad_copies"] == 6 * n_units and st["grad_stale_copies"] == 0
    nbytes = sum(p.numel() * 4 for p in ours.parameters())
    assert st["grad_bytes_copied"] == 6 * nbytes


# ---- gradient accumulation ----


def _train_accumulating(model, opt, micro, on_step=None):
    for s, n in enumerate(micro):
        opt.zero_grad()
        for m in range(n):
            x, y = data(s * 10 + m, n=8)
            (F.mse_loss(model(x), y) / n).backward()
        opt.step()
        if on_step is not None:
            on_step(s)


def test_accumulation_copies_once_per_step():
    """4 micro-batches per step. Step 1 makes the state (Note [lazy state]) and copies every
    gradient at step(); step 2's hooks copy at every backward, not knowing yet how many come;
    from then on each gradient is copied once per step, by the last micro-batch's hook. The
    result equals torch's fused AdamW."""
    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    copies = []
    _train_accumulating(ours, opt, [4] * 5, lambda s: copies.append(opt.stats()["grad_copies"]))
    _train_accumulating(ref, ropt, [4] * 5)
    assert_params(ours, ref)
    n_units = len(opt.state_units())
    per_step = np.diff([0] + copies).tolist()
    assert per_step == [n_units, 4 * n_units] + [n_units] * 3, per_step
    assert opt.stats()["grad_stale_copies"] == 0


def test_accumulation_count_changing_stays_correct():
    """Steps with fewer or more micro-batches than the last one: the guess only decides when
    to copy; a copy staged too early is seen to be stale (its version moved) and copied again,
    one never staged is copied at step()."""
    micro = [4, 4, 2, 5, 5, 1, 3]
    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    _train_accumulating(ours, opt, micro)
    _train_accumulating(ref, ropt, micro)
    assert_params(ours, ref)


# ---- buckets in arrival order ----


class Arrivals:
    """Records the order of the post-accumulate-grad hooks (registered after the optimizer's,
    so each fires right after the optimizer's hook of the same parameter)."""

    def __init__(self, params):
        self.order = []
        for i, p in enumerate(params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.order.append(i))


@pytest.mark.parametrize("reverse", [False, True], ids=["params", "reversed"])
def test_buckets_step_in_arrival_order(monkeypatch, reverse):
    """One bucket per parameter: from the second step on (the first makes the state and copies
    at step(), in parameter order), each step processes the buckets in the order backward
    produced their gradients (the last layer's first), whatever the parameters' order in the
    optimizer; equal to torch's fused AdamW either way."""
    monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 1)
    ours, ref = make_model(), make_model()
    params = list(ours.parameters())[::-1] if reverse else list(ours.parameters())
    opt = offload(params, lr=1e-2)
    arrivals = Arrivals(params)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    orders = []
    for s in range(4):
        x, y = data(s)
        opt.zero_grad()
        arrivals.order = []
        F.mse_loss(ours(x), y).backward()
        opt.step()
        # bucket b holds parameter b; the first step makes the state and copies at step()
        assert opt._spaces[0].order == (arrivals.order if s else [0, 1, 2, 3])
        orders.append(list(opt._spaces[0].order))
        ropt.zero_grad()
        F.mse_loss(ref(*data(s)[:1]), data(s)[1]).backward()
        ropt.step()
    assert_params(ours, ref)
    last_layer = {id(p) for p in ours[2].parameters()}
    first_two = {id(params[b]) for b in orders[-1][:2]}
    assert first_two == last_layer  # backward produces the last layer's gradients first


def test_gradients_set_by_hand_step_in_parameter_order(monkeypatch):
    """Gradients assigned without backward (no hook fires): copied at step(), buckets in
    parameter order; equal to torch's fused AdamW."""
    monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 1)
    ours, ref = make_model(), make_model()
    opt = offload(ours.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for a, b in zip(ours.parameters(), ref.parameters()):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        opt.step()
        ropt.step()
        assert opt._spaces[0].order == [0, 1, 2, 3]
    assert_params(ours, ref)


# ---- the copies' stream rule (Note [optimizer copies]) ----


class _RecordingDevice:
    """The CudaDevice calls the optimizer's copies make, in order; copies run at once."""

    def __init__(self):
        self.log = []

    def current_stream(self):
        return "compute"

    def record(self, stream):
        self.log.append(("record", stream))
        return f"event on {stream}"

    def wait(self, stream, ev):
        self.log.append(("wait", stream, ev))

    def copy(self, dst, src, stream):
        self.log.append(("copy", stream))
        dst.copy_(src)

    def record_stream(self, storage, stream):
        self.log.append(("record_stream", storage.data_ptr(), stream))

    def synchronize(self, ev):
        self.log.append(("synchronize", ev))


def test_copies_follow_the_optimizer_stream_rule():
    """Note [optimizer copies], on a device that records activations/link/cuda.py's CudaDevice
    calls: a D2H copy is ordered after the compute stream and passes its source (the user's
    gradient) to record_stream; an H2D copy is ordered after the compute stream, the compute
    stream waits for it, and its source (the optimizer's own buffer) is not recorded."""
    from spillover.activations.link.cuda import CudaDevice
    from spillover.optim.copies import _Copies

    for name in ("current_stream", "record", "wait", "copy", "record_stream", "synchronize"):
        assert callable(getattr(CudaDevice, name)), name  # the fake has CudaDevice's calls
    copies = _Copies(torch.device("cpu"))
    dev = _RecordingDevice()
    copies.dev, copies.d2h, copies.h2d = dev, "d2h", "h2d"
    grad, staged = torch.randn(5), torch.empty(5)
    copies.wait(copies.to_host(staged, grad))
    assert torch.equal(staged, grad)
    assert dev.log == [
        ("record", "compute"),
        ("wait", "d2h", "event on compute"),
        ("copy", "d2h"),
        ("record", "d2h"),
        ("record_stream", grad.untyped_storage().data_ptr(), "d2h"),
        ("synchronize", "event on d2h"),
    ]
    dev.log.clear()
    param = torch.empty(5)
    copies.to_device(param, staged)
    assert torch.equal(param, grad)
    assert dev.log == [
        ("record", "compute"),
        ("wait", "h2d", "event on compute"),
        ("copy", "h2d"),
        ("record", "h2d"),
        ("wait", "compute", "event on h2d"),
    ]


@pytest.mark.parametrize("inbwd", [False, True], ids=["staged", "update_in_backward"])
def test_parameter_writes_are_ordered_before_the_user_reads(monkeypatch, inbwd):
    """Note [parameter writes are ordered]: through a device that logs CudaDevice's calls,
    when backward returns and when step() returns, every copy the optimizer queued into a
    parameter is followed by the compute stream waiting on an event recorded after it, never by
    a host synchronize standing in for it; backward itself writes no parameter; the parameters
    equal the same run without the device. Steps: state made, kept, a write through
    ``p.grad.data`` (redone / copied again), kept again."""
    from _stream_log import StreamLog, unordered_writes

    monkeypatch.setattr(so.layout, "_BUCKET_ELEMS", 1)
    runs = []
    for link in (StreamLog(), None):
        model = make_model()
        opt = offload(model.parameters(), lr=1e-2, update_in_backward=inbwd, _link=link)
        storages = [p.untyped_storage().data_ptr() for p in model.parameters()]
        for step in range(4):
            x, y = data(step)
            before = link.mark() if link else 0
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if step == 2:
                for p in model.parameters():
                    p.grad.data.mul_(0.5)
            if link is None:
                opt.step()
                continue
            backward = link.mark()
            writes = [e for e in link.log[before:backward] if e[0] == "copy" and e[2] in storages]
            assert writes == [], "backward wrote a parameter"
            assert unordered_writes(link.log, storages, backward) == []
            opt.step()
            done = link.mark()
            writes = [e for e in link.log[backward:done] if e[0] == "copy" and e[2] in storages]
            assert len(writes) >= len(storages), writes  # every parameter written this step
            assert unordered_writes(link.log, storages, done) == [], step
        runs.append((model, opt.stats()))
    (logged, st), (plain, _) = runs
    assert st["steps"] == 4
    if inbwd:
        assert st["steps_in_backward"] >= 1 and st["steps_redone"] >= 1, st
    else:
        assert st["grad_stale_copies"] >= 1, st
    assert_params(logged, plain, exact=True)


# ---- on a GPU: the same, through CUDA streams and events ----

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda_only
def test_cuda_fingerprint_equals_cpu():
    """The device computes the same fingerprint as the CPU (int64 wraps alike), across chunks."""
    t = torch.randn(3 * fp._FP_CHUNK // 8 + 7) * 1e30
    assert fp._fingerprint(t.cuda()) == fp._fingerprint(t)
    b = t.to(torch.bfloat16)
    assert fp._fingerprint(b.cuda()) == fp._fingerprint(b)


@pytest.mark.gpu
@cuda_only
def test_cuda_accumulation_and_data_writes():
    """Parameters on the GPU, 4 micro-batches per step, a write through ``p.grad.data`` on some
    steps: equal to torch's fused AdamW on the GPU within its tolerance (its CUDA kernel rounds
    differently from the CPU one); one copy per unit and step once the count is learned, and
    one more for every edited gradient."""
    ours, ref = make_model().cuda(), make_model().cuda()
    opt = offload(ours.parameters(), lr=1e-2, _force_staging=False)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    copies = []
    for s in range(6):
        for model, o in ((ours, opt), (ref, ropt)):
            o.zero_grad()
            for m in range(4):
                x, y = data(s * 10 + m, n=8)
                (F.mse_loss(model(x.cuda()), y.cuda()) / 4).backward()
            if s in (3, 5):
                for p in model.parameters():
                    p.grad.data.mul_(0.5)
            o.step()
        copies.append(opt.stats()["grad_copies"])
    torch.cuda.synchronize()
    for a, b in zip(ours.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    n_units = len(opt.state_units())
    per_step = np.diff([0] + copies).tolist()
    assert per_step[2:] == [n_units, 2 * n_units, n_units, 2 * n_units], per_step
    assert opt.stats()["grad_stale_copies"] == 2 * n_units


# ---- two ranks: an in-place all-reduce between backward and step ----


def test_two_ranks_all_reduce_in_place_gloo(tmp_path):
    """``dist.all_reduce(p.grad)`` (SUM, in place: c10d does not move the version counter)
    between backward and ``step()`` on two gloo ranks, ``shard=False``: the parameters equal
    those of torch's fused AdamW fed the same all-reduced gradients. And next to DDP with
    ``gradient_as_bucket_view=True``, whose all-reduce overwrites the gradients in place after
    the hooks have copied the local ones."""
    run_ranks(__file__, [str(tmp_path)], timeout=60)
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(2))
    for res in (r0, r1, r0["ddp"], r1["ddp"]):
        assert res["equal"], res["max_diff"]
    # The fingerprint caught the all-reduce; next to DDP the gradient tensor seen at step() is
    # not the one the hook copied (nor at its version), so the cheap check caught it.
    assert r0["stats"]["grad_stale_copies"] > 0 and r1["stats"]["grad_stale_copies"] > 0
    for x, y in ((r0, r1), (r0["ddp"], r1["ddp"])):
        for a, b in zip(x["params"], y["params"]):
            assert torch.equal(a, b)  # the ranks agree


def _compare(ours, ref, opt) -> dict:
    diffs = [(a - b).abs().max().item() for a, b in zip(ours.parameters(), ref.parameters())]
    equal = all(
        torch.equal(a, b) if FMA else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(ours.parameters(), ref.parameters())
    )
    return {
        "params": [p.detach().clone() for p in ours.parameters()],
        "equal": equal,
        "max_diff": max(diffs),
        "stats": opt.stats(),
    }


def _rank_main(out_dir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        rank = dist.get_rank()
        ours, ref = make_model(), make_model()
        opt = offload(ours.parameters(), lr=1e-2, shard=False)
        assert opt._world == 1  # shard=False: each rank keeps the full state
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for s in range(5):
            x, y = data(s, seed=rank + 1)  # each rank its own batch: the sums differ
            for model, o in ((ours, opt), (ref, ropt)):
                o.zero_grad()
                F.mse_loss(model(x), y).backward()
                for p in model.parameters():
                    v = p.grad._version
                    dist.all_reduce(p.grad)  # in place, SUM
                    assert p.grad._version == v, "c10d moved the version: update the Note"
                o.step()
        result = _compare(ours, ref, opt)
        # DDP with gradient_as_bucket_view=True: the gradients are views of DDP's buckets, which
        # its all-reduce overwrites in place after the hooks have staged the local gradients.
        ours, ref = make_model(), make_model()
        ddp = torch.nn.parallel.DistributedDataParallel(ours, gradient_as_bucket_view=True)
        rddp = torch.nn.parallel.DistributedDataParallel(ref, gradient_as_bucket_view=True)
        opt = offload(ours.parameters(), lr=1e-2, shard=False)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for s in range(5):
            x, y = data(s, seed=rank + 1)
            for net, o in ((ddp, opt), (rddp, ropt)):
                o.zero_grad()
                F.mse_loss(net(x), y).backward()
                o.step()
        result["ddp"] = _compare(ours, ref, opt)
        torch.save(result, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(sys.argv[1])
