"""Flashpoint: serverless deep-learning inference on GPU clusters."""

__version__ = "0.1.0"
