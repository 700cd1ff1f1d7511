"""``explain(model)``: what the last step of a wrapped model (or a planner) decided."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from ..planner import Machine, Planner
from .blocks import state_of
from .policies import _Auto


def explain(target: Any, machine: Optional[Machine] = None) -> Any:
    """What the last step of a wrapped model (``spillover.wrap``, ``hf.enable``; through a
    wrapper such as PEFT's) or of a :class:`Planner` decided, per op kind, with bytes and
    estimated costs (an ``Explanation``); for a :class:`spillover.OffloadAdamW`, where its
    state is and how many bytes per parameter it takes (``OffloadAdamW.explain()``).
    ``print(spillover.explain(model))`` shows a table.

    Costs use this machine's calibration (measured on first use) unless ``machine`` is given.
    """
    from ..optim import OffloadAdamW

    if isinstance(target, OffloadAdamW):
        return target.explain()
    if isinstance(target, Planner):
        return _Auto(target).explain([], machine)
    state = state_of(target) if isinstance(target, nn.Module) else None
    if state is None:
        raise ValueError(
            f"spillover.explain: {type(target).__name__} is not under spillover; pass a model "
            "given to spillover.wrap or spillover.integrations.hf.enable (or a wrapper around "
            "one, e.g. PEFT's), a spillover.Planner, or a spillover.OffloadAdamW")
    exp = state.policy.explain(state.last_records(), machine)
    if getattr(state, "loss_line", None):
        exp.summary["loss region"] = state.loss_line  # spillover/loss/regions.py
    return exp
