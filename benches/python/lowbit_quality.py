"""Training quality of OffloadAdamW's low-bit state (issue 36): a small GPT trained on real text
with fp32 AdamW and with each low-bit setting, the validation losses compared.

    python benches/python/lowbit_quality.py [--steps 500] [--batch 4] [--seq 128]
                                            [--d-model 320] [--layers 8] [--out DIR]
                                            [--only NAME,...] [--report]

Data: the Python standard library's own sources (``*.py`` under ``sysconfig``'s stdlib path),
read as bytes (a 256-symbol vocabulary); every 20th file (sorted by path) is validation, the
rest training. Model: ``spillover.models.GPT`` (SDPA attention; ~10M parameters with the
defaults). Every run starts from the same weights and sees the same batches: linear warmup
over the first 10 % of the steps, then cosine decay to 10 % of the peak learning rate;
gradients clipped to norm 1.0; AdamW(lr 2e-3, betas (0.9, 0.95), weight decay 0.1).

Runs (``--only`` picks some; each run's curve is saved to ``DIR/NAME.json`` as it finishes,
so a later call with ``--report`` or with the remaining ``--only`` names completes the table):

- ``fp32``: ``torch.optim.AdamW(fused=True)`` on fp32 parameters, the reference;
- ``bits16``: ``OffloadAdamW(state_bits=16)`` (bf16 moments, stochastic rounding);
- ``bits8``: ``OffloadAdamW(state_bits=8)`` (block-wise 8-bit moments);
- ``bits8-nomaster``: ``OffloadAdamW(state_bits=8, master_weights=False)`` on bf16
  parameters (the model computes in bf16), about 2 bytes of state per parameter;
- ``delayed``: ``OffloadAdamW(overlap="delayed")`` (issue 41: fp32 state, the one-step delayed
  update, Note [delayed update] in spillover/optim/delayed.py, with its default weight
  prediction, Note [next-gradient prediction] in rust/optim/predict.rs). Its validations run on the
  parameters the training's forward sees, the last one after ``opt.flush()`` (the model with
  every update). The exact default is bitwise equal to ``fp32`` (tests/python/test_optim.py),
  so ``fp32`` is the exact update's curve too;
- ``delayed-after50``: the same with ``delay_after=50`` (the first 50 steps exact: the
  learning rate's warm-up here);
- ``delayed-momentum``: ``overlap="delayed", predict_weights="momentum"``: the momentum taken
  for the next gradient (Note [weight prediction]; the default until 2026-12-06);
- ``delayed-plain``: ``overlap="delayed", predict_weights=False``: the plain delayed update
  (the device's parameters one update behind).

``--seed N`` (default 0) starts the model from another initialization and draws other training
batches (the validation batches stay the same); its curves go to ``DIR/NAME-seedN.json``, and
the report adds, per run, the mean over the seeds found of the final loss against fp32's of
the same seeds: one run's final loss moves by about 1 % with the seed alone.

torchao's and bitsandbytes' 8-bit AdamW are not installed here (and run on CUDA), so they
have no column. The table gives each run's final validation loss (mean over ``--val-batches``
fixed batches) and its ratio to fp32's, against the issues' bars (16-bit within 1 %, 8-bit
within 2 %, no master within 3 %; issue 41: delayed within 1 %); ``DIR/lowbit_quality.png``
plots the curves side by side.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sysconfig
import time
from typing import Any, Dict, List, Tuple

import torch

import spillover
from spillover.models import GPT, GPTConfig

RUNS = ("fp32", "bits16", "bits8", "bits8-nomaster", "delayed", "delayed-after50",
        "delayed-momentum", "delayed-plain")
BARS = {"bits16": 0.01, "bits8": 0.02, "bits8-nomaster": 0.03, "delayed": 0.01,
        "delayed-after50": 0.01, "delayed-momentum": 0.01, "delayed-plain": 0.01}
LABELS = {
    "fp32": "torch AdamW fused, fp32 state",
    "bits16": "OffloadAdamW state_bits=16",
    "bits8": "OffloadAdamW state_bits=8",
    "bits8-nomaster": "OffloadAdamW state_bits=8, master_weights=False (bf16 params)",
    "delayed": "OffloadAdamW overlap=\"delayed\" (fp32 state, next-gradient prediction)",
    "delayed-after50": "OffloadAdamW overlap=\"delayed\", delay_after=50",
    "delayed-momentum": "OffloadAdamW overlap=\"delayed\", predict_weights=\"momentum\"",
    "delayed-plain": "OffloadAdamW overlap=\"delayed\", predict_weights=False",
}


def corpus(max_bytes: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, val) byte tensors from the standard library's sources (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    files = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in ("site-packages", "__pycache__", "test"))
        files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".py")]
    files.sort()
    train, val = bytearray(), bytearray()
    for i, f in enumerate(files):
        with open(f, "rb") as fh:
            data = fh.read()
        (val if i % 20 == 0 else train).extend(data)
        if len(train) + len(val) >= max_bytes:
            break
    return (torch.frombuffer(train, dtype=torch.uint8).to(torch.long),
            torch.frombuffer(val, dtype=torch.uint8).to(torch.long))


def batch(data: torch.Tensor, n: int, seq: int, g: torch.Generator) -> Tuple[torch.Tensor, ...]:
    at = torch.randint(0, data.numel() - seq - 1, (n,), generator=g)
    x = torch.stack([data[a : a + seq] for a in at.tolist()])
    y = torch.stack([data[a + 1 : a + seq + 1] for a in at.tolist()])
    return x, y


def lr_at(step: int, steps: int, peak: float) -> float:
    warm = max(1, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(1, steps - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


@torch.no_grad()
def val_loss(model: GPT, val: torch.Tensor, args: Any) -> float:
    g = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(args.val_batches):
        x, y = batch(val, args.batch, args.seq, g)
        losses.append(model(x, y).float().item())
    return sum(losses) / len(losses)


def run(name: str, args: Any, train: torch.Tensor, val: torch.Tensor) -> Dict[str, Any]:
    cfg = GPTConfig(vocab=256, d_model=args.d_model, n_heads=args.d_model // 64,
                    n_layers=args.layers, seq=args.seq, attn="sdpa")
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    if name == "bits8-nomaster":
        model = model.to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    hyper = dict(lr=args.lr, betas=(0.9, 0.95))
    if name == "fp32":
        opt: Any = torch.optim.AdamW(groups, fused=True, **hyper)
    elif name.startswith("delayed"):
        after = 50 if name == "delayed-after50" else 0
        opt = spillover.OffloadAdamW(groups, overlap="delayed", delay_after=after,
                                     predict_weights={"delayed-plain": False,
                                                      "delayed-momentum": "momentum"}.get(name),
                                     **hyper)
    else:
        bits = 16 if name == "bits16" else 8
        opt = spillover.OffloadAdamW(groups, state_bits=bits,
                                     master_weights=name != "bits8-nomaster", **hyper)
    g = torch.Generator().manual_seed(42 + args.seed)
    curve: List[Tuple[int, float]] = []
    vals: List[Tuple[int, float]] = []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for pg in opt.param_groups:
            pg["lr"] = lr_at(step, args.steps, args.lr)
        x, y = batch(train, args.batch, args.seq, g)
        loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        curve.append((step, loss.float().item()))
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            if step + 1 == args.steps and name.startswith("delayed"):
                opt.flush()  # the last update reaches the model (Note [delayed update])
            vals.append((step + 1, val_loss(model, val, args)))
            print(f"  {name} step {step + 1}: train {curve[-1][1]:.4f} val {vals[-1][1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    out = dict(name=name, label=LABELS[name], seed=args.seed, params=n_params, train=curve,
               val=vals,
               final_val=vals[-1][1], seconds=time.perf_counter() - t0)
    if name != "fp32":
        out["state_bytes_per_param"] = opt.stats()["state_bytes"] / n_params
    return out


def _suffix(seed: int) -> str:
    return f"-seed{seed}" if seed else ""


def _over_seeds(out: str) -> None:
    """Per run, the mean over the seeds (0 and every ``-seedN`` file) of its final loss
    against fp32's final loss of the same seed."""
    found: Dict[str, Dict[int, float]] = {}
    for fn in sorted(os.listdir(out)):
        if not fn.endswith(".json"):
            continue
        stem = fn[:-5]
        name, _, seed = stem.partition("-seed")
        if name not in RUNS or (seed and not seed.isdigit()):
            continue
        with open(os.path.join(out, fn)) as f:
            found.setdefault(name, {})[int(seed or 0)] = json.load(f)["final_val"]
    ref = found.get("fp32", {})
    if len(ref) < 2:
        return
    print(f"\n### Over seeds ({len(ref)} fp32 runs): final val loss against fp32 of the same "
          "seed\n")
    print("| run | seeds | each | mean | bar | met |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, by_seed in found.items():
        seeds = sorted(s for s in by_seed if s in ref)
        if not seeds:
            continue
        rel = [by_seed[s] / ref[s] - 1 for s in seeds]
        mean = sum(rel) / len(rel)
        bar = BARS.get(name)
        met = "" if bar is None else ("yes" if mean <= bar else "NO")
        print(f"| {LABELS[name]} | {', '.join(map(str, seeds))} | "
              f"{', '.join(f'{r * 100:+.2f} %' for r in rel)} | {mean * 100:+.2f} % | "
              f"{'' if bar is None else f'<= {bar * 100:.0f} %'} | {met} |")


def report(args: Any) -> None:
    res = {}
    for name in RUNS:
        path = os.path.join(args.out, f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                res[name] = json.load(f)
    if "fp32" not in res:
        print("no fp32 run yet: nothing to compare against")
        return
    ref = res["fp32"]["final_val"]
    _over_seeds(args.out)
    print(f"\n### {res['fp32']['params'] / 1e6:.1f}M-parameter GPT, {args.steps} steps, "
          f"Python stdlib sources (bytes)\n")
    print("| run | final val loss | vs fp32 | bar | met | state bytes/param | seconds |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in res.items():
        rel = r["final_val"] / ref - 1
        bar = BARS.get(name)
        met = "" if bar is None else ("yes" if rel <= bar else "NO")
        per = r.get("state_bytes_per_param")
        print(f"| {r['label']} | {r['final_val']:.4f} | {rel * 100:+.2f} % | "
              f"{'' if bar is None else f'<= {bar * 100:.0f} %'} | {met} | "
              f"{'' if per is None else f'{per:.2f}'} | {r['seconds']:.0f} |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no plot)")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in res.values():
        steps, losses = zip(*r["train"])
        k = 20  # running mean, for legibility
        smooth = [sum(losses[max(0, i - k + 1) : i + 1]) / (i + 1 - max(0, i - k + 1))
                  for i in range(len(losses))]
        ax1.plot(steps, smooth, label=r["label"])
        vs, vl = zip(*r["val"])
        ax2.plot(vs, vl, marker="o", label=r["label"])
    ax1.set(title="training loss (running mean of 20 steps)", xlabel="step", ylabel="loss")
    ax2.set(title="validation loss", xlabel="step", ylabel="loss")
    ax1.legend(fontsize=8)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    png = os.path.join(args.out, "lowbit_quality.png")
    fig.savefig(png, dpi=120)
    print(f"\nplot: {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=320)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--val-every", type=int, default=100)
    ap.add_argument("--val-batches", type=int, default=32)
    ap.add_argument("--max-bytes", type=int, default=32 << 20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benches/results/lowbit-quality")
    ap.add_argument("--only", default=",".join(RUNS))
    ap.add_argument("--report", action="store_true", help="only print the table and plot")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if not args.report:
        train, val = corpus(args.max_bytes)
        print(f"corpus: {train.numel() / 1e6:.1f} MB train, {val.numel() / 1e6:.1f} MB val; "
              f"torch {torch.__version__}, {torch.get_num_threads()} threads")
        for name in args.only.split(","):
            if name not in RUNS:
                raise SystemExit(f"--only: unknown run {name!r}; choose from {', '.join(RUNS)}")
            r = run(name, args, train, val)
            with open(os.path.join(args.out, f"{name}{_suffix(args.seed)}.json"), "w") as f:
                json.dump(r, f)
    report(args)


if __name__ == "__main__":
    main()
