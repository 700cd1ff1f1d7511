"""The benchmark's table in summary.md: its header, a mode's row from its bench-MODE.json, the
row of a mode that never reported, and the three answers of a run (from none's, full's and
host's JSON). No torch here: run.sh calls it when a mode's process was killed, and the deadline
has no seconds to spare for importing torch.

    python benches/gpu/table.py header | legend
    python benches/gpu/table.py failed-row MODE REASON --out DIR
    python benches/gpu/table.py answers --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from typing import Any, Dict, List, Optional

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


HEADER = ("| mode | | step s | tok/s | × none | peak GiB | reserved GiB | fwd / bwd peak GiB "
          "| act. × none | offloaded GiB | pool GiB | kept, pool full GiB | prefetch hit / miss "
          "| overflow reads | stalls s | grads | wall s |\n"
          "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
          "| ---: | ---: | ---: | --- | ---: |")

#: What the columns mean, for the line under the table's title in summary.md.
LEGEND = ("peak: max_memory_allocated over the step, reserved: max_memory_reserved; fwd / bwd: "
          "the forward's and the backward's peaks above the memory held before the step "
          "(parameters and gradients), act. × none: the larger of the two against none's; "
          "spillover's columns from ctx.stats() of the last step. Pools: host and planned "
          "hold the step (1.25 x what one forward saves, + 16 MiB: kept, pool full must be 0), "
          "nvme a quarter of it (entries leave the pool and come back from disk), auto the "
          "defaults (a pool that grows to what the steps use)")


def num(x: float, f: str) -> str:
    return format(x, f) if x == x else "–"  # NaN: not measured


def gib(x: float) -> str:
    """GiB with two decimals, or three significant digits below 1 GiB (the dry run's MiBs)."""
    return num(x / GiB, ".2f" if abs(x) >= GiB else ".3g")


def summary_row(res: Dict[str, Any], ref: Optional[Dict[str, Any]]) -> str:
    t, peak = median(res, "seconds"), median(res, "peak_bytes")
    fwd, bwd = median(res, "fwd_act_bytes"), median(res, "bwd_act_bytes")
    act = median(res, "act_peak_bytes")
    tokens = res.get("batch", 0) * res.get("seq", 0)
    rt = median(ref, "seconds") if ref else float("nan")
    ract = median(ref, "act_peak_bytes") if ref else float("nan")
    stats = res["steps"][-1].get("stats") if res.get("steps") else None
    mark = "✗" if res.get("error") or res.get("failed_checks") else "✓"
    for why in ([res["error"]] if res.get("error") else []) + res.get("failed_checks", []):
        mark += " " + why[:200].replace("|", "\\|")  # a | would end the cell
    if not res.get("complete") and res.get("steps_planned"):
        mark += f" ({len(res.get('steps', []))} of {res['steps_planned']} steps)"
    tier = ["", "", "", "", "", ""]  # offloaded, pool, kept pool full, prefetch, overflow, stalls
    if stats:
        tier = [gib(stats["bytes_offloaded_host"] + stats["bytes_offloaded_nvme"]),
                gib(stats["pool_capacity"]), gib(stats["bytes_kept_pool_full"]),
                f"{stats['prefetch_hits']} / {stats['prefetch_misses']}",
                str(stats["overflow_reads"]), f"{stats['stall_seconds']:.2f}"]
    elif res.get("steps"):
        tier[0] = "0"
    return (f"| {res['mode']} | {mark} | {num(t, '.3f')} | {num(tokens / t, '.0f')} "
            f"| {num(rt / t, '.2f')} | {gib(peak)} | {gib(median(res, 'reserved_peak_bytes'))} "
            f"| {gib(fwd)} / {gib(bwd)} | {num(act / ract if ract else float('nan'), '.2f')} "
            f"| {' | '.join(tier)} | {grads_cell(res, ref)} | {res.get('wall_s', 0):.1f} |")


def failed_row(mode: str, reason: str, out: Optional[str]) -> str:
    """The row of a mode whose process never reported (killed by its timeout, crashed): from the
    steps its JSON kept, if any."""
    res: Dict[str, Any] = {"mode": mode, "steps": []}
    if out and os.path.exists(out_path(out, mode)):
        with open(out_path(out, mode)) as f:
            res = json.load(f)
    res["error"], res["complete"] = reason, False
    return summary_row(res, load_ref(out) if mode != "none" else None)


def load(out: Optional[str], mode: str) -> Optional[Dict[str, Any]]:
    if not out or not os.path.exists(out_path(out, mode)):
        return None
    with open(out_path(out, mode)) as f:
        return json.load(f)


def load_ref(out: Optional[str]) -> Optional[Dict[str, Any]]:
    return load(out, "none")


#: The answers' bars: host's peak below this share of none's; host's backward peak at most this
#: times its forward peak; host's step at most this times none's.
PEAK_SHARE, BWD_OVER_FWD, STEP_OVER_NONE = 0.5, 1.25, 1.10


def answers(out: Optional[str]) -> List[str]:
    """The three questions a run answers, one ✓/✗ line each with its figures (– where a mode it
    needs did not measure): does the host tier lower the device peak, does backward keep it low,
    is the step hidden."""
    res = {m: load(out, m) for m in ("none", "full", "host")}
    med = {m: (lambda k, r=r: median(r, k) if r else float("nan")) for m, r in res.items()}
    counters = {r.get("memory_counter") for r in res.values() if r}
    lines = []
    if counters != {"cuda"}:
        lines.append("- dry run: CPU stand-in figures (memory: the process's peak RSS, not "
                     "device memory; times: the CPU's) -- they test the script, they answer "
                     "nothing about a GPU")

    def line(ok: Optional[bool], text: str) -> None:
        lines.append(f"- {'–' if ok is None else '✓' if ok else '✗'} {text}")

    def known(*xs: float) -> bool:
        return all(x == x for x in xs)

    host, none, full = med["host"]("act_peak_bytes"), med["none"]("act_peak_bytes"), \
        med["full"]("act_peak_bytes")
    q = "host tier lowers the device peak"
    if known(host, none) and none > 0:
        line(host < PEAK_SHARE * none,
             f"{q}: peak above the step's start, host {gib(host)} GiB vs none {gib(none)} GiB "
             f"({host / none:.2f}x; ✓ below {PEAK_SHARE}x), full checkpointing beside it "
             f"{gib(full)} GiB")
    else:
        line(None, f"{q}: not answered (needs none's and host's peaks)")

    fwd, bwd = med["host"]("fwd_act_bytes"), med["host"]("bwd_act_bytes")
    nf, nb = med["none"]("fwd_act_bytes"), med["none"]("bwd_act_bytes")
    q = "backward keeps it low"
    if known(fwd, bwd) and fwd > 0:
        line(bwd <= BWD_OVER_FWD * fwd,
             f"{q}: under host, backward peak {gib(bwd)} GiB vs forward peak {gib(fwd)} GiB "
             f"({bwd / fwd:.2f}x; ✓ at most {BWD_OVER_FWD}x); none: forward {gib(nf)}, "
             f"backward {gib(nb)} GiB")
    else:
        line(None, f"{q}: not answered (needs host's forward and backward peaks)")

    ht, nt = med["host"]("seconds"), med["none"]("seconds")
    q = "the step is hidden"
    if known(ht, nt) and nt > 0:
        st = res["host"]["steps"][-1].get("stats") or {}
        line(ht <= STEP_OVER_NONE * nt,
             f"{q}: host step {ht:.3f} s / none step {nt:.3f} s = {ht / nt:.2f}x (✓ at most "
             f"{STEP_OVER_NONE}x); host stalled {st.get('stall_seconds', float('nan')):.3f} s "
             f"on copies, forced {st.get('copy_waits_forced', 0)} waits")
    else:
        line(None, f"{q}: not answered (needs none's and host's step times)")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description="the benchmark's table in summary.md")
    ap.add_argument("what", choices=("header", "legend", "failed-row", "answers"))
    ap.add_argument("mode", nargs="?")
    ap.add_argument("reason", nargs="?")
    ap.add_argument("--out", default=None, help="folder of bench-MODE.json")
    args = ap.parse_args()
    if args.what == "header":
        print(HEADER)
    elif args.what == "legend":
        print(LEGEND + ".")
    elif args.what == "answers":
        print("\n".join(answers(args.out)))
    else:
        if not args.mode or not args.reason:
            ap.error("failed-row needs MODE and REASON")
        print(failed_row(args.mode, args.reason, args.out))


if __name__ == "__main__":
    main()
