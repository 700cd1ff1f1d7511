"""``wrap(model)``: each repeated block of a model becomes a recompute region; ``unwrap``.

Note [block lists]
    Without ``check_fn``, the blocks are the children of every outermost non-empty
    ``nn.ModuleList`` (one inside no other), keeping the lists whose children are modules of
    modules holding parameters when there are any (a list of heads or embeddings next to the
    blocks is left alone). An encoder-decoder has two such lists (T5's ``encoder.block`` and
    ``decoder.block``, BART's ``encoder.layers`` and ``decoder.layers``) and both become
    regions, as HF's own checkpointing does; the lists inside a block (T5's ``layer``, MoE
    experts) are not regions of their own. Picking only the largest list, as ``wrap`` once did,
    left BART's encoder unwrapped (measured, 2+2 layers, d_model 64, vocab 50265, batch 2x16,
    policy "full": an offload context took 23.13 MB per step, 22.60 MB with both lists, the
    same as under HF's switch) and, in a T5 of two blocks, picked the three sublayers of one
    decoder block. A hierarchical model (stages of blocks) gets one region per stage; pass
    ``check_fn`` for finer ones.

Note [pickling a wrapped model]
    ``torch.save(model)`` pickles modules by class: a wrapped block's class,
    ``Spillover<cls>``, is made at run time and cannot be found by name, so a wrapped block
    pickles as "a wrapped block of ``cls``" (``_WrappedBlock.__reduce_ex__``) and comes back
    wrapped; the model's ``_WrapState`` and its forward hooks come with it, so the loaded model
    is wrapped with the same policy (``unwrap`` works on it). What a policy learned about this
    process and machine is not kept: a ``SelectivePolicy``'s saves and a ``Planner``'s plan are
    learned again in the loaded model's first step (gradients do not depend on them). A model
    under ``spillover.integrations.hf.enable`` pickles the same way (its state, checkpoint
    function and ``_set_gradient_checkpointing`` are objects that pickle), once HF's own
    ``enable_input_require_grads`` hook, a local function no pickle can save, is removed
    (``model.disable_input_require_grads()``; plain HF checkpointing has the same limit).
"""

from __future__ import annotations

import copyreg
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
from torch import nn

from .. import loss as _loss
from ..activations import current_context
from ..planner import Planner, RegionRecord
from .modes import top_hooks
from .ops import skey
from .policies import Policy, RegionPolicy, SelectivePolicy, _Auto, resolve_policy
from .region import _checkpoint, _compiling


class _Alive:
    """A weak reference to a storage (Note [a storage's key is its own while it lives])."""

    __slots__ = ("ref",)

    def __init__(self, storage: Any):
        self.ref = storage._weak_ref()

    def alive(self) -> bool:
        return not torch.UntypedStorage._expired(self.ref)

    def __del__(self) -> None:
        torch.UntypedStorage._free_weak_ref(self.ref)


class _CountingHooks:
    """During a planner's learning step, counts the bytes the model saves outside its regions
    (passing every tensor on to whatever hooks were active, e.g. an offload_context).

    Note [a storage's key is its own while it lives]
        A storage's key (``skey``: its StorageImpl's address) names it only while it lives:
        a freed one's address goes to the next storage allocated. The region inputs excluded
        from the count and the storages counted were kept by key alone, so a tail storage made
        where a freed region input had lived was taken for it and not counted: on the H200
        estimate's 1B Llama the 500 MiB of log-probabilities the loss saves were in the tail
        in some runs and not in others (64 or 564 MiB), and auto at full checkpointing's peak
        settled 0.97x or 1.00x full's time from one run of the same code to the next. So each
        key is held with a weak reference to its storage, and a key whose storage died names
        nothing."""

    def __init__(self, model: nn.Module):
        top = top_hooks(False) if top_hooks is not None else None
        self.inner = top
        self.params = {skey(p) for p in model.parameters()} | {
            skey(b) for b in model.buffers()
        }
        self.excluded: Dict[Tuple[Any, int], _Alive] = {}
        self.seen: Dict[Tuple[Any, int], _Alive] = {}
        self.bytes = 0
        self.tail = 0  # of them, saved after the last region so far (Note [the tail stays])
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def exclude(self, args: Tuple[Any, ...]) -> None:
        for a in args:
            if isinstance(a, torch.Tensor):
                self.excluded[skey(a)] = _Alive(a.untyped_storage())

    def pack(self, t: torch.Tensor) -> Any:
        try:
            k = skey(t)
        except (RuntimeError, NotImplementedError):
            k = None
        if k is not None and k not in self.params and not _names(self.excluded, k) \
                and not _names(self.seen, k) and not (t.is_leaf and t.requires_grad):
            self.seen[k] = _Alive(t.untyped_storage())
            n = t.untyped_storage().nbytes()
            self.bytes += n
            self.tail += n
        return self.inner[0](t) if self.inner is not None else t

    def unpack(self, h: Any) -> torch.Tensor:
        return self.inner[1](h) if self.inner is not None else h


def _names(keys: Dict[Tuple[Any, int], _Alive], k: Tuple[Any, int]) -> bool:
    """``k`` is in ``keys`` and its storage lives (Note [a storage's key is its own while it
    lives])."""
    w = keys.get(k)
    return w is not None and w.alive()


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
        self.warned_cache = False
        # the loss region (spillover/loss/): its hooks, and the line explain() shows
        self.loss_region: Any = None
        self.loss_line: Optional[str] = None
        self.loss_scope: Any = None  # what loss.end_scope restores, while a forward runs
        self.seeding = False  # a trace of the first step runs (Note [seeded plan])

    def __getstate__(self) -> Dict[str, Any]:
        # Note [pickling a wrapped model]: not a forward's counting hooks, nor the key a
        # SelectivePolicy learned this model's blocks under (an id in this process).
        state = dict(self.__dict__)
        state["counting"] = None
        state["loss_scope"] = None
        state.pop("_selective_key", None)
        return state

    def add_record(self, rec: RegionRecord) -> None:
        self.step_records.append(rec)

    def pre_forward(self, model: nn.Module, args: Any, kwargs: Any = None) -> None:
        if not torch.is_grad_enabled() or _compiling():
            return
        # Note [seeded plan] (estimate/seed.py): the first step planned from a trace of this
        # call (wrap's and hf.enable's hooks see its keywords)
        seed = getattr(self.policy, "seed", None)
        if seed is not None and kwargs is not None and not getattr(self, "seeding", False):
            self.seeding = True
            traced = False
            try:
                traced = seed(model, self, args, kwargs)
            finally:
                self.seeding = False
                # the trace's own call ran the loss region's hooks, whose post disarmed it:
                # arm it again for this call (its pre hook ran before this one)
                rearm = getattr(self.loss_region, "pre", None)
                if traced and rearm is not None:
                    rearm(model, args, kwargs)
        if self.step_records:
            self.records = self.step_records
        self.step_records = []
        counting = self.policy.begin_step(args, kwargs)
        if self.loss_scope is None:  # Note [loss transient]: what the loss adds; its cap, Note
            # [loss chunk under a budget], from the plan this step follows
            self.loss_scope = _loss.begin_scope(self.policy.loss_cap())
        if counting:
            self.counting = _CountingHooks(model)
            self.counting.hooks.__enter__()

    def post_forward(self, model: nn.Module, args: Any, out: Any) -> None:
        loss_bytes = loss_min = 0
        if self.loss_scope is not None:
            scope, self.loss_scope = self.loss_scope, None
            loss_bytes, loss_min = _loss.end_scope(scope)
        ctx = current_context()
        if ctx is not None:  # the tail the plan kept ends with the model's forward
            ctx.keep_rest(False)
        if self.counting is not None:
            c, self.counting = self.counting, None
            c.hooks.__exit__(None, None, None)
            self.policy.end_step(c.bytes, loss_bytes, loss_min, tail_bytes=c.tail)

    def last_records(self) -> List[RegionRecord]:
        return self.step_records or self.records


class _WrappedBlock:
    """Mixin put in front of a wrapped block's class: its forward runs as a recompute region."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        state, name = self.__dict__["_spillover_block"]
        inner = super().forward  # type: ignore[misc]
        if torch.is_grad_enabled() and not _compiling():
            kwargs = _without_cache(self, kwargs, state)
        return _checkpoint(inner, args, kwargs, state.policy, key=name, name=name, state=state)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Note [pickling a wrapped model]
        rv = super().__reduce_ex__(protocol)  # type: ignore[misc]
        if not isinstance(rv, tuple) or len(rv) < 2 or rv[0] is not _NEWOBJ:
            raise TypeError(f"spillover.wrap: cannot pickle {type(self).__name__} (protocol "
                            f"{protocol}); use pickle protocol 2 or later, as torch.save does")
        return (_new_wrapped, (_base_class(type(self)),), *rv[2:])


_NEWOBJ = getattr(copyreg, "__newobj__")  # noqa: B009 (typeshed does not declare it)


def _new_wrapped(cls: type) -> nn.Module:
    """Note [pickling a wrapped model]: an empty wrapped block of the model's ``cls``."""
    block: nn.Module = object.__new__(_wrapped_class(cls))
    return block


# Note [caches in regions]
#     A region's forward runs again in backward. A KV cache passed to a block is updated in
#     place by its forward (HF's DynamicCache appends keys and values; an EncoderDecoderCache
#     also stores the cross-attention keys and values and flags the layer ``is_updated``), so
#     the recomputation would see another cache: it appends to a cache that already holds this
#     step's keys (other shapes, other ops) and reads the cross-attention keys from it instead
#     of computing them (measured on T5: 56 tensors saved in forward, 52 in recomputation). As
#     HF's own checkpointing does (``GradientCheckpointingLayer``), a block run as a region
#     gets ``use_cache=False`` and no cache object, unless its class says it only reads the
#     cache (``_can_checkpoint_with_cache``). Training needs no cache; a model that makes one
#     because its config says so gets none from wrap (it turns use_cache off in every config).
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")


def _without_cache(block: Any, kwargs: Dict[str, Any], state: _WrapState) -> Dict[str, Any]:
    drop = [] if getattr(block, "_can_checkpoint_with_cache", False) else [
        k for k in _CACHE_KWARGS if kwargs.get(k) is not None]
    if not drop and not kwargs.get("use_cache"):
        return kwargs
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
        drop.append("use_cache")
    for k in drop:
        if k != "use_cache":
            kwargs[k] = None
    if not state.warned_cache:
        state.warned_cache = True
        import warnings

        warnings.warn(
            f"spillover.wrap: a block run as a recompute region ({type(block).__name__}) got "
            f"{', '.join(drop)}; it runs without a KV cache (Note [caches in regions] in "
            "spillover/recompute/blocks.py: recomputation would update the cache twice), as "
            "with HuggingFace gradient checkpointing. Pass use_cache=False when training.",
            stacklevel=3,
        )
    return kwargs


_wrapped_classes: Dict[type, type] = {}


def _wrapped_class(cls: type) -> type:
    if issubclass(cls, _WrappedBlock):
        return cls
    new = _wrapped_classes.get(cls)
    if new is None:
        new = _wrapped_classes[cls] = type(f"Spillover{cls.__name__}", (_WrappedBlock, cls), {})
    return new


def _base_class(cls: type) -> type:
    """The model's own class of a block ``wrap`` swapped (``Spillover<cls>``), else ``cls``."""
    # (Spillover<cls>, _WrappedBlock, cls, ...)
    return cls.__mro__[2] if issubclass(cls, _WrappedBlock) else cls


def _find_blocks(model: nn.Module,
                 check_fn: Optional[Callable[[nn.Module], bool]]) -> List[Tuple[str, nn.Module]]:
    """Note [block lists]: the blocks ``wrap`` makes regions, in the model's module order."""
    if check_fn is not None:
        picked: List[Tuple[str, nn.Module]] = []
        for name, m in model.named_modules():
            if m is model or any(name.startswith(p + ".") for p, _ in picked):
                continue
            if check_fn(m):
                picked.append((name, m))
        return picked
    outer: List[Tuple[str, nn.ModuleList]] = []
    for name, m in model.named_modules():
        if not isinstance(m, nn.ModuleList) or not len(m):
            continue
        if any(p == "" or name.startswith(p + ".") for p, _ in outer):
            continue  # inside a block of an outer list (a T5 block's sublayers, MoE experts)
        outer.append((name, m))
    lists = [(n, m) for n, m in outer if _holds_blocks(m)] or outer
    seen: set = set()
    blocks: List[Tuple[str, nn.Module]] = []
    for name, lst in lists:
        prefix = name + "." if name else ""
        for i, child in enumerate(lst):
            if id(child) not in seen:  # a block shared by two lists is one region
                seen.add(id(child))
                blocks.append((f"{prefix}{i}", child))
    return blocks


def _holds_blocks(lst: nn.ModuleList) -> bool:
    """Whether a list's children look like blocks: modules of modules, holding parameters (not
    a list of heads, embeddings or activations next to the block lists)."""
    return any(next(iter(c.children()), None) is not None for c in lst) and any(
        True for _ in lst.parameters())


def state_of(model: nn.Module) -> Any:
    """What :func:`wrap` or ``hf.enable`` attached to ``model``, or to the outermost module
    inside it that has it (a PEFT wrapper made around a wrapped model); None without."""
    for m in model.modules():
        state = m.__dict__.get("_spillover_state")
        if state is not None:
            return state
    return None


def check_not_double_checkpointed(model: nn.Module) -> None:
    """Raise ValueError when HuggingFace gradient checkpointing is on in ``model`` (a module
    with ``gradient_checkpointing = True`` and a checkpoint function that is not spillover's).

    ``spillover.wrap`` makes each block a recompute region; on a model whose blocks HF already
    checkpoints, a block would be checkpointed twice (recomputed twice in backward, its inputs
    saved twice). Needs no transformers import: HF's switch is plain attributes.
    """
    for name, m in model.named_modules():
        func = getattr(m, "_gradient_checkpointing_func", None)
        if getattr(m, "gradient_checkpointing", False) is True and not getattr(
            func, "is_spillover", False
        ):
            where = f" ({name})" if name else ""
            raise ValueError(
                f"HuggingFace gradient checkpointing is on in this model{where}: spillover.wrap "
                "would checkpoint its blocks a second time. Either let spillover take HF's "
                "switch over with spillover.integrations.hf.enable(model, policy=...) (works "
                "with Trainer(gradient_checkpointing=True)), or turn HF's off first with "
                "model.gradient_checkpointing_disable()."
            )


def wrap(
    model: nn.Module,
    policy: Policy = "selective",
    check_fn: Optional[Callable[[nn.Module], bool]] = None,
    *,
    budget_bytes: Optional[Union[int, str]] = None,
    chunked_loss: bool = True,
) -> nn.Module:
    """Make each repeated block of ``model`` a recompute region, in place; returns ``model``.

    Blocks are the children of every outermost ``nn.ModuleList`` of blocks (GPT-style
    ``blocks``, HuggingFace ``model.layers``; both of an encoder-decoder's ``encoder.layers`` and
    ``decoder.layers``: Note [block lists]), or the outermost modules for which
    ``check_fn(module)`` is true. Each block's class is swapped for a subclass whose ``forward``
    runs the original one under :func:`checkpoint`; parameters, buffers, hooks and
    ``state_dict`` keys do not change. A wrapped model pickles (``torch.save(model)``) and loads
    wrapped, with the same policy.

    Args:
        policy: see :mod:`spillover.recompute`; ``"auto"`` makes a :class:`Planner` for this
            model.
        check_fn: picks the blocks instead of the largest ``ModuleList``.
        budget_bytes: the peak budget of ``"auto"`` (Note [peak feedback]; default
            SPILLOVER_DEVICE_BUDGET_BYTES, else half of free memory).
        chunked_loss: for a transformers causal LM, a training call (``labels=`` given) runs
            the head and loss through torch's chunked ``linear_cross_entropy``: no tokens x
            vocab logits exist, the output's ``logits`` is None (``spillover.loss``, Note
            [which HF models]). ``False`` keeps the model's own head and loss (and logits).

    Raises:
        ValueError: no blocks found, the model is already wrapped, or HuggingFace gradient
            checkpointing is on in it (its blocks would be checkpointed twice: use
            ``spillover.integrations.hf.enable`` to take it over, or turn it off first).

    HuggingFace models: training with ``use_cache=True`` would update the KV cache again
    during recomputation; as HF's own gradient checkpointing does, ``wrap`` turns
    ``use_cache`` off in every config of the model (an encoder-decoder's decoder has its own
    copy; with a warning), and a block run as a region gets no cache object (Note [caches in
    regions]).
    """
    if "_spillover_state" in model.__dict__:
        raise ValueError("this model is already wrapped; call spillover.unwrap(model) first")
    inner = state_of(model)
    if inner is not None:  # e.g. a PEFT wrapper around a model wrap() or hf.enable() took
        raise ValueError(
            f"a model inside this {type(model).__name__} is already under spillover "
            f"({'hf.enable' if type(inner).__name__ == '_HFState' else 'spillover.wrap'}): it "
            "applies through the wrapper as it is; call spillover.unwrap / "
            "spillover.integrations.hf.disable on that model first to change the policy")
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
        model.register_forward_pre_hook(state.pre_forward, with_kwargs=True),
        model.register_forward_hook(state.post_forward, always_call=True),
    ]
    model.__dict__["_spillover_state"] = state
    # after wrap's own hooks, prepended: the loss runs inside the step wrap's hooks delimit; on
    # the causal LM inside a PEFT wrapper, as when wrap ran before get_peft_model
    state.loss_region, state.loss_line = _loss.attach(_loss.target(model), chunked_loss)
    turned_off = []
    configs: Dict[int, Any] = {}
    for name, m in model.named_modules():
        cfg = getattr(m, "config", None)
        if cfg is not None and id(cfg) not in configs:
            configs[id(cfg)] = cfg
            if getattr(cfg, "use_cache", False) is True:
                cfg.use_cache = False
                turned_off.append(f"{name}.config" if name else "config")
    if turned_off:
        import warnings

        warnings.warn(
            f"spillover.wrap: setting use_cache=False in {', '.join(turned_off)} (recomputed "
            "blocks would update the KV cache twice), as HuggingFace gradient checkpointing does",
            stacklevel=2,
        )
    return model


def unwrap(model: nn.Module) -> nn.Module:
    """Undo :func:`wrap` in place; returns ``model``."""
    state: Optional[_WrapState] = model.__dict__.pop("_spillover_state", None)
    if state is None:
        return model
    for h in state.handles:
        h.remove()
    if state.loss_region is not None:
        state.loss_region.remove()
    for _name, blk in state.blocks:
        blk.__dict__.pop("_spillover_block", None)
        cls = type(blk)
        if issubclass(cls, _WrappedBlock):
            blk.__class__ = _base_class(cls)
    return model
