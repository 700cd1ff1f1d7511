"""torch.compile under offload_context (Note [compiled modules] in activations/registry.py): the
same graphs and breaks as without the context, and offload still happens where the compiled graph
saves tensors through autograd, with gradients bitwise equal to the compiled run without it."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import assert_bitwise, grads

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch

CFG = dict(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64)


def context(tier, tmp_path):
    kw = {"nvme_path": str(tmp_path)} if tier == "nvme" else {}
    return spillover.offload_context(tier, host_pool_bytes="64MiB", min_offload_bytes=0, **kw)


def graphs_and_breaks(fn, *args, ctx=None):
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if ctx is None:
            e = torch._dynamo.explain(fn)(*args)
        else:
            with ctx:
                e = torch._dynamo.explain(fn)(*args)
    return e.graph_count, e.graph_break_count, [str(r.reason)[:200] for r in e.break_reasons]


def gpt_cases():
    for attn in ("explicit", "sdpa"):
        for policy in (None, "selective"):
            yield pytest.param(attn, policy, id=f"{attn}-{policy or 'plain'}")


@pytest.mark.parametrize("tier", ["host", "nvme"])
@pytest.mark.parametrize("attn,policy", list(gpt_cases()))
def test_gpt_compiles_into_the_same_graphs_under_the_context(tmp_path, tier, attn, policy):
    cfg = GPTConfig(**CFG, attn=attn)
    torch.manual_seed(0)
    model = GPT(cfg)
    if policy:
        model = spillover.wrap(model, policy=policy)
    idx, tgt = synthetic_batch(cfg, batch=2)
    plain = graphs_and_breaks(model, idx, tgt)
    under = graphs_and_breaks(model, idx, tgt, ctx=context(tier, tmp_path))
    assert plain[:2] == (1, 0), plain
    assert under == plain


def test_hf_llama_compiles_into_the_same_graphs_under_the_context(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).train()
    ids = torch.randint(0, 32000, (2, 32))

    def loss(i):
        return model(input_ids=i, labels=i, use_cache=False).loss

    plain = graphs_and_breaks(loss, ids)
    under = graphs_and_breaks(loss, ids, ctx=context("host", tmp_path))
    assert under == plain, (plain, under)


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_compiled_fullgraph_offloads_and_is_bitwise(tmp_path, tier):
    """AOTAutograd saves the compiled graph's tensors through autograd, so the pack hook sees
    them at run time: they are offloaded (parameters kept) and come back bitwise. aot_eager
    saves the tensors inductor would and compiles in seconds on a CPU."""
    cfg = GPTConfig(**CFG)
    torch.manual_seed(0)
    model = GPT(cfg)
    twin = copy.deepcopy(model)
    idx, tgt = synthetic_batch(cfg, batch=2)
    torch.compile(model, backend="aot_eager", fullgraph=True)(idx, tgt).backward()
    ref = grads(model)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    ctx = context(tier, tmp_path)
    for _ in range(2):
        twin.zero_grad(set_to_none=True)
        with warnings.catch_warnings():
            # A compiled graph's backward unpacks all it saved at once: the guardrail says so.
            warnings.filterwarnings("ignore", "spillover: .*compiled", RuntimeWarning)
            with ctx:
                loss = compiled(idx, tgt)
            loss.backward()
        assert_bitwise(grads(twin), ref)
        s = ctx.stats()
        assert s.bytes_offloaded_host + s.bytes_offloaded_nvme > 0, s
        assert s.bytes_kept_parameter > 0, s
