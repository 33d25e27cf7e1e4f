"""A stream's cumulative snapshots, assembled on its consumer's event loop from what the loop thread publishes.

The loop thread's share is O(1) per grown sample per step: it publishes the sample's (sequence, output length,
finish reason) in the stream's StreamFeed and wakes the consumer unless a wake-up is already on its way
(AsyncEngine makes one call per event loop per step for all the streams it wakes there). The consumer copies
the tokens past those it holds straight from the sequence's lists: below a published length they never change
(they only grow; a stop string trims only the tokens of the step that completes it, before that step is
published), and the interpreter lock makes each slice whole. It detokenizes them incrementally and builds the
snapshot. So a snapshot costs the loop thread nothing, and a slow consumer neither: later steps only overwrite
the published lengths, and the snapshot it takes next carries every token so far.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass

from .detokenize import IncrementalDetokenizer
from .outputs import CompletionOutput, RequestOutput, final_text, prompt_logprobs
from .sequence import Sequence
from .text_tail import unfinished_tail


class StreamFeed:
    """What the loop thread and a stream's consumer share."""

    def __init__(self, n: int):
        # sample index -> (sequence, output length, finish reason, prompt_weight_version), as they were together
        self.published: list[tuple | None] = [None] * n
        self.wake_pending = False  # a wake-up is on its way: the loop thread sends no other
        self.changed = asyncio.Event()

    def publish(self, seq: Sequence) -> None:
        """(the loop thread) `seq` grew or finished: one tuple replaces its entry whole."""
        self.published[seq.index] = (seq, len(seq.token_ids) - seq.num_prompt_tokens, seq.finish_reason,
                                     seq.prompt_weight_version)

    def claim_wake(self) -> bool:
        """(the loop thread) Whether the caller must wake the consumer: no wake-up is on its way yet."""
        if self.wake_pending:
            return False
        self.wake_pending = True
        return True

    async def wait(self) -> None:
        """(the consumer) Until the loop thread has published something or ended the request. The flag drops
        before the consumer reads: whatever is published after the read sends a new wake-up."""
        await self.changed.wait()
        self.changed.clear()
        self.wake_pending = False


def holding_back(text: str, stops) -> str:
    """A running sample's text for a snapshot: a tail that may begin a stop string is held back until it is
    known not to (the final text ends before the stop string), so every snapshot's text is a prefix of the
    final one."""
    return text[: len(text) - unfinished_tail(text, stops)]


@dataclass(eq=False)
class _Sample:
    """What the consumer holds of one sample: every token so far, and its stable text."""
    token_ids: list[int]
    logprobs: list[float] | None
    weight_versions: list[int]
    top_logprobs: list[dict[int, float]] | None
    detok: IncrementalDetokenizer | None
    finish_reason: str | None = None
    text: str | None = None  # once finished: the engine's text (cut before a stop string)
    stop_reason: int | str | None = None
    prompt_weight_version: int | None = None


class Snapshots:
    """The consumer's side: `take` what the loop thread published, `output` the cumulative RequestOutput."""

    def __init__(self, params, tokenizer):
        self.params, self.tokenizer = params, tokenizer
        self.samples = [_Sample([], [] if params.logprobs is not None else None, [], [] if params.logprobs else None,
                                IncrementalDetokenizer(tokenizer) if tokenizer is not None else None)
                        for _ in range(params.n)]

    def take(self, feed: StreamFeed) -> bool:
        """Copy the tokens published since the last call; whether anything changed."""
        changed = False
        for sample, entry in zip(self.samples, feed.published):
            if entry is None or sample.finish_reason is not None:
                continue
            seq, length, reason, sample.prompt_weight_version = entry  # not seq's now: a re-admission resets it
            have = len(sample.token_ids)
            if length > have:
                new = seq.token_ids[seq.num_prompt_tokens + have : seq.num_prompt_tokens + length]
                sample.token_ids += new
                sample.weight_versions += seq.weight_versions[have:length]
                if sample.logprobs is not None:
                    sample.logprobs += seq.logprobs[have:length]
                if sample.top_logprobs is not None:
                    sample.top_logprobs += seq.top_logprobs[have:length]
                if sample.detok is not None:
                    sample.detok.push(new)
                changed = True
            if reason is not None:
                sample.finish_reason, sample.text = reason, self._final_text(seq, sample)
                sample.stop_reason = seq.stop_reason
                changed = True
        return changed

    def _final_text(self, seq: Sequence, sample: _Sample) -> str | None:
        """A finished sample's text: cut before its stop string (the loop thread's, set before it published), or
        all its tokens decoded (once per sample)."""
        if seq.text is not None or self.tokenizer is None:
            return seq.text
        return final_text(self.tokenizer, sample.token_ids, seq.finish_reason)

    def _text(self, sample: _Sample) -> str | None:
        if sample.finish_reason is not None or sample.detok is None:
            return sample.text
        return holding_back(sample.detok.text, self.params.stop)

    def output(self, request_id, prompt: str | None, first: Sequence, weight_version: int) -> RequestOutput:
        """The snapshot: copies of everything held (samples not split off yet have no tokens)."""
        completions = [CompletionOutput(i, list(s.token_ids), _copy(s.logprobs), self._text(s), s.finish_reason,
                                        list(s.weight_versions), _copy(s.top_logprobs), s.stop_reason,
                                        s.prompt_weight_version)
                       for i, s in enumerate(self.samples)]
        return RequestOutput(request_id, prompt, first.token_ids[: first.num_prompt_tokens], completions,
                             weight_version, prompt_logprobs=prompt_logprobs(first))


def _copy(values: list | None) -> list | None:
    return list(values) if values is not None else None
