"""spillover inside the training stacks people use.

``spillover.integrations.hf``
    :func:`~spillover.integrations.hf.enable` puts spillover's recompute regions behind a
    transformers model's own gradient-checkpointing switch (PEFT-wrapped or not), and
    :class:`~spillover.integrations.hf.SpilloverCallback` runs one offload context around each
    optimizer step of a ``transformers.Trainer``.
``spillover.integrations.lightning``
    :class:`~spillover.integrations.lightning.SpilloverCallback` runs one offload context around
    each training batch of a Lightning ``Trainer``.

This package imports neither framework; each submodule imports its own. :class:`StepContext`
is what both callbacks share, and serves a hand-written loop too.
"""

from __future__ import annotations

from typing import Any, List, Optional

from ..activations import OffloadContext, offload_context
from ..recompute.blocks import check_not_double_checkpointed
from ..stats import OffloadStats

__all__ = ["StepContext", "check_not_double_checkpointed"]


class StepContext:
    """One :func:`spillover.offload_context` entered around each training step.

    ``begin()`` enters the context, ``end()`` leaves it and appends the step's counters to
    :attr:`step_stats`. Backward may run before ``end()`` (a trainer's step) or after it (a
    hand-written loop); either way the step's saved activations went through the context.

    Args:
        context: the context to enter each step (default: ``offload_context(tier, **overrides)``).
        tier, **overrides: as :func:`spillover.offload_context`, when ``context`` is not given.
    """

    def __init__(self, context: Optional[OffloadContext] = None, *, tier: Optional[str] = None,
                 **overrides: Any):
        if context is not None and (tier is not None or overrides):
            raise ValueError("pass either context= or tier=/options for a new one, not both")
        self.context = context if context is not None else offload_context(tier, **overrides)
        #: The counters of each finished step, in order.
        self.step_stats: List[OffloadStats] = []
        self._open: Optional[OffloadContext] = None

    @property
    def steps(self) -> int:
        """Steps begun and ended."""
        return len(self.step_stats)

    @property
    def active(self) -> bool:
        """Whether a step has begun and not ended."""
        return self._open is not None

    def begin(self) -> None:
        """Enter the context for one step (ending a step left open by an exception first)."""
        if self._open is not None:
            self.end()
        self.context.__enter__()  # Note [one context, many steps] in activations/registry.py
        self._open = self.context

    def end(self) -> None:
        """Leave the context; the step's counters as they are now go to :attr:`step_stats` (a
        backward run after ``end()`` is not in them; ``context.stats()`` has it). No-op outside
        a step."""
        ctx, self._open = self._open, None
        if ctx is None:
            return
        ctx.__exit__(None, None, None)
        self.step_stats.append(ctx.stats())  # the step just ended

    def stats(self) -> OffloadStats:
        """The last finished step's counters (an empty record before the first)."""
        return self.step_stats[-1] if self.step_stats else OffloadStats()




class _StepCallback:
    """What the HF and Lightning callbacks share: a :class:`StepContext` in ``steps``, its
    context and the counters of each step it ran."""

    steps: StepContext

    @property
    def context(self) -> OffloadContext:
        """The context entered at each step."""
        return self.steps.context

    @property
    def step_stats(self) -> List[OffloadStats]:
        """The counters of each step, in order."""
        return self.steps.step_stats
