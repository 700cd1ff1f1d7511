"""The ledger of copies in flight as Python sees it (``spillover._native.Inflight``, Note [the
ledger of copies in flight] in rust/tier/inflight.rs; its property tests are tests/inflight.rs)
and the device link over it (Note [sources held] in rust/link/mod.rs)."""

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


def test_the_link_drops_the_sources_the_ledger_names():
    """A simulated link far slower than issuing: every copy is still in flight, so the sources
    held are exactly those the ledger holds, and the counters are the ledger's; once all
    landed, the ledger holds none and the newest within the cap stay (Note [the newest
    sources stay] in activations/link/device.py)."""
    n, cap = 64 << 10, 3 * (64 << 10)
    tr = link.DeviceLink(torch.device("cpu"), cap_bytes=cap, sim_bandwidth=1e6 + 1)  # 65 ms
    tier = _native.Tier(_native.Pool(8 << 20))
    step = tier.begin_step()
    srcs = [torch.full((n,), i, dtype=torch.uint8) for i in range(6)]
    packed = [tr.pack(step, s.untyped_storage(), n) for s in srcs]
    copies = [c for _, c in packed]
    held = {c.id for c in copies if c.source() is not None}
    assert len(held) == 3 and tr.native.bytes_held == 3 * n
    assert copies[-1].source() is not None  # the newest is never a victim
    c = tr.counters()
    assert c["copies"] == 6 and c["forced_waits"] >= 1 and c["sources_released"] == 3
    tr.synchronize()
    assert (tr.bytes_in_flight, tr.native.bytes_held) == (0, 0)
    assert [c.source() is not None for c in copies] == [False] * 3 + [True] * 3
    assert all(torch.equal(s, torch.from_numpy(__import__("numpy").asarray(h.get())))
               for s, (h, _) in zip(srcs, packed))
    tr.release_sources()
    assert tr.bytes_held == 0 and all(c.source() is None for c in copies)
