"""AsyncEngine: one engine shared by many callers, with request-level control.

One background thread owns the Engine and runs its GenerationLoop a step at a time. Callers (asyncio
tasks in any event loop, or threads through `asyncio.run`/`run_coroutine_threadsafe`) never touch the
engine: each call becomes a command that the loop thread runs between two steps, with nothing in flight
(`GenerationLoop.drain` first), and its result comes back on the caller's own event loop. New requests
join the running batch at the next step. That thread and what it touches are a LoopThread, which holds
nothing of its AsyncEngine: one dropped without shutdown() is collected, and stops its thread and engine.

The requests in flight, the ones a pause holds and the pause modes ("abort", "wait", "keep", "retract") are
RequestControl's (request_control.py, shared with the server's engine process); this file answers callers on
their event loops: futures, stream feeds, and a RequestOutput given back as a prompt to resume. The thread is
loop_thread.py's.
"""
from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import threading
import weakref
from collections.abc import Coroutine
from typing import Any

from .chat import chat_prompts
from .engine import Engine
from .inputs import PROMPT_FORMS, one_prompt
from .errors import EngineError
from .loop_thread import LoopThread
from .outputs import RequestOutput
from .request_control import check_pause_mode, check_request_id, request_id_of
from .request_state import TrackedRequest
from .sampling_params import SamplingParams
from .stream_snapshots import Snapshots, StreamFeed

FINALIZE_JOIN_S = 5  # how long collecting an AsyncEngine waits for its loop thread to stop


class AsyncEngine:
    """One Engine shared by many callers: `await` its calls from any event loop; requests join the running batch
    at the next step, and every other call runs between two steps. Build it with Engine's arguments."""

    def __init__(self, model_path, **engine_kwargs):
        if engine_kwargs.get("process_group") is not None:  # refused before any rank builds (a collective) engine
            raise ValueError("process_group is not allowed for AsyncEngine: its requests arrive at each rank's own "
                             "pace, so SPMD ranks would drift apart; use Engine(..., process_group=pg) with the same "
                             "calls on every rank, or AsyncEngine(path, tensor_parallel_size=N)")
        self.engine = Engine(model_path, **engine_kwargs)
        self._loop_thread = LoopThread(self.engine)
        self._control = self._loop_thread.control  # commands run its methods on the loop thread
        # Dropped without shutdown(), the AsyncEngine is collected (its loop thread and commands hold none of it)
        # and stops its loop thread and engine as shutdown() does, waiting FINALIZE_JOIN_S at most (a thread busy
        # in a command exits at its next check). Not at interpreter exit: the thread is a daemon there, and a
        # join would hold the exit while a command runs.
        weakref.finalize(self, self._loop_thread.shutdown, FINALIZE_JOIN_S).atexit = False

    # ------------------------------------------------------------------ the public API

    async def _call(self, method, *args, withdrawable: bool = True):
        """`method(*args)` run on the loop thread between two steps: its result, or its error raised here. The
        command holds `method` (the loop thread's or the engine's), never this AsyncEngine.

        A caller cancelled (a timeout, a task group) before the command starts withdraws it (it never runs) unless
        it is not `withdrawable` (a stream's abort as it closes, a pause: they run whatever happens to the
        caller). One cancelled while it runs raises CancelledError once it has run, so no call goes on reading a
        caller's tensors after the caller has moved on."""
        command = self._loop_thread.put(functools.partial(method, *args))
        try:
            return await asyncio.shield(command.future)
        except asyncio.CancelledError:
            if withdrawable and self._loop_thread.withdraw(command):
                command.future.cancel()  # nothing answers it now; an answer racing the withdrawal finds it done
            else:
                await _outlast(command.future)
            raise

    def _new_request(self, prompt, params, request_id, streaming: bool) -> TrackedRequest:
        loop = asyncio.get_running_loop()
        rid = request_id_of(request_id)
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams (one prompt per call)")
        params.validate()  # a field set since construction: the stream's snapshots read them before the loop does
        if isinstance(prompt, (list, tuple)) and prompt and not one_prompt(prompt):
            raise ValueError(f"prompt must be one prompt ({', '.join(PROMPT_FORMS)}), not a list of prompts; "
                             f"AsyncEngine.generate and stream take one per call")
        if not (isinstance(prompt, (list, tuple, RequestOutput)) or one_prompt(prompt)):  # a bare token id: refused
            raise ValueError(f"prompt must be one prompt ({', '.join(PROMPT_FORMS)}) or an aborted RequestOutput, "
                             f"not {type(prompt).__name__} {prompt!r:.40}")
        return TrackedRequest(rid, params, prompt=prompt, loop=loop, done=loop.create_future(),
                              feed=StreamFeed(params.n) if streaming else None)

    def generate(self, prompt, params=None, request_id: str | None = None) -> Coroutine[Any, Any, RequestOutput]:
        """Sample `params.n` completions of one prompt (a coroutine: await it, or make it a task); an aborted
        request returns what it had. A caller that is cancelled (a client gone) aborts its request: nobody is
        left to want the rest. The prompt and params are copied at the call, so edits after it (the next task's
        seed) leave this request as called.

        `prompt` may be an aborted RequestOutput: its "abort" samples continue from their tokens (as in
        Engine.generate; pass the params of its first call). It runs under a new internal id, so its samples
        draw the draws of an uninterrupted run only when params.seed is set."""
        return self._generate(*_as_called(prompt, params), request_id)

    async def _generate(self, prompt, params, request_id: str | None) -> RequestOutput:
        request = self._new_request(prompt, params, request_id, streaming=False)
        try:
            await self._call(self._loop_thread.submit, request)  # cancelled here, the request was never submitted,
            return await asyncio.shield(request.done)              # or it was and is abandoned below
        except asyncio.CancelledError:
            if not request.done.done():
                self._abandon_soon(request)
            raise

    def chat(self, conversation, params=None, request_id: str | None = None, tools=None,
             chat_template_kwargs=None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> Coroutine[Any, Any, RequestOutput]:
        """generate() for one conversation, rendered by the checkpoint's chat template straight to token ids at
        the call (add_generation_prompt, continue_final_message: render_chat's); an error surfaces at the await."""
        try:
            prompts, batched = chat_prompts(self.engine.tokenizer, conversation, tools, chat_template_kwargs,
                                            add_generation_prompt, name="conversation",
                                            max_seq_len=self.engine.scheduler.max_seq_len,
                                            continue_final_message=continue_final_message)
            if batched:
                raise ValueError("conversation must be one conversation (a list of messages); AsyncEngine.chat "
                                 "takes one per call")
        except Exception as err:
            return _raising(err)
        return self.generate({"prompt_token_ids": prompts[0]}, params, request_id)

    def stream(self, prompt, params=None, request_id: str | None = None) -> "RequestStream":
        """Cumulative RequestOutput snapshots as tokens arrive (`async for`); the last is what generate() returns.

        The snapshots are built here, on the caller's event loop, from the tokens the loop thread published
        since the last one (stream_snapshots.py): a snapshot costs the engine's steps nothing, and one taken
        late carries every token so far. A stream dropped unfinished (a `break` out of its loop) aborts its
        request at once, so its request_id is free for the next call; one still referenced aborts it on aclose()."""
        dropped = _Dropped()
        return RequestStream(self._stream(*_as_called(prompt, params), request_id, dropped), dropped)

    async def _stream(self, prompt, params, request_id, dropped: "_Dropped"):
        request = self._new_request(prompt, params, request_id, streaming=True)
        dropped.abandon = functools.partial(self._abandon_soon, request)
        snapshots = Snapshots(request.params, self.engine.tokenizer)
        submitted = False
        try:
            await self._call(self._loop_thread.submit, request)
            submitted = True
            while True:
                await request.feed.wait()
                if request.done.done():
                    break
                if snapshots.take(request.feed):
                    yield snapshots.output(request.key, request.text, request.first, self.engine.weight_version)
            yield request.done.result()  # the final output, or the request's error raised
        finally:
            dropped.abandon = None
            if not request.done.done():
                request.done.add_done_callback(_outcome_unread)
                if submitted:  # the consumer stopped early: nobody wants the rest (cancelled again here, still)
                    await self._call(self._control.abandon, request, withdrawable=False)
                else:  # cancelled before the loop thread ran the submit
                    self._abandon_soon(request)

    def _abandon_soon(self, request: TrackedRequest) -> None:
        """Queue the abort of `request`, whose caller is gone, without waiting: it runs after the request's
        submit if that is still queued, and only if the request holds its key (RequestControl.abandon)."""
        with contextlib.suppress(RuntimeError):  # from any thread (a stream's garbage collection); a closed loop
            request.loop.call_soon_threadsafe(request.done.add_done_callback, _outcome_unread)
        with contextlib.suppress(EngineError):  # a loop already gone aborts nothing
            self._loop_thread.put(functools.partial(self._control.abandon, request), answered=False)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now: its partial output (finish_reason "abort"), or None if unknown or finished."""
        return await self._call(self._loop_thread.abort, check_request_id(request_id))

    async def pause_generation(self, mode: str = "abort") -> None:
        """Admit no request until continue_generation(). The requests in flight: "abort" ends them (each caller
        gets its partial output, finish_reason "abort"); "wait" lets them finish (returns when none is left);
        "keep" holds them with their tokens and KV (KV the old weights computed, if weights change meanwhile);
        "retract" holds their tokens and frees their KV, to be re-prefilled when they resume (under
        whatever weights are then loaded), so the engine may sleep. The pause starts when its command runs,
        even if its caller was cancelled first: a caller cancelled while awaiting a pause (a timeout) leaves the
        engine paused all the same. A "wait"
        pause whose requests a later "keep" or "retract" pause holds, or a continue_generation lifts, raises
        EngineError instead of waiting for them."""
        check_pause_mode(mode)
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        try:
            if await self._call(self._control.pause, mode, (loop, done), withdrawable=False):
                return
            await done
        finally:
            done.cancel()  # a caller gone waits for nothing: a later end of its "wait" pause answers no one

    async def continue_generation(self) -> None:
        """End a pause: the requests it held and those that arrived meanwhile run from the next step."""
        await self._call(self._control.unpause)

    async def update_weights(self, named_tensors, version: int | None = None, model: str = "target") -> int:
        """Engine.update_weights between two steps; returns the new weight version. Tokens sampled from then on
        carry it in `weight_versions`. Cancelled (a timeout), it raises CancelledError only when the engine holds
        none of the tensors to read: before the copy starts (nothing changed), or after it (the version advanced)."""
        return await self._call(self._control.between_steps, self.engine.update_weights, named_tensors,
                                version, model)

    async def update_weights_from_disk(self, path, version: int | None = None, model: str = "target") -> int:
        """Engine.update_weights_from_disk between two steps; returns the new weight version."""
        return await self._call(self._control.between_steps, self.engine.update_weights_from_disk, path,
                                version, model)

    async def receive_weights(self, receiver, begin_timeout_s: float | None = None) -> int:
        """One update from a trainer process's WeightSender, through `receiver` (a transport.WeightReceiver built
        over `self.engine`), between two steps as update_weights; returns the new weight version. No step runs
        until it ends: the wait for the sender's 'begin' (up to `begin_timeout_s`; None: as long as it takes)
        included, so call it when the trainer is about to send. shutdown() does not end that wait;
        `receiver.close()` from another thread does (WeightUpdateAborted), and so does cancelling the caller
        (asyncio.wait_for): CancelledError within receiver.STOP_CHECK_MS. An update whose 'begin' has arrived
        runs to its end first, as update_weights does when cancelled."""
        if getattr(receiver, "engine", None) is not self.engine:
            raise ValueError("receiver must be a WeightReceiver built over this AsyncEngine's engine: "
                             "WeightReceiver(async_engine.engine)")
        stopped = threading.Event()  # a caller cancelled (wait_for) ends the wait for 'begin', not an update begun
        call = asyncio.ensure_future(self._call(self._control.between_steps, receiver.receive, begin_timeout_s,
                                                stopped.is_set))
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            stopped.set()
            call.cancel()
            await _outlast(call)
            raise

    async def sleep(self, level: int = 1, tags=None) -> None:
        """Engine.sleep between two steps; refused (EngineError) while a request holds KV: pause_generation with
        "abort" or "retract" first."""
        await self._call(self._control.sleep, level, tags)

    async def wake(self, tags=None, allow_resize: bool = False) -> None:
        """Engine.wake between two steps."""
        await self._call(self._control.between_steps, self.engine.wake, tags, allow_resize)

    async def flush_cache(self) -> None:
        """Engine.flush_cache between two steps."""
        await self._call(self._control.between_steps, self.engine.flush_cache)

    async def stats(self) -> dict:
        """Engine.stats(), read on the loop thread between steps."""
        return await self._call(self.engine.stats)

    async def memory_stats(self) -> dict:
        """Engine.memory_stats(), read on the loop thread between steps."""
        return await self._call(self.engine.memory_stats)

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive and has not failed: calls are being served."""
        return self._loop_thread.is_running

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def shutdown(self, timeout_s: float = 30) -> None:
        """Stop the loop thread (requests still pending fail with EngineError), then the engine it built: its
        tensor-parallel worker processes exit (Engine.shutdown)."""
        self._loop_thread.shutdown(timeout_s)

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _outcome_unread(done: asyncio.Future) -> None:
    """The done-callback of a request whose caller is gone: its error (a shutdown before its abort ran) is read
    here, not logged as "Future exception was never retrieved"."""
    if not done.cancelled():
        done.exception()


class _Dropped:
    """What a RequestStream does when dropped: abandon its request, once it has one that is unfinished."""
    abandon = None


class RequestStream:
    """AsyncEngine.stream's async iterator. Dropped unfinished it abandons its request there and then, where the
    async generator inside would be closed only at a later turn of the event loop (after a submit that reuses the
    request_id). It and that generator share only the `_Dropped`, so the generator never keeps it alive."""

    def __init__(self, generator, dropped: _Dropped):
        self._generator, self._dropped = generator, dropped

    def __aiter__(self) -> "RequestStream":
        return self

    def __anext__(self):
        return self._generator.__anext__()

    def aclose(self):
        return self._generator.aclose()

    def __del__(self):
        if self._dropped.abandon is not None:
            self._dropped.abandon()


def _as_called(prompt, params) -> tuple:
    """The prompt and params as they are at the call. The loop reads a request's params at every step, and its
    prompt at submit and again when a pause that held it ends: copies, so a caller that edits its objects for the
    next request, before this call's coroutine has run or after, leaves this one as called."""
    return _as_submitted(prompt), copy.deepcopy(params) if isinstance(params, SamplingParams) else params


async def _raising(err: Exception):
    raise err


def _as_submitted(prompt):
    """A copy of `prompt` that the caller's later edits leave alone: token ids as a new list (a list's copy is
    cheap; a deep copy of every int is not), a dict's values alike, an array or a RequestOutput deep-copied; a str
    is immutable. Whatever else it is, the loop thread's checks refuse."""
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    if isinstance(prompt, dict):
        return {key: _as_submitted(value) for key, value in prompt.items()}
    if isinstance(prompt, RequestOutput) or hasattr(prompt, "ndim"):
        return copy.deepcopy(prompt)
    return prompt


async def _outlast(future: asyncio.Future) -> None:
    """Wait until `future` is done, however often the waiting task is cancelled meanwhile; its result or error is
    the command's, dropped: the cancelled caller raises its cancellation."""
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait([future])
    if not future.cancelled():
        future.exception()
