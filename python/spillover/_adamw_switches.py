"""torch.optim.AdamW's implementation switches as :class:`spillover.OffloadAdamW` takes them and
writes them into its parameter groups.

Note [torch's switches]
    ``torch.optim.AdamW`` takes four switches that choose how the update runs, not what it is:
    ``fused``, ``foreach``, ``capturable`` and ``differentiable``. OffloadAdamW runs one
    implementation, its Rust kernel, whose update is torch's fused one (bitwise on CPUs with
    FMA: the docstring of spillover/optim/__init__.py). So:

    - ``fused`` and ``foreach`` are accepted with any of True, False or None: code written for
      torch passes them (nanoGPT's ``configure_optimizers`` passes ``fused=True`` on a GPU) and
      should run unchanged; a value that asks for something else than the fused update is
      logged at debug level, nothing more.
    - ``capturable=True`` (a step captured in a CUDA graph) and ``differentiable=True``
      (autograd through the step) are refused: the update runs on the CPU, outside any graph
      and outside autograd.

    Every parameter group carries torch's AdamW keys with the values that describe what runs:
    :data:`GROUP_KEYS`. ``torch.optim.Optimizer.load_state_dict`` takes these keys from the
    loaded groups (its ``__setstate__`` fills a missing ``fused`` with None): a state dict
    without them, loaded into ``torch.optim.AdamW(fused=True)``, silently turned fused off and
    the next steps rounded as the for-loop update does. With ``fused=True`` in the groups it
    stays on (a torch AdamW on a device without a fused kernel then refuses the step: set
    ``group["fused"] = None`` after loading there). Loading, OffloadAdamW keeps its own values
    whatever a checkpoint says (a torch ``AdamW(capturable=True)`` checkpoint loads), and a
    checkpoint without the keys loads as before.
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

_log = logging.getLogger("spillover")

#: torch.optim.AdamW's switches with what OffloadAdamW runs (Note [torch's switches]).
GROUP_KEYS: Dict[str, Any] = {
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": True,
    "decoupled_weight_decay": True,
}


def check_switches(fused: Optional[bool], foreach: Optional[bool], capturable: Optional[bool],
                   differentiable: Optional[bool]) -> None:
    """Note [torch's switches]: accept ``fused`` / ``foreach``, refuse the two that cannot hold."""
    for name, value in (("fused", fused), ("foreach", foreach)):
        if value not in (True, False, None):
            raise ValueError(f"OffloadAdamW: {name} must be True, False or None, got {value!r}")
    if capturable:
        raise ValueError(
            "OffloadAdamW(capturable=True): the update runs on the CPU in spillover's kernel, "
            "where a CUDA graph cannot capture it; leave capturable off, or capture "
            "torch.optim.AdamW(capturable=True)"
        )
    if differentiable:
        raise ValueError(
            "OffloadAdamW(differentiable=True): the update runs in spillover's CPU kernel, "
            "outside autograd, so it cannot be differentiated through; use "
            "torch.optim.AdamW(differentiable=True) for meta-learning through the step"
        )
    if fused is False or foreach:
        _log.debug(
            "OffloadAdamW(fused=%r, foreach=%r): the update is always spillover's CPU kernel, "
            "torch's fused AdamW update (Note [torch's switches])", fused, foreach,
        )


def keep_switches(group: Dict[str, Any]) -> None:
    """A parameter group's switches are OffloadAdamW's whatever was given or loaded."""
    group.update(GROUP_KEYS)
