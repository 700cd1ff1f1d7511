"""One rank of the FSDP2 tests (tests/python/test_dcp.py::test_fsdp2_*,
test_fsdp_cpu_offload.py), 2 CPU ranks on gloo:

    python dist_fsdp_worker.py OUT [cpu-offload]   # with torchrun's environment (RANK, ...)

A small GPT, ``spillover.wrap(policy="selective")`` then ``fully_shard`` on every block and the
root (``init_device_mesh("cpu", (2,))``), forward under ``spillover.offload_context``, each rank
on its half of every batch:

- ``torch``: torch's AdamW (foreach, on the DTensor parameters), STEPS steps;
- ``spillover``: OffloadAdamW (shard=False by itself: it runs on each rank's local shards);
- ``resumed``: OffloadAdamW for STEPS // 2 steps, ``dcp.save`` of the model and
  ``spillover.dcp.optimizer_state`` (the state's chunks are the ranges of the local shards),
  then a model built from another seed and a new optimizer ``dcp.load`` it and take the
  remaining steps.

Rank 0 saves every scenario's full parameters to OUT/<scenario>.pt; the checkpoint stays in
OUT/ckpt for the test to resume at world size 1.

``cpu-offload`` (tests/python/test_fsdp_cpu_offload.py): every ``fully_shard`` gets
``offload_policy=CPUOffloadPolicy(pin_memory=...)`` (pinned where CUDA is available: torch pins
the shards with ``pin_memory()``, which raises "Found no NVIDIA driver" on a host without one),
and only ``torch`` and ``spillover`` run, plus ``init`` (the parameters before any step).

A rank that succeeded ends with ``os._exit(0)`` once the group is destroyed, skipping the
interpreter's finalization. Rank 1, which saves nothing, used to end right after its last
``full_tensor()`` all-gather, and gloo's thread could drop the gathered tensor's last reference
while the interpreter was finalizing: "terminate called without an active exception", SIGABRT
(Note [collectives at exit] in python/spillover/optim/store.py has the mechanism). It happened
to rank 1 in one CI run; a script of just those all-gathers and the exit did it 1 run in 40
here. torch's collectives do it, not spillover's, so the worker steps around it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

import spillover
import spillover.dcp
from spillover.models import GPT, GPTConfig, synthetic_batch

STEPS = 4
CFG = GPTConfig(vocab=64, d_model=32, n_heads=4, n_layers=2, seq=16)
CTX = dict(tier="host", host_pool_bytes="16MiB", min_offload_bytes=1024)


def build(mesh, seed: int = 0, offload: bool = False) -> torch.nn.Module:
    policy = {}
    if offload:
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    torch.manual_seed(seed)
    model = spillover.wrap(GPT(CFG), policy="selective")
    for blk in model.blocks:
        # The key bias gets no gradient but rounding noise (softmax ignores it), which Adam
        # scales up to +-lr: two correct optimizers then differ by ~lr there. Frozen: no state.
        blk.attn.qkv.bias.requires_grad_(False)
        fully_shard(blk, mesh=mesh, **policy)
    fully_shard(model, mesh=mesh, **policy)
    return model


def train(model, opt, steps, ctx) -> None:
    rank = dist.get_rank()
    for step in steps:
        idx, tgt = synthetic_batch(CFG, batch=4, seed=step)
        with ctx:
            loss = model(idx[rank * 2 : rank * 2 + 2], tgt[rank * 2 : rank * 2 + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()


def full_params(model) -> dict:
    return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}


def cpu_offload(mesh, ctx) -> dict:
    """torch's AdamW and OffloadAdamW on FSDP2's CPU-offloaded shards."""
    results = {"init": full_params(build(mesh, offload=True))}
    model = build(mesh, offload=True)
    # FSDP2's own flag (a private attribute): the policy reached every sharded parameter.
    assert all(fp.offload_to_cpu for m in [*model.blocks, model]
               for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(STEPS), ctx)
    results["torch"] = full_params(model)

    model = build(mesh, offload=True)
    opt = spillover.OffloadAdamW(model.parameters(), lr=1e-2, tier="host")
    assert opt._world == 1, "DTensor parameters: the optimizer runs on the local shards"
    assert all(p.to_local().device.type == "cpu" for p in model.parameters())
    train(model, opt, range(STEPS), ctx)
    # Note [cpu parameters in place]: host shards are updated where they are, nothing staged.
    assert opt._spaces and not any(s.staged for s in opt._spaces), "staged a host shard"
    results["spillover"] = full_params(model)
    return results


def scenarios(mesh, ctx, out) -> dict:
    """torch, spillover and resumed (the module's docstring)."""
    results = {}
    model = build(mesh)
    train(model, torch.optim.AdamW(model.parameters(), lr=1e-2), range(STEPS), ctx)
    results["torch"] = full_params(model)

    model = build(mesh)
    opt = spillover.OffloadAdamW(model.parameters(), lr=1e-2, tier="host")
    assert opt._world == 1, "DTensor parameters: the optimizer runs on the local shards"
    train(model, opt, range(STEPS), ctx)
    results["spillover"] = full_params(model)

    ckpt = os.path.join(out, "ckpt")
    model = build(mesh)
    opt = spillover.OffloadAdamW(model.parameters(), lr=1e-2, tier="nvme")
    train(model, opt, range(STEPS // 2), ctx)
    dcp.save({"model": model.state_dict(),
              "optim": spillover.dcp.optimizer_state(opt, model.named_parameters())},
             storage_writer=spillover.dcp.FileSystemWriter(ckpt))
    model = build(mesh, seed=1)
    opt = spillover.OffloadAdamW(model.parameters(), lr=1e-3, tier="host")
    state = {"model": model.state_dict(),
             "optim": spillover.dcp.optimizer_state(opt, model.named_parameters())}
    dcp.load(state, checkpoint_id=ckpt)
    model.load_state_dict(state["model"])
    train(model, opt, range(STEPS // 2, STEPS), ctx)
    results["resumed"] = full_params(model)
    return results


def main() -> None:
    out = sys.argv[1]
    offload = sys.argv[2:] == ["cpu-offload"]
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    ctx = spillover.offload_context(**CTX)
    try:
        results = cpu_offload(mesh, ctx) if offload else scenarios(mesh, ctx, out)
        stats = ctx.stats(total=True)
        assert stats.bytes_offloaded > 0, "the offload context offloaded nothing"
        if dist.get_rank() == 0:
            for name, params in results.items():
                torch.save(params, os.path.join(out, f"{name}.pt"))
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no finalization: the module's docstring

if __name__ == "__main__":
    main()
