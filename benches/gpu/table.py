"""The benchmark's table in summary.md: its header, a mode's row from its bench-MODE.json, and
the row of a mode that never reported. No torch here: run.sh calls it when a mode's process was
killed, and the deadline has no seconds to spare for importing torch.

    python benches/gpu/table.py header
    python benches/gpu/table.py failed-row MODE REASON --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any, Dict, Optional

GiB = 1 << 30


def out_path(out: str, mode: str) -> str:
    return os.path.join(out, f"bench-{mode}.json")


def median(res: Dict[str, Any], key: str) -> float:
    vals = [s[key] for s in res.get("steps", []) if s.get(key) is not None]
    return statistics.median(vals) if vals else float("nan")


def grads_cell(res: Dict[str, Any], ref: Optional[Dict[str, Any]]) -> str:
    own = {s["grads"] for s in res.get("steps", [])}
    if not own:
        return "–"
    if len(own) > 1:
        return ("✗ control: none's own steps differ (kernels not deterministic)"
                if res["mode"] == "none" else "✗ its own steps differ")
    if res["mode"] == "none":
        return f"control ✓ ({len(res['steps'])} steps identical)"
    ref_fp = {s["grads"] for s in (ref or {}).get("steps", [])}
    if len(ref_fp) != 1:
        return "– (no deterministic reference: see none's control)"
    return "✓ = none" if own == ref_fp else "✗ ≠ none"


HEADER = ("| mode | | step s | tok/s | × none | peak GiB | act. peak GiB | × none | offloaded GiB "
          "| stalls s | grads | wall s |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |")


def summary_row(res: Dict[str, Any], ref: Optional[Dict[str, Any]]) -> str:
    t, peak, act = median(res, "seconds"), median(res, "peak_bytes"), median(res, "act_peak_bytes")
    tokens = res.get("batch", 0) * res.get("seq", 0)
    rt = median(ref, "seconds") if ref else float("nan")
    ract = median(ref, "act_peak_bytes") if ref else float("nan")
    stats = res["steps"][-1].get("stats") if res.get("steps") else None
    off = (stats["bytes_offloaded_host"] + stats["bytes_offloaded_nvme"]) / GiB if stats else 0.0
    stalls = f"{stats['stall_seconds']:.2f}" if stats else ""
    mark = "✗" if res.get("error") else "✓"
    if res.get("error"):
        mark += " " + res["error"][:200].replace("|", "\\|")  # a | would end the cell
    if not res.get("complete") and res.get("steps_planned"):
        mark += f" ({len(res.get('steps', []))} of {res['steps_planned']} steps)"

    def num(x: float, f: str) -> str:
        return format(x, f) if x == x else "–"  # NaN: not measured

    return (f"| {res['mode']} | {mark} | {num(t, '.3f')} | {num(tokens / t, '.0f')} "
            f"| {num(rt / t, '.2f')} | {num(peak / GiB, '.2f')} | {num(act / GiB, '.2f')} "
            f"| {num(act / ract if ract else float('nan'), '.2f')} | {off:.2f} | {stalls} "
            f"| {grads_cell(res, ref)} | {res.get('wall_s', 0):.1f} |")


def failed_row(mode: str, reason: str, out: Optional[str]) -> str:
    """The row of a mode whose process never reported (killed by its timeout, crashed): from the
    steps its JSON kept, if any."""
    res: Dict[str, Any] = {"mode": mode, "steps": []}
    if out and os.path.exists(out_path(out, mode)):
        with open(out_path(out, mode)) as f:
            res = json.load(f)
    res["error"], res["complete"] = reason, False
    return summary_row(res, load_ref(out) if mode != "none" else None)


def load_ref(out: Optional[str]) -> Optional[Dict[str, Any]]:
    if not out or not os.path.exists(out_path(out, "none")):
        return None
    with open(out_path(out, "none")) as f:
        return json.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description="the benchmark's table in summary.md")
    ap.add_argument("what", choices=("header", "failed-row"))
    ap.add_argument("mode", nargs="?")
    ap.add_argument("reason", nargs="?")
    ap.add_argument("--out", default=None, help="folder of bench-MODE.json")
    args = ap.parse_args()
    if args.what == "header":
        print(HEADER)
    else:
        if not args.mode or not args.reason:
            ap.error("failed-row needs MODE and REASON")
        print(failed_row(args.mode, args.reason, args.out))


if __name__ == "__main__":
    main()
