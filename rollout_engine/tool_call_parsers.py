"""The tool-call parsers by the name `serve --tool-call-parser` takes (vLLM's names)."""
from .tool_calls import HermesToolCallParser, Llama3JsonToolCallParser
from .xml_tool_calls import Qwen3CoderToolCallParser

PARSERS = {"hermes": HermesToolCallParser, "llama3_json": Llama3JsonToolCallParser,
           "qwen3_coder": Qwen3CoderToolCallParser}
