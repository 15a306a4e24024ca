"""Plugins: thin adapters from each framework onto tripwire.core."""
