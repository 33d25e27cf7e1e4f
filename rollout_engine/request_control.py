"""Request-level control over one Engine: the requests in flight, the ones a pause holds, and the pause modes.

AsyncEngine (callers on asyncio event loops) and the server's engine process (callers over ZeroMQ) each drive
their Engine through one RequestControl, from one thread, between steps. What differs between them, how a
caller is told what happened, comes back through the hooks they pass in.

Pause modes: "abort" ends every request (each caller gets its partial output); "wait" admits nothing new and is
answered once nothing is in flight; "keep" stops at a step boundary with every request's KV kept (after a weight
update they continue under the new weights over KV that the old weights computed: their `weight_versions` say
where the switch fell, `prompt_weight_version` which weights computed the prompt's KV (an update inside a
prefill shows there alone), and a prompt scored part-way (prompt_logprobs) keeps the old weights' positions);
"retract" frees their KV and keeps their tokens, so they are re-prefilled (and a part-scored prompt scored again
whole) under the weights that serve when generation continues. Requests submitted while paused are held until `unpause`.
`sleep` needs no sequence holding KV: pause with "abort" or "retract" first.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Callable, Hashable

from .engine import Engine
from .errors import EngineAsleepError, EngineDeadError, EngineError, WeightsNotReadyError
from .sampling_params import SamplingParams
from .sequence import Sequence

PAUSE_MODES = ("abort", "wait", "keep", "retract")


def check_pause_mode(mode) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; one of {PAUSE_MODES}")


def check_request_id(request_id, allowed: str = "a non-empty str") -> str:
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id={request_id!r} is not allowed; {allowed}")
    return request_id


def request_id_of(request_id) -> str:
    """The caller's id, checked, or a fresh one for None: a uuid, which no id a caller chose collides with."""
    if request_id is None:
        return f"request-{uuid.uuid4().hex}"
    return check_request_id(request_id, "None or a non-empty str")


@dataclass(eq=False)
class ControlledRequest:
    """What the control keeps of one request; its owner subclasses it with how the caller is answered."""
    key: Hashable  # the caller's id of the request, unique among those in flight
    params: SamplingParams
    ids: list[int] | None = None  # the prompt's token ids, once checked
    first: Sequence | None = None  # its first sequence in the engine's loop, once admitted
    seqs: dict[int, Sequence] = field(default_factory=dict)  # sample index -> its sequence


def all_finished(request: ControlledRequest) -> bool:
    """Whether each of the request's n samples has finished."""
    return len(request.seqs) == request.params.n and all(s.finish_reason is not None for s in request.seqs.values())


class RequestControl:
    """The hooks, each called on the control's thread:
    - check(request): raise if its input is bad; at submit, and again when a held request is admitted.
    - start(request) -> Sequence: queue it in `engine.loop`; its first sequence (samples known already go in
      `request.seqs`).
    - grew(pairs, done): after a step or a drain, the (request, sequence) of every sample that grew, in order, and
      those requests whose samples have all finished (a dict as an ordered set; `ended` follows for each).
    - ended(request, aborted) -> answer: the request is over and forgotten; `abort` returns the answer.
    - refused(request, error): a held request could not be admitted at `unpause`, or a step failed while it
      ran; it is forgotten.
    - idle(waiter, error=None): answer a "wait" pause: nothing is in flight; or, with `error`, the pause was
      lifted (unpause) before that.
    """

    def __init__(self, engine: Engine, check: Callable, start: Callable, grew: Callable, ended: Callable,
                 refused: Callable, idle: Callable):
        self.engine = engine
        self.check, self.start, self.grew = check, start, grew
        self.ended, self.refused, self.idle = ended, refused, idle
        self.requests: dict[Hashable, ControlledRequest] = {}  # submitted and not over, by key (held ones too)
        self.by_engine_id: dict[int, ControlledRequest] = {}   # admitted, by the loop's int request id
        self.held: list[ControlledRequest] = []                # submitted while paused
        self.mode: str | None = None                           # the pause mode, None when not paused
        self.idle_waiters: list = []                           # "wait" pauses to answer when nothing is in flight
        self.broken_by_update = False                          # an update failed part-way; no whole one since

    # ------------------------------------------------------------------ steps

    def stepping(self) -> bool:
        """Whether a step is due: work left and not paused (a "wait" pause lets it run out). Asleep, or with
        discarded weights, queued requests (retracted ones too) wait for wake / an update; after an update that
        failed part-way, see _end_stranded."""
        engine = self.engine
        return (self.mode in (None, "wait") and engine.loop.has_work() and not engine.is_sleeping
                and not engine.weight_store.stale)

    def step(self) -> None:
        """One generation step; its samples go to their requests."""
        self._collect(self._guarded(self.engine.loop.step))
        self.answer_idle_waiters()

    def drain(self) -> None:
        """Collect the step in flight: afterwards nothing runs until the next `step`."""
        self._collect(self._guarded(self.engine.loop.drain))

    def _guarded(self, run: Callable[[], list[Sequence]]) -> list[Sequence]:
        """`run`'s sequences. If it raises, the engine's loop aborts everything it runs (as Engine.generate does:
        nothing half-run survives into a later step) and every admitted request ends with an EngineError naming
        the cause, through `refused`; held requests and later ones go on. EngineDeadError (the engine cannot run
        any more) goes to the owner, which stops as before."""
        try:
            return run()
        except EngineDeadError:  # a tensor-parallel worker is gone: no later step can run, so the owner stops
            raise
        except Exception as err:  # noqa: BLE001 - its requests' callers learn of it, the engine goes on
            error = EngineError(f"a generation step failed ({type(err).__name__}: {err}); every request in "
                                f"flight ended with this error, and the engine takes new ones")
            error.__cause__ = err
            self._end_admitted(error)
            return []

    def _end_admitted(self, error: Exception) -> None:
        """The engine's loop aborts everything it runs, and every admitted request ends with `error` (`refused`)."""
        self.engine.loop.abort_all()
        for request in [request for request in self.requests.values() if request.first is not None]:
            self._forget(request)
            self.refused(request, error)

    def _end_stranded(self) -> None:
        """Admitted requests cannot run on weights an update left incomplete (it failed after its first copy).
        Unless a pause holds them for a whole update ("keep", "retract"), they end now with WeightsNotReadyError
        instead of waiting for an update nobody may send. Weights a level-2 sleep discarded are not such: the
        requests it retracted wait for the update that brings them back."""
        if self.mode in ("keep", "retract") or not self.broken_by_update:
            return
        try:
            self.engine.weight_store.check_ready()
        except WeightsNotReadyError as err:
            self._end_admitted(WeightsNotReadyError(f"{err}. The requests in flight cannot go on: they ended "
                                                    "with this error; submit them again after a complete update"))
        self.answer_idle_waiters()

    def _collect(self, grown: list[Sequence]) -> None:
        pairs = []
        for seq in grown:
            request = self.by_engine_id.get(seq.request_id)
            if request is not None:
                request.seqs[seq.index] = seq
                pairs.append((request, seq))
        done = {request: None for request, _ in pairs if all_finished(request)}  # an ordered set
        self.grew(pairs, done)
        for request in done:
            self._end(request, aborted=False)

    def answer_idle_waiters(self) -> None:
        if self.idle_waiters and not self.engine.loop.has_work():
            waiters, self.idle_waiters = self.idle_waiters, []
            for waiter in waiters:
                self.idle(waiter)

    # ------------------------------------------------------------------ requests

    def __contains__(self, key) -> bool:
        return key in self.requests

    def submit(self, request: ControlledRequest) -> None:
        """Admit the request, or hold it while paused; its key must not be in flight (the owner's check)."""
        if self.mode is not None:
            self.check(request)  # bad input is refused now, not at unpause
            self.held.append(request)
        else:
            self._admit(request)
        self.requests[request.key] = request
        self._end_if_done(request)

    def _admit(self, request: ControlledRequest) -> None:
        self.check(request)
        if self.engine.is_sleeping:
            raise EngineAsleepError("the engine is asleep; wake() before generating")
        self.engine.weight_store.check_ready()
        request.first = self.start(request)
        self.by_engine_id[request.first.request_id] = request

    def _end_if_done(self, request: ControlledRequest) -> None:
        """A request admitted with no sample left to run (a resumed one) is over now: no step will deliver it."""
        if all_finished(request):
            self._end(request, aborted=False)

    def abort(self, key):
        """End request `key` now: `ended`'s answer, or None if it is unknown or finished in the step that was in
        flight (that step is collected first)."""
        request = self.requests.get(key)
        if request is None:
            return None
        self.drain()
        if key not in self.requests:
            return None
        for seq in list(request.seqs.values()) or ([request.first] if request.first is not None else []):
            if seq.finish_reason is None:
                self.engine.scheduler.finish(seq, "abort")
        if request.first is not None and request.first.index not in request.seqs:
            request.seqs[request.first.index] = request.first
        return self._end(request, aborted=True)

    def abandon(self, request: ControlledRequest):
        """abort(request.key) if `request` is the one in flight under its key: its caller is gone, and its
        submit may have been refused (the key then belonging to another request)."""
        return self.abort(request.key) if self.requests.get(request.key) is request else None

    def _end(self, request: ControlledRequest, aborted: bool):
        self._forget(request)
        return self.ended(request, aborted)

    def _forget(self, request: ControlledRequest) -> None:
        self.requests.pop(request.key, None)
        if request.first is not None:
            self.by_engine_id.pop(request.first.request_id, None)
        if request in self.held:
            self.held.remove(request)

    def forget_all(self) -> tuple[list[ControlledRequest], list]:
        """Forget every request (held ones too) and "wait" pause without a word to anyone: (requests, waiters),
        for the owner to fail."""
        requests, waiters = list(self.requests.values()), self.idle_waiters
        self.requests, self.by_engine_id, self.held, self.idle_waiters = {}, {}, [], []
        return requests, waiters

    # ------------------------------------------------------------------ pause, continue, between steps

    def pause(self, mode: str, waiter, lift_waits: bool = True) -> bool:
        """Pause in `mode` after the step in flight; whether the pause is answered now (False: a "wait" pause
        with work in flight, answered by `idle(waiter)` once none is left). A caller's "keep" or "retract" pause
        (`lift_waits`) answers an earlier "wait" still waiting; a pause of the engine's own (a sleep's, which
        puts the caller's mode back after the wake) does not."""
        check_pause_mode(mode)
        self.drain()
        self.mode = mode
        if mode == "abort":
            for key in list(self.requests):
                self.abort(key)
        elif mode == "retract":
            self.engine.scheduler.retract_all()
        if lift_waits and mode in ("keep", "retract"):  # an earlier "wait" waits for requests now held
            self._lift_waits(f"pause_generation('{mode}') holds the requests this 'wait' pause waited for; they "
                             f"go on after continue_generation, and the engine stays paused")
        if mode == "wait" and self.engine.loop.has_work():
            self.idle_waiters.append(waiter)
            return False
        return True

    def unpause(self) -> None:
        """Continue generating: the requests held by the pause are admitted (or refused). A "wait" pause still
        waiting for its requests to finish is answered with an EngineError: it is over, and the engine not paused.
        With incomplete weights the admitted requests end (_end_stranded)."""
        self.mode = None
        self._end_stranded()
        self._lift_waits("continue_generation lifted this 'wait' pause before the requests in flight finished; "
                         "generation goes on")
        held, self.held = self.held, []
        for request in held:
            try:
                self._admit(request)
            except Exception as err:  # noqa: BLE001 - e.g. the engine is asleep: the caller learns why
                self._forget(request)
                self.refused(request, err)
            else:
                self._end_if_done(request)

    def _lift_waits(self, why: str) -> None:
        """Answer every "wait" pause still waiting with an EngineError saying `why`: what it waits for changed."""
        waiters, self.idle_waiters = self.idle_waiters, []
        for waiter in waiters:
            self.idle(waiter, error=EngineError(why))

    def sleep(self, level, tags) -> None:
        self.drain()
        running = self.engine.scheduler.running
        if running:
            raise EngineError(f"{len(running)} sequences hold KV; pause_generation('abort') "
                              "or pause_generation('retract') before sleep")
        self.engine.sleep(level, tags)

    def between_steps(self, method, *args):
        """Call `method(*args)` with nothing in flight. If it raises (an update that failed part-way), requests no
        pause holds and the weights no longer serve end (_end_stranded)."""
        self.drain()
        stale = len(self.engine.weight_store.stale)
        try:
            result = method(*args)
        except BaseException:
            if len(self.engine.weight_store.stale) > stale:  # it left serving weights incomplete
                self.broken_by_update = True
            self._end_stranded()
            raise
        self.broken_by_update = self.broken_by_update and bool(self.engine.weight_store.stale)
        return result
