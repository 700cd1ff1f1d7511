"""The chunked loss itself (what it is for and who turns it on: the package docstring,
:mod:`spillover.loss`): :func:`chunked_cross_entropy` and :func:`causal_lm_loss`, the rows per
chunk, and the transient each call reports to a wrapped model's step.

Note [which chunked loss]
    Two implementations of the same chunked loss: torch's ``linear_cross_entropy`` (torch
    2.13+) where it exists and the head is a plain linear layer (with or without bias), and
    spillover's own (:mod:`.fused`, Note [chunks in forward]) on an older torch and for heads
    that transform the logits (Note [logit transforms]), which torch's op does not take. Both
    take the same rows per chunk and report the same transient; where both can run they agree
    within fp32 rounding (tests/python/test_loss_fused.py). :func:`backend` says which one a
    call takes; :func:`paths_run` counts the calls each made in this process (what the GPU
    scripts print). The plain loss, logits in memory, runs only where the region is off.

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
"""


from __future__ import annotations

import contextlib
import threading
from typing import Any, Dict, Iterator, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

from . import fused

__all__ = ["available", "backend", "chunk_rows", "options_for", "chunked_cross_entropy",
           "causal_lm_loss", "begin_scope", "end_scope", "limit_chunk", "paths_run",
           "path_line", "TORCH", "OWN"]

#: The names :func:`backend` and :func:`paths_run` give the two paths (Note [which chunked loss])
TORCH = "torch's linear_cross_entropy"
OWN = "spillover's chunks"

_CHUNK_BYTES = 64 << 20  # Note [loss chunks]
_MIN_ROWS, _MAX_ROWS = 256, 1024
_FLOOR_ROWS = 64  # Note [loss chunk under a budget]

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


def backend(softcap: Optional[float] = None, scale: Optional[float] = None) -> str:
    """The chunked loss a call takes on this torch (Note [which chunked loss]): :data:`TORCH`
    or :data:`OWN`."""
    plain_head = not softcap and (scale is None or float(scale) == 1.0)
    return TORCH if plain_head and available() else OWN


_ran: Dict[str, int] = {TORCH: 0, OWN: 0}


def paths_run() -> Dict[str, int]:
    """Calls of the chunked loss made in this process, per path (:data:`TORCH`, :data:`OWN`)."""
    return dict(_ran)


def path_line() -> str:
    """One line for a log: which loss path ran in this process (torch's op, spillover's chunks,
    or neither: the plain loss, logits in memory) and the torch and transformers versions."""
    ran = [f"{name} ({n} calls)" for name, n in _ran.items() if n]
    try:
        import transformers

        tf = transformers.__version__
    except ImportError:
        tf = "not installed"
    what = " and ".join(ran) if ran else "plain (no chunked loss ran: logits in memory)"
    return (f"loss path: {what}; this torch's chunked loss: {backend()}; "
            f"torch {torch.__version__}, transformers {tf}")


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
                          bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                          reduction: str = "mean", softcap: Optional[float] = None,
                          scale: Optional[float] = None) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias).float(), targets)`` without the logits.

    ``hidden`` is ``(..., d)``, ``targets`` the matching ``(...)`` class indices; ``reduction``
    "mean" or "sum". ``softcap`` (``z = c * tanh(l / c)``) and ``scale`` (``z = s * l``) are
    applied to the logits before the loss (Note [logit transforms]). torch's chunked op runs
    where it can, spillover's own chunks elsewhere (Note [which chunked loss]).
    """
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1).to(h.device)
    vocab, tokens = weight.shape[0], h.shape[0]
    hidden_bytes = h.numel() * h.element_size()
    rows = chunk_rows(vocab)
    # Note [loss transient]: one fp32 logits chunk and the hidden states' gradient, with the
    # speed rule's chunk and with the smallest a budget may ask for
    speed = min(rows, tokens) * vocab * 4 + hidden_bytes
    _scope.transient = max(_scope.transient, speed)
    _scope.transient_min = max(_scope.transient_min,
                               min(_FLOOR_ROWS, tokens) * vocab * 4 + hidden_bytes)
    if _scope.cap is not None and speed > _scope.cap:
        rows = chunk_rows(vocab, _scope.cap, hidden_bytes)  # Note [loss chunk under a budget]
    path = backend(softcap, scale)
    _ran[path] += 1
    if path == OWN:
        return fused.linear_cross_entropy(h, weight, y, bias=bias, ignore_index=ignore_index,
                                          reduction=reduction, rows=rows, softcap=softcap,
                                          scale=scale)
    extra = {} if bias is None else {"linear_bias": bias}
    loss = F.linear_cross_entropy(h, weight, y, ignore_index=ignore_index, reduction=reduction,
                                  options=options_for(vocab, rows), **extra)
    return _OneBackward.apply(loss) if loss.requires_grad else loss


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: Optional[torch.Tensor],
                   *, num_items_in_batch: Optional[Union[torch.Tensor, int]] = None,
                   ignore_index: int = -100, shift_labels: Optional[torch.Tensor] = None,
                   bias: Optional[torch.Tensor] = None, softcap: Optional[float] = None,
                   scale: Optional[float] = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` on ``hidden @ weight.T`` without the logits.

    As HF: labels shift left by one (the last position gets ``ignore_index``) unless
    ``shift_labels`` is given; the mean over the positions not ignored, or, when
    ``num_items_in_batch`` is given (gradient accumulation), the sum divided by it. ``bias``,
    ``softcap`` and ``scale``: the head's bias and logit transform (Note [logit transforms]).
    """
    if shift_labels is None:
        if labels is None:
            raise ValueError("causal_lm_loss: pass labels= or shift_labels=")
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = chunked_cross_entropy(hidden, weight, shift_labels, bias=bias,
                                 ignore_index=ignore_index, reduction=reduction,
                                 softcap=softcap, scale=scale)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss
