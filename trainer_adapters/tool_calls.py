"""Tool calls out of model text: the engine's parsers (rollout_engine.tool_calls, which the server shares), named
here for the adapters' users."""
from rollout_engine.tool_calls import (HermesToolCallParser, Llama3JsonToolCallParser, ToolCall, ToolCallError,
                                       ToolCallParser, tool_names)
from rollout_engine.xml_tool_calls import Qwen3CoderToolCallParser

__all__ = ["HermesToolCallParser", "Llama3JsonToolCallParser", "Qwen3CoderToolCallParser", "ToolCall", "ToolCallError",
           "ToolCallParser", "tool_names"]
