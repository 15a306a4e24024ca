"""tripwire for PyTorch Lightning (`lightning` and `pytorch-lightning`)."""

from .callback import TripwireCallback

__all__ = ["TripwireCallback"]
