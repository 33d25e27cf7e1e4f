"""Tool calls out of model text. A parser never raises on what the model wrote: every malformed call
comes back as a ToolCallError, for the environment to answer (the model learns from the answer).

    parser = HermesToolCallParser(tools=TOOLS)      # Hermes / Qwen: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    parser = Llama3JsonToolCallParser(tools=TOOLS)  # Llama 3.1-3.3: {"name": ..., "parameters": {...}}
    parser = Qwen3CoderToolCallParser(tools=TOOLS)  # Qwen3-Coder's XML calls (rollout_engine/xml_tool_calls.py)
    content, calls, errors = parser.parse(text)
    for call in calls:    ... {"role": "tool", "content": run(call.name, call.arguments)}
    for error in errors:  ... {"role": "tool", "content": f"error: {error.message}"}
"""
from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from .sampling_params import is_int
from .text_tail import unfinished_tail
from .tool_schemas import check_arguments, tool_names

__all__ = ["HermesToolCallParser", "Llama3JsonToolCallParser", "ToolCall", "ToolCallError", "ToolCallParser",
           "tool_names"]


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    index: int = 0  # the call's position among the calls (and errors) in the text
    raw: str = ""   # the text between the tags

    def to_message(self, call_id: str | None = None) -> dict:
        """The OpenAI / transformers form of the call, for an assistant message's `tool_calls`. `call_id` (what
        the tool's reply names as its `tool_call_id`) defaults to 9 hex digits of a hash of the call's position,
        name and arguments: the same in every run (a template that renders ids renders the same tokens),
        different for different calls in later turns too, and of the form Mistral's templates require. The
        same call in a later turn gets the same id: pass `call_id` to number calls yourself."""
        if call_id is None:
            key = json.dumps([self.index, self.name, self.arguments], sort_keys=True, ensure_ascii=False)
            call_id = hashlib.sha256(key.encode()).hexdigest()[:9]
        elif not isinstance(call_id, str) or not call_id:
            raise ValueError(f"call_id={call_id!r} is not allowed; a non-empty string, or None")
        return {"type": "function", "id": call_id, "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallError:
    message: str    # what was wrong, phrased for the model to read
    raw: str = ""   # the offending text
    index: int = 0  # position among the calls and errors in the text
    name: str | None = field(default=None)  # the tool's name, when it could be read


@runtime_checkable
class ToolCallParser(Protocol):
    def parse(self, text: str) -> tuple[str, list[ToolCall], list[ToolCallError]]:
        """(content without the calls, well-formed calls, malformed calls). Never raises on model text."""
        ...

    def hold_from(self, text: str, since: int = 0) -> int:
        """Where the part of `text` that may be (the start of) a call begins, len(text) if nowhere: a stream
        sends what comes before it as content. `since`: text before it was sent already (the search may start
        there)."""
        ...


def _unparsed(text, max_chars: int):
    """What parse returns for a reply it does not read (not text, or longer than max_chars); None otherwise."""
    if not isinstance(text, str):
        return "", [], [ToolCallError(f"expected text, got {type(text).__name__}")]
    if len(text) > max_chars:
        return text, [], [ToolCallError(f"the reply is {len(text)} characters; at most {max_chars} are parsed",
                                        text[:200])]
    return None


class _Invalid(Exception):
    pass


def check_limits(max_calls, max_chars) -> None:
    """A parser's bounds: ints >= 1 (a bad one would raise inside parse, which never raises on a reply)."""
    for name, value in (("max_calls", max_calls), ("max_chars", max_chars)):
        if not is_int(value) or value < 1:
            raise ValueError(f"{name}={value!r} is not allowed; an int >= 1")


def _no_duplicates(pairs):
    seen, dup = set(), set()
    for k, _ in pairs:
        (dup if k in seen else seen).add(k)
    if dup:
        dup = sorted(dup)
        raise _Invalid(f"duplicate key(s) {dup}")
    return dict(pairs)


def _no_constants(name):
    raise _Invalid(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 overflows to inf: a tool would compute with it, a reply hold "Infinity"
        raise _Invalid(f"the number {text[:40]} is out of range (beyond a double's largest, about 1.8e308)")
    return value


def _loads(text: str):
    return json.loads(text, object_pairs_hook=_no_duplicates, parse_constant=_no_constants, parse_float=_finite)


class HermesToolCallParser:
    """`<tool_call>{"name": "...", "arguments": {...}}</tool_call>` blocks, as Hermes and Qwen 2.5/3 write them.

    `tools`: the known tools (OpenAI-style schemas or names); a call to any other tool is an error, and
    with schemas the arguments are checked (required, unknown, top-level types, enums; by JSON Schema's rules: 2.0 is
    an integer, true is not 1) unless `check_schemas=False` (vLLM's parsers check none: the tool's own code answers
    a bad argument). None: any name. A number beyond a double's range (1e400) is an error, never inf.
    `arguments` may also be spelled `parameters`, or be a JSON string holding an object (some models
    double-encode). `max_calls` bounds the calls in one turn (further ones are errors)."""

    def __init__(self, tools=None, start: str = "<tool_call>", end: str = "</tool_call>", max_calls: int = 16,
                 max_chars: int = 100_000, check_schemas: bool = True):
        if not start or not end or start == end:
            raise ValueError("start and end must be distinct non-empty tags")
        check_limits(max_calls, max_chars)
        self.schemas, self.check_schemas = tool_names(tools) if tools is not None else None, check_schemas
        self.start, self.end, self.max_calls, self.max_chars = start, end, max_calls, max_chars

    def parse(self, text) -> tuple[str, list[ToolCall], list[ToolCallError]]:
        if (refused := _unparsed(text, self.max_chars)) is not None:
            return refused
        content, calls, errors, pos, index = [], [], [], 0, 0
        while pos < len(text):
            s = text.find(self.start, pos)
            e = text.find(self.end, pos)
            if s < 0 and e < 0:
                content.append(text[pos:])
                break
            if e >= 0 and (s < 0 or e < s):  # a close tag with no open tag before it
                content.append(text[pos:e])
                errors.append(ToolCallError(f"{self.end} without an opening {self.start}", self.end, index))
                index += 1
                pos = e + len(self.end)
                continue
            content.append(text[pos:s])
            body_start = s + len(self.start)
            e = text.find(self.end, body_start)
            if e < 0:
                raw = text[body_start:]
                errors.append(ToolCallError(f"{self.start} is never closed with {self.end}", raw, index,
                                            self._name_hint(raw)))
                break
            raw = text[body_start:e]
            pos = e + len(self.end)
            result = self._call(raw, index, len(calls))
            if not isinstance(result, ToolCall) and self.start in raw:  # a call never closed, then another
                result = ToolCallError(f"{self.start} inside another {self.start}: calls cannot nest", raw, index)
            (calls if isinstance(result, ToolCall) else errors).append(result)
            index += 1
        # White space at the end goes, and at the start only when the reply opens with a call: text before the
        # first call stays as written, so a stream can send it before the calls are known (chat_reply)
        joined = "".join(content).rstrip()
        return (joined if content and content[0].strip() else joined.lstrip()), calls, errors

    def _name_hint(self, raw: str) -> str | None:
        try:
            obj = _loads(raw.strip())
        except Exception:  # noqa: BLE001
            return None
        return obj.get("name") if isinstance(obj, dict) and isinstance(obj.get("name"), str) else None

    def hold_from(self, text: str, since: int = 0) -> int:
        """The first start tag (searched from where a tag could still end after `since`), or a tail of the text
        that may begin one; len(text) if neither."""
        at = text.find(self.start, max(0, since - len(self.start) + 1))
        return at if at >= 0 else len(text) - unfinished_tail(text, [self.start])

    def _call(self, raw: str, index: int, ok_so_far: int) -> ToolCall | ToolCallError:
        body = raw.strip()
        if not body:
            return ToolCallError("empty tool call; write {\"name\": ..., \"arguments\": {...}}", raw, index)
        try:
            obj = _loads(body)
        except (_Invalid, ValueError, RecursionError) as err:  # JSONDecodeError is a ValueError
            return ToolCallError(f"the tool call is not valid JSON: {err}", raw, index)
        return _checked_call(obj, raw, index, ok_so_far, self.schemas, self.max_calls, self.check_schemas)


def _checked_call(obj, raw: str, index: int, ok_so_far: int, schemas, max_calls: int,
                  check_schemas: bool) -> ToolCall | ToolCallError:
    """A decoded call's checks: an object with a name and an arguments (or parameters) object, a known tool
    whose schema the arguments meet (with `schemas`; `check_schemas`), at most `max_calls` calls so far."""
    def error(message, name=None):
        return ToolCallError(message, raw, index, name)

    if not isinstance(obj, dict):
        return error(f"a tool call is a JSON object, got a JSON {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        return error(f"the tool call's \"name\" must be a non-empty string, got {name!r}")
    if "arguments" in obj and "parameters" in obj:
        return error("give \"arguments\" or \"parameters\", not both", name)
    key = "parameters" if "parameters" in obj else "arguments"
    extra = sorted(set(obj) - {"name", key})
    if extra:
        return error(f"unexpected key(s) {extra} in the tool call; it has \"name\" and \"arguments\"", name)
    arguments = obj.get(key, {})
    if isinstance(arguments, str):  # double-encoded
        try:
            arguments = _loads(arguments) if arguments.strip() else {}
        except (_Invalid, ValueError, RecursionError):
            return error(f"\"{key}\" is a string that is not a JSON object", name)
    if not isinstance(arguments, dict):
        return error(f"\"{key}\" must be a JSON object, got a JSON {type(arguments).__name__}", name)
    if (depth := _nesting(arguments)) > MAX_NESTING:
        return error(f"the arguments nest {depth} arrays and objects deep; at most {MAX_NESTING}", name)
    try:  # JSON's \ud83d alone reads as a lone surrogate, which no UTF-8 reply (or tokenizer) can carry
        json.dumps([name, arguments], ensure_ascii=False).encode()
    except UnicodeEncodeError:
        return error("the tool call holds a lone UTF-16 surrogate escape (\\ud800-\\udfff not in a pair)", name)
    if schemas is not None:
        if name not in schemas:
            return error(f"unknown tool {name!r}; the tools are {sorted(schemas)}", name)
        problem = check_arguments(name, arguments, schemas[name]) if check_schemas else None
        if problem:
            return error(problem, name)
    if ok_so_far >= max_calls:
        return error(f"more than {max_calls} tool calls in one turn", name)
    return ToolCall(name, arguments, index, raw)


MAX_NESTING = 64  # no tool takes deeper arguments; near Python's recursion limit, encoding them for the reply raises


def _nesting(value) -> int:
    """How deep arrays and objects nest in a decoded JSON value (1: a flat object), counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((item, depth + 1) for item in (value.values() if isinstance(value, dict) else value))
    return deepest


class Llama3JsonToolCallParser:
    """Llama 3.1-3.3's JSON tool calls: a reply that is a call is the call and nothing else,
    `{"name": "...", "parameters": {...}}` (or "arguments"), several joined by ";", after an optional
    <|python_tag|>. A reply that does not begin with "{" (past that tag and white space) is content, whatever
    it holds later. `tools`, `max_calls`, `max_chars` and `check_schemas`, and the checks of each call, are
    HermesToolCallParser's."""

    TAG = "<|python_tag|>"

    def __init__(self, tools=None, max_calls: int = 16, max_chars: int = 100_000, check_schemas: bool = True):
        check_limits(max_calls, max_chars)
        self.schemas, self.check_schemas = tool_names(tools) if tools is not None else None, check_schemas
        self.max_calls, self.max_chars = max_calls, max_chars

    def _body(self, text: str) -> str:
        body = text.strip()
        return body[len(self.TAG):].lstrip() if body.startswith(self.TAG) else body

    def hold_from(self, text: str, since: int = 0) -> int:
        """0 while the reply may still become a call (blank so far, or beginning with "{", the tag or a part of
        it); else len(text): content from its first character on, at once when some was sent (`since` > 0)."""
        if since > 0:
            return len(text)
        head = text.lstrip()
        may_be_call = not head or head.startswith("{") or self.TAG.startswith(head[:len(self.TAG)])
        return 0 if may_be_call else len(text)

    def parse(self, text) -> tuple[str, list[ToolCall], list[ToolCallError]]:
        if (refused := _unparsed(text, self.max_chars)) is not None:
            return refused
        body = self._body(text)
        if not body.startswith("{"):
            return text.strip(), [], []
        calls, errors, pos = [], [], 0
        while pos < len(body):
            index = len(calls) + len(errors)
            try:
                obj, end = _DECODER.raw_decode(body, pos)
            except (_Invalid, ValueError, RecursionError) as err:
                errors.append(ToolCallError(f"the tool call is not valid JSON: {err}", body[pos:], index))
                break
            result = _checked_call(obj, body[pos:end], index, len(calls), self.schemas, self.max_calls,
                                   self.check_schemas)
            (calls if isinstance(result, ToolCall) else errors).append(result)
            pos = _skip_space(body, end)
            if pos < len(body) and body[pos] != ";":
                errors.append(ToolCallError(f"calls are joined by \";\" and nothing follows them, got "
                                            f"{body[pos:pos + 40]!r}", body[pos:], index + 1))
                break
            pos = _skip_space(body, pos + 1)
        return "", calls, errors


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip()) if pos < len(text) else pos


_DECODER = json.JSONDecoder(object_pairs_hook=_no_duplicates, parse_constant=_no_constants, parse_float=_finite)
