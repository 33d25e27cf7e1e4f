"""Glue between trainers and the engine's public API."""
from .async_grpo import AsyncRollouts, off_policy_loss, off_policy_step, on_policy_mask
from .sync import hf_named_parameters, sync_weights

__all__ = ["AsyncRollouts", "hf_named_parameters", "off_policy_loss", "off_policy_step", "on_policy_mask",
           "sync_weights"]
