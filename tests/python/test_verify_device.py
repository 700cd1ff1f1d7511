"""The verify mode on a device (Note [verify on the device] in activations/verify.py), on the
simulated device: each race a GPU run could hit, injected, is caught as a
``spillover.IntegrityError`` naming the tensor, the step, the tier and the check, in the step
that hit it; real model code runs with it on and no false positive."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import spillover
from spillover.activations.link import link_for
from spillover.models import GPT, GPTConfig, synthetic_batch

MiB = 1 << 20


def _chain(n=8, width=512):
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(width, width),
                                                     torch.nn.ReLU()) for _ in range(n)])


def _ctx(bw, tier="host", tmp_path=None, **kw):
    kw.setdefault("host_pool_bytes", 64 * MiB)
    if tier == "nvme":
        kw["nvme_path"] = str(tmp_path)
    return spillover.offload_context(tier, sim_link_bandwidth=bw, min_offload_bytes=0,
                                     verify=True, **kw)


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("attn", ["explicit", "sdpa"])
def test_no_false_positive_on_the_gpt(tier, attn, tmp_path):
    cfg = GPTConfig(vocab=512, d_model=64, n_heads=4, n_layers=2, seq=64, attn=attn)
    torch.manual_seed(0)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=4)
    model(*batch).backward()
    ref = [p.grad.clone() for p in model.parameters()]
    ctx = _ctx(2e9 + 43, tier, tmp_path, copy_inflight_bytes=256 << 10,
               host_pool_bytes=2 * MiB if tier == "nvme" else 64 * MiB)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with ctx:
            loss = model(*batch)
        loss.backward()
        assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    s = ctx.stats(total=True)
    assert s.tensors_offloaded > 0 and s.tensors_unpacked > s.unpacks_from_source, s


def test_a_source_written_before_its_copy_read_it_is_caught():
    """Check 1: the D2H copy read bytes other than the source's at pack."""
    bw = 2e9 + 47
    ctx = _ctx(bw)
    x = torch.randn(MiB // 4, requires_grad=True)
    link_for("cpu", sim_bandwidth=bw).native.inject("stale_source", "to_host")
    with pytest.raises(spillover.IntegrityError) as e, ctx:
        y = (x * 2).sigmoid()
        ctx.synchronize()
    msg = str(e.value)
    assert "shape [262144] and dtype torch.float32 in step 1 on the host tier" in msg, msg
    assert "check 1" in msg and "written before its copy read it" in msg, msg
    del y


@pytest.mark.parametrize("fault", ["late_landing", "stale_source"])
def test_a_tensor_read_before_its_copy_back_landed_is_caught(fault):
    """Check 2: every tensor comes back over the link (its copy landed, its source gone); the
    copy back lands after it was read (``late_landing``) or reads a block reused under it
    (``stale_source``): backward() raises, naming the check."""
    model, x = _chain(), torch.randn(512, 512)
    bw = 2e9 + (53 if fault == "late_landing" else 59)
    ctx = _ctx(bw)
    tr = link_for("cpu", sim_bandwidth=bw)
    with ctx:
        loss = model(x).sum()
    ctx.synchronize()
    tr.release_sources()
    tr.native.inject(fault, "to_device")
    with pytest.raises(spillover.IntegrityError, match="check 2 .*read before its copy back"):
        loss.backward()


def test_a_flipped_byte_in_the_host_block_is_caught(tmp_path):
    """Check 3 (and 2 where the block goes to the device as it is): a byte of an entry
    flipped behind spillover's back after its copy landed."""
    model, x = _chain(n=4), torch.randn(512, 512)
    bw = 2e9 + 61
    ctx = _ctx(bw)
    packed = []
    orig = ctx._pack
    ctx._pack = lambda t: packed.append(orig(t)) or packed[-1]
    with ctx:
        loss = model(x).sum()
    ctx.synchronize()
    link_for("cpu", sim_bandwidth=bw).release_sources()
    entries = [p.stored.entry for p in packed if not isinstance(p, torch.Tensor)]
    view = entries[0].try_get()
    np.asarray(view)[100] ^= 0xFF
    del view
    with pytest.raises(spillover.IntegrityError):
        loss.backward()


class _WritesWhatItSaved(torch.nn.Module):
    """Dropout (``empty_like`` then ``bernoulli_`` on CPU) and an in-place op on a saved matmul
    output: a region writes storages its policy saved, after their pack."""

    def __init__(self, width=256):
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x):
        y = torch.nn.functional.dropout(self.a(x), 0.5, True)
        z = self.b(y)
        z.mul_(2.0)
        return self.a(torch.tanh(z))


def test_a_region_writing_what_it_saved_is_no_false_positive():
    """A slow link (each copy reads its source ~6 ms after its pack): the writes land before
    the copies read, which is the region's own doing (its entries are recomputed), not a fault
    of the link. The verify mode raised IntegrityError here (CI, gpt2 with dropout under load)."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[_WritesWhatItSaved() for _ in range(2)])
    model = torch.nn.ModuleDict({"blocks": torch.nn.ModuleList(blocks)})
    model.forward = blocks.forward  # the blocks run in order; wrap finds the ModuleList
    x = torch.randn(64, 256, requires_grad=True)

    def run(model, ctx=None):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        if ctx is None:
            model(x).square().sum().backward()
        else:
            with ctx:
                loss = model(x).square().sum()
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    ref = run(blocks)
    spillover.wrap(model, policy=spillover.SelectivePolicy(0))  # saves every op it may
    ctx = _ctx(1e7 + 53)
    for _ in range(3):
        assert all(torch.equal(g, r) for g, r in zip(run(blocks, ctx), ref))
    assert ctx.stats(total=True).tensors_offloaded > 0
    ops = [o for r in model._spillover_state.last_records() for o in r.ops]
    empties = [o for o in ops if o.name == "aten.empty_like.default"]
    assert empties and all(o.action == "recompute" and o.forced == "allocates only"
                           for o in empties)
