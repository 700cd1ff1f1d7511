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

