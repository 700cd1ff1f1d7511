"""The verify mode on a device (``offload_context(verify=True)``, ``SPILLOVER_VERIFY=1``): every
offloaded storage is checked where its bytes are, with no host synchronisation per tensor.

Note [verify on the device]
    Three checks, each catching what the others cannot see:
    1. at pack, a checksum of the source is taken on its device, on the stream that produced it,
       before its copy is queued (Note [device checksum] in rust/link/checksum.rs: a few torch
       ops, the same function the Rust link runs on the host); the link copies its 8 bytes to
       the host after the copy's bytes and, once both landed, compares it with the checksum of
       the host block. A mismatch: the source was written (or its memory reused) before its
       copy read it. Raised by the step that packed it, at its next pack, exit or backward;
    2. at unpack, the checksum of the tensor brought back is taken on the device, on the stream
       that uses it, and compared with the pack's, on the device: a flag per tensor, read once
       when backward ends (one synchronisation per backward, none per tensor). A mismatch: the
       tensor was read before its copy back landed, or its host block was reused under the
       copy. Raised out of ``backward()``;
    3. the tier's crc32c of the host bytes, taken at seal and checked at every read back (torn
       or flipped NVMe reads), as on a CPU host.
    Each error names the tensor's shape and dtype, the step, the tier and which check failed.
    The cost is the checksum's torch ops on the device, twice per tensor (measured: see the
    README's verify mode); a source returned as it is (Note [source returned]) is not checked
    at unpack: its bytes never left.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import IntegrityError

__all__ = ["DeviceChecks", "device_checksum"]

#: Note [device checksum]: the prime, the words per row and the rows summed per batch of ops
P = (1 << 31) - 1
ROW_WORDS = 1024
ROW_BYTES = 4 * ROW_WORDS
_BATCH_ROWS = 4096  # 16 MiB of source: 64 MiB of int64 temporaries at most

_weights: Dict[Any, torch.Tensor] = {}
_lock = threading.Lock()


def _word_weights(device: torch.device) -> torch.Tensor:
    with _lock:
        w = _weights.get(device)
        if w is None:
            w = _weights[device] = torch.arange(1, 2 * ROW_WORDS, 2, dtype=torch.int64,
                                                device=device)
        return w


def _rows(x: torch.Tensor, first_row: int) -> torch.Tensor:
    """Note [device checksum] over whole rows of ``x`` (uint8, a multiple of 4 KiB long) that
    start at row ``first_row``: a 0-d int64 < P."""
    words = x.view(torch.int32).view(-1, ROW_WORDS).to(torch.int64) & 0xFFFFFFFF
    row = (words * _word_weights(x.device)).sum(1) % P
    r = torch.arange(first_row, first_row + row.numel(), dtype=torch.int64, device=x.device)
    return (row * ((2 * r + 1) % P) % P).sum() % P


def device_checksum(u8: torch.Tensor) -> torch.Tensor:
    """Note [device checksum] of a 1-D uint8 tensor's bytes, computed where they are, on the
    current stream: a 0-d int64 tensor on their device (nothing waits for it)."""
    n = u8.numel()
    whole = n // ROW_BYTES
    acc = torch.zeros((), dtype=torch.int64, device=u8.device)
    for r0 in range(0, whole, _BATCH_ROWS):
        r1 = min(whole, r0 + _BATCH_ROWS)
        acc = (acc + _rows(u8[r0 * ROW_BYTES : r1 * ROW_BYTES], r0)) % P
    if n > whole * ROW_BYTES:
        tail = torch.zeros(ROW_BYTES, dtype=torch.uint8, device=u8.device)
        tail[: n - whole * ROW_BYTES] = u8[whole * ROW_BYTES :]
        acc = (acc + _rows(tail, whole)) % P
    return acc


class DeviceChecks:
    """Check 2 of Note [verify on the device] for one context: the flags of the tensors brought
    back, read once per backward."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: List[Tuple[torch.Tensor, str]] = []

    def returned(self, raw: torch.Tensor, packed_sum: torch.Tensor, what: str) -> None:
        """``raw`` was brought back for a storage whose checksum at pack was ``packed_sum``."""
        bad = device_checksum(raw) != packed_sum
        with self._lock:
            self._pending.append((bad, what))

    def check(self) -> None:
        """Read the flags (one synchronisation); IntegrityError for the first mismatch."""
        with self._lock:
            pending, self._pending = self._pending, []
        if not pending:
            return
        flags = torch.stack([b.to(pending[0][0].device) for b, _ in pending]).cpu()
        bad: Optional[int] = next((i for i, f in enumerate(flags.tolist()) if f), None)
        if bad is not None:
            raise IntegrityError(
                f"{pending[bad][1]}: the tensor brought back for backward does not match the "
                "checksum taken on the device at pack (check 2 of Note [verify on the device]:"
                " read before its copy back landed, or its host block reused under the copy)"
            )
