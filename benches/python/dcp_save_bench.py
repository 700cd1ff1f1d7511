"""Peak RSS of saving OffloadAdamW's state with torch.distributed.checkpoint, per rank.

    python benches/python/dcp_save_bench.py                 # 2 ranks (gloo), both tiers
    python benches/python/dcp_save_bench.py --world 1 --layers 8

Each rank trains one step of a stack of Linear layers (fp32 on CPU: state = exp_avg +
exp_avg_sq, 8 bytes per parameter), then, one after the other, measures the rise of its RSS
high-water mark (VmHWM, reset through /proc/self/clear_refs) over its RSS just before:

- ``dcp.save`` of ``spillover.dcp.optimizer_state(opt)`` with torch's ``FileSystemWriter``;
- the same with ``spillover.dcp.FileSystemWriter`` (files of at most ``--file-mib``);
- ``opt.state_dict()`` (the full state, gathered on every rank) for contrast.

glibc's mmap threshold is pinned at 64 KiB, so freed tensors leave RSS at once and the
high-water mark tracks live bytes (as in recompute_bench.py). Reported against the rank's own
shard of the state and the full state. No timing claims: one run, on whatever machine.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import warnings

import torch

_libc = ctypes.CDLL("libc.so.6")
MIB = 1 << 20


def _launch(args: argparse.Namespace) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(args.world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(args.world), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(args.world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-child", *sys.argv[1:]],
                                      env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"a rank failed: exit codes {codes}")


def _peak_during(fn) -> int:
    from spillover._peak import high_water, reset_high_water, rss

    before = rss()
    reset_high_water()
    fn()
    return high_water() - before


def _measure(model, tier: str, args: argparse.Namespace, ck: str, full: int) -> dict:
    import torch.distributed.checkpoint as dcp

    import spillover
    import spillover.dcp

    opt = spillover.OffloadAdamW(model.parameters(), tier=tier,
                                 host_pool_bytes=full // args.world + (64 << 20))
    model(torch.randn(4, args.width)).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    res = {"shard_mib": opt.stats()["state_bytes"] / MIB}

    def save(writer):
        dcp.save({"optim": spillover.dcp.optimizer_state(opt)}, storage_writer=writer)

    res["dcp_torch_writer_mib"] = _peak_during(
        lambda: save(dcp.FileSystemWriter(ck + "-torch"))) / MIB
    res["dcp_spillover_writer_mib"] = _peak_during(
        lambda: save(spillover.dcp.FileSystemWriter(
            ck + "-spillover", file_bytes=args.file_mib * MIB))) / MIB
    res["state_dict_mib"] = _peak_during(opt.state_dict) / MIB
    return {k: round(v, 1) for k, v in res.items()}


def child(args: argparse.Namespace) -> None:
    _libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB: RSS tracks live tensors
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    if args.world > 1:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if args.world > 1 else 0
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(args.width, args.width, bias=False) for _ in range(args.layers)])
    full = 8 * sum(p.numel() for p in model.parameters())
    out = {"rank": rank, "world": args.world, "full_state_mib": full / MIB}
    root = tempfile.mkdtemp(prefix="spillover-dcp-bench-")
    try:
        for tier in args.tiers.split(","):
            out[tier] = _measure(model, tier, args, os.path.join(root, tier), full)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if args.world > 1:
            dist.destroy_process_group()
    print(json.dumps(out), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--tiers", default="host,nvme")
    ap.add_argument("--file-mib", type=int, default=64)
    ap.add_argument("--rank-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_child or args.world == 1:
        child(args)
    else:
        _launch(args)


if __name__ == "__main__":
    main()
