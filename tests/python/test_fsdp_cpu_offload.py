"""FSDP2's own CPU offload (``fully_shard(..., offload_policy=CPUOffloadPolicy())``) with
OffloadAdamW: the sharded parameters live on the host, and OffloadAdamW updates them in place."""

from __future__ import annotations

import os

import pytest
import torch
from _ranks import run_ranks

pytest.importorskip("torch.distributed.fsdp")

HERE = os.path.dirname(os.path.abspath(__file__))


def test_fsdp2_cpu_offload_policy_equal_torch_adamw(tmp_path):
    """2 CPU ranks (gloo), spillover.wrap + offload_context, every ``fully_shard`` with
    ``CPUOffloadPolicy`` (``pin_memory=False`` without CUDA: torch pins the shards with
    ``pin_memory()``, which needs a driver): OffloadAdamW's parameters after 4 steps are within
    the tolerance torch's AdamW implementations differ by (as in
    test_dcp.py::test_fsdp2_equal_torch_adamw_and_resumes_at_any_world_size) of the same run with
    ``torch.optim.AdamW``, and every parameter moved away from its initial value by far more
    than that tolerance, so an optimizer that updated nothing (or a copy) would fail. The worker
    checks that FSDP2 offloaded every parameter and that OffloadAdamW staged none of them."""
    run_ranks(os.path.join(HERE, "dist_fsdp_worker.py"), [str(tmp_path), "cpu-offload"],
              timeout=90)
    init = torch.load(tmp_path / "init.pt")
    ref = torch.load(tmp_path / "torch.pt")
    ours = torch.load(tmp_path / "spillover.pt")
    assert set(ours) == set(ref) == set(init) and ref
    for n in ref:
        torch.testing.assert_close(ours[n], ref[n], rtol=1e-5, atol=1e-6, msg=n)
        if n.endswith("attn.qkv.bias"):  # frozen by the worker
            assert torch.equal(ours[n], init[n]), n
        else:
            # lr 1e-2 for 4 steps: Adam moves each element by up to ~4e-2
            assert (ours[n] - init[n]).abs().max() > 1e-3, f"{n} was not updated"
