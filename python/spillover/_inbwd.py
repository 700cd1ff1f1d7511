"""The old import path of :mod:`spillover.optim.inbwd` (updates during backward)."""

from .optim.inbwd import INBWD_STATS, InBackward

__all__ = ["INBWD_STATS", "InBackward"]
