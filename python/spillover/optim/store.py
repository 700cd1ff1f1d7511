"""The state spaces of ``OffloadAdamW``: which parameters have state, where, on which rank.

Note [collectives at exit]
    A gloo collective called from Python hands its tensors to a worker thread, which drops its
    reference to the work (and so to the tensors) only after the caller's ``wait()`` returned.
    On torch 2.15 a tensor that C++ also references holds a reference to its Python object,
    and dropping the last C++ reference decrefs that object: the gloo thread takes the GIL. A
    step's last collective is the parameter all-gather; when the script ends right after it
    (``dist.destroy_process_group()`` does not stop a group DDP still holds), the gloo thread
    can ask for the GIL once the interpreter is finalizing, and Python ends the thread with
    ``pthread_exit`` inside a C++ destructor: "terminate called without an active exception",
    SIGABRT at exit (seen on a core dump of the README's DDP snippet, about 1 run in 10 on 2
    cores). So every collective here is started with ``async_op=True``, waited for, and its
    work kept until the next ``step()``: the gloo thread's release is then never the last one,
    and the tensors are freed by the thread that holds the GIL.

Note [lazy state]
    As in torch, a parameter has no state until the first step at which it has a gradient: no
    pool blocks, no swap slots, no ``state_dict`` entry. ``step()`` first gives the parameters
    that have a gradient now and no state yet a state space of their own (one per dtype and
    device, laid out over just them), then steps every space. In the usual loop every
    trainable parameter joins at the first step, so there is one space per dtype and device;
    frozen parameters, and parameters that never receive a gradient, cost a check per step and
    nothing else. A parameter that starts receiving gradients later (unfrozen after a warm-up)
    gets a new space then, at no cost to the existing ones. A parameter that stops receiving
    them keeps its state and is skipped, as in torch. ``load_state_dict`` replaces the spaces
    by new ones for exactly the parameters the checkpoint holds state for.

    Under sharding every rank must build the same spaces, so the candidates are the parameters
    without state that have ``requires_grad=True`` (it must agree across ranks, as DDP also
    requires), and one MAX all-reduce over them decides which of them have a gradient on some
    rank; those join together, sharded over a flat layout of just themselves (Note
    [sharding]). A parameter whose ``requires_grad`` is switched on later joins at the first
    step at which a rank has its gradient; one switched off keeps its state. A gradient
    assigned by hand to a parameter with ``requires_grad=False`` and no state is refused with
    a RuntimeError under sharding (the other ranks could not know of it).

"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .layout import (
    _ALIGN,
    _CUMULATIVE,
    _NVME_CHUNK_BYTES,
    _check_dtype,
    _float,
    _is_dtensor,
    _local,
    _round_up,
)
from .space import _check_numel, _Space


class StateStore:
    """The state spaces half of ``OffloadAdamW`` (a base class): the parameters' global
    indices, their step counts, the spaces that hold their state (Note [lazy state]) and the
    ranks those are sharded over (Note [sharding] in sharded.py)."""

    # What OffloadAdamW provides (adamw.py).
    param_groups: List[Dict[str, Any]]
    _tier: str
    _chunk_bytes: Optional[int]
    _nvme_buffers: int
    _force_staging: bool
    _inbwd: bool
    _past: Dict[str, float]
    _settle: Any
    _spaces: List[_Space]  # Note [lazy state]: grows as parameters get gradients

    # ---- construction ----

    def _setup_distributed(self, shard: Optional[bool], pg: Any) -> None:
        self._pg = pg
        self._works: List[Any] = []  # Note [collectives at exit]
        self._world, self._rank = 1, 0
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if shard:
                raise RuntimeError("OffloadAdamW(shard=True) needs torch.distributed initialised")
            return
        world = dist.get_world_size(pg)
        dtensors = any(_is_dtensor(p) for g in self.param_groups for p in g["params"])
        if shard is None:
            shard = world > 1 and not dtensors
        if shard and dtensors:
            raise ValueError(
                "OffloadAdamW: parameters are DTensors (FSDP2) and already sharded; pass "
                "shard=False to run the optimizer on each rank's local shards"
            )
        if shard and world > 1:
            self._world, self._rank = world, dist.get_rank(pg)

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """``fn(*args, group=self._pg)``, waited for, its work kept until the next ``step()``
        (Note [collectives at exit])."""
        work = fn(*args, group=self._pg, async_op=True, **kwargs)
        work.wait()
        self._works.append(work)

    def _pool_need(self) -> int:
        """Pool bytes the parameters that require grad now can lease (Note [node budget] in
        _runtime.py): per kind of parameter, this rank's part of the state (host tier: fp32
        exp_avg, exp_avg_sq and a master copy where one is kept; NVMe tier: the pipeline's
        buffers) and, on the staged path, the gradient and output staging buffers."""
        kinds: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    lp = _local(p)
                    key = (lp.dtype, lp.device)
                    kinds[key] = kinds.get(key, 0) + _round_up(lp.numel(), _ALIGN)
        need = 0
        for (dtype, device), n in kinds.items():
            n = -(-n // self._world) + _ALIGN if self._world > 1 else n
            staged = device.type != "cpu" or self._force_staging or self._inbwd
            cols = 3 if dtype != torch.float32 or staged else 2
            if self._tier == "host":
                need += n * cols * 4
            else:
                need += self._nvme_buffers * (self._chunk_bytes or _NVME_CHUNK_BYTES)
            if staged:
                need += 2 * n * torch.empty((), dtype=dtype).element_size()
        return need

    def _index(self) -> None:
        """Global indices of the parameters, in group order. Parameters added by
        ``add_param_group`` go at the end, so the indices the spaces hold stay valid."""
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of = np.array(
            [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]], dtype=np.int64
        )
        n = len(self._params)
        old_steps = getattr(self, "_steps", np.zeros(0))
        old_stateful = getattr(self, "_stateful", np.zeros(0, dtype=bool))
        self._steps = np.zeros(n, dtype=np.float64)
        self._steps[: len(old_steps)] = old_steps
        self._stateful = np.zeros(n, dtype=bool)  # has a state space (Note [lazy state])
        self._stateful[: len(old_stateful)] = old_stateful
        for p in self._params:
            if p.requires_grad:  # refused now rather than at the first step
                _check_dtype(_local(p).dtype)

    def _add_spaces(self, members: List[int]) -> None:
        """New state spaces for `members` (global indices without state), one per kind."""
        for (dt, dev), idx in self._kinds(members).items():
            self._spaces.append(_Space(self, dt, dev, idx))
            self._stateful[idx] = True

    def _kinds(self, members: List[int]) -> Dict[Tuple[torch.dtype, torch.device], List[int]]:
        kinds: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for i in members:
            lp = _local(self._params[i])
            _check_dtype(lp.dtype)
            kinds.setdefault((lp.dtype, lp.device), []).append(i)
        return kinds

    def _grow(self) -> None:
        """Note [lazy state]: state for the parameters that have a gradient now and none yet."""
        pending = np.nonzero(~self._stateful)[0].tolist()
        if not pending:
            return
        if self._world == 1:
            self._add_spaces([i for i in pending if self._params[i].grad is not None])
            return
        import torch.distributed as dist

        candidates = []
        for i in pending:
            p = self._params[i]
            if p.requires_grad:
                candidates.append(i)
            elif p.grad is not None:
                raise RuntimeError(
                    f"OffloadAdamW: parameter {i} has a gradient but requires_grad=False; "
                    "sharded state is given only to parameters that require grad on every rank "
                    "(Note [lazy state] in spillover/optim/store.py)"
                )
        for (_, dev), idx in self._kinds(candidates).items():
            has = torch.tensor(
                [self._params[i].grad is not None for i in idx], dtype=torch.int32, device=dev
            )
            self._collective(dist.all_reduce, has, op=dist.ReduceOp.MAX)
            self._add_spaces([i for i, h in zip(idx, has.cpu().tolist()) if h])

    def _drop_spaces(self) -> None:
        """Free every space's state, keeping its I/O and time counters for ``stats()``."""
        for s in self._spaces:
            for st in (s.state, s.undo_state):
                for k, v in (st.stats() if st is not None else {}).items():
                    if k in _CUMULATIVE:
                        self._past[k] = self._past.get(k, 0) + v
            for k, v in s.counters.items():
                self._past[k] = self._past.get(k, 0) + v
            s.close()
        self._spaces = []
        self._stateful[:] = False

    # ---- checkpoints ----

    def _gather_state(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """{global index: {'step', 'exp_avg', 'exp_avg_sq'[, 'master']}} for params with state."""
        self._settle("state_dict()")
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for space in self._spaces:
            for k, cols in space.export(self._steps).items():
                i = space.members[k]
                entry = {"step": torch.tensor(self._steps[i], dtype=torch.float32)}
                entry.update(cols)
                state[i] = entry
        return state

    def _load_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Replace every space by new ones for the parameters `state` has (a positive step
        count) for (Note [lazy state]); the others have no state afterwards."""
        members = sorted(i for i, st in state.items() if _float(st.get("step", 0)) > 0)
        for i in members:  # refuse a bad checkpoint before dropping the state there is
            for name in ("exp_avg", "exp_avg_sq"):
                _check_numel(state[i][name], self._params[i], name)
        self._drop_spaces()
        self._steps[:] = 0
        for i in members:
            self._steps[i] = _float(state[i]["step"])
        first = len(self._spaces)
        self._add_spaces(members)
        for space in self._spaces[first:]:
            space.load({k: state[i] for k, i in enumerate(space.members)})
