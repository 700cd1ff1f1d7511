"""explain(): what the last step decided, per op kind, with bytes and costs."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Dict, List, Optional, Tuple

from ..config import format_size
from .cost import SKIPPED_REASON, ms, region_skipped
from .machine import Machine
from .records import RegionRecord
from .search import Plan


@dataclasses.dataclass
class Explanation:
    """What the last step decided, per op kind. ``rows`` are dicts; ``str()`` is a table."""

    policy: str
    rows: List[Dict[str, Any]]
    summary: Dict[str, Any]

    def __str__(self) -> str:
        s = self.summary
        if not s.get("regions") and not self.rows:
            # explain() right after wrap(): an empty table would read as "nothing is saved"
            return (f"spillover: policy {self.policy}; no step recorded yet. explain() shows "
                    "what the last training step decided: run one (a forward with gradients "
                    "enabled), then call spillover.explain again.")
        out = [f"spillover: policy {self.policy}; {s.get('regions', 0)} regions"]
        for k, v in s.items():
            if k != "regions" and v not in (None, ""):
                out.append(f"  {k}: {v}")
        head = ("op", "output", "n", "decision", "each", "total", "FLOP/B", "recompute",
                "transfer", "why")
        table = [head] + [
            (
                r["op"], r["output"], str(r["count"]), r["decision"], format_size(r["bytes"]),
                format_size(r["total_bytes"]), f"{r['flops_per_byte']:.0f}",
                ms(r["recompute_s"]), ms(r["transfer_s"]), r["why"],
            )
            for r in self.rows
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(head) - 1)]
        for row in table:
            cells = [c.ljust(w) if i in (0, 1, 3) else c.rjust(w)
                     for i, (c, w) in enumerate(zip(row[:-1], widths))]
            out.append("  ".join(cells) + "  " + row[-1])
        return "\n".join(out)



def explain_records(
    records: List[RegionRecord],
    policy: str,
    machine: Optional[Machine],
    plan: Optional[Plan] = None,
    outside_bytes: int = 0,
    loss_bytes: int = 0,
) -> Explanation:
    """Group a step's op records by (op, output shape, decision), with bytes and costs;
    ``loss_bytes``: what the chunked loss region adds when backward starts, counted in the
    plan's peak (Note [loss transient] in spillover/loss/chunked.py)."""
    groups: Dict[Tuple[str, Tuple[int, ...], str, str], Dict[str, Any]] = {}
    for ri, r in enumerate(records):
        # A plan's records carry its decisions, not what the runtime then skips.
        dead = (region_skipped(r.ops, lambda o: o.action)
                if r.mode == "checkpoint" and r.saves_seen else set())
        for o in r.ops:
            if o.bytes == 0 and o.forced == "view":
                continue  # views hold nothing and cost nothing
            if r.mode == "plain-keep":  # (Note [a plain tail makes its cheap saves again])
                decision = ("made again" if o.action == "recompute" else "keep") \
                    if o.needed else "not held"
            elif r.mode == "plain-offload":
                decision = (f"offload-{o.tier or 'host'}" if o.needed and o.bytes
                            else "not held")
            elif o.after_stop or o.index in dead:
                decision = "not rerun"
            elif o.action == "offload" and o.tier:
                decision = f"offload-{o.tier}"
            else:
                decision = o.action
            if decision == "not held":
                why = "runs plainly; autograd does not save it"
            elif r.mode == "plain-offload":
                why = "runs plainly: the offload context takes what autograd saves"
            elif o.index in dead:
                why = SKIPPED_REASON
            else:
                why = o.reason or (
                    "after the last saved tensor: never rerun" if o.after_stop else o.forced or "")
            k = (o.name, o.shape, decision, why)
            g = groups.get(k)
            if g is None:
                sec = machine.rerun_seconds(o) if machine and decision == "recompute" else None
                link = None
                if machine and decision.startswith("offload"):
                    bw = machine.link_bytes_per_s
                    if o.tier == "nvme" and machine.nvme_bytes_per_s:
                        bw = machine.nvme_bytes_per_s
                    link = o.bytes / bw
                g = groups[k] = {
                    "op": o.name, "output": _shape_text(o.shape, o.dtype), "count": 0,
                    "decision": decision, "bytes": o.bytes, "total_bytes": 0,
                    "flops": o.flops, "flops_per_byte": o.flops_per_byte,
                    "recompute_s": sec, "transfer_s": link, "needed": o.needed, "why": why,
                    "first_index": (ri, o.index),
                }
            g["count"] += 1
            g["total_bytes"] += o.bytes
    rows = sorted(groups.values(), key=lambda g: g["first_index"])
    for g in rows:
        del g["first_index"]
    summary: Dict[str, Any] = {"regions": len(records)}
    if plan is not None:
        summary.update({
            "budget": format_size(plan.budget) if plan.budget is not None else "none",
            "no checkpointing holds": format_size(plan.plain_bytes),
            "full recompute holds": format_size(plan.full_bytes),
            "this plan holds": format_size(plan.planned_bytes)
            + ("" if plan.fits else " (over budget)"),
            "est. recompute per step": ms(plan.recompute_seconds),
            "est. exposed transfer per step": ms(plan.transfer_seconds),
            "note": plan.note,
        })
        if plan.model_peak:
            summary["planned peak"] = format_size(plan.model_peak + (plan.peak_offset or 0)) + (
                "" if plan.peak_offset is None else
                f" (model {format_size(plan.model_peak)} + measured offset "
                f"{format_size(plan.peak_offset)})")
        if plan.returns:  # Note [regions shipped whole] in search.py
            name = {i: (records[i].name if i < len(records) else str(i))
                    for i in range(len(plan.regions))}
            summary["shipped whole"] = "; ".join(
                f"{name[i]}, back from {name[at]}'s backward"
                for at in sorted(plan.returns) for i in [max(
                    j for j in range(at) if plan.regions[j].mode == "plain-offload")])
        if loss_bytes:
            summary["loss region in the peak"] = format_size(
                loss_bytes if plan.loss_cap is None else min(loss_bytes, plan.loss_cap))
        if plan.loss_cap is not None:
            summary["loss chunk"] = (
                f"capped at {format_size(plan.loss_cap)} (chunk and hidden gradient) by the "
                f"budget, against {format_size(loss_bytes)} with the speed rule's: fewer rows "
                "per chunk, slower (Note [loss chunk under a budget])")
    else:
        modes = collections.Counter(r.mode for r in records)
        if modes.get("full"):
            summary["full"] = f"{modes['full']} regions save only their inputs, recompute all"
        if modes.get("plain"):
            summary["offload"] = (f"{modes['plain']} regions recompute nothing; what they save "
                                  "goes to the offload context (or stays)")
        held = outside_bytes + sum(r.held_bytes for r in records)
        summary["held after forward (regions)"] = format_size(held)
        if machine is not None:
            rc = sum(
                machine.rerun_seconds(o) for r in records if r.mode == "checkpoint"
                for o in r.ops if o.action == "recompute" and not o.after_stop
            )
            summary["est. recompute per step"] = ms(rc)
    return Explanation(policy, rows, summary)


def _shape_text(shape: Tuple[int, ...], dtype: str) -> str:
    return f"{list(shape)} {dtype}" if shape else dtype
