"""GPU benchmark: a Llama-style ~1B model in bf16 at long sequence, one mode per process.

    python benches/gpu/bench.py --mode host --out DIR [--summary FILE] [--steps 3]
    python benches/gpu/bench.py --mode none --tiny --device cpu --out DIR   # the CPU dry run

Modes: none; full (torch.utils.checkpoint per layer); save_on_cpu
(torch.autograd.graph.save_on_cpu(pin_memory=True)); spillover's offload_context with
- host: a host pool that holds everything the step offloads (what the forward saves, measured
  by one forward under counting hooks before the warm-up, + 1/4 + 16 MiB): nothing may stay on
  the device for want of room (bytes_kept_pool_full is 0, checked);
- nvme: a pool of 1/4 of that, so entries are evicted to disk and read back ahead of backward
  (prefetch hits and misses and overflow reads recorded; entries must come back from disk,
  checked) -- not the scratch disk's speed behind a pool that holds the step;
- auto: the defaults, no size given (tier auto; the pool starts small and grows to what the
  steps use, Note [growing pool] in spillover/_growth.py): what a user gets without a knob. With
  a size given, auto is the NVMe tier over that pool, the nvme mode again;
- quickstart: the README's Quick start whole: the layers under spillover.wrap(policy=
  "selective") and a new offload_context(tier="auto") every step, the defaults (from the third
  step on no pool may be mapped or registered, checked);
- quickstart-auto: the same with wrap(policy="auto") and no budget (the default: half the free
  memory): the first step follows a plan made on a trace of fake tensors (no learning step,
  checked; Note [seeded plan] in spillover/estimate/seed.py), and the peak should be none's;
- planned: spillover.wrap(policy=Planner) with full's measured peak as its budget, under
  offload_context("host") with host's pool: the planner's learning and tuning steps run before
  the warm-up, Note [peak feedback] in planner/tuner.py; needs full's result in DIR, else a 1-byte
  budget.
--pool SIZE gives every spillover mode that pool instead. benches/gpu/run.sh runs each mode in
a process of its own, so a mode's peak cannot include what another left on the device and one
mode's crash or timeout loses only that mode.

Per step (one warm-up, two for auto, three for the Quick start's, then --steps measured):
seconds for forward + backward (and each on its own, from CUDA events: no synchronize between
them); torch.cuda.max_memory_allocated and max_memory_reserved of the forward and of the
backward, separately (the peak counters are reset between the two; they count allocations as the
host makes them, so reading them needs no synchronize), each also above the memory held before
the step (parameters and gradients: the activations' peak); ctx.stats() for spillover's modes;
and a fingerprint of the gradients. DIR/bench-MODE.json is rewritten after every step, so a mode
that runs out of time still leaves what it measured. On the CPU (the dry run) the memory figures
are a stand-in: the process's peak resident set (VmHWM, reset through /proc/self/clear_refs) for
both counters, said as "memory_counter": "rss" in the JSON.

Mode optim (not an activation mode; its own table): a GPT from spillover.models (fp32
parameters, bf16 autocast, 134M parameters: AdamW's state is 1 GiB on the device) trained
--steps steps (+1 warm-up) three or four ways in one process, one after the other: forward +
backward alone, torch.optim.AdamW(fused=True) with its state on the device, OffloadAdamW(tier=
"host") (gradients staged by hooks during backward, CPU update, parameters back per
bucket), and when it fits --optim-budget (run.sh's B_OPTIM) OffloadAdamW(
update_in_backward=True) (the CPU updates on a worker thread during backward: Note [update in
backward]). Per way: the step's seconds (forward to the device's last kernel),
max_memory_allocated and max_memory_reserved of the step and of its forward and of its backward
with step() apart, and for the optimizers the time not hidden behind backward
(their step minus forward + backward alone) and step()'s own wall time after backward
returned; OffloadAdamW's gradient copies per step, stale copies (0 unless gradients change
after backward), the gradient fingerprint's throughput on the device (Note [gradient
fingerprint] in spillover/optim/fingerprint.py) and the largest parameter difference from
torch's AdamW after the run (for each OffloadAdamW way). ``--optim-model llama``: the same
ways on the probe's 1B Llama (llama.py, 16 x 2048, vocab 32000) with bf16 parameters, batch
4 x 1024 (issue 41's second model; not in run.sh's budget: run it as a call of its own).

Gradients: the fingerprints of a mode's steps must agree with each other, and with `none`'s.
`none` is the control: when its own steps differ, the model's kernels are not deterministic on
this GPU (flash attention's backward, for one) and no mode's gradients can be compared bitwise;
the column then says so instead of showing ✗. The bitwise check under deterministic algorithms
is tests/python/test_gpu_step.py.

Layout: the model is llama.py; the memory counters, gradient digest and result formats are
measure.py; mode optim is optim_mode.py. This file runs the activation modes and main().
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

import torch
from llama import Llama
from measure import GiB, Memory, above, fingerprint, fmt_gib, write_json
from optim_mode import run_optim
from table import HEADER, load_ref, out_path, summary_row
from torch import nn

import spillover

MODES = ("none", "full", "planned", "save_on_cpu", "host", "nvme", "auto", "quickstart",
         "quickstart-auto", "optim")
#: the README's Quick start whole: the model wrapped (its policy), a new context every step
WRAPPED = {"quickstart": "selective", "quickstart-auto": "auto"}


def mode_context(mode: str, args: Any):
    if mode == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu(pin_memory=args.device == "cuda")
    if mode in WRAPPED:  # the README's Quick start: tier="auto", the defaults
        return spillover.offload_context("auto")
    if mode in ("host", "nvme", "auto", "planned"):
        kw: Dict[str, Any] = {}
        if args.pool_bytes is not None:  # None: the defaults (mode auto)
            kw["host_pool_bytes"] = args.pool_bytes
        if args.nvme_path:
            kw["nvme_path"] = args.nvme_path
        return spillover.offload_context("host" if mode == "planned" else mode, **kw)
    return None


def saved_bytes(model: nn.Module, inp: torch.Tensor, tgt: torch.Tensor) -> int:
    """What one forward saves for backward that an offload context would take: distinct
    storages of at least min_offload_bytes, parameters and buffers left out. One forward under
    counting hooks that keep every tensor where it is; no backward."""
    min_bytes = spillover.Config.load().min_offload_bytes
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    seen: Dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in own and st.nbytes() >= min_bytes:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(inp, tgt)
    del loss
    return sum(seen.values())


def choose_pool(mode: str, args: Any, model: nn.Module, inp: torch.Tensor,
                tgt: torch.Tensor, res: Dict[str, Any]) -> None:
    """args.pool_bytes and res["pool_rule"] for the mode (the module docstring)."""
    args.pool_bytes = None
    if mode in WRAPPED:
        res["pool_rule"] = (f"spillover.wrap(model, policy={WRAPPED[mode]!r}) and a new "
                            "offload_context(tier='auto') every step, the defaults (the README's "
                            "Quick start)")
        return
    if mode not in ("host", "nvme", "auto", "planned"):
        return
    if args.pool:
        args.pool_bytes = spillover.parse_size(args.pool)
        res["pool_rule"] = f"--pool {args.pool}"
    elif mode == "auto":
        res["pool_rule"] = "the defaults (no size: the pool grows to what the steps use)"
    else:
        need = saved_bytes(model, inp, tgt)
        res["saved_estimate_bytes"] = need
        if mode == "nvme":  # a quarter: most entries leave the pool and come back from disk
            want, rule = need // 4, "1/4 of"
        else:  # everything the step offloads fits, with room for the pool's granules
            want, rule = need + need // 4 + (16 << 20), "1.25 x + 16 MiB of"
        args.pool_bytes = max(1 << 20, -(-want // (1 << 20)) * (1 << 20))  # whole MiB
        res["pool_rule"] = f"{rule} the {spillover.format_size(need)} one forward saves"
    res["pool"] = args.pool_bytes
    print(f"  pool: {res['pool_rule']}"
          + (f": {spillover.format_size(args.pool_bytes)}" if args.pool_bytes else ""),
          flush=True)


def run(args: Any, res: Dict[str, Any], path: Optional[str]) -> None:
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    torch.manual_seed(0)
    with dev:  # parameters made where they live: fast, and the same in every process
        model = Llama(args.vocab, args.d_model, args.layers, args.heads, args.ffn, args.seq)
    model = model.to(dtype)
    model.ckpt = args.mode == "full"
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(dev)
    inp, tgt = idx[:, :-1], idx[:, 1:]
    mem = Memory(cuda)
    res.update(params=sum(p.numel() for p in model.parameters()), seq=args.seq,
               batch=args.batch, layers=args.layers, d_model=args.d_model, dtype=str(dtype),
               device=str(dev), gpu=torch.cuda.get_device_name() if cuda else "cpu",
               torch=torch.__version__, memory_counter=mem.kind)
    print(f"{args.mode}: Llama-style {res['params'] / 1e9:.2f}B params, {args.layers} layers, "
          f"d {args.d_model}, seq {args.seq}, batch {args.batch}, {dtype}, {dev}", flush=True)
    choose_pool(args.mode, args, model, inp, tgt, res)
    planner = None
    if args.mode in WRAPPED:  # the layers wrapped as the README's Quick start does
        if WRAPPED[args.mode] == "auto":  # no budget: the default (half the free memory)
            planner = spillover.Planner()
            spillover.wrap(model, policy=planner)
        else:
            spillover.wrap(model, policy=WRAPPED[args.mode])
    if args.mode == "planned":
        plan_steps(model, inp, tgt, args, res, cuda)
    # spillover: one context, entered once per step, as in training (Note [one context, many
    # steps]); the auto mode's pool grows once, and each step reads ahead in the order the one
    # before it learned. save_on_cpu: a fresh one per step, as torch's docs use it.
    ctx = mode_context(args.mode, args)
    # auto grows its pool over its first steps (Note [growing pool]): two warm-ups, so that no
    # measured step includes a growth, pinning or retiring a generation
    # (the Quick start's: selective's refinement and auto's seeded plan settle in these too)
    warmups = 3 if args.mode in WRAPPED else 2 if args.mode == "auto" else 1
    for step in range(args.steps + warmups):
        if not isinstance(ctx, spillover.OffloadContext) or args.mode in WRAPPED:
            ctx = mode_context(args.mode, args)  # quickstart: a new context every step
        model.zero_grad(set_to_none=False)  # gradients stay allocated: part of the baseline
        if cuda:
            torch.cuda.synchronize()
        mem.reset()
        base = mem.now()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)] if cuda else []
        t0 = time.perf_counter()
        if cuda:
            ev[0].record()
        if ctx is None:
            loss = model(inp, tgt)
        else:
            with ctx:
                loss = model(inp, tgt)
        t1 = time.perf_counter()
        if cuda:
            ev[1].record()
        fwd, fwd_res = mem.peaks()  # the forward's peaks, then the backward's from here
        mem.reset()
        loss.backward()
        if cuda:
            ev[2].record()
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        bwd, bwd_res = mem.peaks()
        del loss
        fwd_s, bwd_s = ((ev[0].elapsed_time(ev[1]) / 1e3, ev[1].elapsed_time(ev[2]) / 1e3)
                        if cuda else (t1 - t0, dt - (t1 - t0)))
        peak = max(fwd, bwd) if fwd is not None and bwd is not None else None
        row = {"step": step, "seconds": dt, "fwd_seconds": fwd_s, "bwd_seconds": bwd_s,
               "peak_bytes": peak, "reserved_peak_bytes":
               max(fwd_res, bwd_res) if fwd_res is not None and bwd_res is not None else None,
               "fwd_peak_bytes": fwd, "bwd_peak_bytes": bwd,
               "fwd_reserved_bytes": fwd_res, "bwd_reserved_bytes": bwd_res,
               "base_bytes": base, "act_peak_bytes": above(peak, base),
               "fwd_act_bytes": above(fwd, base), "bwd_act_bytes": above(bwd, base),
               "grads": fingerprint([p.grad for p in model.parameters()])}
        if isinstance(ctx, spillover.OffloadContext):
            ctx.synchronize()
            row["stats"] = ctx.stats().as_dict()
        mem_text = (f"peak above the step's start: forward {fmt_gib(above(fwd, base))}, "
                    f"backward {fmt_gib(above(bwd, base))} GiB; reserved "
                    f"{fmt_gib(row['reserved_peak_bytes'])} GiB" if peak is not None
                    else "peak: no memory counter")
        pools = (f", pool maps {row['stats']['pool_maps']}, registrations "
                 f"{row['stats']['pool_registrations']}, stalls "
                 f"{row['stats']['stall_seconds']:.3f} s" if row.get("stats") else "")
        print(f"  step {step}{' (warm-up)' if step < warmups else ''}: {dt:.3f} s (forward "
              f"{fwd_s:.3f}, backward {bwd_s:.3f}), {mem_text}, grads {row['grads']}{pools}",
              flush=True)
        if step >= warmups:
            res["steps"].append(row)
        else:
            res["warmup"] = row
        if path:
            write_json(path, res)
    if planner is not None:  # auto's plan, and whether its first step followed a seeded one
        res["plan"] = planner.plan.variant if planner.plan else None
        res["learning_steps"] = planner.learning_steps
        res["seeded"] = planner.seed_note or (planner.seeded or {}).get("variant")
        print(f"  auto: plan {res['plan']}, learning steps {res['learning_steps']}, seeded: "
              f"{res['seeded']}", flush=True)
    res["failed_checks"] = checks(args.mode, res)


def checks(mode: str, res: Dict[str, Any]) -> List[str]:
    """What a mode's measured steps must show for its figures to mean what the table says."""
    stats = [s["stats"] for s in res["steps"] if s.get("stats")]
    failed = []
    if mode in WRAPPED:  # Note [the pool lives for the process]: from the third step on
        made = sum(st.get("pool_maps", 0) + st.get("pool_registrations", 0) for st in stats)
        if made:
            failed.append(f"{made} pool maps or registrations in the measured steps (a new "
                          "context per step must map and register nothing from its third)")
    if mode == "quickstart-auto" and res.get("learning_steps"):
        failed.append(f"{res['learning_steps']} learning step(s): the seeded plan was not "
                      f"followed ({res.get('seeded')})")
    if mode in ("host", "planned") and res.get("pool_rule", "").startswith("1.25"):
        kept = max((st["bytes_kept_pool_full"] for st in stats), default=0)
        if kept:
            failed.append(f"{kept / GiB:.2f} GiB stayed on the device for want of pool room "
                          f"(the pool should hold the step)")
    if mode == "nvme" and stats and not any(st["prefetch_hits"] + st["prefetch_misses"]
                                            for st in stats):
        failed.append("no entry came back from disk: the pool held the step, nothing evicted")
    return failed


def full_peak(out: str) -> Optional[int]:
    """The median peak of full checkpointing's steps in this run, if it ran and measured."""
    try:
        with open(out_path(out, "full")) as f:
            res = json.load(f)
    except (OSError, ValueError):
        return None
    if res.get("memory_counter") != "cuda":  # the CPU's stand-in is no device budget
        return None
    try:
        peaks = [s["peak_bytes"] for s in res["steps"] if s.get("peak_bytes")]
    except KeyError:
        return None
    return int(sorted(peaks)[len(peaks) // 2]) if peaks else None


def plan_steps(model: nn.Module, inp: torch.Tensor, tgt: torch.Tensor, args: Any,
               res: Dict[str, Any], cuda: bool) -> None:
    """Wrap the layers with a planner budgeted at full's peak and run its learning and tuning
    steps (not measured: a training run pays them once)."""
    budget = full_peak(args.out)
    res["budget_bytes"] = budget
    planner = spillover.Planner(budget_bytes=budget or 1)
    spillover.wrap(model, policy=planner)
    print(f"  planner budget: {budget / GiB:.2f} GiB (full's peak)" if budget else
          "  planner budget: 1 byte (no result of full in this run)", flush=True)
    for i in range(planner.TUNING_STEPS + 2):
        if planner.tuned:
            break
        model.zero_grad(set_to_none=False)
        with mode_context("planned", args):
            loss = model(inp, tgt)
        loss.backward()
        del loss
        if cuda:
            torch.cuda.synchronize()
        plan = planner.plan
        print(f"  planning step {i}: {plan.variant if plan else 'learning'}, measured peak "
              f"{(planner.last_peak or 0) / GiB:.2f} GiB", flush=True)
    res["plan"] = planner.plan.variant if planner.plan else None
    res["tuned"] = planner.tuned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=MODES, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (+1 warm-up)")
    ap.add_argument("--pool", default=None,
                    help="host pool of every spillover mode (default: per mode, see above)")
    ap.add_argument("--nvme-path", default=None, help="default: SPILLOVER_NVME_PATH")
    ap.add_argument("--tiny", action="store_true", help="a small model, to test the script")
    ap.add_argument("--out", default=None, help="folder of bench-MODE.json")
    ap.add_argument("--summary", default=None, help="append this mode's row to this file")
    ap.add_argument("--optim-model", choices=("gpt", "llama"), default="gpt",
                    help="mode optim: the GPT (fp32 parameters, bf16 autocast; run.sh's) or the "
                    "probe's 1B Llama with bf16 parameters (fp32 masters on the host), seq 1024")
    ap.add_argument("--optim-budget", type=float, default=30.0,
                    help="mode optim: seconds run.sh gives it (B_OPTIM); the update_in_backward "
                    "way runs only if it fits")
    args = ap.parse_args()
    if args.tiny:
        # Small, but its MLP activations (2 MiB) are above the 1 MiB offload threshold.
        args.seq, args.batch, args.layers, args.d_model, args.heads = 512, 2, 2, 128, 4
        args.ffn, args.vocab = 512, 256
    t0 = time.perf_counter()
    res: Dict[str, Any] = {"mode": args.mode, "complete": False, "steps": [],
                           "steps_planned": args.steps}
    path = None
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = out_path(args.out, args.mode)
    code = 0
    lines: List[str] = []
    try:
        if args.mode == "optim":
            lines = run_optim(args, res, path)
        else:
            run(args, res, path)
            if res["failed_checks"]:
                code = 3
        res["complete"] = True
    except Exception as e:  # the row says what broke; the other modes run in their own processes
        traceback.print_exc()
        res["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        res["traceback"] = traceback.format_exc()
        code = 3
    res["wall_s"] = time.perf_counter() - t0
    res["loss_path"] = spillover.loss.path_line()  # which loss ran; torch, transformers
    print(f"  {res['loss_path']}", flush=True)
    if path:
        write_json(path, res)
    if args.mode == "optim":
        if res.get("error"):
            lines.append(f"- ✗ {res['error'][:200]}")
        print("\n".join(lines), flush=True)
        if args.summary:
            with open(args.summary, "a", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
        sys.exit(code)
    row = summary_row(res, load_ref(args.out) if args.mode != "none" else None)
    print(HEADER, row, sep="\n", flush=True)
    if args.summary:
        with open(args.summary, "a", encoding="utf-8") as f:
            f.write(row + "\n")
    sys.exit(code)


if __name__ == "__main__":
    main()
