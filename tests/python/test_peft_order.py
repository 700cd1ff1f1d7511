"""PEFT in either order: ``spillover.wrap`` / ``hf.enable`` before or after ``get_peft_model``
give the same model -- the loss region on the causal LM inside PEFT's wrapper
(Note [which HF models]), the same loss and gradients bitwise, and ``hf.is_enabled`` and
``spillover.explain`` that look through the wrapper."""

from __future__ import annotations

import pytest
import torch

import spillover

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from spillover.integrations import hf  # noqa: E402

VOCAB = 32000


def base():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, use_cache=False)
    return transformers.LlamaForCausalLM(cfg).train()


def lora(model):
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, task_type="CAUSAL_LM",
                          target_modules=["q_proj", "v_proj"])
    out = peft.get_peft_model(model, cfg)
    torch.manual_seed(1)
    for n, p in out.named_parameters():  # nonzero B, so the adapters' gradients are not 0
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.02)
    return out


def make(how, order):
    turn_on = ((lambda m: spillover.wrap(m, policy="selective")) if how == "wrap"
               else (lambda m: hf.enable(m, policy="selective")))
    if order == "before":
        return lora(turn_on(base()))
    return turn_on(lora(base()))


def step(model):
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(2))
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("how", ["wrap", "enable"])
def test_either_order_same_model(how):
    runs = {}
    for order in ("before", "after"):
        model = make(how, order)
        out, g = step(model)
        assert out.logits is None, f"{how} {order} get_peft_model: the loss region is off"
        line = spillover.explain(model).summary["loss region"]
        assert "chunked linear_cross_entropy" in line, line
        assert hf.is_enabled(model) is (how == "enable")
        runs[order] = out.loss.detach(), g
    (la, ga), (lb, gb) = runs["before"], runs["after"]
    assert torch.equal(la, lb)
    assert ga.keys() == gb.keys() and any("lora_B" in k for k in ga)
    for k in ga:
        assert torch.equal(ga[k], gb[k]), k


def test_chunked_loss_off_in_either_order():
    for order in ("before", "after"):
        m = (lora(spillover.wrap(base(), chunked_loss=False)) if order == "before"
             else spillover.wrap(lora(base()), chunked_loss=False))
        assert step(m)[0].logits is not None, order


def test_a_second_wrap_through_the_wrapper_is_refused():
    model = lora(hf.enable(base()))
    with pytest.raises(ValueError, match="already under spillover .hf.enable."):
        spillover.wrap(model)


def test_explain_names_both_entry_points():
    plain = lora(base())
    with pytest.raises(ValueError, match="spillover.wrap or spillover.integrations.hf.enable"):
        spillover.explain(plain)
