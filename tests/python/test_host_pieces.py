"""On the host tier a storage larger than one arena of the pool goes in pieces (a block lives in
one arena: whole, it could never be leased however large the pool, and the pool-full warning's
advice -- raise the pool -- could not help). Arenas are 1 GiB; the test makes them 8 MiB."""

from __future__ import annotations

import torch

import spillover
from spillover import _pools

MiB = 1 << 20


def _step(ctx, x):
    with ctx:
        y = (x * 2).sigmoid()  # sigmoid saves its 12 MiB output
        loss = y.sum()
    loss.backward()


def test_storage_larger_than_an_arena_goes_in_pieces(monkeypatch):
    monkeypatch.setattr(_pools, "ARENA_BYTES", 8 * MiB)
    x = torch.randn(3 * MiB, requires_grad=True)  # 12 MiB of fp32
    (x * 2).sigmoid().sum().backward()
    ref = x.grad.clone()
    x.grad = None
    ctx = spillover.offload_context("host", min_offload_bytes=0,
                                    host_pool_bytes=40 * MiB + 3 * 4096)
    for _ in range(3):
        _step(ctx, x)
        assert torch.equal(x.grad, ref)
        x.grad = None
        s = ctx.stats()
        assert s.tensors_chunked == 1 and s.bytes_kept_pool_full == 0
        assert s.bytes_offloaded == 12 * MiB
    assert ctx.stats().pool_in_use == 0


def test_one_arena_pool_keeps_what_cannot_fit(monkeypatch):
    """A pool of one arena smaller than the storage: kept, and the warning's advice (raise the
    pool) is then right."""
    monkeypatch.setattr(_pools, "ARENA_BYTES", 8 * MiB)
    x = torch.randn(3 * MiB, requires_grad=True)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=8 * MiB - 4096)
    with __import__("warnings").catch_warnings(record=True):
        _step(ctx, x)
    s = ctx.stats()
    assert s.tensors_chunked == 0 and s.bytes_kept_pool_full == 12 * MiB
