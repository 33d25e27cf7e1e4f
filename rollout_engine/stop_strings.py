"""Stop strings: end a sample at the first occurrence of any of its stop strings, in text and in tokens.

Stop strings are matched against the text decoded with `skip_special_tokens=True`, where every special token
(`special_tokens`) is absent: a stop string that is one's whole text ("</s>", "<|im_end|>", which clients and
eval harnesses send as stops) also stops at that token (`special_stop_ids`, added to `stop_token_ids`), and
still matches the same text when the model spells it in ordinary pieces."""
from __future__ import annotations

from .sequence import Sequence
from .tokenizer_memo import per_tokenizer


@per_tokenizer
def special_tokens(tokenizer) -> dict[int, str]:
    """{id: text} of every token that decoding with `skip_special_tokens=True` drops: those of
    `all_special_ids` (BOS, EOS, PAD, UNK, additional special tokens) and every added token marked special,
    which `all_special_ids` leaves out when the tokenizer does not list it there (Llama 3's reserved tokens,
    ChatML's <|im_start|>/<|im_end|> in some tokenizers)."""
    ids = [int(i) for i in getattr(tokenizer, "all_special_ids", None) or ()]
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    texts = convert(ids) if ids and convert is not None else [None] * len(ids)
    out = dict(zip(ids, texts))
    for i, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            out[int(i)] = getattr(added, "content", None)
    return out


def special_stop_ids(stops, specials: dict[int, str]) -> list[int]:
    """The ids of the special tokens (`specials`: what `special_tokens` gives) whose whole text is one of the stop
    strings: the text a stop string is matched against never shows those tokens, so a sample stops at the
    token itself."""
    stops = set(stops)
    return sorted(token_id for token_id, text in specials.items() if isinstance(text, str) and text in stops)


def decodes_to_nothing(tokenizer):
    """A test of whether a token id decodes to nothing with `skip_special_tokens=True`: a special token
    (`special_tokens`), or an id from the tokenizer's length on (a model head padded past the vocabulary: 32000
    pieces in a 32064-row head), which the decode skips."""
    specials, size = special_tokens(tokenizer), len(tokenizer)
    return lambda t: t in specials or t >= size


@per_tokenizer
def byte_pieces(tokenizer) -> frozenset[int]:
    """The ids of the tokenizer's byte-fallback pieces <0x00>..<0xFF> (SentencePiece's Llama 2, Mistral), empty
    when it has none. The decoder turns a run of them into text as a whole; tokens that decode to nothing
    (`decodes_to_nothing`) are dropped before it runs, so they do not end a run."""
    names = [f"<0x{b:02X}>" for b in range(256)]
    return frozenset(i for i, name in zip(tokenizer.convert_tokens_to_ids(names), names)
                     if i is not None and tokenizer.convert_ids_to_tokens(i) == name)


@per_tokenizer
def window_facts(tokenizer):
    """(the ids of the byte-fallback pieces, those of them that continue a UTF-8 character (bytes 0x80-0xBF),
    `decodes_to_nothing`'s test): what a stop check's window needs, in one look-up."""
    byte_ids = byte_pieces(tokenizer)
    names = tokenizer.convert_ids_to_tokens(sorted(byte_ids))
    continuation = frozenset(i for i, name in zip(sorted(byte_ids), names) if 0x80 <= int(name[3:5], 16) <= 0xBF)
    return byte_ids, continuation, decodes_to_nothing(tokenizer)


class StopStrings:
    def __init__(self, tokenizer, scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler

    def check_all(self, seqs) -> None:
        """`check` each of a step's sequences with their stop strings, the tokenizer's facts looked up once (the
        look-up's key reads the tokenizer's special tokens: tens of microseconds with hundreds of added ones)."""
        facts = window_facts(self.tokenizer)
        for seq in seqs:
            self.check(seq, facts)

    def check(self, seq: Sequence, facts=None) -> None:
        """End `seq` at its first stop string: the text before it, and the tokens up to the one that completed
        it (a speculative step emits several at once; the ones after it are dropped with their logprobs).

        A new match can only end in the newest text, so a step decodes a window: its new tokens and enough
        before them to hold the longest stop string (a character is at most 4 tokens, and 4 more cover a
        token split at the window's edge), reaching further back while tokens that decode to nothing leave it
        short of characters, and never starting inside a character spelled in byte-fallback pieces. The whole
        text is decoded only on a hit. `facts`: window_facts(tokenizer), when the caller has looked them up."""
        stops, out = seq.params.stop, seq.output_ids
        if isinstance(seq.stop_reason, int):  # a special token that stands for a stop string (special_stop_ids)
            text = self.tokenizer.convert_ids_to_tokens(seq.stop_reason)
            seq.stop_reason = text if text in stops else seq.stop_reason
        first_new, seq.stop_checked = seq.stop_checked, len(out)
        byte_ids, continuation, silent = facts or window_facts(self.tokenizer)
        start = self._window_start(out, first_new, max(map(len, stops)), continuation, silent)
        while True:
            end = self._first_hit(out, start, first_new, stops, byte_ids)
            if end is None:
                return
            text = self.tokenizer.decode(out[:end], skip_special_tokens=True)
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                break
            first_new = end  # the window's edge made a match the whole text does not have: look on
        seq.text = text[: min(hits)]
        seq.stop_reason = next(s for s in stops if text.find(s) == min(hits))  # the first listed, of those there
        del seq.token_ids[seq.num_prompt_tokens + end :], seq.logprobs[end:], seq.weight_versions[end:]
        if seq.top_logprobs is not None:  # one per token, as the lists above: no reader needs to slice them
            del seq.top_logprobs[end:]
        if seq.finish_reason is None:
            self.scheduler.finish(seq, "stop")
        seq.finish_reason = "stop"

    def _first_hit(self, out, start: int, first_new: int, stops, byte_ids) -> int | None:
        """The end of the first window `out[start:end]` (end past `first_new`) that holds a stop string, or None.
        A run of byte pieces that is not UTF-8 decodes to U+FFFD throughout, so a later byte piece of the same
        step can hide a stop its earlier tokens completed: a step with byte pieces tests each end in turn, and
        one without tests the whole window first."""
        ends = range(first_new + 1, len(out) + 1)
        if byte_ids.isdisjoint(out[first_new:]) and not self._holds_stop(out[start:], stops):
            return None
        return next((e for e in ends if self._holds_stop(out[start:e], stops)), None)

    def _window_start(self, out, first_new: int, longest: int, continuation, silent) -> int:
        back, start, seen = 4 * longest + 4, first_new, 0
        while start > 0 and seen < back:  # back tokens that decode to something: longest characters at least
            start -= 1
            seen += not silent(out[start])
        return self._char_start(out, start, continuation, silent)

    @staticmethod
    def _char_start(out, start: int, continuation, silent) -> int:
        """`start`, or the first byte of the character it falls in: the decoder turns a run of byte pieces into
        text as a whole, and one cut inside a character reads as U+FFFD throughout. A character has at most 3
        continuation bytes, so this reaches back at most 3 pieces (and past the tokens that decode to nothing,
        which do not end a run): a check's cost does not grow with the run."""
        first = next((i for i in range(start, len(out)) if not silent(out[i])), None)  # what the decode sees first
        if start == 0 or first is None or out[first] not in continuation:
            return start
        i, back = start, 0
        while i > 0 and back < 3:
            i -= 1
            if out[i] in continuation:
                back += 1
            elif not silent(out[i]):
                return i  # the character's first byte
        return i

    def _holds_stop(self, tokens, stops) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in stops)
