"""The base of every region policy (:class:`RegionPolicy`), and the checkpoint call the
policies that run a dispatch mode share (``_sac``)."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import torch.utils.checkpoint as _tc
from torch import nn

from .. import planner as _planner
from ..planner import Explanation, Machine, OpRecord, RegionRecord
from ..planner.records import sim_of

if TYPE_CHECKING:
    from .blocks import _WrapState


class RegionPolicy(abc.ABC):
    """What a policy does with one recompute region: run it eagerly, run it under
    torch.compile, and say why it saved or recomputed an op's output (for ``explain``)."""

    @abc.abstractmethod
    def run(self, fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
            key: Any, name: str, state: Optional[_WrapState]) -> Any:
        """``fn(*args, **kwargs)`` as one region, eagerly, with grad enabled. ``key`` and
        ``name`` identify the region across steps (a wrapped block's name; None and "" for a
        standalone ``checkpoint``); ``state`` is the wrapped model's, which takes the region's
        record, or None."""

    @abc.abstractmethod
    def compiled(self, fn: Callable[..., Any], args: Tuple[Any, ...],
                 kwargs: Dict[str, Any]) -> Any:
        """The same region while ``torch.compile`` traces it (Note [torch.compile])."""

    def reason(self, op: OpRecord) -> str:
        """Why this policy saved or recomputed ``op``'s output (neither forced nor skipped)."""
        saved = op.action in ("keep", "offload")
        return f"the policy returned {'save' if saved else 'recompute'}"

    def explain(self, records: List[RegionRecord], machine: Optional[Machine]) -> Explanation:
        """What a wrapped model's last step (``records``) decided; see ``spillover.explain``."""
        for r in records:
            for o in r.ops:
                if not o.reason and not o.forced and not o.after_stop:
                    o.reason = self.reason(o)
        device = records[0].device if records else "cpu"
        m = machine or (_planner.machine_for(device).simulated(sim_of(records[0]))
                        if records else None)
        return _planner.explain_records(records, repr(self), m)

    def attach(self, model: nn.Module) -> None:
        """``wrap`` made ``model``'s blocks regions of this policy."""
        return None

    def begin_step(self, args: Tuple[Any, ...] = (), kwargs: Optional[Dict[str, Any]] = None
                   ) -> bool:
        """A wrapped model's forward starts (eager, grad enabled), called with ``args`` and
        ``kwargs``. True: count the bytes the model saves outside its regions during it, for
        :meth:`end_step`."""
        return False

    def end_step(self, outside_bytes: int, loss_bytes: int = 0, loss_min_bytes: int = 0,
                 tail_bytes: int = 0) -> None:
        """The forward :meth:`begin_step` asked to count has ended; ``loss_bytes``: what its
        chunked loss region adds when backward starts (Note [loss transient], loss/chunked.py), and
        ``loss_min_bytes`` what it would add with the smallest chunk; ``tail_bytes``: the part of
        ``outside_bytes`` saved after the last region (Note [the tail stays], planner/search.py).
        """
        return None

    def loss_cap(self) -> Optional[int]:
        """The cap on the loss region's chunk in this step (Note [loss chunk under a budget]
        in loss/chunked.py); None: the speed rule's chunk."""
        return None

def _sac(fn: Callable[..., Any], args: Tuple[Any, ...], kwargs: Dict[str, Any],
         context_fn: Callable[[], Tuple[Any, Any]]) -> Any:
    return _tc.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn, **kwargs)
