"""tripwire for Hugging Face Transformers: `TripwireCallback` for `transformers.Trainer`."""

from .callback import TripwireCallback

__all__ = ["TripwireCallback"]
