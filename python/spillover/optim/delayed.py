"""The one-step delayed update of ``OffloadAdamW(overlap="delayed")``: the host updates step
t's parameters while the device runs step t+1's forward and backward.

Note [delayed update]
    DeepSpeed ZeRO-Offload's "delayed parameter update", opt-in because its math differs
    from AdamW's. With the default (exact) step, ``step()`` t copies the gradients of step t to
    the host, updates, and copies the parameters back before the next forward can run: the
    device waits for all of it (or, with ``update_in_backward``, for what backward did not
    hide). With ``overlap="delayed"``, ``step()`` t

    1. waits for the update it handed to the worker at ``step()`` t-1, bucket by bucket in
       parameter order, and copies each bucket's parameters back as soon as its update is
       done (the compute stream waits for these copies: the next forward sees them);
    2. starts copying step t's gradients to the host (the compute stream waits for these
       copies too, so a gradient written in place after ``step()`` — ``zero_grad(
       set_to_none=False)``, the next backward accumulating — is written after it was read),
       and hands each bucket's update to the worker thread (the kernel releases the GIL);
    3. returns without waiting for them.

    So the forward and backward of step t+1 run on the parameters step t-1's update produced,
    while the host computes step t's update: the gradient an update applies was computed on
    parameters one update older than those it updates, ``p[t+1] = AdamW(p[t],
    grad(p[t-1]))`` (the first ``step()`` updates nothing the device sees; its update reaches
    the device at the second). The update itself — the kernel, the state, the step counts,
    clipping (``max_grad_norm``: the gradients are copied at ``step()``, after it),
    GradScaler (a skipped step hands nothing over), hyper-parameters read at ``step()`` — is
    the exact one's, on those gradients; only the parameters the gradients are computed on
    differ. With ``predict_weights`` (the default where it runs: fp32 state, an fp32 master)
    the parameters copied back are not step t-1's master but that master moved by step t's
    update as predicted from the state step t-1's update left: by default (``"gradient"``)
    that update without its gradient term, which ``step()`` t computes on the device with
    step t's gradient from the coefficients the pass wrote beside (Note [next-gradient
    prediction] in rust/optim/predict.rs; ``_send_predicted``), or (``"momentum"``) with the
    momentum for step t's gradient (Note [weight prediction]). The kernel's pass writes
    them to the output buffers, the masters stay the plain delayed update's, a parameter
    without a gradient at ``step()`` t gets its master (step t's update does not move it),
    and ``flush()`` writes the masters to the output buffers (``AdamState.write_params``)
    before copying them back. ``delay_after=N`` makes the first N steps exact (the update
    waits), as ZeRO-Offload starts its delayed update after some iterations. What this costs
    in quality is measured, not assumed: ``benches/python/lowbit_quality.py --only
    fp32,delayed,delayed-momentum,delayed-plain`` compares the validation loss with the exact
    update's.

    What the device still waits for: the copies of step 1 and 2 (both directions at once, on
    two streams), and, when the host update takes longer than a forward and backward, the rest
    of it (step 1 blocks the host). Hook copies (``_hook_copies``) are not used in this mode:
    the hooks would write the staging buffers while the worker may still read them.

    Parameters are written only by ``step()``, ``flush()`` and ``state_dict()`` on the
    caller's thread (Note [parameter writes are ordered] in copies.py): the worker writes the
    state and the output staging buffers. ``state_dict()`` (and DCP's save) first applies the
    pending update to the parameters (``flush()``), so the model and the optimizer's state
    agree in a checkpoint: save the optimizer's ``state_dict()`` before the model's, or call
    ``opt.flush()`` first. A flush makes one step's forward see the newest parameters (one
    step without delay). ``load_state_dict()`` waits for the worker and drops the pending
    update (the loaded state replaces it; the parameters are the model's, as loaded).
    Refused with several ranks sharding the state (the step's collectives), with
    ``update_in_backward`` (another way to hide the same work) and with DTensor parameters
    (untested).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from .layout import _local


def _gradient_term(dst: List[torch.Tensor], coef: List[torch.Tensor], grad: List[torch.Tensor],
                   hyper: np.ndarray, step: np.ndarray) -> None:
    """Note [next-gradient prediction] (rust/optim/predict.rs), the device's part: ``dst -=
    lr/bc1 * (1-beta1) * g / (sqrt(coef + (1-beta2)/bc2 * g^2) + eps)`` with ``g`` the
    gradient times ``hyper``'s ``grad_scale`` and ``bc1``, ``bc2`` at ``step``, per tensor
    (``coef`` in bf16), in fp32: four foreach ops, one pass over the elements each (HBM
    traffic ~46 bytes per fp32 parameter); ``dst`` is rounded once, at the end."""
    h = hyper
    b1, b2, s = h["beta1"], h["beta2"], h["grad_scale"]
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    k = [float(x) for x in (1 - b2) / bc2 * s * s]  # the gradient's square, scaled
    cn = [float(x) for x in h["lr"] * (1 - b1) / bc1 * s]
    eps = [float(x) for x in h["eps"]]
    g32 = [x.float() for x in grad]
    t = torch._foreach_addcmul(coef, g32, g32, k)  # fp32: bf16 with fp32 promotes
    torch._foreach_sqrt_(t)
    torch._foreach_add_(t, eps)
    torch._foreach_addcdiv_(dst, g32, t, [-x for x in cn])


class Delayed:
    """The delayed half of ``staged.StagedSpace`` (mixed in): Note [delayed update]."""

    opt: Any
    lock: Any
    state: Any
    copies: Any
    params: List[torch.Tensor]
    units: List[Tuple[int, int, int, int]]
    units_of: Dict[int, List[int]]
    buckets: List[Any]
    bucket_members: List[List[int]]
    unit_global: np.ndarray
    counters: Dict[str, int]
    h2d_events: Dict[int, List[Any]]
    staged_grads: Dict[int, Any]
    out_view: List[torch.Tensor]
    inited: np.ndarray
    order: List[int]
    update_log: List[Tuple[int, float, float]]
    _check: Callable[[torch.Tensor], None]
    _copy_grad: Callable[..., Tuple[List[Any], List[int]]]
    _fill_hyper: Callable[..., None]
    _flat_records: Callable[..., bytes]
    _send_back: Callable[[int, List[int]], None]
    _wait_h2d: Callable[[int], None]
    end_step: Callable[[], None]

    #: the update handed to the worker at the last step(): (bucket, units, future)
    later: List[Tuple[int, List[int], Any]]

    def _step_delayed(self, hyper: np.ndarray) -> np.ndarray:
        """``step()`` with ``overlap="delayed"``: Note [delayed update]."""
        self.staged_grads = {}
        self.end_step()
        grads: Dict[int, torch.Tensor] = {}
        for k, p in enumerate(self.params):
            if p.grad is not None:
                self._check(_local(p))
                grads[k] = p.grad
        pending = {b: (rows, fut) for b, rows, fut in self.later}
        self.later = []
        # not state.initialized() while an update handed over may not have run yet (a unit
        # handed over is initialized by the time it has run); with none, after exact steps
        # (delay_after), it is the state's
        if not pending:
            self.inited = np.asarray(self.state.initialized(), dtype=bool)
        initialized = self.inited
        copies = self.copies
        updated: List[int] = []
        order: List[int] = []
        err: Optional[BaseException] = None
        for b in range(len(self.buckets)):
            if b in pending:  # 1. the last step's update of b: its parameters go back
                rows, fut = pending.pop(b)
                e = fut.exception()
                if e is None:
                    self._send_predicted(b, rows, grads, hyper)
                elif err is None:
                    err = e
            if err is not None:
                continue  # raised below, once the rest of the round has been waited for
            mine = [ui for ui in self.buckets[b][0] if self.units[ui][0] in grads]
            if not mine:
                continue
            events: List[Any] = []  # 2. this step's gradients of b, to the worker
            first = [ui for ui in mine if not initialized[ui]]
            if first:  # the master starts from the parameter: into the output buffer
                self._wait_h2d(b)
                for ui in first:
                    k, start, n, _ = self.units[ui]
                    flat = _local(self.params[k]).detach().reshape(-1)[start : start + n]
                    events.append(copies.to_host(self.out_view[ui], flat))
            here = set(self.buckets[b][0])
            for k in self.bucket_members[b]:
                if k in grads:  # only its units in b: the others' buffers may still be read
                    skip = frozenset(ui for ui in self.units_of[k] if ui not in here)
                    evs, _ = self._copy_grad(k, grads[k], skip)
                    events.extend(evs)
            for ev in events:  # a gradient written in place after step() waits for its copy
                copies.hold_compute(ev)
            rows_idx = np.asarray(mine, dtype=np.int64)
            self._fill_hyper(rows_idx, hyper)
            recs = self._flat_records(rows_idx, predict=self.opt._predict)
            with self.lock:  # the copies back that read b's output buffer: the worker waits
                waits = self.h2d_events.pop(b, []) + events
            fut = self.opt._executor().submit(self._update_later, b, recs, waits)
            self.later.append((b, mine, fut))
            self.inited[rows_idx] = True
            updated.extend(mine)
            order.append(b)
        if err is not None:
            self.join_later()
            self.later = []
            raise err
        self.order = order
        return np.unique(self.unit_global[np.asarray(updated, dtype=np.int64)])

    def _send_predicted(self, b: int, rows: List[int], grads: Dict[int, torch.Tensor],
                        hyper: np.ndarray) -> None:
        """Copy back the parameters of bucket b's units `rows`, which the update handed over at
        the last ``step()`` has computed, at this ``step()`` with gradients `grads`.

        With a prediction, a unit whose parameter has no gradient now gets its master: the
        update the prediction stands for does not move it (AdamW skips a parameter without a
        gradient). With the next-gradient one (Note [next-gradient prediction] in
        rust/optim/predict.rs) the others then take the next update's gradient term on the
        device, ``g`` this step's gradient (clipped, when ``max_grad_norm`` clipped it) times
        the kernel's scale for it (a GradScaler's inverse scale, -1 to maximize), with this
        step's hyper-parameters: the coefficient is copied to device memory of the unit's size
        after the prediction's copy, and the compute stream waits for both (Note [parameter
        writes are ordered] in copies.py)."""
        kind = self.opt._predict
        if kind:
            idle = np.asarray([ui for ui in rows if self.units[ui][0] not in grads],
                              dtype=np.int64)
            if len(idle):
                self.state.write_params(self._flat_records(idle))
        self._send_back(b, rows)
        if kind != "gradient":
            return
        back = self.h2d_events[b]  # the worker's update of b waits for these copies too
        dst, coef, g, consts = [], [], [], []
        with torch.no_grad():
            for ui in rows:
                k, start, n, _ = self.units[ui]
                if k not in grads:
                    continue
                p = _local(self.params[k]).detach()
                if n == p.numel():
                    d, src, gk = p, self.coef_view[ui].view(p.shape), _local(grads[k])
                else:  # a piece of a large parameter (contiguous: checked at build)
                    d, src = p.view(-1)[start : start + n], self.coef_view[ui]
                    gk = _local(grads[k]).reshape(-1)[start : start + n]
                c = torch.empty(d.shape, dtype=torch.bfloat16, device=d.device)
                back.append(self.copies.to_device(c, src))
                self.counters["coef_bytes_copied"] += n * 2  # bf16
                dst.append(d)
                coef.append(c)
                g.append(gk)
                consts.append(self.unit_global[ui])
            if dst:
                _gradient_term(dst, coef, g, hyper[np.asarray(consts)],
                               self.opt._steps[np.asarray(consts)] + 1)

    def _update_later(self, b: int, recs: bytes, waits: List[Any]) -> None:
        """The worker: bucket b's update, once its copies have landed."""
        for ev in waits:
            self.copies.wait(ev)
        t0 = time.perf_counter()
        self.state.step(recs)
        self.update_log.append((b, t0, time.perf_counter()))

    def join_later(self) -> Optional[BaseException]:
        """Wait for the update handed to the worker; the first exception it raised."""
        err = None
        for _, _, fut in list(self.later):
            e = fut.exception()
            if e is not None and err is None:
                err = e
        return err

    def flush(self) -> None:
        """Wait for the pending update and copy its parameters back (Note [delayed update]);
        raises what the update raised."""
        pending, self.later = self.later, []
        err = None
        for b, rows, fut in pending:
            e = fut.exception()
            if e is None:
                if self.opt._predict:  # the master, not the prediction (Note [weight prediction])
                    self.state.write_params(self._flat_records(np.asarray(rows, dtype=np.int64)))
                self._send_back(b, rows)
            elif err is None:
                err = e
        if err is not None:
            raise err
