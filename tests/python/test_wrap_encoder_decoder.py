"""spillover.wrap on real model code: encoder-decoder models (every block list is
wrapped, gradients bitwise equal to the plain run with dropout on, caches kept out of regions),
torch.save / torch.load of a wrapped model, and explain() before the first step."""

import contextlib
import copy
import io
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import assert_bitwise, grads, loss_cap_of
from torch import nn

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch
from spillover.planner import Machine
from spillover.recompute import blocks as _blocks

transformers = pytest.importorskip("transformers")

# Fixed rates, so no test calibrates the machine.
MACHINE = Machine({"float32": 1e11}, 5e9, 6e9, 6e9, 3e9, 2e9)
STEPS = 3


def _t5():
    cfg = transformers.T5Config(
        vocab_size=32128, d_model=64, d_ff=128, num_layers=2, num_heads=4, d_kv=16,
        dropout_rate=0.1, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(cfg)


def _bart():
    cfg = transformers.BartConfig(
        vocab_size=50265, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.1, attention_dropout=0.1,
        activation_dropout=0.1,
    )
    return transformers.BartForConditionalGeneration(cfg)


MODELS = {"t5": _t5, "bart": _bart}
BLOCKS = {
    "t5": ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1"],
    "bart": ["model.encoder.layers.0", "model.encoder.layers.1", "model.decoder.layers.0",
             "model.decoder.layers.1"],
}


@pytest.fixture(scope="module", params=list(MODELS))
def seq2seq(request):
    torch.manual_seed(0)
    model = MODELS[request.param]().train()  # dropout on: the RNG must replay identically
    vocab = model.config.vocab_size
    batches = [(torch.randint(2, vocab, (2, 16)), torch.randint(2, vocab, (2, 12)))
               for _ in range(STEPS)]
    return request.param, model, batches


def _step(model, batch, seed, ctx=None, use_cache=None):
    model.zero_grad(set_to_none=True)
    ids, labels = batch
    torch.manual_seed(seed)  # the same dropout masks in every run
    with ctx or contextlib.nullcontext():
        if use_cache is None:
            loss = model(input_ids=ids, labels=labels).loss
        else:  # with labels=, BART turns use_cache off itself
            logits = model(input_ids=ids, decoder_input_ids=labels, use_cache=use_cache).logits
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, :12].flatten())
    loss.backward()
    return grads(model)


def _policy(name):
    if name == "auto":
        # A budget below what the model holds: the planner must recompute and offload.
        return spillover.Planner(budget_bytes=1, machine=MACHINE)
    return name


def _wrap(model, policy):
    with pytest.warns(UserWarning, match="use_cache=False"):
        spillover.wrap(model, policy=_policy(policy))
    return model


@pytest.mark.parametrize("tier", [None, "host"])
@pytest.mark.parametrize("policy", ["full", "selective", "offload", "auto"])
def test_encoder_decoder_gradients_bitwise(seq2seq, policy, tier, private_pool_bytes):
    """Every block list is a region list, and several steps are bitwise the plain model's."""
    kind, base, batches = seq2seq
    plain = copy.deepcopy(base)
    refs = [_step(plain, b, seed=i) for i, b in enumerate(batches)]
    model = _wrap(copy.deepcopy(base), policy)
    assert [n for n, _ in model._spillover_state.blocks] == BLOCKS[kind]
    # the decoder's config is a copy of the model's: wrap turns use_cache off in each
    assert all(getattr(m.config, "use_cache", False) is False
               for m in model.modules() if hasattr(m, "config"))
    ctx = (spillover.offload_context(tier, min_offload_bytes=4096,
                                     host_pool_bytes=private_pool_bytes) if tier else None)
    for i, b in enumerate(batches):
        assert_bitwise(refs[i], _step(model, b, seed=i, ctx=ctx))


@pytest.mark.parametrize("policy", ["full", "selective", "offload", "auto"])
def test_encoder_decoder_under_hf_enable_bitwise(seq2seq, policy):
    """The same models behind HF's own switch (spillover.integrations.hf.enable)."""
    from spillover.integrations import hf

    kind, base, batches = seq2seq
    plain = copy.deepcopy(base)
    model = hf.enable(copy.deepcopy(base), policy=_policy(policy))
    for i, b in enumerate(batches):
        assert_bitwise(_step(plain, b, seed=i), _step(model, b, seed=i))
    if policy != "auto":  # the planner keeps its records itself
        assert [r.name for r in model._spillover_state.last_records()] == BLOCKS[kind]


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_cache_passed_to_a_region_is_dropped(seq2seq, policy):
    """use_cache=True in training: the decoder makes an EncoderDecoderCache that its forward
    fills; recomputation saw it filled (T5: 56 tensors saved, then 52; selective: a slice that
    ran only in recomputation). Regions now run without it (Note [caches in regions])."""
    kind, base, batches = seq2seq
    plain = copy.deepcopy(base)
    ref = _step(plain, batches[0], seed=0, use_cache=True)
    model = _wrap(copy.deepcopy(base), policy)
    with pytest.warns(UserWarning, match="runs without a KV cache"):
        got = _step(model, batches[0], seed=0, use_cache=True)
    assert_bitwise(ref, got)
    assert_bitwise(_step(plain, batches[1], seed=1, use_cache=True),
                   _step(model, batches[1], seed=1, use_cache=True))


def test_encoder_decoder_holds_no_more_than_hf_checkpointing(seq2seq, private_pool_bytes):
    """What an offload context takes per step under wrap(policy="full") is at most what it takes
    under HF's own gradient_checkpointing_enable; with the decoder's list alone (what wrap
    picked before) it was more."""
    kind, base, batches = seq2seq

    def packed(model):
        ctx = spillover.offload_context("host", min_offload_bytes=0,
                                        host_pool_bytes=private_pool_bytes)
        for i in range(2):
            _step(model, batches[0], seed=i, ctx=ctx)
        return ctx.stats().bytes_packed

    hf_model = copy.deepcopy(base)
    if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
        hf_model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        hf_model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    hf_bytes = packed(hf_model)
    ours = packed(_wrap(copy.deepcopy(base), "full"))
    decoder_only = copy.deepcopy(base)
    dec = [m for n, m in decoder_only.named_modules() if n in BLOCKS[kind][2:]]
    with pytest.warns(UserWarning, match="use_cache=False"):
        spillover.wrap(decoder_only, policy="full", check_fn=lambda m: any(m is d for d in dec))
    assert ours <= hf_bytes < packed(decoder_only)


def test_block_lists_inside_blocks_and_next_to_them():
    """Note [block lists]: the outermost lists of blocks; lists inside a block, and a list of
    leaf heads next to the blocks, are not regions."""

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)])

        def forward(self, x):
            for p in self.parts:
                x = torch.tanh(p(x))
            return x

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.ModuleList([Block(), Block()])
            self.dec = nn.ModuleList([Block()])
            self.heads = nn.ModuleList([nn.Linear(8, 2) for _ in range(4)])

        def forward(self, x):
            for b in [*self.enc, *self.dec]:
                x = b(x)
            return sum(h(x).sum() for h in self.heads)

    torch.manual_seed(0)
    net = Net()
    wrapped = spillover.wrap(copy.deepcopy(net), policy="full")
    assert [n for n, _ in wrapped._spillover_state.blocks] == ["enc.0", "enc.1", "dec.0"]
    x = torch.randn(4, 8)
    net(x).backward()
    wrapped(x).backward()
    assert_bitwise(grads(net), grads(wrapped))
    # a list of leaf modules alone is still wrapped, as before
    only_heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
    assert len(_blocks._find_blocks(only_heads, None)) == 3


def _gpt():
    torch.manual_seed(0)
    # chunked_loss: the loss wrap gives the model, so the plain reference is the same math
    cfg = GPTConfig(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64, dropout=0.1,
                    chunked_loss=True)
    return GPT(cfg), synthetic_batch(cfg, batch=4)


def _gpt_step(model, batch, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = model(*batch)
    loss.backward()
    return loss.detach(), grads(model)


@pytest.mark.parametrize("policy", ["full", "selective", "offload", "auto"])
def test_torch_save_and_load_a_wrapped_model(policy):
    """Note [pickling a wrapped model]: the loaded model is wrapped with the same policy, and
    gives the original's losses and gradients."""
    base, batch = _gpt()
    model = spillover.wrap(copy.deepcopy(base), policy=_policy(policy))
    _gpt_step(model, batch, seed=0)  # a policy that learned something is saved too
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    state = loaded._spillover_state
    assert type(state.policy) is type(model._spillover_state.policy)
    assert [n for n, _ in state.blocks] == ["blocks.0", "blocks.1"]
    assert all(isinstance(b, _blocks._WrappedBlock) and b._spillover_block[0] is state
               for b in loaded.blocks)
    for seed in range(1, 3):
        want, got = _gpt_step(model, batch, seed), _gpt_step(loaded, batch, seed)
        # auto: each against the plain model with the loss chunk its plan ran (loss_cap_of);
        # the loaded planner learns again, so its step may run another chunk than the saved
        with spillover.loss.limit_chunk(loss_cap_of(loaded)):
            plain = _gpt_step(base, batch, seed)
        if loss_cap_of(model) == loss_cap_of(loaded):
            assert torch.equal(want[0], got[0])
            assert_bitwise(want[1], got[1])
        assert torch.equal(plain[0], got[0])
        assert_bitwise(plain[1], got[1])
    assert str(spillover.explain(loaded, machine=MACHINE)).count("regions") >= 1
    spillover.unwrap(loaded)
    assert type(loaded.blocks[0]) is type(base.blocks[0])


def test_a_saved_wrapped_model_loads_in_a_new_process(tmp_path):
    """A new process has made no Spillover<cls> class: loading must not need one by name."""
    base, batch = _gpt()
    model = spillover.wrap(copy.deepcopy(base), policy="selective")
    torch.save({"model": model, "batch": batch}, tmp_path / "m.pt")
    want, _ = _gpt_step(model, batch, seed=5)
    code = textwrap.dedent(f"""
        import torch
        d = torch.load({str(tmp_path / "m.pt")!r}, weights_only=False)
        m = d["model"]
        assert type(m.blocks[0]).__name__ == "SpilloverBlock", type(m.blocks[0])
        torch.manual_seed(5)
        loss = m(*d["batch"])
        loss.backward()
        torch.save(loss.detach(), {str(tmp_path / "loss.pt")!r})
    """)
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)
    assert torch.equal(torch.load(tmp_path / "loss.pt"), want)


@pytest.mark.parametrize("policy", ["full", "selective", "offload", "auto"])
def test_explain_before_the_first_step_says_so(policy):
    base, batch = _gpt()
    model = spillover.wrap(copy.deepcopy(base), policy=_policy(policy))
    text = str(spillover.explain(model, machine=MACHINE))
    assert "no step recorded yet" in text and "run one" in text
    with torch.no_grad():
        model(*batch)  # no gradients: no regions ran, nothing to explain yet
    assert "no step recorded yet" in str(spillover.explain(model, machine=MACHINE))
    _gpt_step(model, batch, seed=0)
    text = str(spillover.explain(model, machine=MACHINE))
    assert "no step recorded yet" not in text and "2 regions" in text


def test_torch_save_and_load_a_model_under_hf_enable():
    """spillover.integrations.hf.enable's parts pickle too: the loaded model is still enabled,
    its layers call the loaded state's checkpoint function, and it gives the same gradients."""
    from spillover.integrations import hf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2)
    base = transformers.LlamaForCausalLM(cfg).train()
    model = hf.enable(copy.deepcopy(base), policy="selective", chunked_loss=False)
    ids = torch.randint(0, 32000, (2, 16))

    def step(m):
        m.zero_grad(set_to_none=True)
        m(input_ids=ids, labels=ids).loss.backward()
        return grads(m)

    step(model)
    # HF's own switch adds a forward hook made of a local function (enable_input_require_grads),
    # which no pickle can save, with or without spillover: drop it, as a user saving must.
    model.disable_input_require_grads()
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert hf.is_enabled(loaded)
    state = loaded._spillover_state
    assert all(layer._gradient_checkpointing_func is state.func for layer in loaded.model.layers)
    assert_bitwise(step(base), step(loaded))
    assert [r.name for r in state.last_records()] == ["model.layers.0", "model.layers.1"]
    loaded.gradient_checkpointing_enable()  # HF's switch still installs spillover's function
    assert loaded.model.layers[0]._gradient_checkpointing_func is state.func
    hf.disable(loaded)
    assert not hf.is_enabled(loaded)
