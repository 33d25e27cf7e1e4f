"""Tool calls in /v1/chat/completions replies, when the server runs with a tool-call parser (`serve
--tool-call-parser hermes` or `llama3_json`) and a request offers `tools` (tool_choice absent or "auto").

A reply whose calls all parse comes back as OpenAI's: `message.tool_calls` ({"id", "type": "function",
"function": {"name", "arguments": a JSON string}}), `content` the text outside the calls (None when there is
none), finish_reason "tool_calls". A reply with a malformed call, or a call to a tool the request did not
offer, comes back as it was written, all of it `content` (never text lost). A stream sends content up to
where a call may begin (Hermes: the first start tag; Llama 3 JSON: a reply that begins with "{" is held
whole), holds the rest, and at the end sends the calls (or the held text) in the last chunk."""
from __future__ import annotations

import json
import uuid

from ..tool_calls import PARSERS


def check_parser_name(name) -> None:
    if name is not None and name not in PARSERS:
        raise ValueError(f"tool_call_parser={name!r} is not allowed; one of {sorted(PARSERS)}, or None")


def parser_for(name: str | None, tools, tool_choice):
    """The parser a request's replies go through, or None (no parser, no tools, or tool_choice "none")."""
    if name is None or not tools or tool_choice == "none":
        return None
    return PARSERS[name](tools=tools)


def openai_calls(calls) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]


def whole_message(parser, text: str, finish_reason):
    """(message, finish_reason) of a whole reply."""
    content, calls, errors = parser.parse(text)
    if errors or not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content or None, "tool_calls": openai_calls(calls)}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


class StreamedReply:
    """One streamed choice's text: what may go out as content now, and what the last chunk carries."""

    def __init__(self, parser):
        self.parser, self.text, self.shown = parser, "", 0

    def push(self, delta: str) -> str:
        """The content to send of the text so far: up to where the parser says a call may begin (hold_from)."""
        self.text += delta
        at = max(self.parser.hold_from(self.text, self.shown), self.shown)
        out, self.shown = self.text[self.shown:at], at
        return out

    def finish(self, delta: str, finish_reason) -> tuple[dict, object]:
        """(the last chunk's delta fields, its finish_reason): the calls and any text after the first start tag
        outside them, or else the held text as content."""
        self.text += delta
        _, calls, errors = self.parser.parse(self.text)
        held = self.text[self.shown:]
        if errors or not calls:
            self.shown = len(self.text)
            return {"content": held}, finish_reason
        after, _, _ = self.parser.parse(held)  # the text between and after the calls
        return ({"content": after, "tool_calls": [dict(call, index=i) for i, call in enumerate(openai_calls(calls))]},
                "tool_calls" if finish_reason == "stop" else finish_reason)
