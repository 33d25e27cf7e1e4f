"""AsyncEngine: one engine shared by many callers, with request-level control.

One background thread owns the Engine and runs its GenerationLoop a step at a time. Callers (asyncio
tasks in any event loop, or threads through `asyncio.run`/`run_coroutine_threadsafe`) never touch the
engine: each call becomes a command that the loop thread runs between two steps, with nothing in flight
(`GenerationLoop.drain` first), and its result comes back on the caller's own event loop. New requests
join the running batch at the next step.

Pause modes (`pause_generation`): "abort" ends every request (their callers get the partial outputs);
"wait" admits nothing new and returns once the requests in flight have finished; "keep" stops at a step
boundary with every request's KV kept — after a weight update those requests continue under the new
weights over KV that the old weights computed (their `weight_versions` say where the switch fell); "retract"
frees their KV and keeps their tokens, so they are re-prefilled under the weights that serve when
generation continues (exact for the new weights). Requests submitted while paused wait for
`continue_generation`. `sleep` needs no request holding KV: pause with "abort" or "retract" first.
"""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import queue
import threading
from .chat import chat_prompts
from .engine import Engine
from .errors import EngineError
from .inputs import normalise
from .outputs import RequestOutput
from .partial import check_resumable
from .request_state import TrackedRequest, request_output, settle, wake
from .sampling_params import SamplingParams
from .sequence import Sequence
from .stream_snapshots import Snapshots, StreamFeed

PAUSE_MODES = ("abort", "wait", "keep", "retract")


class AsyncEngine:
    def __init__(self, model_path, **engine_kwargs):
        if engine_kwargs.get("process_group") is not None:  # refused before any rank builds (a collective) engine
            raise ValueError("process_group is not allowed for AsyncEngine: its requests arrive at each rank's own "
                             "pace, so SPMD ranks would drift apart; use Engine(..., process_group=pg) with the same "
                             "calls on every rank, or AsyncEngine(path, tensor_parallel_size=N)")
        self.engine = Engine(model_path, **engine_kwargs)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._requests: dict[str, TrackedRequest] = {}  # admitted, by the caller's id
        self._by_engine_id: dict[int, TrackedRequest] = {}
        self._held: list[TrackedRequest] = []  # submitted while paused
        self._pause: str | None = None
        self._idle_waiters: list[tuple] = []  # pause("wait") callers, answered when nothing is in flight
        self._ids = itertools.count()
        self._error: BaseException | None = None
        self._stopping = False
        self._closed = False  # the loop thread has failed what was pending: no command may enter the inbox
        self._inbox_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wakeup.clear()
                self._run_commands()
                self._answer_idle_waiters()  # a command (abort, pause "abort") may have ended the last request
                if self._stepping():
                    self._deliver(self.engine.loop.step())
                    self._answer_idle_waiters()
                elif not self._stopping:
                    self._wakeup.wait()
        except BaseException as err:  # noqa: BLE001 - every caller learns of it, nobody hangs
            self._error = err
        finally:
            self._fail_everything(self._error or EngineError("the AsyncEngine was shut down"))

    def _stepping(self) -> bool:
        # Asleep, or with discarded weights, queued requests (retracted ones too) wait for wake / an update.
        return ((self._pause is None or self._pause == "wait") and self.engine.loop.has_work()
                and not self.engine.is_sleeping and not self.engine.weight_store.stale)

    def _run_commands(self) -> None:
        while True:
            try:
                command, loop, future = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                result = command()
            except Exception as err:  # noqa: BLE001 - the caller's error, raised in the caller
                settle(loop, future, error=err)
            else:
                settle(loop, future, result)

    def _deliver(self, grown: list[Sequence]) -> None:
        """Tell each stream that its samples grew (O(1) per sample: its consumer builds the snapshot), and hand
        each request's output to its caller once all n finished."""
        touched, wakes = {}, {}
        for seq in grown:
            request = self._by_engine_id.get(seq.request_id)
            if request is not None:
                request.seqs[seq.index] = seq
                touched[id(request)] = request
                if request.feed is not None:
                    request.feed.publish(seq)
        for request in touched.values():
            finished = (len(request.seqs) == request.params.n
                        and all(s.finish_reason is not None for s in request.seqs.values()))
            if finished:
                self._finish(request, self._output(request))
            elif request.feed is not None and request.feed.claim_wake():
                wakes.setdefault(request.loop, []).append(request.feed)
        for loop, feeds in wakes.items():
            wake(loop, feeds)

    def _output(self, request: TrackedRequest, abort: bool = False) -> RequestOutput:
        return request_output(request, self.engine, abort)

    def _finish(self, request: TrackedRequest, output: RequestOutput) -> None:
        self._requests.pop(request.request_id, None)
        if request.first is not None:
            self._by_engine_id.pop(request.first.request_id, None)
        if request in self._held:
            self._held.remove(request)
        settle(request.loop, request.done, output)
        self._end_stream(request)

    @staticmethod
    def _end_stream(request: TrackedRequest) -> None:
        """Wake a stream's consumer after its request's future was settled: it finds the future done."""
        if request.feed is not None:
            wake(request.loop, [request.feed])

    def _answer_idle_waiters(self) -> None:
        if self._idle_waiters and not self.engine.loop.has_work():
            for loop, future in self._idle_waiters:
                settle(loop, future)
            self._idle_waiters = []

    def _fail_everything(self, error: BaseException) -> None:
        with self._inbox_lock:  # from now on every call raises EngineError; what is queued fails below
            self._closed = True
        for request in list(self._requests.values()) + self._held:
            settle(request.loop, request.done, error=error)
            self._end_stream(request)
        self._requests, self._by_engine_id, self._held = {}, {}, []
        for loop, future in self._idle_waiters:
            settle(loop, future, error=error)
        while True:
            try:
                _, loop, future = self._inbox.get_nowait()
            except queue.Empty:
                break
            settle(loop, future, error=error)

    # ------------------------------------------------------------------ commands (run on the loop thread)

    def _checked(self, request: TrackedRequest) -> tuple:
        """(text, ids) of the request's prompt, checked; a RequestOutput to resume is checked whole."""
        prompt, engine = request.prompt, self.engine
        resuming = isinstance(prompt, RequestOutput)
        (text, ids), = normalise([{"prompt_token_ids": prompt.prompt_token_ids} if resuming else prompt],
                                 request.params, engine.tokenizer, engine.cfg.vocab_size, engine.scheduler.max_seq_len)[0]
        if resuming:
            check_resumable(prompt, request.params, engine.cfg.vocab_size, engine.scheduler.max_seq_len)
            text = prompt.prompt
        return text, ids

    def _admit(self, request: TrackedRequest) -> None:
        text, ids = self._checked(request)
        if self.engine.is_sleeping:
            raise EngineError("the engine is asleep; wake() before generating")
        self.engine.weight_store.check_ready()
        request.text = text
        if isinstance(request.prompt, RequestOutput):  # a new id: one in flight may have the output's
            seqs = self.engine.loop.resume(request.prompt, request.params, keep_id=False)
            request.seqs = {s.index: s for s in seqs}
            request.first = next((s for s in seqs if s.finish_reason is None), seqs[0])
            for seq in seqs if request.feed is not None else []:  # its stream starts from the tokens it has
                request.feed.publish(seq)
        else:
            request.first = self.engine.loop.submit(ids, request.params)
        self._by_engine_id[request.first.request_id] = request

    def _finish_if_done(self, request: TrackedRequest) -> None:
        """A resumed request with no sample left to run is answered now: no step will deliver it."""
        if request.seqs and all(s.finish_reason is not None for s in request.seqs.values()):
            self._finish(request, self._output(request))

    def _submit(self, request: TrackedRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request_id={request.request_id!r} is already in flight; ids must be unique")
        if self._pause is not None:
            self._checked(request)  # refuse bad input now, not at continue
            self._held.append(request)
        else:
            self._admit(request)
        self._requests[request.request_id] = request
        self._finish_if_done(request)

    def _abort(self, request_id) -> RequestOutput | None:
        request = self._requests.get(request_id)
        if request is None:
            return None
        self._deliver(self.engine.loop.drain())
        if request.request_id not in self._requests:  # it finished in the step just collected
            return None
        for seq in request.seqs.values() or ([request.first] if request.first is not None else []):
            if seq.finish_reason is None:
                self.engine.scheduler.finish(seq, "abort")
        if request.first is not None and request.first.index not in request.seqs:
            request.seqs[request.first.index] = request.first
        output = self._output(request, abort=True)
        self._finish(request, output)
        return output

    def _pause_now(self, mode: str, loop, future) -> None:
        self._deliver(self.engine.loop.drain())
        self._pause = mode
        if mode == "abort":
            for request_id in list(self._requests):
                self._abort(request_id)
        elif mode == "retract":
            self.engine.scheduler.retract_all()
        if mode == "wait" and self.engine.loop.has_work():
            self._idle_waiters.append((loop, future))
        else:
            settle(loop, future)

    def _continue(self) -> None:
        self._pause = None
        held, self._held = self._held, []
        for request in held:
            try:
                self._admit(request)
            except Exception as err:  # noqa: BLE001 - e.g. the engine is asleep: the caller learns why
                self._requests.pop(request.request_id, None)
                settle(request.loop, request.done, error=err)
                self._end_stream(request)  # a stream waits on its feed, not on `done`
            else:
                self._finish_if_done(request)

    def _sleep(self, level, tags) -> None:
        self._deliver(self.engine.loop.drain())
        if self.engine.scheduler.running:
            raise EngineError(f"{len(self.engine.scheduler.running)} sequences hold KV; pause_generation('abort') "
                              "or pause_generation('retract') before sleep")
        self.engine.sleep(level, tags)

    def _between_steps(self, method, *args):
        self._deliver(self.engine.loop.drain())
        return method(*args)

    # ------------------------------------------------------------------ the public API

    async def _call(self, command):
        return await self._inbox_put(command)

    def _inbox_put(self, command) -> asyncio.Future:
        """Queue a command for the loop thread; its result arrives on the returned future."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._inbox_lock:  # never put a command that no loop thread will run (it would hang its caller)
            if self._closed or self._stopping or not self._thread.is_alive():
                raise EngineError("the AsyncEngine's loop is not running") from self._error
            self._inbox.put((command, loop, future))
        self._wakeup.set()
        return future

    def _new_request(self, prompt, params, request_id, streaming: bool) -> TrackedRequest:
        loop = asyncio.get_running_loop()
        rid = f"request-{next(self._ids)}" if request_id is None else request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id={request_id!r} is not allowed; None or a non-empty str")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams (one prompt per call)")
        return TrackedRequest(rid, prompt, params, loop, loop.create_future(), StreamFeed(params.n) if streaming else None)

    async def generate(self, prompt, params=None, request_id: str | None = None) -> RequestOutput:
        """Sample `params.n` completions of one prompt; an aborted request returns what it had. A caller that
        is cancelled (a client gone) aborts its request: nobody is left to want the rest.

        `prompt` may be an aborted RequestOutput: its "abort" samples continue from their tokens (as in
        Engine.generate; pass the params of its first call). It runs under a new internal id, so its samples
        draw the draws of an uninterrupted run only when params.seed is set."""
        request = self._new_request(prompt, params, request_id, streaming=False)
        await self._call(lambda: self._submit(request))
        try:
            return await asyncio.shield(request.done)
        except asyncio.CancelledError:
            if not request.done.done():
                with contextlib.suppress(EngineError):  # a loop already gone aborts nothing
                    self._inbox_put(lambda: self._abort(request.request_id))
            raise

    async def chat(self, conversation, params=None, request_id: str | None = None, tools=None,
                   chat_template_kwargs=None) -> RequestOutput:
        """generate() for one conversation, rendered by the checkpoint's chat template straight to token ids."""
        prompts, batched = chat_prompts(self.engine.tokenizer, conversation, tools, chat_template_kwargs,
                                        name="conversation")
        if batched:
            raise ValueError("conversation must be one conversation (a list of messages); AsyncEngine.chat takes "
                             "one per call")
        return await self.generate({"prompt_token_ids": prompts[0]}, params, request_id)

    async def stream(self, prompt, params=None, request_id: str | None = None):
        """Cumulative RequestOutput snapshots as tokens arrive; the last is what generate() returns.

        The snapshots are built here, on the caller's event loop, from the tokens the loop thread published
        since the last one (stream_snapshots.py): a snapshot costs the engine's steps nothing, and one taken
        late carries every token so far."""
        request = self._new_request(prompt, params, request_id, streaming=True)
        await self._call(lambda: self._submit(request))
        snapshots = Snapshots(request.params, self.engine.tokenizer)
        try:
            while True:
                await request.feed.wait()
                if request.done.done():
                    break
                if snapshots.take(request.feed):
                    yield snapshots.output(request.request_id, request.text, request.first, self.engine.weight_version)
            yield request.done.result()  # the final output, or the request's error raised
        finally:
            if not request.done.done():  # the consumer stopped early: nobody wants the rest
                await self.abort(request.request_id)

    async def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now: its partial output (finish_reason "abort"), or None if unknown or finished."""
        return await self._call(lambda: self._abort(request_id))

    async def pause_generation(self, mode: str = "abort") -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode={mode!r} is not allowed; one of {PAUSE_MODES}")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        await self._call(lambda: self._pause_now(mode, loop, done))
        await done

    async def continue_generation(self) -> None:
        await self._call(self._continue)

    async def update_weights(self, named_tensors, version: int | None = None, model: str = "target") -> int:
        return await self._call(lambda: self._between_steps(self.engine.update_weights, named_tensors, version, model))

    async def update_weights_from_disk(self, path, version: int | None = None, model: str = "target") -> int:
        return await self._call(lambda: self._between_steps(self.engine.update_weights_from_disk, path, version,
                                                            model))

    async def sleep(self, level: int = 1, tags=None) -> None:
        await self._call(lambda: self._sleep(level, tags))

    async def wake(self, tags=None, allow_resize: bool = False) -> None:
        await self._call(lambda: self._between_steps(self.engine.wake, tags, allow_resize))

    async def flush_cache(self) -> None:
        await self._call(lambda: self._between_steps(self.engine.flush_cache))

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is alive and has not failed: calls are being served."""
        return self._error is None and not self._closed and self._thread.is_alive()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def shutdown(self, timeout_s: float = 30) -> None:
        """Stop the loop thread; requests still pending fail with EngineError."""
        self._stopping = True
        self._wakeup.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def __enter__(self) -> "AsyncEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
