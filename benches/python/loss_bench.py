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
        --vocab 32768 --batch 2 --seq 1024] [--modes none,hf-ckpt,hf-ckpt-cl,wrap-full,...]
    python benches/python/loss_bench.py --families   # which HF causal LMs get the region

    smoke test: python benches/python/loss_bench.py --layers 1 --d-model 64 --vocab 4096 \
        --seq 128 --rounds 1 --inner 1

Modes:
  none             the plain model
  hf-ckpt          HF's own gradient checkpointing (gradient_checkpointing_enable, non-reentrant)
  hf-ckpt-cl       hf-ckpt with the head and loss by torch's chunked linear_cross_entropy,
                   called by hand on the decoder's hidden states (HF's label shift), at the
                   same rows per chunk as spillover's (Note [loss chunks]): the best a user
                   assembles from torch and transformers alone
  wrap-full        spillover.wrap(model, policy="full"): its chunked loss region on (default):
                   torch's linear_cross_entropy where this torch has it (2.13+), else
                   spillover's own chunks (the "loss path" column says which ran)
  wrap-full-own    wrap-full with torch's linear_cross_entropy hidden: spillover's own chunks
                   (spillover/loss/fused.py), what every torch below 2.13 runs
  wrap-full-plain  spillover.wrap(model, policy="full", chunked_loss=False): HF's head and loss
  wrap-full-nvme   wrap-full, each step under offload_context("nvme", host_pool_bytes=64 MiB)
                   (the pool counts in the peak: on a CPU host it is this RAM)
  trainer          transformers.Trainer (AdamW, --inner + 1 steps, batch --batch) over the
                   model under spillover.integrations.hf.enable(policy="full") with
                   SpilloverCallback(tier="nvme", 64 MiB pool): peak over the whole
                   train() (optimizer state included), time = median step after the first
  trainer-plain    the same with hf.enable(..., chunked_loss=False): HF's head and loss
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

MODES = ("none", "hf-ckpt", "hf-ckpt-cl", "wrap-full", "wrap-full-own", "wrap-full-plain",
         "wrap-full-nvme", "trainer", "trainer-plain")
POOL = "64MiB"


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
        if mode in ("hf-ckpt", "hf-ckpt-cl"):
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        elif mode in ("wrap-full", "wrap-full-own", "wrap-full-nvme"):
            spillover.wrap(model, policy="full")
        elif mode == "wrap-full-plain":
            spillover.wrap(model, policy="full", chunked_loss=False)
        elif mode in ("trainer", "trainer-plain"):
            from spillover.integrations import hf

            hf.enable(model, policy="full", chunked_loss=mode == "trainer")
        elif mode != "none":
            raise SystemExit(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    return model, ids


def step(model, ids, mode, swap=None):
    import torch
    from torch import nn
    from torch.nn import functional as F

    import spillover
    from spillover.loss import chunk_rows

    model.zero_grad(set_to_none=True)
    if mode == "hf-ckpt-cl":
        h = model.model(input_ids=ids).last_hidden_state
        w = model.lm_head.weight
        opts = nn.LinearCrossEntropyOptions(batch_chunk_size=chunk_rows(w.shape[0]),
                                            chunking_method=None)
        loss = F.linear_cross_entropy(h[:, :-1].reshape(-1, h.shape[-1]), w,
                                      ids[:, 1:].reshape(-1), options=opts)
    elif mode == "wrap-full-nvme":
        with spillover.offload_context("nvme", host_pool_bytes=POOL, nvme_path=swap):
            loss = model(input_ids=ids, labels=ids).loss
    else:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(torch.as_tensor(loss).detach())


def train(args, model, ids, swap, steps):
    """transformers.Trainer over ``steps`` steps with SpilloverCallback; the step times."""
    import time as _time

    import transformers

    from spillover.integrations.hf import SpilloverCallback

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.times, self.t = [], 0.0

        def on_step_begin(self, *a, **k):
            self.t = _time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(_time.perf_counter() - self.t)

    data = [{"input_ids": row, "labels": row} for row in ids] * steps
    clock = Clock()
    targs = transformers.TrainingArguments(
        output_dir=swap, max_steps=steps, per_device_train_batch_size=ids.shape[0],
        learning_rate=1e-4, report_to=[], save_strategy="no", logging_strategy="no",
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True)
    cb = SpilloverCallback(tier="nvme", host_pool_bytes=POOL, nvme_path=swap)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=data,
                                   callbacks=[cb, clock])
    trainer.train()
    return clock.times


def child(args):
    from spillover._peak import high_water, reset_high_water, rss

    mode = args.child
    if mode.endswith("-own"):  # a torch without linear_cross_entropy, as below 2.13
        from torch.nn import functional as F

        if hasattr(F, "linear_cross_entropy"):  # below 2.13 it is already so
            del F.linear_cross_entropy
    model, ids = build(args, mode)
    swap = tempfile.mkdtemp(prefix="spillover-loss-bench-")
    if mode.startswith("trainer"):
        # the whole train(): model built, optimizer state and the NVMe pool made inside it
        base = rss()
        reset_high_water()
        times = train(args, model, ids, swap, args.inner + 1)
        res = {"mode": mode, "loss": float("nan"), "time": statistics.median(times[1:]),
               "path": path_ran(mode)}
        if args.phase == "mem":
            res["peak"] = high_water() - base
        with open(args.json, "w") as f:
            json.dump(res, f)
        return
    loss = step(model, ids, mode, swap)  # warm-up: lazy inits, first allocations
    res = {"mode": mode, "loss": loss, "path": path_ran(mode)}
    if args.phase == "mem":
        model.zero_grad(set_to_none=True)
        base = rss()
        reset_high_water()
        step(model, ids, mode, swap)
        res["peak"] = high_water() - base
        if mode == "wrap-full-nvme":
            res["peak"] += spillover_pool_bytes()  # pre-faulted RAM, charged in full
    else:
        times = []
        for _ in range(args.inner):
            t = time.perf_counter()
            step(model, ids, mode, swap)
            times.append(time.perf_counter() - t)
        res["time"] = statistics.median(times)
    with open(args.json, "w") as f:
        json.dump(res, f)


def path_ran(mode):
    """Which loss path the steps so far ran (spillover.loss.paths_run): torch's op, spillover's
    chunks, or plain (HF's head and loss; hf-ckpt-cl calls torch's op by hand)."""
    from spillover import loss

    if mode == "hf-ckpt-cl":
        return "torch op (by hand)"
    ran = [("torch op" if name == loss.TORCH else "own chunks")
           for name, n in loss.paths_run().items() if n]
    return "+".join(ran) or "plain"


def families():
    """The transformers causal LMs the loss region takes over, read from their forward's source
    (Note [which HF models]); the config-dependent checks (a quantized or adapted head, a custom
    loss function) are left to the model in hand."""
    import importlib

    import torch
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from spillover import loss
    from spillover.loss.regions import _forward_reason

    names = sorted({n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
                    for n in (v if isinstance(v, (list, tuple)) else [v])})
    plain, transformed, left = [], [], []
    for name in names:
        try:
            cls = getattr(transformers, name)
        except (AttributeError, ImportError, RuntimeError) as e:
            try:
                cls = getattr(importlib.import_module("transformers"), name)
            except Exception:  # noqa: BLE001 - a family that does not import here is listed
                left.append(f"{name} (does not import: {type(e).__name__})")
                continue
        why, kind = _forward_reason(cls)
        if why:
            left.append(f"{name} ({why})")
        elif kind:
            transformed.append(f"{name} ({kind})")
        else:
            plain.append(name)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}: "
          f"{len(names)} causal LM classes")
    print(f"plain head, {loss.backend()} ({len(plain)}): {', '.join(plain)}")
    print(f"logit transform, {loss.OWN} ({len(transformed)}): {', '.join(transformed)}")
    print(f"left to the model ({len(left)}):")
    for line in left:
        print(f"  {line}")


def spillover_pool_bytes():
    """The NVMe context's pool: made when the first context opened (in the warm-up step, before
    the measured step's baseline) and kept for the process, so RSS growth misses it."""
    from spillover.config import parse_size

    return parse_size(POOL)


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
    p.add_argument("--families", action="store_true",
                   help="list the HF causal LMs the loss region takes over, and exit")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--phase", choices=("mem", "time"), help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.families:
        return families()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise SystemExit(f"unknown mode {m!r}; choose from {', '.join(MODES)}")
    from spillover.loss import available

    if not available() and "hf-ckpt-cl" in modes:
        print("hf-ckpt-cl left out: this torch has no linear_cross_entropy (2.13+)")
        modes.remove("hf-ckpt-cl")
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
    import torch
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    print(f"{'mode':<17}{'peak MB':>9}{'x ' + modes[0]:>9}{'step s':>9}{'spread':>14}"
          f"{'x ' + modes[0]:>9}{'loss':>10}  loss path")
    for m in modes:
        pk, ts = mem[m]["peak"], times[m]
        med = statistics.median(ts)
        print(f"{m:<17}{pk / 1e6:>9.0f}{pk / ref_peak:>9.2f}{med:>9.2f}"
              f"{f'{min(ts):.2f}-{max(ts):.2f}':>14}{med / ref_time:>9.2f}"
              f"{mem[m]['loss']:>10.5f}  {mem[m].get('path', '')}")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
