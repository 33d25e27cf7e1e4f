"""What the AsyncEngine keeps of each caller's request beyond what RequestControl keeps, and the RequestOutput
it reports: final or partial (aborted). A stream's snapshots are its consumer's to build (stream_snapshots.py)."""
from __future__ import annotations

import asyncio
import copy
import dataclasses
from dataclasses import dataclass

from .errors import EngineError
from .outputs import CompletionOutput, RequestOutput, final_text, prompt_logprobs, sample_logprobs, top_logprobs
from .request_control import ControlledRequest
from .stream_snapshots import StreamFeed


@dataclass(eq=False, kw_only=True)
class TrackedRequest(ControlledRequest):
    """`key` is the caller's request_id."""
    prompt: object  # a prompt, or a RequestOutput to resume
    loop: asyncio.AbstractEventLoop
    done: asyncio.Future
    feed: StreamFeed | None = None  # a stream's: what the loop thread publishes for its consumer
    text: str | None = None


def settle(loop, future, result=None, error: BaseException | None = None) -> None:
    """Resolve a caller's future from the loop thread, on the caller's event loop."""
    def apply():
        if not future.done():
            future.set_exception(error) if error is not None else future.set_result(result)

    _call_soon(loop, apply)


def stopped_by(error: BaseException) -> EngineError:
    """What a caller learns of an error that is no Exception (a CancelledError or SystemExit raised on the loop
    thread, by a weight generator say): an EngineError caused by it. Raised as it is, it would read as the caller's
    own cancellation, or end the caller's event loop."""
    stopped = EngineError(f"the AsyncEngine's call was stopped by {type(error).__name__}: {error}")
    stopped.__cause__ = error
    return stopped


def wake(loop, feeds: list[StreamFeed]) -> None:
    """Wake streams' consumers from the loop thread: one call on their event loop for all of them (each call
    writes to the loop's self-pipe)."""
    def apply():
        for feed in feeds:
            feed.changed.set()

    _call_soon(loop, apply)


def _call_soon(loop, callback) -> None:
    """Run `callback` on a caller's event loop. Its thread closes that loop when it likes (its asyncio.run
    ended on a timeout, say), between any check and this call: an answer the loop cannot take is dropped, as
    nobody is left there to read it, and the loop thread goes on serving the other callers."""
    try:
        loop.call_soon_threadsafe(callback)
    except RuntimeError:  # "Event loop is closed": a closed loop costs only its own answer
        pass


def request_output(request: TrackedRequest, engine, abort: bool = False) -> RequestOutput:
    """The output of a request whose samples all finished, or with `abort` the partial one of a request that
    was cut short (samples not split off yet have no tokens)."""
    if abort:
        return _partial(request, engine)
    out = engine.loop.output(request.text, request.first, list(request.seqs.values()), engine.weight_version)
    out.request_id = request.key
    return out


def _partial(request: TrackedRequest, engine) -> RequestOutput:
    first = request.first
    if first is None and isinstance(request.prompt, RequestOutput):  # a resume cut before it ran: as it came
        return dataclasses.replace(copy.deepcopy(request.prompt), request_id=request.key,  # not the caller's own
                                   weight_version=engine.weight_version)
    tokenizer, completions = engine.tokenizer, []
    for index in range(request.params.n):
        seq = request.seqs.get(index)
        ids = seq.output_ids if seq is not None else []
        text = seq.text if seq is not None and seq.text is not None else (  # stopped: the text before the stop
            final_text(tokenizer, ids, seq.finish_reason if seq is not None else None) if tokenizer is not None
            else None)
        if seq is not None:
            logprobs, tops, versions = sample_logprobs(seq), top_logprobs(seq), list(seq.weight_versions)
        else:  # not split off yet: no tokens
            params = request.params
            logprobs, tops, versions = [] if params.logprobs is not None else None, [] if params.logprobs else None, []
        completions.append(CompletionOutput(index, ids, logprobs, text, (seq.finish_reason if seq is not None else None)
                                            or "abort", versions, tops, seq.stop_reason if seq is not None else None,
                                            seq.prompt_weight_version if seq is not None else None))
    # a request held before admission has its prompt's ids from the check at submit
    prompt_ids = first.token_ids[: first.num_prompt_tokens] if first is not None else list(request.ids or [])
    return RequestOutput(request.key, request.text, prompt_ids, completions, engine.weight_version,
                         prompt_logprobs=prompt_logprobs(first) if first is not None else None)
