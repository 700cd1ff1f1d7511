import copy
import gc
import time

import pytest
import torch

import spillover
from spillover.models import GPT, GPTConfig, synthetic_batch

# Each test that checks pool accounting gets a pool of its own capacity (pools are shared per
# capacity within a process), so other tests' live blocks cannot blur its counts.
_next_pool = [200 << 20]


@pytest.fixture
def private_pool_bytes():
    _next_pool[0] += 4096
    return _next_pool[0]


def grads(model):
    return [p.grad.detach().clone() if p.grad is not None else None for p in model.parameters()]


def assert_bitwise(a, b):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert (x is None) == (y is None), f"gradient {i}: one side is None"
        if x is not None:
            assert x.dtype == y.dtype and x.shape == y.shape
            assert torch.equal(x, y), f"gradient {i} differs: max |d| = {(x - y).abs().max()}"


def loss_cap_of(wrapped):
    """The cap on the loss chunk ``wrapped``'s last step ran with (None: the speed rule's): an
    "auto" plan shrinks the chunk when the speed rule's does not fit its budget (Note [loss
    chunk under a budget] in spillover/loss/chunked.py), which changes the order the head's
    gradient sums in. A plain reference run under ``spillover.loss.limit_chunk(cap)`` does the
    same math."""
    return wrapped._spillover_state.policy.loss_cap()


def same_loss_ref(base, batch, wrapped):
    """The plain step of ``base`` with the loss chunk ``wrapped``'s last step used
    (:func:`loss_cap_of`)."""
    with spillover.loss.limit_chunk(loss_cap_of(wrapped)):
        return gpt_step(base, batch)


@pytest.fixture
def chunk_rows_seen(monkeypatch):
    """The rows per chunk of every chunked loss call made in the test (torch's
    ``linear_cross_entropy`` watched), in call order."""
    seen = []
    real = torch.nn.functional.linear_cross_entropy

    def spy(*a, options=None, **kw):
        seen.append(options.batch_chunk_size)
        return real(*a, options=options, **kw)

    monkeypatch.setattr(torch.nn.functional, "linear_cross_entropy", spy)
    return seen


def gpt_step(model, batch, ctx=None, outside=True):
    """One forward/backward; with `outside`, backward runs after the `with` block."""
    model.zero_grad(set_to_none=True)
    idx, tgt = batch
    if ctx is None:
        loss = model(idx, tgt)
        loss.backward()
        return grads(model)
    with ctx:
        loss = model(idx, tgt)
        if not outside:
            loss.backward()
    if outside:
        loss.backward()
    return grads(model)


def _tiny_gpt(chunked_loss):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab=128, d_model=64, n_heads=4, n_layers=2, seq=64,
                    chunked_loss=chunked_loss)
    return GPT(cfg), synthetic_batch(cfg, batch=4)


@pytest.fixture
def tiny_gpt():
    """The plain model: its head makes the logits, which the offload context then takes."""
    return _tiny_gpt(False)


@pytest.fixture
def tiny_gpt_cl():
    """For models spillover.wrap wraps: the chunked loss wrap gives the model, so that the plain
    reference computes the same math (wrap(chunked_loss=False) keeps the logits instead)."""
    return _tiny_gpt(True)


def clone_model(m):
    return copy.deepcopy(m)


def drained(c, timeout=5.0):
    """Pool and swap bytes in use once everything a finished context held has gone back: its
    copies landed, its entries freed (garbage collected), the tier's I/O finished. A copy
    worker lets go of its last references a moment after the copy is seen done, so this polls
    (up to ``timeout`` seconds) instead of reading once."""
    deadline = time.monotonic() + timeout
    while True:
        c.synchronize()
        gc.collect()
        c.synchronize()
        s = c.stats()
        if (s.pool_in_use, s.swap_in_use) == (0, 0) or time.monotonic() > deadline:
            return s.pool_in_use, s.swap_in_use
        time.sleep(0.01)


__all__ = ["assert_bitwise", "drained", "gpt_step", "grads", "clone_model", "spillover"]


@pytest.fixture(params=["sdpa", "eager"])
def tiny_hf_llama(request):
    """An HF Llama of 3 layers (hidden 64) with a realistic vocabulary (32000), with fused
    (SDPA) and explicit (eager) attention, and a batch of token ids (2 x 32)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation=request.param)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    return model, ids
