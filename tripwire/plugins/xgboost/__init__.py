"""tripwire for XGBoost (`xgboost` or `xgboost-cpu`): xgb.train, the sklearn estimators, xgboost.dask."""

from .callback import TripwireCallback

__all__ = ["TripwireCallback"]
