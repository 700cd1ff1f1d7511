"""TRL's ``SFTTrainer`` as its users run it, with spillover: ``hf.enable`` + the callback (TRL's
defaults: HF checkpointing on, TRL's own chunked loss through its fused LM head), with and
without ``peft_config=``, and ``spillover.wrap`` with HF checkpointing off. TRL computes the
loss itself (``model(..., fused_lm_head=True)``, a forward it patches onto the model), so
spillover's loss region yields to it (Note [the loss region yields] in spillover/loss/
regions.py) and every run's parameters after three optimizer steps are bitwise those of TRL's
own run without spillover."""

from __future__ import annotations

import copy
import tempfile
import warnings

import pytest
import torch

import spillover

trl = pytest.importorskip("trl", reason="TRL is in the test extra; pip install '.[test]'")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
from spillover.integrations import hf  # noqa: E402

VOCAB = 32000
STEPS = 3


def tokenizer():
    """A word-level tokenizer made here (no download): ids in the data are pre-tokenized."""
    from tokenizers import Tokenizer, models

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


def dataset(n: int = 16):
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, VOCAB, (int(torch.randint(12, 40, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(n)]
    return datasets.Dataset.from_dict({"input_ids": rows})


def llama():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                                   bos_token_id=1)
    return transformers.LlamaForCausalLM(cfg)


def lora():
    return peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=["q_proj", "v_proj"])


def train(model, callbacks=(), peft_config=None, **args):
    """STEPS optimizer steps of SFTTrainer on the CPU; the trained parameters by name."""
    cfg = trl.SFTConfig(output_dir=tempfile.mkdtemp(), max_steps=STEPS,
                        per_device_train_batch_size=4, learning_rate=1e-3, report_to=[],
                        use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = trl.SFTTrainer(model=model, args=cfg, train_dataset=dataset(),
                                 processing_class=tokenizer(), callbacks=list(callbacks),
                                 peft_config=peft_config)
        trainer.train()
    return trainer, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def assert_same(ref, got):
    assert ref.keys() == got.keys() and ref
    bad = [n for n in ref if not torch.equal(ref[n], got[n])]
    assert not bad, f"{len(bad)} of {len(ref)} parameters differ, first {bad[0]}"


def callback():
    return hf.SpilloverCallback(tier="host", host_pool_bytes="32MiB", min_offload_bytes=0)


@pytest.mark.parametrize("with_peft", [False, True], ids=["full", "lora"])
def test_sft_trainer_with_enable_and_the_callback(with_peft):
    cfg = lora() if with_peft else None
    _, ref = train(llama(), peft_config=cfg)
    model = hf.enable(llama())
    cb = callback()
    trainer, got = train(model, [cb], peft_config=cfg)
    assert_same(ref, got)
    assert len(cb.step_stats) == STEPS
    assert all(s.bytes_offloaded_host > 0 for s in cb.step_stats), cb.step_stats[-1]
    # TRL's peft_config= wraps the model after enable(): spillover is seen through the wrapper
    assert hf.is_enabled(trainer.model)
    assert "loss region" in spillover.explain(trainer.model).summary


def test_sft_trainer_with_wrap_and_hf_checkpointing_off():
    _, ref = train(llama(), gradient_checkpointing=False)
    cb = callback()
    _, got = train(spillover.wrap(llama(), policy="selective"), [cb],
                   gradient_checkpointing=False)
    assert_same(ref, got)
    assert all(s.bytes_offloaded_host > 0 for s in cb.step_stats)


def test_the_loss_region_runs_when_trl_asks_for_logits():
    """TRL's forward without ``fused_lm_head`` (the path ``compute_loss_func`` and label
    smoothing take) is the model's own: with labels, spillover's loss region computes the
    loss, within the chunked loss's tolerance of HF's."""
    base = llama()
    model = copy.deepcopy(base)
    for m in (base, model):  # (a deep copy would keep calling the original's forward)
        trl.trainer.utils.add_fused_lm_head(m)
    hf.enable(model)
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = base(input_ids=ids, labels=ids)
    got = model(input_ids=ids, labels=ids)
    assert got.logits is None and ref.logits is not None
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-6)
    fused = model(input_ids=ids, labels=ids, fused_lm_head=True)  # TRL's own: untouched
    torch.testing.assert_close(fused.loss, ref.loss, rtol=1e-5, atol=1e-6)


def test_readme_snippet(tmp_path, monkeypatch):
    import pathlib
    import re

    readme = pathlib.Path(__file__).resolve().parents[2] / "README.md"
    part = readme.read_text().split("### TRL", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", part, flags=re.S)
    assert len(blocks) == 1, "README: one python block under ### TRL"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPILLOVER_HOST_POOL_BYTES", "32MiB")
    ns = {"__name__": "__readme__"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(blocks[0], "README.md (TRL)", "exec"), ns)
    assert len(ns["callback"].step_stats) == 3
    assert hf.is_enabled(ns["trainer"].model)
