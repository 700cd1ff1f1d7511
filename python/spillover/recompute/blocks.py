"""``wrap(model)``: each repeated block of a model becomes a recompute region; ``unwrap``."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from ..planner import Planner, RegionRecord
from .modes import top_hooks
from .ops import skey
from .policies import Policy, RegionPolicy, SelectivePolicy, _Auto, resolve_policy
from .region import _checkpoint, _compiling


class _CountingHooks:
    """During a planner's learning step, counts the bytes the model saves outside its regions
    (passing every tensor on to whatever hooks were active, e.g. an offload_context)."""

    def __init__(self, model: nn.Module):
        top = top_hooks(False) if top_hooks is not None else None
        self.inner = top
        self.params = {skey(p) for p in model.parameters()} | {
            skey(b) for b in model.buffers()
        }
        self.excluded: set = set()
        self.seen: set = set()
        self.bytes = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def exclude(self, args: Tuple[Any, ...]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self.excluded.add(skey(a))

    def pack(self, t: torch.Tensor) -> Any:
        try:
            k = skey(t)
        except (RuntimeError, NotImplementedError):
            k = None
        if k is not None and k not in self.params and k not in self.excluded \
                and k not in self.seen and not (t.is_leaf and t.requires_grad):
            self.seen.add(k)
            self.bytes += t.untyped_storage().nbytes()
        return self.inner[0](t) if self.inner is not None else t

    def unpack(self, h: Any) -> torch.Tensor:
        return self.inner[1](h) if self.inner is not None else h


class _WrapState:
    """What ``wrap`` attaches to a model: the policy, its blocks, the last step's records."""

    def __init__(self, model: nn.Module, policy: RegionPolicy,
                 blocks: List[Tuple[str, nn.Module]]):
        self.policy = policy
        self.blocks = blocks
        self.records: List[RegionRecord] = []
        self.step_records: List[RegionRecord] = []
        self.counting: Optional[_CountingHooks] = None
        self.handles: List[Any] = []
        self.model_ref = model

    def add_record(self, rec: RegionRecord) -> None:
        self.step_records.append(rec)

    def pre_forward(self, model: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled() or _compiling():
            return
        if self.step_records:
            self.records = self.step_records
        self.step_records = []
        if self.policy.begin_step():
            self.counting = _CountingHooks(model)
            self.counting.hooks.__enter__()

    def post_forward(self, model: nn.Module, args: Any, out: Any) -> None:
        if self.counting is not None:
            c, self.counting = self.counting, None
            c.hooks.__exit__(None, None, None)
            self.policy.end_step(c.bytes)

    def last_records(self) -> List[RegionRecord]:
        return self.step_records or self.records


class _WrappedBlock:
    """Mixin put in front of a wrapped block's class: its forward runs as a recompute region."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state, name = self.__dict__["_spillover_block"]
        inner = super().forward  # type: ignore[misc]
        return _checkpoint(inner, args, kwargs, state.policy, key=name, name=name, state=state)


_wrapped_classes: Dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    if issubclass(cls, _WrappedBlock):
        return cls
    new = _wrapped_classes.get(cls)
    if new is None:
        new = _wrapped_classes[cls] = type(f"Spillover{cls.__name__}", (_WrappedBlock, cls), {})
    return new


def _find_blocks(model: nn.Module,
                 check_fn: Optional[Callable[[nn.Module], bool]]) -> List[Tuple[str, nn.Module]]:
    if check_fn is not None:
        picked: List[Tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if m is model or any(name.startswith(p + ".") for p, _ in picked):
                continue
            if check_fn(m):
                picked.append((name, m))
        return picked
    best: Optional[Tuple[str, nn.ModuleList]] = None
    best_size = (0, 0)
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m):
            size = (len(m), sum(p.numel() for p in m.parameters()))
            if size > best_size:
                best, best_size = (name, m), size
    if best is None:
        return []
    prefix = best[0] + "." if best[0] else ""
    return [(f"{prefix}{i}", child) for i, child in enumerate(best[1])]


def wrap(
    model: nn.Module,
    policy: Policy = "selective",
    check_fn: Optional[Callable[[nn.Module], bool]] = None,
    *,
    budget_bytes: Optional[Union[int, str]] = None,
) -> nn.Module:
    """Make each repeated block of ``model`` a recompute region, in place; returns ``model``.

    Blocks are the children of the model's largest ``nn.ModuleList`` (GPT-style ``blocks``,
    HuggingFace ``model.layers``), or the outermost modules for which ``check_fn(module)`` is
    true. Each block's class is swapped for a subclass whose ``forward`` runs the original one
    under :func:`checkpoint`; parameters, buffers, hooks and ``state_dict`` keys do not change.

    Args:
        policy: see :mod:`spillover.recompute`; ``"auto"`` makes a :class:`Planner` for this
            model.
        check_fn: picks the blocks instead of the largest ``ModuleList``.
        budget_bytes: the peak budget of ``"auto"`` (Note [peak feedback]; default
            SPILLOVER_DEVICE_BUDGET_BYTES, else half of free memory).

    Raises:
        ValueError: no blocks found, the model is already wrapped, or HuggingFace gradient
            checkpointing is on in it (its blocks would be checkpointed twice: use
            ``spillover.integrations.hf.enable`` to take it over, or turn it off first).

    HuggingFace models: training with ``use_cache=True`` would update the KV cache again
    during recomputation; as HF's own gradient checkpointing does, ``wrap`` turns
    ``config.use_cache`` off (with a warning).
    """
    if "_spillover_state" in model.__dict__:
        raise ValueError("this model is already wrapped; call spillover.unwrap(model) first")
    from ..integrations import check_not_double_checkpointed

    check_not_double_checkpointed(model)  # never HF's checkpoint and ours around one block
    if isinstance(policy, str) and policy.strip().lower() == "auto":
        pol: RegionPolicy = _Auto(Planner(budget_bytes=budget_bytes))
    else:
        if budget_bytes is not None:
            raise ValueError("budget_bytes= is for policy='auto'")
        # "selective" learns per block (Note [selective pays]): one policy per wrapped model
        pol = (SelectivePolicy() if isinstance(policy, str)
               and policy.strip().lower() == "selective" else resolve_policy(policy))
    blocks = _find_blocks(model, check_fn)
    if not blocks:
        raise ValueError(
            "spillover.wrap found no blocks: the model has no non-empty nn.ModuleList; pass "
            "check_fn=lambda m: isinstance(m, YourBlock) to choose them"
        )
    state = _WrapState(model, pol, blocks)
    pol.attach(model)
    for name, blk in blocks:
        blk.__class__ = _wrapped_class(type(blk))
        blk.__dict__["_spillover_block"] = (state, name)
    state.handles = [
        model.register_forward_pre_hook(state.pre_forward),
        model.register_forward_hook(state.post_forward, always_call=True),
    ]
    model.__dict__["_spillover_state"] = state
    cfg = getattr(model, "config", None)
    if getattr(cfg, "use_cache", False) is True:
        import warnings

        warnings.warn(
            "spillover.wrap: setting config.use_cache=False (recomputed blocks would update the "
            "KV cache twice), as HuggingFace gradient checkpointing does",
            stacklevel=2,
        )
        cfg.use_cache = False
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap` in place; returns ``model``."""
    state: Optional[_WrapState] = model.__dict__.pop("_spillover_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    for _name, blk in state.blocks:
        blk.__dict__.pop("_spillover_block", None)
        cls = type(blk)
        if issubclass(cls, _WrappedBlock):
            blk.__class__ = cls.__mro__[2]  # (Spillover<cls>, _WrappedBlock, cls, ...)
    return model
