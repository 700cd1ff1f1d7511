"""An unpack whose entry's D2H copy has not been seen landing (Note [unpack before the seal] in
rust/tier). On the H200 the host tier crashed in backward with "get() of an entry whose copy has
not landed: seal() it first": past the cap the compute stream is only made to *wait* for the
oldest copies (the host runs on), their sources go, and backward may ask for their bytes while
the copies still run or before a poll saw them land. The simulated device never got there while
its compute stream held the host for every wait; a lagging one no longer does (Note [the
simulated device]). Each case below raised that ValueError before the fix."""

from __future__ import annotations

import pytest
import torch

import spillover
from spillover.activations.link import link_for

MiB = 1 << 20


class _Wide(torch.nn.Module):
    """Blocks whose saved tensors are large (``width`` x ``width`` fp32 each) beside a cap that
    holds less than one of them: every pack makes the one before a victim."""

    def __init__(self, n: int, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return x.sum()


def _grads(model):
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("pool", [None, 512 * MiB], ids=["default-pool", "large-pool"])
@pytest.mark.parametrize("bw", [10e6 + 13, 25e6 + 11], ids=["10MBps", "25MBps"])
def test_backward_right_after_forward_on_a_link_slower_than_compute(pool, bw):
    """Copies slower than compute, a compute stream that lags the host, large tensors unpacked
    right after they were packed (backward starts at once, no synchronize; 1 MiB tensors at
    10-25 MB/s, a cap of half of one): every mode of return -- source, staged, urgent before
    the seal -- gives the gradients of no offload, and the unpacks before the seal happen."""
    model, x = _Wide(6, 512), torch.randn(512, 512)
    model(x).backward()
    ref = _grads(model)
    kw = {} if pool is None else {"host_pool_bytes": pool}
    tr = link_for("cpu", sim_bandwidth=bw, sim_lag=0.05, cap_bytes=MiB // 2)
    before = tr.urgent_before_landing
    for step in range(3):  # a new context each step, as the Quick start writes it
        model.zero_grad(set_to_none=True)
        ctx = spillover.offload_context("host", sim_link_bandwidth=bw, sim_compute_lag=0.05,
                                        min_offload_bytes=0, copy_inflight_bytes=MiB // 2, **kw)
        with ctx:
            loss = model(x)
        loss.backward()
        got = _grads(model)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), step
        s = ctx.stats()
        assert s.tensors_unpacked >= 12
    assert tr.urgent_before_landing > before  # the path the H200 crashed on was taken
