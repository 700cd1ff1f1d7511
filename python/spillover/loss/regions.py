"""Which models get the loss region, and the hooks that route their loss through
:func:`~spillover.loss.chunked.causal_lm_loss`: HuggingFace causal LMs (:class:`LossRegion`) and
models of one's own with a ``spillover_chunked_loss`` switch (:class:`FlagRegion`).

Note [which HF models]
    The head and loss are taken over only where the result is the same math: a class in
    transformers' causal-LM mapping whose ``forward`` passes ``self.lm_head(...)`` to
    ``self.loss_function`` (checked on its source: nothing between the two lines but
    ``loss = None`` / ``if labels is not None:`` and, exactly as transformers writes them, one
    of the logit transforms of :data:`_TRANSFORMS`: Gemma 2/3's final soft-capping, Cohere's
    logit scale, Granite's logits scaling), whose loss function is HF's ``ForCausalLMLoss``
    and whose head is a plain ``nn.Linear`` (a bias is taken along). A transform is chunked
    with the loss by spillover's own chunks (Note [logit transforms] in fused.py), on every
    torch. A config that sets a transform the forward does not show as one of those, a
    LoRA-adapted or quantized head or a custom loss function leave the model as it was, with
    one info log and the reason in ``spillover.explain(model)``. Only training calls change:
    ``labels`` given and gradients enabled; ``logits_to_keep`` left at 0. The output's ``loss``
    is set and its ``logits`` is ``None``; a caller that needs the logits in training passes
    ``chunked_loss=False``. Inside a PEFT wrapper the region sits on the causal LM the wrapper
    calls (:func:`target`), so ``wrap``/``hf.enable`` before and after ``get_peft_model`` give
    the same model.

Note [the loss region yields]
    The region computes the loss only where the model's own forward would: for a training call
    with labels it stands in for the head (keeps the hidden states, returns logits of zero
    columns) and for the model's ``loss_function`` (HF's ``ForCausalLMLoss`` arguments -- the
    labels, ``num_items_in_batch``, ``shift_labels``, ``ignore_index`` -- exactly as HF's
    forward passes them), and takes both stand-ins off when the forward returns. It changes
    none of the call's arguments. A forward patched by a trainer that computes its own loss
    without the model's head call (TRL's ``add_fused_lm_head``: ``model(...,
    fused_lm_head=True)`` runs the backbone and its own chunked log-probabilities) never calls
    the stand-ins, so the trainer's loss runs as written; the region once moved ``labels`` out
    of the call, and TRL's forward then failed on ``labels[:, 1:]`` (None) at its first step.
    A forward that calls the head through the model but no loss function (no labels reached
    it) gets a clear error naming ``chunked_loss=False``, never zero-column logits silently.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import re
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from .chunked import OWN, TORCH, available, backend, causal_lm_loss, chunk_rows

__all__ = ["LossRegion", "FlagRegion", "attach", "detach", "describe", "unsupported_reason",
           "target", "transform_of", "FLAG"]

_log = logging.getLogger("spillover")

#: The attribute a model of its own may expose to be switched by wrap (``FlagRegion``): a bool
#: its forward reads to compute the loss through :func:`chunked_cross_entropy`.
FLAG = "spillover_chunked_loss"


# -- HuggingFace causal LMs (Note [which HF models]) -----------------------------------------

_BETWEEN_OK = re.compile(r"^\s*(#.*)?$|^\s*loss\s*=\s*None\s*$|^\s*if labels is not None:\s*$")

#: The logit transforms between head and loss taken over (Note [which HF models]): the lines as
#: transformers writes them (stripped, comments off) -> the kind of transform
_TRANSFORMS = {
    ("if self.config.final_logit_softcapping is not None:",
     "logits = logits / self.config.final_logit_softcapping",
     "logits = torch.tanh(logits)",
     "logits = logits * self.config.final_logit_softcapping"): "softcap",
    ("logits = logits * self.logit_scale",): "scale",
    ("logits = logits / self.config.logits_scaling",): "inverse scale",
}
#: Config attributes that change the logits, the transform the forward must show for each, and
#: the values that leave the logits as they are
_CONFIG_TRANSFORMS = {"final_logit_softcapping": ("softcap", (None,)),
                      "logit_scale": ("scale", (None, 1, 1.0)),
                      "logits_scaling": ("inverse scale", (None, 1, 1.0))}


def _causal_lm_names() -> set:
    try:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except ImportError:
        return set()
    names: set = set()
    for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values():
        names.update(v if isinstance(v, (list, tuple)) else [v])
    return names


_source_ok: Dict[type, Tuple[Optional[str], Optional[str]]] = {}


def _forward_reason(cls: type) -> Tuple[Optional[str], Optional[str]]:
    """Why ``cls.forward`` does something to the logits between head and loss (None where
    it does not), and the known transform it applies there (:data:`_TRANSFORMS`, or None)."""
    if cls in _source_ok:
        return _source_ok[cls]
    reason: Optional[str] = None
    kind: Optional[str] = None
    try:
        lines = inspect.getsource(cls.forward).splitlines()
    except (OSError, TypeError):
        lines = []
    head = [i for i, s in enumerate(lines) if "self.lm_head(" in s]
    loss = [i for i, s in enumerate(lines) if "self.loss_function(" in s]
    if len(head) != 1 or len(loss) != 1 or not head[0] < loss[0]:
        reason = "its forward does not call self.lm_head once and then self.loss_function"
    else:
        extra = tuple(s.split("#", 1)[0].strip() for s in lines[head[0] + 1:loss[0]]
                      if not _BETWEEN_OK.match(s))
        kind = _TRANSFORMS.get(extra) if extra else None
        if extra and kind is None:
            reason = f"its forward changes the logits before the loss ({extra[0]!r})"
    _source_ok[cls] = (reason, kind)
    return reason, kind


def transform_of(model: nn.Module) -> Dict[str, float]:
    """The logit transform ``model``'s forward applies between head and loss, as the keyword
    arguments of :func:`~spillover.loss.chunked.chunked_cross_entropy` (``softcap``,
    ``scale``; empty for none), read from the model now (Note [logit transforms])."""
    _, kind = _forward_reason(type(model))
    cfg = getattr(model, "config", None)
    if kind == "softcap":
        cap = getattr(cfg, "final_logit_softcapping", None)
        return {"softcap": float(cap)} if cap else {}
    if kind == "scale":
        return {"scale": float(model.logit_scale)}
    if kind == "inverse scale":
        return {"scale": 1.0 / float(cfg.logits_scaling)}  # type: ignore[union-attr]
    return {}


def unsupported_reason(model: nn.Module) -> Optional[str]:
    """Why the loss region cannot take over ``model``'s head and loss exactly, or None."""
    cls = type(model)
    if cls.__name__ not in _causal_lm_names():
        return f"{cls.__name__} is not a transformers causal LM"
    head = getattr(model, "lm_head", None)
    if type(head) is not nn.Linear:
        return (f"its lm_head is a {type(head).__name__}, not a plain nn.Linear "
                "(an adapter or quantized head)")
    why, kind = _forward_reason(cls)
    if why:
        return why
    cfg = getattr(model, "config", None)
    for attr, (needs, neutral) in _CONFIG_TRANSFORMS.items():
        if getattr(cfg, attr, None) not in neutral and kind != needs:
            return (f"config.{attr}={getattr(cfg, attr)!r} changes the logits before the loss "
                    "in a way its forward does not show")
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
    """The hooks that compute a HF causal LM's training loss by :func:`causal_lm_loss` where
    the model's own forward would (Note [which HF models], Note [the loss region yields]). An
    object with plain state, so ``torch.save(model)`` pickles it.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.handles: list = []
        self.calls = 0
        self._armed = False
        params = list(inspect.signature(type(model).forward).parameters)[1:]
        self._labels_pos = params.index("labels") if "labels" in params else None
        self._hidden: Optional[torch.Tensor] = None
        self._empty: Optional[torch.Tensor] = None
        self._loss: Optional[torch.Tensor] = None

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["handles"] = []  # hook handles are the module's, re-made by __setstate__
        state["_armed"] = False
        state["_hidden"] = state["_empty"] = state["_loss"] = None
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        # the hooks themselves pickle with the module's hook dicts; keep handles to remove them
        self.handles = [_Handle(self.model, self)]

    def describe(self) -> str:
        rows = chunk_rows(self.model.lm_head.weight.shape[0])
        return f"lm_head + loss {_through(backend(**transform_of(self.model)))}, {rows} " \
            "tokens per chunk (no logits in training; chunked_loss=False for logits)"

    def install(self) -> None:
        self.handles = [
            self.model.register_forward_pre_hook(self.pre, with_kwargs=True, prepend=True),
            self.model.register_forward_hook(self.post, always_call=True, prepend=True),
        ]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        self._disarm()

    def _disarm(self) -> None:
        """Take the head's and the loss function's stand-ins off the model (also what a forward
        that raised left: torch skips ``always_call`` hooks when the forward raised before
        returning)."""
        self._armed = False
        self.model.lm_head.__dict__.pop("forward", None)  # type: ignore[union-attr]
        if self.model.__dict__.get("_loss_function") == self._loss_fn:  # (a bound method)
            del self.model.__dict__["_loss_function"]

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's stand-in: keep the hidden states, return logits of no vocab columns."""
        if not self._armed or self._hidden is not None:
            # called outside the armed forward, or a second time in it: be the head
            return self.model.lm_head.__class__.forward(self.model.lm_head, hidden)
        self._hidden = hidden
        self._empty = hidden.new_empty(hidden.shape[:-1] + (0,))
        return self._empty

    def _loss_fn(self, logits: torch.Tensor, labels: Optional[torch.Tensor],
                 vocab_size: Optional[int] = None, num_items_in_batch: Any = None,
                 ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                 **kwargs: Any) -> torch.Tensor:
        """The loss function's stand-in: HF's ``ForCausalLMLoss`` arguments, the chunked loss
        over the hidden states the head was given."""
        hidden, empty = self._hidden, self._empty
        transform = transform_of(self.model)
        # the stand-in head's logits, or (a known transform between head and loss, Note [which
        # HF models]) what the forward made of them: still no vocab columns
        ours = logits is empty or (
            empty is not None and bool(transform) and torch.is_tensor(logits)
            and logits.shape == empty.shape)
        if not ours or hidden is None:
            # logits the stand-in head did not make: HF's own loss on them
            from transformers.loss.loss_utils import ForCausalLMLoss

            return ForCausalLMLoss(logits, labels, vocab_size, num_items_in_batch, ignore_index,
                                   shift_labels, **kwargs)
        self._hidden = None
        head = self.model.lm_head
        self._loss = causal_lm_loss(hidden, head.weight, labels,  # type: ignore[arg-type]
                                    num_items_in_batch=num_items_in_batch,
                                    ignore_index=ignore_index, shift_labels=shift_labels,
                                    bias=head.bias, **transform)  # type: ignore[arg-type]
        return self._loss

    def pre(self, model: nn.Module, args: Tuple[Any, ...],
            kwargs: Dict[str, Any]) -> None:
        self._disarm()  # a previous forward that raised
        self._hidden = self._empty = self._loss = None
        if not torch.is_grad_enabled() or kwargs.get("logits_to_keep", 0) not in (0, None):
            return
        if torch.compiler.is_compiling():
            # torch.compile runs the chunked op eagerly anyway (a graph break); as wrap's own
            # hooks do, a compiled forward is left as the model wrote it
            return
        custom = model.__dict__.get("_loss_function")  # HF's loss_function setter
        if custom is not None and getattr(custom, "__name__", "") != "ForCausalLMLoss":
            return  # a loss function set after wrap/enable: the model's own path runs it
        labels = kwargs.get("labels")
        pos = self._labels_pos
        if labels is None and pos is not None and len(args) > pos:
            labels = args[pos]
        if labels is None:
            return  # HF computes no loss without labels: the caller wants the logits
        self._armed = True
        model.lm_head.forward = self._head  # type: ignore[union-attr]
        model.__dict__["_loss_function"] = self._loss_fn

    def post(self, model: nn.Module, args: Any, out: Any) -> Any:
        armed, empty, loss = self._armed, self._empty, self._loss
        self._disarm()
        self._hidden = self._empty = self._loss = None
        if not armed or empty is None or out is None:
            return None  # not armed, or the forward never called the head through the model
        if loss is None:
            # the head ran but no loss was asked for (no labels): the logits the caller gets
            # are HF's own -- a head of zero columns is not an answer (Note [the loss region
            # yields])
            raise RuntimeError(
                "spillover's loss region took the lm_head of a call that computed no loss "
                "(grad enabled, no labels reached the model's loss function); pass "
                "chunked_loss=False to spillover.wrap / hf.enable to keep the logits")
        self.calls += 1
        if isinstance(out, tuple):
            return tuple(x for x in out if x is not empty)
        # a new output, so that its fields keep their order (loss first) in to_tuple()
        return dataclasses.replace(out, logits=None)


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
        return (f"head + loss {_through(backend())} (the model's {FLAG} switch; rows per "
                "chunk from its vocabulary, Note [loss chunks]; chunked_loss=False for logits)")


def _through(path: str) -> str:
    """How :meth:`describe` names a path (Note [which chunked loss] in chunked.py)."""
    if path == TORCH:
        return "through torch's chunked linear_cross_entropy"
    why = "" if available() else f", as torch {torch.__version__} has no linear_cross_entropy"
    return f"through spillover's chunked linear + cross-entropy ({OWN}{why})"


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
    "spillover"). On a torch without ``linear_cross_entropy`` spillover's own chunks run
    (Note [which chunked loss]).
    """
    if not chunked_loss:
        return None, "off (chunked_loss=False): the model's own head and loss"
    if isinstance(getattr(model, FLAG, None), bool):
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
    region = LossRegion(model)
    region.install()
    return region, region.describe()


def target(model: nn.Module) -> nn.Module:
    """The module the loss region attaches to for ``model``: the model itself, or the
    transformers causal LM inside a wrapper (PEFT's ``PeftModelForCausalLM``, whose forward
    calls it), so that ``wrap``/``hf.enable`` before or after ``get_peft_model`` agree."""
    if isinstance(getattr(model, FLAG, None), bool):
        return model
    names = _causal_lm_names()
    if type(model).__name__ in names:
        return model
    for m in model.modules():
        if type(m).__name__ in names:
            return m
    return model


def detach(region: Optional[LossRegion]) -> None:
    if region is not None:
        region.remove()


def describe(model: nn.Module) -> Optional[str]:
    """The loss-region line of a model under ``wrap`` / ``hf.enable``, or None."""
    state = model.__dict__.get("_spillover_state")
    return getattr(state, "loss_line", None)
