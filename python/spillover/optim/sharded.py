"""The sharded (ZeRO) path of a state space.

Note [sharding]
    Under ``torch.distributed`` with world size W > 1 (unless ``shard=False``), the parameters
    of each (dtype, device) are laid end to end in a flat buffer (each padded to 16 elements,
    the whole to a multiple of 16 W) and rank r owns elements [r S, (r+1) S), S = size / W:
    only that shard's state exists on rank r. A step reduce-scatters the flat gradients (sum,
    then scaled by 1/W in the kernel; ``reduce_grads=False`` when DDP has already averaged
    them), updates the shard, and all-gathers the new parameters into every rank's model.
    Whether a parameter has a gradient is agreed on first (MAX over ranks; a rank without one
    contributes zeros), so every rank takes the same collectives and step counts. ``state_dict``
    gathers the full state on every rank (world-size independent, torch's format);
    ``load_state_dict`` takes each rank's part. At the sizes where sharding is needed the full
    state does not fit one rank: save through ``torch.distributed.checkpoint`` with
    :mod:`spillover.dcp` instead (per-rank pieces produced when the writer asks for them,
    loadable at any world size).

    With 8-bit state each parameter is padded to a block of 256 elements instead of 16, so a
    rank's part of a parameter starts on one of its blocks and the blocks are those of one
    process (Note [block alignment] in rust/optim/layout.rs): the state, and the parameters,
    are those of a single-process run, bit for bit, at any world size.

    Next to DDP, construct the optimizer on the wrapped module's parameters with
    ``reduce_grads=False``: DDP's all-reduce has already averaged the gradients, each rank
    takes its shard of them without communicating, and only the parameter all-gather remains
    (the state is still sharded). bf16 gradients are reduced in bf16, as DDP does.

    With FSDP2 (``fully_shard``) the parameters are already sharded DTensors and gradients are
    already reduce-scattered: pass ``shard=False`` (also chosen automatically when a parameter
    is a DTensor); each rank then runs the optimizer on its local shards (``to_local()``), with
    the state 1/W per rank as FSDP2 sharded it. FSDP2 assigns the sharded gradients itself, so
    the post-accumulate-grad hooks do not fire and ``step()`` copies the local gradients then.
    Tested on 2 CPU ranks (gloo) with ``spillover.wrap`` and ``offload_context``: parameters
    within torch's own AdamW implementations' tolerance of the same FSDP2 run with torch's
    AdamW, and a DCP checkpoint that resumes under FSDP2, ZeRO or one process
    (tests/python/test_dcp.py).

Note [sharded copies]
    On a device, ``step()`` starts every active bucket's two device-to-host copies (gradient
    shard, parameter shard) at once, each into its bucket's own pinned buffers, and the host
    waits for a bucket's two events only right before that bucket's CPU update: the copies of
    the later buckets run while the earlier ones are updated, and no copy is waited for as it
    is issued. A bucket's copy back to the device (Note [parameter writes are ordered] in
    copies.py) is queued after its update, when its D2H copies have landed, so it never
    overwrites parameter-shard bytes a D2H copy is still reading. Guarded on CPU by
    test_optim.py's two-rank recording test.
"""

from __future__ import annotations

from typing import Dict

import numpy as np
import torch

from . import formats
from .layout import owned_range, shard_layout
from .space import _Space


class ShardedSpace(_Space):
    """Rank r's shard of the parameters of one (dtype, device) under ZeRO (Note [sharding]):
    flat device buffers of every parameter, the units of the shard this rank owns; on a
    device, staged through pinned buckets at ``step()`` (no hooks)."""

    def _alloc_buffers(self) -> None:
        opt, dev, dt = self.opt, self.device, self.dtype
        self.flat_grad = torch.zeros(self.total, dtype=dt, device=dev)
        self.flat_param = torch.empty(self.total, dtype=dt, device=dev)
        lo = opt._rank * self.shard
        self.grad_shard = (
            torch.empty(self.shard, dtype=dt, device=dev)
            if opt._reduce_grads
            else self.flat_grad[lo : lo + self.shard]
        )
        self.param_shard = torch.empty(self.shard, dtype=dt, device=dev)
        super()._alloc_buffers()
        if not self.staged:  # the kernel works on the CPU shard buffers directly
            at = np.array([u[3] for u in self.units], dtype=np.uint64) * np.uint64(self.esize)
            self.grad_addr[:] = np.uint64(self.grad_shard.data_ptr()) + at
            self.out_addr[:] = np.uint64(self.param_shard.data_ptr()) + at

    def step(self, hyper: np.ndarray) -> np.ndarray:
        return self._step_sharded(hyper)

    def export(self, steps: np.ndarray) -> Dict[int, Dict[str, torch.Tensor]]:
        """Full state of every member with state, as stored, gathered from every rank (the
        scales of 8-bit state per block of the flat buffer: the shard and each parameter
        start on a block)."""
        has_state = [steps[i] > 0 for i in self.members]
        rows = [ui for ui, u in enumerate(self.units) if has_state[u[0]]]
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        import torch.distributed as dist

        shard = {n: self._column(n, self.shard).zero_() for n in self._names()}

        def addr(ui: int, name: str) -> int:
            t = shard[name]
            at = formats.part(name, self.units[ui][3], 1).start
            return t.data_ptr() + at * t.element_size()

        self._export_rows(rows, addr)
        for name in self._names():
            full = self._column(name, self.total)
            part = shard[name]
            if self.device.type != "cpu":  # nccl gathers device tensors
                part, full = part.to(self.device), full.to(self.device)
            self.opt._collective(dist.all_gather_into_tensor, full, part)
            full = full.cpu()
            for k, p in enumerate(self.params):
                if has_state[k]:
                    piece = full[formats.part(name, self.offsets[k], self.numels[k])].clone()
                    out.setdefault(k, {})[name] = (
                        piece if name in formats.SCALES else piece.view(p.shape)
                    )
        return out

    def _layout(self) -> None:
        world, rank = self.opt._world, self.opt._rank
        self.offsets, self.total, self.shard = shard_layout(self.numels, world, self.align)
        for k, (off, n) in enumerate(zip(self.offsets, self.numels)):
            a, b = owned_range(off, n, self.shard, rank)
            if a < b:
                self._add_units(k, a - off, b - a, a - rank * self.shard)

    def _step_sharded(self, hyper: np.ndarray) -> np.ndarray:
        """Note [sharding]."""
        import torch.distributed as dist

        opt = self.opt
        has = torch.tensor(
            [p.grad is not None for p in self.params], dtype=torch.int32, device=self.device
        )
        opt._collective(dist.all_reduce, has, op=dist.ReduceOp.MAX)
        has_np = has.cpu().numpy().astype(bool)
        if not has_np.any():
            return np.zeros(0, dtype=np.int64)
        for k, p in enumerate(self.params):
            self._check(p)
            dst = self.flat_grad[self.offsets[k] : self.offsets[k] + self.numels[k]]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
        scale = 1.0
        if opt._reduce_grads:  # summed here, scaled by 1/world in the kernel
            opt._collective(dist.reduce_scatter_tensor, self.grad_shard, self.flat_grad)
            scale = 1.0 / opt._world
        for k, start, n, at in self.units:
            src = self.params[k].detach().reshape(-1)
            self.param_shard[at : at + n].copy_(src[start : start + n])
        active = np.array([has_np[u[0]] for u in self.units], dtype=bool)
        if self.staged:  # Note [sharded copies]
            copies = self.copies
            todo = []
            for b, (bucket, f_lo, f_hi, g, o) in enumerate(self.buckets):
                rows = np.asarray([ui for ui in bucket if active[ui]], dtype=np.int64)
                if not len(rows):
                    continue
                self._wait_h2d(b)  # last step's copy back reads o: long done (has.cpu() above)
                evs = [
                    copies.to_host(g, self.grad_shard[f_lo:f_hi]),
                    copies.to_host(o, self.param_shard[f_lo:f_hi]),
                ]
                todo.append((b, rows, evs))
            for b, rows, evs in todo:
                for ev in evs:
                    copies.wait(ev)
                f_lo, f_hi, o = self.buckets[b][1], self.buckets[b][2], self.buckets[b][4]
                self._fill_hyper(rows, hyper, scale)
                self.state.step(self._flat_records(rows))
                self.h2d_events[b] = [copies.to_device(self.param_shard[f_lo:f_hi], o)]
        elif active.any():
            rows = np.nonzero(active)[0]
            self._fill_hyper(rows, hyper, scale)
            self.state.step(self._flat_records(rows))
        opt._collective(dist.all_gather_into_tensor, self.flat_param, self.param_shard)
        updated = np.nonzero(has_np)[0].tolist()
        with torch.no_grad():
            for k in updated:
                p = self.params[k]
                off = self.offsets[k]
                p.copy_(self.flat_param[off : off + self.numels[k]].view_as(p))
        return np.asarray([self.members[k] for k in updated], dtype=np.int64)
