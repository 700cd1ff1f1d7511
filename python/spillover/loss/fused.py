"""spillover's own chunked linear + cross-entropy: the loss region on a torch without
``torch.nn.functional.linear_cross_entropy`` (below 2.13), and for heads that do more than a
linear layer before the loss (final logit soft-capping, a logit scale), which torch's op does
not take.

Note [chunks in forward]
    :class:`LinearCrossEntropy` walks the rows (tokens) in chunks of ``rows`` (the chunk rule
    and cap of Notes [loss chunks] and [loss chunk under a budget] in chunked.py). Per chunk
    it computes the logits ``h_c @ W.T (+ b)`` in the input's dtype, as the plain loss does,
    then in fp32: the optional logit transform, the log-softmax, the loss of the chunk and the
    gradient of its logits (softmax minus the one-hot target, times 1/n for ``"mean"``, zero
    on ignored rows: Note [row weights]), and from it the chunk's rows of the hidden states'
    gradient and its share of the head weight's (and bias') gradient, summed over chunks in
    fp32 (Note [the chunk's passes]). So no tokens x vocab tensor ever exists; at most one fp32
    chunk of logits (two with soft-capping: the tanh is kept for its derivative) and, for
    bf16/fp16 inputs, the chunk in their dtype (Note [chunk buffers]). What the call holds
    from its forward to its backward is the hidden states' gradient (tokens x d, input dtype)
    and the weight's (vocab x d, weight dtype; fp32 while it sums): what torch's chunked op
    holds too (Note [loss transient]). The backward hands them over, scaled in place by the
    loss's incoming gradient, once: a second backward raises, as torch's op.

    They are kept as attributes of the autograd context, not saved tensors, so the offload
    context's hooks never pack them: they are needed first thing in backward, and are the
    step's gradients, not activations (torch's op does the same).

    The number of targets not ignored stays a tensor (no ``.item()``): no host sync on a GPU,
    and the estimate's fake-tensor trace (spillover.estimate) runs it like any other op chain.

Note [the chunk's passes]
    Beyond its three GEMMs (the logits, the hidden rows' gradient, the weight's share), a
    chunk costs its passes over rows x vocab, and the three GEMMs are all the work the loss
    needs. Measured on CPU (a 512 x 32768 fp32 chunk, 2 cores, busy): ~75-80 ms per GEMM,
    ~10 ms per elementwise pass, ~30 ms of page faults for a fresh 64 MiB chunk. So a chunk
    makes as few passes as the math allows:

    - the log-softmax in place, ``torch.log_softmax(z, 1, out=z)``: one kernel with the row in
      cache (max, sum of exp, subtraction; ~15 ms) where amax, sub, exp and sum made four
      passes (~40 ms). The loss is the target's ``-log p``, gathered, as F.cross_entropy's.
      ``exp_`` in place then gives the softmax and a scatter of -1 at the targets the logits'
      gradient before its row weights.
    - no pass for the row weights (Note [row weights]; one with a bias), nor for zeroing the
      weight gradient (the first chunk's GEMM writes it, ``beta=0``), nor a chunk made per
      chunk (Note [chunk buffers]).

    The loss alone (forward + backward, 2,048 tokens, d 256, vocab 32768, fp32, 512 rows;
    medians of 7, interleaved): on a quiet 2-core machine 0.54 s, torch's op at the same rows
    0.56 s, before (amax, sub, exp and sum as passes, the weights and the ignored rows' mask
    multiplied over the chunk, a chunk made per chunk) 0.64 s; on a busy one 1.18 s, 1.37 s,
    1.34 s. Of the quiet 0.54 s the three GEMMs are most: what is left is the log-softmax and
    exp passes and a chunk's page faults once per call.

Note [row weights]
    Row r of the logits' gradient is ``w_r (softmax - onehot)``, ``w_r`` = 1/n (``"mean"``) or
    1 (``"sum"``), 0 where the target is ignored, times a logit scale (Note [logit
    transforms]). In fp32 the GEMMs take the unweighted chunk and the weights ride on their
    small operands: the weight's gradient multiplies the weighted hidden rows (rows x d), and
    the hidden states' gradient rows are scaled in the backward's pass that multiplies them by
    the incoming gradient (one pass for both). The same sums up to their rounding order. With
    bf16/fp16 inputs the gradient is cast to that dtype for its GEMMs anyway, and the weights
    ride on the cast (``torch.mul(p, w, out=)`` into the chunk in that dtype): the weighted
    gradient rounded once, as the plain backward's. With a bias the weights go on the chunk
    (one pass) and the bias's gradient is its column sum, as the plain loss's: the GEMV
    ``p^T w`` on the unweighted chunk was 1.4e-6 off the fp64 gradient (relative to its
    largest entry; 2,048 tokens, vocab 32768) where the column sum is 3e-7 off.

Note [chunk buffers]
    The fp32 chunk is made once per call and every chunk is written into it (``out=``
    GEMMs); so are the second fp32 chunk of soft-capping, for bf16/fp16 inputs the chunk in
    their dtype (the logits before the upcast, then the weighted gradient) and a vocab x d
    buffer in their dtype for each chunk's share of the weight gradient before its fp32 sum.
    A chunk made per chunk cost on CPU ~30 ms of page faults each time (glibc hands a 64 MiB
    block back to the kernel when freed); the peak is the same, one chunk alive either way.

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
            total, count, gh, gw, gb, rows_w = _chunks(hx, wx, bx, y, ignore_index, reduction,
                                                       rows, softcap, scale, need_h, need_w,
                                                       need_b)
            if gh is not None and rows_w is not None and gh.dtype != h.dtype:
                gh.mul_(rows_w)  # Note [row weights]: before a rounding, not after
                rows_w = None
        ctx.grads = (None if gh is None else gh.to(h.dtype),
                     None if gw is None else gw.to(w.dtype),
                     None if gb is None else gb.to(b.dtype))  # type: ignore[union-attr]
        ctx.rows_w = rows_w
        return total / count if count is not None else total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Tuple[Optional[torch.Tensor], ...]:
        grads = ctx.grads
        if grads is None:
            raise RuntimeError(_TWICE)
        ctx.grads = None
        gh, gw, gb = grads
        if gh is not None:  # Note [row weights]: the hidden rows' weights ride on this pass
            gh.mul_(grad if ctx.rows_w is None else ctx.rows_w * grad)
        gw, gb = (None if t is None else t.mul_(grad) for t in (gw, gb))
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
                       Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Note [chunks in forward]: the summed loss, the count of targets not ignored ("mean";
    else None), the gradients of h (h's dtype), w and b (fp32 sums) for an incoming 1, and
    the row weights h's gradient still needs (fp32 input; else None: applied), Note [row
    weights]."""
    tokens, vocab = h.shape[0], w.shape[0]
    valid = y != ignore_index
    safe = torch.where(valid, y, torch.zeros_like(y)).unsqueeze(1)
    if reduction == "mean":
        count: Optional[torch.Tensor] = valid.sum().to(torch.float32)
        # the 1/n of "mean"; with every target ignored the loss is nan and the gradients 0, as
        # F.cross_entropy's
        weight = valid.to(torch.float32) / count.clamp(min=1.0)
    else:
        count = None
        weight = valid.to(torch.float32)
    if scale is not None:  # Note [logit transforms]: the constant factor of dz/dl
        weight = weight * scale
    weight = weight.unsqueeze(1)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    gh = torch.empty(h.shape, dtype=h.dtype, device=h.device) if need_h else None
    # the first chunk writes gw (beta=0 below) rather than adding to zeros
    gw = ((torch.empty if tokens else torch.zeros)(w.shape, dtype=torch.float32, device=w.device)
          if need_w else None)
    gb = torch.zeros(vocab, dtype=torch.float32, device=w.device) if need_b else None
    grads = need_h or need_w or need_b
    # Note [chunk buffers]: made once per call, each chunk written into them with out=
    n = min(rows, tokens)
    dev = h.device
    cast = h.dtype != torch.float32  # the GEMMs' operand is the gradient cast to h's dtype
    logits = torch.empty((n, vocab), dtype=torch.float32, device=dev)
    low = torch.empty((n, vocab), dtype=h.dtype, device=dev) if cast else None
    capped = torch.empty_like(logits) if softcap is not None else None
    minus = torch.full((n, 1), -1.0, dtype=torch.float32, device=dev) if grads else None
    # a bias's gradient is the chunk's column sum: the weights go on the chunk, one pass
    on_chunk = gb is not None
    # gw's small operand: the weighted hidden rows (fp32) or the chunk's share of gw (cast)
    hw = None if not need_w else torch.empty((n, w.shape[1]) if not cast else w.shape,
                                             dtype=h.dtype, device=dev)
    for start in range(0, tokens, rows):
        end = min(start + rows, tokens)
        hc, m, wc = h[start:end], end - start, weight[start:end]
        # the logits in the input's dtype first, as the plain loss (addmm: F.linear's rounding)
        raw = logits[:m] if low is None else low[:m]
        if b is None:
            torch.mm(hc, w.t(), out=raw)
        else:
            torch.addmm(b, hc, w.t(), out=raw)
        z = raw if low is None else logits[:m].copy_(raw)
        tanh = None
        if scale is not None:  # Note [logit transforms]
            z.mul_(scale)
        if softcap is not None:
            tanh = z.div_(softcap).tanh_()
            z = torch.mul(tanh, softcap, out=capped[:m])  # type: ignore[index]
        # Note [the chunk's passes]: log-softmax in place; the loss is the target's -log p
        torch.log_softmax(z, 1, out=z)
        target = z.gather(1, safe[start:end])
        total.sub_(torch.where(valid[start:end].unsqueeze(1), target, 0.0).sum())
        if not grads:
            continue
        # the logits' gradient before its row weights: softmax - onehot(y), in place
        p = z.exp_()
        p.scatter_add_(1, safe[start:end], minus[:m])  # type: ignore[index]
        if tanh is not None:
            p.addcmul_(p, tanh.square_(), value=-1.0)  # times 1 - tanh^2
            del tanh
        # Note [row weights]: on the GEMMs' small operands, in the cast, or (a bias) on the chunk
        if on_chunk:
            p.mul_(wc)
            gb.add_(p.sum(dim=0))  # type: ignore[union-attr]
        g = (p if low is None else low[:m].copy_(p) if on_chunk else
             torch.mul(p, wc, out=low[:m]))
        if gh is not None:
            torch.mm(g, w, out=gh[start:end])
        if gw is not None:
            if not cast:
                hwc = hc if on_chunk else torch.mul(hc, wc, out=hw[:m])  # type: ignore[index]
                gw.addmm_(g.t(), hwc, beta=1 if start else 0)
            else:  # the GEMM sums in fp32 and rounds its chunk once; chunks sum in fp32
                share = torch.mm(g.t(), hc, out=hw)  # type: ignore[arg-type]
                if start:
                    gw.add_(share)
                else:
                    gw.copy_(share)
        del p, g, z
    return total, count, gh, gw, gb, (None if cast or on_chunk else weight)


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
