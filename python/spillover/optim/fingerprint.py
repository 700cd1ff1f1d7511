"""Gradient fingerprints of the staged path.

Note [gradient fingerprint]
    Eight integers modulo 2**64 over the bytes of a gradient read as int8 values b, in chunks c
    of ``_FP_CHUNK`` bytes (32 MiB), each chunk in rows r of ``_FP_ROW`` bytes (4 KiB):

        P[r, s] = sum_j b[r, j] * A[j, s]          (exact in int32: |P| < 128 * 127 * 4096)
        L_c[s]  = sum_r R[r, s] * P[r, s]          (int64, wrapping modulo 2**64)
        F[s]    = sum_c K_s(c) * L_c[s]            (modulo 2**64, on the host)

    for s = 0..7, with A fixed pseudo-random odd int8 weights (never 0: one changed byte always
    changes every P it enters), R pseudo-random odd 64-bit row weights, and K_s(c) pseudo-random
    odd per-chunk weights (splitmix64 of c). A chunk that is not whole rows, or has 16 rows or
    fewer (torch._int_mm's least on CUDA is 17), is zero-padded to whole rows (zeros change no
    sum; the staged path's snapshot is that padded copy). The row products are one int8 matrix
    product per chunk (``torch._int_mm``: tensor cores on CUDA, exact everywhere), so a chunk
    costs at most five ops -- the padding copy, the product, a widening, a product with R and a
    sum -- and temporaries of 12 bytes per 4 KiB row (not the 16 bytes per word of the two
    int64 products per chunk of 2 MiB it replaced: about 1000 chunks of ~7 ops per GiB of bf16
    gradient, launched from Python on the autograd thread, the review's G2). torch's int64
    products and sums wrap modulo 2**64 (checked against exact integers in
    tests/python/test_optim_staged.py; modular sums do not depend on the reduction order, so
    every device and every run agree). Both fingerprints are taken on the gradient's device by
    the same function. The staged one is of the bytes that were staged: the hook copies each
    chunk to a device snapshot on the copy stream, fingerprints the snapshot and copies it to
    the host. The copy stream runs alongside whatever the compute stream (or a collective) does
    after the hook, and a write landing between two separate reads of the gradient could give
    a fingerprint of the new bytes next to a copy of the old ones, which would pass the check;
    read once, the two agree whatever they saw (a torn mix of old and new then fails the check
    at ``step()``). The current one is taken at ``step()`` after everything queued before it
    (all gradients in one batch, one transfer back).

    What it proves: equal fingerprints mean equal bytes unless the change happens to satisfy
    eight relations modulo 2**64 in the weights. For a change made without knowledge of the
    weights (a collective, a clip, a write: anything but an adversary), far less likely than
    any hardware fault; none against an adversary (it is linear; not a cryptographic hash).
    Pseudo-random weights catch permutations, sign flips of balanced values and swapped
    chunks, which a plain or index-weighted sum can miss.

    Cost: per 32 MiB chunk, the snapshot (a device copy), 5 kernels and one 64-byte copy back;
    ``benches/python/optim_bench.py --parts fingerprint`` prints the ops per bucket and the
    host time per pass (the dispatch, measured on ``meta`` tensors: what a GPU's host pays),
    beside this CPU's time with the arithmetic. A stale copy costs one more copy of that
    gradient at ``step()``, not overlapped with backward.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import numpy as np
import torch

from .layout import _local

# Note [gradient fingerprint]: bytes per chunk and per row, lanes, the weights' seed, and the
# constants seeding each chunk's weight.
_FP_CHUNK = 32 << 20
_FP_ROW = 4096
_FP_LANES = 8
_FP_SEED = 0x5EED_F1A6
_FP_CHUNK_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_FP_CACHE: Dict[Any, Tuple[torch.Tensor, torch.Tensor]] = {}


def _fp_weights(device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Note [gradient fingerprint]: A, the (row bytes, lanes) odd int8 byte weights, and R, the
    (rows per chunk, lanes) odd int64 row weights, on `device` (made once per device and chunk
    shape)."""
    key = (str(device), _FP_CHUNK, _FP_ROW)
    w = _FP_CACHE.get(key)
    if w is None:
        rng = np.random.default_rng(_FP_SEED)
        a = rng.integers(-64, 64, size=(_FP_ROW, _FP_LANES), dtype=np.int8) * 2 + 1
        rows = _fp_rows(_FP_CHUNK)
        r = rng.integers(0, 1 << 64, size=(rows, _FP_LANES), dtype=np.uint64, endpoint=False)
        w = (torch.from_numpy(a.astype(np.int8)).to(device),
             torch.from_numpy((r | np.uint64(1)).view(np.int64)).to(device))
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # used from the side streams too
        _FP_CACHE[key] = w
    return w


@functools.lru_cache(maxsize=1 << 16)
def _fp_chunk_multiplier(s: int, c: int) -> int:
    """The odd pseudo-random weight of chunk c's sum in lane s (splitmix64 of c)."""
    m = (1 << 64) - 1
    z = (c * _FP_CHUNK_K[0] + _FP_CHUNK_K[1] * (s + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) | 1


#: torch ops one chunk costs (:func:`_fp_chunk`, its padding included), for the benchmark's
#: count of ops per bucket.
FP_OPS_PER_CHUNK = 5


def _fp_rows(nbytes: int) -> int:
    """Rows a chunk of ``nbytes`` takes: whole rows, and more than 16 (torch._int_mm's least
    on CUDA), its tail zero-padded."""
    return max(17, -(-nbytes // _FP_ROW))


def _fp_pad(b: torch.Tensor) -> torch.Tensor:
    """``b`` (1-D int8) as whole rows (:func:`_fp_rows`): itself when it is, else one copy
    zero-padded (zeros change no sum)."""
    pad = _fp_rows(b.numel()) * _FP_ROW - b.numel()
    return b if pad == 0 else torch.nn.functional.pad(b, (0, pad))


def _fp_chunk(b: torch.Tensor, padded: bool = False) -> torch.Tensor:
    """Note [gradient fingerprint]: the lanes L_c of one chunk's bytes ``b`` (1-D int8, at most
    ``_FP_CHUNK``; ``padded``: already whole rows): an (lanes,) int64 tensor on b's device, no
    wait; at most FP_OPS_PER_CHUNK ops."""
    a, r = _fp_weights(b.device)
    if not padded:
        b = _fp_pad(b)
    rows = b.numel() // _FP_ROW
    p = torch._int_mm(b.view(rows, _FP_ROW), a)
    return (p.to(torch.int64) * r[:rows]).sum(0)


def _fingerprint_parts(t: torch.Tensor) -> torch.Tensor:
    """Per chunk of ``_FP_CHUNK`` bytes of `t`, its lanes: a (chunks, lanes) int64 tensor on
    `t`'s device (Note [gradient fingerprint])."""
    t = _local(t).detach()
    b = t.reshape(-1).contiguous().view(torch.int8)
    if b.numel() == 0:
        return torch.zeros((1, _FP_LANES), dtype=torch.int64, device=b.device)
    return torch.stack([_fp_chunk(b[lo : lo + _FP_CHUNK])
                        for lo in range(0, b.numel(), _FP_CHUNK)])


def _fp_chunks(numel: int, dtype: torch.dtype) -> int:
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return max(1, -(-nbytes // _FP_CHUNK))


def _fp_combine(parts: np.ndarray) -> Tuple[int, ...]:
    """The fingerprint from a (chunks, lanes) int64 array of `_fingerprint_parts`."""
    u = np.ascontiguousarray(parts).view(np.uint64).reshape(-1, _FP_LANES)
    out = []
    for s in range(_FP_LANES):
        m = np.array([_fp_chunk_multiplier(s, c) for c in range(len(u))], dtype=np.uint64)
        out.append(int((u[:, s] * m).sum(dtype=np.uint64)))  # uint64 arrays wrap
    return tuple(out)


def _fingerprint(t: torch.Tensor) -> Tuple[int, ...]:
    """Note [gradient fingerprint] of `t`'s bytes: eight integers modulo 2**64."""
    return _fp_combine(_fingerprint_parts(t).cpu().numpy())
