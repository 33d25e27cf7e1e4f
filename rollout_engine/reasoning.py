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

from .text_tail import unfinished_tail

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

    def _may_open(self, text: str) -> bool:
        """Whether the reply so far may still begin with the start tag: white space, or a part of the tag."""
        head = text.lstrip()
        return len(head) < len(self.start) and self.start.startswith(head)

    def _body(self, text: str, inside: bool) -> int | None:
        """Where the reasoning begins (past the start tag, when the reply writes it), or None: a reply that is
        not reasoning."""
        head = text.lstrip()
        if head.startswith(self.start):
            return len(text) - len(head) + len(self.start)
        return 0 if inside else None

    def parse(self, text: str, inside: bool = False) -> tuple[str | None, str]:
        """(reasoning or None, content) of a whole reply."""
        body = self._body(text, inside)
        if body is None:
            return None, text
        close = text.find(self.end, body)
        if close < 0:
            return text[body:], ""
        return text[body:close], text[close + len(self.end):].lstrip()


class ReasoningStream:
    """One streamed reply split into reasoning and content deltas, each extending what was sent, adding up to
    the whole reply's parse. Held back: a reply that may still begin with the start tag (white space, a part of
    the tag), a tail of the reasoning that may begin the end tag, white space after the end tag. Each delta is
    read once (with the few characters held before it), so a long reply costs time linear in its length."""

    def __init__(self, parser: ThinkReasoningParser, inside: bool = False):
        self.parser, self.inside = parser, inside
        self.state = "opening"  # -> "reasoning" -> "after" (the end tag) -> "content"; or "opening" -> "content"
        self.held = ""  # opening: the reply so far; reasoning: a tail that may begin the end tag; after: white space

    def push(self, delta: str) -> tuple[str, str]:
        """(reasoning delta, content delta) to send after `delta` of text."""
        parser, text = self.parser, self.held + delta
        self.held = ""
        if self.state == "opening":
            if parser._may_open(text):
                self.held = text
                return "", ""
            body = parser._body(text, self.inside)
            if body is None:
                self.state = "content"
                return "", text
            self.state, text = "reasoning", text[body:]
        if self.state == "reasoning":
            close = text.find(parser.end)
            if close < 0:
                keep = unfinished_tail(text, [parser.end])
                self.held = text[len(text) - keep:]
                return text[:len(text) - keep], ""
            self.state, reasoning, text = "after", text[:close], text[close + len(parser.end):]
            return reasoning, self._after(text)
        if self.state == "after":
            return "", self._after(text)
        return "", text

    def _after(self, text: str) -> str:
        """Content past the white space that follows the end tag."""
        content = text.lstrip()
        if content:
            self.state = "content"
        return content

    def finish(self, delta: str) -> tuple[str, str]:
        """The last deltas: what the whole reply's parse holds beyond what was sent."""
        if self.state == "opening":  # never more than white space and a part of the start tag: parse it whole
            reasoning, content = self.parser.parse(self.held + delta, self.inside)
            return reasoning or "", content
        reasoning, content = self.push(delta)
        if self.state == "reasoning":  # never closed: the held tail is reasoning too
            reasoning, self.held = reasoning + self.held, ""
        return reasoning, content


# The parsers by the name `serve --reasoning-parser` takes (vLLM's): both model families write <think>...</think>;
# whether a reply begins inside the block is read off its prompt (prompt_opens), not off the name.
PARSERS = {"deepseek_r1": ThinkReasoningParser, "qwen3": ThinkReasoningParser}
