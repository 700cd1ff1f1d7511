"""The GPU's checks of the pinned pool: a pool block is page-locked as CUDA sees it and copies at
link speed; a refused cudaHostRegister, then a kernel launch, does not raise; register_with_cuda's
bookkeeping against a stand-in cudart (runs on the CPU too). Skip markers, dry run
(GPU_DRY_RUN=1), fixtures and helpers: _gpu_common.py.
"""

from __future__ import annotations

import ctypes
import os
import statistics
import time
import warnings

import numpy as np
import pytest
import torch
from _gpu_common import CUDA, DEV, MARKS, MiB, figure, fmt, need_cuda, pool_bytes

from spillover import _native, _pools

pytestmark = MARKS
__all__ = ["figure"]  # the fixture: pytest finds it in this module's namespace


# ---- the pool, pinned ---------------------------------------------------------------------------


def test_pool_block_is_pinned_and_copies_at_link_speed(figure):
    """A pool block is page-locked as CUDA sees it; a 512 MiB device-to-host copy into it returns
    at once and runs at the bandwidth a cudaHostAlloc'd buffer gets (measured alongside)."""
    n = 512 * MiB if CUDA else 16 * MiB
    pool = _native.Pool(pool_bytes(n + 64 * MiB))
    block = pool.lease(n)
    dst = torch.from_numpy(np.asarray(block))
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=DEV)
    if not CUDA:
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        assert torch.equal(dst, src)
        figure(f"CPU: a {fmt(n)} copy into a pool block at {n / dt / 1e9:.2f} GB/s "
               "(is_pinned and device copies need CUDA)")
        return
    registered = _pools.register_with_cuda(pool)
    assert registered and dst.is_pinned(), "the pool's arena is not page-locked for CUDA"
    ref = torch.empty(n, dtype=torch.uint8, pin_memory=True)

    def d2h(out):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        out.copy_(src, non_blocking=True)
        returned = time.perf_counter() - t0
        e1.record()
        e1.synchronize()
        return returned, n / (e0.elapsed_time(e1) / 1e3) / 1e9

    def h2d(inp):
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        dev.copy_(inp, non_blocking=True)
        e1.record()
        e1.synchronize()
        return n / (e0.elapsed_time(e1) / 1e3) / 1e9

    d2h(dst), d2h(ref)  # warm-up
    ours = [d2h(dst) for _ in range(3)]
    theirs = [d2h(ref) for _ in range(3)]
    assert torch.equal(dst, ref), "the copy into the pool block is not the source's bytes"
    ret = statistics.median(r for r, _ in ours)
    bw, bw_ref = max(b for _, b in ours), max(b for _, b in theirs)
    up, up_ref = max(h2d(dst) for _ in range(3)), max(h2d(ref) for _ in range(3))
    figure(f"is_pinned ✓; {fmt(n)} D2H returns in {ret * 1e3:.3f} ms, {bw:.1f} GB/s "
           f"(cudaHostAlloc buffer {bw_ref:.1f} GB/s: {bw / bw_ref:.2f}x); H2D {up:.1f} GB/s "
           f"({up / up_ref:.2f}x)")
    assert ret < 1e-3, f"the copy took {ret * 1e3:.2f} ms to return: not asynchronous"
    assert bw >= 0.8 * bw_ref, f"D2H into the pool at {bw:.1f} GB/s vs {bw_ref:.1f} pinned"


def test_failed_register_then_kernel_launch_does_not_raise(figure):
    """register_with_cuda meets an arena already registered (cudaErrorHostMemoryAlreadyRegistered):
    it returns False with a warning, unregisters the arena it had registered, clears CUDA's last
    error so the next kernel launch does not raise it, and does not record the pool as
    registered."""
    need_cuda("cudaHostRegister")
    pool = _native.Pool(pool_bytes(32 * MiB), arena_bytes=16 * MiB)
    (a0, n0), (a1, n1) = pool.arenas()[:2]
    cudart = torch.cuda.cudart()

    def code(err):
        return int(getattr(err, "value", err))

    assert code(cudart.cudaHostRegister(a1, n1, 0)) == 0  # the second arena, behind its back
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ok = _pools.register_with_cuda(pool)
        x = torch.ones(1 << 20, device="cuda") * 2  # a kernel launch checks the last error
        total = float(x.sum())
        torch.cuda.synchronize()
        again = _pools.register_with_cuda(pool)
        # The first arena was unregistered again: registering it now succeeds.
        first_free = code(cudart.cudaHostRegister(a0, n0, 0)) == 0
        if first_free:
            cudart.cudaHostUnregister(a0)
    finally:
        cudart.cudaHostUnregister(a1)
    warned = any("cudaHostRegister" in str(w.message) for w in caught)
    figure(f"register_with_cuda -> {ok} (then {again}), kernel launch after it ✓ "
           f"(sum {total:.0f}), first arena unregistered {'✓' if first_free else '✗'}, "
           f"warning {'issued' if warned else 'not issued (already given in this process)'}")
    assert ok is False and again is False
    assert total == 2.0 * (1 << 20)
    assert first_free, "the arena registered before the failure was left registered"


class FakeCudart:
    """torch.cuda.cudart() as register_with_cuda sees it: refuses the registration at index
    ``refuse_at`` (as CUDA does an arena registered twice) and records every call."""

    def __init__(self, refuse_at=None, get_last_error=True):
        self.refuse_at, self.registered, self.flags, self.cleared = refuse_at, {}, [], 0
        if get_last_error:
            self.cudaGetLastError = self._get_last_error

    def _get_last_error(self):
        self.cleared += 1
        return 0

    def cudaHostRegister(self, addr, length, flags):
        self.flags.append(flags)
        if len(self.flags) - 1 == self.refuse_at or addr in self.registered:
            return 712  # cudaErrorHostMemoryAlreadyRegistered
        self.registered[addr] = length
        return 0

    def cudaHostUnregister(self, addr):
        del self.registered[addr]
        return 0


@pytest.mark.parametrize("get_last_error", [True, False], ids=["binding", "ctypes"])
def test_register_with_cuda_bookkeeping(get_last_error, monkeypatch, figure):
    """register_with_cuda against a stand-in cudart (runs on the CPU too): the portable flag,
    under the device guard; a pool is recorded only once registered; a refusal unregisters the
    arenas already registered, clears the last error (torch's binding, else ctypes on the loaded
    libcudart) and is not retried."""
    guards = []

    class Guard:
        def __init__(self, dev):
            guards.append(dev)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Guard)

    def pool():
        return _native.Pool(12 * MiB, arena_bytes=4 * MiB, lock=False)  # three arenas

    ok = FakeCudart(get_last_error=get_last_error)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: ok)
    p = pool()
    assert _pools.register_with_cuda(p) is True and len(ok.registered) == 3
    assert _pools.register_with_cuda(p) is True and len(ok.flags) == 3  # not registered twice
    assert set(ok.flags) == {1} and guards == [0]

    bad = FakeCudart(refuse_at=2, get_last_error=get_last_error)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: bad)
    seen = []  # (library, symbol) called through ctypes
    real_cdll = ctypes.CDLL

    class Spy:
        def __init__(self, name, mode=0, **kw):
            self._lib, self._name = real_cdll(name, mode=mode, **kw), name

        def __getattr__(self, sym):
            fn = getattr(self._lib, sym)
            return lambda *a: seen.append((self._name, sym)) or fn(*a)

    monkeypatch.setattr(ctypes, "CDLL", Spy)
    q = pool()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first = _pools.register_with_cuda(q)
    assert first is False and bad.registered == {}, "arenas left registered after a refusal"
    with open("/proc/self/maps") as f:
        cudart_loaded = any("libcudart" in line for line in f)
    if get_last_error:
        assert bad.cleared == 1 and not seen
    elif cudart_loaded:  # a CPU-only torch build loads no libcudart: nothing to clear there
        assert any("libcudart" in str(lib) and sym == "cudaGetLastError" for lib, sym in seen)
    calls = len(bad.flags)
    assert _pools.register_with_cuda(q) is False and len(bad.flags) == calls  # not retried
    how = ("torch's binding" if get_last_error
           else f"ctypes on {os.path.basename(seen[0][0])}" if seen else "nothing (no libcudart)")
    figure("3 arenas registered once with flag 1 under the device guard; a refusal at the third: "
           f"False, 2 arenas unregistered, last error cleared through {how}")


def test_a_pool_registered_and_dropped_leaves_no_error_for_the_next_step():
    """The H200's probe: its ``pool`` check registered a 4 GiB pool and dropped it; the next
    check's first torch op raised "resource already mapped", and so did every CUDA call after
    it in the process. A registered pool is now held until it is unregistered (Note
    [registered, never unmapped] in _pools.py), so a step that follows in the same process
    runs, and ``empty_cache`` unregisters it before it is unmapped."""
    import spillover

    need_cuda("registering a pool with CUDA")

    pool = _native.Pool(pool_bytes(256 * MiB))
    assert _pools.register_with_cuda(pool)
    del pool
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)]).to(DEV)
    x = torch.randn(512, 1024, device=DEV)
    model(x).sum().backward()
    ref = [p.grad.clone() for p in model.parameters()]
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with spillover.offload_context("host", min_offload_bytes=0):
            loss = model(x).sum()
        loss.backward()
        assert all(torch.equal(p.grad, r) for p, r in zip(model.parameters(), ref))
    spillover.empty_cache()
    torch.cuda.synchronize()
    torch.ones(1, device=DEV).add_(1)  # no error left for the user's next op
