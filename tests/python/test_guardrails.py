"""The guardrails (Note [guardrails] in activations/guardrails.py): each fires once per process in
the situation it names, naming the knob, and not in a normal run; ``report()`` says where a step's
memory went."""

import re
import warnings

import pytest
import torch
from conftest import assert_bitwise, gpt_step

import spillover
from spillover import _runtime
from spillover import calibrate as _calibrate
from spillover.activations.link import device as _device

#: A distinctive phrase of each guardrail's message.
POOL_FULL = "host pool was full"
OTHERS = "was held by others"
COMPILED = "compiled region"
SLOW = "calibrated bandwidths"
ALL = (POOL_FULL, OTHERS, COMPILED, SLOW)

FAST_CALIBRATION = {
    "version": 1,
    "devices": {"cpu": {"d2h_bytes_per_s": 1e12, "h2d_bytes_per_s": 1e12}},
    "nvme_write_bytes_per_s": 1e12,
    "nvme_read_bytes_per_s": 1e12,
}


@pytest.fixture
def caught(monkeypatch):
    """Every warning issued in the test; the guardrails' once-per-process memory starts empty
    (other tests in this process may have tripped them already)."""
    monkeypatch.setattr(_runtime, "_warned", set())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        yield record


def fired(record, phrase):
    return [str(w.message) for w in record if phrase in str(w.message)]


def assert_quiet(record):
    for phrase in ALL:
        assert not fired(record, phrase), fired(record, phrase)


def small_pool(private_pool_bytes, mib):
    return (mib << 20) + private_pool_bytes % (1 << 16)


#: Roomy for the tiny GPT; one capacity for the file (pools are kept per capacity).
ROOMY = (64 << 20) + 6 * 4096


# ---- a normal run -----------------------------------------------------------------------------


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_normal_run_is_quiet(tier, tiny_gpt, caught, monkeypatch, tmp_path):
    monkeypatch.setattr(_calibrate, "load", lambda cfg=None: FAST_CALIBRATION)
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    ctx = spillover.offload_context(tier, min_offload_bytes=0,
                                    host_pool_bytes=ROOMY, nvme_path=str(tmp_path))
    for _ in range(3):
        assert_bitwise(ref, gpt_step(model, batch, ctx))
    assert ctx.stats().bytes_offloaded > 0
    assert_quiet(caught)
    assert "warnings:" not in ctx.report()


# ---- (a) the pool filled --------------------------------------------------------------------


def test_pool_full_fires_once(tiny_gpt, caught, private_pool_bytes):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    ctx = spillover.offload_context("host", min_offload_bytes=0,
                                    host_pool_bytes=small_pool(private_pool_bytes, 1))
    for _ in range(3):
        assert_bitwise(ref, gpt_step(model, batch, ctx))
    kept = ctx.stats().bytes_kept_pool_full
    assert kept > 0
    msgs = fired(caught, POOL_FULL)
    assert len(msgs) == 1, msgs
    assert "SPILLOVER_HOST_POOL_BYTES" in msgs[0] and "MiB" in msgs[0]
    assert not fired(caught, OTHERS)
    report = ctx.report()
    assert POOL_FULL in report  # each step lists what it tripped
    line = next(ln for ln in report.splitlines() if ln.strip().startswith("pool full"))
    assert spillover.format_size(kept) in line
    assert "(in 3 steps)" in ctx.report(total=True)  # all three steps tripped it


# ---- (b) others took the room --------------------------------------------------


def test_others_in_the_pool_fires_once(caught, private_pool_bytes):
    """16 MiB of the 24 MiB activation pool leased by someone else leaves 8 MiB for 12 MiB of
    activations; OffloadAdamW(tier="host") with the same size no longer counts: its state has a
    pool of its own (Note [node budget])."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                torch.nn.Linear(1024, 1024))
    pool = small_pool(private_pool_bytes, 24)
    opt = spillover.OffloadAdamW(model.parameters(), lr=1e-3, tier="host", host_pool_bytes=pool,
                                 chunk_bytes=1 << 20)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=pool)
    x = torch.randn(1024, 1024)

    def steps(n):
        for _ in range(n):
            with ctx:
                loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

    steps(2)  # the optimizer's 16 MiB of state is not in the activation pool
    assert ctx.stats().bytes_kept_pool_full == 0
    assert opt.stats()["state_bytes"] >= 16 << 20 and opt.stats()["heap_chunks"] == 0
    assert not fired(caught, OTHERS) and not fired(caught, POOL_FULL)
    act_pool = spillover._pools.host_pool(spillover.Config.load(host_pool_bytes=pool))
    hog = [act_pool.lease(1 << 20) for _ in range(16)]
    steps(3)
    assert ctx.stats().bytes_kept_pool_full > 0
    msgs = fired(caught, OTHERS)
    assert len(msgs) == 1, msgs
    assert "SPILLOVER_HOST_POOL_BYTES" in msgs[0]
    assert not fired(caught, POOL_FULL)  # the activations would have fit without the hog
    assert OTHERS in ctx.report()
    del hog


# ---- (c) a compiled region unpacks everything at once -----------------------------------------


def compiled_fn():
    w = torch.randn(256, 256, requires_grad=True)

    def f(x):
        h = x @ w
        h = h.sin() * h.cos()
        h = (h @ w).tanh()
        return (h @ w).sigmoid().sum()

    return f, w


def test_compiled_region_fires_once(caught):
    f, w = compiled_fn()
    x = torch.randn(256, 256, requires_grad=True)
    f(x).backward()
    ref = [x.grad.clone(), w.grad.clone()]
    cf = torch.compile(f, backend="aot_eager")
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=ROOMY)
    for _ in range(3):
        x.grad = w.grad = None
        with ctx:
            loss = cf(x)
        loss.backward()
        assert_bitwise(ref, [x.grad, w.grad])
    if ctx.stats().bytes_offloaded == 0:
        pytest.skip("this torch does not run saved-tensor hooks on compiled graphs")
    msgs = fired(caught, COMPILED)
    assert len(msgs) == 1, msgs
    assert "CompiledFunction" in msgs[0] and "torch.compile each" in msgs[0]
    assert COMPILED in ctx.report()


def test_eager_region_does_not_fire(caught):
    f, w = compiled_fn()
    x = torch.randn(256, 256, requires_grad=True)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=ROOMY)
    for _ in range(2):
        with ctx:
            loss = f(x)
        loss.backward()
    assert ctx.stats().bytes_offloaded > 0
    assert_quiet(caught)


# ---- (d) slower than calibration --------------------------------------------------------------


@pytest.fixture
def slow_link(monkeypatch):
    """A simulated link of 1 TB/s -- what the fake calibration says -- whose every copy takes
    150 ms longer (latency), and a cap of copies in flight so small that every pack waits for
    the copy before it: the link runs far below its calibration. (On a plain CPU host pack
    copies at once and nothing waits for a link: Note [host link] in activations/hooks.py.)"""
    real = _device._native.Link

    def slow(kind, **kw):
        return real(kind, **{**kw, "latency": 0.15})

    monkeypatch.setattr(_device._native, "Link", slow)
    return dict(sim_link_bandwidth=1e12, copy_inflight_bytes=4096)


def test_slower_than_calibration_fires_once(tiny_gpt, caught, monkeypatch, slow_link):
    monkeypatch.setattr(_calibrate, "load", lambda cfg=None: FAST_CALIBRATION)
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=ROOMY,
                                    **slow_link)
    for _ in range(3):
        assert_bitwise(ref, gpt_step(model, batch, ctx))
    assert ctx.stats().stall_seconds > 0.1
    msgs = fired(caught, SLOW)
    assert len(msgs) == 1, msgs
    assert "python -m spillover bench --force" in msgs[0]
    assert SLOW in ctx.report()


def test_no_calibration_no_speed_check(tiny_gpt, caught, monkeypatch, slow_link):
    monkeypatch.setattr(_calibrate, "load", lambda cfg=None: None)
    model, batch = tiny_gpt
    ctx = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes=ROOMY,
                                    **slow_link)
    # a device link with no bandwidth of its own (CUDA's): only a calibration gives its rate
    monkeypatch.setattr(ctx._transfer(torch.device("cpu")), "sim_bandwidth", None)
    gpt_step(model, batch, ctx)
    assert ctx.stats().stall_seconds > 0.1
    assert not fired(caught, SLOW)


# ---- report() ---------------------------------------------------------------------------------


def test_report_names_every_category(tiny_gpt, tmp_path, private_pool_bytes):
    model, (idx, tgt) = tiny_gpt
    ctx = spillover.offload_context("nvme", min_offload_bytes="64KiB",
                                    host_pool_bytes=small_pool(private_pool_bytes, 1),
                                    nvme_path=str(tmp_path))
    assert "no step yet" in ctx.report()
    model.zero_grad(set_to_none=True)
    with ctx:
        x = spillover.keep(model.tok(idx) + model.pos(torch.arange(idx.shape[1])))
        for block in model.blocks:
            x = block(x)
        loss = torch.nn.functional.cross_entropy(
            model.head(model.ln_f(x)).flatten(0, 1), tgt.flatten())
    ctx._tier.spill_all()  # every entry on disk only: backward reads them back
    loss.backward()
    s = ctx.stats()
    assert s.bytes_kept_small and s.bytes_kept_parameter and s.bytes_kept_marked, s
    assert s.bytes_offloaded_nvme > 0 and s.prefetch_hits + s.prefetch_misses > 0, s
    r = ctx.report()
    assert r.startswith("spillover: step 1 on the nvme tier")
    for word in ("offloaded:", "host", "nvme", "kept on the device", "small", "parameter",
                 "marked", "pool full", "unsupported", "stalls", "prefetch hits"):
        assert word in r, (word, r)
    assert spillover.format_size(s.bytes_kept_marked) in r
    total = ctx.report(total=True)
    assert total.startswith("spillover: 1 step on the nvme tier")


def test_report_shares_add_up_and_auto_says_what_it_chose(tiny_gpt, tmp_path):
    """Offloaded, kept and views of storages saved already: three shares of one whole, adding
    up to 100 % (the views' bytes were counted inside the total and outside every share: 93 %
    once); tier="auto" names the tier it chose."""
    model, (idx, tgt) = tiny_gpt
    ctx = spillover.offload_context("auto", min_offload_bytes=0, nvme_path=str(tmp_path),
                                    host_pool_bytes="16MiB")
    assert "auto tier (not chosen yet)" in ctx.report(total=True)
    model.zero_grad(set_to_none=True)
    with ctx:
        loss = model(idx, tgt)
    loss.backward()
    s = ctx.stats()
    assert s.storages_deduplicated > 0 and s.bytes_offloaded > 0, s
    r = ctx.report()
    assert r.startswith("spillover: step 1 on the auto tier (chose nvme: "), r
    shares = [int(x) for x in re.findall(r"\((\d+)%\)", r)]
    assert len(shares) == 3 and sum(shares) == 100, r
    assert "views of storages saved already" in r
