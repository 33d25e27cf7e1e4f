"""LoopThread: the thread that owns an AsyncEngine's Engine, runs its steps and the callers' commands between them,
and answers each caller on its own event loop (futures, stream feeds). async_engine.py is the callers' side.
"""
from __future__ import annotations

import asyncio
import copy
import queue
import threading

from .engine import Engine
from .errors import EngineDeadError, EngineError
from .exclusive import held_by
from .inputs import normalise
from .outputs import RequestOutput
from .partial import check_resumable
from .request_control import RequestControl
from .request_state import TrackedRequest, request_output, settle, stopped_by, wake
from .sequence import Sequence


class Command:
    """A caller's call queued for the loop thread: it runs once, unless withdrawn before it starts."""

    def __init__(self, run, loop, future):
        self.run, self.loop, self.future = run, loop, future
        self.started = self.withdrawn = False  # set under the loop thread's inbox lock

    def answer(self, result=None, error: BaseException | None = None) -> None:
        if self.future is not None:
            settle(self.loop, self.future, result, error)


class LoopThread:
    """The thread that owns an AsyncEngine's Engine, and what only it touches: the engine's RequestControl and
    the inbox of commands. Nothing here refers to the AsyncEngine, so the thread never keeps it alive (a caller
    waiting on a request does: the request's future holds the caller's task); one dropped without shutdown() is
    collected, and its finalizer stops this thread."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.control = RequestControl(engine, check=self._check, start=self._start, grew=self._grew,
                                      ended=self._ended, refused=self._refused,
                                      idle=lambda waiter, error=None: settle(*waiter, error=error))
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._error: BaseException | None = None
        self._stopping = False
        self._closed = False  # the loop thread has failed what was pending: no command may enter the inbox
        self._answering = False  # an abort() runs: its caller gets a copy of the output generate()'s gets
        self._inbox_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rollout-engine-loop", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the loop thread

    def _run(self) -> None:
        control = self.control
        try:
            with held_by(self.engine, "the AsyncEngine that owns this Engine (its loop thread; use its methods)"):
                self._loop(control)
        except BaseException as err:  # noqa: BLE001 - every caller learns of it, nobody hangs
            self._error = err
        finally:
            self._fail_everything(self._error or EngineError("the AsyncEngine was shut down"))

    def _loop(self, control: RequestControl) -> None:
        while not self._stopping:
            self._wakeup.clear()
            self._run_commands()
            control.answer_idle_waiters()  # a command (abort, pause "abort") may have ended the last request
            if control.stepping():
                control.step()
            elif not self._stopping:
                self._wakeup.wait()

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not self._claim(command):
                continue
            try:
                result = command.run()
            except Exception as err:  # noqa: BLE001 - the caller's error, raised in the caller
                command.answer(error=err)
            except BaseException as err:  # noqa: BLE001 - e.g. a weight generator's CancelledError or SystemExit:
                command.answer(error=stopped_by(err))  # the Engine's call left it consistent, as on Ctrl-C
            else:
                command.answer(result)

    def _claim(self, command: Command) -> bool:
        """Whether `command` runs: not if its caller withdrew it first (`withdraw`)."""
        with self._inbox_lock:
            if command.withdrawn:
                return False
            command.started = True
            return True

    def _fail_everything(self, error: BaseException) -> None:
        error = error if isinstance(error, Exception) else stopped_by(error)  # never a caller's own cancellation
        with self._inbox_lock:  # from now on every call raises EngineError; what is queued fails below
            self._closed = True
        requests, waiters = self.control.forget_all()
        for request in requests:
            settle(request.loop, request.done, error=error)
            self._end_stream(request)
        for loop, future in waiters:
            settle(loop, future, error=error)
        while True:
            try:
                self._inbox.get_nowait().answer(error=error)
            except queue.Empty:
                break

    # ------------------------------------------------------------------ RequestControl's hooks (the loop thread)

    def _check(self, request: TrackedRequest) -> None:
        """The request's prompt checked: (text, ids) kept; a RequestOutput to resume is checked whole."""
        prompt, engine = request.prompt, self.engine
        resuming = isinstance(prompt, RequestOutput)
        [(text, ids)], [request.params] = normalise(  # its params: a copy when a stop string is a special token
            [{"prompt_token_ids": prompt.prompt_token_ids} if resuming else prompt], request.params, engine.tokenizer,
            engine.cfg.vocab_size, engine.scheduler.max_seq_len)
        if resuming:
            check_resumable(prompt, request.params, engine.cfg.vocab_size, engine.scheduler.max_seq_len,
                            engine.cfg.eos_token_ids)
            text = prompt.prompt
        request.text, request.ids = text, ids

    def _start(self, request: TrackedRequest) -> Sequence:
        if not isinstance(request.prompt, RequestOutput):
            return self.engine.loop.submit(request.ids, request.params)
        seqs = self.engine.loop.resume(request.prompt, request.params, keep_id=False)  # a new id: one in flight
        request.seqs = {s.index: s for s in seqs}                                     # may have the output's
        for seq in seqs if request.feed is not None else []:  # its stream starts from the tokens it has
            request.feed.publish(seq)
        return next((s for s in seqs if s.finish_reason is None), seqs[0])

    def _grew(self, pairs: list[tuple], done: dict) -> None:
        """Tell each stream that its samples grew (O(1) per sample: its consumer builds the snapshot) and wake
        those not done, one call per event loop (a done request's caller is answered by `_ended`)."""
        wakes = {}
        for request, seq in pairs:
            if request.feed is not None:
                request.feed.publish(seq)
        for request in dict.fromkeys(request for request, _ in pairs):
            if request not in done and request.feed is not None and request.feed.claim_wake():
                wakes.setdefault(request.loop, []).append(request.feed)
        for loop, feeds in wakes.items():
            wake(loop, feeds)

    def abort(self, key) -> RequestOutput | None:
        """RequestControl.abort for abort()'s caller, who gets the output copied before generate()'s caller gets
        it (and may edit it); a pause's or a gone caller's abort copies nothing."""
        self._answering = True
        try:
            return self.control.abort(key)
        finally:
            self._answering = False

    def _ended(self, request: TrackedRequest, aborted: bool) -> RequestOutput | None:
        output = request_output(request, self.engine, aborted)
        answer = copy.deepcopy(output) if self._answering and aborted else None  # not the drain's finished ones
        settle(request.loop, request.done, output)
        self._end_stream(request)
        return answer

    def _refused(self, request: TrackedRequest, error: BaseException) -> None:
        settle(request.loop, request.done, error=error)
        self._end_stream(request)  # a stream waits on its feed, not on `done`

    @staticmethod
    def _end_stream(request: TrackedRequest) -> None:
        """Wake a stream's consumer after its request's future was settled: it finds the future done."""
        if request.feed is not None:
            wake(request.loop, [request.feed])

    # ------------------------------------------------------------------ commands (run on the loop thread)

    def submit(self, request: TrackedRequest) -> None:
        if request.key in self.control:
            raise ValueError(f"request_id={request.key!r} is already in flight; ids must be unique")
        self.control.submit(request)

    # ------------------------------------------------------------------ the callers' side

    def put(self, run, answered: bool = True) -> Command:
        """Queue `run` for the loop thread; its result arrives on the command's future (on the running event loop),
        or nowhere when not `answered` (an abort whose caller is gone: callable where no event loop runs)."""
        loop = asyncio.get_running_loop() if answered else None
        command = Command(run, loop, loop.create_future() if answered else None)
        with self._inbox_lock:  # never put a command that no loop thread will run (it would hang its caller)
            running = not (self._closed or self._stopping) and self._thread.is_alive()
            if running:
                self._inbox.put(command)
        # Raised outside the lock: a garbage collection the error starts may drop a stream, whose abort puts again
        if not running:  # an engine that died (a tensor-parallel rank gone) says so: its callers rebuild it
            error = EngineDeadError if isinstance(self._error, EngineDeadError) else EngineError
            raise error("the AsyncEngine's loop is not running") from self._error
        self._wakeup.set()
        return command

    def withdraw(self, command: Command) -> bool:
        """Whether `command` will never run: true if it had not started (it is skipped), false once it has."""
        with self._inbox_lock:
            command.withdrawn = not command.started
            return command.withdrawn

    @property
    def is_running(self) -> bool:
        return self._error is None and not self._closed and self._thread.is_alive()

    def shutdown(self, timeout_s: float = 30) -> None:
        self._stopping = True
        self._wakeup.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if not self._thread.is_alive():  # else the loop still holds the engine
                self.engine.shutdown()
