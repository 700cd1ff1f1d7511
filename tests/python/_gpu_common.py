"""What the GPU test files share: test_gpu_step.py (bitwise gradient parity, device memory back at
its baseline, peaks under a link that cannot keep up, the NVMe tier through a 64 MiB pool),
test_gpu_pool.py (pinned pool blocks and link-speed copies, cudaHostRegister refused and its
bookkeeping) and test_gpu_streams.py (stream ordering). The skip markers (``MARKS``, each file's
``pytestmark``), the ``figure`` and ``deterministic`` fixtures (imported into each test file's
namespace, where pytest finds them), the pools' capacities, the GPT and the step helpers.

Skipped without CUDA. With GPU_DRY_RUN=1 (``benches/gpu/run.sh --dry-run``) every test runs on the
CPU at small sizes instead: what needs CUDA is skipped inside the test and said in its figure, so
a broken test is caught here rather than on the device. Self-contained on purpose (run with
``--noconftest``): only spillover's public API and this module, which no other test file
imports; not conftest.py, which the GPU run does not load. Not collected (no ``test_`` prefix);
pytest's default import mode puts tests/python on sys.path for the files that import it.

Each test records its result as a ``figure`` property; benches/gpu/summary_plugin.py writes it to
the run's summary.md.
"""

from __future__ import annotations

import gc
import os
import time

# cuBLAS reads this once, when it first makes a handle: set before any CUDA work (run.sh
# exports it as well).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402

import spillover  # noqa: E402
from spillover import _pools  # noqa: E402
from spillover.models import GPT, GPTConfig, synthetic_batch  # noqa: E402

CUDA = torch.cuda.is_available()
DRY = not CUDA and os.environ.get("GPU_DRY_RUN") == "1"
DEV = torch.device("cuda" if CUDA else "cpu")
MiB, GiB = 1 << 20, 1 << 30

# Each test file: pytestmark = MARKS.
MARKS = [
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
    return int(v) if v is not None else _pools.host_pool(ctx.config).stats()["in_use"]


def drain(ctx, seconds: float = 5.0):
    """Wait (bounded) until the context's pool has every block back; returns (in use, waited s).
    Copies and writes still finishing hold their blocks for a moment (Note [sources held] in
    rust/link/mod.rs)."""
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


__all__ = [
    "CUDA", "DEV", "DRY", "GiB", "MARKS", "MiB", "deterministic", "differing", "drain", "figure",
    "fmt", "gpt", "grads", "need_cuda", "nvme_dir", "offload", "pool_bytes", "pool_in_use",
    "step", "sync",
]
