"""spillover's own chunked linear + cross-entropy: the loss region on a torch without
``torch.nn.functional.linear_cross_entropy`` (below 2.13), and for heads that do more than a
linear layer before the loss (final logit soft-capping, a logit scale), which torch's op does
not take.

Note [chunks in forward]
    :class:`LinearCrossEntropy` walks the rows (tokens) in chunks of ``rows`` (the chunk rule
    and cap of Notes [loss chunks] and [loss chunk under a budget] in chunked.py). Per chunk
    it computes the logits ``h_c @ W.T (+ b)`` in the input's dtype, as the plain loss does,
    then in fp32: the optional logit transform, the log-sum-exp, the loss of the chunk and the
    gradient of its logits (softmax minus the one-hot target, times 1/n for ``"mean"``, zero
    on ignored rows), and from it the chunk's rows of the hidden states' gradient and its
    share of the head weight's (and bias') gradient, summed over chunks in fp32. So no tokens
    x vocab tensor ever exists; at most one fp32 chunk of logits (two with soft-capping: the
    tanh is kept for its derivative) and the chunk's gradient cast to the input's dtype. What
    the call holds from its forward to its backward is the hidden states' gradient (tokens x d,
    input dtype) and the weight's (vocab x d, weight dtype; fp32 while it sums): what torch's
    chunked op holds too (Note [loss transient]). The backward hands them over, scaled in
    place by the loss's incoming gradient, once: a second backward raises, as torch's op.

    They are kept as attributes of the autograd context, not saved tensors, so the offload
    context's hooks never pack them: they are needed first thing in backward, and are the
    step's gradients, not activations (torch's op does the same).

    The number of targets not ignored stays a tensor (no ``.item()``): no host sync on a GPU,
    and the estimate's fake-tensor trace (spillover.estimate) runs it like any other op chain.

Note [logit transforms]
    HF heads that change the logits before the loss, each chunked exactly: Gemma 2/3's final
    soft-capping ``z = c * tanh(l / c)`` (derivative ``1 - tanh^2``) and a logit scale
    ``z = s * l`` (Cohere's ``logit_scale``; Granite divides by ``logits_scaling``, i.e.
    ``s = 1 / logits_scaling``). The transform runs on the fp32 logits, where the model runs
    it in its own dtype before HF's loss upcasts: the same in fp32 and slightly more exact in
    bf16. torch's op has neither, so these heads take this path on every torch.

Note [autocast in the chunks]
    Under ``torch.autocast`` the plain head runs its GEMM in the autocast dtype (bf16 logits
    from fp32 weights) and the loss upcasts. The chunks do the same by hand: the hidden states,
    weight and bias are cast to the autocast dtype once, the chunk loop runs with autocast off
    (its ``out=`` GEMMs and fp32 sums are not autocast's to recast), and the gradients are
    handed back in the dtypes of the tensors given (fp32 for fp32 parameters).
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple

import torch
from torch.nn import functional as F

__all__ = ["LinearCrossEntropy", "linear_cross_entropy"]

_TWICE = ("spillover: the loss region (chunked linear + cross-entropy, no logits in memory) "
          "runs one backward per forward; retain_graph=True and a second backward need the "
          "plain loss: spillover.wrap(model, chunked_loss=False) or "
          "spillover.integrations.hf.enable(model, chunked_loss=False)")


class LinearCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(transform(F.linear(h, w, b)).float(), y)`` by row chunks, gradients
    computed in forward (Note [chunks in forward]). Inputs: ``h`` (N, d), ``w`` (V, d), ``b``
    (V,) or None, ``y`` (N,); returns the fp32 loss (a scalar)."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                y: torch.Tensor, ignore_index: int, reduction: str, rows: int,
                softcap: Optional[float], scale: Optional[float]) -> torch.Tensor:
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = b is not None and ctx.needs_input_grad[2]
        cd = _autocast_dtype(h)  # Note [autocast in the chunks]
        off = contextlib.nullcontext() if cd is None else torch.autocast(h.device.type,
                                                                          enabled=False)
        cd = cd or h.dtype
        with off:
            hx, wx = h.to(cd), w.to(cd)
            bx = None if b is None else b.to(cd)
            total, count, gh, gw, gb = _chunks(hx, wx, bx, y, ignore_index, reduction, rows,
                                               softcap, scale, need_h, need_w, need_b)
        ctx.grads = (None if gh is None else gh.to(h.dtype),
                     None if gw is None else gw.to(w.dtype),
                     None if gb is None else gb.to(b.dtype))  # type: ignore[union-attr]
        return total / count if count is not None else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(_TWICE)
        ctx.grads = None
        gh, gw, gb = (None if t is None else t.mul_(grad) for t in grads)
        return gh, gw, gb, None, None, None, None, None, None


def _autocast_dtype(h: torch.Tensor) -> Optional[torch.dtype]:
    """Note [autocast in the chunks]: the dtype autocast runs the head's GEMMs in on ``h``'s
    device, or None where autocast is off (or has no such device: meta)."""
    kind = h.device.type
    try:
        if torch.is_autocast_enabled(kind) and h.is_floating_point():
            return torch.get_autocast_dtype(kind)
    except (TypeError, RuntimeError, AttributeError):  # no autocast for this device
        pass
    return None


def _chunks(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], y: torch.Tensor,
            ignore_index: int, reduction: str, rows: int, softcap: Optional[float],
            scale: Optional[float], need_h: bool, need_w: bool, need_b: bool
            ) -> Tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor],
                       Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Note [chunks in forward]: the summed loss, the count of targets not ignored ("mean";
    else None) and the gradients of h (h's dtype), w and b (fp32 sums) for an incoming 1."""
    tokens, vocab = h.shape[0], w.shape[0]
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y)).unsqueeze(1)
    if reduction == "mean":
        count: Optional[torch.Tensor] = valid.sum().to(torch.float32)
        # the 1/n of "mean"; with every target ignored the loss is nan and the gradients 0, as
        # F.cross_entropy's
        coef = valid.to(torch.float32) / count.clamp(min=1.0)
    else:
        count = None
        coef = valid.to(torch.float32)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    gh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None
    gb = torch.zeros(vocab, dtype=torch.float32, device=w.device) if need_b else None
    grads = need_h or need_w or need_b
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        hc = h[start:end]
        z = F.linear(hc, w, b).float()  # in the input's dtype first, as the plain loss
        tanh = None
        if scale is not None:  # Note [logit transforms]
            z.mul_(scale)
        if softcap is not None:
            tanh = z.div_(softcap).tanh_()
            z = tanh * softcap
        target = z.gather(1, safe[start:end])
        top = z.amax(dim=1, keepdim=True)
        z.sub_(top).exp_()  # one fp32 chunk, in place
        sums = z.sum(dim=1, keepdim=True)
        loss = torch.where(valid[start:end], (top + sums.log() - target).squeeze(1), 0.0)
        total += loss.sum()
        if not grads:
            continue
        # the logits' gradient: (softmax - onehot(y)) x 1/n, 0 where ignored (one pass)
        c = coef[start:end].unsqueeze(1)
        p = z.mul_(c / sums)
        p.scatter_add_(1, safe[start:end], -c)
        if tanh is not None:
            p.mul_(tanh.square_().neg_().add_(1.0))
            del tanh
        if scale is not None:
            p.mul_(scale)
        g = p.to(h.dtype)
        if gh is not None:
            torch.mm(g, w, out=gh[start:end])
        if gw is not None:
            if g.dtype == torch.float32:
                gw.addmm_(g.t(), hc)
            else:  # the GEMM sums in fp32 and rounds its chunk once; chunks sum in fp32
                gw.add_(torch.mm(g.t(), hc))
        if gb is not None:
            gb.add_(p.sum(dim=0))
        del p, g, z, c
    return total, count, gh, gw, gb


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                         bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", rows: int = 512,
                         softcap: Optional[float] = None,
                         scale: Optional[float] = None) -> torch.Tensor:
    """The loss of :class:`LinearCrossEntropy`: ``hidden`` (N, d), ``weight`` (V, d),
    ``targets`` (N,) class indices, ``bias`` (V,) or None; ``reduction`` "mean" (over the
    targets not ignored) or "sum"; ``softcap`` and ``scale`` as Note [logit transforms]."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"spillover.loss: reduction {reduction!r}: 'mean' or 'sum'")
    if hidden.dim() != 2 or targets.dim() != 1 or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"spillover.loss: hidden {tuple(hidden.shape)} and targets "
                         f"{tuple(targets.shape)}: expected (N, d) and (N,)")
    if not softcap:
        softcap = None
    if scale is not None and float(scale) == 1.0:
        scale = None
    return LinearCrossEntropy.apply(hidden, weight, bias, targets, int(ignore_index),
                                    reduction, max(1, int(rows)),
                                    None if softcap is None else float(softcap),
                                    None if scale is None else float(scale))
