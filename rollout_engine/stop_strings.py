"""Stop strings: end a sample at the first occurrence of any of its stop strings, in text and in tokens."""
from __future__ import annotations

from .sequence import Sequence


class StopStrings:
    def __init__(self, tokenizer, scheduler):
        self.tokenizer, self.scheduler = tokenizer, scheduler
        # tokens that decode to nothing (skip_special_tokens): only they can leave a window short of characters
        self.silent = frozenset(getattr(tokenizer, "all_special_ids", ()))

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
        while (start > 0 and not self.silent.isdisjoint(out[start:first_new])
               and len(self.tokenizer.decode(out[start:first_new], skip_special_tokens=True)) < longest):
            start = max(0, start - back)
        return start

    def _holds_stop(self, tokens, stops) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in stops)
