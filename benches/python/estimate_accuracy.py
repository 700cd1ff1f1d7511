"""How close ``spillover.estimate`` comes to what a step really does on this CPU: device peak,
host RAM and step time, model x mode, predicted and measured in the same run.

For each model: ``spillover.estimate`` (fake tensors) predicts every mode; then every mode runs
for real on CPU tensors, with the same policies, offload tiers (a real ``offload_context``,
swap files in a temp dir), pool sizes and optimizer (torch's AdamW, its state made by a
warm-up step), and is measured:

- device peak: the peak of live tensor storages, from the CPU allocator's own events
  (``torch.profiler`` with ``profile_memory=True``: every allocation and free, kernels' scratch
  included) over the step's start, plus what was alive at the start (parameters, buffers,
  inputs, optimizer state), plus the offload context's whole pool (on a CPU host the pool is
  this memory, faulted in before the step: Note [simulated offload]), plus the NVMe tier's
  own mappings that storages in pieces come back in while they live (not the allocator's);
  beside it, "RSS": the kernel's high-water mark over the step's start (glibc's mmap threshold
  pinned), everything the process maps, allocator slack and scratch outside torch included;
- host RAM: the context's pool capacity (``ctx.stats().pool_capacity``); modes without a
  context hold none ("-");
- step time: forward, backward and ``optimizer.step()``, medians of ``--rounds`` rounds with
  the modes interleaved, the spread (fastest-slowest) beside it. The prediction is made again
  at each round, the step's ops timed anew just before the round's real steps (Note [op times
  on a CPU]: this shared machine's load moves its rates 4x within the hour), and its median is
  compared.

``auto`` runs the plan the estimate made for it (``Planner.use_plan``: the same plan, no
learning step), under a 32 MiB NVMe pool, its budget ``full``'s predicted peak over the step's
start (as recompute_bench.py budgets it at full checkpointing's peak). ``selective`` is measured
at its second step, as predicted (its regions learn on their first call).

    python benches/python/estimate_accuracy.py [--models gpt-explicit,gpt-sdpa,gpt2,llama,
        mistral,qwen2,gemma,bert,t5] [--modes none,full,selective,host,nvme,auto]
        [--rounds 3] [--gpt 6x512] [--json-out PATH] [--plot PATH]

The CPU GPT is recompute_bench.py's (6 layers, d_model 512, 8 heads, seq 1024, batch 4, vocab
8192, fp32; ``--gpt 2x256`` for a quick run); the transformers models are 2-layer configs with
their real vocabularies' size class (32k; BERT 30,522, T5 32,128), d_model 256, seq 256, batch 4.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import tempfile
import time
import warnings
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

import spillover
from spillover._peak import high_water, reset_high_water, rss
from spillover.config import format_size
from spillover.demo import Allocator
from spillover.estimate.fakes import pick_loss
from spillover.estimate.measured import allocator_events, storages_bytes
from spillover.models import GPT, GPTConfig, synthetic_batch

MODES = ("none", "full", "selective", "host", "nvme", "auto")
POOL = 64 << 20
AUTO_POOL = 32 << 20


# ---- the models -------------------------------------------------------------------------------


def gpt(attn: str, size: str) -> Tuple[Callable[[], torch.nn.Module], tuple, dict]:
    layers, d = (int(x) for x in size.split("x"))
    seq, batch = (1024, 4) if size == "6x512" else (256, 4)
    cfg = GPTConfig(vocab=8192, d_model=d, n_heads=max(1, d // 64), n_layers=layers, seq=seq,
                    attn=attn)
    idx, tgt = synthetic_batch(cfg, batch)
    return (lambda: GPT(cfg)), (idx, tgt), {}


def hf(name: str) -> Tuple[Callable[[], torch.nn.Module], tuple, dict]:
    import transformers as T

    common = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4)
    decoders = {
        "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_key_value_heads=2)),
        "mistral": (T.MistralConfig, T.MistralForCausalLM, dict(num_key_value_heads=2)),
        "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, dict(num_key_value_heads=2)),
        "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(num_key_value_heads=2, head_dim=64)),
    }
    ids = torch.randint(0, 30000, (4, 256), generator=torch.Generator().manual_seed(0))
    if name in decoders:
        cfg_cls, cls, extra = decoders[name]
        cfg = cfg_cls(vocab_size=32000, **common, **extra)
        return (lambda: cls(cfg)), (), dict(input_ids=ids, labels=ids)
    if name == "gpt2":
        cfg = T.GPT2Config(vocab_size=32000, n_embd=256, n_layer=2, n_head=4, n_positions=256)
        return (lambda: T.GPT2LMHeadModel(cfg)), (), dict(input_ids=ids, labels=ids)
    if name == "bert":
        cfg = T.BertConfig(vocab_size=30522, **common)
        return (lambda: T.BertForMaskedLM(cfg)), (), dict(input_ids=ids, labels=ids)
    if name == "t5":
        cfg = T.T5Config(vocab_size=32128, d_model=256, d_ff=512, num_layers=2, num_heads=4,
                         d_kv=64, decoder_start_token_id=0, pad_token_id=0)
        return (lambda: T.T5ForConditionalGeneration(cfg)), (), dict(
            input_ids=ids, labels=ids[:, :128].contiguous())
    raise SystemExit(f"unknown model {name!r}")


def build(name: str, gpt_size: str) -> Tuple[Callable[[], torch.nn.Module], tuple, dict]:
    if name.startswith("gpt-"):
        return gpt(name[4:], gpt_size)
    return hf(name)


# ---- one mode, for real -------------------------------------------------------------------------


class Real:
    """One mode of one model on real CPU tensors: the step the estimate predicted."""

    def __init__(self, mode: str, factory: Callable[[], torch.nn.Module], args: tuple,
                 kwargs: dict, swapdir: str, plan: Any, budget: Optional[int]):
        torch.manual_seed(0)
        self.mode = mode
        self.model = factory()
        self.model.train()
        self.args, self.kwargs = args, kwargs
        self.ctx = None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if mode in ("full", "selective"):
                spillover.wrap(self.model, policy=mode)
            elif mode in ("host", "nvme"):
                spillover.wrap(self.model, policy="offload")
                self.ctx = spillover.offload_context(mode, host_pool_bytes=POOL,
                                                     nvme_path=swapdir)
            elif mode == "auto":
                planner = spillover.Planner(budget_bytes=budget)
                planner.use_plan(plan)
                spillover.wrap(self.model, policy=planner)
                self.ctx = spillover.offload_context("nvme", host_pool_bytes=AUTO_POOL,
                                                     nvme_path=swapdir)
        self.opt = torch.optim.AdamW(self.model.parameters())
        self.mapped: List[Tuple[int, int]] = []  # (ns, +/- bytes) of the tier's own buffers
        if self.ctx is not None:
            self._watch_mappings()

    def _watch_mappings(self) -> None:
        """A storage in pieces comes back on a CPU host in a mapping of the tier's own (Note
        [gathered storages] in rust/tier/gather.rs), not from torch's allocator, whose events
        miss it: its bytes are added to the measured series while the tensor lives."""
        ctx, events = self.ctx, self.mapped
        bring_back = ctx._bring_back

        def watched(tr: Any, s: Any, packed: Any) -> torch.Tensor:
            raw = bring_back(tr, s, packed)
            if s.chunked and not ctx._in_pool(raw.data_ptr()):
                n = raw.untyped_storage().nbytes()
                events.append((time.time_ns(), n))
                weakref.finalize(raw.untyped_storage(), lambda: events.append(
                    (time.time_ns(), -n)))
            return raw

        ctx._bring_back = watched

    def step(self) -> None:
        with self.ctx if self.ctx is not None else contextlib.nullcontext():
            out = self.model(*self.args, **self.kwargs)
            loss = pick_loss(out)
        del out
        loss.backward()
        del loss
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def start_bytes(self) -> int:
        ts = list(self.model.parameters()) + list(self.model.buffers()) + list(self.args)
        ts += list(self.kwargs.values())
        ts += [v for s in self.opt.state.values() for v in s.values()]
        return storages_bytes(ts)

    def pool(self) -> int:
        return self.ctx.stats().pool_capacity if self.ctx is not None else 0

    def measure_memory(self) -> Tuple[int, List[Tuple[float, int]]]:
        """The peak of live storages (with what the step started with and the pool), and the
        live bytes over the step (seconds, bytes)."""
        gc.collect()
        start = self.start_bytes() + self.pool()
        t0 = time.perf_counter_ns()

        def step() -> None:
            nonlocal t0
            t0 = time.perf_counter_ns()
            self.mapped.clear()
            self.step()

        # the profiler stamps its events with the wall clock, in ns (time.time_ns)
        evs = sorted(allocator_events(step) + list(self.mapped))
        cur = peak = 0
        series = []
        first = evs[0][0] if evs else t0
        for ns, n in evs:
            cur += n
            peak = max(peak, cur)
            series.append(((ns - first) / 1e9, start + cur))
        return start + peak, series

    def measure_rss(self, alloc: Allocator) -> int:
        """The step's peak as the kernel sees it: the RSS high-water mark over the step's start
        (glibc's mmap threshold pinned, so freed tensors leave RSS at once), plus what was
        alive at the start and the pool, as recompute_bench.py measures it. Unlike the
        allocator's events it sees memory the offload tier maps itself (a storage in pieces
        read back into a buffer of its own)."""
        gc.collect()
        alloc.for_memory(True)
        try:
            start = self.start_bytes() + self.pool()
            before = rss()
            reset_high_water()
            self.step()
            return start + high_water() - before
        finally:
            alloc.for_memory(False)


# ---- the table ----------------------------------------------------------------------------------


def err(pred: float, meas: float) -> str:
    if not meas:
        return "-"
    return f"{100 * (pred - meas) / meas:+.1f}%"


def run_model(name: str, args: argparse.Namespace, swapdir: str) -> List[Dict[str, Any]]:
    factory, a, kw = build(name, args.gpt)
    modes = [m for m in args.modes.split(",")]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t0 = time.perf_counter()
        est = spillover.estimate(factory(), *a, device="cpu", host_pool_bytes=POOL,
                                 modes=[m for m in modes if m != "auto"] or ["none"], **kw)
        budget = None
        if "auto" in modes:
            full = est["full"] if "full" in est.modes else spillover.estimate(
                factory(), *a, modes=["full"], **kw)["full"]
            start = full.trace.base if full.trace is not None else 0
            budget = full.device_peak_bytes - start
            auto = spillover.estimate(factory(), *a, device="cpu", modes=["auto"],
                                      host_pool_bytes=AUTO_POOL, budget=budget, **kw)
            est.modes["auto"] = auto["auto"]
        est_seconds = time.perf_counter() - t0
    print(f"\n### {name}: estimated every mode in {est_seconds:.1f} s", flush=True)
    reals = {m: Real(m, factory, a, kw, swapdir, est["auto"].plan if m == "auto" else None,
                     budget) for m in modes}
    rows: Dict[str, Dict[str, Any]] = {}
    alloc = Allocator()
    for m, r in reals.items():
        r.step()  # warm-up: optimizer state, pool, swap files; selective learns
        peak, series = r.measure_memory()
        rows[m] = {"model": name, "mode": m, "peak": peak, "rss_peak": r.measure_rss(alloc),
                   "host": r.pool(), "times": [], "series": series}
    from spillover.estimate.modes import _TIMER

    for _ in range(args.rounds):
        # Note [op times on a CPU]: the machine's load moves its rates; each round re-times the
        # step's ops and predicts again, then runs every mode for real
        _TIMER.refresh()
        for m in modes:
            rows[m].setdefault("pred_times", []).append(est._runner.retime(est[m]))
        for m, r in reals.items():
            gc.collect()
            t0 = time.perf_counter()
            r.step()
            rows[m]["times"].append(time.perf_counter() - t0)
    out = []
    for m in modes:
        e, row = est[m], rows[m]
        t = statistics.median(row["times"])
        pt = statistics.median(row["pred_times"])
        row.update(pred_peak=e.device_peak_bytes, pred_host=e.host_bytes,
                   pred_seconds=pt, seconds=t, spread=(min(row["times"]),
                                                                   max(row["times"])),
                   peak_err=(e.device_peak_bytes - row["peak"]) / row["peak"],
                   host_err=((e.host_bytes - row["host"]) / row["host"]) if row["host"]
                   else None, time_err=(pt - t) / t,
                   pred_series=e.timeline, marks=e.marks, note=e.note)
        print(f"{name:<13} {m:<9} peak {format_size(e.device_peak_bytes):>10} vs "
              f"{format_size(row['peak']):>10} {err(e.device_peak_bytes, row['peak']):>7} "
              f"(RSS {format_size(row['rss_peak'])} {err(e.device_peak_bytes, row['rss_peak'])})  "
              f"host {format_size(e.host_bytes) if e.host_bytes else '-':>9} vs "
              f"{format_size(row['host']) if row['host'] else '-':>9} "
              f"{err(e.host_bytes, row['host']):>7}  time {pt:6.3f} vs {t:6.3f} s "
              f"({row['spread'][0]:.3f}-{row['spread'][1]:.3f}) "
              f"{err(pt, t):>7}  {e.note}", flush=True)
        out.append(row)
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models",
                    default="gpt-explicit,gpt-sdpa,gpt2,llama,mistral,qwen2,gemma,bert,t5")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpt", default="6x512", help="layers x d_model of the CPU GPT")
    ap.add_argument("--json-out", help="write every measurement here")
    ap.add_argument("--plot", help="PNG: predicted beside measured, one panel per mode, for "
                                   "the first model")
    args = ap.parse_args(argv)
    swapdir = tempfile.mkdtemp(prefix="spillover-estimate-accuracy-")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; modes {args.modes}")
    rows: List[Dict[str, Any]] = []
    for name in args.models.split(","):
        rows += run_model(name, args, swapdir)
    print("\n| model | mode | device peak: predicted / measured (error) | host RAM: predicted "
          "/ measured (error) | step s: predicted / measured median, spread (error) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        host = (f"{format_size(r['pred_host'])} / {format_size(r['host'])} "
                f"({err(r['pred_host'], r['host'])})" if r["host"] else "-")
        print(f"| {r['model']} | {r['mode']} | {format_size(r['pred_peak'])} / "
              f"{format_size(r['peak'])} ({err(r['pred_peak'], r['peak'])}) | {host} | "
              f"{r['pred_seconds']:.3f} / {r['seconds']:.3f}, {r['spread'][0]:.3f}-"
              f"{r['spread'][1]:.3f} ({err(r['pred_seconds'], r['seconds'])}) |")
    worst = max(rows, key=lambda r: abs(r["peak_err"]))
    hosts = [r for r in rows if r["host_err"] is not None]
    print(f"\nworst device peak error {100 * worst['peak_err']:+.1f}% ({worst['model']} "
          f"{worst['mode']}); within 5 %: {sum(abs(r['peak_err']) <= 0.05 for r in rows)}/"
          f"{len(rows)}")
    if hosts:
        print(f"host RAM within 10 %: {sum(abs(r['host_err']) <= 0.10 for r in hosts)}/"
              f"{len(hosts)}")
    print(f"step time within 25 %: {sum(abs(r['time_err']) <= 0.25 for r in rows)}/{len(rows)}")
    if args.plot and rows:
        from spillover.estimate.plot import timeline_panels

        first = rows[0]["model"]
        panels = [(r["mode"], {"predicted": r["pred_series"], "measured": r["series"]},
                   r["marks"]) for r in rows if r["model"] == first]
        timeline_panels(args.plot, f"{first}: predicted (fake tensors) and measured (CPU "
                        "allocator) device memory per mode", panels)
        print(f"wrote {args.plot}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([{k: v for k, v in r.items() if k not in ("series", "pred_series")}
                       for r in rows], f, indent=1)
        print(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
