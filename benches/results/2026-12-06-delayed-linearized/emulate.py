"""An experiment, not the shipped optimizer: a synchronous torch emulation of
``OffloadAdamW(overlap="delayed")`` with weight prediction (Note [weight prediction] in
rust/optim/predict.rs), on ``benches/python/lowbit_quality.py``'s model, data, schedule and
clipping, and two changes to it (README.md beside this file):

- ``--lam L``: a delay-compensation term on the gradient before the update (DC-ASGD-a, Zheng et
  al. 2017): ``g + L * g * g / (sqrt(v_hat) + eps) * (master - params the gradient was taken at)``;
- ``--lin``: the prediction linearized in the next gradient. The host ships, besides the
  parameters predicted with the next gradient's term left out (``p*decay - lr*beta1/bc1 * m /
  den``), the per-element coefficient ``c = lr*(1-beta1)/bc1 / den`` of that term; at the next
  ``step()`` the parameters become ``pred - c * g``, with ``g`` that step's (clipped) gradient,
  which is on the device then: the exact update but for ``v``'s own change.

The emulation's delay is the real one: the parameters a step's gradient is taken at are those
the previous ``step()`` set. Its plain prediction reproduces the shipped mode's final loss on
seed 0 (2.3607 against OffloadAdamW's 2.3595).

    OMP_NUM_THREADS=1 python emulate.py [--lin] [--lam L] --seed N --out DIR
"""
import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import lowbit_quality as LQ  # noqa: E402

from spillover.models import GPT, GPTConfig  # noqa: E402


class DelayedSim:
    """The delayed update with prediction, synchronously: ``step()`` t sets the parameters the
    previous step's update predicted (the copy back), then computes step t's update."""

    def __init__(self, groups, lr, betas, eps=1e-8, lam=0.0, lin=False, nextv=False):
        self.param_groups = [dict(g, lr=lr) for g in groups]
        self.b1, self.b2 = betas
        self.eps, self.lam, self.lin, self.nextv = eps, lam, lin or nextv, nextv
        self.st = {}
        self.t = 0
        self.pending = None

    def zero_grad(self, set_to_none=True):
        for g in self.param_groups:
            for p in g["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self):
        self.t += 1
        t, b1, b2, eps = self.t, self.b1, self.b2, self.eps
        grads = {p: p.grad for g in self.param_groups for p in g["params"] if p.grad is not None}
        pend = {}
        for g in self.param_groups:
            lr, wd = g["lr"], g.get("weight_decay", 0.0)
            for p in g["params"]:
                if p.grad is None:
                    continue
                s = self.st.get(p)
                if s is None:
                    s = self.st[p] = dict(M=p.detach().clone(), m=torch.zeros_like(p),
                                          v=torch.zeros_like(p))
                grad, big, m, v = p.grad, s["M"], s["m"], s["v"]
                if self.lam and t > 1:  # taken at p, applied at the master
                    den = (v / (1 - b2 ** (t - 1))).sqrt().add_(eps)
                    grad = grad + self.lam * grad * grad / den * (big - p)
                big.mul_(1 - lr * wd)
                m.mul_(b1).add_(grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
                bc1, bc2 = 1 - b1 ** t, 1 - b2 ** t
                big.addcdiv_(m, (v / bc2).sqrt().add_(eps), value=-lr / bc1)
                nb1, nb2 = 1 - b1 ** (t + 1), 1 - b2 ** (t + 1)  # the next step's constants
                pred = big * (1 - lr * wd)
                den = (v / nb2).sqrt().add_(eps)
                if self.nextv:  # the next gradient's term, and v's, left to the next step()
                    pred.addcdiv_(m, den, value=-lr * b1 / nb1)
                    w = (v * (b2 / nb2)).sqrt_()
                    pend[p] = (pred, (w, lr * (1 - b1) / nb1, (1 - b2) / nb2))
                elif self.lin:  # the next gradient's term left to the next step()
                    pred.addcdiv_(m, den, value=-lr * b1 / nb1)
                    pend[p] = (pred, (lr * (1 - b1) / nb1) / den)
                else:
                    pred.addcdiv_(m, den, value=-lr / nb1)
                    pend[p] = (pred, None)
        if self.pending is not None:
            for p, (pred, c) in self.pending.items():
                if isinstance(c, tuple):  # den' = sqrt(b2*v/bc2' + (1-b2)/bc2' * g'^2) + eps
                    w, cn, k = c
                    g2 = grads[p]
                    den2 = (w * w + k * g2 * g2).sqrt_().add_(eps)
                    p.copy_(pred - cn * g2 / den2)
                else:
                    p.copy_(pred if c is None else pred - c * grads[p])
        self.pending = pend

    @torch.no_grad()
    def flush(self):
        for p, s in self.st.items():
            p.copy_(s["M"])
        self.pending = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lam", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lin", action="store_true")
    ap.add_argument("--nextv", action="store_true")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    args = argparse.Namespace(steps=500, batch=4, seq=128, d_model=320, layers=8, lr=2e-3,
                              val_every=100, val_batches=32, max_bytes=32 << 20, seed=a.seed)
    train, val = LQ.corpus(args.max_bytes)
    cfg = GPTConfig(vocab=256, d_model=args.d_model, n_heads=args.d_model // 64,
                    n_layers=args.layers, seq=args.seq, attn="sdpa")
    torch.manual_seed(args.seed)
    model = GPT(cfg)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    opt = DelayedSim(groups, args.lr, (0.9, 0.95), lam=a.lam, lin=a.lin, nextv=a.nextv)
    g = torch.Generator().manual_seed(42 + args.seed)
    vals = []
    t0 = time.perf_counter()
    name = ("nextv" if a.nextv else "lin" if a.lin else "pred")
    name += f"-lam{a.lam:g}" if a.lam else ""
    for step in range(args.steps):
        for pg in opt.param_groups:
            pg["lr"] = LQ.lr_at(step, args.steps, args.lr)
        x, y = LQ.batch(train, args.batch, args.seq, g)
        loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if (step + 1) % args.val_every == 0 or step + 1 == args.steps:
            if step + 1 == args.steps:
                opt.flush()
            vals.append((step + 1, LQ.val_loss(model, val, args)))
            print(f"{name} seed {a.seed} step {step + 1} val {vals[-1][1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    with open(os.path.join(a.out, f"{name}-seed{a.seed}.json"), "w") as f:
        json.dump(dict(name=name, seed=a.seed, val=vals), f)


if __name__ == "__main__":
    main()
