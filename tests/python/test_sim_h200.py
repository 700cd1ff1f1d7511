"""The simulated H200 (Note [the simulated H200] in spillover/simh200.py): the settings restore
the H200's two ratios from what a CPU step measured, and the Quick start's loop runs on them --
gradients bitwise, nothing mapped or registered from the third step -- in CI's size."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_bitwise, gpt_step

import spillover
from spillover import simh200
from spillover.models import GPT, GPTConfig, synthetic_batch


def test_the_h200s_ratios_are_what_it_measured():
    assert pytest.approx(4.87, abs=0.01) == simh200.PRODUCTION_OVER_LINK  # 263 vs 54 GB/s
    assert pytest.approx(0.344, abs=0.001) == simh200.HOST_OVER_COMPUTE  # 106.8 of 310 us


@pytest.mark.parametrize("own", [0.0, 20e-6, 5e-3])
def test_settings_restore_both_ratios(own):
    """A CPU step: forward 0.2 s saving 400 MB in 100 tensors, step 0.6 s (6 ms of compute
    per offloaded tensor), the host's own cost per offload ``own``, 4 device calls each."""
    s = simh200.settings(0.2, 0.6, 400_000_000, 100, own, 4.0)
    assert s.production_over_link == pytest.approx(simh200.PRODUCTION_OVER_LINK)
    assert s.sim_link_bandwidth == pytest.approx(400e6 / 0.2 / simh200.PRODUCTION_OVER_LINK)
    want = simh200.HOST_OVER_COMPUTE * 6e-3
    if own < want:  # the calls make up what the CPU's own cost lacks
        assert s.sim_call_cost == pytest.approx((want - own) / 4)
        assert s.host_over_compute == pytest.approx(simh200.HOST_OVER_COMPUTE)
    else:  # already past it: no call cost, and the ratio says how far past
        assert s.sim_call_cost == 0 and s.host_over_compute == pytest.approx(own / 6e-3)
    assert s.sim_compute_lag == pytest.approx(0.02)
    assert "H200 4.87x" in s.describe()


def test_settings_refuse_a_step_that_measured_nothing():
    with pytest.raises(ValueError, match="offloads must be > 0"):
        simh200.settings(0.2, 0.6, 1, 0, 0.0, 4.0)


def test_the_quick_start_loop_on_the_simulated_h200(monkeypatch, tmp_path):
    """Settings as a small GPT's step would give them (a link ~5x slower than its forward's
    production, call costs bringing the host to 0.34 of its compute per tensor): a new context
    every step, the defaults; bitwise to no offload, no pool mapped or registered from step 3."""
    monkeypatch.delenv("SPILLOVER_HOST_POOL_BYTES", raising=False)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=256, d_model=128, n_heads=4, n_layers=2, seq=128)
    model, batch = GPT(cfg), synthetic_batch(cfg, batch=4)
    ref = gpt_step(model, batch)
    sim = simh200.settings(0.05, 0.15, 40_000_000, 40, 30e-6, 3.0)
    kw = dict(sim.context_kwargs(), sim_link_bandwidth=sim.sim_link_bandwidth + 23)  # own link
    rows = []
    for _ in range(4):
        ctx = spillover.offload_context("host", min_offload_bytes=0, **kw)
        assert_bitwise(ref, gpt_step(model, batch, ctx))
        rows.append(ctx.stats())
    assert rows[-1].tensors_offloaded > 0 and rows[-1].tensors_unpacked > 0
    assert [(s.pool_maps, s.pool_registrations) for s in rows[2:]] == [(0, 0), (0, 0)]
