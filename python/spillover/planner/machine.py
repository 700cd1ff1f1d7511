"""The measured rates a plan is costed with (:mod:`spillover.calibrate` measures them)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence

import torch

if TYPE_CHECKING:
    from .records import OpRecord

#: Note [two clocks in the plan]
#:     On a GPU the host queues ops and the device runs them (Note [two clocks] in
#:     spillover/estimate/modes.py): a forward takes the longer of its kernels and its Python
#:     dispatch. The H200 probe's 1B Llama forward is host-bound (30 us per op against less on
#:     the device), and a checkpointed region's hooks add 12 us per op of its forward whatever
#:     the plan keeps: with one clock the plan charged neither, and at 0.7x no checkpointing's
#:     peak on the estimate it checkpointed 12 of 16 layers to recompute 8 ms of ops, 37 ms
#:     over none's step. With ``host_seconds_per_forward_op`` set (the estimate's GPU
#:     devices), a recomputed op costs the longer of its kernel and its replay's dispatch, a
#:     region run checkpointed pays its hooks' dispatch where the device does not hide it
#:     (:meth:`Machine.wrapped_seconds`), and the copies a forward hides are counted against
#:     its time on both clocks (:meth:`Machine.forward_seconds`). Without it (0, a CPU's
#:     calibration) the costs are as before.


#: Note [a replay's host time is the region's]
#:     A region's replay runs its Python forward again: every op up to the region's stop is
#:     dispatched and seen by the replay's mode, whether the plan recomputes it or the mode
#:     hands back its kept or offloaded output, or an empty tensor for a skipped op (Note
#:     [outputs only saved ops read] in recompute/modes.py). Keeping an op saves its kernel,
#:     not its dispatch. Costed op by op (``rerun_seconds`` summed over the rerun ops), a plan
#:     that kept ops saved their dispatch too: on the estimate of the H200 probe's 1B Llama at
#:     full checkpointing's peak, whose replay is host-bound (1,024 ops at 42 us against 18 ms
#:     of kernels), auto offloaded both rotary outputs of each layer to skip the 14 ops that
#:     build them, modeled 14 ms faster than full checkpointing, and ran 2 % slower (the same
#:     dispatches, and 30 offloads at 107 us each). So with two clocks a region's replay costs
#:     the longer of its rerun ops' kernels and the dispatch of all its ops before the stop:
#:     what a plan keeps pays only where the replay is device-bound. (Where the device lags
#:     the host in backward, part of that dispatch hides behind backward's kernels; a plan's
#:     decisions do not change that share, so it is left out of the comparison.)


#: Note [measured compute]
#:     The calibration's rates come from one op each, on tensors of its size: on this CPU an
#:     out-of-place multiply of 64 MiB, whose fresh output page-faults every time (7.6 GB/s),
#:     where a training step's elementwise ops reuse freed memory (a GPT block's softmax,
#:     scaling and masking of 16 MiB scores ran at 25-32 GB/s), and a 1024-square matmul
#:     (329 GFLOP/s against 1.5x faster in the block). So the model put the block's forward
#:     at 44 ms where it took 25, and on the simulated H200 (GPT 4x256, seq 512, budget 0.7x
#:     none's peak) planned 32 MiB of softmax outputs through the 0.4 GB/s link as hidden
#:     behind a forward that could not hide them: that plan ran 116 ms over none, modeled
#:     40, where a plan that ships nothing ran 47 (modeled 65) and was never tried. Where a
#:     region's forward wall time is its compute's (real tensors on a CPU host, the
#:     simulated device included; not CUDA, whose host only queues kernels, nor an
#:     estimate's fake tensors), the learning step times each region's forward, and the plans
#:     after it scale the model's compute by measured / modeled over the step's regions
#:     (``compute_scale``): recomputation and the time a forward hides copies in move
#:     together, the link and the host's costs do not. The scale only lowers the model's
#:     compute (at most to ``MIN_SCALE``): a learning step that ran slower than modeled is
#:     often a process's first, its memory faulted in for the first time.

#: Note [measured compute]: the least scale the measured forwards may set
MIN_SCALE = 0.2


def measured_scale(machine: Machine, recs: Sequence[Any]) -> float:
    """Note [measured compute]: measured / modeled forward seconds over ``recs`` (the
    regions of a learning step), within [``MIN_SCALE``, 1]; 1 where any was not measured."""
    if not recs or any(r.forward_seconds <= 0 for r in recs):
        return 1.0
    modeled = sum(sum(machine.op_seconds(o) for o in r.ops) for r in recs)
    if modeled <= 0:
        return 1.0
    return min(1.0, max(MIN_SCALE, sum(r.forward_seconds for r in recs) / modeled))


#: Device calls of one pack and its unpack on the simulated link: 1.59 + 2.69, measured by
#: ``benches/python/link_cost.py`` on the simulated link (2026-12-04; Note [device calls] in
#: rust/link).
SIM_CALLS_PER_OFFLOAD = 1.59 + 2.69


@dataclasses.dataclass
class Machine:
    """Measured rates of one device and its host (see :mod:`spillover.calibrate`)."""

    matmul_flops: Dict[str, float]
    elementwise_bytes_per_s: float
    d2h_bytes_per_s: float
    h2d_bytes_per_s: float
    nvme_write_bytes_per_s: Optional[float] = None
    nvme_read_bytes_per_s: Optional[float] = None
    #: Note [host cost in the plan]: host seconds one offloaded tensor costs (pack + unpack)
    host_seconds_per_offload: float = 0.0
    #: ... and one op of a wrapped region when it is rerun (the replay's dispatch)
    host_seconds_per_op: float = 0.0
    #: Note [two clocks in the plan]: the host's dispatch of one op of an eager forward, where
    #: the device runs apart from the host (a GPU); 0: host and device time add up (the
    #: calibration's model, a CPU)
    host_seconds_per_forward_op: float = 0.0
    #: Note [measured compute]: the model's compute times (not the link's, not the host's)
    #: scaled by what a learning step measured
    compute_scale: float = 1.0

    @classmethod
    def from_calibration(cls, data: Dict[str, Any], device: str) -> Machine:
        devs = data["devices"]
        d = devs.get(device) or devs.get(device.split(":")[0]) or next(iter(devs.values()))
        return cls(
            matmul_flops=dict(d["matmul_flops"]),
            elementwise_bytes_per_s=d["elementwise_bytes_per_s"],
            d2h_bytes_per_s=d["d2h_bytes_per_s"],
            h2d_bytes_per_s=d["h2d_bytes_per_s"],
            nvme_write_bytes_per_s=data.get("nvme_write_bytes_per_s"),
            nvme_read_bytes_per_s=data.get("nvme_read_bytes_per_s"),
            host_seconds_per_offload=float(d.get("host_seconds_per_offload") or 0.0),
            host_seconds_per_op=float(d.get("host_seconds_per_op") or 0.0),
            # Note [two clocks in the plan]: measured on CUDA only (a CPU runs one clock)
            host_seconds_per_forward_op=float(d.get("host_seconds_per_forward_op") or 0.0)
            if device.startswith("cuda") else 0.0,
        )

    def simulated(self, sim: Optional[Sequence[float]]) -> Machine:
        """This (the CPU's) machine as the simulated device of ``sim`` = (link bytes/s, host
        seconds per device call) sees it: the link at its bandwidth both ways, and each offload
        charged the device calls a pack and an unpack make on it (Note [the simulated device
        is a device] in records.py); itself when ``sim`` is None."""
        if not sim:
            return self
        bandwidth, call_cost = float(sim[0]), float(sim[1])
        return dataclasses.replace(
            self, d2h_bytes_per_s=bandwidth, h2d_bytes_per_s=bandwidth,
            host_seconds_per_offload=self.host_seconds_per_offload
            + call_cost * SIM_CALLS_PER_OFFLOAD)

    def flops_per_s(self, dtype: str) -> float:
        f = self.matmul_flops
        return f.get(dtype) or f.get("float32") or max(f.values())

    def op_seconds(self, op: OpRecord) -> float:
        """Estimated time to run the op again: its FLOPs at matmul speed if it is compute-bound,
        plus its bytes in and out at elementwise speed (fresh outputs included)."""
        t = op.moved_bytes / self.elementwise_bytes_per_s
        if op.compute_bound:
            t += op.flops / self.flops_per_s(op.dtype)
        return t * self.compute_scale

    def rerun_seconds(self, op: OpRecord) -> float:
        """What recomputing the op costs: its device time (:meth:`op_seconds`) and the host's
        dispatch of it in the region's replay (Note [host cost in the plan]); with two clocks
        the longer of the two (Note [two clocks in the plan])."""
        if self.host_seconds_per_forward_op:
            return max(self.op_seconds(op),
                       self.host_seconds_per_forward_op + self.host_seconds_per_op)
        return self.op_seconds(op) + self.host_seconds_per_op

    def replay_seconds(self, ops: Sequence[OpRecord], rerun: Sequence[OpRecord]) -> float:
        """One checkpointed region's replay in backward, ``ops`` its ops as recorded and
        ``rerun`` those its plan recomputes (not kept, offloaded or skipped). With one clock,
        each rerun op's :meth:`rerun_seconds`. With two (Note [a replay's host time is the
        region's]), the longer of the rerun ops' device time and the host's dispatch of every
        op before the region's stop."""
        if not self.host_seconds_per_forward_op:
            return sum(self.rerun_seconds(o) for o in rerun)
        dev = sum(self.op_seconds(o) for o in rerun)
        per = self.host_seconds_per_forward_op + self.host_seconds_per_op
        return max(dev, per * sum(1 for o in ops if not o.after_stop))

    def forward_seconds(self, ops: Sequence[OpRecord], wrapped: bool = False) -> float:
        """A region's forward on two clocks: the longer of its device time and the host's
        dispatch of its ops (more per op when ``wrapped``: checkpoint's hooks see every op);
        without them, its device time (Note [two clocks in the plan])."""
        dev = sum(self.op_seconds(o) for o in ops)
        if not self.host_seconds_per_forward_op:
            return dev
        per = self.host_seconds_per_forward_op + (self.host_seconds_per_op if wrapped else 0.0)
        return max(dev, per * len(ops))

    def wrapped_seconds(self, ops: Sequence[OpRecord]) -> float:
        """What running a region checkpointed adds to its forward, ops kept or not: the hooks'
        dispatch per op where it is not hidden behind the device (0 without two clocks)."""
        if not self.host_seconds_per_forward_op:
            return 0.0
        return self.forward_seconds(ops, True) - self.forward_seconds(ops)

    @property
    def link_bytes_per_s(self) -> float:
        return min(self.d2h_bytes_per_s, self.h2d_bytes_per_s)

    @property
    def nvme_bytes_per_s(self) -> Optional[float]:
        if not self.nvme_write_bytes_per_s or not self.nvme_read_bytes_per_s:
            return None
        return min(self.nvme_write_bytes_per_s, self.nvme_read_bytes_per_s)



def _device_index(dev: torch.device) -> int:
    if dev.index is not None:
        return dev.index
    module = getattr(torch, dev.type, None)
    return int(module.current_device()) if module is not None else 0

