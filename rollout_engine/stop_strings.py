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


class StopStrings:
    def __init__(self, tokenizer, scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler

    def check(self, seq: Sequence) -> None:
        """End `seq` at its first stop string: the text before it, and the tokens up to the one that completed
        it (a speculative step emits several at once; the ones after it are dropped with their logprobs).

        A new match can only end in the newest text, so a step decodes a window: its new tokens and enough
        before them to hold the longest stop string (a character is at most 4 tokens, and 4 more cover a
        token split at the window's edge), reaching further back while tokens that decode to nothing (special
        tokens, skipped) leave it short of characters: a step decodes that window once unless it holds such
        tokens. The whole text is decoded only on a hit."""
        stops, out = seq.params.stop, seq.output_ids
        first_new, seq.stop_checked = seq.stop_checked, len(out)
        start = self._window_start(out, first_new, max(map(len, stops)))
        if not self._holds_stop(out[start:], stops):
            return
        end = next((e for e in range(first_new + 1, len(out) + 1)  # the token that completed the stop string
                    if self._holds_stop(out[start:e], stops)), len(out))
        text = self.tokenizer.decode(out[:end], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if not hits:  # the window's edge made a match the whole text does not have
            return
        seq.text = text[: min(hits)]
        del seq.token_ids[seq.num_prompt_tokens + end :], seq.logprobs[end:], seq.weight_versions[end:]
        if seq.finish_reason is None:
            self.scheduler.finish(seq, "stop")
        seq.finish_reason = "stop"

    def _window_start(self, out, first_new: int, longest: int) -> int:
        back = 4 * longest + 4
        start = max(0, first_new - back)
        if start == 0:
            return 0
        silent = special_tokens(self.tokenizer).keys()  # decode to nothing: only they leave a window short of text
        while (start > 0 and not silent.isdisjoint(out[start:first_new])
               and len(self.tokenizer.decode(out[start:first_new], skip_special_tokens=True)) < longest):
            start = max(0, start - back)
        return start

    def _holds_stop(self, tokens, stops) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in stops)
