"""Stress cases on real model code (issue 20), shared by ``tests/python/test_stress.py`` (a short
fixed slice for CI) and ``benches/python/stress.py`` (random cases until the time is up).

A :class:`Case` is plain data (JSON round trip, so a failure prints what reproduces it).
:func:`run_case` builds the model from a tiny config with a realistic vocabulary (transformers'
GPT-2, Llama, Mistral, Qwen2, Gemma, BERT-MaskedLM, or :class:`RMSChain`, a pure-torch chain of
``y * rsqrt(mean(y²)) @ w`` blocks that saves one storage through several views), deep-copies it
into a plain copy and a spillover copy (wrapped with the case's policy), and for every step:

- draws the step's batch (its own sequence length) from the case's seed;
- runs the plain copy, then the spillover copy inside ``with ctx:`` (one context object for all
  steps; ``loss.backward()`` after the ``with``), ``torch.manual_seed`` reset identically before
  each forward so that dropout masks match;
- compares the losses and every parameter's gradient with ``torch.equal``;
- applies the same plain SGD update to both copies (identical, since the gradients are).

After the last step everything the context held must have gone back: pool and swap bytes in
use drop to 0. fp32, deterministic algorithms on for the duration of the case.
"""

from __future__ import annotations

import copy
import dataclasses
import gc
import json
import math
import os
import random
import shutil
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Dict, List, Optional, Tuple

FAMILIES = ("gpt2", "llama", "mistral", "qwen2", "gemma", "bert", "rmschain")
HF_FAMILIES = FAMILIES[:-1]
POLICIES = ("none", "full", "selective", "offload", "auto")
TIERS = ("host", "nvme")
ATTENTION = ("sdpa", "eager")
COMPILE = (None, "model", "blocks")
#: vocabulary sizes of real tokenizers in 32k-128k (odd ones included: 50257, 100277)
REAL_VOCABS = (32000, 32768, 49152, 50257, 50304, 65536, 100277, 102400, 128000, 128256)
MIB = 1 << 20
#: the token id BERT cases mask with (any id works: the model is untrained)
MASK_ID = 4


@dataclasses.dataclass
class Case:
    family: str
    vocab: int
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    intermediate: int = 128
    batch: int = 2
    #: one sequence length per step
    seqs: Tuple[int, ...] = (32, 48, 32)
    tier: str = "host"
    #: 0: no size given, the default pool that starts small and grows (Note [growing pool])
    pool_bytes: int = 16 * MIB
    min_offload_bytes: int = 4096
    #: "none" (no wrap) or a policy name of spillover.wrap
    policy: str = "none"
    #: policy "auto": the planner's peak budget (None: its default, half of free memory)
    budget_bytes: Optional[int] = None
    attn: str = "sdpa"
    dropout: float = 0.1
    #: right padding (attention_mask, labels -100 on pads) in rows after the first
    pad: bool = False
    #: Mistral only: sliding_window (None: the config's default, longer than any sequence)
    window: Optional[int] = None
    seed: int = 0
    lr: float = 0.01
    #: "selective" and "auto" price ops with these rates (matmul FLOP/s, elementwise, D2H,
    #: H2D, NVMe write, NVMe read bytes/s; None: _MACHINE_RATES), so no case calibrates ...
    rates: Optional[Tuple[float, ...]] = None
    #: ... unless this is True: the policy is then the plain string, priced by this machine's
    #: calibration (measured on first use, cached under $XDG_CACHE_HOME/spillover)
    calibrated: bool = False
    #: both copies compiled with aot_eager (Note [one hook for the run]): "model" (the whole
    #: module, ``model.compile()``), "blocks" (each repeated block), or None (eager)
    compile: Optional[str] = None
    #: the spillover copy on the simulated device (rust/link/sim/) at this many bytes/s, with
    #: the verify mode on (Note [verify on the device]); None: plain CPU tensors
    sim_link: Optional[float] = None

    def __post_init__(self) -> None:
        self.seqs = tuple(int(s) for s in self.seqs)
        if self.rates is not None:
            self.rates = tuple(float(r) for r in self.rates)
            if len(self.rates) != 6:
                raise ValueError("rates: expected 6 numbers (see Case.rates)")
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r}: expected one of {FAMILIES}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy={self.policy!r}: expected one of {POLICIES}")
        if self.tier not in TIERS:
            raise ValueError(f"tier={self.tier!r}: expected one of {TIERS}")
        if self.attn not in ATTENTION:
            raise ValueError(f"attn={self.attn!r}: expected one of {ATTENTION}")
        if self.compile not in COMPILE:
            raise ValueError(f"compile={self.compile!r}: expected one of {COMPILE}")

    @property
    def steps(self) -> int:
        return len(self.seqs)

    def to_json(self) -> str:
        d = dataclasses.asdict(self)
        d["seqs"] = list(self.seqs)
        d["rates"] = None if self.rates is None else list(self.rates)
        return json.dumps(d, separators=(",", ":"))

    @classmethod
    def from_json(cls, s: str) -> Case:
        return cls(**json.loads(s))

    def short(self) -> str:
        """One line: what the case runs."""
        pol = self.policy + (f"(budget={_size(self.budget_bytes)})"
                             if self.policy == "auto" and self.budget_bytes is not None else "")
        extra = (" pad" if self.pad else "") + (f" window={self.window}" if self.window else "")
        if self.policy in ("selective", "auto"):
            extra += (" calibrated" if self.calibrated else " rates=" + (
                "default" if self.rates is None else "/".join(f"{r:.1e}" for r in self.rates)))
        if self.compile:
            extra += f" compile={self.compile}"
        if self.sim_link:
            extra += f" sim-link={self.sim_link:.2g}+verify"
        return (f"{self.family} V={self.vocab} h={self.hidden} L={self.layers} "
                f"heads={self.heads}/{self.kv_heads} {self.attn} drop={self.dropout} "
                f"b={self.batch} seqs={list(self.seqs)} {self.tier} "
                f"pool={_size(self.pool_bytes or None)} "
                f"min={_size(self.min_offload_bytes)} policy={pol}{extra}")


def _size(n: Optional[int]) -> str:
    if n is None:
        return "default"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return f"{n}B"


@dataclasses.dataclass
class Outcome:
    #: "ok", "mismatch" (gradients or loss differ), "exception", "internal"
    #: (spillover.InternalError: a broken invariant the boundary caught), "panic" (pyo3's
    #: PanicException), "leak" (pool or swap bytes still in use after the case), "invalid" (the
    #: plain run's loss is not finite: the case, not spillover, is wrong); the bench adds
    #: "timeout" and "crash" (the worker process died)
    kind: str
    steps_done: int = 0
    #: the step that failed (0-based), None when the case passed or failed after its steps
    step: Optional[int] = None
    message: str = ""
    traceback: str = ""
    seconds: float = 0.0
    #: a few counters of ctx.stats(total=True)
    stats: Dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.kind == "ok"

    def describe(self) -> str:
        at = f" at step {self.step}" if self.step is not None else ""
        out = f"{self.kind}{at}: {self.message}"
        if self.traceback:
            out += "\n" + self.traceback
        return out


# -- models -------------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _make_rmschain():
    torch = _torch()
    nn = torch.nn

    class RMSBlock(nn.Module):
        """``y * rsqrt(mean(y²) + eps) @ w`` twice and a residual: ``y`` is saved by pow, mul
        and (through views) by mean's backward, and the normed product by the matmul."""

        def __init__(self, hidden: int):
            super().__init__()
            self.w1 = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))
            self.w2 = nn.Parameter(torch.randn(hidden, hidden) / math.sqrt(hidden))

        def forward(self, x):
            y = x
            for w in (self.w1, self.w2):
                y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
                y = y @ w
            return x + y

    class RMSChain(nn.Module):
        """Embedding, ``layers`` RMSBlocks, a vocabulary head and cross-entropy (HF-style
        ``forward(input_ids, labels, attention_mask) -> .loss``; the mask is ignored)."""

        def __init__(self, vocab: int, hidden: int, layers: int, dropout: float):
            super().__init__()
            self.embed = nn.Embedding(vocab, hidden)
            self.drop = nn.Dropout(dropout)
            self.blocks = nn.ModuleList(RMSBlock(hidden) for _ in range(layers))
            self.head = nn.Linear(hidden, vocab, bias=False)

        def forward(self, input_ids, labels=None, attention_mask=None):
            y = self.drop(self.embed(input_ids))
            for b in self.blocks:
                y = b(y)
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
            logits = self.head(y)
            loss = torch.nn.functional.cross_entropy(
                logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100)
            return _Output(loss)

    return RMSChain


class _Output:
    def __init__(self, loss):
        self.loss = loss


def build_model(case: Case):
    """The case's model in training mode, its weights drawn from ``case.seed``."""
    torch = _torch()
    torch.manual_seed(case.seed)
    d = case.dropout
    max_pos = max(64, max(case.seqs))
    if case.family == "rmschain":
        model = _make_rmschain()(case.vocab, case.hidden, case.layers, d)
        return model.train()
    import transformers as T

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if case.family == "gpt2":
            cfg = T.GPT2Config(vocab_size=case.vocab, n_positions=max_pos, n_embd=case.hidden,
                               n_layer=case.layers, n_head=case.heads, n_inner=case.intermediate,
                               resid_pdrop=d, embd_pdrop=d, attn_pdrop=d, use_cache=False,
                               bos_token_id=0, eos_token_id=0)
        elif case.family == "bert":
            cfg = T.BertConfig(vocab_size=case.vocab, hidden_size=case.hidden,
                               num_hidden_layers=case.layers, num_attention_heads=case.heads,
                               intermediate_size=case.intermediate, hidden_dropout_prob=d,
                               attention_probs_dropout_prob=d, max_position_embeddings=max_pos)
        else:
            common = dict(vocab_size=case.vocab, hidden_size=case.hidden,
                          intermediate_size=case.intermediate, num_hidden_layers=case.layers,
                          num_attention_heads=case.heads, num_key_value_heads=case.kv_heads,
                          max_position_embeddings=max_pos, use_cache=False, attention_dropout=d,
                          bos_token_id=0, eos_token_id=0, pad_token_id=0)
            if case.family == "llama":
                cfg = T.LlamaConfig(**common)
            elif case.family == "mistral":
                cfg = T.MistralConfig(**common, sliding_window=case.window or 4096)
            elif case.family == "qwen2":
                cfg = T.Qwen2Config(**common)
            else:
                cfg = T.GemmaConfig(**common, head_dim=case.hidden // case.heads)
        auto = T.AutoModelForMaskedLM if case.family == "bert" else T.AutoModelForCausalLM
        model = auto.from_config(cfg, attn_implementation=case.attn, dtype=torch.float32)
    return model.train()


def compile_like(case: Case, model) -> None:
    """Compile ``model`` in place as the case says (aot_eager: the tensors inductor saves, in
    seconds on a CPU): the whole module, or each block of its outermost ``nn.ModuleList``."""
    torch = _torch()
    if case.compile == "model":
        model.compile(backend="aot_eager")
    elif case.compile == "blocks":
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        for block in lists[0]:
            block.compile(backend="aot_eager")


def make_batch(case: Case, step: int) -> Dict[str, Any]:
    """The step's inputs, drawn from ``case.seed`` and ``step``: ``input_ids``, ``labels`` (BERT:
    about 15% of positions masked, -100 elsewhere), ``attention_mask`` when ``case.pad``."""
    torch = _torch()
    g = torch.Generator().manual_seed(case.seed * 1009 + step)
    b, s = case.batch, case.seqs[step]
    ids = torch.randint(0, case.vocab, (b, s), generator=g)
    if case.family == "bert":
        masked = torch.rand(b, s, generator=g) < 0.15
        masked[:, 0] = True
        labels = torch.where(masked, ids, torch.full_like(ids, -100))
        ids = ids.masked_fill(masked, MASK_ID)
    else:
        labels = ids.clone()
    batch: Dict[str, Any] = {"input_ids": ids, "labels": labels}
    if case.pad and s >= 4:
        lens = torch.randint(s // 2, s + 1, (b,), generator=g)
        lens[0] = s
        mask = (torch.arange(s)[None, :] < lens[:, None]).long()
        labels.masked_fill_(mask == 0, -100)
        batch["attention_mask"] = mask
    return batch


# -- running ------------------------------------------------------------------------------------

#: Fixed rates for "selective" and "auto", so no case calibrates the machine (as
#: test_attention_kinds): matmul FLOP/s, elementwise, D2H, H2D, NVMe write, NVMe read bytes/s.
_MACHINE_RATES = (1e11, 5e9, 6e9, 6e9, 3e9, 2e9)


def _policy(case: Case):
    import spillover
    from spillover.planner import Machine

    if case.calibrated and case.policy != "auto":
        return case.policy
    r = case.rates or _MACHINE_RATES
    machine = None if case.calibrated else Machine({"float32": r[0]}, *r[1:])
    if case.policy == "auto":
        return spillover.Planner(budget_bytes=case.budget_bytes, machine=machine)
    if case.policy == "selective":
        return spillover.SelectivePolicy(machine=machine)
    return case.policy


def _is_panic(e: BaseException) -> bool:
    return type(e).__name__ == "PanicException"


_STAT_FIELDS = ("tensors_offloaded", "tensors_chunked", "bytes_offloaded_host",
                "bytes_offloaded_nvme", "bytes_kept_pool_full", "bytes_deduplicated",
                "prefetch_hits", "prefetch_misses", "host_cache_hits", "overflow_reads",
                "pool_peak", "pool_capacity")


def _compare(plain, spill, loss_p, loss_s) -> Optional[str]:
    """None when the losses and every gradient are bitwise equal, else what differs."""
    torch = _torch()
    problems: List[str] = []
    if not torch.equal(loss_p, loss_s):
        problems.append(f"loss {loss_p.item()!r} != {loss_s.item()!r}")
    n_bad = 0
    for (name_p, p), (name_s, s) in zip(plain.named_parameters(), spill.named_parameters()):
        if name_p != name_s:
            return f"parameter order differs: {name_p} vs {name_s}"
        gp, gs = p.grad, s.grad
        if (gp is None) != (gs is None):
            problems.append(f"{name_p}: grad is None on the "
                            f"{'plain' if gp is None else 'spillover'} side only")
            n_bad += 1
        elif gp is not None and not torch.equal(gp, gs):
            n_bad += 1
            if n_bad <= 5:
                d = (gp - gs).abs()
                problems.append(f"{name_p}: grad differs in {int((d != 0).sum())}/{d.numel()} "
                                f"elements, max |d| = {d.max().item():.3e}")
    if n_bad > 5:
        problems.append(f"... {n_bad} parameters differ in all")
    return "; ".join(problems) or None


def _drained(ctx, timeout: float = 5.0) -> Tuple[int, int]:
    """Pool and swap bytes still in use once the case's tensors are gone (polls: a copy
    worker lets go of its last references a moment after its copy is seen done)."""
    deadline = time.monotonic() + timeout
    while True:
        ctx.synchronize()
        gc.collect()
        ctx.synchronize()
        s = ctx.stats()
        if (s.pool_in_use, s.swap_in_use) == (0, 0) or time.monotonic() > deadline:
            return s.pool_in_use, s.swap_in_use
        time.sleep(0.01)


def run_case(case: Case, log=None) -> Outcome:
    """Run ``case`` (see the module docstring); never raises except for KeyboardInterrupt and
    SystemExit: a failure is the Outcome's kind, message and traceback."""
    torch = _torch()
    import spillover

    t0 = time.monotonic()
    out = Outcome("ok")
    nvme_dir = tempfile.mkdtemp(prefix="spillover-stress-") if case.tier == "nvme" else None
    det = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    plain = spill = ctx = loss_p = loss_s = None
    try:
        base = build_model(case)
        plain = copy.deepcopy(base)
        spill = base
        if case.policy != "none":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # bitwise against HF's own loss: the loss region off (test_loss_region.py)
                spillover.wrap(spill, policy=_policy(case), chunked_loss=False)
        if case.compile:
            torch._dynamo.reset()
            compile_like(case, plain)
            compile_like(case, spill)
        kw: Dict[str, Any] = {"min_offload_bytes": case.min_offload_bytes}
        if case.pool_bytes:
            kw["host_pool_bytes"] = case.pool_bytes
        else:  # the default pool starts small and grows (Note [growing pool] in _growth.py):
            spillover.empty_cache()  # not on a larger one an earlier run left idle
        if nvme_dir is not None:
            kw["nvme_path"] = nvme_dir
        if case.sim_link:
            kw.update(sim_link_bandwidth=case.sim_link, verify=True)
        ctx = spillover.offload_context(case.tier, **kw)
        for step in range(case.steps):
            out.step = step
            batch = make_batch(case, step)
            torch.manual_seed(case.seed + 7919 * (step + 1))
            loss_p = plain(**batch).loss
            loss_p.backward()
            if not torch.isfinite(loss_p):
                out.kind, out.message = "invalid", f"the plain run's loss is {loss_p.item()}"
                return out
            torch.manual_seed(case.seed + 7919 * (step + 1))
            with ctx:
                loss_s = spill(**batch).loss
            loss_s.backward()
            bad = _compare(plain, spill, loss_p.detach(), loss_s.detach())
            if bad is not None:
                out.kind, out.message = "mismatch", bad
                return out
            with torch.no_grad():
                for p, s in zip(plain.parameters(), spill.parameters()):
                    if p.grad is not None:
                        p.add_(p.grad, alpha=-case.lr)
                        s.add_(s.grad, alpha=-case.lr)
                    p.grad = s.grad = None
            loss_p = loss_s = None
            out.steps_done = step + 1
            if log is not None:
                log(f"  step {step} ok (seq {case.seqs[step]})")
        out.step = None
        total = ctx.stats(total=True)
        out.stats = {k: getattr(total, k) for k in _STAT_FIELDS}
        pool, swap = _drained(ctx)
        if (pool, swap) != (0, 0):
            out.kind = "leak"
            out.message = (f"after the last step the pool still has {pool} bytes in use and "
                           f"the swap {swap}")
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: B036  (pyo3's PanicException derives from BaseException)
        out.kind = ("panic" if _is_panic(e) else
                    "internal" if type(e).__name__ == "InternalError" else "exception")
        out.message = f"{type(e).__module__}.{type(e).__qualname__}: {e}"
        out.traceback = traceback.format_exc()
    finally:
        out.seconds = time.monotonic() - t0
        torch.use_deterministic_algorithms(det)
        # Drop the step's graphs before the context, the context before its swap directory.
        plain = spill = loss_p = loss_s = ctx = None
        if case.compile:
            torch._dynamo.reset()
        gc.collect()
        if nvme_dir is not None:
            shutil.rmtree(nvme_dir, ignore_errors=True)
    return out


# -- random cases (the bench) -------------------------------------------------------------------


def max_pool_bytes() -> int:
    """The largest pool the bench draws: 1 GiB, or an eighth of the memory available now."""
    try:
        import psutil

        avail = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001
        avail = 8 << 30
    return max(16 * MIB, min(1 << 30, (avail // 8) & ~4095))


def draw_case(rng: random.Random, max_pool: int, min_steps: int = 3, max_steps: int = 4,
              logits_cap: int = 128 * MIB, calibrated: bool = False) -> Case:
    """A random case: family, realistic vocabulary, pool log-uniform in 16 MiB..max_pool,
    sequence lengths changing between steps (the logits of one step at most ``logits_cap``);
    "selective" and "auto" priced with random rates, or with this machine's calibration when
    ``calibrated``."""
    family = rng.choice(FAMILIES)
    vocab = rng.choice(REAL_VOCABS) if rng.random() < 0.5 else rng.randint(32000, 131072)
    hidden = rng.choice((64, 96, 128))
    heads = rng.choice([h for h in (2, 4, 8) if (hidden // h) % 2 == 0])
    kv_heads = rng.choice(sorted({heads, max(1, heads // 2), 1}))
    if family in ("gpt2", "bert", "rmschain"):
        kv_heads = heads
    intermediate = hidden * rng.choice((2, 3, 4))
    layers = rng.choice((2, 2, 3))
    batch = rng.choice((1, 2, 2, 4))
    max_seq = max(16, min(384, logits_cap // (batch * vocab * 4)))
    steps = rng.randint(min_steps, max_steps)
    seqs: List[int] = []
    for _ in range(steps):
        if seqs and rng.random() < 0.3:
            seqs.append(seqs[-1])  # the same shape again: the learned order holds
        else:  # log-uniform: short sequences as often as long ones
            seqs.append(int(math.exp(rng.uniform(math.log(8), math.log(max_seq + 1)))))
    tier = rng.choice(TIERS)
    lo, hi = math.log(16 * MIB), math.log(max(16 * MIB, max_pool))
    pool = int(math.exp(rng.uniform(lo, hi)))
    pool = 1 << (pool.bit_length() - 1) if rng.random() < 0.3 else (pool & ~4095)
    pool = max(16 * MIB, min(pool, max_pool))
    if rng.random() < 0.15:
        pool = 0  # the default: a pool that grows to what the steps use
    min_offload = rng.choice((4096, 4096, 65536, 1 * MIB, rng.randrange(4096, 1 * MIB, 4096)))
    policy = rng.choice(POLICIES)
    budget = rng.choice((1, 16 * MIB, 256 * MIB, None)) if policy == "auto" else None
    attn = "sdpa" if family == "rmschain" or rng.random() < 0.6 else "eager"
    dropout = 0.1 if rng.random() < 0.8 else 0.0
    window = rng.randint(8, 64) if family == "mistral" and rng.random() < 0.4 else None
    compiled = rng.choice(COMPILE[1:]) if rng.random() < 0.15 else None
    sim_link = float(f"{rng.uniform(1e9, 2e10):.3g}") if rng.random() < 0.2 else None
    pad = window is None and rng.random() < 0.3
    # rates spread over ~2 orders of magnitude around a CPU's and a GPU host's: the planner and
    # selective's refinement make different choices
    rates = None
    if policy in ("selective", "auto") and not calibrated and rng.random() < 0.7:
        rates = tuple(float(f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.3g}")
                      for lo, hi in ((1e10, 1e14), (1e9, 1e12), (1e9, 5e10), (1e9, 5e10),
                                     (2e8, 1e10), (2e8, 1e10)))
    return Case(family=family, vocab=vocab, hidden=hidden, layers=layers, heads=heads,
                kv_heads=kv_heads, intermediate=intermediate, batch=batch, seqs=tuple(seqs),
                tier=tier, pool_bytes=pool, min_offload_bytes=min_offload, policy=policy,
                budget_bytes=budget, attn=attn, dropout=dropout, pad=pad, window=window,
                seed=rng.randrange(1 << 30), rates=rates, calibrated=calibrated,
                compile=compiled, sim_link=sim_link)


def worker_loop(conn, threads: int) -> None:
    """The bench's worker process: run each Case JSON received on ``conn``, send back the
    Outcome as a dict; None ends it."""
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    torch = _torch()
    torch.set_num_threads(threads)
    import transformers

    import spillover  # noqa: F401  (imported once, before the first case is timed)

    transformers.logging.set_verbosity_error()
    conn.send("ready")
    while True:
        msg = conn.recv()
        if msg is None:
            return
        case = Case.from_json(msg)
        out = run_case(case)
        sys.stderr.flush()
        conn.send(dataclasses.asdict(out))
