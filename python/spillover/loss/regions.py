"""Which models get the loss region, and the hooks that route their loss through
:func:`~spillover.loss.chunked.causal_lm_loss`: HuggingFace causal LMs (:class:`LossRegion`) and
models of one's own with a ``spillover_chunked_loss`` switch (:class:`FlagRegion`).

Note [which HF models]
    The head and loss are taken over only where the result is the same math: a class in
    transformers' causal-LM mapping whose ``forward`` passes ``self.lm_head(...)`` straight to
    ``self.loss_function`` (checked on its source: nothing between the two lines but
    ``loss = None`` / ``if labels is not None:``), whose loss function is HF's
    ``ForCausalLMLoss`` and whose head is a plain ``nn.Linear`` without bias. Final logit
    soft-capping (Gemma 2/3), logit scales (Cohere, Granite), a bias, a LoRA-adapted head or a
    custom loss function leave the model as it was, with one info log and the reason in
    ``spillover.explain(model)``. Only training calls change: ``labels`` given and gradients
    enabled; ``logits_to_keep`` left at 0. The output's ``loss`` is set and its ``logits`` is
    ``None``; a caller that needs the logits in training passes ``chunked_loss=False``.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .chunked import available, causal_lm_loss, chunk_rows, warn_missing

__all__ = ["LossRegion", "FlagRegion", "attach", "detach", "describe", "unsupported_reason",
           "FLAG"]

_log = logging.getLogger("spillover")

#: The attribute a model of its own may expose to be switched by wrap (``FlagRegion``): a bool
#: its forward reads to compute the loss through :func:`chunked_cross_entropy`.
FLAG = "spillover_chunked_loss"


# -- HuggingFace causal LMs (Note [which HF models]) -----------------------------------------

_BETWEEN_OK = re.compile(r"^\s*(#.*)?$|^\s*loss\s*=\s*None\s*$|^\s*if labels is not None:\s*$")


def _causal_lm_names() -> set:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return set()
    names: set = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


_source_ok: Dict[type, Optional[str]] = {}


def _forward_reason(cls: type) -> Optional[str]:
    """Why ``cls.forward`` does something to the logits between head and loss, or None."""
    if cls in _source_ok:
        return _source_ok[cls]
    reason: Optional[str] = None
    try:
        lines = inspect.getsource(cls.forward).splitlines()
    except (OSError, TypeError):
        lines = []
    head = [i for i, s in enumerate(lines) if "self.lm_head(" in s]
    loss = [i for i, s in enumerate(lines) if "self.loss_function(" in s]
    if len(head) != 1 or len(loss) != 1 or not head[0] < loss[0]:
        reason = "its forward does not call self.lm_head once and then self.loss_function"
    else:
        extra = [s.strip() for s in lines[head[0] + 1:loss[0]] if not _BETWEEN_OK.match(s)]
        if extra:
            reason = f"its forward changes the logits before the loss ({extra[0]!r})"
    _source_ok[cls] = reason
    return reason


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why the loss region cannot take over ``model``'s head and loss exactly, or None."""
    cls = type(model)
    if cls.__name__ not in _causal_lm_names():
        return f"{cls.__name__} is not a transformers causal LM"
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling"):
        if getattr(cfg, attr, None) not in (None, 1, 1.0):
            return f"config.{attr}={getattr(cfg, attr)!r} changes the logits before the loss"
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        return (f"its lm_head is a {type(head).__name__}, not a plain nn.Linear "
                "(an adapter or quantized head)")
    if head.bias is not None:
        return "its lm_head has a bias"
    why = _forward_reason(cls)
    if why:
        return why
    lf = getattr(cls, "loss_function", None)
    try:
        fn = model.loss_function
    except Exception as e:  # noqa: BLE001 - any failure means "not HF's plain loss"
        return f"its loss_function cannot be read ({e})"
    if lf is None or getattr(fn, "__name__", "") != "ForCausalLMLoss":
        return (f"its loss_function is {getattr(fn, '__name__', fn)!r}, not transformers' "
                "ForCausalLMLoss")
    return None


class LossRegion:
    """The hooks that route a HF causal LM's training loss through :func:`causal_lm_loss`
    (Note [which HF models]). An object with plain state, so ``torch.save(model)`` pickles it.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.handles: list = []
        self.calls = 0
        self._pending: Optional[Tuple[Dict[str, Any], bool]] = None
        self._hidden: Optional[torch.Tensor] = None
        params = list(inspect.signature(type(model).forward).parameters)[1:]
        self._labels_pos = params.index("labels") if "labels" in params else None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["handles"] = []  # hook handles are the module's, re-made by __setstate__
        state["_pending"] = state["_hidden"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        # the hooks themselves pickle with the module's hook dicts; keep handles to remove them
        self.handles = [_Handle(self.model, self)]

    def describe(self) -> str:
        rows = chunk_rows(self.model.lm_head.weight.shape[0])
        return (f"lm_head + loss through torch's chunked linear_cross_entropy, {rows} tokens "
                "per chunk (no logits in training; chunked_loss=False for logits)")

    def install(self) -> None:
        self.handles = [
            self.model.register_forward_pre_hook(self.pre, with_kwargs=True, prepend=True),
            self.model.register_forward_hook(self.post, always_call=True, prepend=True),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    def _capture(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.model.lm_head  # type: ignore[union-attr]
        if self._pending is None:
            # left over from a forward that raised before post() could restore the head (torch
            # skips always_call hooks when the forward raised before returning): be the head
            head.__dict__.pop("forward", None)
            return head(hidden)
        self._hidden = hidden
        # what the forward sees as its logits until post() drops them: no vocab columns
        return hidden.new_empty(hidden.shape[:-1] + (0,))

    def pre(self, model: nn.Module, args: Tuple[Any, ...],
            kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        self._pending = None
        head = model.lm_head  # type: ignore[union-attr]
        head.__dict__.pop("forward", None)  # a previous forward that raised (see _capture)
        if not torch.is_grad_enabled() or kwargs.get("logits_to_keep", 0) not in (0, None):
            return None
        custom = model.__dict__.get("_loss_function")  # HF's loss_function setter
        if custom is not None and getattr(custom, "__name__", "") != "ForCausalLMLoss":
            return None  # a loss function set after wrap/enable: the model's own path runs it
        if torch.compiler.is_compiling():
            # torch.compile runs the chunked op eagerly anyway (a graph break); as wrap's own
            # hooks do, a compiled forward is left as the model wrote it
            return None
        labels = kwargs.get("labels")
        pos = self._labels_pos
        if labels is None and pos is not None and len(args) > pos:
            labels, args = args[pos], args[:pos] + (None,) + args[pos + 1:]
        if labels is None and kwargs.get("shift_labels") is None:
            return None
        kwargs = dict(kwargs)
        loss_kw = {k: kwargs.get(k) for k in ("num_items_in_batch", "shift_labels")}
        loss_kw["ignore_index"] = kwargs.get("ignore_index", -100)
        loss_kw["labels"] = labels
        kwargs["labels"] = None
        # the model's own loss never runs: HF passes shift_labels only to its loss function
        kwargs.pop("shift_labels", None)
        rd = kwargs.get("return_dict")
        if rd is None:
            rd = getattr(getattr(model, "config", None), "return_dict", True)
        kwargs["return_dict"] = True  # a ModelOutput to put the loss in; a tuple again in post
        self._pending = (loss_kw, rd is False)
        self._hidden = None
        head.forward = self._capture  # the instance attribute shadows the class's forward
        return args, kwargs

    def post(self, model: nn.Module, args: Any, out: Any) -> Any:
        pending, self._pending = self._pending, None
        model.lm_head.__dict__.pop("forward", None)  # type: ignore[union-attr]
        hidden, self._hidden = self._hidden, None
        if pending is None or out is None or hidden is None:
            return None  # not a training call, or the forward raised / never reached the head
        loss_kw, want_tuple = pending
        self.calls += 1
        loss = causal_lm_loss(hidden, model.lm_head.weight, **loss_kw)  # type: ignore[union-attr]
        # a new output, so that its fields keep their order (loss first) in to_tuple()
        out = dataclasses.replace(out, loss=loss, logits=None)
        return out.to_tuple() if want_tuple else out


class FlagRegion:
    """The loss region of a model of its own that exposes :data:`FLAG` (``spillover.models.GPT``
    does): a bool its forward reads to compute the loss by :func:`chunked_cross_entropy`.
    ``wrap`` sets it and ``unwrap`` restores what it was."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.before = bool(getattr(model, FLAG))

    def install(self) -> None:
        setattr(self.model, FLAG, True)

    def remove(self) -> None:
        setattr(self.model, FLAG, self.before)

    def describe(self) -> str:
        return ("head + loss through torch's chunked linear_cross_entropy (the model's "
                f"{FLAG} switch; rows per chunk from its vocabulary, Note [loss chunks]; "
                "chunked_loss=False for logits)")


class _Handle:
    """After unpickling: removes this region's hooks from the model's hook dicts."""

    def __init__(self, model: nn.Module, region: LossRegion):
        self.model, self.region = model, region

    def remove(self) -> None:
        for d in (self.model._forward_pre_hooks, self.model._forward_hooks):
            for k, fn in list(d.items()):
                if getattr(fn, "__self__", None) is self.region:
                    del d[k]


_logged: set = set()


def attach(model: nn.Module, chunked_loss: bool = True) -> Tuple[Optional[LossRegion], str]:
    """Turn the loss region on for ``model`` where it applies (Note [which HF models]; a model
    with a :data:`FLAG` attribute has it set, :class:`FlagRegion`).

    Returns the region (None where it is off) and a line for ``explain``: what runs, or why
    the head and loss stay as they were. A model outside transformers' causal LMs is left
    alone silently; a causal LM left alone is logged once per class (INFO, logger
    "spillover"); a torch without the function warns once.
    """
    if not chunked_loss:
        return None, "off (chunked_loss=False): the model's own head and loss"
    if isinstance(getattr(model, FLAG, None), bool):
        if not available():
            warn_missing()  # the model's chunked_cross_entropy calls run unchunked
        flag = FlagRegion(model)
        flag.install()
        return flag, flag.describe()
    reason = unsupported_reason(model)
    if reason is not None:
        if reason.endswith("is not a transformers causal LM"):
            return None, "not a transformers causal LM: the model's own head and loss"
        line = f"the model's own head and loss: {reason}"
        if type(model) not in _logged:
            _logged.add(type(model))
            _log.info("spillover: chunked loss region off for %s: %s", type(model).__name__,
                      reason)
        return None, line
    if not available():
        warn_missing()
        return None, f"the model's own head and loss: torch {torch.__version__} has no " \
            "linear_cross_entropy"
    region = LossRegion(model)
    region.install()
    return region, region.describe()


def detach(region: Optional[LossRegion]) -> None:
    if region is not None:
        region.remove()


def describe(model: nn.Module) -> Optional[str]:
    """The loss-region line of a model under ``wrap`` / ``hf.enable``, or None."""
    state = model.__dict__.get("_spillover_state")
    return getattr(state, "loss_line", None)
