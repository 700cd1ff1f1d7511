"""The formats ``OffloadAdamW``'s state is kept in (``state_bits=32 | 16 | 8``): the columns a
parameter's state has, their dtypes and sizes, the bytes per parameter, and the conversions a
checkpoint of another format goes through.

Note [state formats]
    ``state_bits=32``: ``exp_avg`` and ``exp_avg_sq`` in fp32, torch's AdamW state (bitwise
    equal to ``torch.optim.AdamW(fused=True)``). ``16``: both in bf16, rounded stochastically
    at every step (Note [stochastic rounding] in rust/optim/quant.rs). ``8``: one byte per
    element and one fp32 scale per block of :data:`BLOCK` (256) elements of the flattened
    parameter (Note [8-bit moments] there): ``exp_avg`` as int8 codes ``c``, the value
    ``c * (scale / 127)``; ``exp_avg_sq`` as uint8 codes ``c``, the value
    ``((c + 1) * (scale / 256)) ** 2``; the scales in ``exp_avg_scale`` and
    ``exp_avg_sq_scale``. An fp32 ``master`` column is kept besides when the parameter is not
    its own fp32 master (bf16, or staged from a GPU) and ``master_weights=True``.

    A checkpoint holds the state as stored, so saving and loading it is exact; it says its
    format twice: each entry's tensors (their dtypes, and the scale columns) and, in
    ``state_dict()``, a ``"state_format"`` entry (:func:`describe`) naming the format, the
    block and the code maps. Loading a checkpoint of another format converts it through fp32
    values with one warning (:func:`to_f32` here, whose arithmetic is the Rust kernel's own
    dequantization, bit for bit; then the kernel quantizes, rounding to nearest): fp32 state
    loaded into a low-bit optimizer loses the precision the format lacks; low-bit state
    loaded into an fp32 optimizer is exact in value but keeps what the quantization lost.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

import torch

from .. import _native

#: Elements per block of 8-bit state (one fp32 scale per moment and block).
BLOCK: int = _native.STATE_BLOCK
STATE_BITS = (32, 16, 8)
#: The format names a checkpoint's ``state_format`` carries.
FORMAT_NAMES = {32: "fp32", 16: "bf16-stochastic-v1", 8: "q8-block256-sqrt-v1"}
MOMENTS = ("exp_avg", "exp_avg_sq")
SCALES = ("exp_avg_scale", "exp_avg_sq_scale")
_DTYPES: Dict[int, Tuple[torch.dtype, torch.dtype]] = {
    32: (torch.float32, torch.float32),
    16: (torch.bfloat16, torch.bfloat16),
    8: (torch.int8, torch.uint8),
}


def check_state_bits(bits: Any) -> int:
    """``state_bits=``: 32, 16 or 8 (a ValueError naming the argument otherwise)."""
    if isinstance(bits, bool) or bits not in STATE_BITS:
        raise ValueError(
            f"OffloadAdamW: state_bits must be 32 (fp32 moments, torch's AdamW), 16 (bf16 "
            f"moments) or 8 (block-wise 8-bit moments), got {bits!r}"
        )
    return int(bits)


def blocks(n: int) -> int:
    return -(-n // BLOCK)


def columns(bits: int, master: bool) -> Tuple[str, ...]:
    """The columns of a parameter's state, in the order they are stored."""
    out = (("master",) if master else ()) + MOMENTS
    return out + SCALES if bits == 8 else out


def dtype(bits: int, col: str) -> torch.dtype:
    """The dtype of column `col` as stored."""
    if col in MOMENTS:
        return _DTYPES[bits][MOMENTS.index(col)]
    return torch.float32  # master, scales


def numel(col: str, n: int) -> int:
    """Elements of column `col` for `n` elements of a parameter."""
    return blocks(n) if col in SCALES else n


def part(col: str, start: int, n: int) -> slice:
    """The slice of column `col` holding elements [start, start + n) of a parameter: for the
    scale columns, the blocks they touch (a unit of 8-bit state starts on a block: Note
    [block alignment] in rust/optim/layout.rs)."""
    if col in SCALES:
        return slice(start // BLOCK, -(-(start + n) // BLOCK))
    return slice(start, start + n)


def bytes_per_param(bits: int, master: bool) -> float:
    """Bytes of state per parameter as stored (without the few bytes of padding per chunk)."""
    per = (4 if master else 0) + 2 * _DTYPES[bits][0].itemsize
    return per + (8 / BLOCK if bits == 8 else 0)


def describe(bits: int) -> Dict[str, Any]:
    """What a checkpoint says of its format (``state_dict()["state_format"]``)."""
    out: Dict[str, Any] = {"state_bits": bits, "name": FORMAT_NAMES[bits]}
    if bits == 8:
        out.update(
            block=BLOCK,
            exp_avg="int8 c: c * (exp_avg_scale / 127)",
            exp_avg_sq="uint8 c: ((c + 1) * (exp_avg_sq_scale / 256)) ** 2",
        )
    elif bits == 16:
        out.update(exp_avg="bfloat16", exp_avg_sq="bfloat16")
    return out


def entry_bits(entry: Mapping[str, Any], what: str) -> int:
    """The format of one parameter's saved state, from its tensors (`what` names it in
    errors)."""
    m = entry.get("exp_avg")
    if not isinstance(m, torch.Tensor):
        raise ValueError(f"{what}: no exp_avg tensor")
    has_scales = all(isinstance(entry.get(s), torch.Tensor) for s in SCALES)
    for bits, (dm, dv) in _DTYPES.items():
        v = entry.get("exp_avg_sq")
        if m.dtype == dm and isinstance(v, torch.Tensor) and v.dtype == dv:
            if has_scales != (bits == 8):
                break
            return bits
    raise ValueError(
        f"{what}: exp_avg of dtype {m.dtype} with exp_avg_sq of dtype "
        f"{getattr(entry.get('exp_avg_sq'), 'dtype', None)} and "
        f"{'' if has_scales else 'no '}scales is none of OffloadAdamW's state formats "
        "(fp32; bf16; int8 / uint8 codes with exp_avg_scale and exp_avg_sq_scale)"
    )


def to_f32(
    cols: Mapping[str, torch.Tensor], bits: int, start: int = 0
) -> Dict[str, torch.Tensor]:
    """Flat fp32 ``exp_avg`` and ``exp_avg_sq`` of a parameter's elements [start, start + n)
    given as columns stored as `bits` (the scales: ``part(c, start, n)``): the kernel's own
    widening and dequantization (Note [8-bit moments]), bit for bit. Other columns are passed
    through."""
    out = {k: v for k, v in cols.items() if k not in MOMENTS and k not in SCALES}
    m, v = (cols[c].reshape(-1) for c in MOMENTS)
    if bits == 8:
        n = m.numel()
        front = start % BLOCK  # elements of the first block before `start`
        nb = blocks(front + n)
        sm, sv = (cols[c].reshape(-1)[:nb].to(torch.float32) for c in SCALES)
        pad = (front, nb * BLOCK - n - front)
        cm = torch.nn.functional.pad(m.to(torch.float32), pad).view(nb, BLOCK)
        cv = torch.nn.functional.pad(v.to(torch.float32), pad).view(nb, BLOCK)
        # Note [8-bit moments]: c * (s / 127); r = (c + 1) * (s / 256), v = r * r, in f32.
        m = (cm * (sm / 127.0)[:, None]).reshape(-1)[front : front + n]
        r = ((cv + 1.0) * (sv / 256.0)[:, None]).reshape(-1)[front : front + n]
        v = r * r
    out["exp_avg"] = m.to(torch.float32)
    out["exp_avg_sq"] = v.to(torch.float32)
    return out


def explain_bytes() -> str:
    """A table of bytes per parameter for every setting (``doctor``, the README)."""
    rows = ["state_bits  master  bytes/param (host memory, or NVMe read + written each per step)"]
    for bits in STATE_BITS:
        for master in (True, False):
            rows.append(f"{bits:>10}  {'yes' if master else 'no ':>6}  "
                        f"{bytes_per_param(bits, master):.2f}")
    return "\n".join(rows)
