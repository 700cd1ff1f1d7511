"""spillover.dcp's ``Stateful``: :func:`optimizer_state` / :class:`OptimizerState` (the keys
and ``meta`` a save writes and a load expects; the import of what a load read).

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

    The targets are planned in the optimizer's own state format (Note [state formats] in
    optim/formats.py). A checkpoint of another ``state_bits`` needs ``checkpoint=`` too: the
    targets then take the checkpoint's columns and dtypes, and the load converts them through
    fp32 with one warning. Without it, DCP refuses the plan (the scale columns of 8-bit state
    missing from the checkpoint, or expected by it) or ``load_state_dict`` refuses the state
    read, naming ``checkpoint=``.

Note [loading]
    A rank reads exactly the ranges it will own at the current world size (the layout of Note
    [sharding] for the parameters that have state in the checkpoint), into buffers of that size
    (its own shard, never the full state), then replaces the optimizer's state spaces by new
    ones for exactly those parameters and imports each unit from the buffers. DCP reads each
    stored chunk whole, so a load holds one stored piece besides the rank's shard.
"""

from __future__ import annotations

import json
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from ..optim import OffloadAdamW, formats
from ..optim.layout import _ALIGN, _is_dtensor
from ..optim.store import StateUnit, warn_conversion
from ._column import _Column, _dtensor_range

_FORMAT = 1
_COLUMNS = ("master",) + formats.MOMENTS + formats.SCALES


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
        piece_bytes: largest chunk written per column (Note [pieces, produced when asked] in
            dcp/_column.py).
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
        self._read_bits: Dict[int, int] = {}  # the format a load reads, per parameter

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
        self._read_bits = {i: bits for i, (_, bits) in expect.items()}
        for i in sorted(set(saving) | set(expect)):
            p = self.params[i]
            mine = saving.get(i)
            written = mine[0].columns if mine else ()
            read, bits = expect.get(i, ((), self.opt.state_bits))
            state[self.names[i]] = {
                col: _Column(
                    self,
                    i,
                    col,
                    p.numel(),  # a DTensor's numel is the global one
                    save=mine if col in written else None,
                    load=owned.get(i, (0, 0)) if col in read else None,
                    bits=bits if col in read else self.opt.state_bits,
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
        saved_bits = int(meta.get("state_bits", 32))
        planned = {self._read_bits.get(index[n], saved_bits) for n in steps}
        if planned - {saved_bits}:
            raise ValueError(
                f"spillover.dcp: the checkpoint holds state_bits={saved_bits} state and the load "
                f"was planned for state_bits={sorted(planned - {saved_bits})[0]} (this "
                "optimizer's); pass optimizer_state(opt, checkpoint=<path>) so that the load "
                "reads the checkpoint's format and converts it (Note [which parameters a load "
                "expects])"
            )
        self._load_groups(meta["param_groups"])
        if "rounding_seed" in meta:
            opt._rounding_seed = int(meta["rounding_seed"])
        buffers: Dict[int, Dict[str, Tuple[torch.Tensor, int]]] = {}
        for n in steps:
            got: Dict[str, torch.Tensor] = {}
            start = 0
            for col, c in cols[n].items():
                if isinstance(c, _Column) and c.load is not None:
                    got[col] = c.buffer()
                    start = c.load[0]
            if saved_bits != opt.state_bits and got:  # Note [state formats]: a conversion
                got = formats.to_f32(got, saved_bits, start)
            buffers[index[n]] = {col: (t, start) for col, t in got.items()}
        if saved_bits != opt.state_bits and steps:
            warn_conversion(saved_bits, opt.state_bits, len(steps), "spillover.dcp load")
        opt.import_state(
            {index[n]: s for n, s in steps.items()},
            lambda unit: _read_unit(unit, self.params[unit.param], buffers, self.names),
        )
        self._cache = None

    # ---- helpers ----

    def _expected(self) -> Dict[int, Tuple[Tuple[str, ...], int]]:
        """{index: (columns, state_bits)} a load reads (Note [which parameters a load
        expects]): the optimizer's format, or with ``checkpoint=`` the checkpoint's."""
        opt = self.opt
        if self.checkpoint is not None:
            md = self.checkpoint
            if not hasattr(md, "state_dict_metadata"):
                from torch.distributed.checkpoint import FileSystemReader

                md = FileSystemReader(str(md)).read_metadata()
            keys = md.state_dict_metadata
            out = {}
            for i, n in enumerate(self.names):
                have = {c: k for c in _COLUMNS for k in _keys(keys, n, c)}
                if not have:
                    continue
                if "exp_avg" not in have or "exp_avg_sq" not in have:
                    raise ValueError(
                        f"spillover.dcp: the checkpoint has {sorted(have)} for parameter {n!r} "
                        "but not both exp_avg and exp_avg_sq"
                    )
                dt = {c: keys[k].properties.dtype for c, k in have.items()}
                entry = {c: torch.empty(0, dtype=d) for c, d in dt.items()}
                bits = formats.entry_bits(entry, f"spillover.dcp: parameter {n!r}")
                want = formats.columns(bits, opt.keeps_master(i))
                out[i] = (tuple(c for c in want if c in have), bits)
            return out
        out = {}
        for i, p in enumerate(self.params):
            if p.requires_grad or opt.has_state(i):
                out[i] = (formats.columns(opt.state_bits, opt.keeps_master(i)), opt.state_bits)
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
        return json.dumps({
            "format": _FORMAT,
            "steps": steps,
            "param_groups": groups,
            # Note [state formats]: the columns' format, and the seed of stochastic rounding
            "state_bits": opt.state_bits,
            "state_format": formats.describe(opt.state_bits),
            "rounding_seed": opt._rounding_seed,
        })

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
        """One unit's columns, exported once (Note [pieces, produced when asked] in
        dcp/_column.py)."""
        if self._cache is not None and self._cache[0] is unit:
            return self._cache[1]
        self._cache = None  # drop the previous unit before exporting the next
        cols = self.opt.export_unit(unit)
        self._cache = (unit, cols)
        self._left = -(-unit.length // self.piece) * len(cols)
        return cols

    def _predict_layout(self, members: List[int]) -> Dict[int, Tuple[int, int]]:
        """{index: (start, end)} of the flattened global parameter this rank will own once
        the optimizer has state for exactly `members` (Note [sharding] in optim/sharded.py; checked
        at import)."""
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


def _keys(keys: Any, name: str, col: str) -> List[str]:
    """The checkpoint's key of column `col` of parameter `name`, if any (one at most)."""
    tail = f"state.{name}.{col}"
    return [k for k in keys if k == tail or k.endswith("." + tail)][:1]


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



def _read_unit(
    unit: StateUnit,
    p: torch.Tensor,
    buffers: Dict[int, Dict[str, Tuple[torch.Tensor, int]]],
    names: List[str],
) -> Dict[str, torch.Tensor]:
    """A new unit's columns: views of the load buffers (Note [loading]), as stored or, after
    a conversion, fp32 moments. A master the checkpoint does not have (written where the
    parameter was its own fp32 master) is left out: it starts from the parameter, as
    load_state_dict does."""
    got = buffers.get(unit.param, {})
    n = unit.length
    gstart = (_dtensor_range(p)[0] if _is_dtensor(p) else 0) + unit.start
    converted = "exp_avg" in got and got["exp_avg"][0].dtype == torch.float32
    out = {}
    want = unit.columns_f32 if converted else unit.columns
    for c in want:
        if c not in got:
            if c == "master":
                continue
            raise RuntimeError(
                f"spillover.dcp: nothing was read for {c} of parameter {names[unit.param]!r}; "
                "the layout predicted at planning does not match OffloadAdamW's (a bug: please "
                "report it)"
            )
        buf, lo = got[c]
        mine, theirs = formats.part(c, gstart, n), formats.part(c, lo, 0)
        a, b = mine.start - theirs.start, mine.stop - theirs.start
        if gstart < lo or a < 0 or b > buf.numel():
            raise RuntimeError(
                f"spillover.dcp: parameter {names[unit.param]!r}: unit [{gstart}, {gstart + n}) "
                f"is outside the range read from {lo}; the predicted layout does not match "
                "OffloadAdamW's (a bug: please report it)"
            )
        out[c] = buf[a:b]
    return out
