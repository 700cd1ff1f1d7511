"""The staged path of a state space: parameters on a device (or ``update_in_backward``).

Note [staged gradients]
    With parameters on a GPU, gradients reach the host's pinned pool blocks one of two ways:

    - **at ``step()``** (the default): ``step()``'s bucket pipeline starts the next bucket's
      device-to-host copies before the current bucket's CPU update, so every copy but the
      first bucket's runs under CPU work that is slower than the link (Note [step in arrival
      order]); nothing runs in backward's hooks and nothing needs checking;
    - **in the hooks** (``_hook_copies=True``, private): a post-accumulate-grad hook copies each
      gradient on a side stream as soon as backward has produced it, so the copies overlap the
      rest of backward, and ``step()`` must prove each copy still holds the gradient's bytes.

    Why the default is at ``step()``: what the hooks take off ``step()`` is the first bucket's
    copy (all copies are 1.3 ms at 25 GB/s for 31 MiB of gradients, 10.7 ms at 3 GB/s), while
    they cost two fingerprint passes over every gradient (hook and ``step()``: device kernels
    on a GPU, ~6 ops per gradient of host dispatch on the autograd thread) and their clipping,
    GradScaler and all-reduce cases copy again. Measured with
    ``python benches/python/optim_bench.py --parts sim`` (the simulated device, 8M fp32
    parameters, backward + ``step()`` medians, this repository's 2-core host under load 4-5):
    hooks 196.9 / 362.7 / 123.9 / 321.8 ms against at ``step()`` 126.0 / 306.9 / 80.4 /
    264.8 ms at 3 GB/s and 25 GB/s with 20 and 200 ms of backward (1.18-1.56x slower with
    hook copies). The GPU runs (``benches/gpu/optim_mode.py``, the probe) time both, so a GPU
    can overturn it.

    With hook copies, ``step()`` uses a staged copy only when it provably holds the
    gradient's current bytes; otherwise it copies again. Two checks, the cheap one first:

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
    would be wrong in each case, so it is not the default; what overlaps the CPU updates is the
    next bucket's copying (and, with hook copies, the copying overlaps backward, all of it kept
    unless the fingerprint says the user changed the gradient).
    ``update_in_backward=True`` starts them during backward and undoes the ones these change:
    Note [update in backward].

Note [update in backward]
    ``OffloadAdamW(..., update_in_backward=True)`` runs each bucket's CPU update during
    backward, on a worker thread, as a speculation that ``step()`` keeps, or undoes and redoes
    (clipping applied, a GradScaler's inf/NaN step, a later micro-batch): the whole contract
    is in ``inbwd.py`` (Note [update in backward], Note [speculative update]).

"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from .delayed import Delayed
from .fingerprint import _FP_LANES, _fingerprint_parts, _fp_chunks, _fp_combine
from .inbwd import InBackward
from .layout import _local, _round_up
from .space import _Space


class _Staged:
    """A gradient copy a hook started (Note [staged gradients]): the copies' events (one per
    unit), the event after its fingerprint, the gradient tensor and its version then."""

    __slots__ = ("events", "fp_event", "grad", "version")

    def __init__(self, events: List[Any], fp_event: Any, grad: torch.Tensor, version: int):
        self.events, self.fp_event, self.grad, self.version = events, fp_event, grad, version


class StagedSpace(Delayed, InBackward, _Space):
    """Parameters on a device, or ``update_in_backward``, one rank: hooks stage the gradients
    into pinned buckets during backward, ``step()`` updates the buckets in arrival order and
    copies the parameters back (Note [staged gradients]); units are at most ``_UNIT_MAX``
    elements, so a staging buffer fits a pool block."""

    def __init__(
        self, opt: Any, dtype: torch.dtype, device: torch.device, members: List[int]
    ):
        # Note [update in backward]: the bookkeeping the hooks and the worker share (lock).
        self.lock = threading.Lock()
        #: this step's fingerprints taken by verify_round: k -> (gradient, version, fingerprint)
        self.fp_now: Dict[int, Tuple[Any, int, Tuple[int, ...]]] = {}
        self.inbwd_log: List[Tuple[int, float, float]] = []  # last round: (bucket, start, end)
        self.undo: Dict[Any, torch.Tensor] = {}  # Note [speculative update]: host buffers
        self.later: List[Tuple[int, List[int], Any]] = []  # Note [delayed update]
        #: each bucket's kernel pass, (bucket, start, end) in perf_counter seconds, appended
        #: by every mode (benches read and clear it: the per-bucket breakdown of issue 41)
        self.update_log: List[Tuple[int, float, float]] = []
        self._new_round()
        super().__init__(opt, dtype, device, members)
        self.buckets_of: Dict[int, List[int]] = {}
        for b, mine in enumerate(self.bucket_members):
            for k in mine:
                self.buckets_of.setdefault(k, []).append(b)
        self.inited = np.zeros(len(self.units), dtype=bool)
        self._register_hooks()

    def _layout(self) -> None:
        at = 0
        for k, n in enumerate(self.numels):
            self._add_units(k, 0, n, at)
            at += _round_up(n, self.align)  # Note [block alignment]

    def _alloc_buffers(self) -> None:
        super()._alloc_buffers()
        # Note [gradient fingerprint]: the staged copies' fingerprints, one row per chunk.
        counts = [_fp_chunks(n, self.dtype) for n in self.numels]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.fp_rows = [(int(starts[k]), int(starts[k + 1])) for k in range(len(counts))]
        self.fp_host = torch.zeros(
            (int(starts[-1]), _FP_LANES), dtype=torch.int64,
            pin_memory=self.device.type == "cuda"
        )

    def step(self, hyper: np.ndarray) -> np.ndarray:
        if self.inbwd:
            return self._step_inbwd(hyper)
        if self.delayed and self.opt._updates >= self.opt._delay_after:
            return self._step_delayed(hyper)
        return self._step_staged(hyper)

    def join(self) -> Optional[BaseException]:
        """Wait for the worker: the delayed update (Note [delayed update]) and this round's
        updates in backward; the first exception one raised."""
        err = self.join_later()
        return InBackward.join(self) or err

    def close(self) -> None:
        super().close()  # waited for the delayed update too: dropped
        self.later = []

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
        if self.opt._hook_copies and not self.delayed:  # Note [delayed update]
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

    def _count(self, done: List[int]) -> np.ndarray:
        """Global indices of the parameters with units in `done`."""
        return np.unique(self.unit_global[np.asarray(done, dtype=np.int64)])

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
            # taken already by this step's verify_round (update in backward) when the gradient
            # is the same tensor at the same version: not taken twice
            cached, self.fp_now = self.fp_now, {}
            for k in fresh_candidates:
                c = cached.get(k)
                if c is not None and c[0] is grads[k] and c[1] == grads[k]._version:
                    now[k] = c[2]
            now.update(self._fingerprints_now(
                {k: grads[k] for k in fresh_candidates if k not in now}))
        order = self._bucket_order(arrival, grads)
        self.order = order
        initialized = self.state.initialized()
        events: Dict[int, List[Any]] = {}
        decided: set = set()

        def prepare(b: int) -> None:
            """Decide and start the copies bucket b needs (gradients, first masters)."""
            if any(ui not in done and self.units[ui][0] in grads for ui in self.buckets[b][0]):
                self._wait_h2d(b)  # its output buffer is written below; a bucket kept from
                # backward has just queued its copies back: waiting for them would block
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
            t0 = time.perf_counter()
            self.state.step(self._flat_records(rows))
            self.update_log.append((b, t0, time.perf_counter()))
            updated.extend(mine)
            self._send_back(b, mine)
        return np.unique(self.unit_global[np.asarray(updated, dtype=np.int64)])

    def fill_outputs(self) -> None:
        """Without a master column (``master_weights=False``) the output buffers hold the
        values the updates read and write (Note [state formats] in formats.py): after an
        import, fill them from the parameters."""
        for b, (rows, _, _, _, _) in enumerate(self.buckets):
            self._wait_h2d(b)
            for ui in rows:
                k, start, n, _ = self.units[ui]
                flat = _local(self.params[k]).detach().reshape(-1)[start : start + n]
                self.copies.wait(self.copies.to_host(self.out_view[ui], flat))

    def _send_back(self, b: int, rows: List[int]) -> None:
        """Copy the parameters of bucket b's units `rows` from its output buffer."""
        back = []
        with torch.no_grad():
            for ui in rows:
                k, start, n, _ = self.units[ui]
                p = _local(self.params[k]).detach()  # written by a copy stream, not autograd
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

    def _staged_fingerprint(self, k: int) -> Tuple[int, ...]:
        """Note [gradient fingerprint] of member k's staged copy (waits for it)."""
        return self._staged_fingerprint_of(self.staged_grads[k], k)

    def _staged_fingerprint_of(self, st: _Staged, k: int) -> Tuple[int, ...]:
        self.copies.wait(st.fp_event)
        lo, hi = self.fp_rows[k]
        return _fp_combine(self.fp_host[lo:hi].numpy())

    def _fingerprints_now(self, grads: Dict[int, torch.Tensor]) -> Dict[int, Tuple[int, ...]]:
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
