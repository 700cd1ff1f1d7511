"""spillover.integrations.lightning: a tiny Llama with a LoRA adapter under Lightning's Trainer
(CPU, gradient accumulation, OffloadAdamW from configure_optimizers) gives LoRA parameters
bitwise equal to HF's own non-reentrant checkpointing and offloads on every batch through one
context; the README's Lightning snippet runs."""

import warnings

import pytest
import torch

L = pytest.importorskip("lightning")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from test_hf_trainer import (  # noqa: E402
    MACHINE,
    OPTS,
    POOL,
    _hf_gc_on,
    assert_bitwise,
    dataset,
    run_snippet,
    tiny_llama,
    trainable,
)

import spillover  # noqa: E402
from spillover import planner  # noqa: E402
from spillover.activations.context import OffloadContext  # noqa: E402
from spillover.integrations import hf  # noqa: E402
from spillover.integrations.lightning import SpilloverCallback  # noqa: E402


@pytest.fixture(autouse=True)
def _fixed_machine(monkeypatch):
    monkeypatch.setitem(planner._machines, "cpu", MACHINE)


class LitLoRA(L.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss

    def configure_optimizers(self):
        return spillover.OffloadAdamW([p for p in self.parameters() if p.requires_grad],
                                      lr=1e-2, tier="host", host_pool_bytes=POOL)


def fit(callbacks=(), setup=None):
    L.seed_everything(0, verbose=False)
    model = tiny_llama()
    setup(model)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=2, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, accumulate_grad_batches=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=list(callbacks))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on num_workers and the like
        trainer.fit(LitLoRA(model), train_dataloaders=loader)
    return model, trainable(model)


def test_lightning_lora_bitwise_and_offloads_every_batch(monkeypatch):
    _, ref = fit(setup=_hf_gc_on)

    entered = []
    enter = OffloadContext.__enter__
    monkeypatch.setattr(OffloadContext, "__enter__",
                        lambda self: (entered.append(self), enter(self))[1])
    ctx = spillover.offload_context(**OPTS)
    cb = SpilloverCallback(ctx)
    model, got = fit([cb], lambda m: hf.enable(m, policy="selective",
                                                         chunked_loss=False))

    assert_bitwise(got, ref)
    init = trainable(tiny_llama())
    assert any(not torch.equal(got[k], init[k]) for k in got), "training changed nothing"
    assert len(cb.step_stats) == 6  # 3 optimizer steps of 2 batches
    for s in cb.step_stats:
        assert s.bytes_offloaded > 0, s
        assert s.tensors_unpacked > 0, s  # backward ran inside the batch
    assert cb.context is ctx and entered == [ctx] * 6 and ctx.steps == 6
    assert not cb.steps.active


def test_exception_leaves_the_context():
    class Boom(LitLoRA):
        def training_step(self, batch, batch_idx):
            raise RuntimeError("boom")

    cb = SpilloverCallback(**OPTS)
    model = tiny_llama()
    hf.enable(model, policy="full")
    loader = torch.utils.data.DataLoader(dataset(n=4), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[cb])
    with warnings.catch_warnings(), pytest.raises(RuntimeError, match="boom"):
        warnings.simplefilter("ignore")
        trainer.fit(Boom(model), train_dataloaders=loader)
    assert not cb.steps.active
    from spillover.activations.context import current_context

    assert current_context() is None


def test_readme_lightning(tmp_path, monkeypatch):
    ns = run_snippet("Lightning", tmp_path, monkeypatch)
    assert len(ns["callback"].step_stats) == 3
