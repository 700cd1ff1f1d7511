"""``no_offload()``: a region that runs without spillover's saved-tensor hooks while an
``offload_context`` is active, so that ``torch.func`` transforms work inside it.

::

    with spillover.offload_context(tier="host"):
        hidden = model.body(batch)                 # offloaded as usual
        with spillover.no_offload():
            loss = liger_chunked_loss(hidden, model.lm_head.weight, labels)
    loss.backward()

``torch.func.grad``, ``grad_and_value``, ``vjp``, ``jacrev`` and ``hessian`` refuse to run
while any saved-tensor hooks are on torch's stack (``RuntimeError: torch.func.{grad, vjp,
jacrev, hessian} don't yet support saved tensor hooks``). Liger's chunked losses and Unsloth's
fused loss compute their gradients that way, inside forward.

Note [no offload]
    torch keeps one stack of default saved-tensor hooks per thread
    (``torch._C._autograd._push_saved_tensors_default_hooks`` / ``_pop_...``; ``torch.func``
    requires it to be empty). Each ``offload_context`` active on a thread pushed one pair on it
    at ``__enter__`` (``spillover.wrap``'s planner, during an ``"auto"`` learning step, may have
    pushed one more over it, which passes tensors on to the context's). ``no_offload()`` pops
    those pairs off the top of the stack on entry and pushes the same pairs back, in the same
    order, on exit, however the region ends. It pops only spillover's pairs and only from the
    top: when a pair that is not spillover's (your own ``saved_tensors_hooks``, a
    ``torch.utils.checkpoint`` region) sits above one of ours, it cannot take ours out from
    under it without reordering the stack, so it pushes back what it took and raises. The
    pairs it took are recorded per thread, a stack of frames (one per ``no_offload`` entered),
    because torch's stack is per thread: a region on one thread never touches another's. A
    context that exits while its pair is suspended (only possible without ``with`` nesting,
    e.g. ``ctx.__exit__`` called by hand inside the region) asks :func:`_forget` first, so it
    does not pop a pair that is not its own, and the region's exit does not push back a pair
    whose context is gone.

What the region saves
    Tensors autograd saves inside the region stay on the device, as torch keeps them without
    spillover, and are counted nowhere: the context's hooks never see them, so ``stats()``,
    ``report()`` and the planner's budget leave them out. Keep the region to the loss.
"""

from __future__ import annotations

import threading
from contextlib import ContextDecorator
from typing import Any, Callable, Iterable, List, Optional, Tuple, Union

import torch
from torch import nn

__all__ = ["no_offload", "no_offload_forward"]

_A = torch._C._autograd
_tls = threading.local()

# One popped pair: (the context that pushed it or None for a planner's counting pair, that
# context's saved_tensors_hooks object or None, (pack, unpack) as torch held them).
_Entry = Tuple[Any, Any, Tuple[Callable[..., Any], Callable[..., Any]]]


def _frames() -> List[List[_Entry]]:
    frames = getattr(_tls, "frames", None)
    if frames is None:
        frames = _tls.frames = []
    return frames


def _forget(hooks: Any) -> bool:
    """A context's ``__exit__`` while its hooks may be suspended (Note [no offload]): drop the
    pair from this thread's frames and say whether it was there (then torch's stack no longer
    holds it, and the context must not pop)."""
    for frame in _frames():
        for i, (_, h, _pair) in enumerate(frame):
            if h is hooks:
                del frame[i]
                return True
    return False


def _is_counting(pack: Callable[..., Any]) -> bool:
    from .recompute.blocks import _CountingHooks

    return isinstance(getattr(pack, "__self__", None), _CountingHooks)


def _push(entries: List[_Entry]) -> None:
    for _, _, (pack, unpack) in reversed(entries):
        _A._push_saved_tensors_default_hooks(pack, unpack)


class no_offload(ContextDecorator):
    """Run a region without spillover's saved-tensor hooks (Note [no offload]).

    Use it around a loss that computes gradients with ``torch.func`` (Liger's chunked losses,
    Unsloth's fused loss), which refuses to run under saved-tensor hooks. Inside, the tensors
    autograd saves stay on the device, as torch keeps them, and are counted nowhere; on exit
    (also on an exception) the hooks are back, so what is saved after the region is offloaded
    again. Outside any ``offload_context``, and inside another ``no_offload``, it does nothing.
    Per thread: a region on one thread leaves other threads' contexts alone.

    Also a decorator: ``loss_fn = spillover.no_offload()(loss_fn)``.

    Raises:
        RuntimeError: on entry, when saved-tensor hooks that are not spillover's (your own
            ``torch.autograd.graph.saved_tensors_hooks``, a ``torch.utils.checkpoint``
            region) were entered after the active ``offload_context``: enter ``no_offload()``
            outside them, or them inside it. Nothing is changed then.
    """

    def __enter__(self) -> no_offload:
        from .activations.registry import stack

        taken = {id(h) for frame in _frames() for _, h, _p in frame}
        pending: List[Tuple[Any, Any]] = [(a.ctx, a.hooks) for a in stack()
                                          if id(a.hooks) not in taken]
        popped: List[_Entry] = []
        try:
            while pending:
                top: Optional[Tuple[Any, Any]] = _A._top_saved_tensors_default_hooks(True)
                if top is None:
                    raise RuntimeError(
                        "spillover.no_offload: an offload_context is active on this thread but "
                        "its saved-tensor hooks are not on torch's stack (something popped "
                        "them: torch._C._autograd._pop_saved_tensors_default_hooks outside a "
                        "`with` block); exit the context and enter it again")
                match = next(((c, h) for c, h in pending if h.pack_hook is top[0]), None)
                if match is not None:
                    pending.remove(match)
                    entry: _Entry = (match[0], match[1], (top[0], top[1]))
                elif _is_counting(top[0]):
                    entry = (None, None, (top[0], top[1]))
                else:
                    raise RuntimeError(
                        "spillover.no_offload: saved-tensor hooks that are not spillover's "
                        f"({getattr(top[0], '__qualname__', type(top[0]).__name__)}) were "
                        "entered after the active offload_context, and sit above its hooks on "
                        "torch's stack; they cannot be taken out from under them (and "
                        "torch.func would refuse those hooks anyway). Enter no_offload() "
                        "outside those hooks (your saved_tensors_hooks, a checkpoint region), "
                        "or enter them inside it")
                _A._pop_saved_tensors_default_hooks()
                popped.append(entry)
        except BaseException:
            _push(popped)
            raise
        _frames().append(popped)
        return self

    def __exit__(self, *exc: Any) -> None:
        frames = _frames()
        if not frames:
            raise RuntimeError("spillover.no_offload: __exit__ without a matching __enter__ on "
                               "this thread; use it as `with spillover.no_offload():`")
        _push(frames.pop())


class _ForwardRegion:
    """What :func:`no_offload_forward` puts on a module: a forward pre-hook that enters a
    :class:`no_offload` region and a forward hook (called also when forward raises) that leaves
    it. Per thread, a list of the frame depths its pre-hook entered at, so that the hook leaves
    only a region its pre-hook entered (not one of an outer caller, when entering raised)."""

    def __init__(self, module: nn.Module):
        self._tls = threading.local()
        self._handles = [
            module.register_forward_pre_hook(self._enter, prepend=True),  # first in, last out
            module.register_forward_hook(self._exit, always_call=True),
        ]

    def _depths(self) -> List[int]:
        d = getattr(self._tls, "depths", None)
        if d is None:
            d = self._tls.depths = []
        return d

    def _enter(self, module: nn.Module, args: Any) -> None:
        depth = len(_frames())
        no_offload().__enter__()
        self._depths().append(depth)

    def _exit(self, module: nn.Module, args: Any, out: Any) -> None:
        depths = self._depths()
        if depths and depths[-1] == len(_frames()) - 1:
            depths.pop()
            no_offload().__exit__(None, None, None)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def no_offload_forward(module: nn.Module) -> _ForwardRegion:
    """Run every forward of ``module`` inside :class:`no_offload` (a loss module that uses
    ``torch.func``, e.g. Liger's ``LigerFusedLinear*Loss``, or TRL's trainers' ones). Returns a
    handle whose ``remove()`` takes the hooks off. Outside an ``offload_context`` the hooks do
    nothing. The callbacks' ``no_offload=`` argument calls this."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"no_offload_forward: {type(module).__name__} is not an nn.Module; wrap "
                        "a loss function with spillover.no_offload() instead: "
                        "`loss_fn = spillover.no_offload()(loss_fn)`")
    return _ForwardRegion(module)


def forward_regions(modules: Union[None, nn.Module, Iterable[nn.Module]]) -> List[_ForwardRegion]:
    """The callbacks' ``no_offload=``: one module, several, or None."""
    if modules is None:
        return []
    if isinstance(modules, nn.Module) or not isinstance(modules, Iterable):
        modules = [modules]  # type: ignore[list-item]  (a non-module says so below)
    return [no_offload_forward(m) for m in modules]
