"""Resumable sharded checkpoints of :class:`spillover.OffloadAdamW` through
``torch.distributed.checkpoint`` (DCP).

::

    import torch.distributed.checkpoint as dcp
    import spillover.dcp

    state = {"model": model.state_dict(), "optim": spillover.dcp.optimizer_state(opt)}
    dcp.save(state, storage_writer=spillover.dcp.FileSystemWriter("ckpt/step-100"))
    ...
    state = {"model": model.state_dict(), "optim": spillover.dcp.optimizer_state(opt)}
    dcp.load(state, checkpoint_id="ckpt/step-100")      # any world size, any tier
    model.load_state_dict(state["model"])

What a checkpoint holds
    Per parameter with state (Note [lazy state] in optim/store.py: a parameter that never had a
    gradient has no entries), keyed by its name (``named_parameters`` given to
    :func:`optimizer_state`, else its index in the optimizer's parameter order):
    ``state.<name>.exp_avg``, ``state.<name>.exp_avg_sq`` and, for parameters that keep an fp32
    master copy (bf16, or on a GPU), ``state.<name>.master``: 1-D fp32 tensors of the *flattened*
    parameter's numel, whatever the world size, tier or sharding that wrote them. ``meta`` is a
    JSON string with every parameter's step count and the param groups' hyper-parameters.

Note [pieces, produced when asked]
    Each rank presents only the elements it owns (Note [sharding] in optim/sharded.py: a contiguous
    range of each flattened parameter; with FSDP2 the range of the parameter's local shard),
    as chunks of at most ``piece_bytes``, and produces a chunk only when DCP's writer asks for
    it (DCP's ``_Checkpointable`` protocol: ``__create_write_items__`` at planning,
    ``__get_tensor_shard__`` when the writer resolves the item; DTensor is the reference). A
    chunk is read out of the optimizer's state (pool or NVMe) through one *unit* of the
    optimizer's layout at a time: the unit's columns are exported once, the pieces of that unit
    are copied out of them, and the export is dropped when another unit is asked for. So what
    the optimizer contributes to a rank's peak during ``dcp.save`` is one unit's columns (the
    rank's part of one parameter; at most 16 Mi elements on the staged GPU path) plus one
    piece, not its shard and never the full state.

Note [DCP's writer holds a file's tensors]
    torch's ``FileSystemWriter`` keeps a reference to every tensor it wrote into a file until
    the file is closed (``_write_files_from_queue`` collects them in ``tensor_dict`` for the
    safetensors format, even when writing torch.save records), and with the default
    ``single_file_per_rank=True`` a rank writes one file (per ``thread_count``). However lazily
    the chunks are produced, the whole shard is then resident at the end of the save.
    :class:`FileSystemWriter` here is torch's, with the rank's items split into files of at
    most ``file_bytes`` each, so at most one file's worth of chunks is held at a time; it also
    resolves items in plan order (``per_thread_copy_ahead=0``: torch's overlapping loader, used
    when CUDA is available, sorts items by size and resolves ahead, which would make the
    optimizer export a unit once per piece). The files it writes are ordinary DCP files:
    ``dcp.load`` with torch's reader reads them. torch's own writer works too, without the
    bound.

Note [which parameters a load expects]
    DCP plans a load from the target state dict, before it has read anything, and every target
    key must exist in the checkpoint. The targets are the parameters with state now, plus every
    parameter with ``requires_grad=True`` — right when every trainable parameter had taken a
    step when the checkpoint was written (the usual case), and with a ``master`` column for the
    parameters that keep one here. When some had not (unused, or frozen then), or the checkpoint
    has no master copies (written where the parameters were fp32 on a CPU: each is its own
    master there), pass ``checkpoint=<path>`` (or the checkpoint's DCP ``Metadata``): the
    targets are then read from it, and a missing master starts from the parameter, as
    ``OffloadAdamW.load_state_dict`` does. A checkpoint holding state for a parameter that was
    not a target is refused at ``load_state_dict`` (nothing is dropped silently).

Note [loading]
    A rank reads exactly the ranges it will own at the current world size (the layout of Note
    [sharding] for the parameters that have state in the checkpoint), into buffers of that size
    (its own shard, never the full state), then replaces the optimizer's state spaces by new
    ones for exactly those parameters and imports each unit from the buffers. DCP reads each
    stored chunk whole, so a load holds one stored piece besides the rank's shard.
"""

from __future__ import annotations

import json
import math
import queue
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .optim import OffloadAdamW
from .optim.layout import _ALIGN, _is_dtensor
from .optim.store import StateUnit

__all__ = ["FileSystemWriter", "OptimizerState", "optimizer_state"]  # noqa: F822 (__getattr__)

_FORMAT = 1
_COLUMNS = ("master", "exp_avg", "exp_avg_sq")


def optimizer_state(
    opt: OffloadAdamW,
    named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
    *,
    checkpoint: Any = None,
    piece_bytes: int = 32 << 20,
) -> OptimizerState:
    """A ``torch.distributed.checkpoint.stateful.Stateful`` for ``opt``'s state: put it in the
    dict given to ``dcp.save`` / ``dcp.load`` (module docstring).

    Args:
        opt: the :class:`spillover.OffloadAdamW` (any tier; ZeRO-sharded, FSDP2 or one rank).
        named_parameters: ``model.named_parameters()``: keys the state by parameter name (stable
            when parameters are added or reordered) instead of by position in the optimizer.
        checkpoint: for a load, the checkpoint directory (or its DCP ``Metadata``) to read which
            parameters have state from (Note [which parameters a load expects]).
        piece_bytes: largest chunk written per column (Note [pieces, produced when asked]).
    """
    return OptimizerState(opt, named_parameters, checkpoint=checkpoint, piece_bytes=piece_bytes)


class OptimizerState:
    """See :func:`optimizer_state`. A ``torch.distributed.checkpoint.stateful.Stateful`` (that
    protocol is checked by its two methods, so this module imports DCP only when used)."""

    def __init__(
        self,
        opt: OffloadAdamW,
        named_parameters: Optional[Iterable[Tuple[str, torch.nn.Parameter]]] = None,
        *,
        checkpoint: Any = None,
        piece_bytes: int = 32 << 20,
    ):
        if not isinstance(opt, OffloadAdamW):
            raise TypeError(
                f"spillover.dcp.optimizer_state takes an OffloadAdamW, got {type(opt).__name__}; "
                "for torch's optimizers use torch.distributed.checkpoint.state_dict."
                "get_optimizer_state_dict"
            )
        if piece_bytes < 4 * _ALIGN:
            raise ValueError(f"piece_bytes must be at least {4 * _ALIGN}, got {piece_bytes}")
        self.opt = opt
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.piece = piece_bytes // 4
        self.checkpoint = checkpoint
        self.names = _names(self.params, named_parameters)
        self._cache: Optional[Tuple[StateUnit, Dict[str, torch.Tensor]]] = None
        self._left = 0  # pieces of the cached unit not yet handed to DCP

    # ---- Stateful ----

    def state_dict(self) -> Dict[str, Any]:
        """Lazy columns for the parameters with state (save) or expected in the checkpoint
        (load), and the ``meta`` string. DCP decides which: a column is planned for writing
        (``__create_write_items__``) or for reading (``__create_chunk_list__``)."""
        # Note [update in backward]: never a half-done step
        units = self.opt.state_units("a DCP save or load")
        self._cache = None
        self._expect_set: Optional[set] = None
        saving: Dict[int, List[StateUnit]] = {}
        for u in units:
            saving.setdefault(u.param, []).append(u)
        expect = self._expected()
        state: Dict[str, Any] = {}
        owned = self._predict_layout(sorted(expect))
        self._expect_set = set(expect)
        for i in sorted(set(saving) | set(expect)):
            p = self.params[i]
            mine = saving.get(i)
            written = mine[0].columns if mine else ()
            read = expect.get(i, ())
            state[self.names[i]] = {
                col: _Column(
                    self,
                    i,
                    col,
                    p.numel(),  # a DTensor's numel is the global one
                    save=mine if col in written else None,
                    load=owned.get(i, (0, 0)) if col in read else None,
                )
                for col in _COLUMNS
                if col in written or col in read
            }
        return {"state": state, "meta": self._meta()}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Import what ``dcp.load`` read into the columns (Note [loading])."""
        opt = self.opt
        meta = json.loads(state_dict["meta"])
        if meta.get("format") != _FORMAT:
            raise ValueError(
                f"spillover.dcp: checkpoint format {meta.get('format')!r} is not {_FORMAT}; it "
                "was written by another spillover version"
            )
        index = {n: i for i, n in enumerate(self.names)}
        steps = {n: float(s) for n, s in meta["steps"].items() if float(s) > 0}
        unknown = sorted(set(steps) - set(index))
        if unknown:
            raise ValueError(
                f"spillover.dcp: the checkpoint has state for parameters this optimizer does not "
                f"have: {unknown[:5]}; pass named_parameters= naming them as when it was saved"
            )
        cols = state_dict["state"]
        missed = sorted(n for n in steps if n not in cols)
        if missed:
            raise ValueError(
                f"spillover.dcp: the checkpoint has state for {missed[:5]} but the load did not "
                "ask for it (those parameters had no state and do not require grad here); pass "
                "optimizer_state(opt, checkpoint=<path>) so that the load reads which parameters "
                "have state from the checkpoint (Note [which parameters a load expects])"
            )
        if self._expect_set is not None and set(index[n] for n in steps) != self._expect_set:
            extra = sorted(self.names[i] for i in self._expect_set if self.names[i] not in steps)
            raise ValueError(
                f"spillover.dcp: the load expected state for {extra[:5]}, which the checkpoint "
                "does not have; pass optimizer_state(opt, checkpoint=<path>) so that the load "
                "reads which parameters have state from the checkpoint (Note [which parameters "
                "a load expects])"
            )
        self._load_groups(meta["param_groups"])
        buffers: Dict[int, Dict[str, Tuple[torch.Tensor, int]]] = {}
        for n in steps:
            for col, c in cols[n].items():
                if isinstance(c, _Column) and c.load is not None:
                    buffers.setdefault(index[n], {})[col] = (c.buffer(), c.load[0])
        opt.import_state(
            {index[n]: s for n, s in steps.items()},
            lambda unit: _read_unit(unit, self.params[unit.param], buffers, self.names),
        )
        self._cache = None

    # ---- helpers ----

    def _expected(self) -> Dict[int, Tuple[str, ...]]:
        """{index: columns} a load reads (Note [which parameters a load expects])."""
        opt = self.opt
        if self.checkpoint is not None:
            md = self.checkpoint
            if not hasattr(md, "state_dict_metadata"):
                from torch.distributed.checkpoint import FileSystemReader

                md = FileSystemReader(str(md)).read_metadata()
            keys = set(md.state_dict_metadata)
            out = {}
            for i, n in enumerate(self.names):
                have = tuple(c for c in _COLUMNS if _any_key(keys, n, c))
                if have:
                    out[i] = have if opt.keeps_master(i) else tuple(
                        c for c in have if c != "master"
                    )
            return out
        out = {}
        for i, p in enumerate(self.params):
            if p.requires_grad or opt.has_state(i):
                out[i] = _COLUMNS if opt.keeps_master(i) else _COLUMNS[1:]
        return out

    def _meta(self) -> str:
        opt = self.opt
        groups = []
        at = 0
        for g in opt.param_groups:
            hyper = {}
            for k, v in g.items():
                if k == "params":
                    continue
                if isinstance(v, torch.Tensor):
                    v = v.tolist()
                elif isinstance(v, tuple):
                    v = [x.item() if isinstance(x, torch.Tensor) else x for x in v]
                try:
                    json.dumps(v)
                except TypeError:
                    continue  # not a hyper-parameter a checkpoint can carry (a callable, ...)
                hyper[k] = v
            hyper["params"] = self.names[at : at + len(g["params"])]
            at += len(g["params"])
            groups.append(hyper)
        steps = {self.names[i]: s for i, s in opt.state_steps().items()}
        return json.dumps({"format": _FORMAT, "steps": steps, "param_groups": groups})

    def _load_groups(self, saved: List[Dict[str, Any]]) -> None:
        opt = self.opt
        if len(saved) != len(opt.param_groups):
            raise ValueError(
                f"spillover.dcp: the checkpoint has {len(saved)} param groups, the optimizer "
                f"{len(opt.param_groups)}; build the optimizer with the same groups"
            )
        at = 0
        for gi, (g, s) in enumerate(zip(opt.param_groups, saved)):
            mine = self.names[at : at + len(g["params"])]
            at += len(g["params"])
            if list(s["params"]) != mine:
                raise ValueError(
                    f"spillover.dcp: param group {gi} holds {len(s['params'])} parameters in the "
                    f"checkpoint and {len(mine)} here (or other names); build the optimizer "
                    "with the same groups and parameter names"
                )
        for g, s in zip(opt.param_groups, saved):
            for k, v in s.items():
                if k != "params":
                    g[k] = tuple(v) if k == "betas" else v

    def _unit_columns(self, unit: StateUnit) -> Dict[str, torch.Tensor]:
        """One unit's columns, exported once (Note [pieces, produced when asked])."""
        if self._cache is not None and self._cache[0] is unit:
            return self._cache[1]
        self._cache = None  # drop the previous unit before exporting the next
        cols = self.opt.export_unit(unit)
        self._cache = (unit, cols)
        self._left = -(-unit.length // self.piece) * len(cols)
        return cols

    def _predict_layout(self, members: List[int]) -> Dict[int, Tuple[int, int]]:
        """{index: (start, end)} of the flattened global parameter this rank will own once
        the optimizer has state for exactly `members` (Note [sharding]; checked at import)."""
        out = {}
        for i, (a, b) in self.opt.owned_ranges(members).items():
            p = self.params[i]
            base = _dtensor_range(p)[0] if _is_dtensor(p) else 0
            out[i] = (base + a, base + b)
        return out

    def _served(self) -> None:
        """One piece of the cached unit was handed to DCP; drop the export after the last."""
        self._left -= 1
        if self._left <= 0:
            self._cache = None


def _any_key(keys: Any, name: str, col: str) -> bool:
    tail = f"state.{name}.{col}"
    return any(k == tail or k.endswith("." + tail) for k in keys)


def _names(params: List[torch.Tensor], named: Optional[Iterable[Tuple[str, Any]]]) -> List[str]:
    if named is None:
        return [str(i) for i in range(len(params))]
    by_id: Dict[int, str] = {}
    for n, p in named:
        by_id.setdefault(id(p), n)
    out = []
    for i, p in enumerate(params):
        n = by_id.get(id(p))
        if n is None:
            raise ValueError(
                f"spillover.dcp: optimizer parameter {i} (shape {tuple(p.shape)}) is not in "
                "named_parameters; pass the named_parameters() of the module that owns every "
                "parameter the optimizer holds"
            )
        out.append(n)
    if len(set(out)) != len(out):
        raise ValueError("spillover.dcp: two optimizer parameters have the same name")
    return out


def _dtensor_range(p: torch.Tensor) -> Tuple[int, int, bool]:
    """(start, length, writes) of a DTensor's local shard in the flattened global parameter;
    `writes` is False for a replica that another rank writes."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = p.device_mesh
    shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, p.placements)
    if list(shape[1:]) != list(p.shape[1:]):
        raise ValueError(
            f"spillover.dcp: a DTensor parameter with placements {p.placements} is sharded "
            "along a dimension other than 0 (tensor parallel); spillover.dcp saves Shard(0) and "
            "Replicate placements (FSDP2, HSDP): save this optimizer with its state_dict() "
            "instead"
        )
    writes = True
    coord = mesh.get_coordinate() or []
    for dim, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            writes = writes and coord[dim] == 0
        elif not (isinstance(pl, Shard) and pl.dim == 0):
            raise ValueError(
                f"spillover.dcp: DTensor placement {pl} cannot be saved by spillover.dcp (it "
                "saves Shard(0) and Replicate); save this optimizer with its state_dict() instead"
            )
    row = math.prod(p.shape[1:]) if p.dim() > 1 else 1
    return offset[0] * row if p.dim() else 0, math.prod(shape), writes


def _replicated_writer() -> bool:
    """A replicated (unsharded) optimizer under a world of several ranks: rank 0 writes."""
    import torch.distributed as dist

    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


class _Column(torch.Tensor):
    """One column (exp_avg, exp_avg_sq or master) of one parameter's state, as DCP sees it: a
    1-D fp32 tensor of the flattened parameter's numel, of which this rank writes the chunks
    it owns, produced when asked (Note [pieces, produced when asked]), and reads the range it
    will own (Note [loading]). Its own storage is empty."""

    owner: OptimizerState
    global_shape: Tuple[int, ...]

    @staticmethod
    def __new__(cls, owner, index, col, numel, save, load):  # noqa: D102
        return torch.Tensor._make_subclass(cls, torch.empty(0), False)

    def __init__(self, owner, index, col, numel, save, load):
        self.owner = owner
        self.param: int = index
        self.col = col
        self.numel_ = numel
        self.save = save  # the units of this parameter's state on this rank, if it has state
        self.load = load  # (start, end) this rank reads, if a load expects this column
        self._buf: Optional[torch.Tensor] = None
        self._loading = False  # set when DCP plans a read of this column
        # DCP compares a load target's size with the checkpoint's through this attribute
        # (CheckpointableTensor); the other three complete that protocol's shape.
        self.global_shape = (numel,)
        self.global_offsets = ((load[0],),) if load else ()
        self.local_offsets = ((0,),) if load else ()
        self.local_sizes = ((load[1] - load[0],),) if load else ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # DCP only reads properties (device, ...) of its values; anything else (a copy, a
        # stager's deepcopy for async_save, arithmetic) would see the empty placeholder and
        # could save nothing in the state's place, so it is refused (Note [pieces, produced
        # when asked]).
        name = getattr(func, "__name__", "")
        if name not in ("__get__", "__repr__", "__format__"):
            raise RuntimeError(
                f"spillover.dcp: {name or func} on a column of OffloadAdamW's state; the "
                "columns are read by dcp.save / dcp.load through DCP's checkpointable "
                "protocol, not as tensors (dcp.async_save stages copies of every tensor: use "
                "dcp.save); for tensors use OffloadAdamW.state_dict()"
            )
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    def __repr__(self, *args: Any, **kwargs: Any) -> str:
        return (
            f"<spillover.dcp column {self.col} of parameter "
            f"{self.owner.names[self.param]!r}: {self.numel_} fp32>"
        )

    # ---- save ----

    def _pieces(self) -> List[Tuple[int, int, int, int]]:
        """(global start, length, unit, start in unit) of the chunks this rank writes."""
        units = self.save
        if not units:
            return []
        p = self.owner.params[self.param]
        base = 0
        if _is_dtensor(p):
            base, _, writes = _dtensor_range(p)
            if not writes:
                return []
        elif not units[0].sharded and not _replicated_writer():
            return []
        out = []
        step = self.owner.piece
        for ui, unit in enumerate(units):
            n = unit.length
            for s in range(0, n, step):
                out.append((base + unit.start + s, min(step, n - s), ui, s))
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> List[Any]:
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import (
            TensorWriteData,
            WriteItem,
            WriteItemType,
        )

        props = TensorProperties(dtype=torch.float32)
        size = torch.Size([self.numel_])
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([g])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size([g]), sizes=torch.Size([n])),
                    properties=props,
                    size=size,
                ),
            )
            for g, n, _, _ in self._pieces()
        ]

    def __create_chunk_list__(self) -> List[Any]:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self._loading = True
        if self.load is None or self.load[0] == self.load[1]:
            return []  # this rank owns none of it
        a, b = self.load
        return [ChunkStorageMetadata(offsets=torch.Size([a]), sizes=torch.Size([b - a]))]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        at = index.offset[0] if index.offset is not None else 0
        if self._loading:
            if self.load is not None and at == self.load[0]:
                return self.buffer()
        else:
            for g, n, ui, s in self._pieces():
                if g == at:
                    cols = self.owner._unit_columns(self.save[ui])
                    piece = cols[self.col][s : s + n].clone()  # own storage: freed once written
                    self.owner._served()
                    return piece
        raise ValueError(f"spillover.dcp: no chunk of {index.fqn} starts at {at} on this rank")

    def buffer(self) -> torch.Tensor:
        """The load buffer of the range this rank reads (allocated when first asked)."""
        if self._buf is None:
            a, b = self.load
            self._buf = torch.empty(b - a, dtype=torch.float32)
        return self._buf


def _read_unit(
    unit: StateUnit,
    p: torch.Tensor,
    buffers: Dict[int, Dict[str, Tuple[torch.Tensor, int]]],
    names: List[str],
) -> Dict[str, torch.Tensor]:
    """A new unit's columns: views of the load buffers (Note [loading]). A master the
    checkpoint does not have (written where the parameter was its own fp32 master) is left
    out: it starts from the parameter, as load_state_dict does."""
    got = buffers.get(unit.param, {})
    n = unit.length
    gstart = (_dtensor_range(p)[0] if _is_dtensor(p) else 0) + unit.start
    out = {}
    for c in unit.columns:
        if c not in got:
            if c == "master":
                continue
            raise RuntimeError(
                f"spillover.dcp: nothing was read for {c} of parameter {names[unit.param]!r}; "
                "the layout predicted at planning does not match OffloadAdamW's (a bug: please "
                "report it)"
            )
        buf, lo = got[c]
        if gstart < lo or gstart + n > lo + buf.numel():
            raise RuntimeError(
                f"spillover.dcp: parameter {names[unit.param]!r}: unit [{gstart}, {gstart + n}) "
                f"is outside the range read [{lo}, {lo + buf.numel()}); the predicted layout "
                "does not match OffloadAdamW's (a bug: please report it)"
            )
        out[c] = buf[gstart - lo : gstart - lo + n]
    return out


def _make_writer_class() -> type:
    from torch.distributed.checkpoint import FileSystemWriter as _TorchWriter
    from torch.distributed.checkpoint.filesystem import _item_size
    from torch.distributed.checkpoint.planner import WriteItemType

    class FileSystemWriter(_TorchWriter):
        """torch's ``FileSystemWriter`` with each rank's items split into files of at most
        ``file_bytes`` (Note [DCP's writer holds a file's tensors]), items resolved in plan
        order. Other arguments as torch's."""

        def __init__(self, path: Any, *, file_bytes: int = 64 << 20, **kwargs: Any):
            kwargs.setdefault("per_thread_copy_ahead", 0)
            if kwargs.get("single_file_per_rank") is False:
                raise ValueError(
                    "spillover.dcp.FileSystemWriter bounds the bytes per file; use torch's "
                    "FileSystemWriter for one file per item"
                )
            super().__init__(path, **kwargs)
            if file_bytes <= 0:
                raise ValueError(f"file_bytes must be positive, got {file_bytes}")
            self.file_bytes = file_bytes

        def write_data(self, plan: Any, planner: Any) -> Any:
            from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

            prefix = plan.storage_data.prefix
            files: List[List[Any]] = [[]]
            size = 0
            for item in plan.items:
                n = 0 if item.type == WriteItemType.BYTE_IO else _item_size(item)
                n = min(n, _chunk_bytes(item))
                if files[-1] and size + n > self.file_bytes:
                    files.append([])
                    size = 0
                files[-1].append(item)
                size += n
            q: queue.Queue = queue.Queue()
            for k, items in enumerate(files):
                name = f"{prefix}{k}{DEFAULT_SUFFIX}"
                q.put((self.fs.concat_path(self.path, name), name, items))
            return self._write_data(planner, q)

    FileSystemWriter.__module__ = __name__
    FileSystemWriter.__qualname__ = "FileSystemWriter"
    return FileSystemWriter


def _chunk_bytes(item: Any) -> int:
    """Bytes of a write item's chunk (``_item_size`` counts the whole tensor's)."""
    td = item.tensor_data
    if td is None or td.chunk is None:
        return 0
    return math.prod(td.chunk.sizes) * torch._utils._element_size(td.properties.dtype)


def __getattr__(name: str) -> Any:
    if name == "FileSystemWriter":
        cls = _make_writer_class()
        globals()["FileSystemWriter"] = cls
        return cls
    raise AttributeError(name)
