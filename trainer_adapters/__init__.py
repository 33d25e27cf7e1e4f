"""Glue between trainers and the engine's public API."""
from .sync import hf_named_parameters, sync_weights

__all__ = ["hf_named_parameters", "sync_weights"]
