"""spillover: activation and optimizer-state offload for PyTorch training.

``with spillover.offload_context(tier="host"):`` around forward moves saved activations into a
pinned host pool (and, with the NVMe tier, on to disk) and brings them back for backward with
gradients bitwise equal to training without it.
"""

from __future__ import annotations

from . import _native, dcp  # noqa: F401  (dcp: spillover.dcp, DCP checkpoints of OffloadAdamW)
from ._pools import empty_cache
from .activations import OffloadContext, keep, offload_context
from .config import Config, format_size, parse_size
from .errors import (
    ConfigError,
    DeviceError,
    IntegrityError,
    InternalError,
    OutOfSpaceError,
    PoolExhaustedError,
    SpilloverError,
    SwapIOError,
)
from .estimate import Estimate, estimate
from .optim import OffloadAdamW
from .planner import Planner
from .recompute import SelectivePolicy, checkpoint, explain, unwrap, wrap
from .stats import OffloadStats
from .suspend import no_offload

__version__ = _native.__version__

__all__ = [
    "Config",
    "ConfigError",
    "DeviceError",
    "Estimate",
    "IntegrityError",
    "InternalError",
    "OffloadAdamW",
    "OffloadContext",
    "OffloadStats",
    "OutOfSpaceError",
    "PoolExhaustedError",
    "SpilloverError",
    "SwapIOError",
    "Planner",
    "SelectivePolicy",
    "checkpoint",
    "empty_cache",
    "estimate",
    "explain",
    "format_size",
    "keep",
    "no_offload",
    "offload_context",
    "parse_size",
    "unwrap",
    "wrap",
    "__version__",
]
