"""HuggingFace transformers and PEFT: spillover behind the model's own checkpointing switch.

::

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(...), LoraConfig(...))
    hf.enable(model, policy="selective")           # HF's checkpoint function becomes spillover's
    trainer = Trainer(model, TrainingArguments(..., gradient_checkpointing=True),
                      train_dataset=..., callbacks=[hf.SpilloverCallback(tier="auto")])
    trainer.train()

Note [HF's checkpointing switch]
    transformers checkpoints a decoder layer by calling ``layer._gradient_checkpointing_func(
    partial(forward, layer, **kwargs), *args)`` (``GradientCheckpointingLayer``; releases before
    it call the same attribute from the model's layer loop with ``layer.__call__``). Whoever
    turns checkpointing on — ``gradient_checkpointing_enable`` / ``activation_checkpointing_
    enable``, ``Trainer(gradient_checkpointing=True)`` at ``train()``, PEFT's
    ``prepare_model_for_kbit_training`` — sets that attribute through the model's
    ``_set_gradient_checkpointing``. :func:`enable` replaces that method on the instance so the
    function installed is always a :class:`_SpilloverCheckpoint`, then turns checkpointing on
    through HF's own entry point. So HF keeps doing everything it does around checkpointing
    (``use_cache`` off in training layers, ``enable_input_require_grads`` for adapters over
    frozen embeddings), every layer is checkpointed once, by spillover, and HF's checkpoint
    options (``use_reentrant``, ``offload``) no longer apply: spillover's regions are always
    non-reentrant (which is also why frozen embeddings need no ``requires_grad`` input).

Note [Trainer steps]
    ``Trainer`` calls ``on_step_begin`` before the first micro-batch of an optimizer step and
    ``on_step_end`` after the last micro-batch's backward, the gradient clipping and the
    optimizer step (``on_substep_end`` between micro-batches). :class:`SpilloverCallback` enters
    its context at the first and leaves it at the second, so one context step covers every
    forward and backward of gradient accumulation; logging, saving and evaluation run after
    ``on_step_end``, outside it.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch.utils.checkpoint as _tc
from torch import nn

from ..activations import OffloadContext
from ..planner import Planner
from ..recompute.blocks import _WrappedBlock, _WrapState, check_not_double_checkpointed, state_of
from ..recompute.policies import Policy, RegionPolicy, SelectivePolicy, _Auto, resolve_policy
from ..recompute.region import _checkpoint
from ..suspend import forward_regions
from . import StepContext, _StepCallback

try:
    from transformers import TrainerCallback as _TrainerCallback
except ImportError:  # pragma: no cover - the callback needs transformers; enable() says so
    _TrainerCallback = object  # type: ignore[assignment,misc]

__all__ = ["enable", "disable", "is_enabled", "SpilloverCallback",
           "check_not_double_checkpointed"]


class _SpilloverCheckpoint:
    """A model's ``_gradient_checkpointing_func`` under spillover: each call runs one layer as a
    recompute region of the model's policy, keyed by the layer's name (Note [HF's checkpointing
    switch]). Once spillover is turned off for the model (:func:`disable`, or
    ``spillover.unwrap``), calls run torch's non-reentrant checkpoint, HF's default."""

    is_spillover = True

    def __init__(self, state: Optional[_HFState]):
        self._state = weakref.ref(state) if state is not None else None

    def __reduce__(self) -> Any:
        # torch.save(model) (Note [pickling a wrapped model] in recompute/blocks.py): the
        # state travels as itself (the layers and the state's func are one object in the pickle)
        return (_SpilloverCheckpoint, (self._state() if self._state is not None else None,))

    def __call__(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        state = self._state() if self._state is not None else None
        if state is None or not state.attached():
            return _tc.checkpoint(fn, *args, use_reentrant=False, **kwargs)
        layer = _layer_of(fn)
        name = state.names.get(id(layer), "") if layer is not None else ""
        return _checkpoint(fn, args, kwargs, state.policy, key=name or None, name=name,
                           state=state)


def _layer_of(fn: Callable[..., Any]) -> Optional[nn.Module]:
    if isinstance(fn, functools.partial) and fn.args and isinstance(fn.args[0], nn.Module):
        return fn.args[0]  # partial(forward, layer, **kwargs)
    owner = getattr(fn, "__self__", None)  # layer.__call__ (transformers < 4.52)
    return owner if isinstance(owner, nn.Module) else None


class _HFState(_WrapState):
    """What :func:`enable` attaches (as ``_spillover_state``, so ``spillover.explain`` reads it
    and ``spillover.wrap`` refuses the model) to the transformers model and to the object the
    caller passed (a PEFT model), when that is another one."""

    def __init__(self, model: nn.Module, policy: RegionPolicy,
                 blocks: List[Tuple[str, nn.Module]], owners: List[nn.Module]):
        super().__init__(model, policy, blocks)
        self.names: Dict[int, str] = {id(m): name for name, m in blocks}
        self.owners = [weakref.ref(o) for o in owners]
        self.func = _SpilloverCheckpoint(self)
        self._depth = 0

    def __getstate__(self) -> Dict[str, Any]:
        # torch.save(model): weak references and ids of this process do not pickle
        state = super().__getstate__()
        state["owners"] = [o for o in (ref() for ref in self.owners) if o is not None]
        del state["names"]
        state["_depth"] = 0
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.owners = [weakref.ref(o) for o in state["owners"]]
        self.names = {id(m): name for name, m in self.blocks}

    # A step begins at the outermost of the hooked forwards: PEFT's LoraModel calls the base
    # model's forward directly (no hooks), so the wrapper and every PreTrainedModel inside are
    # hooked, and only the outermost call of a forward counts.
    def pre_forward(self, model: nn.Module, args: Any, kwargs: Any = None) -> None:
        self._depth += 1
        if self._depth == 1:
            super().pre_forward(model, args, kwargs)

    def post_forward(self, model: nn.Module, args: Any, out: Any) -> None:
        self._depth = max(0, self._depth - 1)
        if self._depth == 0:
            super().post_forward(model, args, out)

    def attached(self) -> bool:
        for ref in self.owners:
            o = ref()
            if o is None or o.__dict__.get("_spillover_state") is not self:
                return False
        return True


def _pretrained_class() -> type:
    try:
        from transformers import PreTrainedModel
    except ImportError as e:
        raise ImportError("spillover.integrations.hf needs transformers "
                          "(pip install transformers)") from e
    return PreTrainedModel  # type: ignore[no-any-return]


def _pretrained(model: nn.Module) -> Any:
    """The outermost transformers ``PreTrainedModel`` in ``model`` (itself, or the base model
    inside a PEFT wrapper)."""
    cls = _pretrained_class()
    for m in model.modules():
        if isinstance(m, cls):
            return m
    raise TypeError(f"spillover.integrations.hf.enable: {type(model).__name__} holds no "
                    "transformers PreTrainedModel; use spillover.wrap(model) for other models")


def _region_policy(policy: Policy, budget_bytes: Optional[Union[int, str]]) -> RegionPolicy:
    # as spillover.wrap: "auto" and "selective" get a policy object of their own per model
    name = policy.strip().lower() if isinstance(policy, str) else None
    if name == "auto":
        return _Auto(Planner(budget_bytes=budget_bytes))
    if budget_bytes is not None:
        raise ValueError("budget_bytes= is for policy='auto'")
    if name == "selective":
        return SelectivePolicy()
    return resolve_policy(policy)


def is_enabled(model: nn.Module) -> bool:
    """Whether :func:`enable` is in effect on ``model`` or on the transformers model in it
    (``enable(base)`` then ``get_peft_model(base)``: True for the PEFT model too)."""
    state = state_of(model)
    return isinstance(state, _HFState) and state.attached()


def enable(model: nn.Module, policy: Policy = "selective", *,
           budget_bytes: Optional[Union[int, str]] = None,
           chunked_loss: bool = True) -> nn.Module:
    """Turn spillover on for a transformers model, PEFT-wrapped or not; returns ``model``.

    Gradient checkpointing is turned on through the model's own switch, with spillover's
    checkpoint function in place of torch's: each decoder layer HF checkpoints becomes a
    recompute region of ``policy`` (Note [HF's checkpointing switch]). Turning HF checkpointing
    on again later — ``Trainer(gradient_checkpointing=True)``, ``model.gradient_checkpointing_
    enable(...)`` — keeps spillover's function. If HF checkpointing was already on, spillover
    takes it over. Calling ``enable`` again replaces the policy.

    Run forward inside an ``offload_context`` (a ``Trainer`` does that with
    :class:`SpilloverCallback`) for the tensors the regions save to leave the device.

    Args:
        policy: as :func:`spillover.wrap` (``"selective"``, ``"full"``, ``"offload"``,
            ``"auto"``, a callable or a policy object).
        budget_bytes: the device-memory budget of ``"auto"``.
        chunked_loss: as :func:`spillover.wrap`: a causal LM's training calls (``labels=``
            given) compute the head and loss by torch's chunked ``linear_cross_entropy``,
            without logits (the output's ``logits`` is None); ``False`` keeps them. PEFT's
            wrapper reaches it through the base model's hooks (a LoRA-adapted ``lm_head``
            keeps HF's loss).

    Raises:
        ValueError: the model is already wrapped by :func:`spillover.wrap` (its blocks would be
            checkpointed twice: ``spillover.unwrap(model)`` first), or does not support
            gradient checkpointing.
        TypeError: ``model`` holds no transformers ``PreTrainedModel``.
    """
    hf = _pretrained(model)
    owners = [hf] if hf is model else [hf, model]
    for o in owners:
        st = o.__dict__.get("_spillover_state")
        if st is not None and not isinstance(st, _HFState):
            raise ValueError("this model is wrapped by spillover.wrap: its blocks are recompute "
                             "regions already. Call spillover.unwrap(model) before "
                             "spillover.integrations.hf.enable(model), or keep wrap() alone")
    if any(isinstance(m, _WrappedBlock) for m in model.modules()):
        raise ValueError("part of this model is wrapped by spillover.wrap; call "
                         "spillover.unwrap on it first")
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(hf).__name__} does not support gradient checkpointing, which "
                         "spillover.integrations.hf.enable drives; use spillover.wrap(model)")
    if isinstance(hf.__dict__.get("_spillover_state"), _HFState):
        disable(model)
    original = hf._set_gradient_checkpointing
    if "value" in inspect.signature(original).parameters:
        raise ValueError(f"{type(hf).__name__} uses transformers' pre-4.35 checkpointing "
                         "interface (_set_gradient_checkpointing(module, value)), which takes no "
                         "checkpoint function; use spillover.wrap(model) instead")

    pol = _region_policy(policy, budget_bytes)
    pretrained = _pretrained_class()
    blocks = [(name, m) for name, m in hf.named_modules()
              if hasattr(m, "gradient_checkpointing") and not isinstance(m, pretrained)]
    state = _HFState(hf, pol, blocks, owners)
    pol.attach(hf)
    hooked: Dict[int, Any] = {
        id(m): m for m in [*owners, *(m for m in hf.modules() if isinstance(m, pretrained))]
    }
    for m in hooked.values():
        state.handles += [m.register_forward_pre_hook(state.pre_forward, with_kwargs=True),
                          m.register_forward_hook(state.post_forward, always_call=True)]
    hf.__dict__["_set_gradient_checkpointing"] = _SetCheckpointing(hf, original, state.func)
    for o in owners:
        o.__dict__["_spillover_state"] = state
    from .. import loss as _loss

    state.loss_region, state.loss_line = _loss.attach(hf, chunked_loss)
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.x
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class _SetCheckpointing:
    """A model's ``_set_gradient_checkpointing`` under :func:`enable` (Note [HF's checkpointing
    switch]): whoever turns checkpointing on gets spillover's function. An object, not a
    closure, so that ``torch.save(model)`` pickles it."""

    def __init__(self, model: nn.Module, original: Callable[..., Any],
                 func: _SpilloverCheckpoint):
        self.model = model
        # The class's method is found again at call time (a bound method would pickle as
        # getattr(model, name): this object); anything else someone put there is kept as is.
        own = getattr(type(model), "_set_gradient_checkpointing", None)
        self.original = None if getattr(original, "__func__", None) is own else original
        self.func = func

    def __call__(self, enable: bool = True, gradient_checkpointing_func: Any = None,
                 **kwargs: Any) -> Any:
        original = self.original or functools.partial(
            type(self.model)._set_gradient_checkpointing, self.model)  # type: ignore[attr-defined]
        return original(enable=enable, gradient_checkpointing_func=self.func, **kwargs)


def disable(model: nn.Module) -> nn.Module:
    """Undo :func:`enable`; returns ``model``. HF gradient checkpointing stays on, with torch's
    non-reentrant checkpoint (HF's default) in place of spillover's; turn it off with
    ``model.gradient_checkpointing_disable()``."""
    hf = _pretrained(model)
    state = hf.__dict__.get("_spillover_state")
    if not isinstance(state, _HFState):
        return model
    for h in state.handles:
        h.remove()
    if state.loss_region is not None:
        state.loss_region.remove()
    hf.__dict__.pop("_set_gradient_checkpointing", None)
    for ref in state.owners:
        o = ref()
        if o is not None and o.__dict__.get("_spillover_state") is state:
            del o.__dict__["_spillover_state"]
    plain = functools.partial(_tc.checkpoint, use_reentrant=False)
    for m in hf.modules():
        if getattr(m, "_gradient_checkpointing_func", None) is state.func:
            setattr(m, "_gradient_checkpointing_func", plain)  # noqa: B010
    return model


class SpilloverCallback(_StepCallback, _TrainerCallback):  # type: ignore[misc,valid-type]
    """A ``transformers.TrainerCallback`` that runs one offload context around each optimizer
    step (Note [Trainer steps]): every forward and backward of the step's micro-batches, so
    with gradient accumulation too. The same context object is entered at every step.

    Pair it with :func:`enable` for recompute regions behind HF's checkpointing; without it,
    the context still offloads what the model saves.

    A loss that computes gradients with ``torch.func`` (Liger's chunked losses, as TRL's
    trainers use them; Unsloth's fused loss) raises under the context's saved-tensor hooks;
    it must run inside :func:`spillover.no_offload`. A callback reaches only modules: pass the
    loss module in ``no_offload=`` (e.g. ``no_offload=trainer.dpo_loss_fn``, then
    ``trainer.add_callback(cb)``). A loss computed by a plain function inside the model's
    forward (a patched ``forward``, ``model.loss_function``) is out of a callback's reach:
    wrap that function yourself, ``loss_fn = spillover.no_offload()(loss_fn)``.

    Args:
        context: the context to enter each step (default: a new one).
        no_offload: a module, or several, whose every forward runs in
            :func:`spillover.no_offload` (the hooks stay on them; outside a context they do
            nothing).
        tier, **overrides: as :func:`spillover.offload_context`, for a new context.

    Attributes:
        steps: the :class:`~spillover.integrations.StepContext` (``steps.step_stats``: the
            counters of each optimizer step).
        no_offload_hooks: one handle per ``no_offload=`` module; ``remove()`` takes its hooks
            off.
    """

    def __init__(self, context: Optional[OffloadContext] = None, *, tier: Optional[str] = None,
                 no_offload: Union[None, nn.Module, Iterable[nn.Module]] = None,
                 **overrides: Any):
        self.steps = StepContext(context, tier=tier, **overrides)
        self.no_offload_hooks = forward_regions(no_offload)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None,
                       **kwargs: Any) -> None:
        # Trainer(gradient_checkpointing=True) turns HF's checkpointing on at train(), after a
        # spillover.wrap() made the same layers regions: each would be checkpointed twice.
        if model is not None and any(isinstance(m, _WrappedBlock) for m in model.modules()):
            try:
                check_not_double_checkpointed(model)
            except ValueError as e:
                raise ValueError(
                    "SpilloverCallback: the Trainer turned HF gradient checkpointing on over "
                    "blocks spillover.wrap made recompute regions; each would be checkpointed "
                    "twice. Use spillover.integrations.hf.enable(model) instead of wrap(), or "
                    f"gradient_checkpointing=False. ({e})"
                ) from None

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.begin()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.end()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.steps.end()  # a step the loop left open (it stops only after on_step_end)
