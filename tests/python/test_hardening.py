"""Hardening: fork, signals, refused io_uring and memlock, swap-file privacy, hostile paths,
and property tests over shapes, strides and dtypes."""

import gc
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import assert_bitwise, drained, gpt_step
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spillover

HERE = os.path.dirname(os.path.abspath(__file__))


def run_py(code, *, env=None, prefix=(), timeout=120):
    full_env = dict(os.environ, PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.update(env or {})
    return subprocess.run(
        [*prefix, sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, timeout=timeout, env=full_env,
    )


STEP = """
import warnings, torch, spillover
from spillover.models import GPT, GPTConfig, synthetic_batch
torch.manual_seed(0)
cfg = GPTConfig(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64)
model, (idx, tgt) = GPT(cfg), synthetic_batch(cfg, 4)
def grads(ctx=None):
    model.zero_grad(set_to_none=True)
    if ctx is None:
        model(idx, tgt).backward()
    else:
        with ctx:
            loss = model(idx, tgt)
        loss.backward()
    return [p.grad.clone() for p in model.parameters()]
"""


def test_io_uring_refused_by_seccomp_falls_back_with_one_warning(tmp_path):
    r = run_py(STEP + f"""
from _seccomp import refuse_io_uring
ref = grads()
refuse_io_uring()
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    got = []
    for _ in range(2):
        c = spillover.offload_context("nvme", nvme_path={str(tmp_path)!r},
                                      host_pool_bytes=(1 << 20) + 8192, min_offload_bytes=0)
        got.append(grads(c))
msgs = [str(x.message) for x in w if "io_uring" in str(x.message)]
assert len(msgs) == 1, msgs
assert spillover._tiers.opened_swap(c.config).engine == "threads"
assert c.stats().bytes_offloaded_nvme > 0
assert all(torch.equal(a, b) for g in got for a, b in zip(ref, g))
print("OK", msgs[0])
""")
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout and "Operation not permitted" in r.stdout, r.stdout


def test_memlock_refused_pool_works_unlocked_and_doctor_says_what_to_raise(tmp_path):
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to drop CAP_IPC_LOCK")
    prefix = ["prlimit", "--memlock=8388608:8388608", "setpriv",
              "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock", "--"]
    r = run_py(STEP + """
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    ref = grads()
    got = grads(spillover.offload_context("host", host_pool_bytes="64MiB", min_offload_bytes=0))
    got2 = grads(spillover.offload_context("host", host_pool_bytes="64MiB", min_offload_bytes=0))
msgs = [str(x.message) for x in w if "RLIMIT_MEMLOCK" in str(x.message)]
assert len(msgs) == 1, msgs
assert all(torch.equal(a, b) for a, b in zip(ref, got))
print("OK", msgs[0])
""", prefix=prefix)
    assert r.returncode == 0, r.stderr
    assert "ulimit -l" in r.stdout
    d = subprocess.run([*prefix, sys.executable, "-m", "spillover", "doctor",
                        "--probe-seconds", "0"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, SPILLOVER_HOST_POOL_BYTES="1GiB"))
    assert "RLIMIT_MEMLOCK is 8.0 MiB" in d.stdout and "ulimit -l unlimited" in d.stdout, d.stdout


def test_fork_child_does_not_touch_the_engine(tmp_path):
    # The parent has a live swap engine; children fork, one offloads on its own, one exits
    # through normal interpreter shutdown (which once would have joined the parent's threads).
    r = run_py(STEP + f"""
import os, sys
kw = dict(nvme_path={str(tmp_path)!r}, host_pool_bytes=(1 << 20) + 8192, min_offload_bytes=0)
ref = grads()
c = spillover.offload_context("nvme", **kw)
with c:
    loss = model(idx, tgt)          # a step in flight in the parent while we fork
pid = os.fork()
if pid == 0:
    torch.set_num_threads(1)  # torch's OpenMP pool does not survive fork (DataLoader does this)
    mine = grads()
    got = grads(spillover.offload_context("nvme", **kw))
    ok = all(torch.equal(a, b) for a, b in zip(mine, got))
    os._exit(0 if ok else 3)
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
pid = os.fork()
if pid == 0:
    sys.exit(0)                      # normal shutdown: finalizers run in the child
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
model.zero_grad(set_to_none=True)
loss.backward()                      # the parent's step is unaffected
assert all(torch.equal(a, p.grad) for a, p in zip(ref, model.parameters()))
print("OK")
""", timeout=120)
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout


def test_dataloader_workers_fork_inside_a_context(tiny_gpt, tmp_path):
    model, (idx, tgt) = tiny_gpt
    ref = gpt_step(model, (idx, tgt))
    ds = torch.utils.data.TensorDataset(idx, tgt)
    ctx = torch.multiprocessing.get_context("fork")
    c = spillover.offload_context("nvme", nvme_path=str(tmp_path), min_offload_bytes=0,
                                  host_pool_bytes=(1 << 20) + 12288)
    model.zero_grad(set_to_none=True)
    with c:
        loader = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2,
                                             multiprocessing_context=ctx)
        (bi, bt), = list(loader)
        loss = model(bi, bt)
    loss.backward()
    assert_bitwise(ref, [p.grad for p in model.parameters()])


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_keyboard_interrupt_leaves_nothing_behind(tiny_gpt, tmp_path, private_pool_bytes, where):
    model, batch = tiny_gpt
    pool = (1 << 20) + private_pool_bytes % (1 << 18)
    kw = dict(nvme_path=str(tmp_path), host_pool_bytes=pool, min_offload_bytes=0)

    def interrupt(*_):
        raise KeyboardInterrupt

    def step():  # its locals (the graph) go away with its frame, as in a training loop
        c = spillover.offload_context("nvme", **kw)
        if where == "forward":
            h = model.blocks[1].register_forward_pre_hook(interrupt)
            try:
                with c:
                    model(*batch)
            finally:
                h.remove()
        else:
            with c:
                loss = model(*batch)
            h = model.blocks[0].ln1.weight.register_hook(interrupt)
            try:
                loss.backward()
            finally:
                h.remove()

    interrupted = False
    try:
        step()
    except KeyboardInterrupt:
        interrupted = True
    assert interrupted
    gc.collect()
    time.sleep(0.2)
    from spillover import _pools, _tiers

    cfg = spillover.Config.load(tier="nvme", **kw)
    tier = _tiers.tier_for(cfg, _pools.host_pool(cfg), nvme=True)
    tier.wait_idle()
    gc.collect()
    assert os.listdir(tmp_path) == []  # swap files never have a name
    # An interrupted backward can leave the autograd engine holding a little of that graph
    # (a few small saved tensors: pool blocks or swap slots) for a while; nothing more may stay.
    left, left_swap = tier.stats()["pool_in_use"], tier.stats()["swap_in_use"]
    assert left <= 64 << 10 and left_swap <= 64 << 10, tier.stats()
    gpt_step(model, batch, spillover.offload_context("nvme", **kw))  # the next step works
    gc.collect()
    tier.wait_idle()
    # What the interrupted step left is not added to: the next step frees all of its own.
    assert tier.stats()["pool_in_use"] <= left, (left, tier.stats())
    assert tier.stats()["swap_in_use"] <= left_swap


def test_swap_files_are_private_and_gone_after_sigkill(tmp_path):
    code = STEP + f"""
import os, stat, time
c = spillover.offload_context("nvme", nvme_path={str(tmp_path)!r},
                              host_pool_bytes=(1 << 20) + 16384, min_offload_bytes=0)
with c:
    loss = model(idx, tgt)
modes = []
for fd in os.listdir("/proc/self/fd"):
    target = os.readlink(f"/proc/self/fd/{{fd}}") if os.path.islink(f"/proc/self/fd/{{fd}}") else ""
    if target.startswith({str(tmp_path)!r}):
        modes.append(stat.S_IMODE(os.fstat(int(fd)).st_mode))
print("MODES", modes, flush=True)
time.sleep(60)
"""
    full_env = dict(os.environ, PYTHONPATH=HERE)
    p = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=full_env)
    line = p.stdout.readline()
    try:
        assert line.startswith("MODES"), (line, p.stderr.read() if p.poll() is not None else "")
        modes = eval(line.split(" ", 1)[1])
        assert modes and all(m & 0o077 == 0 for m in modes), modes
        assert os.listdir(tmp_path) == []  # O_TMPFILE or unlinked: no name while running
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    assert os.listdir(tmp_path) == []


def test_hostile_swap_paths(tmp_path):
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    cases = [(str(open_dir), "world-writable"), ("/proc", "kernel file system")]
    for path, msg in cases:
        with pytest.raises(spillover.ConfigError, match=msg), spillover.offload_context(
            "nvme", nvme_path=path, host_pool_bytes=(1 << 20) + 20480
        ):
            pass
    os.chmod(open_dir, 0o1777)  # sticky, like /tmp: accepted
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "link"
    link.symlink_to(real)  # followed: the swap file lives in the real directory
    for path in (open_dir, link):
        c = spillover.offload_context(
            "nvme", nvme_path=str(path), host_pool_bytes=(1 << 20) + 20480
        )
        with c:
            pass
        swap = spillover._tiers.opened_swap(c.config)
        assert [os.path.realpath(d) for d in swap.dirs] == [os.path.realpath(path)]


def test_handles_of_one_context_never_resolve_in_another():
    a, b = (spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="64MiB")
            for _ in range(2))
    x = torch.arange(1 << 18, dtype=torch.float32)
    y = torch.arange(1 << 18, dtype=torch.float32).flip(0)
    with a:
        ha = a.pack(x * 1)
    with b:
        hb = b.pack(y * 1)
    assert torch.equal(b.unpack(ha), x) and torch.equal(a.unpack(hb), y)
    assert ha.stored is not hb.stored


DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int8, torch.int64,
          torch.bool, torch.uint8, torch.complex64]


@st.composite
def views(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = draw(st.lists(st.integers(0, 9), min_size=0, max_size=4))
    base = (torch.randint(0, 100, shape) if not dtype.is_floating_point and not dtype.is_complex
            else torch.randn(shape, dtype=torch.float64)).to(dtype)
    t = base
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["t", "slice", "expand", "step", "none"]))
        if kind == "t" and t.dim() >= 2:
            t = t.transpose(0, t.dim() - 1)
        elif kind == "slice" and t.dim() >= 1 and t.shape[0] > 1:
            t = t[draw(st.integers(1, t.shape[0] - 1)):]
        elif kind == "step" and t.dim() >= 1:
            t = t[:: draw(st.integers(1, 3))]
        elif kind == "expand":
            t = t.unsqueeze(0).expand(draw(st.integers(1, 3)), *t.shape)
    return t


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(views(), st.sampled_from(["host", "nvme"]))
def test_any_view_round_trips_bitwise(t, tier):
    c = spillover.offload_context(tier, min_offload_bytes=0, host_pool_bytes=(8 << 20) + 24576)
    with c:
        h = c.pack(t)
    out = c.unpack(h)
    assert out.dtype == t.dtype and out.shape == t.shape and out.stride() == t.stride()
    assert out.storage_offset() == t.storage_offset()
    assert torch.equal(out, t) or (t.numel() == 0)


def test_huge_but_sparse_view_copies_its_storage_once():
    big = torch.zeros(1 << 22)  # 16 MiB storage
    v = big[:: 1 << 12]  # 1024 elements spread over all of it
    c = spillover.offload_context("host", min_offload_bytes=0, host_pool_bytes="64MiB")
    with c:
        h1, h2 = c.pack(v), c.pack(big[5:9])
    assert torch.equal(c.unpack(h1), v) and torch.equal(c.unpack(h2), big[5:9])
    assert c.stats().storages_deduplicated == 1


@pytest.mark.parametrize("change", ["removed", "read-only"])
def test_swap_dir_removed_or_read_only_mid_run(tiny_gpt, tmp_path, change):
    # The swap file is open and nameless, so the running tier keeps working (a stated
    # fallback: nothing to do); an engine opened afterwards on that path fails at entry.
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    d = tmp_path / "swap"
    d.mkdir()
    kw = dict(nvme_path=str(d), min_offload_bytes=0)
    assert_bitwise(ref, gpt_step(model, batch, spillover.offload_context(
        "nvme", host_pool_bytes=(1 << 20) + 45056, **kw)))
    # (made before the change: a context made after it is refused at construction)
    c = spillover.offload_context("nvme", host_pool_bytes=(1 << 20) + 45056, **kw)
    if change == "removed":
        d.rmdir()
    else:
        os.chmod(d, 0o500)
    assert_bitwise(ref, gpt_step(model, batch, c))
    assert c.stats().bytes_offloaded_nvme > 0
    if os.geteuid() == 0 and change == "read-only":
        return  # root writes through a read-only mode; the refusal below cannot be seen
    msg = "does not exist" if change == "removed" else "not writable"
    # Another I/O shape needs an engine of its own, whose files would be made in that directory
    # (one with this shape is open already and keeps working: its files have no name).
    with pytest.raises(spillover.ConfigError, match=msg), spillover.offload_context(
        "nvme", host_pool_bytes=(1 << 20) + 49152, io_block_bytes=512 << 10, **kw
    ):
        pass


from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402


class StoreMachine(RuleBasedStateMachine):
    """Random put / get / evict / free sequences against the NVMe store: every get returns
    the exact bytes put, and when every handle is gone nothing stays in the pool or swap."""

    def __init__(self):
        super().__init__()
        import tempfile

        self.dir = tempfile.mkdtemp()
        self.ctx = spillover.offload_context(
            "nvme", nvme_path=self.dir, host_pool_bytes=(1 << 20) + 53248, min_offload_bytes=0,
            io_engine="threads",
        )
        self.ctx.__enter__()
        self.live = []
        self.n = 0

    # Up to 1.2 MiB against a 1.05 MiB pool: storages above half the pool go in pieces.
    @rule(kib=st.integers(1, 1200), dtype=st.sampled_from([torch.float32, torch.int16]))
    def put(self, kib, dtype):
        self.n += 1
        t = torch.arange(kib * 1024 // 4, dtype=torch.float32).mul_(self.n).to(dtype)
        self.live.append((self.ctx.pack(t), t.clone()))

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def get(self, i):
        h, expect = self.live[i % len(self.live)]
        assert torch.equal(self.ctx.unpack(h), expect)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10**6))
    def free(self, i):
        self.live.pop(i % len(self.live))

    @rule()
    def evict(self):
        self.ctx.synchronize()
        self.ctx._tier.spill_all()

    @invariant()
    def pool_within_capacity(self):
        s = self.ctx.stats()
        assert s.pool_in_use <= s.pool_capacity

    def teardown(self):
        self.live.clear()
        self.ctx.__exit__(None, None, None)
        assert drained(self.ctx) == (0, 0), self.ctx.stats()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=30,
                                          deadline=None)
test_store_put_get_evict_free_sequences = StoreMachine.TestCase


def test_long_run_bounded():
    """CI's bounded form of benches/python/long_run.py (the full run is 1,000 steps)."""
    script = os.path.join(HERE, "..", "..", "benches", "python", "long_run.py")
    r = subprocess.run([sys.executable, script, "--steps", "60", "--every", "20"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "✓ fds flat" in r.stdout and "✓ pool in use 0" in r.stdout
