"""Gradient fingerprints of the staged path.

Note [gradient fingerprint]
    Two integers modulo 2**64 over the bytes of a gradient read as int16 words w_i: in chunks c
    of ``_FP_WORDS`` (2**20) words, F_s = sum_c K_s(c) * sum_j w_{c,j} * r_s[j] for s = 0, 1,
    where r_0, r_1 are fixed pseudo-random odd 64-bit weights and K_s(c) pseudo-random odd
    per-chunk weights (splitmix64 of c).
    torch's int64 products and sums wrap modulo 2**64 (checked against exact integers in
    tests/python/test_optim_staged.py; modular sums do not depend on the reduction order, so
    every device and every run agree), and the chunks' partial sums are combined on the host in
    numpy uint64. Both fingerprints are taken on the gradient's device by the same function. The
    staged one is of the bytes that were staged: the hook copies each chunk to a device
    snapshot on the copy stream, fingerprints the snapshot and copies it to the host. The copy
    stream runs alongside whatever the compute stream (or a collective) does after the hook,
    and a write landing between two separate reads of the gradient could give a fingerprint of
    the new bytes next to a copy of the old ones, which would pass the check; read once, the
    two agree whatever they saw (a torn mix of old and new then fails the check at
    ``step()``). The current one is taken at ``step()`` after everything queued before it (all
    gradients in one batch, one transfer back).

    What it proves: equal fingerprints mean equal bytes unless the change happens to satisfy
    two relations modulo 2**64 in the weights. For a change made without knowledge of the
    weights (a collective, a clip, a write: anything but an adversary) each holds with a
    probability of about 2**-48 if the weights were drawn at random (a 16-bit word's difference
    has at most 15 trailing zero bits), both together about 2**-96: a 128-bit fingerprint with
    about 96 bits of strength against accidents, and none against an adversary (it is linear;
    not a cryptographic hash). Pseudo-random weights catch permutations, sign flips of balanced
    values and swapped chunks, which a plain or index-weighted sum can miss.

    Cost: per gradient, two passes on its device (one at the hook, on the copy stream; one at
    ``step()``), each two integer kernels per chunk with 16 bytes of temporaries per word
    (32 MiB per chunk) and about 50 bytes of memory traffic per word (25 per gradient byte);
    the hook's snapshot adds a device-to-device copy of each chunk (2 MiB).
    Measured on this repository's 2-core CPU host with torch CPU ops: 0.9 GiB/s of gradient
    (``benches/python/optim_bench.py --parts staged``), about twice the time the CPU update
    itself takes per gradient byte there — which is why it runs on the device, whose bandwidth
    is three orders of magnitude higher (an estimate: a few ms per GiB of gradient on an H200;
    ``benches/gpu/bench.py --mode optim`` measures it), and not on the host copy. A stale copy
    costs one more copy of that gradient at ``step()``, not overlapped with backward.

"""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import numpy as np
import torch

from .layout import _local

# Note [gradient fingerprint]: words per chunk (temporaries: 2 x 8 bytes per word), the two
# weight sequences' seed, and the constants seeding each chunk's weight.
_FP_WORDS = 1 << 20
_FP_SEED = 0x5EED_F1A6
_FP_CHUNK_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_FP_CACHE: Dict[Any, torch.Tensor] = {}



def _fp_weights(device: torch.device) -> torch.Tensor:
    """Note [gradient fingerprint]: the two sequences of odd 64-bit weights, (2, _FP_WORDS)
    int64 on `device` (made once per device and chunk size)."""
    key = (str(device), _FP_WORDS)
    w = _FP_CACHE.get(key)
    if w is None:
        rng = np.random.default_rng(_FP_SEED)
        r = rng.integers(0, 1 << 64, size=(2, _FP_WORDS), dtype=np.uint64, endpoint=False)
        w = torch.from_numpy((r | np.uint64(1)).view(np.int64)).to(device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # used from the side streams too
        _FP_CACHE[key] = w
    return w


@functools.lru_cache(maxsize=1 << 16)
def _fp_chunk_multiplier(s: int, c: int) -> int:
    """The odd pseudo-random weight of chunk c's sum in sequence s (splitmix64 of c)."""
    m = (1 << 64) - 1
    z = (c * _FP_CHUNK_K[0] + _FP_CHUNK_K[1] * (s + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) | 1


def _fingerprint_parts(t: torch.Tensor) -> torch.Tensor:
    """Per chunk of ``_FP_WORDS`` int16 words of `t`'s bytes, the two weighted sums modulo
    2**64: a (chunks, 2) int64 tensor on `t`'s device (Note [gradient fingerprint])."""
    t = _local(t).detach()
    words = t.reshape(-1).contiguous().view(torch.int16)
    r = _fp_weights(words.device)
    if words.numel() == 0:
        return torch.zeros((1, 2), dtype=torch.int64, device=words.device)
    parts = []
    for lo in range(0, words.numel(), _FP_WORDS):
        x = words[lo : lo + _FP_WORDS]  # int16 * int64: an int64 product, x is not widened
        parts.append((x * r[:, : x.numel()]).sum(dim=1))  # wraps modulo 2**64
    return torch.stack(parts)


def _fp_chunks(numel: int, dtype: torch.dtype) -> int:
    words = numel * torch.empty((), dtype=dtype).element_size() // 2
    return max(1, -(-words // _FP_WORDS))


def _fp_combine(parts: np.ndarray) -> Tuple[int, int]:
    """The fingerprint from a (chunks, 2) int64 array of `_fingerprint_parts`."""
    u = np.ascontiguousarray(parts).view(np.uint64).reshape(-1, 2)
    out = []
    for s in range(2):
        m = np.array([_fp_chunk_multiplier(s, c) for c in range(len(u))], dtype=np.uint64)
        out.append(int((u[:, s] * m).sum(dtype=np.uint64)))  # uint64 arrays wrap
    return out[0], out[1]


def _fingerprint(t: torch.Tensor) -> Tuple[int, int]:
    """Note [gradient fingerprint] of `t`'s bytes: two integers modulo 2**64."""
    return _fp_combine(_fingerprint_parts(t).cpu().numpy())
