"""``OffloadAdamW``, the ``torch.optim.Optimizer`` facade.

Note [GradScaler]
    ``torch.amp.GradScaler`` skips a step whose gradients hold an inf/NaN, and a skipped step
    touches neither parameters nor state, and creates no state (Note [lazy state]). With one
    rank OffloadAdamW sets ``_step_supports_amp_scaling``, as torch's fused AdamW does:
    ``scaler.step(opt)`` then only checks the gradients for inf/NaN (multiplying them by 1)
    and calls ``opt.step()`` with ``opt.grad_scale`` and ``opt.found_inf`` set; ``step()``
    returns at once when ``found_inf`` is set, else the kernel multiplies each gradient by
    1/scale (computed as GradScaler's ``unscale_`` computes it, so the result is the same, and
    equal to torch's fused AdamW's division for the power-of-two scales GradScaler uses); the
    ``.grad`` tensors stay scaled, as with torch's fused AdamW. This
    is needed on the staged path: GradScaler's in-place unscaling does not move a gradient's
    version counter, so a copy the hooks took before it could not be told from a current one
    (Note [staged gradients]); with the scale applied in the kernel the copies stay valid and
    their overlap with backward is kept. When ``scaler.unscale_(opt)`` was called before
    ``scaler.step(opt)`` (to clip), ``grad_scale`` is None and ``step()`` copies every
    gradient again. With ``update_in_backward`` the updates made during backward assume the
    last step's scale; ``step()`` keeps them when the scale is the same and undoes them when
    ``found_inf`` skips the step (Note [speculative update] in inbwd.py).

    Under sharding with ``reduce_grads=True`` each rank holds its own gradients and the ranks
    can disagree on inf: use ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
    (``device="cpu"`` for CPU parameters), whose ``unscale_`` all-reduces the inf flag, so the
    ranks skip or step together. With a plain GradScaler the ranks that step would wait in a
    collective for a rank that skipped. Next to DDP (``reduce_grads=False``) the gradients are
    already averaged and a plain GradScaler decides the same on every rank. Sharded ranks do
    not set ``_step_supports_amp_scaling`` (ShardedGradScaler all-reduces the inf flag only in
    ``unscale_``, which that path skips): the scaler unscales the gradients before ``step()``,
    which reads them afresh (no hooks when sharded).

Note [update threads]
    The Rust kernel runs on rayon's threads, all cores by default: it is bound by the host's
    memory bandwidth, which a core less hardly lowers (benches/python/optim_threads.py: on
    the 2-core machine it was written on, one thread moved 40-43 GB/s of state, two 28-56
    under other load). In the exact default the device waits for the update, so it may take
    every core. When the update runs while the device computes (``update_in_backward``,
    ``overlap="delayed"``), the thread that drives the device — Python launching the
    forward's and backward's kernels, the hooks — must get a core as soon as it wakes, or the
    device starves; so those modes update on a pool of their own of one thread fewer
    (``AdamState(threads=)``), unless ``update_threads`` says otherwise. Measured on the
    simulated device only (benches/results/2026-12-04-issue41-optim.md): the delayed update
    at 2.18x torch's fused AdamW's step with one thread, 2.38x with two (medians of three
    runs, ranges overlapping); not measured on a GPU host.
"""

from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

import numpy as np
import torch

from .. import _adamw_switches as _switches
from .. import _pools, _tiers
from ..config import Config
from . import formats
from .inbwd import INBWD_STATS
from .layout import (
    _CUMULATIVE,
    _GRAD_STATS,
    _HYPER,
    _ROUND_STATS,
    _STATS,
    _float,
    _is_dtensor,
)
from .store import StateStore


class OffloadAdamW(StateStore, torch.optim.Optimizer):
    """AdamW whose state lives in host memory (``tier="host"``) or on NVMe (``tier="nvme"``)
    and is updated by spillover's Rust CPU kernel; ZeRO-sharded across ranks under
    ``torch.distributed``. See the module docstring for the contract.

    Args:
        params, lr, betas, eps, weight_decay, maximize: as ``torch.optim.AdamW``.
        amsgrad: must be False (not implemented; refused with a clear error).
        fused, foreach: accepted for torch's AdamW's sake; the update is always the Rust
            kernel's, torch's fused update (Note [torch's switches] in _adamw_switches.py).
        capturable, differentiable: must be False (refused with a clear error).
        tier: ``"host"`` or ``"nvme"``.
        nvme_path: swap directories for ``tier="nvme"`` (default: ``SPILLOVER_NVME_PATH``, else
            the process's private temporary directory). The swap engine and its files are the
            process's one for these directories and I/O settings, shared with the activation
            tier.
        shard: ZeRO sharding across ranks; default: when ``torch.distributed`` is initialised
            with more than one rank and no parameter is a DTensor.
        process_group: the group to shard over (default: the world).
        reduce_grads: reduce-scatter (sum / world) the gradients; False when they are already
            averaged across ranks (DDP).
        chunk_bytes: bytes of state per chunk (the NVMe tier's unit of I/O; default 8 MiB,
            64 MiB on the host tier).
        nvme_buffers: pool blocks the NVMe pipeline streams through (>= 3; default 16, so 128
            MiB of pool while a step runs, none between steps). Enough I/O must stay queued
            while the kernel runs: measured here with 8 MiB chunks, 8 buffers gave 1.2x the
            engine's bound, 12 gave 1.02x, 16 gave 0.98x.
        update_in_backward: run each bucket's CPU update during backward, on a worker
            thread, as soon as its gradients have been staged, and keep it at ``step()`` when
            it is the update ``step()`` computes; undone and redone when clipping applied or
            the gradients changed, undone when GradScaler skips the step or a later
            micro-batch accumulates into them (Note [update in backward], Note [speculative
            update] in inbwd.py). One rank or ``shard=False``; pays with parameters on a GPU;
            costs 12 bytes of host memory per parameter for the undo copy.
        update_threads: the threads the Rust kernel updates on (Note [update threads]): by
            default all cores (rayon's pool: ``RAYON_NUM_THREADS`` or the cores this process
            may run on), but one fewer (at least one) when the update runs while the device
            computes (``update_in_backward``, ``overlap="delayed"``), so that the thread that
            drives the device keeps a core.
        overlap: ``None`` (the default: the exact update, bitwise equal to torch's fused
            AdamW) or ``"delayed"``: a one-step delayed update (DeepSpeed ZeRO-Offload's),
            **whose math differs from AdamW's**: ``step()`` hands the update to a worker thread
            and returns, the host computes it while the device runs the next forward and
            backward, and the next ``step()`` copies its parameters back, so each gradient is
            computed on parameters one update older than those it updates (``p[t+1] =
            AdamW(p[t], grad(p[t-1]))``), or, with ``predict_weights`` (the default where
            it runs), on ``p[t-1]`` moved by the update predicted for step t. Its cost in
            quality is measured by ``benches/python/lowbit_quality.py --only
            fp32,delayed,delayed-plain``. ``state_dict()`` and
            ``flush()`` first apply the pending update to the parameters. One rank or
            ``shard=False``; not with ``update_in_backward``; Note [delayed update] in
            delayed.py.
        delay_after: with ``overlap="delayed"``, the first ``delay_after`` steps are exact
            (ZeRO-Offload starts its delayed update after a few dozen iterations: the early
            steps, large and fast-changing, suffer most from the lag).
        predict_weights: with ``overlap="delayed"``, give the device the parameters moved by
            the next update as predicted from the state, so that the gradients are computed
            close to where the exact update would compute them. ``"gradient"`` (or ``True``):
            the next update's gradient term is left to ``step()``, which computes it on the
            device with that gradient, so only ``v``'s one-step change in the momentum's
            term is predicted (Note [next-gradient prediction] in rust/optim/predict.rs;
            ``v``'s part of the next denominator crosses the link beside the
            parameters, in bf16: 2 bytes per parameter); ``"momentum"``: the momentum
            taken for the next gradient (Note [weight prediction]; no more bytes). The
            host's master is the plain delayed update's; ``flush()`` and ``state_dict()``
            give the model the master. Default (``None``): ``"gradient"`` where it can run,
            fp32 state with an fp32 master (``state_bits=32``, ``master_weights=True``);
            ``False``: the plain delayed update. Measured on
            ``benches/python/lowbit_quality.py``: README, "The delayed update".
        state_bits: how ``exp_avg`` and ``exp_avg_sq`` are stored (Note [state formats] in
            formats.py): 32 (fp32, torch's AdamW state: 8 bytes per parameter, 12 with a master
            copy), 16 (bf16, rounded stochastically: 4 / 8 bytes) or 8 (one byte each plus an
            fp32 scale per 256 elements: 2.03 / 6.03 bytes). The update is computed in fp32
            either way, in the Rust kernel, dequantizing and requantizing in the same pass; on
            the NVMe tier the bytes read and written per step shrink in the same ratio.
        master_weights: keep an fp32 master copy for parameters that are not their own (bf16,
            or staged from a GPU). ``False``: none; a bf16 parameter is updated in fp32 and
            written back rounded stochastically (seeded by ``rounding_seed``, reproducible),
            so that updates smaller than half a bf16 ulp still move it on average; with
            ``state_bits=8`` that is about 2 bytes of state per parameter.
        rounding_seed: the seed of stochastic rounding (bf16 moments, bf16 parameters without
            a master). The random bits depend on it, the step count and each element's place
            in its parameter only, so every tier, layout and world size gives the same
            result; a checkpoint carries it.
        max_grad_norm: clip the gradients at ``step()`` as ``clip_grad_norm_(params,
            max_grad_norm)`` does (after unscaling them in place as ``scaler.unscale_(opt)``
            does, when ``torch.amp.GradScaler`` steps this optimizer), with the same results;
            the norm is left in ``opt.grad_norm``. One rank or ``shard=False``. With
            ``update_in_backward`` and a GradScaler it keeps the overlap that clipping after
            ``scaler.unscale_(opt)`` loses (Note [speculative update]).
        **config: any knob of :class:`spillover.Config` (``optim_pool_bytes``, ``io_engine``,
            ...). The optimizer's state and staging buffers use a pool of their own, never the
            activations' (``SPILLOVER_OPTIM_POOL_BYTES``); ``host_pool_bytes=`` given here is
            read as ``optim_pool_bytes``.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: Tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        amsgrad: bool = False,
        maximize: bool = False,
        tier: str = "host",
        nvme_path: Any = None,
        shard: Optional[bool] = None,
        process_group: Any = None,
        reduce_grads: bool = True,
        chunk_bytes: Optional[int] = None,
        nvme_buffers: int = 16,
        update_in_backward: bool = False,
        overlap: Optional[str] = None,
        delay_after: int = 0,
        predict_weights: Optional[Union[bool, str]] = None,
        update_threads: Optional[int] = None,
        max_grad_norm: Optional[float] = None,
        state_bits: int = 32,
        master_weights: bool = True,
        rounding_seed: int = 0,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        _force_staging: bool = False,
        _link: Any = None,
        _hook_copies: bool = False,
        **config: Any,
    ):
        _check_hyper(lr, betas, eps, weight_decay, amsgrad)
        _switches.check_switches(fused, foreach, capturable, differentiable)
        if tier not in ("host", "nvme"):
            raise ValueError(f"OffloadAdamW: tier must be 'host' or 'nvme', got {tier!r}")
        self._state_bits = formats.check_state_bits(state_bits)
        if not isinstance(master_weights, bool):
            raise ValueError(
                f"OffloadAdamW: master_weights must be True or False, got {master_weights!r}"
            )
        self._master_weights = master_weights
        if isinstance(rounding_seed, bool) or not isinstance(rounding_seed, int) or not (
            0 <= rounding_seed < 1 << 64
        ):
            raise ValueError(
                f"OffloadAdamW: rounding_seed must be an integer in [0, 2**64), got "
                f"{rounding_seed!r}"
            )
        self._rounding_seed = rounding_seed
        if "host_pool_bytes" in config:  # the optimizer's pool is its own: optim_pool_bytes
            alias = config.pop("host_pool_bytes")
            if config.get("optim_pool_bytes") is None:
                config["optim_pool_bytes"] = alias
        self._cfg = Config.load(nvme_path=nvme_path, **config)
        self._tier = tier
        self._chunk_bytes = chunk_bytes
        self._nvme_buffers = nvme_buffers
        self._reduce_grads = reduce_grads
        self._force_staging = _force_staging
        # Tests and benchmarks: a CudaDevice stand-in for the staged copies of CPU tensors
        # (Note [optimizer copies]), and whether the hooks stage gradients during backward
        # (Note [staged gradients]; off, the default: every gradient is copied by step()'s
        # bucket pipeline).
        self._link = _link
        self._hook_copies = bool(_hook_copies)
        self._inbwd = bool(update_in_backward)
        if overlap not in (None, "delayed"):
            raise ValueError(
                f"OffloadAdamW: overlap must be None (the exact update) or 'delayed', got "
                f"{overlap!r}"
            )
        self._delayed = overlap == "delayed"
        if isinstance(delay_after, bool) or not isinstance(delay_after, int) or delay_after < 0:
            raise ValueError(f"OffloadAdamW: delay_after must be an integer >= 0, got "
                             f"{delay_after!r}")
        self._delay_after = delay_after
        self._predict = self._check_predict(predict_weights)
        if update_threads is not None and (
            isinstance(update_threads, bool) or not isinstance(update_threads, int)
            or update_threads < 1
        ):
            raise ValueError(
                f"OffloadAdamW: update_threads must be an integer >= 1, got {update_threads!r}"
            )
        self._update_threads = update_threads
        if self._delayed and self._inbwd:
            raise ValueError(
                "OffloadAdamW: overlap='delayed' and update_in_backward=True are two ways to "
                "hide the same host update; choose one (update_in_backward is exact, 'delayed' "
                "is not: Note [delayed update])"
            )
        if max_grad_norm is not None and not float(max_grad_norm) > 0.0:
            raise ValueError(f"OffloadAdamW: max_grad_norm must be > 0, got {max_grad_norm}")
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grad_norm: Optional[torch.Tensor] = None
        # Note [speculative update]: the inverse scale updates in backward assume (the last
        # step()'s), and the step counters of stats().
        self._spec_inv = 1.0
        self._round_steps = {k: 0 for k in _ROUND_STATS}
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._spaces = []  # Note [lazy state]: grows as parameters get gradients
        self._updates = 0  # steps that updated at least one parameter
        self._past: Dict[str, float] = {}  # counters of the spaces load_state_dict dropped
        self._building = True
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            **_switches.GROUP_KEYS,
        )
        super().__init__(params, defaults)
        self._building = False
        self._setup_distributed(shard, process_group)
        if self._inbwd:
            self._check_inbwd()
        if self._delayed:
            self._check_delayed()
        if self._max_grad_norm is not None and self._world > 1:
            raise ValueError(
                "OffloadAdamW(max_grad_norm=...) works with one rank or shard=False: sharded "
                "ranks hold their own unreduced gradients, whose norms are not the step's; clip "
                "with torch.nn.utils.clip_grad_norm_ on the reduced gradients instead"
            )
        self._pool = _pools.host_pool(self._cfg, purpose="optim", need=self._pool_need())
        self._swap: Any = None
        if tier == "nvme":
            # Checks the directories (ConfigError) and warns once with the engine's warning.
            self._swap = _tiers.swap_for(self._cfg, self._pool)
        self._index()
        # Note [GradScaler]: one rank unscales in the kernel; sharded ranks let the scaler do it.
        self._step_supports_amp_scaling = self._world == 1

    def _check_inbwd(self) -> None:
        """Note [update in backward]: where it is offered."""
        mode = "OffloadAdamW(update_in_backward=True)"
        if self._world > 1:
            raise ValueError(
                f"{mode} works with one rank or shard=False: the sharded step reduce-scatters "
                "the gradients and all-gathers the parameters at step(), collectives that "
                "cannot run from a backward hook; use the default mode (update_in_backward="
                "False), or shard=False"
            )
        params = [p for g in self.param_groups for p in g["params"]]
        if any(_is_dtensor(p) for p in params):
            raise ValueError(
                f"{mode} does not support DTensor parameters (FSDP2): FSDP2 assigns the sharded "
                "gradients itself, so the post-accumulate-grad hooks that start the updates do "
                "not fire; use the default mode (update_in_backward=False)"
            )

    def _check_predict(self, predict: Optional[Union[bool, str]]) -> str:
        """Note [weight prediction], Note [next-gradient prediction] (rust/optim/predict.rs):
        the prediction's kind, "" for none; "gradient" by default with overlap="delayed" where the
        kernel computes it (an fp32 master, fp32 moments)."""
        kinds = (None, True, False, "gradient", "momentum")
        if not any(predict is k for k in kinds[:3]) and predict not in kinds[3:]:
            raise ValueError(f"OffloadAdamW: predict_weights must be None, True, False, "
                             f"'gradient' or 'momentum', got {predict!r}")
        if not self._delayed:
            if predict:
                raise ValueError(
                    f"OffloadAdamW: predict_weights={predict!r} applies to overlap='delayed' "
                    "(the exact update has no lag to predict across)"
                )
            return ""
        can = self._state_bits == 32 and self._master_weights
        if predict and not can:
            raise ValueError(
                f"OffloadAdamW: predict_weights={predict!r} needs fp32 state (state_bits=32) "
                f"and an fp32 master (master_weights=True); got state_bits={self._state_bits}, "
                f"master_weights={self._master_weights}. Use predict_weights=False (the plain "
                "delayed update) or the default state"
            )
        if predict is False or (predict is None and not can):
            return ""
        return "momentum" if predict == "momentum" else "gradient"

    def _check_delayed(self) -> None:
        """Note [delayed update]: where it is offered."""
        if self._world > 1:
            raise ValueError(
                "OffloadAdamW(overlap='delayed') works with one rank or shard=False: the "
                "sharded step reduce-scatters the gradients and all-gathers the parameters at "
                "step(); use the default (overlap=None), or shard=False"
            )
        if any(_is_dtensor(p) for g in self.param_groups for p in g["params"]):
            raise ValueError(
                "OffloadAdamW(overlap='delayed') is not offered for DTensor parameters (FSDP2): "
                "untested there; use the default (overlap=None)"
            )

    def _threads(self) -> int:
        """The ``threads=`` of a new AdamState (0: rayon's global pool): Note [update
        threads]."""
        if self._update_threads is not None:
            return self._update_threads
        if not (self._inbwd or self._delayed):
            return 0
        env = os.environ.get("RAYON_NUM_THREADS", "")
        cores = int(env) if env.isdigit() and int(env) > 0 else len(os.sched_getaffinity(0))
        return max(1, cores - 1)

    def flush(self) -> None:
        """With ``overlap="delayed"``: wait for the update the last ``step()`` handed to the
        host and copy its parameters back now (the next forward sees them), so the model holds
        every step's update — before saving the model, or evaluating it. Nothing to do
        otherwise. ``state_dict()`` calls it (Note [delayed update] in delayed.py)."""
        for space in self._spaces:
            space.flush()

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one worker thread of update_in_backward (Note [update in backward]) and of
        overlap="delayed" (Note [delayed update])."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="spillover-optim-update"
            )
        return self._worker

    def _settle(self, what: str) -> None:
        """Wait for the update-in-backward worker; refuse `what` between a backward that
        updated parameters and its ``step()`` (the state is mid-step then)."""
        self.flush()  # Note [delayed update]: the model and the state agree
        busy = False
        for space in self._spaces:
            space.join()
            busy = busy or space.in_round()
        if busy:
            raise RuntimeError(
                f"OffloadAdamW(update_in_backward=True): {what} was called between backward "
                "and step(); the updates made during backward are counted at step(), so the "
                "state is mid-step now: call step() first"
            )

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if param_group.get("amsgrad", False):
            raise ValueError("OffloadAdamW does not implement amsgrad")
        _switches.check_switches(param_group.get("fused"), param_group.get("foreach"),
                                 param_group.get("capturable"), param_group.get("differentiable"))
        super().add_param_group(param_group)
        _switches.keep_switches(self.param_groups[-1])
        if not getattr(self, "_building", True):
            self._index()  # the new parameters get state at their first gradient

    # ---- step ----

    def _hyper(self) -> np.ndarray:
        """Per parameter: the hyper-parameters of its group, read now (schedulers change them)."""
        h = np.zeros(len(self.param_groups), _HYPER)
        for gi, g in enumerate(self.param_groups):
            if g.get("amsgrad", False):
                raise ValueError("OffloadAdamW does not implement amsgrad")
            b1, b2 = g["betas"]
            scale = -1.0 if g.get("maximize", False) else 1.0  # maximize: ascend the gradient
            h[gi] = (
                _float(g["lr"]),
                _float(b1),
                _float(b2),
                _float(g["eps"]),
                _float(g["weight_decay"]),
                scale,
            )
        return h[self._group_of]

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        """One AdamW step over every parameter with a gradient (GIL released in the kernel)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler: Note [GradScaler]
        grad_scale = getattr(self, "grad_scale", None)
        inv = None
        if grad_scale is not None:  # unscaled in the kernel, as GradScaler.unscale_ would
            inv = _float(torch.as_tensor(grad_scale).double().reciprocal().float())
        if found_inf is not None and _float(found_inf) != 0.0:
            for space in self._spaces:  # undone, and the next step's hooks count afresh
                space.skip_round()
            self._round_steps["steps_skipped"] += 1
            return loss
        self._works.clear()  # the last step's collectives: Note [collectives at exit]
        hyper = self._hyper()
        if inv is not None:
            hyper["grad_scale"] *= inv
        for space in self._spaces:  # before the clipping below changes gradients itself
            space.verify_round(hyper)
        if grad_scale is None and found_inf is not None:
            for space in self._spaces:  # unscale_ was called: the staged copies may be scaled
                space.staged_grads = {}
        if self._max_grad_norm is not None and not self._clip(inv, hyper):
            for space in self._spaces:
                space.invalidate_round()
        if inv is not None:  # the scale the next updates in backward assume
            self._spec_inv = inv
        elif found_inf is None:  # no scaler; after scaler.unscale_ the last scale is kept
            self._spec_inv = 1.0
        self._grow()
        stepped = False
        kept = redone = 0
        for space in self._spaces:
            space.last_round = (0, 0)
            updated = space.step(hyper)
            self._steps[updated] += 1
            stepped = stepped or len(updated) > 0
            kept += space.last_round[0]
            redone += space.last_round[1]
        self._updates += stepped
        self._round_steps["steps_in_backward"] += kept > 0
        self._round_steps["steps_redone"] += redone > 0
        return loss

    def _clip(self, inv: Optional[float], hyper: np.ndarray) -> bool:
        """``max_grad_norm``: unscale the gradients in place as ``GradScaler.unscale_`` does
        (when `inv`), clip them with ``clip_grad_norm_`` and set `hyper`'s scale to match.
        Whether the gradients the kernel now sees are those an update assuming `inv` saw:
        nothing was clipped and the unscaling was the kernel's own multiplication (fp32
        gradients): Note [speculative update]."""
        params = [p for p in self._params if p.grad is not None]
        grads = [p.grad for p in params if p.grad is not None]
        limit = self._max_grad_norm
        if not grads or limit is None:
            return True
        same = True
        if inv is not None:
            groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
            for g in grads:
                groups.setdefault((g.device, g.dtype), []).append(g)
            for (dev, _), grads in groups.items():
                found = torch.zeros(1, dtype=torch.float32, device=dev)
                scale = torch.full((), inv, dtype=torch.float32, device=dev)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found, scale)
            hyper["grad_scale"] = np.where(hyper["grad_scale"] < 0, -1.0, 1.0)  # maximize
            same = all(g.dtype == torch.float32 for g in grads)
        norm = torch.nn.utils.clip_grad_norm_(params, limit)
        self.grad_norm = norm
        coef = torch.clamp(limit / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s
        return same and bool(coef == 1.0)

    def state_dict(self) -> Dict[str, Any]:
        """torch's format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}},
        "param_groups": [...]}``, every tensor a CPU copy of the full state as stored
        (gathered from all ranks when sharded; NVMe state is read back): fp32 with
        ``state_bits=32`` (what ``torch.optim.AdamW`` loads), bf16 with 16, int8 / uint8 codes
        and ``exp_avg_scale`` / ``exp_avg_sq_scale`` with 8 (Note [state formats] in
        formats.py). ``master`` is present for parameters that keep an fp32 master copy (bf16,
        or on a GPU, unless ``master_weights=False``). ``"state_format"`` says the format, and
        carries ``master_weights`` and ``rounding_seed``. The groups carry torch's AdamW keys,
        ``fused=True`` among them (Note [torch's switches] in _adamw_switches.py)."""
        groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        fmt = formats.describe(self._state_bits)
        fmt.update(master_weights=self._master_weights, rounding_seed=self._rounding_seed)
        return {"state": self._gather_state(), "param_groups": groups, "state_format": fmt}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint written by ``state_dict`` (any tier, any world size) or by
        ``torch.optim.AdamW`` (the master copy then starts from the parameters). State of
        another ``state_bits`` is converted, with one warning per format (Note [state
        formats]); the rounding seed is the checkpoint's, so a resumed run repeats an unbroken
        one."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups):
            raise ValueError("loaded state dict has a different number of parameter groups")
        for g, saved in zip(self.param_groups, groups):
            if len(g["params"]) != len(saved["params"]):
                raise ValueError(
                    "loaded state dict contains a parameter group that doesn't match the size "
                    "of optimizer's group"
                )
        if any(saved.get("amsgrad", False) for saved in groups):
            raise ValueError("OffloadAdamW does not implement amsgrad")
        index = {}
        for g, saved in zip(self.param_groups, groups):
            for p_new, i_saved in zip(g["params"], saved["params"]):
                index[i_saved] = p_new
            for k, v in saved.items():
                if k != "params":
                    g[k] = v
            _switches.keep_switches(g)  # Note [torch's switches]
        position = {id(p): i for i, p in enumerate(self._params)}
        state = {}
        for i_saved, st in state_dict["state"].items():
            p = index.get(i_saved)
            if p is not None:
                state[position[id(p)]] = st
        fmt = state_dict.get("state_format") or {}
        name = fmt.get("name", formats.FORMAT_NAMES[32])
        if name not in formats.FORMAT_NAMES.values():
            raise ValueError(
                f"OffloadAdamW.load_state_dict: the checkpoint's state format {name!r} is not "
                f"one this version reads ({', '.join(formats.FORMAT_NAMES.values())}); it was "
                "written by another spillover version"
            )
        if "rounding_seed" in fmt:
            self._rounding_seed = int(fmt["rounding_seed"])
        self._load_state(state)

    def __setstate__(self, state: Dict[str, Any]) -> None:  # pragma: no cover - pickling
        raise TypeError("OffloadAdamW cannot be pickled; save its state_dict() instead")

    def explain(self) -> Any:
        """Where the state is and its bytes per parameter, as stored, per state space (a
        :class:`spillover.optim.explain.StateExplanation`; ``print`` it for a table).
        ``spillover.explain(opt)`` returns the same."""
        from .explain import explain_state

        return explain_state(self)

    def stats(self) -> Dict[str, Any]:
        """steps (that updated a parameter), and counters summed over the optimizer's state
        spaces: bytes_read, bytes_written (NVMe), io_wait_seconds, compute_seconds,
        last_step_seconds, state_bytes (as stored, Note [state formats] in formats.py; of the
        parameters that have state: Note [lazy state]),
        heap_chunks; on the staged path (parameters on a GPU, one rank), grad_copies and
        grad_bytes_copied (device-to-host gradient copies, one per unit of at most
        ``_UNIT_MAX`` elements) and grad_stale_copies (those made again because the staged
        copy's fingerprint no longer matched: Note [staged gradients]); coef_bytes_copied
        (``overlap="delayed"`` with the next-gradient prediction: ``v``'s part of the
        next denominator, copied back beside the parameters, Note [next-gradient
        prediction]); steps_skipped
        (GradScaler's inf/NaN steps); with ``update_in_backward``, steps_in_backward,
        steps_redone, inbwd_redo_rate (steps_redone over the steps that had updates made during
        backward), inbwd_buckets, inbwd_buckets_redone, inbwd_buckets_undone, undo_bytes and
        undo_swap_bytes (Note [speculative update] in inbwd.py). All zero before the first
        step."""
        total: Dict[str, Any] = {k: 0 for k in _STATS + _GRAD_STATS + INBWD_STATS}
        total.update(self._past)
        total.update(self._round_steps)
        total["undo_bytes"] = sum(s.undo_bytes()[0] for s in self._spaces)
        total["undo_swap_bytes"] = sum(s.undo_bytes()[1] for s in self._spaces)
        for s in self._spaces:
            for k, v in s.state.stats().items():
                if k != "steps":
                    total[k] = total.get(k, 0) + v
            if s.undo_state is not None:  # its I/O is the step's (Note [speculative update])
                for k, v in s.undo_state.stats().items():
                    if k in _CUMULATIVE:
                        total[k] += v
            for k, v in s.counters.items():
                total[k] += v
        total["steps"] = self._updates
        # Note [speculative update]: the share of the steps that used an update made in
        # backward which had to be undone and redone (clipping applied, a gradient changed)
        done = total.get("steps_in_backward", 0) + total.get("steps_redone", 0)
        total["inbwd_redo_rate"] = total.get("steps_redone", 0) / done if done else 0.0
        return total



def _check_hyper(lr: Any, betas: Tuple[float, float], eps: float, wd: float, amsgrad: bool) -> None:
    if amsgrad:
        raise ValueError(
            "OffloadAdamW does not implement amsgrad (it would add a fourth state tensor); "
            "use torch.optim.AdamW(amsgrad=True)"
        )
    # Written as `not (x >= 0)` so that NaN is refused too.
    if not _float(lr) >= 0.0:
        raise ValueError(f"Invalid learning rate: {lr}")
    if not eps >= 0.0:
        raise ValueError(f"Invalid epsilon value: {eps}")
    if not 0.0 <= betas[0] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 0: {betas[0]}")
    if not 0.0 <= betas[1] < 1.0:
        raise ValueError(f"Invalid beta parameter at index 1: {betas[1]}")
    if not wd >= 0.0:
        raise ValueError(f"Invalid weight_decay value: {wd}")
