"""NVMe tier: gradients bitwise equal with most tensors really on disk, both engines,
striping, prefetch, errors (bad paths at entry, injected EIO, disk full), no growth."""

import gc
import os
import subprocess
import tempfile

import pytest
import torch
from conftest import assert_bitwise, drained, gpt_step

import spillover
from spillover import _native
from spillover._tiers import opened_swap

ENGINES = ["io_uring", "threads"]


def _uring_ok():
    try:
        p = _native.Pool(1 << 20, lock=False)
        _native.Swap(p, [tempfile.gettempdir()], engine="io_uring")
        return True
    except Exception:
        return False


URING = _uring_ok()


def nvme(tmp_path, engine, pool, **kw):
    if engine == "io_uring" and not URING:
        pytest.skip("io_uring refused on this kernel/container")
    kw.setdefault("min_offload_bytes", 0)
    return spillover.offload_context(
        "nvme", host_pool_bytes=pool, nvme_path=str(tmp_path), io_engine=engine, **kw
    )


@pytest.mark.parametrize("engine", ENGINES)
def test_gpt_parity_with_most_tensors_on_disk(tiny_gpt, tmp_path, engine, private_pool_bytes):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    pool = (5 << 18) + private_pool_bytes % (1 << 18)  # far smaller than the activations
    for _ in range(3):
        c = nvme(tmp_path, engine, pool)
        assert_bitwise(ref, gpt_step(model, batch, c))
        s = c.stats()
        assert s.bytes_offloaded_nvme > s.bytes_offloaded_host, s
        assert s.prefetch_hits + s.prefetch_misses > 0
    assert opened_swap(c.config).engine == engine


def test_views_retain_graph_and_bf16_on_disk(tiny_gpt, tmp_path):
    model, (idx, tgt) = tiny_gpt
    model = model.to(torch.bfloat16)
    model.zero_grad()
    loss = model(idx, tgt)
    loss.backward(retain_graph=True)
    loss.backward()
    ref = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    c = nvme(tmp_path, "threads", 5 << 18)
    with c:
        loss = model(idx, tgt)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_bitwise(ref, [p.grad for p in model.parameters()])
    assert c.stats().bytes_offloaded_nvme > 0


def test_two_directories_are_striped(tiny_gpt, tmp_path):
    model, batch = tiny_gpt
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    ref = gpt_step(model, batch)
    c = spillover.offload_context(
        "nvme", host_pool_bytes=(2 << 20) + 8192, nvme_path=f"{a},{b}", min_offload_bytes=0
    )
    assert_bitwise(ref, gpt_step(model, batch, c))
    swap = opened_swap(c.config)
    assert len(swap.dirs) == 2
    assert swap.stats()["bytes_written"] > 0, (c.stats(), swap.stats())


@pytest.mark.parametrize("verify", [False, True])
def test_nvme_verify_round_trip(tiny_gpt, tmp_path, verify):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    c = nvme(tmp_path, "threads", (2 << 20) + 4096 * (2 + verify), verify=verify)
    assert_bitwise(ref, gpt_step(model, batch, c))


def test_bad_paths_fail_at_construction(tmp_path, monkeypatch):
    """Before any step, naming the way the path was given and how to fix it."""
    f = tmp_path / "file"
    f.write_text("x")
    for path, msg in [(tmp_path / "missing", "does not exist"), (f, "is not a directory")]:
        with pytest.raises(spillover.ConfigError, match=f"^nvme_path='{path}' {msg}.*"
                           "pass nvme_path=DIR .or set SPILLOVER_NVME_PATH=DIR."):
            spillover.offload_context("nvme", nvme_path=str(path), host_pool_bytes=5 << 20)
        with pytest.raises(spillover.ConfigError, match=f"^nvme_path='{path}' {msg}"):
            spillover.OffloadAdamW([torch.nn.Parameter(torch.zeros(4))], tier="nvme",
                                   nvme_path=str(path))
    monkeypatch.setenv("SPILLOVER_NVME_PATH", str(tmp_path / "missing"))
    with pytest.raises(spillover.ConfigError, match="^SPILLOVER_NVME_PATH='.*missing' does"):
        spillover.offload_context("auto")
    spillover.offload_context("host")  # a host tier opens no swap


def test_injected_read_error_is_an_exception(tiny_gpt, tmp_path):
    model, (idx, tgt) = tiny_gpt
    c = nvme(tmp_path, "threads", (2 << 20) + 3 * 4096)
    with c:
        loss = model(idx, tgt)
    assert c.stats().bytes_offloaded_nvme > 0
    c.synchronize()
    c._tier.spill_all()  # every entry only on disk: backward must read
    opened_swap(c.config).inject_fault("read", 5, 1)
    with pytest.raises(spillover.SwapIOError) as e:
        loss.backward()
    assert e.value.errno == 5 and "read" in str(e.value)
    del loss
    # the next step works once the cause is gone
    gpt_step(model, (idx, tgt), nvme(tmp_path, "threads", (2 << 20) + 3 * 4096))


def test_injected_write_error_is_an_exception(tiny_gpt, tmp_path):
    model, (idx, tgt) = tiny_gpt
    c = nvme(tmp_path, "threads", (2 << 20) + 5 * 4096)
    with c:  # opens the swap
        pass
    opened_swap(c.config).inject_fault("write", 5, 1)
    c = nvme(tmp_path, "threads", (2 << 20) + 5 * 4096)
    with pytest.raises(spillover.SwapIOError), c:
        model(idx, tgt).backward()


def test_disk_full_names_the_path(tiny_gpt, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a size-limited tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs here: {r.stderr.strip()}")
    try:
        model, (idx, tgt) = tiny_gpt
        c = spillover.offload_context(
            "nvme", nvme_path=str(mnt), host_pool_bytes=(2 << 20) + 7 * 4096,
            min_offload_bytes=0, io_engine="threads",
        )
        with pytest.raises(spillover.OutOfSpaceError) as e, c:
            model(idx, tgt).backward()
        assert str(mnt) in str(e.value)
        gc.collect()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_many_steps_do_not_grow(tiny_gpt, tmp_path, private_pool_bytes):
    model, batch = tiny_gpt
    pool = (7 << 18) + private_pool_bytes % (1 << 18)  # a capacity no other test uses
    fd_dir = f"/proc/{os.getpid()}/fd"
    samples = []
    for i in range(200):
        c = nvme(tmp_path, "threads", pool)
        gpt_step(model, batch, c)
        if i >= 10:
            gc.collect()
            c.synchronize()
            st = c.stats()
            samples.append((len(os.listdir(fd_dir)), st.swap_in_use, st.pool_in_use))
    fds, swap_used, pool_used = zip(*samples)
    # Other threads of the test process may hold a file for a moment; growth is what matters.
    assert max(fds[len(fds) // 2 :]) <= fds[0] + 2, fds
    assert max(swap_used) == 0 and max(pool_used) == 0, samples[-3:]


def _all_to_disk(c):
    """Write every entry out and drop its block (entries a live view sees stay)."""
    c.synchronize()  # pack copies landed: every entry is sealed
    c._tier.spill_all()
    t = c._tier.stats()
    assert t["dirty"] == t["clean"] == t["writing"] == t["reading"] == 0, t


def test_read_back_with_a_full_pool_uses_a_temporary_buffer(tmp_path):
    x = torch.randn(1 << 18, requires_grad=True)  # 1 MiB
    c = nvme(tmp_path, "threads", (2 << 20) + 40960)

    def f():
        h = x * 2.0
        return (h * h).sum()  # saves h (1 MiB) twice: as self and as other

    f().backward()
    ref = x.grad.clone()
    x.grad = None
    with c:
        loss = f()
    _all_to_disk(c)
    hog = c._pool.lease(c._pool.stats()["largest_free"])  # nothing left for the read
    spillover._runtime._warned.discard("pool-overflow")  # warned once per process
    with pytest.warns(RuntimeWarning, match="SPILLOVER_HOST_POOL_BYTES"):
        loss.backward()
    del hog
    assert torch.equal(x.grad, ref)
    assert c.stats().overflow_reads >= 1, c.stats()


@pytest.mark.parametrize("engine", ENGINES)
def test_storage_larger_than_the_pool_goes_in_pieces(tmp_path, engine):
    c = nvme(tmp_path, engine, (1 << 20) + 61440)
    base = torch.randn(769, 1024)  # 3 MiB + 4 KiB: three times the pool, not a whole piece
    views = [base, base.t(), base[3:], base[:, 7:9], base[700:].view(-1)]
    want = [(v.clone(), v.stride(), v.storage_offset()) for v in views]
    with c:
        handles = [c.pack(v) for v in views]
    c.synchronize()  # pieces written from the tensor count once their writes landed
    s = c.stats()
    assert s.tensors_chunked == 1 and s.storages_deduplicated == 4, s
    assert s.bytes_offloaded_nvme > 0 and s.bytes_kept == 0, s
    for _ in range(2):  # read back twice, as a retained graph does
        for h, (v, stride, offset) in zip(handles, want):
            out = c.unpack(h)
            assert torch.equal(out, v) and out.stride() == stride
            assert out.storage_offset() == offset
    del handles, h, out
    assert drained(c) == (0, 0)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("verify", [False, True])
def test_chunked_storage_is_read_straight_into_its_tensor(tmp_path, engine, verify,
                                                          private_pool_bytes):
    """Note [gathered storages]: pieces on disk go from their slots into the unpacked
    tensor's own buffer, through no pool block; the pieces still in the pool are copied."""
    pool = (1 << 20) + private_pool_bytes % (1 << 16)
    c = nvme(tmp_path, engine, pool, verify=verify)
    big = torch.randn(3 << 18)  # 3 MiB: three times the pool
    with c:
        h = c.pack(big)
        h2 = c.pack(big[5:])
    _all_to_disk(c)
    c._pool.reset_peak()
    in_use = c._pool.stats()["in_use"]
    out = c.unpack(h)
    assert torch.equal(out, big)
    assert c._pool.stats()["peak"] == in_use  # no piece went through the pool
    # In no pool of the process (pools now come and go: the span from the first to the last
    # can hold a one-off mapping made between them).
    assert not any(a <= out.data_ptr() < b for a, b in c._pool_ranges)
    s = c.stats()
    assert s.tensors_chunked == 1, s
    assert s.prefetch_hits + s.prefetch_misses == len(h.stored.entry.parts), s
    # The other view's unpack shares the gathered bytes (Note [views share one return]).
    out2 = c.unpack(h2)
    assert torch.equal(out2, big[5:]) and out2.untyped_storage().data_ptr() == out.data_ptr()
    n = c.stats().prefetch_hits + c.stats().prefetch_misses
    assert n == len(h.stored.entry.parts), c.stats()
    # A second backward (a retained graph) gathers again, with one piece back in the pool.
    part = h.stored.entry.parts[0]
    blk = part.get()
    del blk, out, out2
    assert torch.equal(c.unpack(h2), big[5:])
    assert c.stats().prefetch_hits + c.stats().prefetch_misses > n + 1
    del h, h2, part
    assert drained(c) == (0, 0)


def test_chunked_storage_is_read_ahead_when_it_is_next(tmp_path, private_pool_bytes):
    """Note [gathered storages]: in the learned order, the reads of a chunked storage start
    once what comes before it has been unpacked -- not before."""
    pool = (1 << 20) + private_pool_bytes % (1 << 16)
    first, small, big = torch.randn(1 << 16), torch.randn(1 << 16), torch.randn(3 << 18)
    for step in range(2):  # the first teaches the unpack order: small, big, first
        c = nvme(tmp_path, "threads", pool)
        with c:
            hf, hs, hb = c.pack(first), c.pack(small), c.pack(big)
        _all_to_disk(c)
        if step == 0:
            for h in (hs, hb, hf):
                c.unpack(h)
            continue
        g = hb.stored.entry
        assert not g.started
        assert torch.equal(c.unpack(hs), small)
        assert g.started  # its reads started, not waited for
        c.synchronize()
        assert torch.equal(c.unpack(hb), big)
        s = c.stats()
        assert s.prefetch_hits >= len(g.parts), s
        assert not g.started
        assert torch.equal(c.unpack(hf), first)
    del hf, hs, hb, h, g
    assert drained(c) == (0, 0)


def test_a_chunked_storage_is_not_read_ahead_while_another_is_held(tmp_path,
                                                                   private_pool_bytes):
    """Note [gathered storages]: one gathered buffer at a time. The next chunked storage's
    reads start only once the one before it is no longer held: read ahead straight into its
    buffer while the explicit GPT's softmax backward still held the current probabilities,
    the next ones raised the step's peak by their size."""
    pool = (1 << 20) + private_pool_bytes % (1 << 16)
    big1, s1, s2, big2 = (torch.randn(3 << 18), torch.randn(1 << 16), torch.randn(1 << 16),
                          torch.randn(3 << 18))
    for step in range(2):  # the first teaches the unpack order: big2, s2, s1, big1
        c = nvme(tmp_path, "threads", pool)
        with c:
            hs = [c.pack(t) for t in (big1, s1, s2, big2)]
        _all_to_disk(c)
        if step == 0:
            for h in reversed(hs):
                c.unpack(h)
            continue
        g1 = hs[0].stored.entry
        out = c.unpack(hs[3])
        assert torch.equal(out, big2)
        assert torch.equal(c.unpack(hs[2]), s2)
        assert not g1.started, "read ahead while another gathered storage is held"
        del out
        gc.collect()
        assert torch.equal(c.unpack(hs[1]), s1)
        assert g1.started  # its reads started once big2's buffer was let go
        assert torch.equal(c.unpack(hs[0]), big1)
    del hs, h, g1
    assert drained(c) == (0, 0)


def test_entries_are_written_early_and_dropped_without_waiting(tmp_path, private_pool_bytes):
    """Note [write early, drop late]: past a quarter of the pool unwritten, entries are written
    behind and keep their blocks; a lease that needs room drops written ones at once. (Copied
    into the pool, not written from the tensors: Note [written from the tensor].)"""
    pool = (1 << 20) + private_pool_bytes % (1 << 16)
    c = nvme(tmp_path, "threads", pool, write_from_tensor=False)
    xs = [torch.randn(1 << 15) for _ in range(6)]  # 128 KiB each: 3/4 of the pool in all
    hs = []
    with c:
        for x in xs:
            hs.append(c.pack(x))
            c.synchronize()  # its copy done: the next pack may write it behind
    c.synchronize()  # the writes started finish: their entries are clean, still in the pool
    entries = [h.stored.entry for h in hs]
    assert all(e.residency in ("dirty", "clean") for e in entries)
    assert sum(e.residency == "clean" for e in entries) >= 3  # written, still in the pool
    assert sum(e.nbytes for e in entries if e.residency == "dirty") <= c._tier.dirty_bytes
    stall = c.stats().stall_seconds
    blk = c._step.put(512 << 10)  # more than is free: two written entries make room
    assert c.stats().stall_seconds == stall
    assert [e.residency for e in entries[:2]] == ["disk", "disk"]
    del blk
    for h, x in zip(hs, xs):
        assert torch.equal(c.unpack(h), x)
    del hs, h, entries
    assert drained(c) == (0, 0)


def test_learned_order_is_dropped_when_the_step_packs_other_tensors(tmp_path,
                                                                    private_pool_bytes):
    """The unpack order taught by the last step is used only if this step packed tensors of the
    same sizes in the same order; otherwise (a new plan, another model) reverse pack order."""
    pool = (1 << 20) + private_pool_bytes % (1 << 16)
    a, b, c3 = torch.randn(1 << 14), torch.randn(1 << 15), torch.randn(1 << 16)

    def step(tensors, unpack_order):
        c = nvme(tmp_path, "threads", pool)
        with c:
            hs = [c.pack(t) for t in tensors]
        first = hs[unpack_order[0]].stored.entry.seq
        expected = c._step.expected_after(first, 100)
        for i in unpack_order:
            c.unpack(hs[i])
        return expected

    assert step([a, b, c3], [1, 0, 2]) == [0]  # no order learned yet: reverse pack order
    assert step([a, b, c3], [1, 0, 2]) == [0, 2]  # taught by the step before
    assert step([b, a, c3], [1, 0, 2]) == [0]  # other sizes packed: reverse pack order again
    assert step([b, a, c3], [1, 0, 2]) == [0, 2]  # taught by the step before


@pytest.mark.parametrize("engine", ENGINES)
def test_gpt_parity_with_tensors_larger_than_half_the_pool(tiny_gpt, tmp_path, engine):
    model, batch = tiny_gpt
    ref = gpt_step(model, batch)
    for _ in range(2):  # the second step prefetches in the learned order
        c = nvme(tmp_path, engine, (384 << 10) + 12288)
        assert_bitwise(ref, gpt_step(model, batch, c))
        s = c.stats()
        assert s.tensors_chunked > 0 and s.bytes_offloaded_nvme > 0 and s.bytes_kept_pool_full == 0
    del c
    model.zero_grad(set_to_none=True)
    c = nvme(tmp_path, engine, (384 << 10) + 12288)
    with c:
        loss = model(*batch)
    loss.backward(retain_graph=True)
    first = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    loss.backward()
    assert_bitwise(first, [p.grad for p in model.parameters()])
    assert_bitwise(ref, first)
    del loss
    assert drained(c) == (0, 0)
