"""Incremental detokenization for streams: emit only text that later tokens cannot change.

A stream's text is its output ids decoded alone, the convention of the engine's final text (no prompt tokens
as context: a SentencePiece decoder strips the first space of what it decodes, so context would turn the
first token's space into text the final text does not have).

A byte-level tokenizer may split one character across tokens; decoding the tokens so far then ends in
U+FFFD, which the next token turns into the real character. Decoding every output token each step is
quadratic, so (as in vLLM) a stream decodes a short window: `prefix` = the tokens already turned into text
(kept only as context for the decoder's spacing rules) and `read` = the tokens whose text is pending. Text is
emitted when the window's text grows and does not end in U+FFFD; the window then slides forward.

Byte-fallback vocabularies (Llama 2, Mistral, Gemma) spell a rare character as pieces <0xNN>, one byte each,
and their decoder turns a run of such pieces into text as a whole: if the run's bytes are not UTF-8, every
piece of it becomes U+FFFD, even a newline that read fine before the next byte came. So a run's text is
pending until a piece that is not a byte ends the run, and a window never starts inside a run.

Stop strings: the engine cuts a sample's text before its stop string, so a stream holds back the last
`len(longest stop) - 1` characters until the sample finishes (a stop string can only begin there), and the
final text comes from the engine's own output.
"""
from __future__ import annotations

import os

from .stop_strings import byte_pieces, decodes_to_nothing

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of one sample's tokens, piece by piece: `push(new_ids)` returns what became stable, and
    `finish(final_text)` what is left of the engine's final text. The pieces concatenate to `final_text`.

    With `offsets=True` it also records, per token, where its text starts: the characters decoded from the
    tokens before it (a character split across tokens starts where its first token does). Tokens then go
    through the decoder one at a time."""

    def __init__(self, tokenizer, hold_back: int = 0, offsets: bool = False):
        self.tokenizer, self.hold_back = tokenizer, max(0, hold_back)
        self.ids: list[int] = []
        self.prefix = 0                 # window start: context for the decoder only
        self.read = 0                   # tokens before this are already text
        self.stable = ""                # every stable character
        self.pending = ""               # the text of the tokens from `read` on, as the window decodes it now
        self.sent = 0                   # characters of `stable` already returned
        self.offsets: list[int] | None = [] if offsets else None
        self.byte_ids = byte_pieces(tokenizer) if tokenizer is not None else frozenset()
        self.silent = decodes_to_nothing(tokenizer) if self.byte_ids else None  # read only within byte runs

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _extend(self, new_ids) -> None:
        """Add tokens to the text (stable or pending) without sending any."""
        if self.offsets is None:
            self._grow(new_ids)
            return
        for t in new_ids:
            # pending text counts up to a partial character (U+FFFD), which starts where the character will;
            # offsets never go back (a run of byte pieces that turns out not to be UTF-8 can read shorter)
            offset = len(self.stable) + len(self.pending.rstrip(REPLACEMENT))
            self.offsets.append(max(offset, self.offsets[-1]) if self.offsets else offset)
            prefix, read, stable = self.prefix, self.read, len(self.stable)
            self._grow([t])
            if self.read != read and len(self.ids) - read > 1:
                self._place(prefix, read, stable)

    def _place(self, prefix: int, read: int, stable: int) -> None:
        """Tokens read.. were pending together and are now the stable text from `stable` on: each starts where the
        text of the tokens before it stops agreeing with that text. A U+FFFD that a later piece completed
        starts the character; one that stays (bytes that never form a character) counts before the next token."""
        before = len(self._decode(self.ids[prefix:read]))
        text = self.stable[stable:]
        for i in range(read + 1, len(self.ids)):
            head = self._decode(self.ids[prefix:i])[before:]
            self.offsets[i] = max(stable + len(os.path.commonprefix([head, text])), self.offsets[i - 1])

    def _grow(self, new_ids) -> None:
        if self.tokenizer is None or not new_ids:
            return
        self.ids.extend(new_ids)
        if self.offsets is None and self._in_byte_run():
            # the run's text waits for the piece that ends it; decoding the growing run at every token would
            # make a long run quadratic (4,000 byte pieces: seconds)
            return
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        self.pending = after[len(before) :]
        if len(after) > len(before) and not after.endswith(REPLACEMENT) and not self._in_byte_run():
            self.stable, self.pending = self.stable + self.pending, ""
            self.prefix, self.read = self.read, len(self.ids)

    def _decodes_to_nothing(self, t: int) -> bool:
        """`stop_strings.decodes_to_nothing` (a special token, or an id past the tokenizer's length), or an id a
        slow tokenizer has no piece for: decoding skips it, so it does not end a run of byte pieces either."""
        if t < 0 or self.silent(t):
            return True
        try:
            return self.tokenizer.convert_ids_to_tokens(t) is None
        except (IndexError, KeyError, ValueError, OverflowError):  # a slow tokenizer's lookup of an unknown id
            return True

    def _in_byte_run(self) -> bool:
        """Whether the last token the decoder sees (special tokens and unknown ids are skipped) is a
        byte-fallback piece."""
        if not self.byte_ids:
            return False
        for t in reversed(self.ids[self.read :]):
            if t in self.byte_ids:
                return True
            if not self._decodes_to_nothing(t):
                return False
        return False

    def push(self, new_ids) -> str:
        """Add sampled tokens; return the newly stable text (may be "")."""
        self._extend(new_ids)
        end = len(self.stable) - self.hold_back
        if end <= self.sent:
            return ""
        piece, self.sent = self.stable[self.sent : end], end
        return piece

    @property
    def text(self) -> str:
        """What push() and finish() have returned so far."""
        return self.stable[: self.sent]

    def finish(self, final_text: str | None, new_ids=()) -> str:
        """The rest of the sample's final text (the engine's, cut at a stop string): everything held back.
        `new_ids`: the sample's tokens not pushed yet (they count for `offsets`; the text is `final_text`'s).
        A final text that does not begin with what was sent means the windowed decode disagreed with the
        tokenizer's decode of the whole output: a RuntimeError, as the stream cannot take text back."""
        self._extend(new_ids)
        if final_text is None:
            return ""
        sent = self.text
        if not final_text.startswith(sent):
            at = len(os.path.commonprefix([sent, final_text]))
            raise RuntimeError(f"the final text does not begin with the text already streamed: they part at "
                               f"character {at} (streamed {sent[at : at + 20]!r}, final {final_text[at : at + 20]!r})")
        self.stable, self.sent = final_text, len(final_text)
        return final_text[len(sent) :]
