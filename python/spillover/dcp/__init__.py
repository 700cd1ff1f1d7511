"""Resumable sharded checkpoints of :class:`spillover.OffloadAdamW` through
``torch.distributed.checkpoint`` (DCP).

::

    import torch.distributed.checkpoint as dcp
    import spillover.dcp

    state = {"model": model.state_dict(), "optim": spillover.dcp.optimizer_state(opt)}
    dcp.save(state, storage_writer=spillover.dcp.FileSystemWriter("ckpt/step-100"))
    ...
    state = {"model": model.state_dict(), "optim": spillover.dcp.optimizer_state(opt)}
    dcp.load(state, checkpoint_id="ckpt/step-100")      # any world size, any tier
    model.load_state_dict(state["model"])

What a checkpoint holds
    Per parameter with state (Note [lazy state] in optim/store.py: a parameter that never had a
    gradient has no entries), keyed by its name (``named_parameters`` given to
    :func:`optimizer_state`, else its index in the optimizer's parameter order):
    ``state.<name>.exp_avg``, ``state.<name>.exp_avg_sq`` and, for parameters that keep an fp32
    master copy (bf16, or on a GPU), ``state.<name>.master``: 1-D fp32 tensors of the *flattened*
    parameter's numel, whatever the world size, tier or sharding that wrote them. ``meta`` is a
    JSON string with every parameter's step count and the param groups' hyper-parameters.

The pieces: :mod:`._state` (:func:`optimizer_state`, the ``Stateful`` and what a load reads;
Note [which parameters a load expects], Note [loading]), :mod:`._column` (one column as DCP
sees it; Note [pieces, produced when asked]), :mod:`._writer` (:class:`FileSystemWriter`;
Note [DCP's writer holds a file's tensors]).
"""

from __future__ import annotations

from typing import Any

from ._state import OptimizerState, optimizer_state

__all__ = ["FileSystemWriter", "OptimizerState", "optimizer_state"]  # noqa: F822 (__getattr__)


def __getattr__(name: str) -> Any:
    if name == "FileSystemWriter":
        from ._writer import _make_writer_class

        cls = _make_writer_class()
        globals()["FileSystemWriter"] = cls
        return cls
    raise AttributeError(name)
