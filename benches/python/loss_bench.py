"""The loss region on CPU: a HF LlamaForCausalLM (4 layers, d 256, vocab 32768, 2 × 1024
tokens, fp32) trained as users call it, ``model(input_ids, labels=...)``, per mode: the peak
of the whole step (forward + backward) and the median step time.

- memory: a child process per mode with glibc's mmap threshold pinned at 64 KiB
  (MALLOC_MMAP_THRESHOLD_, as recompute_bench.py's memory phase), so freed tensors leave RSS at
  once; one warm-up step, then peak = VmHWM over the measured step (reset through
  /proc/self/clear_refs before it) - RSS before it. Parameter gradients are set to None before
  each step, so every mode's peak includes allocating them.
- time: a fresh child per mode and round, glibc's allocator as users have it; a warm-up step,
  then --inner timed steps (their median); modes interleaved round by round (--rounds), the
  median over rounds with the spread.

    python benches/python/loss_bench.py [--rounds 2 --inner 2] [--layers 4 --d-model 256
        --vocab 32768 --batch 2 --seq 1024] [--modes none,hf-ckpt,wrap-full,wrap-full-plain]

    smoke test: python benches/python/loss_bench.py --layers 1 --d-model 64 --vocab 4096 \
        --seq 128 --rounds 1 --inner 1

Modes:
  none             the plain model
  hf-ckpt          HF's own gradient checkpointing (gradient_checkpointing_enable, non-reentrant)
  wrap-full        spillover.wrap(model, policy="full"): its chunked loss region on (default)
  wrap-full-plain  spillover.wrap(model, policy="full", chunked_loss=False): HF's head and loss
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

MODES = ("none", "hf-ckpt", "wrap-full", "wrap-full-plain")


def build(args, mode):
    import torch
    import transformers

    import spillover

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.d_model, intermediate_size=4 * args.d_model,
        num_hidden_layers=args.layers, num_attention_heads=max(1, args.d_model // 32),
        num_key_value_heads=max(1, args.d_model // 32), max_position_embeddings=args.seq,
        use_cache=False)
    model = transformers.LlamaForCausalLM(cfg).train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if mode == "hf-ckpt":
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        elif mode == "wrap-full":
            spillover.wrap(model, policy="full")
        elif mode == "wrap-full-plain":
            spillover.wrap(model, policy="full", chunked_loss=False)
        elif mode != "none":
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return model, ids


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return float(out.loss.detach())


def child(args):
    from spillover._peak import high_water, reset_high_water, rss

    model, ids = build(args, args.child)
    loss = step(model, ids)  # warm-up: lazy inits, first allocations
    res = {"mode": args.child, "loss": loss}
    if args.phase == "mem":
        model.zero_grad(set_to_none=True)
        base = rss()
        reset_high_water()
        step(model, ids)
        res["peak"] = high_water() - base
    else:
        times = []
        for _ in range(args.inner):
            t = time.perf_counter()
            step(model, ids)
            times.append(time.perf_counter() - t)
        res["time"] = statistics.median(times)
    with open(args.json, "w") as f:
        json.dump(res, f)


def run_child(args, mode, phase):
    env = dict(os.environ)
    if phase == "mem":
        env["MALLOC_MMAP_THRESHOLD_"] = str(1 << 16)
    else:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    with tempfile.NamedTemporaryFile(suffix=".json") as jf:
        cmd = [sys.executable, __file__, "--child", mode, "--phase", phase, "--json", jf.name,
               "--layers", str(args.layers), "--d-model", str(args.d_model),
               "--vocab", str(args.vocab), "--batch", str(args.batch), "--seq", str(args.seq),
               "--inner", str(args.inner)]
        subprocess.run(cmd, check=True, env=env)
        with open(jf.name) as f:
            return json.load(f)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--inner", type=int, default=2)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("mem", "time"), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    t0 = time.perf_counter()
    mem = {m: run_child(args, m, "mem") for m in modes}
    times = {m: [] for m in modes}
    for _ in range(args.rounds):
        for m in modes:  # interleaved: a slow spell of the machine hits every mode
            times[m].append(run_child(args, m, "time")["time"])
    print(f"LlamaForCausalLM {args.layers} layers, d {args.d_model}, vocab {args.vocab}, "
          f"{args.batch} x {args.seq} tokens, fp32, CPU; {args.rounds} rounds x {args.inner} "
          "steps")
    ref_peak = mem[modes[0]]["peak"]
    ref_time = statistics.median(times[modes[0]])
    print(f"{'mode':<17}{'peak MB':>9}{'x ' + modes[0]:>9}{'step s':>9}{'spread':>14}"
          f"{'x ' + modes[0]:>9}{'loss':>10}")
    for m in modes:
        pk, ts = mem[m]["peak"], times[m]
        med = statistics.median(ts)
        print(f"{m:<17}{pk / 1e6:>9.0f}{pk / ref_peak:>9.2f}{med:>9.2f}"
              f"{f'{min(ts):.2f}-{max(ts):.2f}':>14}{med / ref_time:>9.2f}"
              f"{mem[m]['loss']:>10.5f}")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
