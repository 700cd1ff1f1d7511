"""Old import path of :mod:`spillover.activations.guardrails` (kept so that existing imports
work)."""

from .activations.guardrails import Guardrails

__all__ = ["Guardrails"]
