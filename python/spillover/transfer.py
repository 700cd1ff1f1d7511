"""Old import path of :mod:`spillover.activations.link` (kept so that existing imports work)."""

from .activations.link import (
    Copy,
    CpuDevice,
    CudaDevice,
    SimDevice,
    Transfers,
    block_tensor,
    default_cap_bytes,
    transfers_for,
)

__all__ = ["Copy", "CpuDevice", "CudaDevice", "SimDevice", "Transfers", "block_tensor",
           "default_cap_bytes", "transfers_for"]
