"""Adapters for training frameworks (Lightning, Accelerate); they use only the public API."""
