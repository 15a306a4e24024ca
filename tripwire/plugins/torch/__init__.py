"""tripwire for PyTorch: `TripwireProbe` for plain training loops, and the torch capture the Lightning plugin shares."""

from .probe import TripwireProbe

__all__ = ["TripwireProbe"]
