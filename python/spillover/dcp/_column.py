"""One column of OffloadAdamW's state as DCP sees it (:class:`_Column`: DCP's
checkpointable protocol), and where a DTensor's or a replica's part of it lies.

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
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import torch

from ..optim import formats
from ..optim.layout import _is_dtensor

if TYPE_CHECKING:
    from ._state import OptimizerState


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


def _block_start(owner: OptimizerState, index: int, col: str, start: int) -> None:
    """A scale column is cut at blocks: refuse a part of 8-bit state starting inside one."""
    if col in formats.SCALES and start % formats.BLOCK:
        raise ValueError(
            f"spillover.dcp: this rank's part of parameter {owner.names[index]!r} starts at "
            f"element {start}, inside a block of {formats.BLOCK} of its 8-bit state (an FSDP2 "
            "shard whose boundary does not fall on a multiple of 256 elements); a DCP "
            "checkpoint keeps one scale per block of the whole parameter. Use state_bits=16 "
            "or 32 for this model, or save this optimizer with its state_dict()"
        )


class _Column(torch.Tensor):
    """One column (exp_avg, exp_avg_sq, master, or a scale column of 8-bit state) of one
    parameter's state, as DCP sees it: a 1-D tensor of the column's dtype, as many elements as
    the flattened parameter (a scale column: one per block), of which this rank writes the
    chunks it owns, produced when asked (Note [pieces, produced when asked]), and reads the
    range it will own (Note [loading] in dcp/_state.py). Its own storage is empty."""

    owner: OptimizerState
    global_shape: Tuple[int, ...]

    @staticmethod
    def __new__(cls, owner, index, col, numel, save, load, bits=32):  # noqa: D102
        return torch.Tensor._make_subclass(cls, torch.empty(0), False)

    def __init__(self, owner, index, col, numel, save, load, bits=32):
        self.owner = owner
        self.param: int = index
        self.col = col
        self.bits = bits  # the format of this column (Note [state formats])
        self.dtype_ = formats.dtype(bits, col)
        self.numel_ = formats.numel(col, numel)
        self.save = save  # the units of this parameter's state on this rank, if it has state
        # (start, end) of the parameter's elements this rank reads, if a load expects it
        self.load = load
        rng = None
        if load:
            _block_start(owner, index, col, load[0])
            part = formats.part(col, load[0], load[1] - load[0])
            rng = (part.start, max(part.start, part.stop))
        self.rng = rng  # the same, in the column's elements
        self._buf: Optional[torch.Tensor] = None
        self._loading = False  # set when DCP plans a read of this column
        # DCP compares a load target's size with the checkpoint's through this attribute
        # (CheckpointableTensor); the other three complete that protocol's shape.
        self.global_shape = (self.numel_,)
        self.global_offsets = ((rng[0],),) if rng else ()
        self.local_offsets = ((0,),) if rng else ()
        self.local_sizes = ((rng[1] - rng[0],),) if rng else ()

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
            f"{self.owner.names[self.param]!r}: {self.numel_} {self.dtype_}>"
        )

    # ---- save ----

    def _pieces(self) -> List[Tuple[int, int, int, int]]:
        """(global start, length, unit, start in unit) of the chunks this rank writes, in the
        column's elements."""
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
            g = base + unit.start
            _block_start(self.owner, self.param, self.col, g)
            part = formats.part(self.col, g, unit.length)
            n = part.stop - part.start
            for s in range(0, n, step):
                out.append((part.start + s, min(step, n - s), ui, s))
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

        props = TensorProperties(dtype=self.dtype_)
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
        if self.rng is None or self.rng[0] == self.rng[1]:
            return []  # this rank owns none of it
        a, b = self.rng
        return [ChunkStorageMetadata(offsets=torch.Size([a]), sizes=torch.Size([b - a]))]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        at = index.offset[0] if index.offset is not None else 0
        if self._loading:
            if self.rng is not None and at == self.rng[0]:
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
        """The load buffer of the range this rank reads, in the column's elements and dtype
        (allocated when first asked)."""
        if self._buf is None:
            a, b = self.rng
            self._buf = torch.empty(b - a, dtype=self.dtype_)
        return self._buf
