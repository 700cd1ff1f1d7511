"""Old import path of :mod:`spillover.activations.context` (kept so that existing imports work)."""

from .activations.context import OffloadContext, current_context, keep, offload_context

__all__ = ["offload_context", "OffloadContext", "keep", "current_context"]
