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

from typing import Any, Optional

from ..context import OffloadContext
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

    Args:
        context: the context to enter each batch (default: a new one).
        tier, **overrides: as :func:`spillover.offload_context`, for a new context.

    Attributes:
        steps: the :class:`~spillover.integrations.StepContext` (``steps.step_stats``: the
            counters of each training batch).
    """

    def __init__(self, context: Optional[OffloadContext] = None, *, tier: Optional[str] = None,
                 **overrides: Any):
        super().__init__()
        self.steps = StepContext(context, tier=tier, **overrides)

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
