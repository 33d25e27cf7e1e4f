"""The HTTP front's record of each request in flight (engine_client.py keeps them by key): its samples as the
engine process's "tokens" messages extend them, the RequestOutput they make, and how a request ends."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from ..outputs import CompletionOutput, RequestOutput, final_text
from ..sampling_params import SamplingParams


@dataclass(eq=False)
class SampleRecord:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    weight_versions: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # logprobs=k >= 1
    finish_reason: str | None = None
    text: str | None = None  # once finished: its final text (the engine's where it cut one at a stop string)
    stop_reason: int | str | None = None


@dataclass(eq=False)
class RequestRecord:
    key: int
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    done: asyncio.Future
    changed: asyncio.Event | None  # a stream's wake-up
    samples: list[SampleRecord]
    error: BaseException | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None  # SamplingParams.prompt_logprobs, once scored
    first_token_time: float | None = None  # time.perf_counter() when its first token reached this process

    def output(self, tokenizer, weight_version: int, final: bool) -> RequestOutput:
        """The request as it stands: a snapshot (copies; a running sample's text None: the front detokenizes
        streams itself) or the final output. A finished sample has its final text in either, so a stream ends
        its choice at once rather than when the request's last sample ends."""
        completions = []
        for i, s in enumerate(self.samples):
            if s.finish_reason is not None and s.text is None and tokenizer is not None:
                s.text = final_text(tokenizer, s.token_ids, s.finish_reason)  # once: it never changes
            text = s.text if s.finish_reason is not None or final else None
            wants, k = self.params.logprobs is not None, self.params.logprobs or 0
            completions.append(CompletionOutput(i, list(s.token_ids), list(s.logprobs) if wants else None, text,
                                                s.finish_reason, list(s.weight_versions),
                                                list(s.top_logprobs) if k else None, s.stop_reason))
        metrics = {} if self.first_token_time is None else {"first_token_time": self.first_token_time}
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, completions, weight_version, metrics,
                             list(self.prompt_logprobs) if self.prompt_logprobs is not None else None)

    def end(self, output: RequestOutput | None = None, error: BaseException | None = None) -> None:
        """Resolves the caller's future with `output` or `error` (once) and wakes a stream."""
        self.error = error
        if not self.done.done():
            self.done.set_exception(error) if error is not None else self.done.set_result(output)
            if error is not None:
                self.done.exception()  # retrieved: a stream raises `self.error`, a cancelled caller is gone
        if self.changed is not None:
            self.changed.set()


def extend_samples(records: dict[int, RequestRecord], header: dict, columns: dict) -> dict[int, RequestRecord]:
    """Adds a "tokens" message's new tokens (with their logprobs, weight versions and top logprobs) and finish
    reasons to the samples of the records it names (a key no longer held is skipped); returns the records it
    touched, by key."""
    touched, pos, now = {}, 0, time.perf_counter()
    column = lambda name: columns.get(name, [])  # noqa: E731 - a message with no tokens has no columns
    ids, lps, versions = column("token_ids"), column("logprobs"), column("weight_versions")
    top_ids, top_lps, top_pos = column("top_ids"), column("top_logprobs"), 0
    ks = column("top_k") or [0] * len(column("keys"))
    for key, index, count, k in zip(column("keys"), column("indices"), column("counts"), ks):
        record = records.get(key)
        if record is not None:
            sample = record.samples[index]
            sample.token_ids += ids[pos : pos + count]
            sample.logprobs += lps[pos : pos + count]
            sample.weight_versions += versions[pos : pos + count]
            sample.top_logprobs += [dict(zip(top_ids[j : j + k], top_lps[j : j + k]))
                                    for j in range(top_pos, top_pos + k * count, k)] if k else []
            if count and record.first_token_time is None:
                record.first_token_time = now
            touched[key] = record
        pos, top_pos = pos + count, top_pos + k * count
    for key, index, reason, text, stop_reason in header["finished"]:
        record = records.get(key)
        if record is not None:
            sample = record.samples[index]
            sample.finish_reason, sample.text, sample.stop_reason = reason, text, stop_reason
            touched[key] = record
    return touched


def add_prompt_scores(records: dict[int, RequestRecord], header: dict, columns: dict) -> None:
    """A "prompt_scores" message's positions (wire.py), appended to its record's `prompt_logprobs` (a key no
    longer held is skipped)."""
    record = records.get(header["key"])
    if record is None:
        return
    scores = record.prompt_logprobs = record.prompt_logprobs or [None]
    ids, lps, entry = columns.get("prompt_ids", []), columns.get("prompt_logprobs", []), 0
    for size in columns.get("prompt_sizes", []):
        scores.append(dict(zip(ids[entry : entry + size], lps[entry : entry + size])))
        entry += size
