"""The closed-form activation memory of Korthikanti et al. (2022), "Reducing Activation
Recomputation in Large Transformer Models", next to what the trace counts.

Note [closed form]
    Korthikanti et al. count, per transformer layer with 16-bit activations, a GPT block with a
    4h GeLU MLP, dropout and materialised attention, ``s*b*h*(34 + 5*a*s/h)`` bytes saved for
    backward (attention 11sbh + 5as²b, MLP 19sbh, two layer norms 4sbh), and ``2*s*b*h`` per
    layer under full recomputation (the layer's input; the layer being recomputed adds its own
    activations while its backward runs). Their terms, and what a Llama-family block (the
    configs ``fit`` is run on) does instead, each counted the same way (bytes saved for
    backward, from the block's shapes):

    - attention: q, k, v and the output projection's input are 2sbh each, k and v at the full
      head count as transformers' SDPA path expands grouped heads before the kernel; the fused
      kernel keeps its output (2sbh) and a float32 log-sum-exp per row and head (4abs), not
      the ``5as²b`` of softmax, its dropout mask and scores; no dropout (their 2sbh + as²b);
    - MLP: SwiGLU with intermediate size ``i``: the gate and up projections' input (2sbh, one
      storage), the gate output, its SiLU, the up output and the down projection's input, 2sbi
      each (8sbi: 28sbh at i = 3.5h), against their 19sbh;
    - norms: two RMSNorms, their input (2sbh each) and a float32 inverse RMS per row (4sb);
      their output (2sbh each, the projections' input, already counted above);
    - outside the layers: the embedding's output and the final norm (2sbh each), and the loss:
      logits (2sbv), their float32 copy (4sbv), its log-softmax (4sbv), the loss's gradient of
      that (4sbv) at the start of backward.

    The step's peak adds what the trace also counts: parameters, the optimizer's state
    (torch's AdamW: two states in the parameters' dtype), the gradients alive at the peak
    (none at the start of backward; all but the first layers' under full recomputation, where
    the peak comes late in backward), and the layer being recomputed.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict

__all__ = ["ClosedForm", "closed_form"]


@dataclasses.dataclass
class ClosedForm:
    """Closed-form bytes of one configuration (Note [closed form])."""

    korthikanti_layer: int  # their per-layer activations (materialised attention, 4h MLP)
    korthikanti_layer_flash: int  # the same without the 5as²b term (a fused kernel)
    llama_layer: int  # the same counting for this config's block
    outside: int  # embedding, final norm, and the loss at the start of backward
    none_activations: int
    full_activations: int  # inputs of every layer + one layer rebuilt
    params: int
    state: int
    grads: int
    none_peak: int  # params + state + activations + loss (start of backward)
    full_peak: int  # params + state + all grads + one layer rebuilt (late in backward)

    def as_dict(self) -> Dict[str, int]:
        return dataclasses.asdict(self)


def closed_form(cfg: Any, seq: int, batch: int, itemsize: int = 2,
                state_bytes_per_param: int = 4) -> ClosedForm:
    """Note [closed form] for a transformers decoder config (``hidden_size``,
    ``num_attention_heads``, ``intermediate_size``, ``num_hidden_layers``, ``vocab_size``)."""
    h = int(cfg.hidden_size)
    a = int(cfg.num_attention_heads)
    i = int(getattr(cfg, "intermediate_size", 4 * h))
    L = int(cfg.num_hidden_layers)
    v = int(cfg.vocab_size)
    s, b = int(seq), int(batch)
    sbh = s * b * h
    k_layer = sbh * 34 + 5 * a * s * s * b
    k_flash = sbh * 34
    attention = 4 * 2 * sbh + 2 * sbh + 4 * a * b * s  # q k v o-proj input; output; lse
    mlp = 2 * sbh + 4 * 2 * s * b * i
    norms = 2 * (2 * sbh + 4 * s * b)
    layer = attention + mlp + norms
    outside = 2 * 2 * sbh + (2 + 4 + 4 + 4) * s * b * v
    kv = int(getattr(cfg, "num_key_value_heads", a) or a)
    hd = int(getattr(cfg, "head_dim", None) or h // a)
    params = (2 * v * h * (1 if getattr(cfg, "tie_word_embeddings", False) else 2) // 2
              + L * (h * (a * hd) * 2 + h * (kv * hd) * 2 + 3 * h * i + 2 * h) + h)
    params_bytes = params * itemsize
    state = params * state_bytes_per_param
    grads = params_bytes
    none_act = L * layer + outside
    full_act = L * 2 * sbh + layer
    return ClosedForm(
        korthikanti_layer=k_layer, korthikanti_layer_flash=k_flash, llama_layer=layer,
        outside=outside, none_activations=none_act, full_activations=full_act,
        params=params_bytes, state=state, grads=grads,
        none_peak=params_bytes + state + none_act,
        full_peak=params_bytes + state + grads + layer + 2 * sbh)
