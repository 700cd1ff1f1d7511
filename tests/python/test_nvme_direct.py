"""NVMe tier on a CPU host: saved storages written to disk from their own memory (Note [written
from the tensor] in rust/tier/direct.rs): held until written and released then, never copied
into the pool, read back bitwise from an address inside their first page; what backward needs
first stays in the pool; SPILLOVER_WRITE_FROM_TENSOR=0 copies as before."""

import gc

import pytest
import torch
from conftest import assert_bitwise, drained, gpt_step
from torch.multiprocessing.reductions import StorageWeakRef

import spillover


def nvme(tmp_path, private, **kw):
    """A context on a pool of its own (a pool of a capacity is shared in a process, with the
    blocks other contexts still hold): 4 MiB less 4 to 68 KiB -- never 4 MiB, which other tests
    use -- so that three 1 MiB storages fill it."""
    pool = (4 << 20) - 4096 - private % (1 << 16)
    return spillover.offload_context("nvme", host_pool_bytes=pool, nvme_path=str(tmp_path),
                                     io_engine="threads", **kw)


def test_torch_places_large_storages_off_the_page_grid():
    """Why the entry's block is the image of its pages: O_DIRECT cannot write from where torch
    puts a storage. Mapped on their own, large storages start 64 bytes into a page; once glibc
    has raised its mmap threshold (after other tests freed large blocks) they come from the heap,
    16-byte aligned, and one in 32 lands on 512 bytes by chance (CI saw one). So: of eight live
    ones, not all are aligned."""
    xs = [torch.empty((8 << 20) + 4096 * i, dtype=torch.uint8) for i in range(8)]
    assert any(x.data_ptr() % 512 for x in xs), [x.data_ptr() % 4096 for x in xs]


def _fill(c):
    """Three 1 MiB storages: the pool of `nvme` has no room to spare after them (each takes a
    page more, the image of its pages), so the next pack writes from the tensor."""
    fillers = [torch.randn(1 << 18) for _ in range(3)]
    return [c.pack(x) for x in fillers], fillers


@pytest.mark.parametrize("verify", [False, True])
def test_a_storage_is_held_until_written_then_released(tmp_path, verify, private_pool_bytes):
    c = nvme(tmp_path, private_pool_bytes, verify=verify)
    x = torch.randn(1 << 18)  # 1 MiB, 64 bytes into a page
    ref = x.clone()
    weak = StorageWeakRef(x.untyped_storage())
    with c:
        kept, fillers = _fill(c)
        in_pool = c.stats().pool_in_use
        h = c.pack(x)
    del x
    c.synchronize()  # the write landed
    gc.collect()
    assert weak.expired(), "the tier still holds the storage after its write landed"
    assert h.stored.entry.residency == "disk"
    assert [k.stored.entry.residency for k in kept] != ["disk"] * 3  # copied, kept in the pool
    assert c.stats().pool_in_use == in_pool, "a storage written from its memory used the pool"
    assert torch.equal(c.unpack(h), ref)
    for k, f in zip(kept, fillers):
        assert torch.equal(c.unpack(k), f)
    del h, kept, k
    assert drained(c) == (0, 0)


def test_with_room_to_spare_the_storage_is_copied(tmp_path, private_pool_bytes):
    """The pool first: a pool with room keeps the bytes (no read back), the storage goes."""
    c = nvme(tmp_path, private_pool_bytes)
    x = torch.randn(1 << 18)
    ref = x.clone()
    weak = StorageWeakRef(x.untyped_storage())
    with c:
        h = c.pack(x)
    del x
    gc.collect()
    assert weak.expired(), "copied into the pool: nothing holds the storage"
    assert h.stored.entry.residency in ("dirty", "writing", "clean")
    assert torch.equal(c.unpack(h), ref)
    del h
    assert drained(c) == (0, 0)


def test_switched_off_the_storage_is_copied_and_released_at_once(tmp_path, private_pool_bytes):
    c = nvme(tmp_path, private_pool_bytes, write_from_tensor=False)
    with c:
        kept, fillers = _fill(c)
        x = torch.randn(1 << 18)
        ref = x.clone()
        weak = StorageWeakRef(x.untyped_storage())
        h = c.pack(x)  # the pool makes room: it writes older entries out and waits
    del x
    gc.collect()
    assert weak.expired(), "copied into the pool: nothing holds the storage"
    assert torch.equal(c.unpack(h), ref)
    del h, kept
    assert drained(c) == (0, 0)


def test_writes_past_the_hold_wait(tmp_path, private_pool_bytes, monkeypatch):
    """SPILLOVER_WRITE_HOLD_BYTES reaches the tier, and a pack that would pass the hold waits
    for the writes before it: with a hold of one page, every storage written from its tensor
    finds the ones before it on disk."""
    monkeypatch.setenv("SPILLOVER_WRITE_HOLD_BYTES", "4KiB")
    c = nvme(tmp_path, private_pool_bytes)
    with c:
        kept, fillers = _fill(c)
        assert c._tier.write_hold_bytes == 4096
        xs = [torch.randn(1 << 18) for _ in range(4)]
        hs = []
        for x in xs:
            hs.append(c.pack(x))
            assert [h.stored.entry.residency for h in hs[:-1]] == ["disk"] * (len(hs) - 1)
    c.synchronize()
    assert [h.stored.entry.residency for h in hs] == ["disk"] * 4
    for h, x in zip(hs, xs):
        assert torch.equal(c.unpack(h), x)
    monkeypatch.delenv("SPILLOVER_WRITE_HOLD_BYTES")
    with nvme(tmp_path, private_pool_bytes) as d:
        assert d._tier.write_hold_bytes is None  # the default: pool + largest storage so far
    del hs, h, kept
    assert drained(c) == (0, 0)


def test_what_backward_needs_first_stays_in_the_pool(tmp_path, private_pool_bytes):
    """From the second step on, the learned order names what backward unpacks first: those
    storages are copied into the pool (and still there when backward starts); the first ones
    of forward fill the pool while it has room; the rest is written from the tensors."""
    xs = [torch.randn(1 << 18) for _ in range(8)]  # 1 MiB each, 8 MiB through a 4 MiB pool
    c = nvme(tmp_path, private_pool_bytes, prefetch_bytes=512 << 10)
    in_pool = ("dirty", "writing", "clean")
    for step in range(2):
        with c:
            hs = [c.pack(x) for x in xs]
        c.synchronize()
        res = [h.stored.entry.residency for h in hs]
        if step == 0:  # no order learned yet: the pool while it has room, then the tensors
            assert all(r in in_pool for r in res[:3]) and res[3:] == ["disk"] * 5, res
        else:  # the last three (the pool less the 512 KiB window) copied, room made for them
            # (by dropping written entries, earliest packed first: one of them may go again
            # while an earlier copy is still unwritten)
            assert res[3:5] == ["disk"] * 2 and res[-1] in in_pool, res
            assert sum(r in in_pool for r in res[5:]) >= 2, res
        for h, x in zip(reversed(hs), reversed(xs)):
            assert torch.equal(c.unpack(h), x)
        del hs, h
    assert drained(c) == (0, 0)


@pytest.mark.parametrize("attn", ["explicit", "sdpa"])
def test_gpt_steps_bitwise_written_from_the_tensors(tmp_path, attn, private_pool_bytes):
    from spillover.models import GPT, GPTConfig, synthetic_batch

    cfg = GPTConfig(vocab=512, d_model=64, n_heads=4, n_layers=3, seq=256, attn=attn)
    torch.manual_seed(0)
    model = GPT(cfg)
    batch = synthetic_batch(cfg, 4)
    ref = gpt_step(model, batch)
    for _ in range(3):  # 4 MiB: smaller than a step's activations
        c = nvme(tmp_path, private_pool_bytes, verify=True, min_offload_bytes=1 << 16)
        assert_bitwise(ref, gpt_step(model, batch, c))
        s = c.stats()
        assert s.bytes_offloaded_nvme > s.pool_capacity, s
    assert drained(c) == (0, 0)


def test_a_storage_in_pieces_is_written_from_its_memory_and_gathered(tmp_path,
                                                                   private_pool_bytes):
    """Note [gathered storages]: past half the pool a storage goes in pieces; written from the
    tensor, every piece after the first starts on a page, so their images lie back to back in
    the gathered buffer and the storage comes back bitwise, over two steps (the second keeps
    the pieces backward needs first in the pool, at the same place in their pages)."""
    c = nvme(tmp_path, private_pool_bytes, prefetch_bytes=1 << 20)
    xs = [torch.randn(3 << 18) for _ in range(2)] + [torch.randn(3 << 19)]  # 3, 3, 6 MiB
    clones = [x.clone() for x in xs]
    for step in range(2):
        weaks = [StorageWeakRef(x.untyped_storage()) for x in xs]
        with c:
            hs = [c.pack(x) for x in xs]
        c.synchronize()
        g = hs[-1].stored.entry
        assert len(g.parts) > 1
        res = [p.residency for p in g.parts]
        if step == 0:  # the pool filled up with the first storages: this one from the tensor
            # (but its last piece, 64 bytes: the first was cut 64 bytes short)
            assert res[:-1] == ["disk"] * (len(res) - 1), res
        else:  # its last pieces are what backward unpacks first
            assert res[0] == "disk" and res[-1] in ("dirty", "writing", "clean"), res
        xs = None
        gc.collect()
        assert all(w.expired() for w in weaks), "held after their writes landed"
        for h, x in zip(reversed(hs), reversed(clones)):
            assert torch.equal(c.unpack(h), x)
        del hs, h, g
        xs = [x.clone() for x in clones]
    assert drained(c) == (0, 0)
