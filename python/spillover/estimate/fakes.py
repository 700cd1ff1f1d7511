"""Fake models, inputs and the loss of a step traced on fake tensors (:mod:`.trace` runs it).

Note [fake device]
    The step is always traced on fake *CPU* tensors, whatever the target: torch's autograd
    engine asks the CUDA driver for a context when it runs a backward of CUDA tensors, fake or
    not, and this must run on a machine without a GPU. What differs on a GPU is applied on top:
    the allocator's 512-byte rounding, the device's throughput in the time model, and the GPU
    link's semantics in the simulated offload context (:mod:`.offload`). Fused attention runs
    the CPU flash kernel, which saves what the CUDA flash kernel saves (the output and a
    float32 log-sum-exp per row); an explicit softmax saves its scores on either.

Note [HF masks on fake tensors]
    transformers looks at the values of the position ids to find packed sequences (several
    sequences in one row) and, on fake tensors, cannot: it then assumes packing and builds a
    4-D mask for every attention call instead of running SDPA with ``is_causal=True``, a step
    that eager never runs (measured on a 2-layer Llama: 670 ops against eager's 587, a peak 4 %
    off). Position ids the model makes itself (from ``arange``) are never packed, so while the
    step is traced the check answers "not packed" for them, as eager does; position ids passed
    as an input are checked as transformers checks them (on fake tensors: packed). A padding
    ``attention_mask`` passed as an input is likewise taken to pad (transformers builds the
    mask); leave it out for batches without padding.
"""

from __future__ import annotations

import contextlib
import copy
import sys
from typing import Any, Callable, Dict, Iterator, Optional, Sequence

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

__all__ = ["FAKE_DEVICE", "fake_like", "fake_copy", "fake_inputs", "pick_loss",
           "hf_eager_masks", "storage_keys"]

#: Note [fake device]
FAKE_DEVICE = "cpu"

# ---- fake models and inputs ------------------------------------------------------------------


def fake_like(t: torch.Tensor, mode: FakeTensorMode, dtype: Optional[torch.dtype] = None,
              shape: Optional[Sequence[int]] = None) -> torch.Tensor:
    """A fake tensor shaped like ``t`` (or ``shape``), on the traced device (Note [fake
    device])."""
    with mode:
        if shape is None:
            out = torch.empty_strided(t.shape, t.stride(), dtype=dtype or t.dtype,
                                      device=FAKE_DEVICE)
        else:
            out = torch.empty(tuple(shape), dtype=dtype or t.dtype, device=FAKE_DEVICE)
    return out


def fake_copy(model: nn.Module, mode: FakeTensorMode,
              dtype: Optional[torch.dtype] = None) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are fake tensors on the traced device
    (``dtype``: floating ones cast to it). Shared parameters stay shared (a tied head);
    nothing of ``model`` is changed or copied but its structure and small attributes."""
    memo: Dict[int, Any] = {}
    for p in model.parameters():
        if id(p) not in memo:
            dt = dtype if dtype is not None and p.is_floating_point() else None
            memo[id(p)] = nn.Parameter(fake_like(p, mode, dt), requires_grad=p.requires_grad)
    for b in model.buffers():
        if id(b) not in memo:
            dt = dtype if dtype is not None and b.is_floating_point() else None
            memo[id(b)] = fake_like(b, mode, dt)
    return copy.deepcopy(model, memo)


def fake_inputs(x: Any, mode: FakeTensorMode) -> Any:
    """``x`` (tensors, lists, tuples, dicts of them) with every tensor replaced by a fake one
    of its shape and dtype."""
    if isinstance(x, torch.Tensor):
        out = fake_like(x, mode)
        out.requires_grad_(x.requires_grad)
        return out
    if isinstance(x, (list, tuple)) and not hasattr(x, "_fields"):
        return type(x)(fake_inputs(y, mode) for y in x)
    if isinstance(x, dict):
        return {k: fake_inputs(v, mode) for k, v in x.items()}
    return x


def pick_loss(out: Any, loss_fn: Optional[Callable[[Any], Any]] = None) -> torch.Tensor:
    """The step's loss: ``loss_fn(out)`` when given, else ``out`` when it is a scalar tensor,
    else its ``.loss`` (or ``["loss"]``). ValueError naming what was found otherwise."""
    if loss_fn is not None:
        loss = loss_fn(out)
    elif isinstance(out, torch.Tensor):
        loss = out
    elif getattr(out, "loss", None) is not None:
        loss = out.loss
    elif isinstance(out, dict) and out.get("loss") is not None:
        loss = out["loss"]
    else:
        raise ValueError(
            f"spillover.estimate: the model returned {type(out).__name__}, neither a scalar "
            "tensor nor an output with a .loss: pass loss_fn=lambda out: ... (the step's loss "
            "from the model's output), or labels the model computes its loss from")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"spillover.estimate: the step's loss must be a scalar tensor, got {shape}; pass "
            "loss_fn= to reduce the model's output to one")
    if not loss.requires_grad:
        raise ValueError(
            "spillover.estimate: the loss does not require grad (no parameter requires grad, "
            "or the forward ran under torch.no_grad): there is no backward to estimate")
    return loss


@contextlib.contextmanager
def hf_eager_masks(user_inputs: set) -> Iterator[None]:
    """Note [HF masks on fake tensors]: transformers' packed-sequence check, answered as
    eager answers it for position ids the model made itself."""
    mu = sys.modules.get("transformers.masking_utils")
    find = getattr(mu, "find_packed_sequence_indices", None) if mu is not None else None
    if find is None:
        yield
        return

    def find_packed(position_ids: torch.Tensor) -> Optional[torch.Tensor]:
        try:
            given = position_ids.untyped_storage()._cdata in user_inputs
        except (RuntimeError, NotImplementedError):
            given = True
        return find(position_ids) if given else None

    mu.find_packed_sequence_indices = find_packed
    try:
        yield
    finally:
        mu.find_packed_sequence_indices = find


def storage_keys(tensors: Sequence[torch.Tensor]) -> set:
    keys = set()
    for t in tensors:
        with contextlib.suppress(RuntimeError, NotImplementedError):
            keys.add(t.untyped_storage()._cdata)
    return keys
