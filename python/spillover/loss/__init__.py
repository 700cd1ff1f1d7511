"""The loss region without logits: a causal LM's head and loss by row chunks, through torch's
``linear_cross_entropy`` (torch 2.13+) or spillover's own chunks (:mod:`.fused`: older torch,
and heads with a logit transform), so no tokens × vocab logits tensor (nor its gradient, nor
the log-softmax cross-entropy saves) exists during training.

``spillover.wrap(model)`` and ``spillover.integrations.hf.enable(model)`` turn it on for
HuggingFace causal LMs (``chunked_loss=False`` turns it off); a custom model calls
:func:`causal_lm_loss` (HF's label shift) or :func:`chunked_cross_entropy` (targets already
aligned) in place of ``F.cross_entropy(head(h), ...)``.

Three rooms: :mod:`.chunked` (the chunked loss, which implementation runs, its chunk size and
what it adds to a step's peak: Notes [which chunked loss], [loss chunks], [loss chunk under a
budget], [loss transient]), :mod:`.fused` (spillover's own chunks: Notes [chunks in forward],
[logit transforms]) and :mod:`.regions` (which models it is turned on for and the hooks that
do it: Note [which HF models]).
"""

from .chunked import (
    OWN,
    TORCH,
    available,
    backend,
    begin_scope,
    causal_lm_loss,
    chunk_rows,
    chunked_cross_entropy,
    end_scope,
    limit_chunk,
    options_for,
    path_line,
    paths_run,
)
from .regions import (
    FLAG,
    FlagRegion,
    LossRegion,
    attach,
    describe,
    detach,
    target,
    transform_of,
    unsupported_reason,
)

__all__ = ["available", "backend", "chunk_rows", "options_for", "chunked_cross_entropy",
           "causal_lm_loss", "LossRegion", "FlagRegion", "attach", "detach", "describe",
           "begin_scope", "end_scope", "limit_chunk", "unsupported_reason", "target",
           "transform_of", "paths_run", "path_line", "TORCH", "OWN", "FLAG"]
