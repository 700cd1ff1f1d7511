"""The ledger of copies in flight as Python sees it (``spillover._native.Inflight``, Note [the
ledger of copies in flight] in rust/tier/inflight.rs; its property tests are tests/inflight.rs)
and the link policy over it (Note [the ledger lives in the tier] in link/policy.py)."""

import pytest
import torch

from spillover import _native
from spillover.activations import link


def test_past_the_cap_the_oldest_sources_go_never_the_newest():
    led = _native.Inflight(10)
    assert [led.issue(4) for _ in range(2)] == [(0, []), (1, [])]
    assert led.issue(4) == (2, [0])
    assert (led.bytes_held, led.held, led.bytes_in_flight, led.in_flight) == (8, 2, 12, 3)
    assert led.issue(100) == (3, [1, 2])  # larger than the cap: passes alone
    assert led.held_ids() == [3] and led.bytes_held == 100
    assert (led.forced_waits, led.sources_released, led.copies) == (2, 3, 4)
    assert (led.peak_bytes_held, led.peak_bytes_in_flight) == (108, 112)
    assert led.cap_bytes == 10


def test_a_copy_lands_once_and_the_front_is_the_oldest_not_landed():
    led = _native.Inflight(1 << 40)
    a, _ = led.issue(3)
    b, _ = led.issue(5)
    assert led.front() == a
    assert led.landed(b) and not led.landed(b) and not led.landed(12345)
    assert (led.front(), led.bytes_in_flight, led.bytes_held) == (a, 3, 3)
    assert not led.is_held(b) and led.is_held(a) and led.is_in_flight(a)
    assert led.release_all() == [a] and led.release_all() == []
    assert (led.bytes_held, led.sources_released, led.forced_waits) == (0, 1, 0)
    assert led.landed(a)
    assert (led.front(), led.bytes_in_flight, led.in_flight_ids()) == (None, 0, [])
    assert led.peak_bytes_in_flight == 8


def test_the_ledger_rejects_what_is_no_size():
    with pytest.raises((OverflowError, TypeError)):
        _native.Inflight(-1)
    with pytest.raises((OverflowError, TypeError)):
        _native.Inflight(8).issue(-1)


def test_the_policy_drops_the_sources_the_ledger_names():
    """A simulated link far slower than issuing: every copy is still in flight, so the sources
    held are exactly those the ledger holds, and the counters are the ledger's."""
    dev = link.SimDevice(1e6)  # 1 MB/s: 64 KiB take 65 ms
    n, cap = 64 << 10, 3 * (64 << 10)
    tr = link.Transfers(dev, cap)
    srcs = [torch.full((n,), i, dtype=torch.uint8) for i in range(6)]
    dsts = [torch.zeros(n, dtype=torch.uint8) for _ in srcs]
    copies = [tr.to_host(s, d) for s, d in zip(srcs, dsts)]
    held = {c._id for c in copies if c.source() is not None}
    assert held == set(tr._ledger.held_ids())
    assert copies[-1].source() is not None  # the newest is never a victim
    assert tr.bytes_held <= cap and tr.peak_bytes_held >= tr.bytes_held
    assert tr.copies == 6 and tr.forced_waits >= 1
    assert tr.sources_released == 6 - len(held)
    tr.synchronize()
    assert (tr.bytes_in_flight, tr.bytes_held, tr._copies) == (0, 0, {})
    assert all(c.source() is None for c in copies)
    assert all(torch.equal(s, d) for s, d in zip(srcs, dsts))
    tr.release_sources()
    assert tr.sources_released == 6 - len(held)  # nothing was left to release
