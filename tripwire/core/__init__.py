"""The core: framework-free. It imports no torch, tensorflow, keras or xgboost."""
