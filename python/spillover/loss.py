"""The loss region without logits: a causal LM's head and loss through torch's chunked
``linear_cross_entropy``, so no tokens × vocab logits tensor (nor its gradient, nor the
log-softmax cross-entropy saves) exists during training.

``spillover.wrap(model)`` and ``spillover.integrations.hf.enable(model)`` turn it on for
HuggingFace causal LMs (``chunked_loss=False`` turns it off); a custom model calls
:func:`causal_lm_loss` (HF's label shift) or :func:`chunked_cross_entropy` (targets already
aligned) in place of ``F.cross_entropy(head(h), ...)``.

Note [loss chunks]
    torch's default chunking (``LinearCrossEntropyOptions()``, "aspect_ratio") is slow on CPU:
    on 2,046 tokens × d 256 → vocab 32,768, forward + backward took 2.1–5.3 s (6.5–11.3 s on a
    busy 2-core machine) against 0.73 s with 512–1024 rows per chunk and 1.0–2.3 s unchunked.
    Fewer than ~256 rows per chunk makes each GEMM thin (128 rows: ~1.3x the time of 512).
    The rule: rows per chunk = the largest power of two whose fp32 logits chunk
    (rows × vocab × 4 bytes) fits in 64 MiB, clamped to [256, 1024]. Vocab 8,192 → 1,024 rows
    (32 MiB); 32,768 → 512 (64 MiB); 128,256 → 256 (125 MiB: the floor wins over the cap,
    keeping the GEMM wide). A chunk is thus at most 1/8 of a 2 × 4k-token step's logits at
    vocab 32k, and the region's peak is the chunk plus the weight gradient (vocab × d).
    That is the chunk whenever it fits. Only a budget it does not fit shrinks it (Note [loss
    chunk under a budget]).

Note [loss chunk under a budget]
    The chunk fixes the order in which the weight gradient sums, so a chunk that changed with
    the budget would give ``wrap(policy="auto")`` gradients that differ in the last bits from
    ``policy="full"``'s on the same model (seen: 4e-9 on the tiny GPT). So the speed rule's
    chunk is kept whenever the plan fits with it, and an ``"auto"`` plan shrinks it only when
    it does not: the planner then plans with the smallest chunk (``_FLOOR_ROWS`` rows, the
    transient a learning step reports beside the speed rule's) and gives what that plan leaves
    of the budget back to the chunk, up to the speed rule's (``Plan.loss_cap``). The rows are
    then the largest power of two whose chunk and hidden gradient fit that cap, at least
    ``_FLOOR_ROWS``: a thin GEMM is slower (128 rows: ~1.3x the time of 512), a step over the
    budget on a GPU is an out-of-memory error. :func:`limit_chunk` applies the same cap by
    hand (a reference run with the chunk a plan chose, a custom loss under a tight device).

Note [loss transient]
    What the loss region adds at its peak (the start of backward), measured on CPU
    (4,096 tokens, d 512, vocab 8,192, fp32, peak over forward + backward): 384 MiB unchunked
    (logits, log-softmax and their gradient: three tokens × vocab tensors); chunked, 32 MiB at
    256 rows and 58 MiB at 1,024 = the weight gradient (16) + the hidden states' gradient (8) +
    about one logits chunk. The planner counts the last two (the weight gradient is a
    parameter's, in the measured offset): ``rows × vocab × 4 + tokens × d × itemsize``. Each
    chunked call inside a wrapped model's forward reports it (:func:`begin_scope`), and an
    ``"auto"`` plan counts it on top of what the step holds when its backward starts.

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

import contextlib
import dataclasses
import inspect
import logging
import re
import threading
import warnings
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["available", "chunk_rows", "options_for", "chunked_cross_entropy",
           "causal_lm_loss", "LossRegion", "FlagRegion", "attach", "detach", "describe",
           "begin_scope", "end_scope", "limit_chunk", "FLAG"]

_log = logging.getLogger("spillover")

_CHUNK_BYTES = 64 << 20  # Note [loss chunks]
_MIN_ROWS, _MAX_ROWS = 256, 1024
_FLOOR_ROWS = 64  # Note [loss chunk under a budget]

#: The attribute a model of its own may expose to be switched by wrap (``FlagRegion``): a bool
#: its forward reads to compute the loss through :func:`chunked_cross_entropy`.
FLAG = "spillover_chunked_loss"


class _Scope(threading.local):
    """Note [loss transient]: the largest transient a chunked call reported while a wrapped
    model's forward runs (per thread): with the speed rule's chunk, and with the smallest one
    a budget may shrink it to; and the cap on it (Note [loss chunk under a budget])."""

    def __init__(self) -> None:
        self.transient = 0
        self.transient_min = 0
        self.cap: Optional[int] = None


_scope = _Scope()


def begin_scope(cap: Optional[int] = None) -> Tuple[int, int, Optional[int]]:
    """A wrapped model's forward starts: chunked calls until :func:`end_scope` report their
    transient, and keep it within ``cap`` bytes when given (Note [loss chunk under a budget]).
    Returns what :func:`end_scope` restores (scopes nest)."""
    prev = (_scope.transient, _scope.transient_min, _scope.cap)
    _scope.transient = _scope.transient_min = 0
    _scope.cap = _tighter(prev[2], cap)
    return prev


def end_scope(prev: Tuple[int, int, Optional[int]]) -> Tuple[int, int]:
    """Close the scope :func:`begin_scope` opened; returns the largest transient reported with
    the speed rule's chunk and with the smallest chunk."""
    out = (_scope.transient, _scope.transient_min)
    _scope.transient, _scope.transient_min, _scope.cap = prev
    return out


def _tighter(a: Optional[int], b: Optional[int]) -> Optional[int]:
    return b if a is None else a if b is None else min(a, b)


@contextlib.contextmanager
def limit_chunk(cap_bytes: Optional[int]) -> Iterator[None]:
    """Keep what each chunked loss call adds at its peak (one fp32 logits chunk and the hidden
    states' gradient) within ``cap_bytes``, by fewer rows per chunk (at least 64): what an
    ``"auto"`` plan does when the speed rule's chunk does not fit its budget (Note [loss chunk
    under a budget]; ``Plan.loss_cap`` says which cap it chose). ``None`` changes nothing."""
    prev = _scope.cap
    _scope.cap = _tighter(prev, cap_bytes)
    try:
        yield
    finally:
        _scope.cap = prev


def available() -> bool:
    """Whether this torch has the chunked ``linear_cross_entropy`` (torch 2.13+)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")


def chunk_rows(vocab: int, cap_bytes: Optional[int] = None, hidden_bytes: int = 0) -> int:
    """Rows (tokens) per chunk for a head of ``vocab`` classes (Note [loss chunks]); with
    ``cap_bytes``, fewer where one fp32 chunk + ``hidden_bytes`` (the hidden states' gradient)
    would pass it, down to 64 (Note [loss chunk under a budget])."""
    fit = max(1, _CHUNK_BYTES // (4 * max(1, int(vocab))))
    rows = max(_MIN_ROWS, min(_MAX_ROWS, 1 << (fit.bit_length() - 1)))
    if cap_bytes is not None:
        while rows > _FLOOR_ROWS and rows * vocab * 4 + hidden_bytes > cap_bytes:
            rows //= 2
    return rows


def options_for(vocab: int, rows: Optional[int] = None) -> Any:
    """torch's ``LinearCrossEntropyOptions`` with ``rows`` per chunk (default
    :func:`chunk_rows`)."""
    return nn.LinearCrossEntropyOptions(batch_chunk_size=rows or chunk_rows(vocab),
                                        chunking_method=None)


_warned_missing = False


def _warn_missing() -> None:
    global _warned_missing
    if not _warned_missing:
        _warned_missing = True
        warnings.warn(
            f"spillover: torch {torch.__version__} has no torch.nn.functional."
            "linear_cross_entropy (torch 2.13+); the head and loss run unchunked, with the "
            "tokens x vocab logits in memory. Upgrade torch for the chunked loss region, or "
            "pass chunked_loss=False to silence this.", stacklevel=3)


class _OneBackward(torch.autograd.Function):
    """Identity on the chunked loss whose backward runs once: torch's chunked op supports one
    backward per forward, and says so without naming the switch that turns it off. A second
    backward (``retain_graph=True``, then backward again) raises here first, naming it."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        ctx.done = False
        return loss.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if ctx.done:
            raise RuntimeError(
                "spillover: the loss region (torch's chunked linear_cross_entropy, no logits "
                "in memory) runs one backward per forward; retain_graph=True and a second "
                "backward need the plain loss: spillover.wrap(model, chunked_loss=False) or "
                "spillover.integrations.hf.enable(model, chunked_loss=False)")
        ctx.done = True
        return grad


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                          ignore_index: int = -100, reduction: str = "mean") -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight).float(), targets)`` without the logits.

    ``hidden`` is ``(..., d)``, ``targets`` the matching ``(...)`` class indices. On a torch
    without ``linear_cross_entropy`` this is the plain computation (with one warning).
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(h.device)
    if not available():
        _warn_missing()
        return F.cross_entropy(F.linear(h, weight).float(), y, ignore_index=ignore_index,
                               reduction=reduction)
    vocab, tokens = weight.shape[0], h.shape[0]
    hidden_bytes = h.numel() * h.element_size()
    # Note [loss transient]: one fp32 logits chunk and the hidden states' gradient, with the
    # speed rule's chunk and with the smallest a budget may ask for
    _scope.transient = max(_scope.transient,
                           min(chunk_rows(vocab), tokens) * vocab * 4 + hidden_bytes)
    _scope.transient_min = max(_scope.transient_min,
                               min(_FLOOR_ROWS, tokens) * vocab * 4 + hidden_bytes)
    rows = chunk_rows(vocab)
    if _scope.cap is not None and min(rows, tokens) * vocab * 4 + hidden_bytes > _scope.cap:
        rows = chunk_rows(vocab, _scope.cap, hidden_bytes)  # Note [loss chunk under a budget]
    loss = F.linear_cross_entropy(h, weight, y, ignore_index=ignore_index, reduction=reduction,
                                  options=options_for(vocab, rows))
    return _OneBackward.apply(loss) if loss.requires_grad else loss


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: Optional[torch.Tensor],
                   *, num_items_in_batch: Optional[Union[torch.Tensor, int]] = None,
                   ignore_index: int = -100,
                   shift_labels: Optional[torch.Tensor] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``hidden @ weight.T`` without the logits.

    As HF: labels shift left by one (the last position gets ``ignore_index``) unless
    ``shift_labels`` is given; the mean over the positions not ignored, or, when
    ``num_items_in_batch`` is given (gradient accumulation), the sum divided by it.
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: pass labels= or shift_labels=")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = chunked_cross_entropy(hidden, weight, shift_labels, ignore_index=ignore_index,
                                 reduction=reduction)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


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
            _warn_missing()  # the model's chunked_cross_entropy calls run unchunked
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
        _warn_missing()
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
