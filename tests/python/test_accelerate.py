"""accelerate as its users run it: ``Accelerator().prepare`` with ``OffloadAdamW``, the offload
context around the forward (NVMe tier), ``accelerator.backward``, ``save_state`` and
``load_state``. Four steps bitwise equal to the same run with torch's fused AdamW and no
context; a run resumed from the state saved after step 2 bitwise equal to the run that went on;
fp32 and ``mixed_precision="bf16"``. And the README's snippet."""

from __future__ import annotations

import pathlib
import re
import tempfile
import warnings

import pytest
import torch

import spillover

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

VOCAB = 32000
STEPS = 4


def accelerator(mixed_precision):
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(True)  # one process, several precisions
    return accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(cfg)


def run(offload, mixed_precision, save_after=None, resume=None, tmp=None):
    """Steps 0..STEPS-1 (from 2 when ``resume`` is a saved state); the trained parameters."""
    acc = accelerator(mixed_precision)
    model = llama()
    opt = (spillover.OffloadAdamW(model.parameters(), lr=1e-3, tier="host") if offload
           else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    model, opt = acc.prepare(model, opt)
    if resume is not None:
        acc.load_state(resume)
    ctx = (spillover.offload_context("nvme", nvme_path=tempfile.mkdtemp(dir=tmp),
                                     host_pool_bytes="32MiB", min_offload_bytes=0)
           if offload else None)
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, VOCAB, (2, 32), generator=g) for _ in range(STEPS)]
    for step in range(2 if resume is not None else 0, STEPS):
        ids = data[step]
        if ctx is None:
            loss = model(input_ids=ids, labels=ids).loss
        else:
            with ctx:
                loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        if save_after == step + 1:
            acc.save_state(str(tmp / "state"))
    if ctx is not None:
        assert ctx.stats(total=True).bytes_offloaded_nvme > 0
    return {n: p.detach().clone() for n, p in acc.unwrap_model(model).named_parameters()}


def same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("mixed_precision", ["no", "bf16"])
def test_prepare_offload_save_and_resume_bitwise(tmp_path, mixed_precision):
    ref = run(False, mixed_precision)
    got = run(True, mixed_precision, save_after=2, tmp=tmp_path)
    assert same(ref, got)
    resumed = run(True, mixed_precision, resume=str(tmp_path / "state"), tmp=tmp_path)
    assert same(resumed, got)


def test_readme_snippet(tmp_path, monkeypatch):
    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    part = readme.read_text().split("### accelerate", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    assert len(blocks) == 1, "README: one python block under ### accelerate"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPILLOVER_HOST_POOL_BYTES", "32MiB")
    accelerator("no")
    ns = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(blocks[0], "README.md (accelerate)", "exec"), ns)
    assert ns["ctx"].stats().tensors_packed > 0
    assert (tmp_path / "ckpt").is_dir()
