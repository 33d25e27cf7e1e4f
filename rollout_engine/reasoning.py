"""Reasoning out of model text: what a thinking model writes between <think> and </think>, apart from its answer.

    parser = ThinkReasoningParser()
    reasoning, content = parser.parse(text)                  # Qwen3: "<think>...</think>answer"
    reasoning, content = parser.parse(text, inside=True)     # the prompt opened the block (DeepSeek-R1 templates)
    inside = parser.prompt_opens(tokenizer.decode(prompt_ids[-8:]))

A reply is reasoning when it begins (past white space) with the start tag, or when the prompt ends inside an
open block (`inside`): the reasoning runs to the first end tag, or to the reply's end when the reply stops
before closing it; the content is what follows the end tag, past its leading white space. Any other reply is all
content, reasoning None. Nothing is lost: the text is reasoning, the tags and the white space after the end
tag, and content.
"""
from __future__ import annotations

__all__ = ["PARSERS", "ReasoningStream", "ThinkReasoningParser"]


class ThinkReasoningParser:
    def __init__(self, start: str = "<think>", end: str = "</think>"):
        if not start or not end or start == end:
            raise ValueError("start and end must be distinct non-empty tags")
        self.start, self.end = start, end

    def prompt_opens(self, prompt_tail: str) -> bool:
        """Whether a prompt ending in `prompt_tail` leaves a reasoning block open: it ends, past white space, with
        the start tag (a template that closes an empty block, as Qwen3's does without thinking, does not)."""
        return prompt_tail.rstrip().endswith(self.start)

    def _body(self, text: str, inside: bool) -> int | None:
        """Where the reasoning begins, or None: a reply that is not reasoning (yet, while the start tag may still
        be forming: see `shown`)."""
        if inside:
            head = text.lstrip()
            skip = len(text) - len(head)
            return skip + len(self.start) if head.startswith(self.start) else 0
        head = text.lstrip()
        return len(text) - len(head) + len(self.start) if head.startswith(self.start) else None

    def parse(self, text: str, inside: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole reply."""
        body = self._body(text, inside)
        if body is None:
            return None, text
        close = text.find(self.end, body)
        if close < 0:
            return text[body:], ""
        return text[body:close], text[close + len(self.end):].lstrip()

    def shown(self, text: str, inside: bool = False) -> tuple[str, str]:
        """(reasoning, content) that a stream may send of the reply so far: the parse of the whole reply will begin
        with each. Held back: a reply that may still begin with the start tag (white space, a part of the tag), a
        tail of the reasoning that may begin the end tag, white space after the end tag."""
        head = text.lstrip()
        if not inside and (not head or (len(head) < len(self.start) and self.start.startswith(head))):
            return "", ""
        if inside and len(head) < len(self.start) and self.start.startswith(head):
            return "", ""  # a model that repeats the prompt's start tag: the tag is not reasoning
        body = self._body(text, inside)
        if body is None:
            return "", text
        close = text.find(self.end, body)
        if close >= 0:
            return text[body:close], text[close + len(self.end):].lstrip()
        keep = next((k for k in range(min(len(self.end) - 1, len(text) - body), 0, -1)
                     if text.endswith(self.end[:k])), 0)
        return text[body:len(text) - keep], ""


class ReasoningStream:
    """One streamed reply split into reasoning and content deltas (each a prefix of the whole reply's parse)."""

    def __init__(self, parser: ThinkReasoningParser, inside: bool = False):
        self.parser, self.inside = parser, inside
        self.text, self.reasoning, self.content = "", "", ""

    def _advance(self, reasoning: str | None, content: str) -> tuple[str, str]:
        reasoning = reasoning or ""
        out = reasoning[len(self.reasoning):], content[len(self.content):]
        self.reasoning, self.content = reasoning, content
        return out

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) to send after `delta` of text."""
        self.text += delta
        return self._advance(*self.parser.shown(self.text, self.inside))

    def finish(self, delta: str) -> tuple[str, str]:
        """The last deltas: what the whole reply's parse holds beyond what was sent."""
        self.text += delta
        return self._advance(*self.parser.parse(self.text, self.inside))


# The parsers by the name `serve --reasoning-parser` takes (vLLM's): both model families write <think>...</think>;
# whether a reply begins inside the block is read off its prompt (prompt_opens), not off the name.
PARSERS = {"deepseek_r1": ThinkReasoningParser, "qwen3": ThinkReasoningParser}
