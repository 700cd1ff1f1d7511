"""``OffloadAdamW.explain()`` (and ``spillover.explain(opt)``): where the optimizer's state is
and how many bytes per parameter it takes, as stored (Note [state formats] in formats.py)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List

from ..config import format_size
from . import formats
from .layout import _local

if TYPE_CHECKING:
    from .adamw import OffloadAdamW


@dataclasses.dataclass
class StateExplanation:
    """The optimizer's state per state space (``rows``, dicts) and in total (``summary``);
    ``str()`` is a table."""

    rows: List[Dict[str, Any]]
    summary: Dict[str, Any]

    def __str__(self) -> str:
        out = ["spillover: OffloadAdamW state"]
        for k, v in self.summary.items():
            out.append(f"  {k}: {v}")
        if not self.rows:
            return "\n".join(out)
        head = ("path", "dtype", "device", "params", "elements", "state_bits", "master",
                "stored", "bytes/param", "format")
        table = [head] + [
            (
                r["path"], r["dtype"], r["device"], str(r["params"]), str(r["elements"]),
                str(r["state_bits"]), "yes" if r["master"] else "no",
                format_size(r["state_bytes"]), f"{r['bytes_per_param']:.2f}",
                f"{r['format_bytes_per_param']:.2f}",
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(head))]
        for row in table:
            out.append("  ".join(c.rjust(w) if i >= 3 else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(row, widths))))
        out.append("  (bytes/param: as stored, chunk and alignment padding included; format: "
                   "the format's own figure; NVMe tier: read and written once per step each)")
        return "\n".join(out)


def explain_state(opt: OffloadAdamW) -> StateExplanation:
    """See :class:`StateExplanation`."""
    rows: List[Dict[str, Any]] = []
    total_bytes = total_elems = 0
    for space in opt._spaces:
        elems = sum(u[2] for u in space.units)
        st = int(space.state.stats()["state_bytes"])
        total_bytes += st
        total_elems += elems
        path = "sharded" if space.sharded else "staged" if space.staged else "in place"
        rows.append(dict(
            path=path,
            dtype=str(space.dtype).replace("torch.", ""),
            device=str(space.device),
            params=len(space.members),
            elements=elems,
            state_bits=space.bits,
            master=space.master,
            state_bytes=st,
            bytes_per_param=st / max(elems, 1),
            format_bytes_per_param=formats.bytes_per_param(space.bits, space.master),
        ))
    summary: Dict[str, Any] = {
        "tier": opt._tier,
        "state_bits": f"{opt._state_bits} ({formats.FORMAT_NAMES[opt._state_bits]})",
        "master_weights": opt._master_weights,
    }
    if opt._delayed:  # Note [delayed update], Note [weight prediction]
        why = ("" if opt._predict else
               " (predict_weights=False)" if opt._state_bits == 32 and opt._master_weights else
               " (it needs state_bits=32 and master_weights=True)")
        on = f"on ({opt._predict})" if opt._predict else "off"
        summary["update"] = ("one-step delayed (overlap='delayed'), weight prediction "
                             f"{on}{why}"
                             + (f", exact for the first {opt._delay_after} steps"
                                if opt._delay_after else ""))
    if total_elems:
        summary["state"] = (f"{format_size(total_bytes)} for {total_elems:,} elements on this "
                            f"rank = {total_bytes / total_elems:.2f} bytes/param")
        if opt._tier == "nvme":
            summary["NVMe per step"] = f"{format_size(2 * total_bytes)} read + written"
    waiting = [i for i, p in enumerate(opt._params) if p.requires_grad and not opt._stateful[i]]
    if waiting:
        kinds: Dict[Any, int] = {}
        for i in waiting:
            lp = _local(opt._params[i])
            kinds[(lp.dtype, lp.device)] = kinds.get((lp.dtype, lp.device), 0) + lp.numel()
        summary["no state yet"] = "; ".join(
            f"{n:,} {str(dt).replace('torch.', '')} elements on {dev}, "
            f"{formats.bytes_per_param(opt._state_bits, opt._keeps_master(dt, dev)):.2f} "
            "bytes/param once they take a step (Note [lazy state])"
            for (dt, dev), n in kinds.items()
        )
    return StateExplanation(rows, summary)
