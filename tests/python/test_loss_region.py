"""The loss region (spillover/loss/): a HF causal LM's head and loss by chunks under
``spillover.wrap`` / ``hf.enable``, against HF's own loss: through torch's chunked
``linear_cross_entropy`` where this torch has it, spillover's own chunks elsewhere (Note [which
chunked loss]); tests/python/test_loss_fused.py runs spillover's chunks on every torch.

Tolerance: the chunked loss sums in another order than ``F.cross_entropy`` over the whole
logits, so loss and gradients are compared at rtol 1e-5, atol 1e-6 in fp32 (torch's own
defaults for fp32 in ``assert_close`` are rtol 1.3e-6, atol 1e-5; the atol is tightened, the
rtol widened for the weight gradient's longer sums). The opt-out is compared bitwise.
"""

from __future__ import annotations

import copy
import io
import logging
import warnings

import pytest
import torch
from torch.nn import functional as F

import spillover
from spillover import loss as L
from spillover.models import GPT, GPTConfig, synthetic_batch

transformers = pytest.importorskip("transformers")
from spillover.integrations import hf  # noqa: E402

# torch's own op and its options (torch 2.13+); the rest runs on every torch
needs_torch_op = pytest.mark.skipif(not L.available(),
                                    reason="torch without linear_cross_entropy (2.13+)")

VOCAB = 32000
RTOL, ATOL = 1e-5, 1e-6


def tiny(kind: str):
    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False)
        return transformers.LlamaForCausalLM(cfg).train()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0, use_cache=False)
        return transformers.GPT2LMHeadModel(cfg).train()
    if kind == "gemma2":  # final logit soft-capping (30): chunked with the loss
        cfg = transformers.Gemma2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, use_cache=False)
        return transformers.Gemma2ForCausalLM(cfg).train()
    if kind == "cohere":  # logits * logit_scale
        cfg = transformers.CohereConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, logit_scale=0.25, use_cache=False)
        return transformers.CohereForCausalLM(cfg).train()
    if kind == "granite":  # logits / logits_scaling
        cfg = transformers.GraniteConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, logits_scaling=4.0, use_cache=False)
        return transformers.GraniteForCausalLM(cfg).train()
    raise ValueError(kind)


def batch(seed: int = 0):
    """ids (2, 24) with right padding in row 0 (mask 0, labels -100) and ignored prompt
    positions in row 1 (labels -100, as a chat template masks the prompt)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    mask[0, 18:] = 0
    labels = ids.clone()
    labels[0, 18:] = -100
    labels[1, :5] = -100
    return ids, mask, labels


def grads(m):
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def step(m, ids, mask, labels, **kw):
    m.zero_grad(set_to_none=True)
    out = m(input_ids=ids, attention_mask=mask, labels=labels, **kw)
    out.loss.backward()
    return out, grads(m)


def close(ref, got):
    assert ref.keys() == got.keys() and ref
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=ATOL, msg=k)


def bitwise(ref, got):
    assert ref.keys() == got.keys() and ref
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


def turn_on(m, how: str, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # wrap's use_cache notice
        if how == "wrap":
            return spillover.wrap(m, policy="full", **kw)
        return hf.enable(m, policy="full", **kw)


class SavedSizes:
    """The largest tensor autograd saves in a forward (the logits, on HF's path)."""

    def __init__(self):
        self.largest = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    def pack(self, t):
        self.largest = max(self.largest, t.numel())
        return t

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)


def test_chunk_rows_rule():
    # Note [loss chunks]: the largest power of two with rows x vocab x 4 B <= 64 MiB, in
    # [256, 1024]
    assert L.chunk_rows(8192) == 1024
    assert L.chunk_rows(32768) == 512
    assert L.chunk_rows(32000) == 512
    assert L.chunk_rows(128256) == 256
    assert L.chunk_rows(50) == 1024
    if not L.available():
        return
    opt = L.options_for(32768)
    assert opt.batch_chunk_size == 512 and opt.chunking_method is None


def test_a_cap_shrinks_the_chunk_down_to_the_floor():
    # Note [loss chunk under a budget]: the largest power of two within the cap, at least 64
    hidden = 4096 * 512 * 4
    speed = 1024 * 8192 * 4 + hidden
    assert L.chunk_rows(8192, cap_bytes=speed, hidden_bytes=hidden) == 1024
    assert L.chunk_rows(8192, cap_bytes=speed - 1, hidden_bytes=hidden) == 512
    assert L.chunk_rows(8192, cap_bytes=256 * 8192 * 4 + hidden, hidden_bytes=hidden) == 256
    assert L.chunk_rows(8192, cap_bytes=1, hidden_bytes=hidden) == 64
    assert L.chunk_rows(8192, cap_bytes=10 << 30, hidden_bytes=hidden) == 1024  # never more


@needs_torch_op  # chunk_rows_seen watches torch's op; test_loss_fused.py has spillover's own
def test_limit_chunk_uses_fewer_rows_within_torchs_tolerance(chunk_rows_seen):
    """A capped chunk: more, smaller chunks (the rows torch is given), the same loss and
    gradients within torch's tolerance; the scope reports the transient of the speed rule's
    chunk and of the smallest one, whatever the cap."""
    torch.manual_seed(0)
    tokens, d, vocab = 2048, 64, 512
    h0, w0 = torch.randn(tokens, d), torch.randn(vocab, d) * 0.1
    y = torch.randint(0, vocab, (tokens,))
    seen = chunk_rows_seen

    def run(cap):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        scope = L.begin_scope()
        with L.limit_chunk(cap):
            loss = L.chunked_cross_entropy(h, w, y)
        reported = L.end_scope(scope)
        loss.backward()
        return loss.detach(), h.grad, w.grad, reported

    ref = run(None)
    hidden = tokens * d * 4
    capped = run(128 * vocab * 4 + hidden)
    assert seen == [1024, 128]
    for a, b in zip(ref[:3], capped[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert ref[3] == capped[3] == (1024 * vocab * 4 + hidden, 64 * vocab * 4 + hidden)
    with L.limit_chunk(64 * vocab * 4 + hidden):  # noqa: SIM117 (caps nest: the tighter wins)
        with L.limit_chunk(1 << 30):
            run(None)
    assert seen[-1] == 64


@pytest.mark.parametrize("how", ["wrap", "enable"])
@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_loss_and_grads_match_hf_without_logits(kind, how):
    base = tiny(kind)
    ids, mask, labels = batch()
    ref_out, ref = step(base, ids, mask, labels)
    with SavedSizes() as plain:
        base(input_ids=ids, attention_mask=mask, labels=labels)
    tokens = ids.numel()
    assert plain.largest >= tokens * VOCAB  # HF's path saves the logits (check the check)

    model = turn_on(copy.deepcopy(base), how)
    state = model._spillover_state
    assert state.loss_region is not None, state.loss_line
    with SavedSizes() as ours:
        out, got = step(model, ids, mask, labels)
    assert out.logits is None
    assert ours.largest < tokens * VOCAB // 8, "a tokens x vocab tensor was saved"
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL)
    close(ref, got)
    assert state.loss_region.calls == 1
    assert model.lm_head.__dict__.get("forward") is None  # the head is itself again
    line = spillover.explain(model).summary["loss region"]
    assert ("linear_cross_entropy" if L.available() else "spillover's chunks") in line


def test_gradient_accumulation_num_items_in_batch():
    base = tiny("llama")
    model = turn_on(copy.deepcopy(base), "wrap")
    micro = [batch(1), batch(2)]
    # as Trainer counts it: the targets not ignored, over all micro-batches of the step
    n = sum(int((lab[..., 1:] != -100).sum()) for _, _, lab in micro)
    for m in (base, model):
        m.zero_grad(set_to_none=True)
        for ids, mask, labels in micro:
            loss = m(input_ids=ids, attention_mask=mask, labels=labels,
                     num_items_in_batch=torch.tensor(n)).loss
            loss.backward()
    close(grads(base), grads(model))
    # the scaling is a sum over n, not a mean per micro-batch: the two differ here
    ids, mask, labels = micro[0]
    mean = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    summed = model(input_ids=ids, attention_mask=mask, labels=labels,
                   num_items_in_batch=n).loss
    ref = base(input_ids=ids, attention_mask=mask, labels=labels, num_items_in_batch=n).loss
    torch.testing.assert_close(summed, ref, rtol=RTOL, atol=ATOL)
    assert not torch.allclose(mean, summed)


def test_shift_labels_and_tuple_output():
    base = tiny("llama")
    model = turn_on(copy.deepcopy(base), "wrap")
    ids, mask, labels = batch(3)
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:].contiguous()
    ref = base(input_ids=ids, attention_mask=mask, shift_labels=shift, labels=labels).loss
    got = model(input_ids=ids, attention_mask=mask, shift_labels=shift, labels=labels).loss
    torch.testing.assert_close(got, ref, rtol=RTOL, atol=ATOL)
    tup = model(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    ref_tup = base(input_ids=ids, attention_mask=mask, labels=labels, return_dict=False)
    assert isinstance(tup, tuple)
    torch.testing.assert_close(tup[0], ref_tup[0], rtol=RTOL, atol=ATOL)
    assert all(t.dim() != 3 or t.shape[-1] != VOCAB for t in tup if torch.is_tensor(t))


@pytest.mark.parametrize("how", ["wrap", "enable"])
def test_opt_out_is_bitwise_hf(how):
    base = tiny("llama")
    model = turn_on(copy.deepcopy(base), how, chunked_loss=False)
    assert model._spillover_state.loss_region is None
    assert "chunked_loss=False" in model._spillover_state.loss_line
    ids, mask, labels = batch()
    ref_out, ref = step(base, ids, mask, labels)
    out, got = step(model, ids, mask, labels)
    assert torch.equal(out.loss, ref_out.loss)
    assert torch.equal(out.logits, ref_out.logits)
    bitwise(ref, got)


def test_without_labels_or_gradients_the_model_is_unchanged():
    base = tiny("llama")
    model = turn_on(copy.deepcopy(base), "wrap")
    ids, mask, labels = batch()
    assert torch.equal(model(input_ids=ids, attention_mask=mask).logits,
                       base(input_ids=ids, attention_mask=mask).logits)
    with torch.no_grad():  # evaluation with labels keeps HF's loss and logits
        a = model(input_ids=ids, attention_mask=mask, labels=labels)
        b = base(input_ids=ids, attention_mask=mask, labels=labels)
    assert torch.equal(a.loss, b.loss) and torch.equal(a.logits, b.logits)
    assert model._spillover_state.loss_region.calls == 0
    # a loss function the user sets afterwards runs as HF would run it
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    out = model(input_ids=ids, attention_mask=mask, labels=labels)
    assert out.logits is not None
    assert torch.equal(out.loss, out.logits.float().mean())


@pytest.mark.parametrize("kind", ["gemma2", "cohere", "granite"])
def test_logit_transforms_are_chunked_with_the_loss(kind):
    """Note [logit transforms]: Gemma 2's soft-capping, Cohere's and Granite's logit scales run
    in spillover's own chunks (torch's op has none): HF's loss and gradients, no logits."""
    base = tiny(kind)
    ids, mask, labels = batch()
    ref_out, ref = step(base, ids, mask, labels)
    model = turn_on(copy.deepcopy(base), "wrap")
    state = model._spillover_state
    assert state.loss_region is not None, state.loss_line
    assert "spillover's chunks" in spillover.explain(model).summary["loss region"]
    before = L.paths_run()[L.OWN]
    with SavedSizes() as ours:
        out, got = step(model, ids, mask, labels)
    assert L.paths_run()[L.OWN] == before + 1
    assert out.logits is None
    assert ours.largest < ids.numel() * VOCAB // 8, "a tokens x vocab tensor was saved"
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL)
    close(ref, got)


def test_a_transform_the_forward_does_not_show_is_left_alone_and_named(caplog):
    """A config that sets a logit transform its model's forward does not apply between head and
    loss as transformers writes it (here Llama, whose forward has no soft-capping): the model's
    own head and loss, the reason logged and in explain()."""
    base = tiny("llama")
    base.config.final_logit_softcapping = 30.0
    with caplog.at_level(logging.INFO, logger="spillover"):
        model = turn_on(copy.deepcopy(base), "wrap")
    state = model._spillover_state
    assert state.loss_region is None
    assert "final_logit_softcapping" in state.loss_line
    assert any("final_logit_softcapping" in r.getMessage() for r in caplog.records)
    ids, mask, labels = batch()
    ref_out, ref = step(base, ids, mask, labels)
    out, got = step(model, ids, mask, labels)
    assert torch.equal(out.loss, ref_out.loss) and out.logits is not None
    bitwise(ref, got)
    assert "final_logit_softcapping" in spillover.explain(model).summary["loss region"]


def test_unwrap_and_disable_restore_the_head():
    base = tiny("llama")
    ids, mask, labels = batch()
    for how, undo in (("wrap", spillover.unwrap), ("enable", hf.disable)):
        model = turn_on(copy.deepcopy(base), how)
        undo(model)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.logits is not None and out.logits.shape[-1] == VOCAB


def test_pickled_model_keeps_the_region():
    base = tiny("llama")
    model = turn_on(copy.deepcopy(base), "wrap")
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    ids, mask, labels = batch()
    out, got = step(loaded, ids, mask, labels)
    assert out.logits is None and loaded._spillover_state.loss_region.calls == 1
    close(step(base, ids, mask, labels)[1], got)
    spillover.unwrap(loaded)
    assert loaded(input_ids=ids, attention_mask=mask, labels=labels).logits is not None


def test_under_offload_context_bitwise_to_without(private_pool_bytes):
    base = turn_on(tiny("llama"), "wrap")
    ids, mask, labels = batch()
    ref_out, ref = step(base, ids, mask, labels)
    with spillover.offload_context(tier="host", host_pool_bytes=private_pool_bytes,
                                   min_offload_bytes=4096) as ctx:
        base.zero_grad(set_to_none=True)
        out = base(input_ids=ids, attention_mask=mask, labels=labels)
    out.loss.backward()
    assert ctx.stats().tensors_packed > 0
    assert torch.equal(out.loss, ref_out.loss)
    bitwise(ref, grads(base))


def test_torch_without_the_function(monkeypatch):
    """Below torch 2.13 (the op hidden here): spillover's own chunks, no warning, no logits,
    HF's loss and gradients within fp32 rounding; explain() names the path and why."""
    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    base = tiny("llama")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model = hf.enable(copy.deepcopy(base), policy="full")
    line = model._spillover_state.loss_line
    assert model._spillover_state.loss_region is not None, line
    assert "spillover's chunks" in line and "has no linear_cross_entropy" in line
    ids, mask, labels = batch()
    ref_out, ref = step(base, ids, mask, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, got = step(model, ids, mask, labels)
    assert out.logits is None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL)
    close(ref, got)


def test_builtin_gpt_chunked_loss():
    cfg = GPTConfig(vocab=8192, d_model=64, n_heads=4, n_layers=2, seq=64)
    torch.manual_seed(0)
    plain = GPT(cfg)
    chunked = copy.deepcopy(plain)
    chunked.spillover_chunked_loss = True  # what GPTConfig(chunked_loss=True) starts with
    idx, tgt = synthetic_batch(cfg, 4)
    for m in (plain, chunked):
        m.zero_grad(set_to_none=True)
        m(idx, tgt).backward()
    torch.testing.assert_close(chunked(idx, tgt), plain(idx, tgt), rtol=RTOL, atol=ATOL)
    close(grads(plain), grads(chunked))
    with SavedSizes() as s:
        chunked(idx, tgt)
    assert s.largest < idx.numel() * cfg.vocab // 4


def test_readme_snippet():
    import pathlib
    import re

    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    section = readme.read_text().split("### The loss region", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "README: one python block under ### The loss region"
    ns: dict = {}
    with SavedSizes() as s:
        exec(compile(blocks[0], "README.md", "exec"), ns)
    assert ns["h"].grad is not None and torch.isfinite(ns["loss"])
    assert s.largest < 2 * 512 * 32000 // 8  # no logits were saved
    ref = F.cross_entropy((ns["h"][:, :-1] @ ns["head"].weight.t()).flatten(0, 1),
                          ns["labels"][:, 1:].flatten())
    torch.testing.assert_close(ns["loss"], ref, rtol=RTOL, atol=ATOL)


def test_peft_lora_under_enable():
    peft = pytest.importorskip("peft")
    base = tiny("llama")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "v_proj"])
    plain = peft.get_peft_model(copy.deepcopy(base), cfg)
    for n, p in plain.named_parameters():  # nonzero B, so the adapters' gradients are not 0
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    model = hf.enable(copy.deepcopy(plain), policy="full")
    assert model.base_model.model._spillover_state.loss_region is not None
    ids, mask, labels = batch()
    ref_out, ref = step(plain, ids, mask, labels)
    out, got = step(model, ids, mask, labels)
    assert out.logits is None and ref_out.logits is not None
    torch.testing.assert_close(out.loss, ref_out.loss, rtol=RTOL, atol=ATOL)
    close(ref, got)
    assert any("lora_B" in k for k in got)


def test_wrap_turns_the_builtin_gpt_loss_region_on_and_unwrap_restores_it():
    """spillover.wrap sets the built-in GPT's switch (spillover.loss.FlagRegion): the same loss
    and gradients, within torch's tolerance for the chunked loss, as the plain model, no
    tokens x vocab tensor saved; explain() names it; unwrap turns it off again;
    chunked_loss=False leaves the logits."""
    cfg = GPTConfig(vocab=8192, d_model=64, n_heads=4, n_layers=2, seq=64)
    torch.manual_seed(0)
    plain = GPT(cfg)
    wrapped = spillover.wrap(copy.deepcopy(plain), policy="full")
    assert wrapped.spillover_chunked_loss is True
    line = spillover.explain(wrapped).summary["loss region"]
    assert ("chunked linear_cross_entropy" if L.available() else "spillover's chunks") in line
    idx, tgt = synthetic_batch(cfg, 4)
    for m in (plain, wrapped):
        m.zero_grad(set_to_none=True)
        m(idx, tgt).backward()
    close(grads(plain), grads(wrapped))
    with SavedSizes() as s:
        wrapped(idx, tgt)
    assert s.largest < idx.numel() * cfg.vocab // 4
    spillover.unwrap(wrapped)
    assert wrapped.spillover_chunked_loss is False
    kept = spillover.wrap(copy.deepcopy(plain), policy="full", chunked_loss=False)
    assert kept.spillover_chunked_loss is False


def test_a_second_backward_through_the_chunked_loss_names_the_switch():
    """The chunked loss (torch's op, spillover's chunks alike) runs one backward per forward:
    retain_graph=True and a second backward raise an error that says how to get the plain
    loss."""
    cfg = GPTConfig(vocab=512, d_model=32, n_heads=2, n_layers=1, seq=32)
    torch.manual_seed(0)
    model = spillover.wrap(GPT(cfg), policy="full")
    idx, tgt = synthetic_batch(cfg, 2)
    loss = model(idx, tgt)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="chunked_loss=False"):
        loss.backward()
