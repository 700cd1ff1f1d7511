"""The measured rates a plan is costed with (:mod:`spillover.calibrate` measures them)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, Optional

import torch

if TYPE_CHECKING:
    from .records import OpRecord

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
        )

    def flops_per_s(self, dtype: str) -> float:
        f = self.matmul_flops
        return f.get(dtype) or f.get("float32") or max(f.values())

    def op_seconds(self, op: OpRecord) -> float:
        """Estimated time to run the op again: its FLOPs at matmul speed if it is compute-bound,
        plus its bytes in and out at elementwise speed (fresh outputs included)."""
        t = op.moved_bytes / self.elementwise_bytes_per_s
        if op.compute_bound:
            t += op.flops / self.flops_per_s(op.dtype)
        return t

    def rerun_seconds(self, op: OpRecord) -> float:
        """What recomputing the op costs: its device time (:meth:`op_seconds`) and the host's
        dispatch of it in the region's replay (Note [host cost in the plan])."""
        return self.op_seconds(op) + self.host_seconds_per_op

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

