"""Shared torch capture (used by the Lightning plugin) and the probe for plain PyTorch loops."""
