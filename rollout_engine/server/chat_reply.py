"""Chat replies' parts: reasoning (`serve --reasoning-parser`) and tool calls (`serve --tool-call-parser hermes` or
`llama3_json`, for requests that offer `tools` with tool_choice absent or "auto").

Reasoning (rollout_engine/reasoning.py) comes out first; the tool-call parser reads the content that is left.
The message carries the reasoning under both names clients read it by, `reasoning` (vLLM) and
`reasoning_content` (SGLang, DeepSeek's API): null when the reply has none.

A reply whose calls all parse comes back as OpenAI's: `message.tool_calls` ({"id", "type": "function",
"function": {"name", "arguments": a JSON string}}), `content` the text outside the calls (None when there is
none), finish_reason "tool_calls"; with the request's `parallel_tool_calls` false, only the first call (as vLLM
and OpenAI: the calls after it are dropped, the reply is not cut short). A reply with a malformed call, or a call to a tool the request did not
offer, comes back as it was written, all of it `content` (never text lost). A stream sends reasoning as it
comes (holding a tail that may begin the end tag), and content up to where a call may begin (Hermes: the first
start tag; Llama 3 JSON: a reply that begins with "{" is held whole); it holds the rest, and at the end sends
the calls (or the held text) in the last chunk."""
from __future__ import annotations

import json
import uuid

from ..reasoning import PARSERS as REASONING_PARSERS
from ..reasoning import ReasoningStream
from ..tool_call_parsers import PARSERS

PROMPT_TAIL_TOKENS = 8  # the prompt's last tokens that prompt_opens reads: a start tag and white space


def check_parsers(tool_call_parser, reasoning_parser, tokenizer) -> None:
    """The parser names are known ones, and a parser has text to read: the checkpoint's tokenizer decodes it."""
    if tool_call_parser is not None and tool_call_parser not in PARSERS:
        raise ValueError(f"tool_call_parser={tool_call_parser!r} is not allowed; one of {sorted(PARSERS)}, or None")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser={reasoning_parser!r} is not allowed; one of "
                         f"{sorted(REASONING_PARSERS)}, or None")
    for arg, name, parsers in (("tool_call_parser", tool_call_parser, PARSERS),
                               ("reasoning_parser", reasoning_parser, REASONING_PARSERS)):
        if name is None:
            continue
        if tokenizer is None:
            raise ValueError(f"{arg}={name!r} needs the checkpoint's tokenizer, which parses the replies' text; this "
                             f"checkpoint has none (token ids in and out only): leave {arg} out")
        _check_tags_survive(arg, name, parsers[name](), tokenizer)


def _check_tags_survive(arg: str, name: str, parser, tokenizer) -> None:
    """Replies are decoded without special tokens: a tag the tokenizer marks special (some Hermes checkpoints mark
    <tool_call>) never reaches the parser, which would return every call as plain content."""
    tags = [tag for tag in (getattr(parser, "start", None), getattr(parser, "end", None)) if tag]
    for tag in tags:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if tag not in tokenizer.decode(ids, skip_special_tokens=True):
            why = "marks it special" if set(ids) & set(tokenizer.all_special_ids) else "does not decode it back"
            raise ValueError(f"{arg}={name!r} reads the tag {tag!r}, and this tokenizer {why}, so the replies' text "
                             f"(decoded without special tokens) never holds it; this server does not parse such "
                             f"replies: leave {arg} out and parse the token ids")


class FirstCallOnly:
    """A parser whose replies keep their first call alone (a request's `parallel_tool_calls` false)."""

    def __init__(self, parser):
        self.parser = parser

    def __getattr__(self, name):
        return getattr(self.parser, name)

    def parse(self, text: str):
        content, calls, errors = self.parser.parse(text)
        return content, calls[:1], errors


def parser_for(name: str | None, tools, tool_choice, parallel_tool_calls=None):
    """The tool-call parser a request's replies go through, or None (no tools, or tool_choice "none"). A
    well-formed call to an offered tool comes back as a call whatever its arguments, as vLLM returns it: the
    client's tool answers a bad argument, which the model then reads. Tools asked for ("auto", the default
    when tools come) on a server without a parser are refused, as vLLM refuses them: the calls would come
    back as plain text, and an agent loop would read a reply without tool_calls as the episode's end."""
    if not tools or tool_choice == "none":
        return None
    if name is None:
        raise ValueError('tools with tool_choice "auto" (the default when tools are sent) need a tool-call parser, '
                         "and this server has none: start it with --tool-call-parser (one of "
                         f'{", ".join(sorted(PARSERS))}), or send tool_choice "none" to get the reply as text')
    parser = PARSERS[name](tools=tools, check_schemas=False)
    return FirstCallOnly(parser) if parallel_tool_calls is False else parser


def reasoning_parser_for(name: str | None):
    return None if name is None else REASONING_PARSERS[name]()


def prompt_opens(parser, tokenizer, prompt_ids) -> bool:
    """Whether the reply to `prompt_ids` begins inside a reasoning block."""
    return parser is not None and parser.prompt_opens(tokenizer.decode(list(prompt_ids[-PROMPT_TAIL_TOKENS:])))


def openai_calls(calls) -> list[dict]:
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}} for c in calls]


def _reasoning_fields(reasoning) -> dict:
    return {"reasoning": reasoning, "reasoning_content": reasoning}


def closing_tag(parser, stop) -> str:
    """The parser's end tag where it is the stop string that ended the reply, else "": the engine cuts a stop
    string from the text, and a client that stops at </tool_call> (to run one call per turn) still gets its call."""
    return stop if isinstance(stop, str) and stop == getattr(parser, "end", None) else ""


def _tool_message(parser, text: str, finish_reason, closing: str = ""):
    content, calls, errors = parser.parse(text + closing)
    if errors or not calls:
        return {"role": "assistant", "content": text}, finish_reason
    message = {"role": "assistant", "content": content or None, "tool_calls": openai_calls(calls)}
    return message, "tool_calls" if finish_reason == "stop" else finish_reason


def whole_message(tool_parser, reasoning_parser, text: str, finish_reason, inside: bool = False, stop=None):
    """(message, finish_reason) of a whole reply; `inside`: its prompt opened a reasoning block; `stop`: the stop
    string cut from its text (None if none was, or the request keeps it)."""
    reasoning = None
    if reasoning_parser is not None:
        reasoning, text = reasoning_parser.parse(text, inside)
    if tool_parser is not None:
        message, finish_reason = _tool_message(tool_parser, text, finish_reason, closing_tag(tool_parser, stop))
    else:
        message = {"role": "assistant", "content": text}
    if reasoning_parser is not None:
        if reasoning is not None and not message["content"]:
            message["content"] = None  # all reasoning (a reply cut short while thinking)
        message |= _reasoning_fields(reasoning)
    return message, finish_reason


class StreamedReply:
    """One streamed choice's text: the delta fields that may go out now, and what the last chunk carries."""

    def __init__(self, tool_parser=None, reasoning: ReasoningStream | None = None):
        self.parser, self.reasoning, self.text, self.shown = tool_parser, reasoning, "", 0

    def _content(self, delta: str) -> str:
        """The content to send of the content so far: up to where the parser says a call may begin (hold_from),
        less trailing white space, which a reply with calls drops (parse): what is sent stays a prefix of it."""
        if self.parser is None:
            return delta
        self.text += delta
        if not delta.strip():  # white space alone sends nothing now: not searched again at each push of a long run
            return ""
        at = max(len(self.text[:self.parser.hold_from(self.text, self.shown)].rstrip()), self.shown)
        out, self.shown = self.text[self.shown:at], at
        return out

    def _reasoning(self, delta: str, last: bool) -> tuple[dict, str]:
        """(the reasoning's delta fields, the content's delta text) of `delta` of reply text."""
        if self.reasoning is None:
            return {}, delta
        reasoning, delta = (self.reasoning.finish if last else self.reasoning.push)(delta)
        return (_reasoning_fields(reasoning) if reasoning else {}), delta

    def push(self, delta: str) -> dict:
        """The delta fields to send after `delta` of reply text."""
        fields, delta = self._reasoning(delta, last=False)
        return fields | {"content": self._content(delta)}

    def finish(self, delta: str, finish_reason, stop=None) -> tuple[dict, object]:
        """(the last chunk's delta fields, its finish_reason): any reasoning not sent yet; the calls and any text
        after the first start tag outside them, or else the held text as content. `stop`: whole_message's."""
        fields, delta = self._reasoning(delta, last=True)
        if self.parser is None:
            return fields | {"content": delta}, finish_reason
        self.text += delta
        content, calls, errors = self.parser.parse(self.text + closing_tag(self.parser, stop))
        held = self.text[self.shown:]
        if errors or not calls:
            self.shown = len(self.text)
            return fields | {"content": held}, finish_reason
        after = content[self.shown:]  # what was sent is a prefix of the reply's content (_content)
        calls = [dict(call, index=i) for i, call in enumerate(openai_calls(calls))]
        finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return fields | {"content": after, "tool_calls": calls}, finish_reason
