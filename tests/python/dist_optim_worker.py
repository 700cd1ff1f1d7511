"""One rank of the 2-rank OffloadAdamW test (tests/python/test_optim.py::test_two_ranks_*).

Started with torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) by the test,
or by torchrun itself:  torchrun --nproc-per-node 2 tests/python/dist_optim_worker.py OUT_DIR

Runs a few scenarios on gloo, each rank training on its half of every batch, and saves the
parameters and the gathered state_dict of each scenario to OUT_DIR/<scenario>-rank<r>.pt.
"""

from __future__ import annotations

import sys
from typing import List, Tuple

import torch
import torch.distributed as dist

import spillover

STEPS = 5
POOL = 32 << 20
# Low-bit state (tests/python/test_optim_lowbit.py): (dtype, tier, extra OffloadAdamW arguments).
LOWBIT = {
    "q8-host": (torch.float32, "host", dict(state_bits=8)),
    "q8-nvme-bf16-nomaster": (torch.bfloat16, "nvme", dict(state_bits=8, master_weights=False)),
    "q16-host-bf16": (torch.bfloat16, "host", dict(state_bits=16)),
}


def make_model(dtype: torch.dtype = torch.float32) -> torch.nn.Sequential:
    """Odd sizes, so parameters end in partial vectors and straddle shard boundaries."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.GELU(), torch.nn.Linear(47, 5))
    return model.to(dtype)


def batches(dtype: torch.dtype = torch.float32, n: int = STEPS) -> List[Tuple[torch.Tensor, ...]]:
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 33, generator=g).to(dtype), torch.randn(8, 5, generator=g).to(dtype))
        for _ in range(n)
    ]


def run(scenario: str, out_dir: str) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = torch.bfloat16 if scenario.startswith("bf16") else torch.float32
    tier = "nvme" if "nvme" in scenario else "host"
    kw = {}
    if scenario in LOWBIT:
        dtype, tier, extra = LOWBIT[scenario]
        kw.update(extra)
    model = make_model(dtype)
    net = model
    if scenario == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        kw["reduce_grads"] = False  # DDP has averaged them already
    if scenario == "fp32-staged":
        # the GPU path's buffers and copies, on CPU tensors, with the hooks' copies
        kw.update(_force_staging=True, _hook_copies=True)
    link = None
    if scenario == "fp32-logged":  # the same, through a device that logs its calls
        from _stream_log import StreamLog

        import spillover.optim.layout as layout

        layout._UNIT_MAX, layout._BUCKET_ELEMS = 128, 256  # several buckets per shard
        link = StreamLog()
        kw.update(_force_staging=True, _link=link)
    groups = [
        {"params": list(model[0].parameters()), "lr": 2e-2},
        {"params": list(model[2].parameters()), "weight_decay": 0.0},
    ]
    opt = spillover.OffloadAdamW(
        groups, lr=1e-2, tier=tier, chunk_bytes=8192, host_pool_bytes=POOL, **kw
    )
    assert opt._world == world, "expected the optimizer to shard"
    for x, y in batches(dtype):
        half = x.shape[0] // world
        xs, ys = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(xs), ys).backward()
        start = link.mark() if link else 0
        opt.step()
        if link is not None:
            check_sharded_copies(opt, link, start)
    # Note [collectives at exit]: the last step's collectives are kept (waited for), so that
    # gloo's worker never drops the last reference to their tensors (it takes the GIL for it).
    assert len(opt._works) == (2 if scenario == "ddp" else 3), opt._works  # MAX, [RS,] gather
    sd = opt.state_dict()
    params = [p.detach().clone() for p in model.parameters()]
    if scenario == "fp32-host":
        # A sharded load_state_dict: a second optimizer resumes from the gathered checkpoint
        # and must take the same next step as the original.
        twin = make_model(dtype)
        twin.load_state_dict(model.state_dict())
        tgroups = [
            {"params": list(twin[0].parameters()), "lr": 2e-2},
            {"params": list(twin[2].parameters()), "weight_decay": 0.0},
        ]
        topt = spillover.OffloadAdamW(
            tgroups, lr=1e-2, tier="nvme", chunk_bytes=8192, host_pool_bytes=POOL
        )
        topt.load_state_dict(sd)
        x, y = batches(dtype, n=STEPS + 1)[-1]
        for m, o in ((model, opt), (twin, topt)):
            o.zero_grad()
            half = x.shape[0] // world
            xs, ys = x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half]
            torch.nn.functional.mse_loss(m(xs), ys).backward()
            o.step()
        same = all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
        sd["resumed_equal"] = same
    torch.save({"params": params, "state_dict": sd}, f"{out_dir}/{scenario}-rank{rank}.pt")


def check_sharded_copies(opt, link, start: int) -> None:
    """Note [sharded copies]: in the step logged from `start`, every bucket's two D2H copies
    were queued before the host waited for any of them, and the compute stream is ordered
    after every copy into the parameter shard (Note [parameter writes are ordered])."""
    from _stream_log import unordered_writes

    (space,) = opt._spaces
    seg = link.log[start:]
    d2h = [i for i, e in enumerate(seg) if e[0] == "copy" and e[1] == space.copies.d2h]
    waited = [i for i, e in enumerate(seg)
              if e[0] == "synchronize" and e[1].stream == space.copies.d2h]
    assert len(space.buckets) > 1 and len(d2h) == 2 * len(space.buckets), (d2h, len(space.buckets))
    assert len(waited) == len(d2h) and max(d2h) < min(waited), (d2h, waited)
    shard = space.param_shard.untyped_storage().data_ptr()
    assert unordered_writes(link.log, [shard], link.mark()) == []


def main() -> None:
    out_dir = sys.argv[1]
    scenarios = (
        sys.argv[2].split(",")
        if len(sys.argv) > 2
        else ["fp32-host", "bf16-nvme", "ddp", "fp32-staged"]
    )
    dist.init_process_group("gloo")
    try:
        for s in scenarios:
            run(s, out_dir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
