"""What the AsyncEngine keeps of each caller's request, and the RequestOutput it reports: final, partial
(aborted) or a stream's snapshot."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from .outputs import CompletionOutput, RequestOutput, prompt_logprobs, sample_logprobs, top_logprobs
from .sequence import Sequence


@dataclass(eq=False)
class TrackedRequest:
    request_id: str
    prompt: object
    params: object
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    updates: asyncio.Queue | None = None  # a stream's snapshots
    # A snapshot is in the queue, not yet taken: the next steps add none (each is cumulative, so the one taken
    # next carries their tokens too), and a slow consumer costs the loop thread nothing per step.
    snapshot_queued: bool = False
    text: str | None = None
    first: Sequence | None = None
    seqs: dict[int, Sequence] = field(default_factory=dict)  # sample index -> its sequence


def settle(loop, future, result=None, error: BaseException | None = None) -> None:
    """Resolve a caller's future from the loop thread, on the caller's event loop."""
    def apply():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    if not loop.is_closed():
        loop.call_soon_threadsafe(apply)


def _holding_back(text: str, stops) -> str:
    """A running sample's text for a snapshot: a character still split across tokens comes whole later
    (stripped by the caller), and a tail that may begin a stop string is held back until it is known not to
    (the final text ends before the stop string), so every snapshot's text is a prefix of the final one."""
    cut = max((k for s in stops for k in range(1, min(len(s), len(text) + 1)) if text.endswith(s[:k])), default=0)
    return text[: len(text) - cut]


def request_output(request: TrackedRequest, engine, abort: bool = False) -> RequestOutput:
    """The request's output as it stands (samples not split off yet have no tokens)."""
    if abort or len(request.seqs) < request.params.n or any(s.finish_reason is None for s in request.seqs.values()):
        return _snapshot(request, engine, "abort" if abort else None)
    out = engine.loop.output(request.text, request.first, list(request.seqs.values()), engine.weight_version)
    out.request_id = request.request_id
    return out


def _snapshot(request: TrackedRequest, engine, reason: str | None) -> RequestOutput:
    tokenizer, completions = engine.tokenizer, []
    for index in range(request.params.n):
        seq = request.seqs.get(index)
        ids = seq.output_ids if seq is not None else []
        text = None
        if seq is not None and seq.text is not None:  # finished at a stop string: the text before it
            text = seq.text
        elif tokenizer is not None:
            text = tokenizer.decode(ids, skip_special_tokens=True)
            if reason is None and seq is not None and seq.finish_reason is None:
                text = _holding_back(text.rstrip("\ufffd"), request.params.stop)
        if seq is not None:
            logprobs, tops, versions = sample_logprobs(seq), top_logprobs(seq), list(seq.weight_versions)
        else:  # not split off yet: no tokens
            params = request.params
            logprobs, tops, versions = [] if params.logprobs is not None else None, [] if params.logprobs else None, []
        completions.append(CompletionOutput(index, ids, logprobs, text,
                                            (seq.finish_reason if seq is not None else None) or reason, versions, tops))
    first = request.first
    prompt_ids = first.token_ids[: first.num_prompt_tokens] if first is not None else []
    return RequestOutput(request.request_id, request.text, prompt_ids, completions, engine.weight_version,
                         prompt_logprobs=prompt_logprobs(first) if first is not None else None)
