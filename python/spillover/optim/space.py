"""A state space: the state of the parameters of one (dtype, device).

Note [cpu parameters in place]
    On CPU, with one rank, the kernel reads ``p.grad`` and updates ``p`` through their
    addresses, with no copy; an fp32 parameter is its own master copy, so nothing else is
    stored for it and changing it between steps (loading weights) is seen by the next step. A
    non-contiguous parameter or gradient goes through a contiguous copy.
"""

from __future__ import annotations

import abc
import weakref
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .. import _native, _pools, _runtime
from ..activations.link import block_tensor
from ..errors import PoolExhaustedError
from . import formats
from . import layout as _layout
from .copies import _Copies
from .inbwd import INBWD_STATS
from .layout import (
    _DTYPES,
    _GRAD_BF16,
    _GRAD_STATS,
    _HOST_CHUNK_BYTES,
    _NVME_CHUNK_BYTES,
    _OUT_BF16,
    _PREDICT,
    _SRC_BF16,
    _TORCH_TAIL,
    BUFFER_RECORD,
    STEP_RECORD,
    _bf16_flag,
    _buckets,
    _local,
)

if TYPE_CHECKING:
    from .store import StateStore


class _Space(abc.ABC):
    """The state of the parameters of one (dtype, device): a native AdamState over *units*
    (whole parameters, the parts of them this rank owns, or — on the staged path — pieces of
    at most ``_UNIT_MAX`` elements, so every staging buffer fits a pool block). The base of
    one type per strategy, which ``StateStore`` picks: :class:`DirectSpace` (CPU parameters,
    one rank: Note [cpu parameters in place]), ``staged.StagedSpace`` (parameters on a device
    or ``update_in_backward``: Note [staged gradients]) and ``sharded.ShardedSpace`` (ZeRO:
    Note [sharding])."""

    # Set in __init__ and _alloc_buffers; declared for inbwd.InBackward's sake (mixed in).
    state: Any
    copies: Any
    counters: Dict[str, int]
    fired: np.ndarray
    expect: np.ndarray
    inited: np.ndarray
    unit_global: np.ndarray
    bucket_members: List[List[int]]
    compare_bytes: bool
    inbwd: bool
    delayed: bool
    last_round: Tuple[int, int]

    def __init__(
        self, opt: StateStore, dtype: torch.dtype, device: torch.device, members: List[int]
    ):
        self.opt = weakref.proxy(opt)
        self.dtype = dtype
        self.device = device
        self.members = members  # global parameter indices, in order
        self.params = [opt._params[i] for i in members]
        self.sharded = opt._world > 1
        # update_in_backward stages CPU parameters too (Note [update in backward])
        self.staged = opt._stages(device)
        # CPU parameters staged for update_in_backward: the staged copy is in host memory next
        # to the gradient, so comparing the bytes is exact and cheaper than fingerprints
        # (Note [speculative update]); _force_staging keeps the GPU path's fingerprints.
        self.compare_bytes = device.type == "cpu" and not opt._force_staging
        # Note [state formats]: an fp32 master unless the parameter (or its staged copy, the
        # output buffer) is its own, or master_weights=False makes it so.
        self.master = opt._keeps_master(dtype, device)
        self.bits = opt._state_bits
        # Units of 8-bit state start on blocks of their parameter (Note [block alignment]).
        self.align = formats.BLOCK if self.bits == 8 else _layout._ALIGN
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.numels = [_local(p).numel() for p in self.params]
        # units: (member position, start in the parameter, length, offset in the flat buffers)
        self.units: List[Tuple[int, int, int, int]] = []
        self._layout()
        self.unit_global = np.array([members[u[0]] for u in self.units], dtype=np.int64)
        self.units_of: Dict[int, List[int]] = {}
        for ui, u in enumerate(self.units):
            self.units_of.setdefault(u[0], []).append(ui)
        self.rec = np.zeros(len(self.units), STEP_RECORD)
        self.rec["unit"] = np.arange(len(self.units))
        self.rec["tail"] = [
            max(0, start + n - max(start, self.numels[k] - self.numels[k] % _TORCH_TAIL))
            for k, start, n, _ in self.units
        ]
        # Note [stochastic rounding] in rust/optim/quant.rs: each unit's first element's key,
        # its parameter's index and its offset in it, the same on every tier, layout and rank.
        self.rec["key"] = [(members[k] << 40) + start for k, start, _, _ in self.units]
        for k, p in enumerate(self.params):
            if self.staged and len(self.units_of.get(k, [])) > 1 and not p.is_contiguous():
                raise ValueError(
                    f"OffloadAdamW: a non-contiguous parameter of {self.numels[k]} elements on "
                    f"{device} is larger than one staging unit ({_layout._UNIT_MAX}); make it "
                    "contiguous"
                )
        self.hooks: List[Any] = []
        # Note [staged gradients]: per bucket, the copies of the last step's parameters back to
        # the device (they read its output buffer); per member, the copy the hooks staged.
        self.h2d_events: Dict[int, List[Any]] = {}
        self.staged_grads: Dict[int, Any] = {}  # staged._Staged
        self.fired = np.zeros(len(self.params), dtype=np.int64)  # hook calls this step
        self.expect = np.zeros(len(self.params), dtype=np.int64)  # ... last step (0: unknown)
        self.arrival: Dict[int, int] = {}  # member -> sequence number of its staging this step
        self.seq = 0
        self.order: List[int] = []  # buckets in the order the last step processed them
        self.counters = {k: 0 for k in _GRAD_STATS + INBWD_STATS}
        # Note [update in backward] (StagedSpace): whether this space updates in backward,
        # the undo copy on the swap files, the last step's buckets kept and redone.
        self.inbwd = bool(opt._inbwd) and self.staged and not self.sharded
        # Note [delayed update] (StagedSpace): the update handed to the worker at step()
        self.delayed = bool(opt._delayed) and self.staged and not self.sharded
        self.undo_state: Any = None
        self.last_round = (0, 0)
        self._alloc_buffers()
        self.state = self._make_state([u[2] for u in self.units])

    @abc.abstractmethod
    def _layout(self) -> None:
        """Fill ``self.units`` (each strategy lays out its own)."""

    # ---- construction ----

    def _add_units(self, k: int, start: int, n: int, at: int) -> None:
        """Units for elements [start, start + n) of member k at flat offset `at` (staged and
        sharded spaces), split into pieces that start on multiples of _UNIT_MAX (a multiple of
        16), so a staging buffer fits a pool block and a unit exported for a DCP save stays
        bounded (Note [pieces, produced when asked] in dcp/_column.py)."""
        end = start + n
        while start < end:
            piece = min(end, (start // _layout._UNIT_MAX + 1) * _layout._UNIT_MAX) - start
            self.units.append((k, start, piece, at))
            start += piece
            at += piece

    def _alloc_buffers(self) -> None:
        """Pinned staging buffers (staged), and each unit's gradient and output addresses in
        them (they never move)."""
        opt = self.opt
        dev = self.device
        n_units = len(self.units)
        self.grad_addr = np.zeros(n_units, dtype=np.uint64)
        self.out_addr = np.zeros(n_units, dtype=np.uint64)
        self.coef_addr = np.zeros(n_units, dtype=np.uint64)
        if not self.staged:
            return
        if dev.type == "cuda":
            _pools.register_with_cuda(opt._pool)
        self.copies = _Copies(dev, opt._link)
        # Buckets of consecutive units: one pinned block each for gradients and outputs.
        self.buckets: List[Tuple[List[int], int, int, torch.Tensor, torch.Tensor]] = []
        self.grad_view: List[torch.Tensor] = []
        self.out_view: List[torch.Tensor] = []
        #: Note [next-gradient prediction] (rust/optim/predict.rs): the next denominator's
        #: v part in bf16, beside the outputs; only with that prediction
        self.coef_view: List[torch.Tensor] = []
        coefs = opt._predict == "gradient"
        for rows in _buckets(list(range(n_units)), self.units, _layout._BUCKET_ELEMS):
            f_lo = self.units[rows[0]][3]
            f_hi = self.units[rows[-1]][3] + self.units[rows[-1]][2]
            g, o = self._pinned(f_hi - f_lo), self._pinned(f_hi - f_lo)
            c = self._pinned(f_hi - f_lo, torch.bfloat16) if coefs else None
            self.buckets.append((rows, f_lo, f_hi, g, o))
            for ui in rows:
                _, _, n, at = self.units[ui]
                self.grad_view.append(g[at - f_lo : at - f_lo + n])
                self.out_view.append(o[at - f_lo : at - f_lo + n])
                self.grad_addr[ui] = self.grad_view[ui].data_ptr()
                self.out_addr[ui] = self.out_view[ui].data_ptr()
                if c is not None:
                    self.coef_view.append(c[at - f_lo : at - f_lo + n])
                    self.coef_addr[ui] = self.coef_view[ui].data_ptr()
        # Members with units in each bucket (a large parameter spans several buckets).
        self.bucket_members = [sorted({self.units[ui][0] for ui in b[0]}) for b in self.buckets]

    def _pinned(self, n: int, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A pinned buffer of `n` elements of `dtype` (default: the parameters'), a block of
        the pool where it fits."""
        opt = self.opt
        dtype = dtype or self.dtype
        nbytes = max(n, 1) * torch.empty((), dtype=dtype).element_size()
        try:
            return block_tensor(opt._pool.lease(nbytes))[:nbytes].view(dtype)
        except PoolExhaustedError:
            _runtime.warn_once(
                "optim-staging",
                "spillover: OffloadAdamW's staging buffers did not fit the host pool; using "
                "separately pinned memory. Raise SPILLOVER_HOST_POOL_BYTES to avoid it.",
            )
            return torch.empty(max(n, 1), dtype=dtype, pin_memory=self.device.type == "cuda")

    def _make_state(self, lens: List[int]) -> Any:
        opt = self.opt
        per = formats.bytes_per_param(self.bits, self.master)
        chunk_bytes = opt._chunk_bytes or (
            _NVME_CHUNK_BYTES if opt._tier == "nvme" else _HOST_CHUNK_BYTES
        )
        chunk_elems = max(1024, int(chunk_bytes / per) // 1024 * 1024)  # whole blocks
        kw: Dict[str, Any] = dict(
            master=self.master,
            state_bits=self.bits,
            seed=opt._rounding_seed,
            chunk_elems=chunk_elems,
            tier=opt._tier,
            threads=opt._threads(),  # Note [update threads] in adamw.py
        )
        if opt._tier == "nvme":
            # swap_for has already warned (once) with the engine's warning.
            kw.update(swap=opt._swap, buffers=opt._nvme_buffers)
        st = _native.AdamState(opt._pool, lens, **kw)
        heap = st.stats()["heap_chunks"]
        if heap:
            _runtime.warn_once(
                "optim-heap",
                f"spillover: {heap} chunk(s) of OffloadAdamW's host state did not fit the host "
                "pool and live in ordinary heap memory (not pinned); raise "
                "SPILLOVER_HOST_POOL_BYTES to keep all of it in the pool.",
            )
        return st

    def close(self) -> None:
        """Remove the hooks, wait for the update-in-backward worker and for the copies still in
        flight from or to the staging buffers, so the buffers can be freed."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.join()
        self._new_round()
        if self.staged:
            pending = [e for evs in self.h2d_events.values() for e in evs]
            for st in self.staged_grads.values():
                pending += st.events + [st.fp_event]
            for ev in pending:
                self.copies.wait(ev)
        self.h2d_events = {}
        self.staged_grads = {}

    # ---- step ----

    @abc.abstractmethod
    def step(self, hyper: np.ndarray) -> np.ndarray:
        """One step; returns the global indices of the parameters that were updated.
        `hyper`: per global parameter, lr, beta1, beta2, eps, weight_decay, grad_scale.
        Each strategy steps its own way (DirectSpace, StagedSpace, ShardedSpace)."""

    def _fill_hyper(self, rows: np.ndarray, hyper: np.ndarray, scale: float = 1.0) -> None:
        """Hyper-parameters and step counts for the units in `rows`."""
        rec = self.rec
        g = self.unit_global[rows]
        h = hyper[g]
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            rec[name][rows] = h[name]
        rec["step"][rows] = self.opt._steps[g] + 1
        rec["grad_scale"][rows] = h["grad_scale"] * scale

    def _flat_records(self, rows: np.ndarray, predict: str = "") -> bytes:
        """Records for units whose gradient and output are in the flat or staging buffers;
        `predict` ("momentum", "gradient"): their outputs get the predicted parameters (Note
        [weight prediction] in rust/optim/predict.rs), "gradient" without the next gradient's
        term, its coefficient in the coefficient buffers (Note [next-gradient prediction])."""
        rec = self.rec
        rec["grad"][rows] = self.grad_addr[rows]
        rec["out"][rows] = self.out_addr[rows]
        rec["src"][rows] = self.out_addr[rows]  # holds the parameter when a unit starts
        rec["coef"][rows] = self.coef_addr[rows] if predict == "gradient" else 0
        rec["flags"][rows] = (_bf16_flag(self.dtype, _GRAD_BF16 | _SRC_BF16 | _OUT_BF16)
                              | (_PREDICT if predict else 0))
        return rec[rows].tobytes()

    def _check(self, p: torch.Tensor) -> None:
        if p.dtype != self.dtype or p.device != self.device:
            raise RuntimeError(
                f"OffloadAdamW: a parameter changed from {self.dtype} on {self.device} to "
                f"{p.dtype} on {p.device} after the optimizer was made; make the optimizer "
                "after moving or casting the model"
            )

    def end_without_step(self) -> None:
        """End a step that updates nothing: the staged copies are dropped and the hooks'
        counts are learnt."""
        self.staged_grads = {}
        self.end_step()

    def end_step(self) -> None:
        """Learn how many times each hook fires per step (Note [gradient accumulation]) and
        start counting afresh; called after every step, skipped ones included."""
        fired = self.fired > 0
        self.expect[fired] = self.fired[fired]
        self.fired[:] = 0
        self.arrival = {}

    def _wait_h2d(self, b: int) -> None:
        """Bucket b's output buffer is about to be overwritten: its copies back must be done."""
        for ev in self.h2d_events.pop(b, []):
            self.copies.wait(ev)

    # ---- updates during backward: none (StagedSpace mixes in inbwd.InBackward) ----

    def _new_round(self) -> None:
        """No round to begin: nothing updates during backward here."""
        return None

    def join(self) -> Optional[BaseException]:
        return None

    def flush(self) -> None:
        """No update is pending here (Note [delayed update] is StagedSpace's)."""
        return None

    def in_round(self) -> bool:
        return False

    def verify_round(self, hyper: np.ndarray) -> None:
        """Nothing was updated in backward, so nothing to verify."""
        return None

    def invalidate_round(self) -> None:
        """Nothing was updated in backward, so nothing to undo."""
        return None

    def skip_round(self) -> bool:
        """A skipped step: nothing was updated in backward; whether anything was undone."""
        self.end_without_step()
        return False

    def undo_bytes(self) -> Tuple[int, int]:
        return 0, 0

    # ---- checkpoints ----

    def _names(self) -> Tuple[str, ...]:
        """The state's columns (Note [state formats])."""
        return formats.columns(self.bits, self.master)

    def _column(self, name: str, n: int, shape: Any = None) -> torch.Tensor:
        """A new tensor for column `name` of `n` parameter elements, as stored (the moments
        shaped `shape` when given)."""
        dt = formats.dtype(self.bits, name)
        if shape is not None and name not in formats.SCALES:
            return torch.empty(shape, dtype=dt)
        return torch.empty(formats.numel(name, n), dtype=dt)

    def export(self, steps: np.ndarray) -> Dict[int, Dict[str, torch.Tensor]]:
        """Full state of every member with state, as stored: {member position: {name:
        tensor}}, the moments (and master) shaped as the parameter, the scales of 8-bit
        state flat, one per block of the flattened parameter."""
        has_state = [steps[i] > 0 for i in self.members]
        rows = [ui for ui, u in enumerate(self.units) if has_state[u[0]]]
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        for k, p in enumerate(self.params):
            if has_state[k]:
                lp = _local(p)
                out[k] = {n: self._column(n, lp.numel(), lp.shape) for n in self._names()}

        def addr(ui: int, name: str) -> int:
            k, start, n, _ = self.units[ui]
            t = out[k][name]
            return t.data_ptr() + formats.part(name, start, n).start * t.element_size()

        self._export_rows(rows, addr)
        return out

    def _export_rows(self, rows: List[int], addr: Any) -> None:
        if not rows:
            return
        recs = np.zeros(len(rows), BUFFER_RECORD)
        recs["unit"] = rows
        for name in self._names():
            recs[name] = [addr(ui, name) for ui in rows]
        self.state.export_state(recs.tobytes())


class DirectSpace(_Space):
    """CPU parameters, one rank, not staged: the kernel updates them in place (Note [cpu
    parameters in place]); a unit is a whole parameter."""

    def _layout(self) -> None:
        self.units = [(k, 0, n, -1) for k, n in enumerate(self.numels)]

    def step(self, hyper: np.ndarray) -> np.ndarray:
        """Note [cpu parameters in place]."""
        rows: List[int] = []
        grads: List[int] = []
        flags: List[int] = []
        params: List[int] = []
        keep: List[torch.Tensor] = []
        fixups: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for ui, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            p = _local(p)
            g = _local(g)
            self._check(p)
            if g.is_sparse:
                raise RuntimeError("OffloadAdamW does not support sparse gradients")
            if g.device != p.device:
                raise RuntimeError(f"gradient on {g.device} for a parameter on {p.device}")
            if g.dtype not in _DTYPES:
                g = g.to(p.dtype)
            if not g.is_contiguous():
                g = g.contiguous()
            keep.append(g)
            if not p.is_contiguous():
                c = p.detach().contiguous()
                fixups.append((p, c))
                p = c
            rows.append(ui)
            grads.append(g.data_ptr())
            params.append(p.data_ptr())
            flags.append(_bf16_flag(g.dtype, _GRAD_BF16))
        if not rows:
            return np.zeros(0, dtype=np.int64)
        idx = np.asarray(rows, dtype=np.int64)
        rec = self.rec
        rec["grad"][idx] = grads
        rec["src"][idx] = params
        rec["out"][idx] = params
        pflags = _bf16_flag(self.dtype, _SRC_BF16 | _OUT_BF16)
        rec["flags"][idx] = np.asarray(flags, dtype=np.uint64) | np.uint64(pflags)
        self._fill_hyper(idx, hyper)
        self.state.step(rec[idx].tobytes())
        del keep
        for p, c in fixups:
            p.detach().copy_(c)
        return self.unit_global[idx]


def _check_numel(t: Any, p: torch.Tensor, name: str) -> torch.Tensor:
    t = _local(t) if isinstance(t, torch.Tensor) else torch.as_tensor(t)
    if t.numel() != _local(p).numel():
        raise ValueError(
            f"state '{name}' has {t.numel()} elements, its parameter {_local(p).numel()}"
        )
    return t


def _flat_f32(t: Any, p: torch.Tensor, name: str) -> torch.Tensor:
    t = _check_numel(t, p, name)
    return t.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()
