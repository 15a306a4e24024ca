"""tripwire for Keras 3 on the TensorFlow, torch and JAX backends. Set KERAS_BACKEND before importing Keras."""

from .callback import TripwireCallback
from .hooks import wrap_optimizer

__all__ = ["TripwireCallback", "wrap_optimizer"]
