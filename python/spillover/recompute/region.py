"""Running one recompute region: ``checkpoint(fn, *args, policy=...)``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Tuple

import torch

from ..planner import Planner
from .policies import Policy, RegionPolicy, _Auto, resolve_policy

if TYPE_CHECKING:
    from .blocks import _WrapState


def _compiling() -> bool:
    is_compiling = getattr(torch.compiler, "is_compiling", None)
    return bool(is_compiling and is_compiling())


def _checkpoint(
    fn: Callable[..., Any],
    args: Tuple[Any, ...],
    kwargs: Dict[str, Any],
    pol: RegionPolicy,
    key: Any = None,
    name: str = "",
    state: Optional[_WrapState] = None,
) -> Any:
    if not torch.is_grad_enabled():
        return fn(*args, **kwargs)
    if _compiling():
        return pol.compiled(fn, args, kwargs)
    return pol.run(fn, args, kwargs, key, name, state)


def checkpoint(fn: Callable[..., Any], *args: Any, policy: Policy = "selective",
               **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` as one recompute region.

    What the region saves for backward follows ``policy`` (see :mod:`spillover.recompute`).
    Saved outputs go to the innermost active ``offload_context`` when there is one. Gradients
    are bitwise those of ``fn`` run plainly. A region may be backwarded several times
    (``retain_graph=True``); it must run the same ops in recompute as in its forward.

    ``policy`` may also be a :class:`Planner` shared by several calls; ``"auto"`` uses one
    planner per call site of this process.
    """
    if isinstance(policy, str) and policy.strip().lower() == "auto":
        pol: RegionPolicy = _default_auto()
    else:
        pol = resolve_policy(policy)
    return _checkpoint(fn, args, kwargs, pol)


_DEFAULT_AUTO: Optional[_Auto] = None


def _default_auto() -> _Auto:
    global _DEFAULT_AUTO
    if _DEFAULT_AUTO is None:
        _DEFAULT_AUTO = _Auto(Planner())
    return _DEFAULT_AUTO
