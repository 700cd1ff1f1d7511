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

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from . import formats
from .layout import (
    _ALIGN,
    _CUMULATIVE,
    _HOST_CHUNK_BYTES,
    _NVME_CHUNK_BYTES,
    BUFFER_RECORD,
    _check_dtype,
    _float,
    _is_dtensor,
    _local,
    _round_up,
    owned_range,
    shard_layout,
)
from .sharded import ShardedSpace
from .space import DirectSpace, _check_numel, _flat_f32, _Space
from .staged import StagedSpace


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
    _link: Any
    _hook_copies: bool
    _inbwd: bool
    _delayed: bool
    _predict: str
    _threads: Callable[[], int]
    _state_bits: int
    _master_weights: bool
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
        _runtime.py): per kind of parameter, this rank's part of the state (host tier:
        exp_avg, exp_avg_sq as stored and a master copy where one is kept, Note [state
        formats]; NVMe tier: the pipeline's buffers) and, on the staged path, the gradient and
        output staging buffers (and the delayed update's bf16 coefficients: Note [next-gradient
        prediction] in rust/optim/predict.rs)."""
        kinds: Dict[Tuple[torch.dtype, torch.device], int] = {}
        align = formats.BLOCK if self._state_bits == 8 else _ALIGN  # Note [block alignment]
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    lp = _local(p)
                    key = (lp.dtype, lp.device)
                    kinds[key] = kinds.get(key, 0) + _round_up(lp.numel(), align)
        need = 0
        for (dtype, device), n in kinds.items():
            n = -(-n // self._world) + formats.BLOCK if self._world > 1 else n
            staged = self._stages(device)
            per = formats.bytes_per_param(self._state_bits, self._keeps_master(dtype, device))
            if self._tier == "host":
                need += int(n * per)
                if self._state_bits != 32:  # byte columns end on cache lines: 8 KiB a chunk
                    need += 8192 * (1 + int(n * per) // _HOST_CHUNK_BYTES)
            else:
                need += self._nvme_buffers * (self._chunk_bytes or _NVME_CHUNK_BYTES)
            if staged:
                need += 2 * n * torch.empty((), dtype=dtype).element_size()
                if self._predict == "gradient":  # Note [next-gradient prediction]: bf16
                    need += 2 * n
        return need

    def _keeps_master(self, dtype: torch.dtype, device: torch.device) -> bool:
        """Whether parameters of `dtype` on `device` get an fp32 master column (Note [state
        formats]): not when an fp32 parameter on the CPU is its own, nor with
        ``master_weights=False`` (the parameter, or its staged copy, is the value updated)."""
        return (dtype != torch.float32 or self._stages(device)) and self._master_weights

    def _stages(self, device: torch.device) -> bool:
        """Whether the parameters on `device` take the staged path (Note [staged gradients]
        in staged.py): on a device, or for update_in_backward (Note [update in backward]) and
        overlap="delayed" (Note [delayed update])."""
        return device.type != "cpu" or self._force_staging or self._inbwd or self._delayed

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
            kind = (
                ShardedSpace
                if self._world > 1
                else StagedSpace if self._stages(dev) else DirectSpace
            )
            self._spaces.append(kind(self, dt, dev, idx))
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
        """{global index: {'step', 'exp_avg', 'exp_avg_sq'[, 'master'][, scales]}} for params
        with state, as stored (Note [state formats])."""
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
        count) for (Note [lazy state]); the others have no state afterwards. Entries of
        another format than this optimizer's are converted, with one warning (Note [state
        formats])."""
        members = sorted(i for i, st in state.items() if _float(st.get("step", 0)) > 0)
        flat: Dict[int, Dict[str, torch.Tensor]] = {}
        other: Dict[int, int] = {}  # format -> entries converted from it
        for i in members:  # refuse a bad checkpoint before dropping the state there is
            p = self._params[i]
            n = _local(p).numel()
            what = f"OffloadAdamW.load_state_dict: state of parameter {i}"
            bits = formats.entry_bits(state[i], what)
            cols = {}
            for c in formats.columns(bits, False):
                t = state[i][c]
                t = _check_numel(t, p, c) if c in formats.MOMENTS else torch.as_tensor(t)
                if t.numel() != formats.numel(c, n):
                    raise ValueError(
                        f"{what}: '{c}' has {t.numel()} elements, {formats.numel(c, n)} expected"
                    )
                cols[c] = t.detach().to("cpu").reshape(-1).contiguous()
            if bits != self._state_bits:
                cols = formats.to_f32(cols, bits)
                other[bits] = other.get(bits, 0) + 1
            if state[i].get("master") is not None:  # else it starts from the parameter
                cols["master"] = _flat_f32(state[i]["master"], p, "master")
            flat[i] = cols
        for bits, count in other.items():
            warn_conversion(bits, self._state_bits, count, "load_state_dict")
        self.import_state(
            {i: _float(state[i]["step"]) for i in members},
            lambda u: {
                c: t[formats.part(c, u.start, u.length)] for c, t in flat[u.param].items()
            },
        )

    # ---- the state-store interface (spillover.dcp saves and loads through it) ----

    def keeps_master(self, index: int) -> bool:
        """Whether parameter `index` (in ``param_groups`` order) has, once it has state, an
        fp32 master copy among its state (``"master"`` in its units' columns): when it is not
        its own fp32 master (bf16, or on a device) or its gradients are staged
        (``update_in_backward``), unless ``master_weights=False``."""
        lp = _local(self._params[index])
        return self._keeps_master(lp.dtype, lp.device)

    @property
    def state_bits(self) -> int:
        """How the moments are stored: 32, 16 or 8 (Note [state formats])."""
        return self._state_bits

    def has_state(self, index: int) -> bool:
        """Whether parameter `index` has state now (Note [lazy state])."""
        return bool(self._stateful[index])

    def state_steps(self) -> Dict[int, float]:
        """The step count of every parameter that took a step, by index."""
        return {int(i): float(self._steps[i]) for i in np.nonzero(self._steps)[0]}

    def state_units(self, what: str = "reading the optimizer's state") -> List[StateUnit]:
        """The units of state this rank holds for the parameters that took a step, in
        parameter and element order. Waits for the updates made during backward; refused
        between such a backward and its ``step()`` (naming `what`)."""
        self._settle(what)
        out = [
            StateUnit(space.members[k], start, n, space._names(), space.sharded, space, ui,
                      space.bits)
            for space in self._spaces
            for ui, (k, start, n, _) in enumerate(space.units)
            if self._steps[space.members[k]] > 0
        ]
        return sorted(out, key=lambda u: (u.param, u.start))

    def export_unit(self, unit: StateUnit) -> Dict[str, torch.Tensor]:
        """The state of `unit` now, as stored: one new 1-D tensor per column (``unit.dtype(c)``
        of ``unit.numel(c)`` elements)."""
        cols = {c: torch.empty(unit.numel(c), dtype=unit.dtype(c)) for c in unit.columns}
        rec = np.zeros(1, BUFFER_RECORD)
        rec["unit"] = unit._row
        for c, t in cols.items():
            rec[c] = t.data_ptr()
        unit._space.state.export_state(rec.tobytes())
        return cols

    def owned_ranges(self, members: List[int]) -> Dict[int, Tuple[int, int]]:
        """{index: (start, end)} of each flattened local parameter (a DTensor's local shard)
        this rank will hold the state of once exactly `members` have state (Note [sharding]
        in sharded.py); a parameter of which it holds nothing is left out."""
        out: Dict[int, Tuple[int, int]] = {}
        if self._world == 1:
            for i in members:
                n = _local(self._params[i]).numel()
                if n:
                    out[i] = (0, n)
            return out
        for idx in self._kinds(members).values():
            numels = [_local(self._params[i]).numel() for i in idx]
            align = formats.BLOCK if self._state_bits == 8 else _ALIGN
            offsets, _, shard = shard_layout(numels, self._world, align)
            for i, off, n in zip(idx, offsets, numels):
                a, b = owned_range(off, n, shard, self._rank)
                if a < b:
                    out[i] = (a - off, b - off)
        return out

    def import_state(
        self, steps: Dict[int, float], read: Callable[[StateUnit], Dict[str, torch.Tensor]]
    ) -> None:
        """Replace all state by state for exactly the parameters in `steps` (index: step
        count), laid out as ``owned_ranges`` says; each new unit's columns are ``read(unit)``:
        1-D CPU tensors, either as stored (``unit.columns``, ``unit.dtype(c)``, exact) or
        fp32 ``exp_avg`` / ``exp_avg_sq`` values without scales (quantized as they are
        imported: a conversion, Note [state formats]); a missing ``"master"`` starts from the
        parameter."""
        self._drop_spaces()
        self._steps[:] = 0
        for i, s in steps.items():
            self._steps[i] = s
        first = len(self._spaces)
        self._add_spaces(sorted(steps))
        for space in self._spaces[first:]:
            if not space.units:
                continue
            forms: Dict[str, List[Any]] = {"stored": [], "f32": []}
            keep = []
            for ui, (k, start, n, _) in enumerate(space.units):
                unit = StateUnit(
                    space.members[k], start, n, space._names(), space.sharded, space, ui,
                    space.bits,
                )
                cols = dict(read(unit))
                if cols.get("master") is None and "master" in unit.columns:
                    flat = _local(space.params[k]).detach().reshape(-1)
                    cols["master"] = flat[start : start + n].to("cpu", torch.float32)
                form = unit.form_of(cols)
                rec = np.zeros(1, BUFFER_RECORD)
                rec["unit"] = ui
                for c in unit.columns if form == "stored" else unit.columns_f32:
                    t = cols[c].contiguous()
                    keep.append(t)
                    rec[c] = t.data_ptr()
                forms[form].append(rec)
            for form, recs in forms.items():
                if recs:
                    space.state.import_state(np.concatenate(recs).tobytes(), form=form)
            del keep
            if isinstance(space, StagedSpace):  # Note [update in backward]: loaded units can
                space.inited = np.asarray(space.state.initialized(), dtype=bool)  # update then
                if not space.master:
                    space.fill_outputs()  # the staged copy is the value updated


def warn_conversion(src: int, dst: int, count: int, how: str) -> None:
    """Note [state formats]: one warning per conversion a load makes."""
    import warnings

    lost = (
        "rounded into the lower precision of the optimizer's format"
        if dst < src
        else "exact in value; what the checkpoint's quantization lost stays lost"
    )
    warnings.warn(
        f"OffloadAdamW ({how}): the checkpoint holds {formats.FORMAT_NAMES[src]} state "
        f"(state_bits={src}) for {count} parameter(s) and this optimizer keeps state_bits={dst}; "
        f"converted through fp32 ({lost}). Build the optimizer with state_bits={src} to load "
        "it as it is.",
        UserWarning,
        stacklevel=3,
    )


class StateUnit:
    """One unit of the state one rank holds (the state-store interface): elements
    [start, start + length) of the flattened local tensor of parameter `param` (index in
    ``param_groups`` order), its `columns` (``"master"`` when kept, ``"exp_avg"``,
    ``"exp_avg_sq"``, and the scales of 8-bit state: Note [state formats]), stored as `bits`,
    and whether it is this rank's part of a ZeRO-sharded layout (no other rank holds it) or a
    replica (every rank holds the same)."""

    __slots__ = ("param", "start", "length", "columns", "sharded", "_space", "_row", "bits")

    def __init__(
        self,
        param: int,
        start: int,
        length: int,
        columns: Tuple[str, ...],
        sharded: bool,
        space: Any,
        row: int,
        bits: int = 32,
    ):
        self.param, self.start, self.length, self.columns = param, start, length, columns
        self.sharded, self._space, self._row, self.bits = sharded, space, row, bits

    def dtype(self, col: str) -> torch.dtype:
        """The dtype of column `col` as stored."""
        return formats.dtype(self.bits, col)

    def numel(self, col: str) -> int:
        """Elements of column `col` (the scales: one per block of 256)."""
        return formats.numel(col, self.length)

    @property
    def columns_f32(self) -> Tuple[str, ...]:
        """The columns of the fp32 form (a conversion)."""
        return tuple(c for c in self.columns if c not in formats.SCALES)

    def form_of(self, cols: Dict[str, torch.Tensor]) -> str:
        """``"stored"`` when `cols` holds this unit's columns as stored, ``"f32"`` when fp32
        moments to convert; a ValueError naming what is missing otherwise."""
        def fits(names: Tuple[str, ...], dtype: Any) -> bool:
            return all(
                isinstance(cols.get(c), torch.Tensor)
                and cols[c].dtype == (dtype or self.dtype(c))
                and cols[c].numel() == self.numel(c)
                for c in names
            )

        if fits(self.columns, None):
            return "stored"
        master_ok = "master" not in self.columns or fits(("master",), None)
        if master_ok and fits(formats.MOMENTS, torch.float32):
            return "f32"
        got = {c: (tuple(t.shape), t.dtype) for c, t in cols.items() if hasattr(t, "dtype")}
        raise ValueError(
            f"OffloadAdamW.import_state: parameter {self.param} [{self.start}, "
            f"{self.start + self.length}): expected "
            f"{ {c: (self.numel(c), self.dtype(c)) for c in self.columns} } as stored, or "
            f"fp32 exp_avg / exp_avg_sq of {self.length} elements; got {got}"
        )
