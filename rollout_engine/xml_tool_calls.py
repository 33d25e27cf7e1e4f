"""Qwen3-Coder's XML tool calls, one per <tool_call> block:

    <tool_call>
    <function=add>
    <parameter=a>
    1
    </parameter>
    </function>
    </tool_call>

A parameter's value is the text between its tags, less the one newline the template writes after the opening tag
and before the closing one. It stays that text where the tool's schema declares the parameter a string (or
declares nothing: without a schema every value is a string); for any other declared type it is read as JSON, so
`1` is an integer and `{"x": [1]}` an object. As vLLM's parser for these models reads them, a value that is not
JSON is read as the model may write it in Python: `True`/`False`/`None` in any case, an integer like `007`, a
number like `.5`, and a Python literal (`{'k': 'v'}`); what still does not read comes back as a string for the
schema check to refuse ("must be of type integer"), never as a guess. Every call then gets HermesToolCallParser's
checks.
"""
from __future__ import annotations

import ast
import math
import re
from collections.abc import Mapping

from .tool_calls import HermesToolCallParser, ToolCall, ToolCallError, _checked_call, _Invalid, _loads

__all__ = ["Qwen3CoderToolCallParser"]

_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*)</function>", re.S)
_PARAMETER_OPEN, _PARAMETER_CLOSE = "<parameter=", "</parameter>"
_KEY_END = re.compile(r"[>\n]")  # a key holds neither


def _parameters(body: str):
    """(key, value, start, end) of each <parameter=KEY>value</parameter> in `body`, in order: a value ends at the
    first closing tag. One pass over the text, however many tags stay open: a regex search from each opening tag
    scans to the text's end, quadratic time on a reply of unclosed ones."""
    pos = 0
    while (start := body.find(_PARAMETER_OPEN, pos)) >= 0:
        key_end = _KEY_END.search(body, start + len(_PARAMETER_OPEN))
        if key_end is None:
            return
        if key_end[0] == "\n":  # no tag here, nor at any opening before this newline
            pos = key_end.end()
            continue
        end = body.find(_PARAMETER_CLOSE, key_end.end())
        if end < 0:  # no closing tag after this one: none after a later one either
            return
        yield body[start + len(_PARAMETER_OPEN):key_end.start()], body[key_end.end():end], start, end + len(
            _PARAMETER_CLOSE)
        pos = end + len(_PARAMETER_CLOSE)


def _one_newline_off(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


class Qwen3CoderToolCallParser(HermesToolCallParser):
    """`<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>` blocks, as Qwen3-Coder
    writes them. `tools`, `max_calls`, `max_chars` and `check_schemas` are HermesToolCallParser's (each value is
    read by its schema's type either way), and so are the blocks' rules (unclosed, nested, stray end tags) and a
    stream's holding (from the first <tool_call>)."""

    def __init__(self, tools=None, max_calls: int = 16, max_chars: int = 100_000, check_schemas: bool = True):
        super().__init__(tools, max_calls=max_calls, max_chars=max_chars, check_schemas=check_schemas)

    def _name_hint(self, raw: str) -> str | None:
        found = re.search(r"<function=([^>\n]*)>", raw)
        return found[1].strip() or None if found else None

    def _call(self, raw: str, index: int, ok_so_far: int) -> ToolCall | ToolCallError:
        function = _FUNCTION.fullmatch(raw.strip())
        if function is None:
            return ToolCallError("a tool call is <function=NAME>, its <parameter=KEY>value</parameter>s, then "
                                 "</function>", raw, index, self._name_hint(raw))
        name, body = function[1].strip(), function[2]
        arguments, pos = {}, 0
        for key, value, start, end in _parameters(body):
            if body[pos:start].strip():
                return self._error(f"text outside a parameter: {body[pos:start].strip()[:40]!r}", raw, index, name)
            key, pos = key.strip(), end
            if not key or key in arguments:
                return self._error(f"parameter {key!r} is {'given twice' if key else 'unnamed'}", raw, index, name)
            arguments[key] = self._value(name, key, _one_newline_off(value))
        if body[pos:].strip():
            return self._error(f"text outside a parameter: {body[pos:].strip()[:40]!r}", raw, index, name)
        return _checked_call({"name": name, "arguments": arguments}, raw, index, ok_so_far, self.schemas,
                             self.max_calls, self.check_schemas)

    @staticmethod
    def _error(message: str, raw: str, index: int, name: str) -> ToolCallError:
        return ToolCallError(message, raw, index, name or None)

    def _value(self, name: str, key: str, text: str):
        """The parameter's value: its text, or that text read as JSON where the schema declares a type other than
        string (the text itself when it does not read)."""
        schema = (self.schemas or {}).get(name) or {}
        spec = (schema.get("properties") or {}).get(key)
        declared = spec.get("type") if isinstance(spec, Mapping) else None
        types = declared if isinstance(declared, list) else [declared]
        if declared is None or "string" in types:
            return text
        try:
            return _loads(text.strip())
        except (_Invalid, ValueError, RecursionError):
            return _python_value(text.strip(), types, text)


_WORDS = {"true": True, "false": False, "null": None, "none": None}


def _python_value(text: str, types: list, default: str):
    """`text` (not JSON) as a value of one of the declared `types`, read as Python writes it; else `default`."""
    word = text.lower()
    if word in _WORDS and (_WORDS[word] is None or "boolean" in types):
        return _WORDS[word]
    if "integer" in types:
        try:
            return int(text)
        except ValueError:
            pass
    if "number" in types:
        try:
            value = float(text)
        except ValueError:
            value = math.inf
        if math.isfinite(value):
            return value
    if "object" in types or "array" in types:
        try:
            value = ast.literal_eval(text)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return default
        return value if isinstance(value, (dict, list)) and _json_like(value) else default
    return default


def _json_like(value) -> bool:
    """Whether `value` is what JSON can say: str-keyed dicts, lists, strings, finite numbers, booleans, None (a
    Python literal may also hold sets, tuples, bytes, complex numbers or inf)."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_like(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_json_like(v) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int, bool))
