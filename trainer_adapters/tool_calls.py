"""Tool calls out of model text: the engine's parsers (rollout_engine.tool_calls, which the server shares), named
here for the adapters' users."""
from rollout_engine.tool_calls import (HermesToolCallParser, Llama3JsonToolCallParser, ToolCall, ToolCallError,
                                       ToolCallParser, tool_names)

__all__ = ["HermesToolCallParser", "Llama3JsonToolCallParser", "ToolCall", "ToolCallError", "ToolCallParser",
           "tool_names"]
