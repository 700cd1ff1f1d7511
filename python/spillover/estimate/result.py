""":class:`Estimate`: every mode's figures for one model, input and device, as a table, a
picture, and the largest batch or sequence that fits."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..config import format_size
from .devices import Device
from .modes import MODES, ModeEstimate, Runner
from .trace import SavedTensor

__all__ = ["Estimate"]

#: What each mode is, for the table's footnote (Note [modes as run] in modes.py).
MODE_TEXT = {
    "none": "the model as given",
    "full": "wrap(policy='full')",
    "selective": "wrap(policy='selective')",
    "host": "wrap(policy='offload') + offload_context('host')",
    "nvme": "wrap(policy='offload') + offload_context('nvme')",
    "auto": "wrap(policy='auto') + offload_context('auto'), the planner under the budget",
}


class Estimate:
    """The figures of one training step per mode (``Estimate["full"].device_peak_bytes``), from
    one traced step per mode on fake tensors (:func:`spillover.estimate`).

    ``saved``: what autograd saves in the plain step, one entry per storage, largest first.
    ``budget``: the peak (over the step's start) ``auto`` planned under.
    """

    def __init__(self, runner: Runner, modes: Dict[str, ModeEstimate], what: str,
                 resize: Optional[Callable[..., Runner]] = None):
        self._runner = runner
        self.modes = modes
        self.device: Device = runner.device
        self.what = what
        self.budget = runner.budget_for() if "auto" in modes else runner.budget
        none = modes.get("none")
        saved = none.trace.saved if none is not None and none.trace is not None else []
        self.saved: List[SavedTensor] = sorted(saved, key=lambda s: -s.bytes)
        self._resize = resize

    def __getitem__(self, mode: str) -> ModeEstimate:
        m = self.modes.get(mode)
        if m is None:
            raise KeyError(f"no estimate for mode {mode!r}: this estimate has "
                           f"{', '.join(self.modes)} (modes= chose them; all: "
                           f"{', '.join(MODES)})")
        return m

    def __iter__(self) -> Any:
        return iter(self.modes.values())

    def __repr__(self) -> str:
        return f"<Estimate of {self.what} on {self.device.name}: {', '.join(self.modes)}>"

    # -- the table --

    def table(self) -> str:
        """Every mode's device peak, host memory, NVMe traffic per step (and drive writes per
        day at the predicted step rate) and step time, with what fits the device."""
        d = self.device
        head = ("mode", "device peak", "fits", "host RAM", "NVMe/step", "DWPD", "step s",
                "recompute", "at")
        rows = []
        for m in self.modes.values():
            rows.append((
                m.mode, format_size(m.device_peak_bytes),
                "yes" if m.fits else "NO",
                format_size(m.host_bytes) if m.host_bytes else "-",
                format_size(m.nvme_bytes_per_step) if m.nvme_bytes_per_step else "-",
                f"{m.drive_writes_per_day:.1f}" if m.drive_writes_per_day else "-",
                f"{m.step_seconds:.3f}",
                f"{m.recompute_flops / max(1.0, m.flops - m.recompute_flops):.0%}"
                if m.recompute_flops else "-",
                m.peak_phase + (f"; {m.note}" if m.note else ""),
            ))
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" if i in (0, 8) else f"{{:>{w}}}"
                        for i, w in enumerate(widths))
        lines = [f"spillover.estimate: {self.what} on {d.name} "
                 f"({format_size(d.memory_bytes)} device, {format_size(d.host_memory_bytes)} "
                 "host)" + (f"; auto's budget {format_size(self.budget)} over the step's start"
                            if self.budget is not None and "auto" in self.modes else ""),
                 fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*r).rstrip() for r in rows]
        lines.append("device peak: the most bytes of live tensor storages in forward, backward "
                     "and the optimizer step (torch.cuda.max_memory_allocated's count)"
                     + ("; on a CPU the offload pool is counted in it" if d.kind == "cpu"
                        else "") + ". DWPD: drive writes per day at this step rate. "
                     "recompute: extra FLOPs. at: where the peak is.")
        lines += [f"  {k}: {v}" for k, v in MODE_TEXT.items() if k in self.modes]
        return "\n".join(lines)

    def saved_table(self, n: int = 10) -> str:
        """The ``n`` largest storages autograd saves in the plain step, with the module and op
        that saved them."""
        lines = [f"{'bytes':>10}  {'dtype':<9} {'shape':<22} {'kind':<10} module / op"]
        for s in self.saved[:n]:
            lines.append(f"{format_size(s.bytes):>10}  {s.dtype:<9} {str(list(s.shape)):<22} "
                         f"{s.kind:<10} {s.module or '-'} / {s.op}")
        total = sum(s.bytes for s in self.saved if s.kind == "activation")
        lines.append(f"{len(self.saved)} saved storages, {format_size(total)} of activations")
        return "\n".join(lines)

    # -- the planner --

    def planner(self, budget_bytes: Optional[int] = None) -> Any:
        """A :class:`~spillover.Planner` that follows ``auto``'s plan from its first step
        (Note [seeded plan] in seed.py): ``spillover.wrap(model, policy=est.planner())`` on the
        model this estimate traced, run with the same inputs' shapes under an offload context
        of the same tier and pool. Its first steps are measured and corrected as usual."""
        from ..planner import Planner
        from .seed import hand_over

        m = self["auto"]
        tmp = m.planner
        if tmp is None or tmp.plan is None:
            raise ValueError("Estimate.planner: the auto mode made no plan (see its note)")
        p = Planner(budget_bytes=budget_bytes if budget_bytes is not None else self.budget)
        trace = m.trace
        hand_over(tmp, p, "cuda:0" if self.device.kind == "cuda" else "cpu",
                  (m.device_peak_bytes - trace.base) if trace is not None else None,
                  seconds=0.0)
        return p

    # -- the largest that fits --

    def largest(self, *, batch: Optional[int] = None, seq: Optional[int] = None,
                modes: Optional[Sequence[str]] = None) -> Dict[str, int]:
        """Per mode, the largest batch (``batch=`` the most to try) or sequence length
        (``seq=``) whose step fits the device (device peak within its memory, host memory
        within the host's), the others held; 0 when not even 1 fits. The inputs are resized
        along dim 0 (batch) or dim 1 (sequence: every input whose dim 1 is the traced length),
        and each size tried is traced again; sequences are searched in multiples of 64."""
        if (batch is None) == (seq is None):
            raise ValueError("Estimate.largest: give batch=N or seq=N (the most to try), "
                             "one of them")
        if self._resize is None:
            raise ValueError("Estimate.largest: this estimate cannot be traced at other sizes "
                             "(made from a layer-extrapolated trace): use the fit command's "
                             "own search")
        dim, top = (0, batch) if batch is not None else (1, seq)
        assert top is not None
        quantum = 1 if dim == 0 else 64
        out = {}
        for mode in modes or list(self.modes):
            out[mode] = self._search(mode, dim, int(top), quantum)
        return out

    def _fits(self, mode: str, dim: int, size: int) -> bool:
        assert self._resize is not None
        try:
            runner = self._resize(dim, size)
            return runner.run(mode).fits
        except (RuntimeError, ValueError, IndexError) as e:
            if "out of memory" in str(e).lower():
                return False
            raise ValueError(f"Estimate.largest: tracing {mode} at size {size} along dim {dim} "
                             f"failed ({type(e).__name__}: {e}); the model may not accept "
                             "that size (e.g. positions beyond its maximum)") from e

    def _search(self, mode: str, dim: int, top: int, quantum: int) -> int:
        """Doubling, then bisection, over multiples of ``quantum`` up to ``top``."""
        lo, hi = 0, quantum
        while hi <= top and self._fits(mode, dim, hi):
            lo, hi = hi, hi * 2
        hi = min(hi, top + quantum)
        while hi - lo > quantum:
            mid = (lo + hi) // 2 // quantum * quantum
            if mid <= lo:
                break
            if self._fits(mode, dim, mid):
                lo = mid
            else:
                hi = mid
        return lo

    # -- the picture --

    def plot(self, path: str, measured: Optional[Dict[str, List[Tuple[float, int]]]] = None
             ) -> str:
        """Draw each mode's predicted device memory over the step (one panel per mode, the end
        of forward and of backward marked, the peak annotated) to ``path`` (PNG); with
        ``measured`` ({mode: [(seconds, bytes)]}) the measured curve beside the predicted one.
        Returns ``path``; RuntimeError when matplotlib is missing."""
        from .plot import plot_modes

        return plot_modes(self, path, measured)


def resize_inputs(args: Tuple[Any, ...], kwargs: Dict[str, Any], dim: int, old: int,
                  new: int) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``args``/``kwargs`` with every tensor whose size along ``dim`` is ``old`` made ``new``
    long there (meta tensors: shapes are all the trace reads)."""
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.dim() > dim and x.shape[dim] == old:
                shape = list(x.shape)
                shape[dim] = new
                return torch.zeros(shape, dtype=x.dtype, device="meta").requires_grad_(
                    x.requires_grad)
            return x
        if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
            return type(x)(one(y) for y in x)
        if isinstance(x, dict):
            return {k: one(v) for k, v in x.items()}
        return x

    return one(tuple(args)), one(dict(kwargs))


def size_along(args: Tuple[Any, ...], kwargs: Dict[str, Any], dim: int) -> int:
    """The size along ``dim`` of the first input tensor that has one (0: none)."""
    for x in list(args) + list(kwargs.values()):
        if isinstance(x, torch.Tensor) and x.dim() > dim:
            return int(x.shape[dim])
        if isinstance(x, (list, tuple)):
            s = size_along(tuple(x), {}, dim)
            if s:
                return s
    return 0


_ = math
