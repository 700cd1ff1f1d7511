"""The staged-copy parts of ``benches/python/optim_bench.py``: ``--parts staged`` (the staged
path on this CPU against the default) and ``--parts sim`` (hook copies, copies at ``step()``
and ``update_in_backward`` on the simulated device); optim_bench.py's docstring says what
each measures."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Dict, List

import torch
from optim_common import params_like, race, sizes

import spillover


def bench_staged(args, pool_bytes: int) -> List[str]:
    from spillover import optim as so

    szs = sizes(int(args.staged_params), 16)
    n = sum(szs)
    # Four optimizers in one pool (pools are shared per capacity): 20 B/param each for the
    # master, the two moments and the two staging buffers, plus slack.
    own_pool = 4 * n * 20 + (96 << 20) + 4096

    def setup(staged: bool, inbwd: bool = False):
        ps = params_like(szs, torch.float32, 0)
        g = torch.Generator().manual_seed(1)
        coef = [torch.randn(p.shape, generator=g) * 1e-2 for p in ps]
        opt = spillover.OffloadAdamW(
            ps,
            lr=1e-3,
            tier="host",
            host_pool_bytes=own_pool,
            _force_staging=staged,
            _hook_copies=staged,  # this part times the hooks' copies and fingerprints
            update_in_backward=inbwd,
        )
        return ps, coef, opt

    step_times: Dict[str, List[float]] = {}  # the step() call alone, per optimizer

    def train(ps, coef, opt, edit: bool, step: bool = True):
        def run():
            for p in ps:
                p.grad = None
            sum((p * c).sum() for p, c in zip(ps, coef)).backward()
            if edit:  # moves no version counter: only the fingerprint sees it
                for p in ps:
                    p.grad.data.mul_(0.5)
            if step:
                t0 = time.perf_counter()
                opt.step()
                step_times.setdefault(id(opt), []).append(time.perf_counter() - t0)

        return run

    direct = setup(False)
    reused = setup(True)
    stale = setup(True)
    inbwd = setup(True, inbwd=True)
    methods = {
        "backward only": train(*direct, edit=False, step=False),
        "in place (not staged)": train(*direct, edit=False),
        "staged, copies reused": train(*reused, edit=False),
        "staged, .data write: copied again": train(*stale, edit=True),
        "staged, update_in_backward": train(*inbwd, edit=False),
    }
    t = race(methods, args.rounds)
    grads = [p.grad for p in reused[0]]
    fp_times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for gr in grads:
            so._fingerprint_parts(gr)
        fp_times.append(time.perf_counter() - t0)
    fp = min(fp_times)
    gib = n * 4 / (1 << 30)
    bwd = t["backward only"]
    st = reused[2].stats(), stale[2].stats()

    def call(setup_: Any) -> str:
        return f"{statistics.median(step_times[id(setup_[2])]) * 1e3:.1f} ms (median)"

    out = [
        f"\n### staged path on CPU tensors, {n / 1e6:.0f}M fp32 parameters in {len(szs)} "
        f"tensors ({gib:.2f} GiB of gradients; optimizer time = step time - backward only)\n",
        "| method | step ms (median) | optimizer ms | note |",
        "| --- | --- | --- | --- |",
    ]
    for k, v in t.items():
        note = ""
        if k.startswith("staged, copies"):
            note = f"grad_copies {st[0]['grad_copies']}, stale {st[0]['grad_stale_copies']}"
            note += f"; step() call alone {call(reused)}"
        elif k.startswith("staged, .data"):
            note = f"grad_copies {st[1]['grad_copies']}, stale {st[1]['grad_stale_copies']}"
        elif k.endswith("update_in_backward"):
            note = (
                f"step() call alone {call(inbwd)} (the updates ran during backward, on the "
                "worker thread; step() fingerprints the gradients)"
            )
        opt_ms = "" if k == "backward only" else f"{(v - bwd) * 1e3:.1f}"
        out.append(f"| {k} | {v * 1e3:.1f} | {opt_ms} | {note} |")
    out.append(
        f"\nfingerprint alone (torch int64 ops on this CPU): {fp * 1e3:.1f} ms for {gib:.2f} GiB "
        f"= {gib / fp:.2f} GiB/s; the staged step fingerprints every gradient twice (hook and "
        "step); on a GPU host both run on the device"
    )
    del direct, reused, stale, inbwd, grads
    gc.collect()
    return out


class _Sleep(torch.autograd.Function):
    """Simulated device compute: the backward of one layer takes `seconds`."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.seconds)
        return g, None


def bench_sim(args, pool_bytes: int) -> List[str]:
    from spillover.activations.link import sim

    class Link(sim.SimDevice):
        """The compute stream's waits are kept for the next forward (a GPU's host goes on)."""

        def __init__(self, bandwidth):
            super().__init__(bandwidth)
            self.pending: List[Any] = []

        def wait(self, stream, ev):
            if stream is sim._HOST:
                self.pending.append(ev)
            else:
                super().wait(stream, ev)

        def forward_starts(self):
            for ev in self.pending:
                self.synchronize(ev)
            self.pending = []

    szs = sizes(int(args.sim_params), 16)
    n = sum(szs)
    own_pool = 3 * n * 20 + (96 << 20) + 4096

    def setup(bw: float, mode: str):
        ps = params_like(szs, torch.float32, 0)
        g = torch.Generator().manual_seed(1)
        coef = [torch.randn(p.shape, generator=g) * 1e-2 for p in ps]
        link = Link(bw)
        opt = spillover.OffloadAdamW(
            ps, lr=1e-3, tier="host", host_pool_bytes=own_pool, _force_staging=True,
            _link=link, _hook_copies=mode != "at step() (default)",
            update_in_backward=mode == "update_in_backward",
        )
        return ps, coef, opt, link

    def train(ps, coef, opt, link, seconds):
        def run():
            link.forward_starts()
            for p in ps:
                p.grad = None
            acc = torch.zeros(())
            for p, c in zip(ps, coef):
                acc = _Sleep.apply(acc + (p * c).sum(), seconds / len(ps))
            acc.backward()
            opt.step()

        return run

    out = [
        f"\n### simulated device: {n / 1e6:.0f}M fp32 parameters in {len(szs)} tensors "
        f"({n * 4 / (1 << 20):.0f} MiB of gradients), step = backward + step(), ms (median)\n",
        "| link GB/s | backward ms | hook copies | at step() (default) | update_in_backward |"
        " hooks / at step() | hooks - 2 fingerprints - at step() |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    from spillover.optim import fingerprint

    grads = [torch.randn(s_) for s_ in szs]
    fp_times = []
    for _ in range(3):  # the host's fingerprint of every gradient (the sim charges 2 per step)
        t0 = time.perf_counter()
        for gr in grads:
            fingerprint._fingerprint_parts(gr)
        fp_times.append(time.perf_counter() - t0)
    fp = min(fp_times)
    del grads
    modes = ("hook copies", "at step() (default)", "update_in_backward")
    for bw in args.sim_bandwidths.split(","):
        for bwd in args.sim_backwards.split(","):
            made = {m: setup(float(bw) * 1e9, m) for m in modes}
            t = race({m: train(*made[m], float(bwd) / 1e3) for m in modes}, args.rounds)
            for m in modes:
                made[m][3].forward_starts()
                for space in made[m][2]._spaces:  # the copies in flight, before freeing
                    space.close()
            cells = " | ".join(f"{t[m] * 1e3:.1f}" for m in modes)
            ratio = t["hook copies"] / t["at step() (default)"]
            net = (t["hook copies"] - 2 * fp - t["at step() (default)"]) * 1e3
            out.append(f"| {bw} | {bwd} | {cells} | {ratio:.2f} | {net:+.1f} |")
            del made
            gc.collect()
    out.append(
        f"\nfingerprint of every gradient on this host: {fp * 1e3:.1f} ms (the hook-copies mode "
        "takes two per step: hook and step(); on a GPU they are device kernels on the copy "
        "stream). "
        "Copy of all gradients over the link: "
        + ", ".join(f"{n * 4 / (float(b) * 1e9) * 1e3:.1f} ms at {b} GB/s"
                    for b in args.sim_bandwidths.split(","))
    )
    return out
