"""Note [the tail stays] (planner/search.py): ``OffloadContext.keep_rest`` keeps on the device
what is saved from the call until backward starts -- what a model saves after its last
region, which backward needs first and whose copies cannot hide -- counted as kept by a
policy; backward's first unpack ends it, and every gradient is bitwise that of no offload."""

from __future__ import annotations

import pytest
import torch

import spillover

MiB = 1 << 20


def _step(x, w1, w2, ctx=None, keep=False):
    """Two stages: what the first saves is offloaded; with ``keep`` what the second saves
    (sigmoid's output, which the square saves again: a loss's tail) stays."""
    h = torch.tanh(x @ w1)  # saves x and tanh's output
    if keep:
        ctx.keep_rest()
    y = torch.sigmoid(h @ w2)  # saves h again (offloaded already), w2, sigmoid's output
    return y.square().sum()  # saves y again


@pytest.mark.parametrize("sim", [False, True], ids=["host", "simulated-link"])
def test_keep_rest_keeps_what_follows_until_backward(sim):
    torch.manual_seed(0)
    x = torch.randn(256, 512)
    w1 = torch.randn(512, 512, requires_grad=True)
    w2 = torch.randn(512, 512, requires_grad=True)
    _step(x, w1, w2).backward()
    ref = [w1.grad.clone(), w2.grad.clone()]
    kw = dict(sim_link_bandwidth=50e6 + 7, sim_compute_lag=0.01) if sim else {}
    stats = {}
    for keep in (False, True):
        w1.grad = w2.grad = None
        ctx = spillover.offload_context("host", min_offload_bytes=0, **kw)
        with ctx:
            loss = _step(x, w1, w2, ctx, keep)
        loss.backward()
        assert torch.equal(w1.grad, ref[0]) and torch.equal(w2.grad, ref[1]), keep
        stats[keep] = ctx.stats()
    y_bytes = 256 * 512 * 4
    shipped, kept = stats[False], stats[True]
    assert shipped.bytes_kept_policy == 0 and shipped.tensors_offloaded == 3  # x, h, y
    # y stays (counted once: the square's save of it is a deduplicated view); x and h go
    assert kept.bytes_kept_policy == y_bytes, kept
    assert kept.tensors_offloaded == 2 and kept.bytes_offloaded == shipped.bytes_offloaded - y_bytes
    assert kept.tensors_packed == shipped.tensors_packed


def test_backward_ends_keep_rest():
    """A second forward in the same context after a backward offloads again."""
    torch.manual_seed(0)
    x = torch.randn(64, 256)
    w = torch.randn(256, 256, requires_grad=True)
    ctx = spillover.offload_context("host", min_offload_bytes=0)
    with ctx:
        a = torch.tanh(x @ w)
        b = torch.tanh(a @ w)
        ctx.keep_rest()
        c = torch.tanh(b @ w)  # kept
        c.sum().backward()  # its first unpack ends keep_rest
        d = torch.tanh(x @ w)  # offloaded again
        d.sum().backward()
    s = ctx.stats()
    assert s.bytes_kept_policy == 64 * 256 * 4, s  # c alone, not d


def test_keep_rest_outside_a_step_does_nothing():
    ctx = spillover.offload_context("host")
    ctx.keep_rest()  # never entered: no step to mark, no error
    ctx.keep_rest(False)


def test_a_dead_storages_key_names_nothing(monkeypatch):
    """Note [a storage's key is its own while it lives] (recompute/blocks.py): a tail tensor
    whose storage took the address of a region input that died is counted in the tail. Every
    key is made the same here (the address reused), which the counting once took for the
    excluded input: the H200 estimate's 500 MiB of log-probabilities were in its tail in some
    runs only."""
    from spillover.recompute import blocks

    monkeypatch.setattr(blocks, "skey", lambda t: ("cpu", 1))
    c = blocks._CountingHooks(torch.nn.Identity())  # (no parameter: no key of its own)
    first = torch.randn(8)
    c.exclude((first,))
    assert c.pack(torch.randn(4)) is not None and c.tail == 0  # named by the live input
    del first
    c.pack(torch.randn(16))
    assert c.tail == 64
    kept = torch.randn(32)
    c.pack(kept)  # the key is the one counted above, whose storage died: counted again
    assert c.tail == 64 + 128
    c.pack(kept.view(4, 8))  # a view of a storage counted and alive: not again
    assert c.tail == 64 + 128
