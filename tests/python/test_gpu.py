"""The checks only a GPU can make: pinned pool blocks and link-speed copies, device memory back at
its baseline after backward, peak device memory under a link that cannot keep up, the NVMe tier
through a 64 MiB pool, bitwise gradients under deterministic algorithms (with the reference
against itself as a control), stream ordering (test_stream_gradients_bitwise[host] also runs
under TORCH_CUDA_SANITIZER=1 in benches/gpu/run.sh, which says why only that one) and a refused
cudaHostRegister.

Skipped without CUDA. With GPU_DRY_RUN=1 (``benches/gpu/run.sh --dry-run``) every test runs on the
CPU at small sizes instead: what needs CUDA is skipped inside the test and said in its figure, so
a broken test is caught here rather than on the device. Self-contained on purpose (run with
``--noconftest``): only spillover's public API, no helper another test file may change.

Each test records its result as a ``figure`` property; benches/gpu/summary_plugin.py writes it to
the run's summary.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import statistics
import time
import warnings

# cuBLAS reads this once, when it first makes a handle: set before any CUDA work (run.sh
# exports it as well).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.checkpoint import checkpoint  # noqa: E402

import spillover  # noqa: E402
from spillover import _native, _runtime  # noqa: E402
from spillover.models import GPT, GPTConfig, synthetic_batch  # noqa: E402

CUDA = torch.cuda.is_available()
DRY = not CUDA and os.environ.get("GPU_DRY_RUN") == "1"
DEV = torch.device("cuda" if CUDA else "cpu")
MiB, GiB = 1 << 20, 1 << 30

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (CUDA or DRY), reason="needs CUDA (GPU_DRY_RUN=1: on the CPU)"),
]

# Pools are shared per capacity within a process: each test asks for a capacity of its own, so
# no other test's blocks blur its counts.
_next_pool = [0]


def pool_bytes(base: int) -> int:
    _next_pool[0] += 1
    return base + _next_pool[0] * 4096


def need_cuda(what: str) -> None:
    if not CUDA:
        pytest.skip(f"{what} needs CUDA (dry run on the CPU)")


def sync() -> None:
    if CUDA:
        torch.cuda.synchronize()


def fmt(n: float) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def nvme_dir(tmp_path) -> str:
    """run.sh points SPILLOVER_NVME_PATH at the scratch dir it probed for O_DIRECT."""
    d = os.environ.get("SPILLOVER_NVME_PATH", "").split(",")[0]
    return d or str(tmp_path)


@pytest.fixture
def figure(record_property):
    """figure("...") records the test's headline figure for summary.md (and prints it)."""

    def put(text: str) -> None:
        print(f"FIGURE: {text}")
        record_property("figure", text)

    return put


@pytest.fixture
def deterministic():
    """Deterministic algorithms on without warn_only (a nondeterministic op raises), restored
    after the test."""
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]


# ---- models and steps ---------------------------------------------------------------------------


def gpt(dtype=torch.float32, big=False):
    """A GPT with explicit attention (its s x s scores are saved); ``big``: ~400 MiB of saved
    activations on the GPU (~100 MiB on the CPU), more than a 64 MiB pool holds."""
    torch.manual_seed(0)
    if big:
        cfg = GPTConfig(vocab=256, d_model=256, n_heads=8, n_layers=6 if CUDA else 3,
                        seq=512 if CUDA else 256)
        batch = 2
    elif CUDA:
        cfg, batch = GPTConfig(vocab=256, d_model=256, n_heads=8, n_layers=3, seq=256), 4
    else:
        cfg, batch = GPTConfig(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64), 2
    model = GPT(cfg).to(DEV, dtype)
    return model, synthetic_batch(cfg, batch=batch, device=DEV)


def grads(model):
    return [p.grad.detach().clone() for p in model.parameters()]


def step(model, batch, ctx=None):
    """One forward/backward from zeroed gradients; backward runs outside the ``with`` block."""
    model.zero_grad(set_to_none=True)
    idx, tgt = batch
    if ctx is None:
        model(idx, tgt).backward()
    else:
        with ctx:
            loss = model(idx, tgt)
        loss.backward()
        ctx.synchronize()
    sync()
    return grads(model)


def differing(a, b):
    """Indices of the gradients that are not bitwise equal."""
    assert len(a) == len(b)
    return [i for i, (x, y) in enumerate(zip(a, b))
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y)]


def pool_in_use(ctx) -> int:
    """The context's pool's bytes in use: ``stats().pool_in_use`` where it exists, else the pool's
    own counter."""
    v = getattr(ctx.stats(), "pool_in_use", None)
    return int(v) if v is not None else _runtime.host_pool(ctx.config).stats()["in_use"]


def drain(ctx, seconds: float = 5.0):
    """Wait (bounded) until the context's pool has every block back; returns (in use, waited s).
    Copies and writes still finishing hold their blocks for a moment (Note [source lifetime])."""
    t0 = time.perf_counter()
    while True:
        ctx.synchronize()
        sync()
        gc.collect()
        used = pool_in_use(ctx)
        waited = time.perf_counter() - t0
        if used == 0 or waited > seconds:
            return used, waited
        time.sleep(0.01)


def offload(tier, pool, tmp_path, **kw):
    if tier != "host":
        kw.setdefault("nvme_path", nvme_dir(tmp_path))
    return spillover.offload_context(tier, host_pool_bytes=pool, min_offload_bytes=0, **kw)


# ---- bitwise parity -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_control_reference_against_itself(dtype, deterministic, figure):
    """The control: the reference (no offload) run twice is bitwise equal to itself, so a ✗ in
    the parity tests means spillover, not a nondeterministic kernel."""
    model, batch = gpt(dtype)
    a, b = step(model, batch), step(model, batch)
    bad = differing(a, b)
    figure(f"{len(a)} gradients, {len(a) - len(bad)} bitwise equal across two reference runs")
    assert not bad, f"the reference differs from itself in gradients {bad}: kernels, not spillover"


@pytest.mark.parametrize("tier", ["host", "nvme", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_gradients_bitwise(tier, dtype, deterministic, figure, tmp_path):
    model, batch = gpt(dtype)
    ref, again = step(model, batch), step(model, batch)
    if differing(ref, again):
        pytest.skip("control failed: the reference differs from itself (see the control test)")
    # NVMe: a pool smaller than the activations, so entries go to disk and come back.
    pool = pool_bytes(256 * MiB if tier == "host" else 16 * MiB if CUDA else 2 * MiB)
    results = []
    for _ in range(2):  # the second step runs with the access order the first one learned
        ctx = offload(tier, pool, tmp_path)
        bad = differing(ref, step(model, batch, ctx))
        results.append((bad, ctx.stats()))
    s = results[-1][1]
    figure(f"{len(ref)} gradients; steps bitwise equal: "
           f"{', '.join('✓' if not b else f'✗ ({len(b)} differ)' for b, _ in results)}; "
           f"offloaded {fmt(s.bytes_offloaded_host)} host + {fmt(s.bytes_offloaded_nvme)} NVMe")
    for bad, _ in results:
        assert not bad, f"gradients {bad} differ from the reference"
    assert s.bytes_offloaded > 0 and s.tensors_unpacked >= s.tensors_offloaded


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
    registered = _runtime.register_with_cuda(pool)
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
            ok = _runtime.register_with_cuda(pool)
        x = torch.ones(1 << 20, device="cuda") * 2  # a kernel launch checks the last error
        total = float(x.sum())
        torch.cuda.synchronize()
        again = _runtime.register_with_cuda(pool)
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
    assert _runtime.register_with_cuda(p) is True and len(ok.registered) == 3
    assert _runtime.register_with_cuda(p) is True and len(ok.flags) == 3  # not registered twice
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
        first = _runtime.register_with_cuda(q)
    assert first is False and bad.registered == {}, "arenas left registered after a refusal"
    with open("/proc/self/maps") as f:
        cudart_loaded = any("libcudart" in line for line in f)
    if get_last_error:
        assert bad.cleared == 1 and not seen
    elif cudart_loaded:  # a CPU-only torch build loads no libcudart: nothing to clear there
        assert any("libcudart" in str(lib) and sym == "cudaGetLastError" for lib, sym in seen)
    calls = len(bad.flags)
    assert _runtime.register_with_cuda(q) is False and len(bad.flags) == calls  # not retried
    how = ("torch's binding" if get_last_error
           else f"ctypes on {os.path.basename(seen[0][0])}" if seen else "nothing (no libcudart)")
    figure("3 arenas registered once with flag 1 under the device guard; a refusal at the third: "
           f"False, 2 arenas unregistered, last error cleared through {how}")


# ---- device memory ------------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "nvme", "auto"])
def test_memory_back_at_baseline_after_backward(tier, figure, tmp_path):
    """After backward, device memory is what it was before forward (gradients included) and the
    pool has every block back."""
    model, batch = gpt(big=True)
    step(model, batch)  # gradients exist from here on; backward accumulates into them
    model.zero_grad(set_to_none=False)
    ctx = offload(tier, pool_bytes(64 * MiB), tmp_path)
    gc.collect()
    sync()
    base = torch.cuda.memory_allocated() if CUDA else 0
    with ctx:
        loss = model(*batch)
    during = torch.cuda.memory_allocated() if CUDA else 0
    loss.backward()
    del loss
    used, waited = drain(ctx)
    after = torch.cuda.memory_allocated() if CUDA else 0
    s = ctx.stats()
    mem = (f"device memory {fmt(base)} before forward, {fmt(during)} after it, "
           f"{after - base:+d} B after backward" if CUDA else "device memory: needs CUDA")
    figure(f"{mem}; pool in use {fmt(used)} (after {waited:.2f} s; peak {fmt(s.pool_peak)}); "
           f"offloaded {fmt(s.bytes_offloaded_host)} host + {fmt(s.bytes_offloaded_nvme)} NVMe")
    assert s.bytes_offloaded > 0
    assert used == 0, f"{used} bytes of the pool still in use after backward"
    assert after == base, f"{after - base} bytes of device memory not returned after backward"


class Cheap(nn.Module):
    """A layer of elementwise ops: it saves two tensors of its input's size and computes next to
    nothing, so forward makes activations far faster than a PCIe link can move them."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.tensor(1.0001))

    def forward(self, x):
        return x + torch.sin(x * self.w)


def test_host_tier_peak_when_the_link_cannot_keep_up(figure):
    """Peak device memory (max_memory_allocated over a step, above the memory before it) of the
    host tier, against no offload and full checkpointing, in one run, on a model whose forward
    saves ~2 GiB in a few milliseconds (~40 ms of PCIe): the bound on copies in flight must hold
    the host tier well below no offload, in forward and in backward (each phase's peak is
    measured on its own: the counters are reset between them)."""
    layers, numel = (16, 16 * MiB) if CUDA else (4, MiB // 2)
    torch.manual_seed(0)
    model = nn.ModuleList(Cheap() for _ in range(layers)).to(DEV)
    x = torch.randn(numel, device=DEV, requires_grad=True)
    pool = pool_bytes(4 * GiB if CUDA else 64 * MiB)

    def run(mode):
        model.zero_grad(set_to_none=True)
        x.grad = None
        gc.collect()
        sync()
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if CUDA else 0
        ctx = spillover.offload_context("host", host_pool_bytes=pool) if mode == "host" else None
        t0 = time.perf_counter()
        with ctx if ctx is not None else contextlib.nullcontext():
            h = x
            for layer in model:
                h = checkpoint(layer, h, use_reentrant=False) if mode == "full" else layer(h)
            loss = h.square().mean()
        fwd = time.perf_counter() - t0
        fwd_peak = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
        if CUDA:  # the allocator's counters are the host's: no synchronize needed to read them
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        if ctx is not None:
            ctx.synchronize()
        sync()
        dt = time.perf_counter() - t0
        bwd_peak = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
        return ((max(fwd_peak, bwd_peak), fwd_peak, bwd_peak), fwd, dt,
                (ctx.stats() if ctx is not None else None), x.grad.clone())

    run("host")  # warm-up: maps and registers the pool
    res = {m: run(m) for m in ("none", "full", "host")}
    s = res["host"][3]
    saved = 2 * layers * numel * 4
    assert torch.equal(res["none"][4], res["host"][4]), "host tier gradient differs"
    assert s.bytes_offloaded_host > 0
    if not CUDA:
        figure(f"CPU: ran none / full / host on {fmt(saved)} of activations, offloaded "
               f"{fmt(s.bytes_offloaded_host)} (peak device memory needs CUDA)")
        return
    (none, *none_fb), (full, *_), (host, *host_fb) = (res[m][0] for m in ("none", "full", "host"))
    figure(f"{fmt(saved)} saved in {res['none'][1] * 1e3:.1f} ms of forward; peak above "
           f"baseline: none {fmt(none)}, full checkpointing {fmt(full)}, host tier {fmt(host)} "
           f"({host / none:.2f}x none, {host / full:.2f}x full); forward / backward peaks: "
           f"host {fmt(host_fb[0])} / {fmt(host_fb[1])}, none {fmt(none_fb[0])} / "
           f"{fmt(none_fb[1])}; step {res['host'][2] * 1e3:.0f} ms vs none "
           f"{res['none'][2] * 1e3:.0f} ms, stalls {s.stall_seconds:.3f} s")
    assert host < 0.5 * none, "the host tier's peak is not well below no offload's"


def test_backward_frees_what_it_brought_back_in_stream_order(figure):
    """Note [frees in stream order]: backward's tensors brought back over the link go as
    autograd lets go of them (the copy stream waits on the using stream's event, behind the
    cap), not once the host has seen the compute stream pass them: with the host running ahead
    of a link-bound backward, nearly everything brought back stayed alive. Every copy has
    landed before backward, so every unpack crosses the link."""
    layers, numel = (16, 16 * MiB) if CUDA else (4, MiB // 2)
    torch.manual_seed(0)
    model = nn.ModuleList(Cheap() for _ in range(layers)).to(DEV)
    x = torch.randn(numel, device=DEV, requires_grad=True)
    cap = 128 * MiB
    ctx = spillover.offload_context("host", host_pool_bytes=pool_bytes(4 * GiB if CUDA else
                                                                       64 * MiB),
                                    copy_inflight_bytes=cap)
    for _ in range(2):  # the first maps and registers the pool
        x.grad = None
        model.zero_grad(set_to_none=True)
        gc.collect()
        sync()
        with ctx:
            h = x
            for layer in model:
                h = layer(h)
            loss = h.square().mean()
        ctx.synchronize()
        sync()
        base = torch.cuda.memory_allocated() if CUDA else 0
        if CUDA:
            torch.cuda.reset_peak_memory_stats()
        loss.backward()
        sync()
        bwd = (torch.cuda.max_memory_allocated() - base) if CUDA else 0
    s = ctx.stats()
    saved = 2 * layers * numel * 4
    assert s.bytes_offloaded_host > 0 and s.unpacks_from_source == 0
    if not CUDA:
        figure(f"CPU: offloaded {fmt(s.bytes_offloaded_host)}, unpacked "
               f"{s.tensors_unpacked} tensors (the backward peak needs CUDA)")
        return
    figure(f"backward peak above its start {fmt(bwd)} for {fmt(saved)} brought back "
           f"({bwd / saved:.2f}x); cap {fmt(cap)}, stalls {s.stall_seconds:.3f} s")
    assert bwd < 0.5 * saved, "backward kept most of what it brought back alive"


def test_nvme_tier_64mib_pool_no_overflow_reads(deterministic, figure, tmp_path):
    """~400 MiB of activations through a 64 MiB pool on the NVMe tier: every read back finds a
    block in the pool (no temporary buffers), gradients bitwise equal to the reference."""
    model, batch = gpt(big=True)
    ref = step(model, batch)
    rows = []
    for _ in range(2):
        ctx = offload("nvme", pool_bytes(64 * MiB), tmp_path)
        t0 = time.perf_counter()
        bad = differing(ref, step(model, batch, ctx))
        rows.append((bad, ctx.stats(), time.perf_counter() - t0))
    s = rows[-1][1]
    figure(f"{fmt(s.bytes_packed)} packed, {fmt(s.bytes_offloaded_nvme)} to NVMe through "
           f"{fmt(s.pool_capacity)}; overflow reads {[r[1].overflow_reads for r in rows]}; "
           f"prefetch hits {s.prefetch_hits} / misses {s.prefetch_misses}, pool hits "
           f"{s.host_cache_hits}; stalls {s.stall_seconds:.3f} s; step {rows[-1][2]:.2f} s; "
           f"gradients {'✓' if not any(r[0] for r in rows) else '✗'}")
    assert s.bytes_offloaded_nvme > 0, "nothing went to disk: the test does not test the tier"
    assert all(r[1].overflow_reads == 0 for r in rows)
    assert not any(r[0] for r in rows), "gradients differ from the reference"


# ---- stream ordering (also under TORCH_CUDA_SANITIZER=1) ----------------------------------------


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_stream_gradients_bitwise(tier, figure, tmp_path):
    """Offload and reload on side streams, the compute stream using each tensor as soon as it is
    back: bitwise gradients (without deterministic mode: under the sanitizer a race is found
    as such, and kernels of these shapes are deterministic anyway)."""
    model, batch = gpt()
    ref = step(model, batch)
    ctx = offload(tier, pool_bytes(64 * MiB), tmp_path)
    bad = differing(ref, step(model, batch, ctx))
    s = ctx.stats()
    figure(f"gradients {'✓' if not bad else f'✗ {bad}'}; "
           f"{s.tensors_offloaded} tensors offloaded, {s.tensors_unpacked} unpacked; "
           f"sanitizer {'on' if os.environ.get('TORCH_CUDA_SANITIZER') else 'off'}")
    assert not bad


def test_stream_no_device_synchronize_on_the_compute_path(figure):
    """Forward and backward under offload with torch's sync debug mode set to error: no
    device-wide or stream synchronize on the compute path."""
    need_cuda("torch.cuda.set_sync_debug_mode")
    model, (idx, tgt) = gpt()
    pool = pool_bytes(256 * MiB)
    step(model, (idx, tgt), spillover.offload_context("host", host_pool_bytes=pool))  # warm-up
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=pool)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with c:
            loss = model(idx, tgt)
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    figure(f"{c.stats().tensors_offloaded} tensors offloaded and back, no synchronize")


def test_stream_source_memory_is_not_reused_before_its_copy_completes(figure):
    # Note [source lifetime]: after pack, forward drops its references and the caching allocator
    # would hand the bytes to the next allocation; the copy must still read the old values.
    n = 4096 if CUDA else 512
    torch.manual_seed(0)
    x = torch.randn(n, n, device=DEV, requires_grad=True)

    def f():
        h = (x * 2.0).sin()  # sin saves its input (x*2.0), which forward then forgets
        junk = [torch.full((n, n), 7.0, device=DEV) for _ in range(4)]
        del junk
        return h.sum()

    f().backward()
    ref = x.grad.clone()
    x.grad = None
    pool = pool_bytes(GiB if CUDA else 64 * MiB)
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=pool)
    with c:
        loss = f()
    loss.backward()
    sync()
    same = torch.equal(ref, x.grad)
    figure(f"gradient {'✓' if same else '✗'} with the source's memory reallocated at once; "
           f"{fmt(c.stats().bytes_offloaded_host)} offloaded")
    assert same
    assert c.stats().bytes_offloaded_host >= n * n * 4
