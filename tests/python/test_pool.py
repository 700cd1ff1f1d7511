"""The native pool from Python: leases, exhaustion, zero-copy views and their lifetime."""

import gc

import numpy as np
import pytest
import torch

import spillover
from spillover import _native
from spillover.activations.link import block_tensor


@pytest.fixture
def pool():
    return _native.Pool(8 << 20, arena_bytes=4 << 20, lock=False)


def test_lease_and_return(pool):
    b = pool.lease(5000)
    assert b.nbytes == 5000 and b.capacity == 8192 and b.address % 4096 == 0
    s = pool.stats()
    assert s["in_use"] == 8192 and s["live_blocks"] == 1 and s["leases"] == 1
    del b
    s = pool.stats()
    assert s["in_use"] == 0 and s["peak"] == 8192 and s["free_extents"] == 2  # two arenas


def test_exhaustion_is_a_typed_error(pool):
    held = [pool.lease(4 << 20), pool.lease(3 << 20)]
    with pytest.raises(spillover.PoolExhaustedError) as e:
        pool.lease(2 << 20)
    assert isinstance(e.value, MemoryError) and isinstance(e.value, spillover.SpilloverError)
    assert e.value.need == 2 << 20 and e.value.largest_free == 1 << 20
    assert "SPILLOVER_HOST_POOL_BYTES" in str(e.value)
    assert pool.stats()["failed_leases"] == 1
    del held
    pool.lease(2 << 20)


def test_zero_length_and_oversize_copy_are_refused(pool):
    with pytest.raises(ValueError):
        pool.lease(0)
    b = pool.lease(4096)
    src = torch.zeros(8192, dtype=torch.uint8)
    with pytest.raises(ValueError, match="does not fit"):
        b.copy_from(src.data_ptr(), 8192)


def test_block_view_is_zero_copy_and_outlives_the_block(pool):
    b = pool.lease(1 << 20)
    t = block_tensor(b)
    assert t.data_ptr() == b.address and t.numel() == 1 << 20
    src = torch.arange(1 << 18, dtype=torch.int32)
    b.copy_from(src.data_ptr(), src.numel() * 4)
    assert torch.equal(t.view(torch.int32), src)
    np.asarray(b)[0] = 77  # writes through any view are seen by the others
    assert t[0].item() == 77
    del b
    gc.collect()
    assert pool.stats()["live_blocks"] == 1  # the tensor keeps the block (and mapping) alive
    assert t.view(torch.int32)[1].item() == 1
    del t
    gc.collect()
    assert pool.stats()["live_blocks"] == 0


def test_copy_round_trip_and_checksum(pool):
    b = pool.lease(3 << 20)
    src = torch.randint(0, 255, (3 << 20,), dtype=torch.uint8)
    b.copy_from(src.data_ptr(), src.numel())
    dst = torch.empty_like(src)
    b.copy_to(dst.data_ptr(), dst.numel())
    assert torch.equal(src, dst)
    assert b.checksum() == _native.crc32c(src.data_ptr(), src.numel())


def test_lock_warning_is_none_or_says_what_to_raise():
    p = _native.Pool(1 << 20, lock=True)
    w = p.lock_warning
    assert w is None or ("RLIMIT_MEMLOCK" in w and "ulimit -l" in w)
    if w is None:
        assert p.stats()["locked_bytes"] == p.capacity
