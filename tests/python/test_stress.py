"""A fixed slice of the stress harness (issue 20; ``benches/python/stress.py`` draws random
cases for as long as it is given): real transformers model code (GPT-2, Llama, Mistral, Qwen2,
Gemma, BERT-MaskedLM) and a pure-torch RMSNorm chain, built from tiny configs with realistic
vocabularies (the logits storage is larger than half the pool: offloaded in pieces), dropout
on, sequence lengths changing between steps, both tiers, every policy, one context object over
several steps; every step's loss and gradients bitwise equal to the plain run's
(``_stress_models.run_case``). Plus the two reproducers of the NVMe tier's "the plan reads only
entries on disk" panic on a second step."""

import copy
import tempfile

import pytest
import torch
from _stress_models import MIB, Case, run_case
from conftest import assert_bitwise, grads

import spillover

pytest.importorskip("transformers", reason="the stress cases run transformers model code")

# Each pool size appears once in this module (pools are shared per capacity within a process:
# an odd size keeps other tests' blocks out of the drain check at the end of each case).
K = 4096
SLICE = [
    Case("gpt2", 50257, seqs=(32, 48, 32), tier="host", pool_bytes=16 * MIB + 1 * K,
         policy="none", attn="sdpa", seed=1),
    Case("gpt2", 32768, seqs=(40, 24), tier="nvme", pool_bytes=16 * MIB + 2 * K,
         policy="auto", budget_bytes=1, attn="eager", seed=2),
    Case("llama", 32000, kv_heads=2, seqs=(64, 40, 64), tier="nvme", pool_bytes=16 * MIB + 3 * K,
         policy="full", attn="eager", seed=3),
    Case("llama", 65536, seqs=(24, 32), tier="host", pool_bytes=20 * MIB + 4 * K,
         policy="selective", attn="sdpa", pad=True, seed=4),
    Case("mistral", 32768, kv_heads=2, seqs=(48, 32, 48), tier="nvme",
         pool_bytes=16 * MIB + 5 * K, policy="selective", attn="sdpa", window=16, seed=5),
    Case("qwen2", 49152, kv_heads=1, seqs=(32, 56), tier="host", pool_bytes=24 * MIB + 6 * K,
         policy="offload", attn="eager", seed=6),
    Case("gemma", 32000, heads=2, kv_heads=1, seqs=(40, 32, 40), tier="nvme",
         pool_bytes=16 * MIB + 7 * K, policy="offload", attn="sdpa", seed=7),
    Case("bert", 32000, seqs=(32, 48), tier="host", pool_bytes=16 * MIB + 8 * K,
         policy="full", attn="eager", pad=True, seed=8),
    Case("bert", 50304, seqs=(40, 40, 24), tier="nvme", pool_bytes=16 * MIB + 9 * K,
         policy="none", attn="sdpa", min_offload_bytes=65536, seed=9),
    Case("rmschain", 32768, hidden=128, seqs=(64, 32, 64), tier="nvme",
         pool_bytes=16 * MIB + 10 * K, policy="none", seed=10),
    Case("rmschain", 100277, seqs=(16, 24), tier="host", pool_bytes=16 * MIB + 11 * K,
         policy="auto", budget_bytes=16 * MIB, seed=11),
    # Llama 3's vocabulary: 16 MiB of logits for 32 tokens; priced as a fast GPU host
    Case("qwen2", 128256, hidden=128, heads=8, kv_heads=2, batch=1, seqs=(32, 24, 32),
         tier="nvme", pool_bytes=16 * MIB + 12 * K, policy="selective", attn="eager",
         rates=(3e13, 2e11, 2.5e10, 2.5e10, 6e9, 7e9), seed=12),
    Case("gpt2", 65536, hidden=96, heads=2, seqs=(48, 64), tier="nvme",
         pool_bytes=16 * MIB + 13 * K, policy="offload", attn="sdpa", pad=True, seed=13),
    Case("gemma", 50257, hidden=128, heads=4, kv_heads=1, seqs=(24, 40), tier="host",
         pool_bytes=24 * MIB + 14 * K, policy="auto", budget_bytes=256 * MIB, attn="eager",
         seed=14),
    # no size given: the default pool starts at 64 MiB and grows mid-step (Note [growing pool])
    Case("llama", 128256, hidden=128, seqs=(96, 128), tier="nvme", pool_bytes=0,
         policy="none", attn="sdpa", seed=15),
    Case("gpt2", 100277, hidden=96, heads=2, seqs=(96, 128), tier="host", pool_bytes=0,
         policy="offload", attn="eager", seed=16),
    # compiled (Note [one hook for the run]): the whole model, and block by block after wrap
    Case("llama", 32000, seqs=(32, 32, 32), tier="nvme", pool_bytes=16 * MIB + 16 * K,
         policy="none", attn="sdpa", compile="model", seed=17),
    Case("qwen2", 49152, kv_heads=2, seqs=(32, 32, 32), tier="host",
         pool_bytes=16 * MIB + 17 * K, policy="selective", attn="sdpa", compile="blocks",
         seed=18),
    # on the simulated device with the verify mode on (Note [verify on the device])
    Case("llama", 32000, kv_heads=2, seqs=(48, 32, 48), tier="nvme", pool_bytes=16 * MIB + 18 * K,
         policy="none", attn="sdpa", sim_link=4e9 + 1, seed=19),
    Case("gpt2", 50257, seqs=(32, 40), tier="host", pool_bytes=20 * MIB + 19 * K,
         policy="selective", attn="eager", pad=True, sim_link=2e9 + 3, seed=20),
]


# a host pool smaller than the step is part of the test, its guardrail warning expected
@pytest.mark.filterwarnings("ignore:spillover. the .* host pool was full:RuntimeWarning")
@pytest.mark.parametrize("case", SLICE, ids=lambda c: f"{c.family}-{c.tier}-{c.policy}-{c.attn}"
                         + (f"-compiled-{c.compile}" if c.compile else "")
                         + ("-sim-verify" if c.sim_link else ""))
def test_slice(case):
    out = run_case(case)
    assert out.ok, f"{case.short()}\n{case.to_json()}\n{out.describe()}"
    assert out.steps_done == case.steps
    # the case exercised what it is here for: bytes left the device; on NVMe, with a pool
    # smaller than the logits, some went to disk and a storage went in pieces
    st = out.stats
    assert st["bytes_offloaded_host"] + st["bytes_offloaded_nvme"] > 0, st
    if case.tier == "nvme":
        assert st["bytes_offloaded_nvme"] > 0, st
        # (a compiled graph saves no logits-sized storage of its own)
        assert case.compile or st["tensors_chunked"] > 0, st
    if not case.pool_bytes:  # the default pool grows rather than keep tensors on the device
        assert st["bytes_kept_pool_full"] == 0, st
        if case.tier == "host":  # (on NVMe what finds no room is written from the tensor)
            assert st["pool_capacity"] > 64 * MIB, st


def test_slice_covers_the_issue():
    """The slice names every family, both tiers, every policy and both attention kinds."""
    from _stress_models import ATTENTION, COMPILE, FAMILIES, POLICIES, TIERS

    assert {c.family for c in SLICE} == set(FAMILIES)
    assert {c.tier for c in SLICE} == set(TIERS)
    assert {c.policy for c in SLICE} == set(POLICIES)
    assert {c.attn for c in SLICE} == set(ATTENTION)
    assert all(32000 <= c.vocab <= 131072 for c in SLICE)
    assert {c.compile for c in SLICE} == set(COMPILE)
    assert any(c.sim_link for c in SLICE)


def test_first_calibration_keeps_dropout_masks(tmp_path, monkeypatch):
    """"selective" priced by this machine's calibration, measured on first use (no cache, none
    in the process yet) in the middle of the first forward: the dropout masks drawn after it
    must still be the plain run's."""
    from spillover import planner

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(planner, "_machines", {})
    case = Case("llama", 32000, seqs=(24, 32), tier="host", pool_bytes=16 * MIB + 15 * K,
                policy="selective", calibrated=True, seed=15)
    out = run_case(case)
    assert out.ok, f"{case.short()}\n{case.to_json()}\n{out.describe()}"


def test_rmsnorm_chain_nvme_second_step():
    """Reproducer: one storage saved through several views (``y`` by pow, mul and mean),
    a 4 MiB NVMe pool, many small offloads; the second step panicked ("the plan reads only
    entries on disk")."""
    torch.manual_seed(0)
    x = torch.randn(1024, 256, requires_grad=True)
    ws = [torch.randn(256, 256, requires_grad=True) for _ in range(8)]

    def step(ctx=None):
        for t in [x, *ws]:
            t.grad = None
        if ctx is None:
            y = x
            for w in ws:
                y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
                y = y @ w
            loss = y.square().mean()
        else:
            with ctx:
                y = x
                for w in ws:
                    y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
                    y = y @ w
                loss = y.square().mean()
        loss.backward()
        return [loss.detach(), x.grad.clone(), *(w.grad.clone() for w in ws)]

    ctx = spillover.offload_context(tier="nvme", nvme_path=tempfile.mkdtemp(),
                                    host_pool_bytes="4MiB", min_offload_bytes=4096)
    for _ in range(2):
        ref = step()
        got = step(ctx)
        assert_bitwise(ref, got)


def test_llama_full_nvme_64mib_three_steps():
    """Reproducer: LlamaForCausalLM (vocab 32768, hidden 256, 4 layers) wrapped "full", a 64 MiB
    NVMe pool (the 128 MiB logits go in pieces), ids (2, 512), 3 steps."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32768, hidden_size=256, intermediate_size=1024,
                      num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
                      use_cache=False)
    base = LlamaForCausalLM(cfg)
    # bitwise against HF's own loss: the loss region off (test_loss_region.py covers it)
    model = spillover.wrap(copy.deepcopy(base), policy="full", chunked_loss=False)
    ctx = spillover.offload_context(tier="nvme", nvme_path=tempfile.mkdtemp(),
                                    host_pool_bytes="64MiB")
    for step in range(3):
        ids = torch.randint(0, 32768, (2, 512), generator=torch.Generator().manual_seed(step))
        base.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
        ref = base(input_ids=ids, labels=ids).loss
        ref.backward()
        with ctx:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert torch.equal(ref, loss), f"step {step}: loss {ref.item()} != {loss.item()}"
        assert_bitwise(grads(base), grads(model))
