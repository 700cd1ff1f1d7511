"""One rank of the DCP checkpoint tests (tests/python/test_dcp.py).

    python dist_dcp_worker.py save OUT      # 2 ranks: 3 steps, dcp.save, 3 more steps
    python dist_dcp_worker.py resume OUT    # 1 or 2 ranks: dcp.load, the same 3 more steps

Started with torchrun's environment by the test (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); a
world of one runs without torch.distributed (the unsharded optimizer). Each logical step uses
the mean of two half-batch gradients, (g0 + g1) * 0.5: what two ranks' summed reduce-scatter
scaled by 1/2 computes, so every world size takes bitwise the same steps. Both tiers: fp32 on
the host tier, bf16 (with an fp32 master column) on the NVMe tier; and low-bit state: 8-bit
moments on the host tier, 8-bit moments with bf16 parameters and no master on the NVMe tier
(Note [state formats]). A frozen parameter has no state (Note [lazy state]) and no entries.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import spillover
import spillover.dcp

STEPS = 3
POOL = 32 << 20
# name: (tier, parameter dtype, extra OffloadAdamW arguments)
CONFIGS = {
    "host": ("host", torch.float32, {}),
    "nvme": ("nvme", torch.bfloat16, {}),
    "host-q8": ("host", torch.float32, {"state_bits": 8}),
    "nvme-q8-nomaster": ("nvme", torch.bfloat16, {"state_bits": 8, "master_weights": False}),
}


def make_model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """Odd sizes, so parameters straddle shard boundaries and end in partial vectors."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.GELU(), torch.nn.Linear(47, 5))
    model.add_module("frozen", torch.nn.Linear(3, 3))
    model.frozen.requires_grad_(False)
    return model.to(dtype)


def make_opt(model: torch.nn.Module, tier: str, **kw) -> spillover.OffloadAdamW:
    groups = [
        {"params": list(model[0].parameters()), "lr": 2e-2},
        {"params": list(model[2].parameters()) + list(model.frozen.parameters()),
         "weight_decay": 0.0},
    ]
    return spillover.OffloadAdamW(
        groups, lr=1e-2, tier=tier, chunk_bytes=8192, host_pool_bytes=POOL, **kw
    )


def batch(step: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 33, generator=g).to(dtype), torch.randn(8, 5, generator=g).to(dtype)


def train(model, opt, steps, dtype) -> None:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    net = torch.nn.Sequential(model[0], model[1], model[2])
    mse = torch.nn.functional.mse_loss
    for step in steps:
        x, y = batch(step, dtype)
        opt.zero_grad()
        if world == 2:
            mse(net(x[rank * 4 : rank * 4 + 4]), y[rank * 4 : rank * 4 + 4]).backward()
        else:
            halves = []
            for r in range(2):
                opt.zero_grad()
                mse(net(x[r * 4 : r * 4 + 4]), y[r * 4 : r * 4 + 4]).backward()
                halves.append([p.grad for p in net.parameters()])
            for p, g0, g1 in zip(net.parameters(), *halves):
                p.grad = (g0 + g1) * 0.5
        opt.step()


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    warnings.simplefilter("ignore")  # DCP's "assuming single process", overwrite notices
    if world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if world > 1 else 0
    try:
        for name, (tier, dtype, kw) in CONFIGS.items():
            ckpt = os.path.join(out, f"ckpt-{name}")
            if mode == "save":
                model = make_model(dtype)
                opt = make_opt(model, tier, **kw)
                train(model, opt, range(STEPS), dtype)
                state = {
                    "model": model.state_dict(),
                    "optim": spillover.dcp.optimizer_state(
                        opt, model.named_parameters(), piece_bytes=256
                    ),
                }
                # Small pieces and files: several chunks per unit and several files per rank.
                writer = spillover.dcp.FileSystemWriter(ckpt, file_bytes=4096)
                dcp.save(state, storage_writer=writer)
                train(model, opt, range(STEPS, 2 * STEPS), dtype)
                tag = "ref"
            else:
                model = make_model(dtype, seed=1)  # other weights: the load must set them
                opt = make_opt(model, tier, **kw)
                state = {
                    "model": model.state_dict(),
                    "optim": spillover.dcp.optimizer_state(opt, model.named_parameters()),
                }
                dcp.load(state, checkpoint_id=ckpt)
                model.load_state_dict(state["model"])
                steps = opt.state_steps()
                assert opt.param_groups[0]["lr"] == 2e-2 and steps == {i: 3.0 for i in range(4)}
                n = sum(len(g["params"]) for g in opt.param_groups)
                assert not any(opt.has_state(i) for i in range(4, n)), "the frozen one has state"
                train(model, opt, range(STEPS, 2 * STEPS), dtype)
                tag = f"resumed{world}"
            params = [p.detach().clone() for p in model.parameters()]
            torch.save(params, os.path.join(out, f"{tag}-{name}-rank{rank}.pt"))
    finally:
        if world > 1:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
