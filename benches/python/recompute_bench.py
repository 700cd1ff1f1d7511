"""Recompute and offload end to end on CPU, on both attention kinds of the built-in GPT: the
peak memory of the whole step and step time, per mode, same run. For each kind in --attn
(default both, one after the other) two phases:

- memory: a child process with glibc's mmap threshold pinned at 64 KiB, so that freed tensors
  leave RSS at once (the method of e2e_cpu.py). peak = the kernel's RSS high-water mark over
  forward *and* backward (VmHWM, reset through /proc/self/clear_refs before the step) - RSS
  before the step + the whole spillover pool under a context (pre-faulted RAM on a CPU host,
  used or not: the planner charges it so too). Beside it, "held" = RSS after forward - RSS
  before (+ the pool), copies still in flight included. Two rounds: every mode once (auto
  learns; its budget is set from `torch-full`'s peak), then auto's tuning steps (it measures
  its first planned steps and re-plans, Note [peak feedback] in planner/tuner.py), then every mode
  again; the second round is reported, and beside it the most any step of the mode reached
  (for auto: its learning and tuning steps included, the whole-run peak its budget bounds).
- time: a fresh child process per mode and round, glibc's allocator as users have it (the
  pinned threshold would make every large allocation page-fault and slow the modes that
  allocate most: with it, `none` ran slower than `full`). Each child runs its warm-up step
  (auto follows the plan tuned in the memory phase: this allocator would measure other
  peaks), then --inner timed ones (their median); modes are interleaved round by
  round, --steps rounds, medians with the spread (fastest-slowest). Under glibc's default,
  tensors above 32 MiB (the explicit attention scores here) are fresh page-faulted mappings
  every time in every mode, and step times swing with what the previous mode left in the
  heap; `--allocator cached` takes the page faults out, as a GPU's caching allocator does.

    python benches/python/recompute_bench.py [--layers 6 --d-model 512 --heads 8 --seq 1024
        --batch 4] [--attn explicit|sdpa|both] [--steps 3]
        [--modes none,torch-full,torch-sac,full,selective,offload-nvme,auto]
        [--pool 64MiB] [--auto-pool 32MiB] [--vocab 8192] [--explain] [--json-out PATH]

    smoke test (about a minute, mostly imports):
    python benches/python/recompute_bench.py --layers 2 --d-model 64 --heads 2 --seq 64 \
        --batch 2 --steps 1

Attention kinds (spillover.models.GPTConfig.attn):
  explicit      softmax(q kᵀ/√d) v written out: the s×s scores are saved
  sdpa          F.scaled_dot_product_attention(is_causal=True), as Hugging Face models run it

Modes:
  none          the plain model
  torch-full    torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False) per block:
                torch's full checkpointing, the reference of the "x torch-full" columns
  torch-sac     torch's own selective checkpointing, saving every matmul output (and, with
                sdpa, the attention kernel's outputs); what `selective` should beat
  torch-full-cl (not run by default) torch-full with the head and loss by torch's chunked
                linear_cross_entropy at spillover's rows per chunk: the best a user assembles
                from torch alone
  The torch modes run the model as written: its head makes the tokens x vocab logits. Every
  spillover mode goes through spillover.wrap, which gives the model its chunked loss region
  (no logits; spillover.loss), and auto counts that region in the peak it plans.
  full          spillover.wrap(policy="full"): each block saves only its input
  selective     spillover.wrap(policy="selective")
  offload-nvme  spillover.wrap(policy="offload") under offload_context("nvme", pool --pool)
  offload-nvme-copy (not run by default) the same with write_from_tensor=False: every saved
                storage copied into the pool before it is written (Note [written from the
                tensor] in rust/tier/direct.rs), the tier as it was before
  auto          spillover.wrap(policy="auto") under offload_context("nvme", pool --auto-pool),
                budget = `torch-full`'s peak of the whole step in this run (the least over
                rounds 0 and 1; `full`'s when `torch-full` is not run): auto learns in round 0,
                then plans and tunes. On a CPU host the pool is the memory the budget counts:
                32 MiB by default, so that it takes a sixteenth of the budget, not an eighth
  auto-sel      (not run by default) the same with budget = `selective`'s peak: is auto
                faster at equal memory?

After each kind's table: every spillover mode that another mode of the run beats on both
peak and time ("DOMINATED: ..."); selective's memory saved per second added against
torch-full's; auto's peak and time against full's (goal: peak <= 1.05x, time <= 0.85x).
--json-out writes every measurement, per kind.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import gc
import json
import math
import os
import pickle
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

import spillover
from spillover import calibrate
from spillover._peak import high_water as peak_rss
from spillover._peak import reset_high_water as reset_peak_rss
from spillover._peak import rss
from spillover.config import format_size
from spillover.demo import PEAK_MARGIN, TIME_MARGIN
from spillover.loss import chunk_rows
from spillover.models import ATTENTION_KINDS, GPT, GPTConfig, synthetic_batch

_libc = ctypes.CDLL("libc.so.6")

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
# The fused attention kernels this torch has (CPU flash, CUDA flash / efficient / cuDNN): SAC
# saves their outputs (the attention output and its row statistics), as it saves a matmul's.
SDPA_OPS = tuple(
    getattr(aten, name).default
    for name in ("_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention",
                 "_scaled_dot_product_cudnn_attention")
    if hasattr(aten, name)
)
SAC_SAVED = MATMULS + SDPA_OPS

DEFAULT_MODES = "none,torch-full,torch-sac,full,selective,offload-nvme,auto"
ALL_MODES = DEFAULT_MODES.split(",") + ["auto-sel", "torch-full-cl", "offload-nvme-copy"]
TORCH_MODES = ("none", "torch-full", "torch-sac", "torch-full-cl")  # no spillover
WRAP_POLICY = {"full": "full", "selective": "selective", "offload-nvme": "offload",
               "offload-nvme-copy": "offload"}
AUTO_MODES = ("auto", "auto-sel")


def _sac_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAC_SAVED else CheckpointPolicy.PREFER_RECOMPUTE


def torch_checkpoint_forward(model: GPT, idx: torch.Tensor, tgt: torch.Tensor,
                             selective: bool, chunked: bool = False) -> torch.Tensor:
    """The model's forward with each block under torch.utils.checkpoint (non-reentrant): full
    checkpointing, or with `selective` torch's SAC saving SAC_SAVED's outputs; `chunked`: the
    head and loss by torch's linear_cross_entropy (spillover's chunk rows, no logits)."""
    x = model.tok(idx) + model.pos(torch.arange(idx.shape[1]))
    kw = {}
    if selective:
        kw["context_fn"] = functools.partial(create_selective_checkpoint_contexts, _sac_policy)
    for blk in model.blocks:
        x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False, **kw)
    if chunked:
        w = model.head.weight
        opts = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_rows(w.shape[0]),
                                                  chunking_method=None)
        return torch.nn.functional.linear_cross_entropy(
            model.ln_f(x).flatten(0, 1), w, tgt.flatten(), options=opts)
    logits = model.head(model.ln_f(x))
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten())


def budget_source(mode: str, modes: list) -> str:
    """The mode whose peak is an auto mode's budget."""
    if mode == "auto-sel":
        return "selective"
    return "torch-full" if "torch-full" in modes else "full"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192,
                    help="vocabulary (the loss region: tokens x vocab logits without spillover)")
    ap.add_argument("--attn", choices=(*ATTENTION_KINDS, "both"), default="both",
                    help="attention kind; both: the whole table for each, one after the other")
    ap.add_argument("--steps", type=int, default=3,
                    help="rounds; each times --inner steps per mode (their median), in a fresh "
                         "process after its warm-up step")
    ap.add_argument("--inner", type=int, default=3,
                    help="timed steps per child process (their median is the round's time)")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help=f"comma-separated, from: {', '.join(ALL_MODES)}")
    ap.add_argument("--pool", default="64MiB", help="host pool of offload-nvme")
    ap.add_argument("--auto-pool", default="32MiB",
                    help="host pool of auto's NVMe context (on a CPU host the pool is the memory "
                         "the budget counts: a smaller one leaves auto more of it)")
    ap.add_argument("--explain", action="store_true", help="print explain() for each wrap mode")
    ap.add_argument("--seed", choices=("trace", "estimate", "none"), default="trace",
                    help="auto's first step: planned from a trace of it on fake tensors made "
                         "inside it (trace, the default), from spillover.estimate before it "
                         "(estimate), or a learning step (none, as before Note [seeded plan])")
    ap.add_argument("--json-out", metavar="PATH", help="write every measurement here (JSON)")
    ap.add_argument("--phase", choices=("all", "memory", "time"), default="all",
                    help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--plan", help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--allocator", choices=("default", "cached"), default="default",
                    help="time phase: glibc as configured (default), or 'cached': no mmap and "
                         "no trimming, so freed memory is reused without page faults, as a "
                         "GPU's caching allocator does")
    return ap


def measure(args: argparse.Namespace) -> None:
    """One child: the memory phase (every mode, two rounds) or one timed step of one mode."""
    if args.phase == "memory":
        _libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD = 64 KiB: RSS tracks live tensors
    elif args.allocator == "cached":
        _libc.mallopt(-4, 0)  # M_MMAP_MAX = 0: every allocation from the heap
        _libc.mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never give freed memory back
    cfg = GPTConfig(vocab=args.vocab, d_model=args.d_model, n_heads=args.heads,
                    n_layers=args.layers, seq=args.seq, attn=args.attn)
    torch.manual_seed(0)
    base = GPT(cfg)
    idx, tgt = synthetic_batch(cfg, args.batch)
    modes = args.modes.split(",")
    tmp = tempfile.mkdtemp(prefix="spillover-recompute-bench-")
    machine = calibrate.calibrate(device="cpu")  # before timing: the planner reads it
    if args.phase == "memory":
        print(calibrate.describe(machine), flush=True)

    models = {}
    planners = {}  # auto mode -> (planner, the mode whose peak is its budget)
    for mode in modes:
        if mode in TORCH_MODES:
            models[mode] = base
            continue
        m = GPT(cfg)
        m.load_state_dict(base.state_dict())
        policy = WRAP_POLICY.get(mode)
        if mode in AUTO_MODES:
            # budget set from this run's measurements; --seed (Note [seeded plan] in
            # spillover/estimate/seed.py): "trace" plans the first step from a trace of it
            # made inside it, "estimate" from spillover.estimate before it, "none" learns first
            planner = spillover.Planner(budget_bytes=1, seed_from_trace=args.seed == "trace")
            planners[mode] = (planner, budget_source(mode, modes))
            policy = planner
        models[mode] = spillover.wrap(m, policy=policy)

    def context(mode):
        if mode in ("offload-nvme", "offload-nvme-copy"):
            return spillover.offload_context("nvme", host_pool_bytes=args.pool, nvme_path=tmp,
                                             write_from_tensor=mode == "offload-nvme")
        if mode in AUTO_MODES:
            return spillover.offload_context("nvme", host_pool_bytes=args.auto_pool,
                                             nvme_path=tmp)
        return None

    def step_once(mode, measure_memory):
        model = models[mode]
        model.zero_grad(set_to_none=True)
        gc.collect()
        if measure_memory:
            _libc.malloc_trim(0)
        ctx = context(mode)
        before = rss()
        if measure_memory:
            reset_peak_rss()
        t0 = time.perf_counter()
        if ctx is not None:
            with ctx:
                loss = model(idx, tgt)
        elif mode in ("torch-full", "torch-sac", "torch-full-cl"):
            loss = torch_checkpoint_forward(model, idx, tgt, selective=mode == "torch-sac",
                                            chunked=mode == "torch-full-cl")
        else:
            loss = model(idx, tgt)
        held = rss() - before  # copies still in flight hold their sources: counted
        loss.backward()
        dt = time.perf_counter() - t0
        peak = peak_rss() - before if measure_memory else 0
        if ctx is not None:
            pool = ctx.stats().pool_capacity  # pre-faulted RAM whether in use or not
            held += pool
            peak += pool
        return dt, peak, held

    if args.phase == "memory":
        # Round 0: every mode once (auto learns; its budget comes from it); round 1: what each
        # holds, auto now planned.
        # Each context's pool is mapped and faulted in when it first opens, and a step counts
        # the whole pool on top of what RSS grew: opened once here, so that a mode's first step
        # does not count its pool twice.
        for mode in modes:
            ctx = context(mode)
            if ctx is not None:
                with ctx:
                    pass
        least_peak: dict = {}
        peak_by, held_by = {}, {}
        run_peak: dict = {}  # the most any step of the mode reached (learning, tuning included)
        auto_steps: dict = {m: [] for m in planners}  # (peak, seconds, plan) of every step
        for step in range(2):
            if step == 1:
                # auto measures its first planned steps and re-plans (Note [peak feedback] in
                # planner/tuner.py) before the step that is reported
                for mode, (planner, _ref) in planners.items():
                    for _ in range(planner.TUNING_STEPS + 1):
                        if planner.tuned:
                            break
                        dt, peak, held = step_once(mode, True)
                        run_peak[mode] = max(run_peak.get(mode, 0), peak)
                        auto_steps[mode].append((peak, dt, planner.plan.variant
                                                 if planner.plan else "learning"))
                        print(f"  memory tuning {mode:<13} peak {peak / 2**20:8.0f} MiB, plan "
                              f"{planner.plan.variant if planner.plan else '-'}", flush=True)
            for mode in modes:
                if mode in planners:
                    planner = planners[mode][0]
                    if args.seed == "estimate" and planner.plan is None:
                        # ahead of training, outside the step: the estimate's tuned plan
                        est = spillover.estimate(base, idx, tgt, modes=["auto"],
                                                 budget=planner.budget_bytes,
                                                 host_pool_bytes=args.auto_pool)
                        seeded = est.planner(planner.budget_bytes)
                        planner.seed(seeded.plan, seeded.planned_records, seeded.peak_offsets,
                                     seeded.outside_bytes, seeded.loss_bytes,
                                     seeded.loss_min_bytes,
                                     predicted_peak=seeded.seeded["predicted_peak"])
                    before = planner.plan.variant if planner.plan else "learning"
                dt, peak, held = step_once(mode, True)
                run_peak[mode] = max(run_peak.get(mode, 0), peak)
                if mode in planners:
                    auto_steps[mode].append((peak, dt, planner.plan.variant if before ==
                                             "learning" and planner.seeded else before))
                least_peak[mode] = min(least_peak.get(mode, peak), peak)
                for planner, ref in planners.values():
                    if ref == mode:  # the budget is the reference's peak of the whole step
                        planner.budget_bytes = least_peak[mode]
                peak_by[mode], held_by[mode] = peak, held
                print(f"  memory round {step} {mode:<13} peak {peak / 2**20:8.0f} MiB, held "
                      f"after forward {held / 2**20:8.0f} MiB", flush=True)
        budgets = {m: planners[m][0].budget_bytes for m in planners}
        plans = {}
        for m, (planner, _ref) in planners.items():
            # the time phase follows the plan tuned here: its own allocator (not pinned) would
            # measure other peaks
            path = f"{args.json}.{m}.plan"
            with open(path, "wb") as f:
                pickle.dump(planner.plan, f)
            plans[m] = path
        with open(args.json, "w") as f:
            json.dump({"peak": peak_by, "held": held_by, "run_peak": run_peak,
                       "auto_steps": auto_steps,
                       "seeded": {m: dict(planners[m][0].seeded or {},
                                          note=planners[m][0].seed_note) for m in planners},
                       "budgets": budgets, "plans": plans,
                       "variants": {m: planners[m][0].plan.variant for m in planners}}, f)
        if args.explain:
            for m in modes:
                if m not in TORCH_MODES:
                    print(f"\n== explain: {m}")
                    print(spillover.explain(models[m]))
        return

    # phase "time": one mode, in steady state (as a training loop runs it).
    (mode,) = modes
    if mode in planners:
        planners[mode][0].budget_bytes = args.budget
        with open(args.plan, "rb") as f:
            planners[mode][0].use_plan(pickle.load(f))
    step_once(mode, False)  # warm-up
    dt = statistics.median(step_once(mode, False)[0] for _ in range(args.inner))
    with open(args.json, "w") as f:
        json.dump({"t": dt}, f)


def child(args: list) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as jf:
        subprocess.run([sys.executable, __file__, "--json", jf.name, *args], check=True)
        with open(jf.name) as f:
            return json.load(f)


def dominated_pairs(med: dict) -> list:
    """(loser, winner) for every spillover mode that another mode beats on both peak and
    median time by more than the margins of spillover.demo.dominated (1 % of peak, 5 % of
    time: closer than that is noise). ``med``: mode -> (time, peak)."""
    return [(m, o) for m in med if m not in TORCH_MODES for o in med
            if o != m and med[m][0] > med[o][0] * (1 + TIME_MARGIN)
            and med[m][1] > med[o][1] * (1 + PEAK_MARGIN)]


def run_kind(args: argparse.Namespace, attn: str) -> dict:
    """Both phases for one attention kind; prints its table and checks; returns the results."""
    modes = args.modes.split(",")
    shape = ["--layers", str(args.layers), "--d-model", str(args.d_model), "--heads",
             str(args.heads), "--seq", str(args.seq), "--batch", str(args.batch), "--vocab",
             str(args.vocab), "--attn",
             attn, "--pool", args.pool, "--auto-pool", args.auto_pool, "--allocator",
             args.allocator, "--seed", args.seed]
    print(f"\n### attention {attn}", flush=True)
    # Memory first, in a child whose allocator is pinned (see the module docstring); then each
    # timed step in a child of its own that runs one mode only, round by round.
    mem_run = child(["--phase", "memory", "--modes", args.modes, *shape]
                    + (["--explain"] if args.explain else []))
    budgets = mem_run["budgets"]
    times: dict = {m: [] for m in modes}
    for step in range(args.steps):
        for mode in modes:
            budget = (["--budget", str(budgets[mode]), "--plan", mem_run["plans"][mode]]
                      if mode in budgets else [])
            dt = child(["--phase", "time", "--modes", mode, "--inner", str(args.inner), *shape,
                        *budget])["t"]
            times[mode].append(dt)
            print(f"  time round {step} {mode:<13} {dt:6.2f} s", flush=True)

    for path in mem_run["plans"].values():
        os.unlink(path)
    med = {m: (statistics.median(times[m]), mem_run["peak"][m]) for m in modes}
    nan = (math.nan, math.nan)
    base_t, base_m = med.get("none", nan)
    full_t, full_m = med.get("torch-full", nan)
    print(f"\nGPT {args.layers}x{args.d_model}, {args.heads} heads, seq {args.seq}, batch "
          f"{args.batch}, vocab {args.vocab}, fp32, attention {attn}, CPU "
          f"({torch.get_num_threads()} threads); "
          f"medians of {args.steps} rounds, allocator {args.allocator}")
    print(f"{'':<13} {'':>7} {'':>11} {'time':>7} {'':>12} {'':>9} {'peak':>7} {'':>12}")
    head = ("mode", "step s", "spread", "x none", "x torch-full", "peak MiB", "x none",
            "x torch-full", "held MiB")
    print(f"{head[0]:<13} {head[1]:>7} {head[2]:>11} {head[3]:>7} {head[4]:>12} {head[5]:>9} "
          f"{head[6]:>7} {head[7]:>12} {head[8]:>9}")
    for m in modes:
        t, mem = med[m]
        lo, hi = min(times[m]), max(times[m])
        print(f"{m:<13} {t:7.2f} {lo:5.2f}-{hi:<5.2f} {t / base_t:7.2f} {t / full_t:12.2f} "
              f"{mem / 2**20:9.0f} {mem / base_m:7.2f} {mem / full_m:12.2f} "
              f"{mem_run['held'][m] / 2**20:9.0f}")
    print("peak MiB: the RSS high-water mark of the whole step (forward and backward) over RSS "
          "before it, + the whole pool of a context; held MiB: RSS after forward (+ the pool), "
          "copies in flight included. spread: fastest-slowest round. x torch-full: against "
          "torch.utils.checkpoint on every block (torch's full checkpointing).")

    pairs = dominated_pairs(med)
    for m, o in pairs:
        print(f"DOMINATED: {m} (peak {format_size(med[m][1])} > {format_size(med[o][1])}, "
              f"time {med[m][0]:.3f} > {med[o][0]:.3f} s of {o})")
    if not pairs:
        print("never dominated: no spillover mode is beaten on both peak and time (by more "
              f"than {PEAK_MARGIN:.0%} and {TIME_MARGIN:.0%})")

    if "selective" in med and "torch-full" in med and "none" in med:
        def saved_per_s(mode):
            """MiB saved against none, seconds added against none, and their ratio."""
            t, mem = med[mode]
            saved, added = (base_m - mem) / 2**20, t - base_t
            return saved, added, (saved / added if added > 0 else math.inf)

        s_mib, s_dt, s_rate = saved_per_s("selective")
        f_mib, f_dt, f_rate = saved_per_s("torch-full")
        line = (f"selective: saves {s_mib:.0f} MiB vs none for {s_dt:+.2f} s; torch-full "
                f"{f_mib:.0f} MiB for {f_dt:+.2f} s")
        if s_dt <= 0 and s_mib > 0:
            line += ": selective saves memory at no added time (goal met)"
        elif f_rate in (0, math.inf) or s_mib <= 0:
            line += ": no ratio (a mode saved nothing or added no time)"
        else:
            line += (f": {s_rate:.0f} vs {f_rate:.0f} MiB per second added, "
                     f"{s_rate / f_rate:.2f}x torch-full's (goal >= 1)")
        print(line)
    for m in ("offload-nvme", "offload-nvme-copy"):
        if m in med and "torch-full" in med and "none" in med:
            t, mem = med[m]
            print(f"{m} ({args.pool} pool): peak {mem / full_m:.2f}x torch-full's, time "
                  f"{t / base_t:.2f}x none's")
    for m in AUTO_MODES:
        ref = budget_source(m, modes)
        if m in med and ref in med:
            t, mem = med[m]
            ref_t, ref_m = med[ref]
            goal = " (goal: peak within 1.05x, time <= 0.85x)" if m == "auto" else ""
            print(f"{m}: peak {mem / ref_m:.2f}x {ref}'s, time {t / ref_t:.2f}x {ref}'s{goal}; "
                  f"budget {format_size(budgets[m])} = {ref}'s peak; plan: "
                  f"{mem_run['variants'][m]}")
            if "none" in med and m == "auto":
                # what bounds the time goal: no plan runs faster than the plain model, and under
                # this budget only the NVMe tier's plans fit (their copies use the same cores)
                print(f"{m}: none runs at {base_t / ref_t:.2f}x {ref}'s time (no plan is "
                      f"faster); {m} at {t / base_t:.2f}x none's")
            whole = mem_run["run_peak"][m]
            print(f"{m}: whole-run peak (its learning and tuning steps included) "
                  f"{format_size(whole)} = {whole / budgets[m]:.2f}x its budget (goal <= 1.05x)")
            steps = mem_run["auto_steps"][m]
            if steps:
                (p0, t0, v0), (_pl, tl, vl) = steps[0], steps[-1]
                print(f"{m}: first step ({v0}): peak {format_size(p0)} = {p0 / budgets[m]:.2f}x "
                      f"its budget, {t0:.2f} s = {t0 / tl:.2f}x the last memory step's ({vl}, "
                      f"{tl:.2f} s; both with the mmap threshold pinned); steps: "
                      + ", ".join(f"{p / 2**20:.0f} MiB {t:.2f} s {v}" for p, t, v in steps))
                sd = mem_run["seeded"][m]
                if sd.get("variant"):
                    print(f"{m}: the first step's plan came from a trace on fake tensors "
                          f"({sd.get('fake_steps')} fake steps, {sd.get('seconds', 0):.2f} s of "
                          f"its time; predicted peak {format_size(sd.get('predicted_peak') or 0)})")
                elif sd.get("note"):
                    print(f"{m}: not seeded: {sd['note']}")
    return {
        "attn": attn,
        "auto_steps": mem_run["auto_steps"],
        "modes": {m: {"t": times[m], "t_median": med[m][0], "peak": mem_run["peak"][m],
                      "held": mem_run["held"][m], "run_peak": mem_run["run_peak"][m],
                      "budget": budgets.get(m),
                      "plan": mem_run["variants"].get(m)} for m in modes},
        "dominated": [{"mode": m, "by": o} for m, o in pairs],
    }


def main() -> None:
    ap = parser()
    args = ap.parse_args()
    if args.phase != "all":
        measure(args)
        return
    bad = [m for m in args.modes.split(",") if m not in ALL_MODES]
    if bad:
        ap.error(f"unknown mode {', '.join(bad)}; choose from {', '.join(ALL_MODES)}")
    kinds = ATTENTION_KINDS if args.attn == "both" else (args.attn,)
    results = [run_kind(args, attn) for attn in kinds]
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"model": {"layers": args.layers, "d_model": args.d_model,
                                 "heads": args.heads, "seq": args.seq, "batch": args.batch,
                                 "dtype": "float32"},
                       "steps": args.steps, "allocator": args.allocator, "pool": args.pool,
                       "auto_pool": args.auto_pool, "threads": torch.get_num_threads(),
                       "kinds": results}, f, indent=1)
        print(f"\nwrote {args.json_out}")


if __name__ == "__main__":
    main()
