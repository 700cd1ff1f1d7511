"""``spillover.estimate(model, *args, **kwargs)``: will the step fit, and how fast will it be,
in each mode spillover offers, before anything runs.

One training step of ``model(*args, **kwargs)`` (forward, the loss, backward, the optimizer
step) is traced on fake tensors (no memory, no compute: a model built on the ``meta`` device
costs nothing) once per mode, through the code that mode runs (Note [modes as run] in
modes.py), under a tracker of every storage it allocates and frees (Note [live storages] in
trace.py). Offload tiers are simulated (Note [simulated offload] in offload.py); the time is
a model of the device (Note [step time] in modes.py, Note [device figures] in devices.py).

The package, one concern a module: :mod:`.trace` (the fake step and its tracker),
:mod:`.offload` (the simulated context), :mod:`.devices`, :mod:`.modes` (each mode's run and
figures), :mod:`.result` (:class:`Estimate`: table, largest), :mod:`.plot`, :mod:`.fit` (the
``python -m spillover fit`` command) and :mod:`.closed_form` (Korthikanti et al.'s formula).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from ..config import parse_size
from .devices import DEVICES, Device, device_spec
from .modes import MODES, OPTIMIZERS, SHARDINGS, ModeEstimate, Runner
from .result import Estimate, resize_inputs, size_along
from .trace import SavedTensor

__all__ = ["estimate", "Estimate", "ModeEstimate", "Device", "device_spec", "DEVICES", "MODES",
           "OPTIMIZERS", "SHARDINGS", "SavedTensor"]


def estimate(model: nn.Module, *args: Any,
             device: Union[str, Device, Mapping[str, Any]] = "cpu",
             modes: Sequence[str] = MODES,
             budget: Optional[Union[int, str]] = None,
             optimizer: str = "adamw",
             world_size: int = 1,
             sharding: str = "none",
             loss_fn: Optional[Callable[[Any], Any]] = None,
             host_pool_bytes: Optional[Union[int, str]] = None,
             min_offload_bytes: Optional[Union[int, str]] = None,
             chunked_loss: bool = True,
             dtype: Optional[torch.dtype] = None,
             rederive: Optional[bool] = None,
             **kwargs: Any) -> Estimate:
    """Predict one training step of ``model(*args, **kwargs)`` in each mode, without running it.

    The step's loss is the call's output when it is a scalar tensor, its ``.loss`` when it has
    one, else ``loss_fn(output)``. Every other keyword below is the estimate's own; all others
    go to the model.

    Args:
        device: ``"cpu"`` (this machine, measured), ``"h100"``, ``"h200"``, or a dict of figures
            (``{"base": "h100", "memory_bytes": "94GiB"}``; :func:`device_spec`).
        modes: which of ``none``, ``full``, ``selective``, ``host``, ``nvme``, ``auto``.
        budget: ``auto``'s peak budget over the step's start (what
            SPILLOVER_DEVICE_BUDGET_BYTES means); default: the device's memory less what the
            step starts with.
        optimizer: ``"adamw"`` (torch's, state on the device), ``"adamw-fused"``,
            ``"offload-host"`` / ``"offload-nvme"`` (``OffloadAdamW``'s tiers), ``"none"``.
        world_size, sharding: ranks, and what they shard: ``"none"`` (DDP), ``"zero"`` (the
            optimizer state), ``"fsdp"`` (parameters, gradients and state).
        host_pool_bytes: the offload pool's size (default: the default pool, which grows).
        min_offload_bytes: saved tensors below this stay put (default
            SPILLOVER_MIN_OFFLOAD_BYTES, 1 MiB).
        chunked_loss: what ``wrap`` does with a causal LM's head and loss.
        dtype: trace the model's floating parameters in this dtype (e.g. a config's bf16).
        rederive: whether the offload context makes cheap saved tensors again at unpack
            instead of shipping them (default SPILLOVER_REDERIVE, on; Note [made again at
            unpack] in spillover/activations/rederive.py).

    Returns:
        An :class:`Estimate`: ``est["full"].device_peak_bytes``, ``est.table()``,
        ``est.plot(path)``, ``est.largest(batch=64)``.

    Raises:
        ValueError: an unknown mode, optimizer, sharding or device; a model already under
            ``spillover.wrap``; no loss found; a forward that reads tensor values (data-
            dependent control flow cannot be traced on fake tensors).
    """
    from ..config import Config
    from ..recompute.blocks import state_of

    if state_of(model) is not None:
        raise ValueError(
            "spillover.estimate: this model is already under spillover.wrap or hf.enable; the "
            "estimate wraps a copy of it per mode: pass the model before wrapping it (or "
            "after spillover.unwrap(model))")
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ValueError(f"spillover.estimate: modes={list(modes)!r}: choose from "
                         f"{', '.join(MODES)}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"spillover.estimate: optimizer={optimizer!r}: choose from "
                         f"{', '.join(OPTIMIZERS)}")
    if sharding not in SHARDINGS:
        raise ValueError(f"spillover.estimate: sharding={sharding!r}: choose from "
                         f"{', '.join(SHARDINGS)}")
    if int(world_size) < 1:
        raise ValueError(f"spillover.estimate: world_size={world_size!r}: at least 1")
    dev = device_spec(device)
    cfg = Config.load()
    mob = parse_size(min_offload_bytes) if isinstance(min_offload_bytes, str) else (
        min_offload_bytes if min_offload_bytes is not None else cfg.min_offload_bytes)
    pool = parse_size(host_pool_bytes) if isinstance(host_pool_bytes, str) else host_pool_bytes
    bud = parse_size(budget) if isinstance(budget, str) else budget
    opts: Dict[str, Any] = dict(loss_fn=loss_fn, optimizer=optimizer, world_size=int(world_size),
                                sharding=sharding, budget=bud, host_pool_bytes=pool,
                                min_offload_bytes=int(mob), chunked_loss=chunked_loss,
                                dtype=dtype,
                                rederive=cfg.rederive if rederive is None else bool(rederive))

    def make(a: Any, kw: Dict[str, Any]) -> Runner:
        return Runner(model, a, kw, dev, **opts)

    runner = make(args, kwargs)
    order = ["none"] + [m for m in modes if m != "none"] if "none" in modes else list(modes)
    results = {m: _run(runner, m) for m in order}
    results = {m: results[m] for m in modes}

    def resize(dim: int, size: int) -> Runner:
        old = size_along(args, kwargs, dim)
        a, kw = resize_inputs(args, kwargs, dim, old, size)
        return make(a, kw)

    what = f"{type(model).__name__}, inputs {_shapes(args, kwargs)}"
    return Estimate(runner, results, what, resize)


def _run(runner: Runner, mode: str) -> ModeEstimate:
    from torch._subclasses.fake_tensor import DataDependentOutputException

    try:
        return runner.run(mode)
    except DataDependentOutputException as e:
        raise ValueError(
            f"spillover.estimate: the {mode} step reads the values of a tensor ({e}); on fake "
            "tensors there are none. Move value-dependent control flow out of the forward, or "
            "pass inputs that avoid it (e.g. no padding attention_mask)") from e


def _shapes(args: Sequence[Any], kwargs: Dict[str, Any]) -> str:
    parts = [str(list(a.shape)) for a in args if isinstance(a, torch.Tensor)]
    parts += [f"{k}={list(v.shape)}" for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return ", ".join(parts) or "none"
