"""Train a small GPT on several processes with spillover, checkpointing through DCP.

    torchrun --nproc-per-node 2 examples/train_distributed.py             # DDP, on CPU (gloo)
    torchrun --nproc-per-node 2 examples/train_distributed.py --fsdp      # FSDP2
    torchrun --nproc-per-node 2 examples/train_distributed.py --steps 8   # resumes from ckpt/

Every rank: selective recompute (``spillover.wrap``), saved activations offloaded through one
``offload_context``, AdamW state off the device in ``OffloadAdamW`` (ZeRO-sharded across the
ranks next to DDP; on each rank's local shards under FSDP2). Every ``--save-every`` steps the
model and the optimizer are saved with ``torch.distributed.checkpoint`` under ``--ckpt``, one
directory per step; a run finds the latest and resumes from it, at any number of processes.
On GPUs the same script uses NCCL and one device per rank.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import spillover
import spillover.dcp
from spillover.models import GPT, GPTConfig, synthetic_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fsdp", action="store_true", help="FSDP2 (fully_shard) instead of DDP")
    ap.add_argument("--steps", type=int, default=4, help="train until this step")
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--ckpt", default="ckpt", help="checkpoint directory (one per step)")
    ap.add_argument("--tier", default="host", choices=("host", "nvme"),
                    help="where OffloadAdamW keeps its state")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)

    cfg = GPTConfig(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64)
    torch.manual_seed(0)  # the same initial weights on every rank
    model = spillover.wrap(GPT(cfg).to(device), policy="selective")
    if args.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type if cuda else "cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        net = model
        opt = spillover.OffloadAdamW(model.parameters(), lr=3e-4, tier=args.tier)
    else:
        net = torch.nn.parallel.DistributedDataParallel(model)
        # DDP averages the gradients; the optimizer only shards the state.
        opt = spillover.OffloadAdamW(model.parameters(), lr=3e-4, tier=args.tier,
                                     reduce_grads=False)

    def state():  # a fresh dict each time: DCP loads in place
        return {"model": model.state_dict(),
                "optim": spillover.dcp.optimizer_state(opt, model.named_parameters())}

    done = [int(d.split("-")[1]) for d in os.listdir(args.ckpt)] if os.path.isdir(
        args.ckpt) else []
    start = max(done, default=0)
    if start:
        s = state()
        dcp.load(s, checkpoint_id=os.path.join(args.ckpt, f"step-{start}"))
        model.load_state_dict(s["model"])
        if rank == 0:
            print(f"resumed from step {start} at world size {world}", flush=True)

    # The tiny model's activations are a few KiB: offload from 16 KiB (the default is 1 MiB),
    # into a 256 MiB pool (the default, a quarter of this rank's share of the node's memory, is
    # pre-faulted at the first step: seconds, for a model this small).
    ctx = spillover.offload_context(tier="auto", min_offload_bytes="16KiB",
                                    host_pool_bytes="256MiB")
    for step in range(start, args.steps):
        idx, tgt = synthetic_batch(cfg, batch=4, device=device, seed=step * world + rank)
        with ctx:
            loss = net(idx, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if rank == 0:
            print(f"step {step + 1} loss {loss.item():.4f}", flush=True)
        if (step + 1) % args.save_every == 0:
            path = os.path.join(args.ckpt, f"step-{step + 1}")
            dcp.save(state(), storage_writer=spillover.dcp.FileSystemWriter(path))
    if rank == 0:
        print(ctx.stats(total=True), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
