"""The update during backward of ``OffloadAdamW(update_in_backward=True)``: a speculative
update per bucket on a worker thread, kept at ``step()`` when it is what ``step()`` would have
computed, else undone from a copy and redone (or skipped).

Note [update in backward]
    ``OffloadAdamW(..., update_in_backward=True)`` (like torch's
    ``_apply_optimizer_in_backward`` or torchtune's ``optimizer_in_bwd``, but allowing what a
    plain torch loop does between backward and ``step()``) runs the CPU update during
    backward. When the hooks have staged, in this backward, the gradient of every member of a
    bucket that requires grad, the bucket's update is handed to one worker thread (the kernel
    releases the GIL): buckets are updated in the order they completed — the last layers
    first — while backward goes on producing the earlier layers' gradients. The worker writes
    only the state and the bucket's output staging buffer, never the parameters: the
    parameters are written at ``step()`` (from the output buffers: asynchronous host-to-device
    copies on a GPU, which the compute stream waits for; a memcpy on CPU), once the update is
    known to be the one ``step()`` computes (Note [speculative update]). So a forward run
    before ``step()`` (gradient accumulation, an EMA, a norm logged) sees the parameters as they
    were, the compute stream is never left unordered after a parameter write, and an undo never
    has to touch a parameter. Hyper-parameters are read when a bucket is handed over, the step
    count is the one ``step()`` will count. Backward returns without waiting for the worker:
    the updates of the buckets that complete last (the embedding, the first layers) go on
    while the host runs what follows backward, and ``step()`` waits for them (it waited at the
    end of backward before, which left that tail overlapping nothing). Nothing else touches
    what the worker writes meanwhile: a later micro-batch's hook waits for its bucket's update
    before it stages into the bucket's buffers (and undoes it), and ``state_dict``, ``load``,
    ``close`` and the rest wait for the worker first (``_settle``, ``abort_round``).

    ``step()`` waits for the worker, keeps the updates that were right, undoes and redoes the
    others with the final gradients, updates the buckets that were not complete (a parameter
    whose hook did not fire, a gradient set by hand, a unit whose state does not exist yet),
    writes the parameters and counts the step. The first step of a unit runs at ``step()``
    (its master copy starts from the parameter there, and the hooks exist only once the state
    does: Note [lazy state] in store.py), so the first step of all is a default step.

    Refused, each with a ValueError naming the default mode as the alternative: sharding (the
    step's collectives cannot run from a hook; ``shard=False`` or one rank works) and DTensors
    (FSDP2 assigns gradients itself and the hooks do not fire). CPU parameters take the staged
    path in this mode (gradients copied to staging buffers by the hooks, parameters written
    from the output buffers at ``step()``): correct, but the update then competes with
    backward for the same cores; the mode pays with parameters on a GPU.

Note [speculative update]
    An update made during backward used the gradient the hooks staged, the hyper-parameters of
    that moment and, with ``torch.amp.GradScaler``, the inverse scale the last ``step()`` saw.
    ``step()`` keeps a bucket's update only when all of these are what it would use now:

    - every member's gradient still has the staged bytes: its fingerprint now equals the one
      taken with the staged copy (Note [gradient fingerprint] in fingerprint.py; for CPU
      parameters, whose staged copy is host memory next to the gradient, the bytes are
      compared instead, exactly and at memory speed, and no fingerprint is taken). torch's
      ``clip_grad_norm_`` multiplies every gradient by ``min(max_norm / (norm + 1e-6), 1)``:
      by exactly 1.0 while the norm is under the limit, which leaves the bytes as they were
      (the version counter moves, the fingerprint does not), so the common step is kept and
      only a step whose clipping applies is redone. An all-reduce, a ``.data`` write or a
      gradient set to None changes it too, and is redone the same way;
    - the hyper-parameters (lr, betas, eps, weight decay, the scale) read at ``step()`` equal,
      bit for bit, those the update used (a scheduler stepped between backward and ``step()``);
    - the step is not skipped: GradScaler's ``found_inf`` undoes every update of the round and
      counts no step, as a skipped step of torch's AdamW touches nothing. A step whose scale
      differs from the last one (after a skipped step the scaler backs off, every
      ``growth_interval`` steps it grows) is redone. ``scaler.unscale_(opt)`` before
      ``scaler.step(opt)`` (to clip) rewrites every gradient, so every bucket is redone:
      exact, but with no overlap; ``max_grad_norm=`` on the optimizer does the unscaling and
      clipping itself, knows when the gradients it produced equal the speculated ones
      (no clipping, fp32 gradients: the kernel's ``g * (1/scale)`` is the same single
      multiplication as ``unscale_``'s), and keeps the overlap.

    Undo: before a bucket's update the worker copies the state it is about to overwrite
    (fp32 master, exp_avg, exp_avg_sq of the bucket's units, as stored: 12 bytes per parameter
    with fp32 state, 6.03 with 8-bit moments, Note [state formats] in formats.py) and an undo
    puts it back, exactly. Without a master column (``master_weights=False``) the value
    updated is the output buffer itself, so its bytes are copied too (2 or 4 per parameter, in
    host memory on either tier). Host tier: the copy is in ordinary host memory (not the
    pool), one buffer per bucket, kept for the next steps. NVMe tier: the copy is a second
    state on the swap files (as many bytes of swap space as the state), written through a
    bounce buffer of the largest bucket's size (two of them in host memory: saving,
    restoring); each update made in backward then costs one more read of its bucket's state
    and one write of the copy, which doubles the step's NVMe traffic, and an undo one read and
    one write more. The step
    count is kept by ``step()``, not by the update, and parameters are written only at
    ``step()``, so the undo is exact and a redo computes what ``step()`` would have.

    Gradient accumulation: each space learns how many times each hook fires per step (Note
    [gradient accumulation] in staged.py) and stages, hence updates, only from the expected
    last micro-batch on. A step with more micro-batches than the last one fires a hook for a
    bucket already updated in this round: the hook waits for that update, undoes it and the
    bucket is updated again once its gradients are complete (exact, since the parameters were
    not written and the forward in between saw the old ones). A step with fewer is updated at
    ``step()``. The step after the first counts firings, so it updates (and undoes) once per
    micro-batch; from the next on, once per step. Nothing is written differently from a
    plain torch loop.

    Counters (``OffloadAdamW.stats()``): ``steps_in_backward`` (steps that kept an update made
    during backward), ``steps_redone`` (steps that undid and redid one), ``steps_skipped``
    (GradScaler's inf/NaN steps), per bucket ``inbwd_buckets`` (updates made during backward),
    ``inbwd_buckets_redone`` and ``inbwd_buckets_undone`` (undone by a later micro-batch or a
    skipped or abandoned round), ``undo_bytes`` (host memory the undo copies hold) and
    ``undo_swap_bytes`` (swap space they hold, NVMe tier).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from . import formats
from .layout import BUFFER_RECORD

# Counters each space keeps (summed, over time too, by OffloadAdamW.stats()).
INBWD_STATS = ("inbwd_buckets", "inbwd_buckets_redone", "inbwd_buckets_undone")


class InBackward:
    """The in-backward half of ``staged.StagedSpace`` (mixed in; uses its buffers, state, hooks
    and lock): Note [update in backward], Note [speculative update]."""

    # What StagedSpace provides: the bookkeeping this mixin reads and writes, and its methods.
    opt: Any
    lock: Any
    state: Any
    copies: Any
    inbwd: bool
    params: List[torch.Tensor]
    units: List[Tuple[int, int, int, int]]
    units_of: Dict[int, List[int]]
    buckets: List[Any]
    buckets_of: Dict[int, List[int]]
    bucket_members: List[List[int]]
    unit_global: np.ndarray
    counters: Dict[str, int]
    fired: np.ndarray
    expect: np.ndarray
    inited: np.ndarray
    staged_grads: Dict[int, Any]
    h2d_events: Dict[int, List[Any]]
    undo: Dict[Any, Dict[str, torch.Tensor]]
    undo_state: Any
    master: bool
    out_view: List[torch.Tensor]
    _names: Callable[[], Tuple[str, ...]]
    _column: Callable[..., torch.Tensor]
    _make_state: Callable[[List[int]], Any]
    order: List[int]
    inbwd_log: List[Tuple[int, float, float]]
    last_round: Tuple[int, int]
    _stage_copy: Callable[[int, torch.Tensor], bool]
    _fill_hyper: Callable[..., None]
    _flat_records: Callable[[np.ndarray], bytes]
    _fingerprints_now: Callable[[Dict[int, torch.Tensor]], Dict[int, Tuple[int, ...]]]
    _staged_fingerprint: Callable[[int], Tuple[int, ...]]
    _same_bytes: Callable[[int, torch.Tensor], bool]
    compare_bytes: bool
    _send_back: Callable[[int, List[int]], None]
    _step_staged: Callable[..., np.ndarray]
    update_log: List[Tuple[int, float, float]]
    _count: Callable[[List[int]], np.ndarray]
    end_without_step: Callable[[], None]

    # ---- the round (the backward(s) since the last step()) ----

    def _new_round(self) -> None:
        with self.lock:
            self.pending: Optional[List[set]] = None  # per bucket: members still to arrive
            self.submitted: Dict[int, Any] = {}  # bucket -> the future of its update
            self.spec: Dict[int, Tuple[List[int], bytes]] = {}  # bucket -> rows, hyper used
            self.saved: Set[int] = set()  # buckets whose undo copy holds the pre-round state
            self.futures: List[Any] = []
            self.log: Dict[int, Tuple[float, float]] = {}  # bucket -> worker start, end
            self.verdict: Optional[Dict[int, bool]] = None  # bucket -> keep, set at step()

    def _stage_inbwd(self, k: int, p: torch.Tensor) -> None:
        """The hook in update-in-backward mode: undo the buckets of k a previous micro-batch
        updated, stage the gradient from the expected last firing on (Note [gradient
        accumulation]) and hand every bucket it completes to the worker."""
        self.fired[k] += 1
        mine = self.buckets_of.get(k, [])
        with self.lock:
            again = [b for b in mine if b in self.submitted]
        for b in again:  # a later micro-batch: Note [speculative update]
            self._undo(b)
            if self.pending is not None:  # its members' gradients are to arrive again
                self.pending[b] = self._members_to_wait(b)
        g = p.grad
        if g is None or (self.expect[k] and self.fired[k] < self.expect[k]):
            return
        if not self._stage_copy(k, g):
            return
        if self.pending is None:  # the round's first gradient: which members to wait for
            self.pending = [self._members_to_wait(b) for b in range(len(self.buckets))]
        for b in mine:
            self.pending[b].discard(k)
            if not self.pending[b]:
                self._submit(b)

    def _members_to_wait(self, b: int) -> set:
        return {m for m in self.bucket_members[b] if self.params[m].requires_grad}

    def _submit(self, b: int) -> None:
        """Hand bucket b's update to the worker, if all its units have state (the first step
        of a unit, which starts its master from the parameter, runs at ``step()``)."""
        rows = [ui for ui in self.buckets[b][0] if self.units[ui][0] in self.staged_grads]
        if not rows or not self.inited[rows].all():
            return
        opt = self.opt
        hyper = opt._hyper()  # read now: the update is now (Note [speculative update])
        hyper["grad_scale"] *= opt._spec_inv
        waits = []
        for ui in rows:
            k = self.units[ui][0]
            waits.append(self.staged_grads[k].events[self.units_of[k].index(ui)])
        used = hyper[self.unit_global[np.asarray(rows, dtype=np.int64)]].tobytes()
        with self.lock:
            fut = opt._executor().submit(self._update_bucket, b, rows, waits, hyper)
            self.submitted[b] = fut
            self.futures.append(fut)
            self.spec[b] = (rows, used)

    def _update_bucket(self, b: int, rows: List[int], waits: List[Any], hyper: np.ndarray) -> None:
        """The worker: save what bucket b's update overwrites, then update it from its staged
        gradients into its output buffer. Touches only bucket b's buffers and the state."""
        t0 = time.perf_counter()
        with self.lock:
            old = self.h2d_events.pop(b, [])
        for ev in old + waits:  # the last copies back read the output buffer; ours must land
            self.copies.wait(ev)
        idx = np.asarray(rows, dtype=np.int64)
        self._save(b, rows)
        with self.lock:
            self.saved.add(b)
        self._fill_hyper(idx, hyper)
        t1 = time.perf_counter()
        self.state.step(self._flat_records(idx))
        t2 = time.perf_counter()
        self.update_log.append((b, t1, t2))
        with self.lock:
            self.counters["inbwd_buckets"] += 1
            self.log[b] = (t0, t2)

    # ---- the undo copy ----

    def _save(self, b: int, rows: List[int]) -> None:
        """Copy the state of bucket b's `rows` to its undo copy (the worker, before the
        update), as stored: host memory on the host tier, the swap files through a bounce
        buffer on the NVMe tier; and without a master, the output buffer's values."""
        if not self.master:
            self._copy_outputs(b, rows, save=True)
        if self.opt._tier != "nvme":
            self.state.export_state(self._undo_records(b, rows, self._undo_buffer(b)))
            return
        recs = self._undo_records(b, rows, self._undo_buffer("save"))
        self.state.export_state(recs)
        if self.undo_state is None:
            self.undo_state = self._make_state([u[2] for u in self.units])
        self.undo_state.import_state(recs)

    def _copy_outputs(self, b: int, rows: List[int], save: bool) -> None:
        """Without a master the output buffer is the value updated (Note [state formats]):
        copy bucket b's `rows` of it to (`save`) or from its undo copy in host memory."""
        buf = self.undo.get(("out", b))
        if buf is None:
            n = self.buckets[b][2] - self.buckets[b][1]
            buf = {"out": torch.empty(max(n, 1), dtype=self.out_view[rows[0]].dtype)}
            self.undo[("out", b)] = buf
        f_lo = self.buckets[b][1]
        for ui in rows:
            _, _, n, at = self.units[ui]
            mine = buf["out"][at - f_lo : at - f_lo + n]
            if save:
                mine.copy_(self.out_view[ui])
            else:
                self.out_view[ui].copy_(mine)

    def _undo_buffer(self, key: Any) -> Dict[str, torch.Tensor]:
        """Host buffers (one per column, as stored) of the undo copy, made at their first
        use: per bucket on the host tier (the copy itself); on the NVMe tier one bounce buffer
        for saving (the worker) and one for restoring (the hooks, then ``step()``), each of
        the largest bucket's size."""
        buf = self.undo.get(key)
        if buf is None:
            if isinstance(key, int):
                n = self.buckets[key][2] - self.buckets[key][1]
            else:
                n = max(f_hi - f_lo for _, f_lo, f_hi, _, _ in self.buckets)
            buf = {c: self._column(c, max(n, 1)) for c in self._names()}
            self.undo[key] = buf
        return buf

    def _undo_records(self, b: int, rows: List[int], buf: Dict[str, torch.Tensor]) -> bytes:
        """BUFFER_RECORDs of bucket b's `rows` in `buf` (laid out as the bucket; 8-bit units
        start on blocks of it: Note [block alignment])."""
        f_lo = self.buckets[b][1]
        recs = np.zeros(len(rows), BUFFER_RECORD)
        recs["unit"] = rows
        off = [self.units[ui][3] - f_lo for ui in rows]
        for name, t in buf.items():
            at = np.asarray([formats.part(name, o, 1).start for o in off], dtype=np.uint64)
            recs[name] = np.uint64(t.data_ptr()) + at * np.uint64(t.element_size())
        return recs.tobytes()

    def undo_bytes(self) -> Tuple[int, int]:
        """Bytes the undo copies hold: (host memory, swap files)."""
        bufs = list(self.undo.values())  # the worker adds
        host = sum(t.numel() * t.element_size() for buf in bufs for t in buf.values())
        swap = 0 if self.undo_state is None else int(self.undo_state.stats()["state_bytes"])
        return host, swap

    def _restore(self, b: int, counter: str) -> None:
        """Put back the state bucket b's update overwrote (its worker is done)."""
        rows, _ = self.spec[b]
        if b in self.saved:
            if not self.master:
                self._copy_outputs(b, rows, save=False)
            if self.opt._tier != "nvme":
                self.state.import_state(self._undo_records(b, rows, self._undo_buffer(b)))
            else:
                recs = self._undo_records(b, rows, self._undo_buffer("restore"))
                self.undo_state.export_state(recs)
                self.state.import_state(recs)
        with self.lock:  # the worker counts too
            self.counters[counter] += 1

    def _undo(self, b: int) -> None:
        """Undo bucket b's update of this round from a hook (a later micro-batch), after
        waiting for it; a worker error is left for ``step()`` to raise."""
        with self.lock:
            fut = self.submitted.pop(b)
        if fut.exception() is not None:
            return
        self._restore(b, "inbwd_buckets_undone")
        with self.lock:
            self.spec.pop(b)
            self.saved.discard(b)
            self.log.pop(b, None)

    # ---- step() ----

    def join(self) -> Optional[BaseException]:
        """Wait for the worker's updates of this round; the first exception one raised."""
        with self.lock:
            futures = list(self.futures)
        err = None
        for f in futures:
            e = f.exception()
            if e is not None and err is None:
                err = e
        return err

    def in_round(self) -> bool:
        """Whether the worker updated something since the last ``step()``."""
        with self.lock:
            return bool(self.submitted)

    def _abandon(self, counter: str = "inbwd_buckets_undone") -> bool:
        """Undo every update of the round (after `join`) and end it without a step; whether
        there were any."""
        with self.lock:
            buckets = list(self.submitted)
        for b in buckets:
            self._restore(b, counter)
        self._new_round()
        self.end_without_step()
        return bool(buckets)

    def abort_round(self) -> bool:
        """Wait for the worker and undo the round (``load_state_dict``, a skipped step)."""
        err = self.join()
        undone = self._abandon()
        if err is not None:
            raise err
        return undone

    def verify_round(self, hyper: np.ndarray) -> None:
        """At ``step()``, before the optimizer changes any gradient itself: decide which of the
        round's updates are what ``step()`` computes with `hyper` (Note [speculative update]).
        Raises a worker's exception after undoing the round."""
        if not self.inbwd:
            return
        err = self.join()
        if err is not None:
            self._abandon()
            raise err
        with self.lock:
            spec = dict(self.spec)
        members = sorted({self.units[ui][0] for rows, _ in spec.values() for ui in rows})
        changed, check = set(), {}
        for k in members:
            g = self.params[k].grad
            if g is None:
                changed.add(k)
            else:
                check[k] = g
        if self.compare_bytes:
            changed.update(k for k, g in check.items() if not self._same_bytes(k, g))
        else:
            now = self._fingerprints_now(check)
            # kept for this step's own check of the buckets it redoes (_step_staged)
            self.fp_now = {k: (check[k], check[k]._version, fp) for k, fp in now.items()}
            for k, fp in now.items():
                if self._staged_fingerprint(k) != fp:
                    changed.add(k)
        verdict = {}
        for b, (rows, used) in spec.items():
            now = hyper[self.unit_global[np.asarray(rows, dtype=np.int64)]].tobytes()
            verdict[b] = now == used and not any(self.units[ui][0] in changed for ui in rows)
        self.verdict = verdict

    def invalidate_round(self) -> None:
        """The gradients all changed after `verify_round` (the optimizer clipped them)."""
        if self.verdict:
            self.verdict = {b: False for b in self.verdict}

    def skip_round(self) -> bool:
        """A skipped step (GradScaler's inf/NaN): undo the round, count nothing; whether
        anything was undone."""
        if not self.inbwd:
            self.end_without_step()
            return False
        return self.abort_round()

    def _step_inbwd(self, hyper: np.ndarray) -> np.ndarray:
        """``step()`` in update-in-backward mode: write the parameters of the kept buckets,
        undo the others and update them with the rest (Note [speculative update])."""
        if self.verdict is None:
            self.verify_round(hyper)
        verdict = self.verdict or {}
        with self.lock:
            log = dict(self.log)
        kept = sorted((b for b, ok in verdict.items() if ok), key=lambda b: log[b][0])
        redo = [b for b, ok in verdict.items() if not ok]
        for b in redo:
            self._restore(b, "inbwd_buckets_redone")
        done: List[int] = []
        for b in kept:
            rows = self.spec[b][0]
            self._send_back(b, rows)
            done.extend(rows)
        self.inbwd_log = [(b, *log[b]) for b in kept]
        self.last_round = (len(kept), len(redo))
        self._new_round()
        rest = self._step_staged(hyper, frozenset(done))  # reads the step counts unmoved
        self.order = kept + self.order
        self.inited = np.asarray(self.state.initialized(), dtype=bool)
        return np.unique(np.concatenate([rest, self._count(done)]))
