"""Optimizer step time on FSDP2's CPU-offloaded shards: OffloadAdamW against torch's AdamW.

    python benches/python/fsdp_offload_bench.py [--world 2] [--rounds 24] [--d-model 512]
                                                [--layers 7] [--vocab 4096]

Starts `--world` CPU ranks (gloo) of itself. Each rank builds the same GPT (default about
25M parameters), ``fully_shard`` on every block and the root with
``offload_policy=CPUOffloadPolicy(pin_memory=<CUDA available>)``, once per method, runs one
forward and backward so that every sharded parameter has its gradient, then times
``opt.step()`` alone: ``spillover.OffloadAdamW(tier="host")`` (its kernel reads the local
gradient shard and writes the local parameter shard in place), ``torch.optim.AdamW`` on
the DTensors: its default (the per-parameter loop: torch defaults to foreach only on GPUs),
``foreach=True`` and ``fused=True``. The gradients stay
between steps (each method keeps stepping its own copy). Every round runs every method once,
the rounds cycling through every order of the methods; a barrier before each step, and a
step's time is the slowest rank's. Each rank gets cpus / world threads for torch and for
spillover's kernel (RAYON_NUM_THREADS). Prints medians over rounds. Use a multiple of 24
rounds (4 methods).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings


def launch(args: argparse.Namespace) -> None:
    """Run this script as `args.world` ranks with torchrun's environment."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    threads = str(max(1, (os.cpu_count() or 1) // args.world))
    procs = []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS=threads, RAYON_NUM_THREADS=threads)
        procs.append(subprocess.Popen([sys.executable, *sys.argv], env=env))
    sys.exit(max(p.wait() for p in procs))


def main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    import spillover
    from spillover.models import GPT, GPTConfig, synthetic_batch

    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_heads=8, n_layers=args.layers,
                    seq=64)
    policy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())

    def build():
        torch.manual_seed(0)
        model = GPT(cfg)
        for blk in model.blocks:
            fully_shard(blk, mesh=mesh, offload_policy=policy)
        fully_shard(model, mesh=mesh, offload_policy=policy)
        idx, tgt = synthetic_batch(cfg, batch=2, seed=rank)
        model(idx, tgt).backward()
        return model

    makers = {
        "spillover OffloadAdamW": lambda ps: spillover.OffloadAdamW(ps, lr=1e-3, tier="host"),
        "torch AdamW (default)": lambda ps: torch.optim.AdamW(ps, lr=1e-3),
        "torch AdamW (foreach)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
        "torch AdamW (fused)": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    }
    steps = {}
    for name, make in makers.items():
        model = build()
        steps[name] = make(list(model.parameters())).step
    n = sum(p.numel() for p in model.parameters())
    local = sum(p.to_local().numel() for p in model.parameters())

    for step in steps.values():  # warm-up: allocates state, faults pages in
        step()
        step()
    times = {k: [] for k in steps}
    orders = list(itertools.permutations(steps))
    for r in range(args.rounds):
        for k in orders[r % len(orders)]:
            gc.collect()
            dist.barrier()
            t0 = time.perf_counter()
            steps[k]()
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times[k].append(t.item())
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        ref = med["torch AdamW (default)"]
        print(f"\ntorch {torch.__version__}, {world} ranks x {torch.get_num_threads()} threads, "
              f"GPT {n / 1e6:.1f}M parameters ({local / 1e6:.1f}M on rank 0), "
              f"CPUOffloadPolicy(pin_memory={policy.pin_memory}), {args.rounds} rounds, "
              f"load average {os.getloadavg()[0]:.2f}\n")
        print("| optimizer | step ms (median, slowest rank) | torch default / this |")
        print("| --- | --- | --- |")
        for k, t in med.items():
            print(f"| {k} | {t * 1e3:.1f} | {ref / t:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=24)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--vocab", type=int, default=4096)
    a = ap.parse_args()
    if "RANK" in os.environ:
        main(a)
    else:
        launch(a)
