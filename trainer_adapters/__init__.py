"""Glue between trainers and the engine's public API."""
from .episode import Episode, build_episode_batch
from .on_policy import on_policy_logprobs
from .sync import hf_named_parameters, sync_weights
from .tool_calls import HermesToolCallParser, Llama3JsonToolCallParser, ToolCall, ToolCallError, ToolCallParser

__all__ = ["Episode", "HermesToolCallParser", "Llama3JsonToolCallParser", "ToolCall", "ToolCallError", "ToolCallParser", "build_episode_batch",
           "hf_named_parameters", "on_policy_logprobs", "sync_weights"]
