"""``OffloadAdamW``: torch's AdamW with its state in host memory or on NVMe, updated by a Rust
CPU kernel, and sharded across ranks ZeRO-style under ``torch.distributed``.

What it promises
    The update is ``torch.optim.AdamW``'s (decoupled weight decay, bias correction, per-group
    hyper-parameters read at every step, so LR schedulers work). On CPUs with FMA the result
    is bitwise equal to ``torch.optim.AdamW(fused=True)`` on fp32 parameters, and for bf16
    parameters to "fp32 master + fused AdamW + ``.to(bfloat16)``"; torch's ``foreach`` and
    for-loop implementations round differently from its own fused kernel and agree to a few ulp
    per step (Note [torch rounding] in ``rust/optim/kernel.rs``). State per parameter:
    ``exp_avg`` and ``exp_avg_sq`` in fp32, plus an fp32 master copy when the parameter is not
    itself one (bf16 parameters, parameters on a GPU). A parameter whose ``.grad`` is None is
    skipped, step count included, as in torch, and has no state before its first gradient
    (Note [lazy state]). ``torch.amp.GradScaler`` works as with torch's optimizers (Note
    [GradScaler]).

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

Note [cpu parameters in place]
    On CPU, with one rank, the kernel reads ``p.grad`` and updates ``p`` through their
    addresses, with no copy; an fp32 parameter is its own master copy, so nothing else is
    stored for it and changing it between steps (loading weights) is seen by the next step. A
    non-contiguous parameter or gradient goes through a contiguous copy.

Note [staged gradients]
    With parameters on a GPU, a post-accumulate-grad hook copies each gradient into a pinned
    pool block on a side stream as soon as backward has produced it, so the copies overlap the
    rest of backward. ``step()`` uses a staged copy only when it provably holds the gradient's
    current bytes; otherwise it copies again. Two checks, the cheap one first:

    - ``p.grad`` must still be the tensor that was copied, at the same version counter (a new
      tensor, clipping, a second backward, ``zero_()`` move it: copied again, nothing hashed);
    - the gradient's fingerprint now must equal the one taken right after the copy (Note
      [gradient fingerprint]). Version counters are not enough: measured with torch 2.15,
      ``dist.all_reduce(g)`` (SUM, gloo) leaves ``g._version`` where it was, as does
      ``dist.broadcast``; writes through ``g.data`` (``g.data.mul_``, ``.copy_``, item
      assignment) leave it too; ``all_reduce(op=AVG)`` on gloo happened to move it by one
      (a division in place after the sum), which is not a promise. GradScaler's in-place
      unscaling does not move it either (Note [GradScaler]). A step after any of these uses the
      new bytes (``grad_stale_copies`` in ``stats()`` counts the copies the fingerprint
      caught); tested with a ``.data`` write and with an in-place all-reduce on two gloo ranks.

    Next to DDP with ``shard=False`` the hooks copy the local gradients, before DDP's
    all-reduce has written the averaged ones, and the cheap check sees it at ``step()``
    (measured on gloo: with ``gradient_as_bucket_view=True`` ``p.grad`` is then another tensor,
    without it the same tensor at a later version), so every gradient is copied twice: correct
    (tested), but the overlap is lost; next to DDP use the sharded path
    (``reduce_grads=False``, Note [sharding]), which has no hooks.

    Parameters go back with asynchronous host-to-device copies per bucket (the CPU update of the
    next bucket overlaps them), and the compute stream waits for them, so the next forward sees
    the new values without a device-wide synchronize. The CPU tests run this path on CPU tensors
    (``_force_staging=True``, synchronous copies); the CUDA streams and events themselves are
    exercised only by the ``gpu``-marked tests.

Note [gradient fingerprint]
    Two integers modulo 2**64 over the bytes of a gradient read as int16 words w_i: in chunks c
    of ``_FP_WORDS`` (2**20) words, F_s = sum_c K_s(c) * sum_j w_{c,j} * r_s[j] for s = 0, 1,
    where r_0, r_1 are fixed pseudo-random odd 64-bit weights and K_s(c) pseudo-random odd
    per-chunk weights (splitmix64 of c).
    torch's int64 products and sums wrap modulo 2**64 (checked against exact integers in
    tests/python/test_optim_staged.py; modular sums do not depend on the reduction order, so
    every device and every run agree), and the chunks' partial sums are combined on the host in
    numpy uint64. Both fingerprints are taken on the gradient's device by the same function. The
    staged one is of the bytes that were staged: the hook copies each chunk to a device
    snapshot on the copy stream, fingerprints the snapshot and copies it to the host. The copy
    stream runs alongside whatever the compute stream (or a collective) does after the hook,
    and a write landing between two separate reads of the gradient could give a fingerprint of
    the new bytes next to a copy of the old ones, which would pass the check; read once, the
    two agree whatever they saw (a torn mix of old and new then fails the check at
    ``step()``). The current one is taken at ``step()`` after everything queued before it (all
    gradients in one batch, one transfer back).

    What it proves: equal fingerprints mean equal bytes unless the change happens to satisfy
    two relations modulo 2**64 in the weights. For a change made without knowledge of the
    weights (a collective, a clip, a write: anything but an adversary) each holds with a
    probability of about 2**-48 if the weights were drawn at random (a 16-bit word's difference
    has at most 15 trailing zero bits), both together about 2**-96: a 128-bit fingerprint with
    about 96 bits of strength against accidents, and none against an adversary (it is linear;
    not a cryptographic hash). Pseudo-random weights catch permutations, sign flips of balanced
    values and swapped chunks, which a plain or index-weighted sum can miss.

    Cost: per gradient, two passes on its device (one at the hook, on the copy stream; one at
    ``step()``), each two integer kernels per chunk with 16 bytes of temporaries per word
    (32 MiB per chunk) and about 50 bytes of memory traffic per word (25 per gradient byte);
    the hook's snapshot adds a device-to-device copy of each chunk (2 MiB).
    Measured on this repository's 2-core CPU host with torch CPU ops: 0.9 GiB/s of gradient
    (``benches/python/optim_bench.py --parts staged``), about twice the time the CPU update
    itself takes per gradient byte there — which is why it runs on the device, whose bandwidth
    is three orders of magnitude higher (an estimate: a few ms per GiB of gradient on an H200;
    ``benches/gpu/bench.py --mode optim`` measures it), and not on the host copy. A stale copy
    costs one more copy of that gradient at ``step()``, not overlapped with backward.

Note [gradient accumulation]
    Post-accumulate-grad hooks fire at every backward, so with N micro-batches per step a hook
    that copied each time would copy every gradient N times. Each space counts, per parameter,
    how many times its hook fired before the last ``step()`` (also a skipped one) and stages a
    copy only from that firing on: once per step in a steady loop. The count is only a guess
    about when to copy: a step with more micro-batches moves the version after the copy (copied
    again at ``step()``), one with fewer never stages (copied at ``step()``). While the count
    is unknown (the first step with hooks) every firing copies, as a loop without accumulation
    wants. The first ``step()`` of all makes the state (Note [lazy state]), so its gradients are
    all copied at ``step()``.

Note [step in arrival order]
    Backward produces the last layers' gradients first. ``step()`` takes the buckets (units
    of up to ``_BUCKET_ELEMS`` elements, in parameter order, one pinned block each) in the order
    their last staged gradient arrived this step — the hooks number their copies — and buckets
    whose gradients were not staged last, in parameter order. For each bucket it decides, and
    starts, the copies the next bucket needs (a stale or missing gradient, a first master copy)
    before running its own CPU update, which waits only for its own copies; the parameters go
    back per bucket. ``.order`` on a space records the last step's order.

    The CPU updates start at ``step()``, not during backward: until ``step()`` is called the
    user may still clip, unscale (GradScaler), all-reduce or edit gradients, change the learning
    rate (schedulers), or skip the step (GradScaler on inf/NaN), and every one of these decides
    what the update computes. An update started during backward would have to be undone or
    would be wrong in each case, so it is not the default; what overlaps backward is the
    copying, and (with the fingerprint) all of it is kept unless the user changed the gradient.
    ``update_in_backward=True`` starts them during backward and undoes the ones these change:
    Note [update in backward].

Note [update in backward]
    ``OffloadAdamW(..., update_in_backward=True)`` runs each bucket's CPU update during
    backward, on a worker thread, as a speculation that ``step()`` keeps, or undoes and redoes
    (clipping applied, a GradScaler's inf/NaN step, a later micro-batch): the whole contract
    is in ``_inbwd.py`` (Note [update in backward], Note [speculative update]).

Note [sharding]
    Under ``torch.distributed`` with world size W > 1 (unless ``shard=False``), the parameters
    of each (dtype, device) are laid end to end in a flat buffer (each padded to 16 elements,
    the whole to a multiple of 16 W) and rank r owns elements [r S, (r+1) S), S = size / W:
    only that shard's state exists on rank r. A step reduce-scatters the flat gradients (sum,
    then scaled by 1/W in the kernel; ``reduce_grads=False`` when DDP has already averaged
    them), updates the shard, and all-gathers the new parameters into every rank's model.
    Whether a parameter has a gradient is agreed on first (MAX over ranks; a rank without one
    contributes zeros), so every rank takes the same collectives and step counts. ``state_dict``
    gathers the full state on every rank (world-size independent, torch's format);
    ``load_state_dict`` takes each rank's part. At the sizes where sharding is needed the full
    state does not fit one rank: save through ``torch.distributed.checkpoint`` with
    :mod:`spillover.dcp` instead (per-rank pieces produced when the writer asks for them,
    loadable at any world size).

    Next to DDP, construct the optimizer on the wrapped module's parameters with
    ``reduce_grads=False``: DDP's all-reduce has already averaged the gradients, each rank
    takes its shard of them without communicating, and only the parameter all-gather remains
    (the state is still sharded). bf16 gradients are reduced in bf16, as DDP does.

    With FSDP2 (``fully_shard``) the parameters are already sharded DTensors and gradients are
    already reduce-scattered: pass ``shard=False`` (also chosen automatically when a parameter
    is a DTensor); each rank then runs the optimizer on its local shards (``to_local()``), with
    the state 1/W per rank as FSDP2 sharded it. FSDP2 assigns the sharded gradients itself, so
    the post-accumulate-grad hooks do not fire and ``step()`` copies the local gradients then.
    Tested on 2 CPU ranks (gloo) with ``spillover.wrap`` and ``offload_context``: parameters
    within torch's own AdamW implementations' tolerance of the same FSDP2 run with torch's
    AdamW, and a DCP checkpoint that resumes under FSDP2, ZeRO or one process
    (tests/python/test_dcp.py).

Note [collectives at exit]
    A gloo collective called from Python hands its tensors to a worker thread, which drops its
    reference to the work (and so to the tensors) only after the caller's ``wait()`` returned.
    On torch 2.15 a tensor that C++ also references holds a reference to its Python object,
    and dropping the last C++ reference decrefs that object: the gloo thread takes the GIL. A
    step's last collective is the parameter all-gather; when the script ends right after it
    (``dist.destroy_process_group()`` does not stop a group DDP still holds), the gloo thread
    can ask for the GIL once the interpreter is finalizing, and Python ends the thread with
    ``pthread_exit`` inside a C++ destructor: "terminate called without an active exception",
    SIGABRT at exit (seen on a core dump of the README's DDP snippet, about 1 run in 10 on 2
    cores). So every collective here is started with ``async_op=True``, waited for, and its
    work kept until the next ``step()``: the gloo thread's release is then never the last one,
    and the tensors are freed by the thread that holds the GIL.

Note [lazy state]
    As in torch, a parameter has no state until the first step at which it has a gradient: no
    pool blocks, no swap slots, no ``state_dict`` entry. ``step()`` first gives the parameters
    that have a gradient now and no state yet a state space of their own (one per dtype and
    device, laid out over just them), then steps every space. In the usual loop every
    trainable parameter joins at the first step, so there is one space per dtype and device;
    frozen parameters, and parameters that never receive a gradient, cost a check per step and
    nothing else. A parameter that starts receiving gradients later (unfrozen after a warm-up)
    gets a new space then, at no cost to the existing ones. A parameter that stops receiving
    them keeps its state and is skipped, as in torch. ``load_state_dict`` replaces the spaces
    by new ones for exactly the parameters the checkpoint holds state for.

    Under sharding every rank must build the same spaces, so the candidates are the parameters
    without state that have ``requires_grad=True`` (it must agree across ranks, as DDP also
    requires), and one MAX all-reduce over them decides which of them have a gradient on some
    rank; those join together, sharded over a flat layout of just themselves (Note
    [sharding]). A parameter whose ``requires_grad`` is switched on later joins at the first
    step at which a rank has its gradient; one switched off keeps its state. A gradient
    assigned by hand to a parameter with ``requires_grad=False`` and no state is refused with
    a RuntimeError under sharding (the other ranks could not know of it).

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
    ``found_inf`` skips the step (Note [speculative update] in _inbwd.py).

    Under sharding with ``reduce_grads=True`` each rank holds its own gradients and the ranks
    can disagree on inf: use ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``
    (``device="cpu"`` for CPU parameters), whose ``unscale_`` all-reduces the inf flag, so the
    ranks skip or step together. With a plain GradScaler the ranks that step would wait in a
    collective for a rank that skipped. Next to DDP (``reduce_grads=False``) the gradients are
    already averaged and a plain GradScaler decides the same on every rank. Sharded ranks do
    not set ``_step_supports_amp_scaling`` (ShardedGradScaler all-reduces the inf flag only in
    ``unscale_``, which that path skips): the scaler unscales the gradients before ``step()``,
    which reads them afresh (no hooks when sharded).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import threading
import weakref
from typing import Any, Dict, Iterable, List, Optional, Tuple

import numpy as np
import torch

from . import _adamw_switches as _switches
from . import _native, _runtime, _tiers
from ._inbwd import INBWD_STATS, InBackward
from .config import Config
from .errors import PoolExhaustedError
from .transfer import block_tensor

__all__ = ["OffloadAdamW"]

# One record per unit and step; must match STEP_RECORD in rust/py/optim.rs.
STEP_RECORD = np.dtype(
    [
        ("unit", "<u8"),
        ("grad", "<u8"),
        ("src", "<u8"),
        ("out", "<u8"),
        ("flags", "<u8"),
        ("lr", "<f8"),
        ("beta1", "<f8"),
        ("beta2", "<f8"),
        ("eps", "<f8"),
        ("weight_decay", "<f8"),
        ("step", "<f8"),
        ("grad_scale", "<f8"),
        ("tail", "<u8"),
    ]
)
# One record per unit for export/import; must match BUFFER_RECORD in rust/py/optim.rs.
BUFFER_RECORD = np.dtype(
    [("unit", "<u8"), ("master", "<u8"), ("exp_avg", "<u8"), ("exp_avg_sq", "<u8")]
)
_GRAD_BF16, _SRC_BF16, _OUT_BF16 = 1, 2, 4

_DTYPES = (torch.float32, torch.bfloat16)
# torch's fused CPU AdamW updates the last `numel % 8` elements of each tensor in a scalar
# loop that rounds differently (AVX2 and AVX-512 builds alike; measured): Note [torch rounding].
_TORCH_TAIL = 8
_ALIGN = 16  # elements; units and flat-buffer offsets start on these (rust/optim/layout.rs)
_HOST_CHUNK_BYTES = 64 << 20
_NVME_CHUNK_BYTES = 8 << 20
_BUCKET_ELEMS = 8 << 20  # staged path: parameters go back per bucket of this many elements
_UNIT_MAX = 16 << 20  # staged path: larger parameters are split into units of this many
# OffloadAdamW.stats(): the counters of AdamState.stats(), and those that add up over time.
_STATS = (
    "steps",
    "bytes_read",
    "bytes_written",
    "io_wait_seconds",
    "compute_seconds",
    "last_step_seconds",
    "state_bytes",
    "heap_chunks",
)
_CUMULATIVE = ("bytes_read", "bytes_written", "io_wait_seconds", "compute_seconds")
# Note [speculative update]: steps that kept an update made during backward, that undid and
# redid one, that GradScaler skipped.
_ROUND_STATS = ("steps_in_backward", "steps_redone", "steps_skipped")
_HYPER = np.dtype(
    [(n, "<f8") for n in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")]
)
# The staged path's gradient counters (Python-side, per space): device-to-host gradient copies
# (one per unit), their bytes, and those made because a staged copy's fingerprint no longer
# matched the gradient (Note [staged gradients]).
_GRAD_STATS = ("grad_copies", "grad_bytes_copied", "grad_stale_copies")
# Note [gradient fingerprint]: words per chunk (temporaries: 2 x 8 bytes per word), the two
# weight sequences' seed, and the constants seeding each chunk's weight.
_FP_WORDS = 1 << 20
_FP_SEED = 0x5EED_F1A6
_FP_CHUNK_K = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_FP_CACHE: Dict[Any, torch.Tensor] = {}

def _bf16_flag(dtype: torch.dtype, bit: int) -> int:
    return bit if dtype == torch.bfloat16 else 0


def _local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (FSDP2), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _is_dtensor(t: torch.Tensor) -> bool:
    return callable(getattr(t, "to_local", None))


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _float(x: Any) -> float:
    return float(x.item()) if isinstance(x, torch.Tensor) else float(x)


def _fp_weights(device: torch.device) -> torch.Tensor:
    """Note [gradient fingerprint]: the two sequences of odd 64-bit weights, (2, _FP_WORDS)
    int64 on `device` (made once per device and chunk size)."""
    key = (str(device), _FP_WORDS)
    w = _FP_CACHE.get(key)
    if w is None:
        rng = np.random.default_rng(_FP_SEED)
        r = rng.integers(0, 1 << 64, size=(2, _FP_WORDS), dtype=np.uint64, endpoint=False)
        w = torch.from_numpy((r | np.uint64(1)).view(np.int64)).to(device)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # used from the side streams too
        _FP_CACHE[key] = w
    return w


@functools.lru_cache(maxsize=1 << 16)
def _fp_chunk_multiplier(s: int, c: int) -> int:
    """The odd pseudo-random weight of chunk c's sum in sequence s (splitmix64 of c)."""
    m = (1 << 64) - 1
    z = (c * _FP_CHUNK_K[0] + _FP_CHUNK_K[1] * (s + 1)) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) | 1


def _fingerprint_parts(t: torch.Tensor) -> torch.Tensor:
    """Per chunk of ``_FP_WORDS`` int16 words of `t`'s bytes, the two weighted sums modulo
    2**64: a (chunks, 2) int64 tensor on `t`'s device (Note [gradient fingerprint])."""
    t = _local(t).detach()
    words = t.reshape(-1).contiguous().view(torch.int16)
    r = _fp_weights(words.device)
    if words.numel() == 0:
        return torch.zeros((1, 2), dtype=torch.int64, device=words.device)
    parts = []
    for lo in range(0, words.numel(), _FP_WORDS):
        x = words[lo : lo + _FP_WORDS]  # int16 * int64: an int64 product, x is not widened
        parts.append((x * r[:, : x.numel()]).sum(dim=1))  # wraps modulo 2**64
    return torch.stack(parts)


def _fp_chunks(numel: int, dtype: torch.dtype) -> int:
    words = numel * torch.empty((), dtype=dtype).element_size() // 2
    return max(1, -(-words // _FP_WORDS))


def _fp_combine(parts: np.ndarray) -> Tuple[int, int]:
    """The fingerprint from a (chunks, 2) int64 array of `_fingerprint_parts`."""
    u = np.ascontiguousarray(parts).view(np.uint64).reshape(-1, 2)
    out = []
    for s in range(2):
        m = np.array([_fp_chunk_multiplier(s, c) for c in range(len(u))], dtype=np.uint64)
        out.append(int((u[:, s] * m).sum(dtype=np.uint64)))  # uint64 arrays wrap
    return out[0], out[1]


def _fingerprint(t: torch.Tensor) -> Tuple[int, int]:
    """Note [gradient fingerprint] of `t`'s bytes: two integers modulo 2**64."""
    return _fp_combine(_fingerprint_parts(t).cpu().numpy())


class _Copies:
    """Device <-> pinned host copies for the staged path; synchronous on CPU (tests)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.d2h = torch.cuda.Stream(device)
            self.h2d = torch.cuda.Stream(device)
            _fp_weights(device)  # made here, on the compute stream, before any use

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        if not self.cuda:
            dst.copy_(src)
            return None
        # The producer of `src` is the compute stream; the caching allocator must not reuse
        # `src` (zero_grad may free it) before this stream has read it.
        self.d2h.wait_stream(torch.cuda.current_stream(src.device))
        with torch.cuda.stream(self.d2h):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        src.record_stream(self.d2h)
        return ev

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> Any:
        """Copy `src` (host) into `dst` (device): the copy waits for the compute stream and the
        compute stream for the copy (on the main thread, at ``step()``)."""
        if not self.cuda:
            dst.copy_(src)
            return None
        compute = torch.cuda.current_stream(dst.device)
        self.h2d.wait_stream(compute)  # kernels queued before may still read the parameter
        with torch.cuda.stream(self.h2d):
            dst.copy_(src, non_blocking=True)
            ev = torch.cuda.Event()
            ev.record()
        compute.wait_event(ev)  # Note [staged gradients]: the next forward sees new values
        return ev

    def stage(
        self, src: torch.Tensor, units: List[Tuple[torch.Tensor, int, int]], fp_dst: torch.Tensor
    ) -> Tuple[List[Any], Any]:
        """Note [gradient fingerprint]: copy the flat gradient `src` into the host views of its
        units (``(dst, start, n)``, in order, covering it) through device snapshots of one
        fingerprint chunk each, and each snapshot's sums into the host tensor `fp_dst`, so the
        staged bytes and the fingerprint are of the same bytes even if `src` is written while
        the copy runs. Returns one event per unit and one after the fingerprint."""
        if self.cuda:
            self.d2h.wait_stream(torch.cuda.current_stream(src.device))
            ctx: Any = torch.cuda.stream(self.d2h)
        else:
            ctx = contextlib.nullcontext()
        esize = src.element_size()
        chunk = _FP_WORDS * 2 // esize
        events: List[Any] = []
        with ctx:
            r = _fp_weights(src.device)
            parts = []
            u = 0
            for lo in range(0, src.numel(), chunk):
                hi = min(lo + chunk, src.numel())
                snap = src[lo:hi].clone()
                words = snap.view(torch.int16)
                parts.append((words * r[:, : words.numel()]).sum(dim=1))
                while u < len(units):
                    dst, start, n = units[u]
                    a, b = max(lo, start), min(hi, start + n)
                    if a < b:
                        dst[a - start : b - start].copy_(snap[a - lo : b - lo], non_blocking=True)
                    if start + n > hi:
                        break  # the unit goes on in the next chunk
                    events.append(self._record())
                    u += 1
            while u < len(units):  # empty units at the end
                events.append(self._record())
                u += 1
            if not parts:
                parts.append(torch.zeros(2, dtype=torch.int64, device=src.device))
            fp_dst.copy_(torch.stack(parts), non_blocking=True)
            fp_event = self._record()
        if self.cuda:
            src.record_stream(self.d2h)
        return events, fp_event

    def _record(self) -> Any:
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record()
        return ev

    @staticmethod
    def wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()


class _Staged:
    """A gradient copy a hook started (Note [staged gradients]): the copies' events (one per
    unit), the event after its fingerprint, the gradient tensor and its version then."""

    __slots__ = ("events", "fp_event", "grad", "version")

    def __init__(self, events: List[Any], fp_event: Any, grad: torch.Tensor, version: int):
        self.events, self.fp_event, self.grad, self.version = events, fp_event, grad, version


class _Space(InBackward):
    """The state of the parameters of one (dtype, device): a native AdamState over *units*
    (whole parameters, the parts of them this rank owns, or — on the staged path — pieces of
    at most ``_UNIT_MAX`` elements, so every staging buffer fits a pool block)."""

    def __init__(
        self, opt: OffloadAdamW, dtype: torch.dtype, device: torch.device, members: List[int]
    ):
        self.opt = weakref.proxy(opt)
        self.dtype = dtype
        self.device = device
        self.members = members  # global parameter indices, in order
        self.params = [opt._params[i] for i in members]
        self.sharded = opt._world > 1
        # update_in_backward stages CPU parameters too (Note [update in backward])
        self.staged = device.type != "cpu" or opt._force_staging or opt._inbwd
        # CPU parameters staged for update_in_backward: the staged copy is in host memory next
        # to the gradient, so comparing the bytes is exact and cheaper than fingerprints
        # (Note [speculative update]); _force_staging keeps the GPU path's fingerprints.
        self.compare_bytes = device.type == "cpu" and not opt._force_staging
        self.master = dtype != torch.float32 or self.staged
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.numels = [_local(p).numel() for p in self.params]
        # units: (member position, start in the parameter, length, offset in the flat buffers)
        self.units: List[Tuple[int, int, int, int]] = []
        if self.sharded:
            self._layout_sharded(opt._world, opt._rank)
        elif self.staged:
            at = 0
            for k, n in enumerate(self.numels):
                self._add_units(k, 0, n, at)
                at += _round_up(n, _ALIGN)
        else:
            self.units = [(k, 0, n, -1) for k, n in enumerate(self.numels)]
        self.unit_global = np.array([members[u[0]] for u in self.units], dtype=np.int64)
        self.units_of: Dict[int, List[int]] = {}
        for ui, u in enumerate(self.units):
            self.units_of.setdefault(u[0], []).append(ui)
        self.rec = np.zeros(len(self.units), STEP_RECORD)
        self.rec["unit"] = np.arange(len(self.units))
        self.rec["tail"] = [
            max(0, start + n - max(start, self.numels[k] - self.numels[k] % _TORCH_TAIL))
            for k, start, n, _ in self.units
        ]
        for k, p in enumerate(self.params):
            if self.staged and len(self.units_of.get(k, [])) > 1 and not p.is_contiguous():
                raise ValueError(
                    f"OffloadAdamW: a non-contiguous parameter of {self.numels[k]} elements on "
                    f"{device} is larger than one staging unit ({_UNIT_MAX}); make it contiguous"
                )
        self.hooks: List[Any] = []
        # Note [staged gradients]: per bucket, the copies of the last step's parameters back to
        # the device (they read its output buffer); per member, the copy the hooks staged.
        self.h2d_events: Dict[int, List[Any]] = {}
        self.staged_grads: Dict[int, _Staged] = {}
        self.fired = np.zeros(len(self.params), dtype=np.int64)  # hook calls this step
        self.expect = np.zeros(len(self.params), dtype=np.int64)  # ... last step (0: unknown)
        self.arrival: Dict[int, int] = {}  # member -> sequence number of its staging this step
        self.seq = 0
        self.order: List[int] = []  # buckets in the order the last step processed them
        self.counters = {k: 0 for k in _GRAD_STATS + INBWD_STATS}
        # Note [update in backward]: the bookkeeping the hooks and the worker share (lock).
        self.inbwd = bool(opt._inbwd) and self.staged and not self.sharded
        self.lock = threading.Lock()
        self.inbwd_log: List[Tuple[int, float, float]] = []  # last round: (bucket, start, end)
        self.undo: Dict[Any, torch.Tensor] = {}  # Note [speculative update]: host buffers
        self.undo_state: Any = None  # ... and on the NVMe tier, the copy on the swap files
        self.last_round = (0, 0)  # the last step's buckets kept, redone
        self._new_round()
        self._alloc_buffers()
        self.state = self._make_state([u[2] for u in self.units])
        if self.staged and not self.sharded:
            self.buckets_of: Dict[int, List[int]] = {}
            for b, members in enumerate(self.bucket_members):
                for k in members:
                    self.buckets_of.setdefault(k, []).append(b)
            self.inited = np.zeros(len(self.units), dtype=bool)
            self._register_hooks()

    # ---- construction ----

    def _add_units(self, k: int, start: int, n: int, at: int) -> None:
        """Units for elements [start, start + n) of member k at flat offset `at`; split on the
        staged and sharded paths (pieces start on multiples of _UNIT_MAX, a multiple of 16), so
        a staging buffer fits a pool block and a unit exported for a DCP save stays bounded
        (Note [pieces, produced when asked] in dcp.py)."""
        if not (self.staged or self.sharded):
            self.units.append((k, start, n, at))
            return
        end = start + n
        while start < end:
            piece = min(end, (start // _UNIT_MAX + 1) * _UNIT_MAX) - start
            self.units.append((k, start, piece, at))
            start += piece
            at += piece

    def _layout_sharded(self, world: int, rank: int) -> None:
        offs = []
        at = 0
        for n in self.numels:
            offs.append(at)
            at += _round_up(n, _ALIGN)
        total = _round_up(max(at, 1), _ALIGN * world)
        self.offsets = offs
        self.total = total
        self.shard = total // world
        lo, hi = rank * self.shard, (rank + 1) * self.shard
        for k, (off, n) in enumerate(zip(offs, self.numels)):
            a, b = max(off, lo), min(off + n, hi)
            if a < b:
                self._add_units(k, a - off, b - a, a - lo)

    def _alloc_buffers(self) -> None:
        """Flat device buffers (sharded) and pinned staging buffers (staged), and each unit's
        gradient and output addresses in them (they never move)."""
        opt = self.opt
        dev, dt = self.device, self.dtype
        n_units = len(self.units)
        self.grad_addr = np.zeros(n_units, dtype=np.uint64)
        self.out_addr = np.zeros(n_units, dtype=np.uint64)
        if self.sharded:
            self.flat_grad = torch.zeros(self.total, dtype=dt, device=dev)
            self.flat_param = torch.empty(self.total, dtype=dt, device=dev)
            lo = opt._rank * self.shard
            self.grad_shard = (
                torch.empty(self.shard, dtype=dt, device=dev)
                if opt._reduce_grads
                else self.flat_grad[lo : lo + self.shard]
            )
            self.param_shard = torch.empty(self.shard, dtype=dt, device=dev)
        if not self.staged:
            if self.sharded:  # the kernel works on the CPU shard buffers directly
                at = np.array([u[3] for u in self.units], dtype=np.uint64) * np.uint64(self.esize)
                self.grad_addr[:] = np.uint64(self.grad_shard.data_ptr()) + at
                self.out_addr[:] = np.uint64(self.param_shard.data_ptr()) + at
            return
        if dev.type == "cuda":
            _runtime.register_with_cuda(opt._pool)
        self.copies = _Copies(dev)
        # Buckets of consecutive units: one pinned block each for gradients and outputs.
        self.buckets: List[Tuple[List[int], int, int, torch.Tensor, torch.Tensor]] = []
        self.grad_view: List[torch.Tensor] = []
        self.out_view: List[torch.Tensor] = []
        for rows in _buckets(list(range(n_units)), self.units, _BUCKET_ELEMS):
            f_lo = self.units[rows[0]][3]
            f_hi = self.units[rows[-1]][3] + self.units[rows[-1]][2]
            g, o = self._pinned(f_hi - f_lo), self._pinned(f_hi - f_lo)
            self.buckets.append((rows, f_lo, f_hi, g, o))
            for ui in rows:
                _, _, n, at = self.units[ui]
                self.grad_view.append(g[at - f_lo : at - f_lo + n])
                self.out_view.append(o[at - f_lo : at - f_lo + n])
                self.grad_addr[ui] = self.grad_view[ui].data_ptr()
                self.out_addr[ui] = self.out_view[ui].data_ptr()
        # Members with units in each bucket (a large parameter spans several buckets).
        self.bucket_members = [sorted({self.units[ui][0] for ui in b[0]}) for b in self.buckets]
        if self.sharded:
            return
        # Note [gradient fingerprint]: the staged copies' fingerprints, one row per chunk.
        counts = [_fp_chunks(n, self.dtype) for n in self.numels]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.fp_rows = [(int(starts[k]), int(starts[k + 1])) for k in range(len(counts))]
        self.fp_host = torch.zeros(
            (int(starts[-1]), 2), dtype=torch.int64, pin_memory=dev.type == "cuda"
        )

    def _pinned(self, n: int) -> torch.Tensor:
        opt = self.opt
        nbytes = max(n, 1) * self.esize
        try:
            return block_tensor(opt._pool.lease(nbytes))[:nbytes].view(self.dtype)
        except PoolExhaustedError:
            _runtime.warn_once(
                "optim-staging",
                "spillover: OffloadAdamW's staging buffers did not fit the host pool; using "
                "separately pinned memory. Raise SPILLOVER_HOST_POOL_BYTES to avoid it.",
            )
            return torch.empty(max(n, 1), dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def _make_state(self, lens: List[int]) -> Any:
        opt = self.opt
        cols = 3 if self.master else 2
        chunk_bytes = opt._chunk_bytes or (
            _NVME_CHUNK_BYTES if opt._tier == "nvme" else _HOST_CHUNK_BYTES
        )
        chunk_elems = max(1024, chunk_bytes // (4 * cols) // 1024 * 1024)
        kw: Dict[str, Any] = dict(master=self.master, chunk_elems=chunk_elems, tier=opt._tier)
        if opt._tier == "nvme":
            # swap_for has already warned (once) with the engine's warning.
            kw.update(swap=opt._swap, buffers=opt._nvme_buffers)
        st = _native.AdamState(opt._pool, lens, **kw)
        heap = st.stats()["heap_chunks"]
        if heap:
            _runtime.warn_once(
                "optim-heap",
                f"spillover: {heap} chunk(s) of OffloadAdamW's host state did not fit the host "
                "pool and live in ordinary heap memory (not pinned); raise "
                "SPILLOVER_HOST_POOL_BYTES to keep all of it in the pool.",
            )
        return st

    def _register_hooks(self) -> None:
        ref = weakref.ref(self)
        for k, p in enumerate(self.params):
            if not p.requires_grad:
                continue

            def hook(param: torch.Tensor, k: int = k) -> None:
                space = ref()
                if space is not None:
                    space._stage_grad(k, param)

            self.hooks.append(p.register_post_accumulate_grad_hook(hook))

    def close(self) -> None:
        """Remove the hooks, wait for the update-in-backward worker and for the copies still in
        flight from or to the staging buffers, so the buffers can be freed."""
        for h in self.hooks:
            h.remove()
        self.hooks = []
        self.join()
        self._new_round()
        if self.staged:
            pending = [e for evs in self.h2d_events.values() for e in evs]
            for st in self.staged_grads.values():
                pending += st.events + [st.fp_event]
            for ev in pending:
                self.copies.wait(ev)
        self.h2d_events = {}
        self.staged_grads = {}

    # ---- the staged path (Note [staged gradients]) ----

    def _copy_grad(
        self, k: int, g: torch.Tensor, skip: frozenset = frozenset()
    ) -> Tuple[List[Any], List[int]]:
        """Start copying member k's gradient into the staging buffers of its units not in
        `skip`; one event per unit, and the units, in the order of ``units_of[k]``."""
        flat = _local(g).reshape(-1)
        events, uis = [], []
        for ui in self.units_of.get(k, []):
            if ui in skip:
                continue
            _, start, n, _ = self.units[ui]
            events.append(self.copies.to_host(self.grad_view[ui], flat[start : start + n]))
            uis.append(ui)
            self.counters["grad_copies"] += 1
            self.counters["grad_bytes_copied"] += n * self.esize
        return events, uis

    def _stage_grad(self, k: int, p: torch.Tensor) -> None:
        """The post-accumulate-grad hook: Note [gradient accumulation]."""
        if self.inbwd:
            self._stage_inbwd(k, p)
            return
        self.fired[k] += 1
        g = p.grad
        if g is None or (self.expect[k] and self.fired[k] < self.expect[k]):
            return
        self._stage_copy(k, g)

    def _stage_copy(self, k: int, g: torch.Tensor) -> bool:
        """Stage member k's gradient `g` (Note [gradient fingerprint]); False when it is left
        to ``step()`` (another dtype: converted when copied)."""
        if _local(g).dtype != self.dtype:  # converted when copied: left to step()
            self.staged_grads.pop(k, None)
            return False
        flat = _local(g).reshape(-1)
        units = []
        for ui in self.units_of.get(k, []):
            _, start, n, _ = self.units[ui]
            units.append((self.grad_view[ui], start, n))
            self.counters["grad_copies"] += 1
            self.counters["grad_bytes_copied"] += n * self.esize
        if self.compare_bytes:  # checked by comparing bytes: no fingerprint
            for dst, start, n in units:
                dst.copy_(flat[start : start + n])
            events, fp_event = [None] * len(units), None
        else:
            lo, hi = self.fp_rows[k]
            events, fp_event = self.copies.stage(flat, units, self.fp_host[lo:hi])
        self.staged_grads[k] = _Staged(events, fp_event, g, g._version)
        self.seq += 1
        self.arrival[k] = self.seq  # the last staging counts: its copy lands last
        return True

    # ---- updates during backward: _inbwd.InBackward ----

    def _count(self, done: List[int]) -> np.ndarray:
        """Global indices of the parameters with units in `done`."""
        return np.unique(self.unit_global[np.asarray(done, dtype=np.int64)])

    def end_without_step(self) -> None:
        """End a step that updates nothing: the staged copies are dropped and the hooks'
        counts are learnt."""
        self.staged_grads = {}
        self.end_step()

    def end_step(self) -> None:
        """Learn how many times each hook fires per step (Note [gradient accumulation]) and
        start counting afresh; called after every step, skipped ones included."""
        fired = self.fired > 0
        self.expect[fired] = self.fired[fired]
        self.fired[:] = 0
        self.arrival = {}

    def _wait_h2d(self, b: int) -> None:
        """Bucket b's output buffer is about to be overwritten: its copies back must be done."""
        for ev in self.h2d_events.pop(b, []):
            self.copies.wait(ev)

    # ---- step ----

    def step(self, hyper: np.ndarray) -> np.ndarray:
        """One step; returns the global indices of the parameters that were updated.
        `hyper`: per global parameter, lr, beta1, beta2, eps, weight_decay, grad_scale."""
        if self.sharded:
            return self._step_sharded(hyper)
        if self.inbwd:
            return self._step_inbwd(hyper)
        if self.staged:
            return self._step_staged(hyper)
        return self._step_direct(hyper)

    def _fill_hyper(self, rows: np.ndarray, hyper: np.ndarray, scale: float = 1.0) -> None:
        """Hyper-parameters and step counts for the units in `rows`."""
        rec = self.rec
        g = self.unit_global[rows]
        h = hyper[g]
        for name in ("lr", "beta1", "beta2", "eps", "weight_decay"):
            rec[name][rows] = h[name]
        rec["step"][rows] = self.opt._steps[g] + 1
        rec["grad_scale"][rows] = h["grad_scale"] * scale

    def _flat_records(self, rows: np.ndarray) -> bytes:
        """Records for units whose gradient and output are in the flat or staging buffers."""
        rec = self.rec
        rec["grad"][rows] = self.grad_addr[rows]
        rec["out"][rows] = self.out_addr[rows]
        rec["src"][rows] = self.out_addr[rows]  # holds the parameter when a unit starts
        rec["flags"][rows] = _bf16_flag(self.dtype, _GRAD_BF16 | _SRC_BF16 | _OUT_BF16)
        return rec[rows].tobytes()

    def _check(self, p: torch.Tensor) -> None:
        if p.dtype != self.dtype or p.device != self.device:
            raise RuntimeError(
                f"OffloadAdamW: a parameter changed from {self.dtype} on {self.device} to "
                f"{p.dtype} on {p.device} after the optimizer was made; make the optimizer "
                "after moving or casting the model"
            )

    def _step_direct(self, hyper: np.ndarray) -> np.ndarray:
        """Note [cpu parameters in place]."""
        rows: List[int] = []
        grads: List[int] = []
        flags: List[int] = []
        params: List[int] = []
        keep: List[torch.Tensor] = []
        fixups: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for ui, p in enumerate(self.params):
            g = p.grad
            if g is None:
                continue
            p = _local(p)
            g = _local(g)
            self._check(p)
            if g.is_sparse:
                raise RuntimeError("OffloadAdamW does not support sparse gradients")
            if g.device != p.device:
                raise RuntimeError(f"gradient on {g.device} for a parameter on {p.device}")
            if g.dtype not in _DTYPES:
                g = g.to(p.dtype)
            if not g.is_contiguous():
                g = g.contiguous()
            keep.append(g)
            if not p.is_contiguous():
                c = p.detach().contiguous()
                fixups.append((p, c))
                p = c
            rows.append(ui)
            grads.append(g.data_ptr())
            params.append(p.data_ptr())
            flags.append(_bf16_flag(g.dtype, _GRAD_BF16))
        if not rows:
            return np.zeros(0, dtype=np.int64)
        idx = np.asarray(rows, dtype=np.int64)
        rec = self.rec
        rec["grad"][idx] = grads
        rec["src"][idx] = params
        rec["out"][idx] = params
        pflags = _bf16_flag(self.dtype, _SRC_BF16 | _OUT_BF16)
        rec["flags"][idx] = np.asarray(flags, dtype=np.uint64) | np.uint64(pflags)
        self._fill_hyper(idx, hyper)
        self.state.step(rec[idx].tobytes())
        del keep
        for p, c in fixups:
            p.detach().copy_(c)
        return self.unit_global[idx]

    def _step_staged(self, hyper: np.ndarray, done: frozenset = frozenset()) -> np.ndarray:
        """One rank, parameters on a device: Note [staged gradients]. Buckets go in the order
        their gradients arrived (Note [step in arrival order]); each bucket's CPU update waits
        only for its own copies, and the next bucket's copies are decided and started before
        it, so they overlap it. Units in `done` were updated during backward (Note [update in
        backward]) and are left alone."""
        staged, self.staged_grads = self.staged_grads, {}
        arrival = self.arrival
        self.end_step()
        grads: Dict[int, torch.Tensor] = {}
        for k, p in enumerate(self.params):
            if p.grad is not None and any(ui not in done for ui in self.units_of.get(k, [])):
                self._check(_local(p))
                grads[k] = p.grad
        if not grads:
            return np.zeros(0, dtype=np.int64)
        # Cheap filter first: a staged copy of another tensor, or of this one at an older
        # version, is stale without hashing; the rest are fingerprinted now, in one batch.
        fresh_candidates = [
            k
            for k, g in grads.items()
            if k in staged and staged[k].grad is g and g._version == staged[k].version
        ]
        candidates = set(fresh_candidates)
        now = {}
        if not self.compare_bytes:
            now = self._fingerprints_now({k: grads[k] for k in fresh_candidates})
        order = self._bucket_order(arrival, grads)
        self.order = order
        initialized = self.state.initialized()
        events: Dict[int, List[Any]] = {}
        decided: set = set()

        def prepare(b: int) -> None:
            """Decide and start the copies bucket b needs (gradients, first masters)."""
            self._wait_h2d(b)
            for k in self.bucket_members[b]:
                if k not in grads or k in decided:
                    continue
                decided.add(k)
                st = staged.get(k)
                if st is not None and k in candidates:  # staged, same tensor and version
                    if (
                        self._same_bytes(k, grads[k])
                        if self.compare_bytes
                        else self._staged_fingerprint_of(st, k) == now[k]
                    ):
                        evs = st.events
                        uis = self.units_of.get(k, [])
                    else:  # the same tensor and version, other bytes: Note [staged gradients]
                        self.counters["grad_stale_copies"] += len(self.units_of.get(k, []))
                        evs, uis = self._copy_grad(k, grads[k], done)
                else:  # not staged, or replaced or changed in place since (version moved)
                    evs, uis = self._copy_grad(k, grads[k], done)
                for ui, ev in zip(uis, evs):
                    events[ui] = [ev]
            for ui in self.buckets[b][0]:
                k, start, n, _ = self.units[ui]
                if k in grads and ui not in done and not initialized[ui]:  # master from param
                    flat = _local(self.params[k]).detach().reshape(-1)[start : start + n]
                    events[ui].append(self.copies.to_host(self.out_view[ui], flat))

        updated: List[int] = []
        if order:
            prepare(order[0])
        for i, b in enumerate(order):
            if i + 1 < len(order):
                prepare(order[i + 1])
            mine = [ui for ui in self.buckets[b][0] if ui in events and ui not in done]
            if not mine:
                continue
            for ui in mine:
                for ev in events[ui]:
                    self.copies.wait(ev)
            rows = np.asarray(mine, dtype=np.int64)
            self._fill_hyper(rows, hyper)
            self.state.step(self._flat_records(rows))
            updated.extend(mine)
            self._send_back(b, mine)
        return np.unique(self.unit_global[np.asarray(updated, dtype=np.int64)])

    def _send_back(self, b: int, rows: List[int]) -> None:
        """Copy the parameters of bucket b's units `rows` from its output buffer."""
        back = []
        with torch.no_grad():
            for ui in rows:
                k, start, n, _ = self.units[ui]
                p = _local(self.params[k])
                if n == p.numel():
                    dst, src = p, self.out_view[ui].view(p.shape)
                else:  # a piece of a large parameter (contiguous: checked at build)
                    dst, src = p.view(-1)[start : start + n], self.out_view[ui]
                back.append(self.copies.to_device(dst, src))
        self.h2d_events[b] = back

    def _same_bytes(self, k: int, g: torch.Tensor) -> bool:
        """``compare_bytes``: whether member k's staged copy holds `g`'s bytes, compared as
        integers (bit for bit: NaN payloads, signed zeros)."""
        flat = _local(g).detach().reshape(-1)
        if flat.dtype != self.dtype:
            return False
        word = torch.int16 if self.esize == 2 else torch.int32
        for ui in self.units_of.get(k, []):
            _, start, n, _ = self.units[ui]
            staged, now = self.grad_view[ui].view(word), flat[start : start + n].view(word)
            if not np.array_equal(staged.numpy(), now.numpy()):  # measured: 4x torch.equal
                return False
        return True

    def _staged_fingerprint(self, k: int) -> Tuple[int, int]:
        """Note [gradient fingerprint] of member k's staged copy (waits for it)."""
        return self._staged_fingerprint_of(self.staged_grads[k], k)

    def _staged_fingerprint_of(self, st: _Staged, k: int) -> Tuple[int, int]:
        self.copies.wait(st.fp_event)
        lo, hi = self.fp_rows[k]
        return _fp_combine(self.fp_host[lo:hi].numpy())

    def _fingerprints_now(self, grads: Dict[int, torch.Tensor]) -> Dict[int, Tuple[int, int]]:
        """Note [gradient fingerprint] of each gradient as it is now: computed on its device
        after everything queued before ``step()``, brought back in one copy."""
        if not grads:
            return {}
        keys = list(grads)
        parts = [_fingerprint_parts(grads[k]) for k in keys]
        host = torch.cat(parts).cpu().numpy()
        out, at = {}, 0
        for k, part in zip(keys, parts):
            out[k] = _fp_combine(host[at : at + len(part)])
            at += len(part)
        return out

    def _bucket_order(self, arrival: Dict[int, int], grads: Dict[int, torch.Tensor]) -> List[int]:
        """Note [step in arrival order]: the buckets with a gradient, ordered by when their last
        staged member's gradient arrived; buckets with a gradient the hooks did not stage (it
        is copied now) come after, in parameter order."""
        late = float("inf")
        keys = []
        for b, members in enumerate(self.bucket_members):
            mine = [k for k in members if k in grads]
            if mine:
                keys.append((max(arrival.get(k, late) for k in mine), b))
        return [b for _, b in sorted(keys)]

    def _step_sharded(self, hyper: np.ndarray) -> np.ndarray:
        """Note [sharding]."""
        import torch.distributed as dist

        opt = self.opt
        has = torch.tensor(
            [p.grad is not None for p in self.params], dtype=torch.int32, device=self.device
        )
        opt._collective(dist.all_reduce, has, op=dist.ReduceOp.MAX)
        has_np = has.cpu().numpy().astype(bool)
        if not has_np.any():
            return np.zeros(0, dtype=np.int64)
        for k, p in enumerate(self.params):
            self._check(p)
            dst = self.flat_grad[self.offsets[k] : self.offsets[k] + self.numels[k]]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
        scale = 1.0
        if opt._reduce_grads:  # summed here, scaled by 1/world in the kernel
            opt._collective(dist.reduce_scatter_tensor, self.grad_shard, self.flat_grad)
            scale = 1.0 / opt._world
        for k, start, n, at in self.units:
            src = self.params[k].detach().reshape(-1)
            self.param_shard[at : at + n].copy_(src[start : start + n])
        active = np.array([has_np[u[0]] for u in self.units], dtype=bool)
        if self.staged:
            for b, (bucket, f_lo, f_hi, g, o) in enumerate(self.buckets):
                self._wait_h2d(b)
                rows = np.asarray([ui for ui in bucket if active[ui]], dtype=np.int64)
                if not len(rows):
                    continue
                self.copies.wait(self.copies.to_host(g, self.grad_shard[f_lo:f_hi]))
                self.copies.wait(self.copies.to_host(o, self.param_shard[f_lo:f_hi]))
                self._fill_hyper(rows, hyper, scale)
                self.state.step(self._flat_records(rows))
                self.h2d_events[b] = [self.copies.to_device(self.param_shard[f_lo:f_hi], o)]
        elif active.any():
            rows = np.nonzero(active)[0]
            self._fill_hyper(rows, hyper, scale)
            self.state.step(self._flat_records(rows))
        opt._collective(dist.all_gather_into_tensor, self.flat_param, self.param_shard)
        updated = np.nonzero(has_np)[0].tolist()
        with torch.no_grad():
            for k in updated:
                p = self.params[k]
                off = self.offsets[k]
                p.copy_(self.flat_param[off : off + self.numels[k]].view_as(p))
        return np.asarray([self.members[k] for k in updated], dtype=np.int64)

    # ---- checkpoints ----

    def _names(self) -> Tuple[str, ...]:
        return ("master", "exp_avg", "exp_avg_sq") if self.master else ("exp_avg", "exp_avg_sq")

    def export(self, steps: np.ndarray) -> Dict[int, Dict[str, torch.Tensor]]:
        """Full state of every member with state: {member position: {name: fp32 tensor}}."""
        has_state = [steps[i] > 0 for i in self.members]
        rows = [ui for ui, u in enumerate(self.units) if has_state[u[0]]]
        out: Dict[int, Dict[str, torch.Tensor]] = {}
        if self.sharded:
            import torch.distributed as dist

            shard = {n: torch.zeros(self.shard, dtype=torch.float32) for n in self._names()}
            self._export_rows(rows, lambda ui, n: shard[n][self.units[ui][3] :].data_ptr())
            for name in self._names():
                full = torch.empty(self.total, dtype=torch.float32)
                part = shard[name]
                if self.device.type != "cpu":  # nccl gathers device tensors
                    part, full = part.to(self.device), full.to(self.device)
                self.opt._collective(dist.all_gather_into_tensor, full, part)
                full = full.cpu()
                for k, p in enumerate(self.params):
                    if has_state[k]:
                        off, n = self.offsets[k], self.numels[k]
                        out.setdefault(k, {})[name] = full[off : off + n].clone().view(p.shape)
            return out
        for k, p in enumerate(self.params):
            if has_state[k]:
                shape = _local(p).shape
                out[k] = {n: torch.empty(shape, dtype=torch.float32) for n in self._names()}

        def addr(ui: int, name: str) -> int:
            k, start, _, _ = self.units[ui]
            return out[k][name].data_ptr() + 4 * start

        self._export_rows(rows, addr)
        return out

    def _export_rows(self, rows: List[int], addr: Any) -> None:
        if not rows:
            return
        recs = np.zeros(len(rows), BUFFER_RECORD)
        recs["unit"] = rows
        for name in self._names():
            recs[name] = [addr(ui, name) for ui in rows]
        self.state.export_state(recs.tobytes())

    def load(self, states: Dict[int, Dict[str, Any]]) -> None:
        """Set the state of the members in `states` (full parameter shapes, any float dtype),
        reset the others. A missing master starts from the parameter."""
        flat: Dict[int, Dict[str, torch.Tensor]] = {}
        for k, st in states.items():
            p = self.params[k]
            cols = {n: _flat_f32(st[n], p, n) for n in ("exp_avg", "exp_avg_sq")}
            if self.master:
                src = st.get("master")
                cols["master"] = _flat_f32(src if src is not None else p, p, "master")
            flat[k] = cols
        rows = []
        for ui, (k, _, _, _) in enumerate(self.units):
            if k in flat:
                rows.append(ui)
            else:
                self.state.reset(ui)
        if rows:
            recs = np.zeros(len(rows), BUFFER_RECORD)
            recs["unit"] = rows
            for name in self._names():
                recs[name] = [
                    flat[self.units[ui][0]][name].data_ptr() + 4 * self.units[ui][1] for ui in rows
                ]
            self.state.import_state(recs.tobytes())
        del flat
        if hasattr(self, "inited"):  # Note [update in backward]: loaded units can update then
            self.inited = np.asarray(self.state.initialized(), dtype=bool)


def _check_numel(t: Any, p: torch.Tensor, name: str) -> torch.Tensor:
    t = _local(t) if isinstance(t, torch.Tensor) else torch.as_tensor(t)
    if t.numel() != _local(p).numel():
        raise ValueError(
            f"state '{name}' has {t.numel()} elements, its parameter {_local(p).numel()}"
        )
    return t


def _flat_f32(t: Any, p: torch.Tensor, name: str) -> torch.Tensor:
    t = _check_numel(t, p, name)
    return t.detach().to(device="cpu", dtype=torch.float32).reshape(-1).contiguous()


def _buckets(units: List[int], layout: List[Tuple[int, int, int, int]], elems: int):
    bucket: List[int] = []
    size = 0
    for ui in units:
        bucket.append(ui)
        size += layout[ui][2]
        if size >= elems:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


class OffloadAdamW(torch.optim.Optimizer):
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
            update] in _inbwd.py). One rank or ``shard=False``; pays with parameters on a GPU;
            costs 12 bytes of host memory per parameter for the undo copy.
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
        max_grad_norm: Optional[float] = None,
        foreach: Optional[bool] = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: Optional[bool] = None,
        _force_staging: bool = False,
        **config: Any,
    ):
        _check_hyper(lr, betas, eps, weight_decay, amsgrad)
        _switches.check_switches(fused, foreach, capturable, differentiable)
        if tier not in ("host", "nvme"):
            raise ValueError(f"OffloadAdamW: tier must be 'host' or 'nvme', got {tier!r}")
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
        self._inbwd = bool(update_in_backward)
        if max_grad_norm is not None and not float(max_grad_norm) > 0.0:
            raise ValueError(f"OffloadAdamW: max_grad_norm must be > 0, got {max_grad_norm}")
        self._max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grad_norm: Optional[torch.Tensor] = None
        # Note [speculative update]: the inverse scale updates in backward assume (the last
        # step()'s), and the step counters of stats().
        self._spec_inv = 1.0
        self._round_steps = {k: 0 for k in _ROUND_STATS}
        self._worker: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._spaces: List[_Space] = []  # Note [lazy state]: grows as parameters get gradients
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
        if self._max_grad_norm is not None and self._world > 1:
            raise ValueError(
                "OffloadAdamW(max_grad_norm=...) works with one rank or shard=False: sharded "
                "ranks hold their own unreduced gradients, whose norms are not the step's; clip "
                "with torch.nn.utils.clip_grad_norm_ on the reduced gradients instead"
            )
        self._pool = _runtime.host_pool(self._cfg, purpose="optim", need=self._pool_need())
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

    def _executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The one worker thread of update_in_backward (Note [update in backward])."""
        if self._worker is None:
            self._worker = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="spillover-optim-update"
            )
        return self._worker

    def _settle(self, what: str) -> None:
        """Wait for the update-in-backward worker; refuse `what` between a backward that
        updated parameters and its ``step()`` (the state is mid-step then)."""
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

    # ---- construction ----

    def _setup_distributed(self, shard: Optional[bool], pg: Any) -> None:
        self._pg = pg
        self._works: List[Any] = []  # Note [collectives at exit]
        self._world, self._rank = 1, 0
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            if shard:
                raise RuntimeError("OffloadAdamW(shard=True) needs torch.distributed initialised")
            return
        world = dist.get_world_size(pg)
        dtensors = any(_is_dtensor(p) for g in self.param_groups for p in g["params"])
        if shard is None:
            shard = world > 1 and not dtensors
        if shard and dtensors:
            raise ValueError(
                "OffloadAdamW: parameters are DTensors (FSDP2) and already sharded; pass "
                "shard=False to run the optimizer on each rank's local shards"
            )
        if shard and world > 1:
            self._world, self._rank = world, dist.get_rank(pg)

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> None:
        """``fn(*args, group=self._pg)``, waited for, its work kept until the next ``step()``
        (Note [collectives at exit])."""
        work = fn(*args, group=self._pg, async_op=True, **kwargs)
        work.wait()
        self._works.append(work)

    def _pool_need(self) -> int:
        """Pool bytes the parameters that require grad now can lease (Note [node budget] in
        _runtime.py): per kind of parameter, this rank's part of the state (host tier: fp32
        exp_avg, exp_avg_sq and a master copy where one is kept; NVMe tier: the pipeline's
        buffers) and, on the staged path, the gradient and output staging buffers."""
        kinds: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for g in self.param_groups:
            for p in g["params"]:
                if p.requires_grad:
                    lp = _local(p)
                    key = (lp.dtype, lp.device)
                    kinds[key] = kinds.get(key, 0) + _round_up(lp.numel(), _ALIGN)
        need = 0
        for (dtype, device), n in kinds.items():
            n = -(-n // self._world) + _ALIGN if self._world > 1 else n
            staged = device.type != "cpu" or self._force_staging or self._inbwd
            cols = 3 if dtype != torch.float32 or staged else 2
            if self._tier == "host":
                need += n * cols * 4
            else:
                need += self._nvme_buffers * (self._chunk_bytes or _NVME_CHUNK_BYTES)
            if staged:
                need += 2 * n * torch.empty((), dtype=dtype).element_size()
        return need

    def _index(self) -> None:
        """Global indices of the parameters, in group order. Parameters added by
        ``add_param_group`` go at the end, so the indices the spaces hold stay valid."""
        self._params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        self._group_of = np.array(
            [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]], dtype=np.int64
        )
        n = len(self._params)
        old_steps = getattr(self, "_steps", np.zeros(0))
        old_stateful = getattr(self, "_stateful", np.zeros(0, dtype=bool))
        self._steps = np.zeros(n, dtype=np.float64)
        self._steps[: len(old_steps)] = old_steps
        self._stateful = np.zeros(n, dtype=bool)  # has a state space (Note [lazy state])
        self._stateful[: len(old_stateful)] = old_stateful
        for p in self._params:
            if p.requires_grad:  # refused now rather than at the first step
                _check_dtype(_local(p).dtype)

    def _add_spaces(self, members: List[int]) -> None:
        """New state spaces for `members` (global indices without state), one per kind."""
        for (dt, dev), idx in self._kinds(members).items():
            self._spaces.append(_Space(self, dt, dev, idx))
            self._stateful[idx] = True

    def _kinds(self, members: List[int]) -> Dict[Tuple[torch.dtype, torch.device], List[int]]:
        kinds: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        for i in members:
            lp = _local(self._params[i])
            _check_dtype(lp.dtype)
            kinds.setdefault((lp.dtype, lp.device), []).append(i)
        return kinds

    def _grow(self) -> None:
        """Note [lazy state]: state for the parameters that have a gradient now and none yet."""
        pending = np.nonzero(~self._stateful)[0].tolist()
        if not pending:
            return
        if self._world == 1:
            self._add_spaces([i for i in pending if self._params[i].grad is not None])
            return
        import torch.distributed as dist

        candidates = []
        for i in pending:
            p = self._params[i]
            if p.requires_grad:
                candidates.append(i)
            elif p.grad is not None:
                raise RuntimeError(
                    f"OffloadAdamW: parameter {i} has a gradient but requires_grad=False; "
                    "sharded state is given only to parameters that require grad on every rank "
                    "(Note [lazy state] in spillover/optim.py)"
                )
        for (_, dev), idx in self._kinds(candidates).items():
            has = torch.tensor(
                [self._params[i].grad is not None for i in idx], dtype=torch.int32, device=dev
            )
            self._collective(dist.all_reduce, has, op=dist.ReduceOp.MAX)
            self._add_spaces([i for i, h in zip(idx, has.cpu().tolist()) if h])

    def _drop_spaces(self) -> None:
        """Free every space's state, keeping its I/O and time counters for ``stats()``."""
        for s in self._spaces:
            for st in (s.state, s.undo_state):
                for k, v in (st.stats() if st is not None else {}).items():
                    if k in _CUMULATIVE:
                        self._past[k] = self._past.get(k, 0) + v
            for k, v in s.counters.items():
                self._past[k] = self._past.get(k, 0) + v
            s.close()
        self._spaces = []
        self._stateful[:] = False

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

    # ---- checkpoints ----

    def _gather_state(self) -> Dict[int, Dict[str, torch.Tensor]]:
        """{global index: {'step', 'exp_avg', 'exp_avg_sq'[, 'master']}} for params with state."""
        self._settle("state_dict()")
        state: Dict[int, Dict[str, torch.Tensor]] = {}
        for space in self._spaces:
            for k, cols in space.export(self._steps).items():
                i = space.members[k]
                entry = {"step": torch.tensor(self._steps[i], dtype=torch.float32)}
                entry.update(cols)
                state[i] = entry
        return state

    def _load_state(self, state: Dict[int, Dict[str, Any]]) -> None:
        """Replace every space by new ones for the parameters `state` has (a positive step
        count) for (Note [lazy state]); the others have no state afterwards."""
        members = sorted(i for i, st in state.items() if _float(st.get("step", 0)) > 0)
        for i in members:  # refuse a bad checkpoint before dropping the state there is
            for name in ("exp_avg", "exp_avg_sq"):
                _check_numel(state[i][name], self._params[i], name)
        self._drop_spaces()
        self._steps[:] = 0
        for i in members:
            self._steps[i] = _float(state[i]["step"])
        first = len(self._spaces)
        self._add_spaces(members)
        for space in self._spaces[first:]:
            space.load({k: state[i] for k, i in enumerate(space.members)})

    def state_dict(self) -> Dict[str, Any]:
        """torch's format: ``{"state": {index: {"step", "exp_avg", "exp_avg_sq"[, "master"]}},
        "param_groups": [...]}``, every tensor an fp32 CPU copy of the full state (gathered from
        all ranks when sharded; NVMe state is read back). ``master`` is present for parameters
        that keep an fp32 master copy (bf16, or on a GPU). The groups carry torch's AdamW keys,
        ``fused=True`` among them (Note [torch's switches] in _adamw_switches.py)."""
        groups = []
        index = 0
        for g in self.param_groups:
            packed = {k: v for k, v in g.items() if k != "params"}
            packed["params"] = list(range(index, index + len(g["params"])))
            index += len(g["params"])
            groups.append(packed)
        return {"state": self._gather_state(), "param_groups": groups}

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:
        """Load a checkpoint written by ``state_dict`` (any tier, any world size) or by
        ``torch.optim.AdamW`` (the master copy then starts from the parameters)."""
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
        self._load_state(state)

    def __setstate__(self, state: Dict[str, Any]) -> None:  # pragma: no cover - pickling
        raise TypeError("OffloadAdamW cannot be pickled; save its state_dict() instead")

    def stats(self) -> Dict[str, Any]:
        """steps (that updated a parameter), and counters summed over the optimizer's state
        spaces: bytes_read, bytes_written (NVMe), io_wait_seconds, compute_seconds,
        last_step_seconds, state_bytes (of the parameters that have state: Note [lazy state]),
        heap_chunks; on the staged path (parameters on a GPU, one rank), grad_copies and
        grad_bytes_copied (device-to-host gradient copies, one per unit of at most
        ``_UNIT_MAX`` elements) and grad_stale_copies (those made again because the staged
        copy's fingerprint no longer matched: Note [staged gradients]); steps_skipped
        (GradScaler's inf/NaN steps); with ``update_in_backward``, steps_in_backward,
        steps_redone, inbwd_buckets, inbwd_buckets_redone, inbwd_buckets_undone,
        undo_bytes and undo_swap_bytes (Note [speculative update] in _inbwd.py). All zero
        before the first step."""
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
        return total


def _check_dtype(dtype: torch.dtype) -> None:
    if dtype not in _DTYPES:
        raise TypeError(f"OffloadAdamW supports float32 and bfloat16 parameters, got {dtype}")


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
