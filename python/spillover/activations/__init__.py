"""The activation path in three layers: the saved-tensor hooks (torch semantics: context.py,
hooks.py, registry.py, guardrails.py), the link of each device kind (link/: the torch objects a
device copy needs), and the Rust tier under them (``spillover._native.Tier``: bytes, residency,
read-ahead, write-behind). ``spillover.offload_context`` is :func:`context.offload_context`."""

from .context import OffloadContext, current_context, keep, offload_context

__all__ = ["OffloadContext", "current_context", "keep", "offload_context"]
