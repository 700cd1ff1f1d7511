"""``OffloadAdamW``: torch's AdamW with its state in host memory or on NVMe, updated by a Rust
CPU kernel, and sharded across ranks ZeRO-style under ``torch.distributed``.

What it promises
    The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, per-group
    hyper-parameters read at every step, so LR schedulers work). On CPUs with FMA the result
    is bitwise equal to ``torch.optim.AdamW(fused=True)`` on fp32 parameters, and for bf16
    parameters to "fp32 master + fused AdamW + ``.to(bfloat16)``"; torch's ``foreach`` and
    for-loop implementations round differently from its own fused kernel and agree to a few ulp
    per step (Note [torch rounding] in ``rust/optim/kernel.rs``). State per parameter:
    ``exp_avg`` and ``exp_avg_sq`` in fp32 (``state_bits=32``, the default), bf16 (16) or
    block-wise 8-bit (8), plus an fp32 master copy when the parameter is not itself one (bf16
    parameters, parameters on a GPU) unless ``master_weights=False`` (Note [state formats] in
    formats.py: 12, 8 or 6.03 bytes per parameter with a master, 8, 4 or 2.03 without). A
    parameter whose ``.grad`` is None is skipped, step count included, as in torch, and has no
    state before its first gradient (Note [lazy state] in store.py). ``torch.amp.GradScaler``
    works as with torch's optimizers (Note [GradScaler] in adamw.py).

Where the state lives
    ``tier="host"``: in blocks of spillover's host pool (on the heap, with one warning, when
    the pool is full). ``tier="nvme"``: in slots of the process's swap files, streamed through
    a few pool blocks per step (read chunk i+1, update chunk i, write chunk i-1; Note
    [three-stage pipeline] in ``rust/optim/nvme.rs``); between steps it holds no pool memory.
    The swap engine is the process's one for these settings (``spillover._tiers.swap_for``):
    an ``offload_context(tier="nvme")`` with the same swap directories and I/O settings uses
    the same engine thread and the same files.
    A step that raises (``SwapIOError``, ``OutOfSpaceError``) leaves the state of the chunks it
    was streaming unspecified and counts no step: reload the last checkpoint.

The package
    ``adamw.py``: the ``torch.optim.Optimizer`` facade (Note [GradScaler]). ``store.py``: which
    parameters have state, in which state spaces, on which rank (Note [lazy state], Note
    [collectives at exit]). A state space holds the state of the parameters of one (dtype,
    device), one type per strategy: ``space.py`` the base and ``DirectSpace`` (Note [cpu
    parameters in place]), ``staged.py`` ``StagedSpace`` (Note [staged gradients], [gradient
    accumulation], [step in arrival order]) with ``inbwd.py`` mixed in (updates during
    backward: Note [update in backward], [speculative update]) and ``delayed.py`` mixed in
    (``overlap="delayed"``, the one-step delayed update: Note [delayed update]), ``sharded.py``
    ``ShardedSpace`` (Note [sharding]). ``fingerprint.py`` (Note [gradient fingerprint]),
    ``copies.py`` (the device copies), ``layout.py`` (records, sizes, counters: defined once),
    ``formats.py`` (what each ``state_bits`` stores; Note [state formats]), ``explain.py``
    (``OffloadAdamW.explain()``).
"""

from .adamw import OffloadAdamW

# Besides the public name, what other modules, tests and benches imported from spillover.optim
# when it was one module. The sizes a test changes are not among them: patch them where they
# are read (`spillover.optim.layout`, `spillover.optim.fingerprint`).
from .fingerprint import _fingerprint, _fingerprint_parts  # noqa: F401
from .layout import _ALIGN, BUFFER_RECORD, STEP_RECORD, _is_dtensor, _local, _round_up  # noqa: F401
from .space import _Space  # noqa: F401

__all__ = ["OffloadAdamW"]
