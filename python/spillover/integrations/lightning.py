"""Lightning: one offload context around each training batch.

::

    class LitModel(L.LightningModule):
        def configure_optimizers(self):       # optimizer state in the host pool or on NVMe
            return spillover.OffloadAdamW(
                [p for p in self.parameters() if p.requires_grad], lr=3e-4, tier="host")

    trainer = L.Trainer(callbacks=[SpilloverCallback(tier="auto")], ...)

Note [Lightning steps]
    ``on_train_batch_start`` runs before a batch's ``training_step`` and ``on_train_batch_end``
    after its backward and (on the batch that completes an accumulation) the optimizer step,
    in automatic and manual optimization alike. :class:`SpilloverCallback` enters its context at
    the first and leaves it at the second, so the batch's forward and backward both run inside
    it; validation runs outside. An exception in between leaves it at ``on_exception``.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional, Union

from torch import nn

from ..activations import OffloadContext
from ..suspend import forward_regions
from . import StepContext, _StepCallback

try:
    import lightning.pytorch as _pl
except ImportError:  # the standalone package
    import pytorch_lightning as _pl  # type: ignore[no-redef]

__all__ = ["SpilloverCallback"]


class SpilloverCallback(_StepCallback, _pl.Callback):  # type: ignore[misc,name-defined]
    """A Lightning ``Callback`` that runs one offload context around each training batch
    (Note [Lightning steps]). The same context object is entered at every batch.

    Recompute regions come from ``spillover.wrap(module)`` (or, for a transformers model
    inside the ``LightningModule``, ``spillover.integrations.hf.enable``); without them, the
    context still offloads what the model saves.

    A loss that computes gradients with ``torch.func`` (Liger's chunked losses, Unsloth's fused
    loss) raises under the context's saved-tensor hooks; it must run inside
    :func:`spillover.no_offload`. In your ``training_step``, write
    ``with spillover.no_offload(): loss = loss_fn(...)``; for a loss module, ``no_offload=``
    does that for every call. A callback cannot reach a loss computed by a plain function
    inside a model's forward: wrap that function, ``spillover.no_offload()(loss_fn)``.

    Args:
        context: the context to enter each batch (default: a new one).
        no_offload: a module, or several, whose every forward runs in
            :func:`spillover.no_offload` (the hooks stay on them; outside a context they do
            nothing).
        tier, **overrides: as :func:`spillover.offload_context`, for a new context.

    Attributes:
        steps: the :class:`~spillover.integrations.StepContext` (``steps.step_stats``: the
            counters of each training batch).
        no_offload_hooks: one handle per ``no_offload=`` module; ``remove()`` takes its hooks
            off.
    """

    def __init__(self, context: Optional[OffloadContext] = None, *, tier: Optional[str] = None,
                 no_offload: Union[None, nn.Module, Iterable[nn.Module]] = None,
                 **overrides: Any):
        super().__init__()
        self.steps = StepContext(context, tier=tier, **overrides)
        self.no_offload_hooks = forward_regions(no_offload)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                             batch_idx: int) -> None:
        self.steps.begin()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps.end()

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.steps.end()

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.steps.end()
