"""Incremental detokenization for streams: emit only text that later tokens cannot change.

A byte-level tokenizer may split one character across tokens; decoding the tokens so far then ends in
U+FFFD, which the next token turns into the real character. Decoding every output token each step is
quadratic, so (as in vLLM) a stream decodes a short window: `prefix` = the tokens already turned into text
(kept only as context for the decoder's spacing rules) and `read` = the tokens whose text is pending. Text is
emitted when the window's text grows and does not end in U+FFFD; the window then slides forward.

Stop strings: the engine cuts a sample's text before its stop string, so a stream holds back the last
`len(longest stop) - 1` characters until the sample finishes (a stop string can only begin there), and the
final text comes from the engine's own output.
"""
from __future__ import annotations

REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 5  # prompt tokens given to the decoder as context (leading-space rules of some tokenizers)


class IncrementalDetokenizer:
    """The text of one sample's tokens, piece by piece: `push(new_ids)` returns what became stable, and
    `finish(final_text)` what is left of the engine's final text. The pieces concatenate to `final_text`."""

    def __init__(self, tokenizer, context_ids=(), hold_back: int = 0):
        self.tokenizer, self.hold_back = tokenizer, max(0, hold_back)
        self.ids = list(context_ids)[-CONTEXT_TOKENS:]
        self.prefix = 0                 # window start: context for the decoder only
        self.read = len(self.ids)       # tokens before this are already text
        self.stable = ""                # every stable character (context excluded)
        self.sent = 0                   # characters of `stable` already returned

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, new_ids) -> str:
        """Add sampled tokens; return the newly stable text (may be "")."""
        if self.tokenizer is None or not new_ids:
            return ""
        self.ids.extend(new_ids)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self.stable += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
        end = len(self.stable) - self.hold_back
        if end <= self.sent:
            return ""
        piece, self.sent = self.stable[self.sent : end], end
        return piece

    @property
    def text(self) -> str:
        """What push() has returned so far."""
        return self.stable[: self.sent]

    def finish(self, final_text: str | None) -> str:
        """The rest of the sample's final text (the engine's, cut at a stop string): everything held back.
        If the final text does not extend what was sent (it cannot, short of a tokenizer whose windowed
        decode disagrees with its full decode), nothing more is sent."""
        if final_text is None:
            return ""
        sent = self.text
        if not final_text.startswith(sent):
            return ""
        self.sent = len(self.stable)
        return final_text[len(sent) :]
