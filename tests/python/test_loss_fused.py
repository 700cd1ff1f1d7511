"""spillover's own chunked linear + cross-entropy (spillover/loss/fused.py, Notes [chunks in
forward], [logit transforms], [autocast in the chunks]) against the plain loss
``F.cross_entropy(F.linear(h, w, b).float(), y)``, and the loss region running it on a torch
whose ``linear_cross_entropy`` is hidden (the path of every torch below 2.13, exercised here on
the newest too).

Tolerances: in fp32 each gradient within 1e-5 of the plain one relative to that tensor's
largest entry (the issue's bar; seen: under 1e-6), the loss at rtol 1e-6. In bf16 and fp16 the
plain loss itself is off by its rounding; both are compared with the fp64 loss, and ours may be
off by at most 2x the plain loss's error (seen: up to 1.9x in bf16, from the chunk's logits
gradient rounded to bf16 before each of its GEMMs, as the plain backward does once).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import spillover
from spillover import loss as L
from spillover.loss import fused

needs_torch_op = pytest.mark.skipif(not L.available(),
                                    reason="torch without linear_cross_entropy (2.13+)")

TOKENS, D, VOCAB, ROWS = 700, 48, 1000, 256  # three chunks, the last one short


@pytest.fixture
def own_path(monkeypatch):
    """torch's ``linear_cross_entropy`` hidden: what a torch below 2.13 has."""
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    assert L.backend() == L.OWN


def data(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(TOKENS, D, generator=g).to(dtype)
    w = (torch.randn(VOCAB, D, generator=g) * 0.2).to(dtype)
    b = (torch.randn(VOCAB, generator=g) * 0.1).to(dtype)
    y = torch.randint(0, VOCAB, (TOKENS,), generator=g)
    y[::5] = -100  # ignored targets (padding, prompts)
    return h, w, b, y


def plain(h, w, b, y, reduction="mean", softcap=None, scale=None):
    z = F.linear(h, w, b)
    if scale is not None:
        z = z * scale
    if softcap is not None:
        z = torch.tanh(z / softcap) * softcap
    return F.cross_entropy(z.float(), y, reduction=reduction)


def run(fn, h, w, b, y, dtype=None, bias=True, **kw):
    """Loss and gradients (h, w[, b]) of ``fn`` on fresh leaves of ``dtype``."""
    leaves = [t.to(dtype or t.dtype).clone().requires_grad_() for t in (h, w, b)]
    loss = fn(leaves[0], leaves[1], leaves[2] if bias else None, y, **kw)
    loss.backward()
    return [loss.detach()] + [t.grad for t in leaves[: 3 if bias else 2]]


def ours(h, w, b, y, **kw):
    return fused.linear_cross_entropy(h, w, y, bias=b, rows=ROWS, **kw)


def within(got, ref, rel=1e-5):
    """Each tensor within ``rel`` of ``ref`` relative to ``ref``'s largest entry."""
    for i, (a, r) in enumerate(zip(got, ref)):
        err = (a.double() - r.double()).abs().max().item()
        assert err <= rel * r.double().abs().max().item() + 1e-12, (i, err)


TRANSFORMS = [{}, {"softcap": 3.0}, {"scale": 0.25}]


@pytest.mark.parametrize("transform", TRANSFORMS, ids=["linear", "softcap", "scale"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_fp32_loss_and_gradients_match_the_plain_loss(reduction, bias, transform):
    h, w, b, y = data()
    ref = run(plain, h, w, b, y, bias=bias, reduction=reduction, **transform)
    got = run(ours, h, w, b, y, bias=bias, reduction=reduction, **transform)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=0)
    within(got[1:], ref[1:])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("transform", TRANSFORMS, ids=["linear", "softcap", "scale"])
def test_low_precision_within_the_plain_losss_own_error(dtype, transform):
    h, w, b, y = data()
    exact = run(plain, h, w, b, y, dtype=torch.float64, **transform)
    base = run(plain, h, w, b, y, dtype=dtype, **transform)
    got = run(ours, h, w, b, y, dtype=dtype, **transform)
    assert [t.dtype for t in got[1:]] == [dtype] * 3
    for i, (a, p, e) in enumerate(zip(got, base, exact)):
        scale = e.abs().max().item()
        mine = (a.double() - e).abs().max().item() / scale
        theirs = (p.double() - e).abs().max().item() / scale
        assert mine <= 2 * theirs + 1e-6, (i, mine, theirs)


def test_every_target_ignored_gives_nan_loss_and_zero_gradients():
    h, w, b, y = data()
    y = torch.full_like(y, -100)
    ref = run(plain, h, w, b, y)
    got = run(ours, h, w, b, y)
    assert torch.isnan(ref[0]) and torch.isnan(got[0])
    for a, r in zip(got[1:], ref[1:]):
        assert torch.equal(a, r) and not a.any()


@needs_torch_op
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_agrees_with_torchs_op_within_fp32_rounding(reduction, bias):
    """Where both exist torch's op stays the default (backend()), and the two agree."""
    assert L.backend() == L.TORCH and L.backend(softcap=30.0) == L.OWN
    h, w, b, y = data()

    def torchs(h, w, b, y, reduction):
        extra = {} if b is None else {"linear_bias": b}
        return F.linear_cross_entropy(h, w, y, reduction=reduction,
                                      options=L.options_for(VOCAB, ROWS), **extra)

    ref = run(torchs, h, w, b, y, bias=bias, reduction=reduction)
    got = run(ours, h, w, b, y, bias=bias, reduction=reduction)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-6, atol=0)
    within(got[1:], ref[1:])


class Largest(TorchDispatchMode):
    """The largest tensor any op makes while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def test_no_tokens_by_vocab_tensor_exists(own_path):
    """Note [chunks in forward]: the largest tensor of forward and backward is one chunk of
    logits (rows x vocab) or the weight's gradient, never tokens x vocab."""
    tokens, vocab = 4096, 8192  # chunk_rows: 1024 rows, a quarter of the tokens
    h = torch.randn(tokens, 16, requires_grad=True)
    w = torch.randn(vocab, 16, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,))
    with Largest() as seen:
        L.chunked_cross_entropy(h, w, y).backward()
    assert seen.numel == L.chunk_rows(vocab) * vocab <= tokens * vocab // 4


def test_rows_follow_the_chunk_rule_and_a_cap(own_path, monkeypatch):
    """Notes [loss chunks], [loss chunk under a budget]: the speed rule's rows, fewer under
    limit_chunk, the same loss and gradients within fp32 rounding; the scope reports the same
    transient as with torch's op."""
    seen = []
    real = fused.linear_cross_entropy

    def spy(*a, rows, **kw):
        seen.append(rows)
        return real(*a, rows=rows, **kw)

    monkeypatch.setattr(fused, "linear_cross_entropy", spy)
    tokens, vocab = 2048, 512
    h, w, _, y = data()
    h, w = torch.randn(tokens, D), torch.randn(vocab, D) * 0.1
    y = torch.randint(0, vocab, (tokens,))
    hidden = tokens * D * 4

    def once(cap):
        scope = L.begin_scope()
        with L.limit_chunk(cap):
            out = run(lambda h, w, b, y: L.chunked_cross_entropy(h, w, y), h, w, w[:, 0], y,
                      bias=False)
        return out, L.end_scope(scope)

    ref, reported = once(None)
    capped, reported_capped = once(128 * vocab * 4 + hidden)
    assert seen == [1024, 128]
    assert reported == reported_capped == (1024 * vocab * 4 + hidden, 64 * vocab * 4 + hidden)
    torch.testing.assert_close(capped[0], ref[0], rtol=1e-6, atol=0)
    within(capped[1:], ref[1:])


def test_a_second_backward_names_the_switch():
    h, w, b, y = data()
    h.requires_grad_()
    loss = fused.linear_cross_entropy(h, w, y, rows=ROWS)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="chunked_loss=False"):
        loss.backward()


def test_autocast_runs_the_head_in_its_dtype():
    """Note [autocast in the chunks]: fp32 parameters under bf16 autocast, as the plain head
    under autocast (bf16 GEMMs, fp32 loss); gradients come back in fp32."""
    h, w, b, y = data()

    def under(fn):
        def f(h, w, b, y):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return fn(h, w, b, y)
        return f

    exact = run(plain, h, w, b, y, dtype=torch.float64)
    base = run(under(plain), h, w, b, y)
    got = run(under(ours), h, w, b, y)
    assert [t.dtype for t in got[1:]] == [torch.float32] * 3
    for a, p, e in zip(got, base, exact):
        scale = e.abs().max().item()
        assert (a.double() - e).abs().max().item() <= \
            2 * (p.double() - e).abs().max().item() + 1e-6 * scale


def test_meta_tensors_run_for_the_estimate():
    """No data-dependent Python (the count of targets stays a tensor): the chunks run on meta
    tensors, as spillover.estimate traces a step."""
    h = torch.empty(TOKENS, D, device="meta", requires_grad=True)
    w = torch.empty(VOCAB, D, device="meta", requires_grad=True)
    y = torch.empty(TOKENS, dtype=torch.long, device="meta")
    loss = fused.linear_cross_entropy(h, w, y, rows=ROWS)
    loss.backward()
    assert h.grad.shape == h.shape and w.grad.shape == w.shape


# -- the loss region with torch's op hidden ---------------------------------------------------

transformers = pytest.importorskip("transformers")
from spillover.integrations import hf  # noqa: E402

HF_VOCAB = 32000


def tiny_llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def hf_batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, HF_VOCAB, (2, 24), generator=g)
    labels = ids.clone()
    labels[0, 18:] = -100
    labels[1, :5] = -100
    return ids, labels


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def hf_step(m, ids, labels, **kw):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=ids, labels=labels, **kw)
    out.loss.backward()
    return out, grads(m)


@pytest.mark.parametrize("how", ["wrap", "enable"])
def test_region_without_torchs_op_matches_hf(own_path, how):
    base = tiny_llama()
    ids, labels = hf_batch()
    ref_out, ref = hf_step(base, ids, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrap's use_cache notice
        turn_on = spillover.wrap if how == "wrap" else hf.enable
        model = turn_on(copy.deepcopy(base), policy="full")
    assert "spillover's chunks" in spillover.explain(model).summary["loss region"]
    before = L.paths_run()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "runs unchunked" warning any more
        out, got = hf_step(model, ids, labels)
    assert out.logits is None
    assert L.paths_run()[L.OWN] == before[L.OWN] + 1
    assert L.paths_run()[L.TORCH] == before[L.TORCH]
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=1e-6, atol=0)
    for k in ref:
        within([got[k]], [ref[k]])


def test_region_without_torchs_op_gradient_accumulation(own_path):
    base = tiny_llama()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spillover.wrap(copy.deepcopy(base), policy="full")
    micro = [hf_batch(1), hf_batch(2)]
    n = sum(int((lab[..., 1:] != -100).sum()) for _, lab in micro)
    for m in (base, model):
        m.zero_grad(set_to_none=True)
        for ids, labels in micro:
            m(input_ids=ids, labels=labels, num_items_in_batch=torch.tensor(n)).loss.backward()
    ref, got = grads(base), grads(model)
    for k in ref:
        within([got[k]], [ref[k]])


def test_region_without_torchs_op_under_offload_context_bitwise(own_path, tmp_path):
    """The chunks keep their gradients out of the offload hooks (Note [chunks in forward]) and
    sum in a fixed order: a step under the NVMe tier is bitwise the step without."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = spillover.wrap(tiny_llama(), policy="full")
    ids, labels = hf_batch()
    ref_out, ref = hf_step(model, ids, labels)
    model.zero_grad(set_to_none=True)
    with spillover.offload_context(tier="nvme", host_pool_bytes=16 << 20,
                                   nvme_path=str(tmp_path), min_offload_bytes=4096) as ctx:
        out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    assert ctx.stats().tensors_packed > 0
    assert torch.equal(out.loss, ref_out.loss)
    got = grads(model)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_path_line_names_the_path_and_versions():
    line = L.path_line()
    assert f"torch {torch.__version__}" in line and "transformers" in line
    assert L.backend() in line
