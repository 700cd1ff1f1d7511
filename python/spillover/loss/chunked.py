"""The chunked loss itself (what it is for and who turns it on: the package docstring,
:mod:`spillover.loss`): :func:`chunked_cross_entropy` and :func:`causal_lm_loss`, the rows per
chunk, and the transient each call reports to a wrapped model's step.

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
import warnings
from typing import Any, Iterator, Optional, Tuple, Union

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["available", "chunk_rows", "options_for", "chunked_cross_entropy",
           "causal_lm_loss", "begin_scope", "end_scope", "limit_chunk", "warn_missing"]

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


def warn_missing() -> None:
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
        warn_missing()
        return F.cross_entropy(F.linear(h, weight).float(), y, ignore_index=ignore_index,
                               reduction=reduction)
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
