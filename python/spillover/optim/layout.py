"""The layouts and records ``OffloadAdamW``'s parts share, defined once: the records handed to
the Rust kernel (their layout is the crate's, read from ``spillover._native``), the unit and
bucket sizes, the counters of ``stats()``, and the small tensor helpers every part uses."""

from __future__ import annotations

from typing import Any, List, Tuple

import numpy as np
import torch

from .. import _native

# The records the Rust kernel reads, laid out once, in rust/py/optim.rs (STEP_FIELDS,
# BUFFER_FIELDS, STEP_FLAGS): one per unit and step, one per unit for export/import.
STEP_RECORD = np.dtype([(name, "<" + kind) for name, kind in _native.STEP_RECORD_FIELDS])
BUFFER_RECORD = np.dtype([(name, "<" + kind) for name, kind in _native.BUFFER_RECORD_FIELDS])
_FLAGS = dict(_native.STEP_FLAGS)
_GRAD_BF16, _SRC_BF16, _OUT_BF16 = _FLAGS["grad_bf16"], _FLAGS["src_bf16"], _FLAGS["out_bf16"]
_PREDICT = _FLAGS["predict"]  # Note [weight prediction] in rust/optim/predict.rs

_DTYPES = (torch.float32, torch.bfloat16)
# torch's fused CPU AdamW updates the last `numel % 8` elements of each tensor in a scalar
# loop that rounds differently (AVX2 and AVX-512 builds alike; measured): Note [torch rounding].
_TORCH_TAIL = 8
_ALIGN = 16  # elements; units and flat-buffer offsets start on these (rust/optim/layout.rs)
_HOST_CHUNK_BYTES = 64 << 20
_NVME_CHUNK_BYTES = 8 << 20
_BUCKET_ELEMS = 8 << 20  # staged path: parameters go back per bucket of this many elements
_UNIT_MAX = 16 << 20  # staged path: larger parameters are split into units of this many
# OffloadAdamW.stats(): the counters of AdamState.stats(), and those that add up over time.
_STATS = (
    "steps",
    "bytes_read",
    "bytes_written",
    "io_wait_seconds",
    "compute_seconds",
    "last_step_seconds",
    "state_bytes",
    "heap_chunks",
)
_CUMULATIVE = ("bytes_read", "bytes_written", "io_wait_seconds", "compute_seconds")
# Note [speculative update]: steps that kept an update made during backward, that undid and
# redid one, that GradScaler skipped.
_ROUND_STATS = ("steps_in_backward", "steps_redone", "steps_skipped")
_HYPER = np.dtype(
    [(n, "<f8") for n in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")]
)
# The staged path's gradient counters (Python-side, per space): device-to-host gradient copies
# (one per unit), their bytes, and those made because a staged copy's fingerprint no longer
# matched the gradient (Note [staged gradients]); the next-gradient prediction's coefficients
# copied back (Note [next-gradient prediction] in rust/optim/predict.rs).
_GRAD_STATS = ("grad_copies", "grad_bytes_copied", "grad_stale_copies", "coef_bytes_copied")

def _bf16_flag(dtype: torch.dtype, bit: int) -> int:
    return bit if dtype == torch.bfloat16 else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)



def _buckets(units: List[int], layout: List[Tuple[int, int, int, int]], elems: int):
    bucket: List[int] = []
    size = 0
    for ui in units:
        bucket.append(ui)
        size += layout[ui][2]
        if size >= elems:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _DTYPES:
        raise TypeError(f"OffloadAdamW supports float32 and bfloat16 parameters, got {dtype}")


def shard_layout(
    numels: List[int], world: int, align: int = _ALIGN
) -> Tuple[List[int], int, int]:
    """Note [sharding] in sharded.py: each parameter's offset in the flat buffer of its
    (dtype, device) (each padded to `align` elements: ``_ALIGN``, or a block of 8-bit state,
    Note [block alignment] in rust/optim/layout.rs), the buffer's size (a multiple of
    ``align * world``) and the size of one rank's shard of it."""
    offsets, at = [], 0
    for n in numels:
        offsets.append(at)
        at += _round_up(n, align)
    total = _round_up(max(at, 1), align * world)
    return offsets, total, total // world


def owned_range(offset: int, n: int, shard: int, rank: int) -> Tuple[int, int]:
    """The elements [a, b) of a parameter at `offset` in the flat buffer (`n` elements) that
    rank `rank` owns, as offsets in the flat buffer; empty (a >= b) when it owns none."""
    lo, hi = rank * shard, (rank + 1) * shard
    return max(offset, lo), min(offset + n, hi)
