"""The engine process of `rollout-engine serve`: one Engine, driven a step at a time, commands in and tokens out
over ZeroMQ. The HTTP front (engine_client.py) lives in another process, so the SSE chunks it writes cost the
engine's steps nothing (the two share no interpreter lock).

Its loop: take every command that has arrived (submit, abort, pause, admin calls, stats), then run one step and
send one "tokens" message (wire.py) with the new tokens of every request that grew. With no work it waits on the
command socket. It leaves when told to, when its parent (the front) is gone, or when the engine is dead (a
tensor-parallel worker gone; after telling the front why). A step that raises anything else ends the requests in
flight with that error and the loop goes on (RequestControl._guarded). A malformed command is answered with an error if it carries a reply id, else logged and dropped:
it never stops the loop.

The requests in flight, the ones a pause holds and the pause modes are RequestControl's (request_control.py,
shared with AsyncEngine); this file speaks the wire format, validates raw JSON commands, and tracks what of each
sample went out. It also records which pause the caller asked for: a sleep given a `mode` pauses on its own
first, and afterwards (a "retract" sleep: after the wake) the caller's pause is in force again, not lifted.

With `serve --weight-receiver` it polls a WeightInbox (weight_inbox.py) beside its commands: a trainer's update
is served between two steps, and the front is sent the new status.

Started by the front (engine_link.py) through engine_main.main.
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass, field

import zmq

from ..engine import Engine
from ..inputs import normalise
from ..memory import parse_tags
from ..request_control import ControlledRequest, RequestControl, check_pause_mode
from ..sampling_params import SamplingParams
from .weight_inbox import WeightInbox
from .wire import PROMPT_ENTRIES, error_fields, pack, unpack

IDLE_POLL_MS = 500     # with no work, how long to wait for a command before checking on the parent
PARENT_CHECK_S = 1.0   # how often a busy loop checks that the front is still there
SEND_TIMEOUT_MS = 1000  # a send the front does not take in this long: check on it, then try again
_DEFERRED = object()   # a command whose reply comes later (pause "wait")
SLEEP_MODES = ("abort", "retract")  # how a sleep given a mode ends the requests in flight before it releases


@dataclass(eq=False, kw_only=True)
class SentRequest(ControlledRequest):
    """`key` is the front's id of the request."""
    sent: dict[int, int] = field(default_factory=dict)  # sample index -> tokens sent
    finished: set[int] = field(default_factory=set)     # sample indices whose finish went out
    prompt_sent: bool = False  # its prompt's scores went out (prompt_logprobs)


def check_sleep(level, tags, mode) -> None:
    """A sleep's arguments, checked before anything is paused (mode None: the sleep pauses nothing)."""
    if isinstance(level, bool) or level not in (1, 2):
        raise ValueError(f"level={level!r} is not allowed; 1 (offload weights to host) or 2 (discard them)")
    parse_tags(tags)
    if mode is not None and mode not in SLEEP_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; None, 'abort' (end requests in flight) or 'retract' "
                         "(keep their tokens, resume them after the wake)")


def _int(header: dict, name: str) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**63:  # keys travel as int64
        raise ValueError(f"{name}={value!r} is not allowed; an int in [0, 2**63)")
    return value


class EngineLoop:
    def __init__(self, engine: Engine, commands: zmq.Socket, outputs: zmq.Socket, parent: int | None = None,
                 socket_dir: str | None = None, inbox: WeightInbox | None = None):
        self.engine, self.commands, self.outputs, self.socket_dir = engine, commands, outputs, socket_dir
        self.inbox, self.poller = inbox, zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        if inbox is not None:  # each update tells the front's /health its status before the sender hears back
            self.poller.register(inbox.socket, zmq.POLLIN)
            inbox.announce = lambda: self._send({"kind": "status", "status": self.status()})
        # the front's pid, known before the model loaded: a front gone meanwhile (this process re-parented) is seen
        self.parent = os.getppid() if parent is None else parent
        self.control = RequestControl(engine, check=lambda request: None,  # `_validated` checked it whole
                                      start=lambda request: engine.loop.submit(request.ids, request.params),
                                      grew=self._send_tokens, ended=self._ended, refused=self._refused,
                                      idle=self._reply)  # a "wait" pause's waiter is its reply id
        self.asked_pause: str | None = None  # the mode of the caller's pause, None once continued
        self.held_for_wake = False  # a "retract" sleep holds its requests until the wake
        self.stopping = False
        self.checked_parent = time.monotonic()
        self.handlers = {"submit": self._submit, "abort": self._abort, "pause": self._pause,
                         "continue": self._continue, "sleep": self._sleep, "wake": self._wake,
                         "update_weights_from_disk": self._update_from_disk, "flush_cache": self._flush_cache,
                         "stats": self._stats, "shutdown": self._shutdown}

    # ------------------------------------------------------------------ the loop

    def serve(self) -> None:
        """Tell the front the engine is ready, then run; the front may have gone while the model loaded."""
        self._check_parent(at_once=True)
        engine = self.engine
        self._send({"kind": "ready", "info": {"vocab_size": engine.cfg.vocab_size,
                                              "max_seq_len": engine.scheduler.max_seq_len,
                                              "model_path": str(engine.config.model_path), "status": self.status()}})
        self.run()

    def run(self) -> None:
        try:
            while not self.stopping:
                self._take_commands(0 if self.control.stepping() else IDLE_POLL_MS)
                self.control.answer_idle_waiters()
                if self.control.stepping():
                    self.control.step()
                self._check_parent()
        except Exception as err:  # the front fails every request with this error, then sees the process exit
            self._send({"kind": "fatal", "error": error_fields(err)})
            raise

    def _check_parent(self, at_once: bool = False) -> None:
        now = time.monotonic()
        if at_once or now - self.checked_parent > PARENT_CHECK_S:
            self.checked_parent = now
            if os.getppid() != self.parent:  # the front would have removed the sockets' directory: we do
                if self.socket_dir is not None:
                    shutil.rmtree(self.socket_dir, ignore_errors=True)
                raise SystemExit("the server's front process is gone")

    def _send(self, header: dict, columns: dict | None = None) -> None:
        frames = pack(header, columns)
        while True:
            try:
                return self.outputs.send_multipart(frames)
            except zmq.Again:  # the front is not reading: it may be gone
                self._check_parent()

    def _take_commands(self, timeout_ms: int) -> None:
        ready = dict(self.poller.poll(timeout_ms))
        if self.inbox is not None and self.inbox.socket in ready:
            self.inbox.serve(self.control)
        if self.commands not in ready:
            return
        while True:
            try:
                frames = self.commands.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(frames)

    def _handle(self, frames: list[bytes]) -> None:
        try:
            header, _ = unpack(frames)
            handler = self.handlers.get(header["kind"])
            if handler is None:
                raise ValueError(f"unknown command kind {header['kind']!r}; one of {sorted(self.handlers)}")
        except Exception as err:  # noqa: BLE001 - whatever arrives, the loop goes on
            print(f"rollout-engine engine process: dropped a malformed command: {err!r}", file=sys.stderr)
            return
        reply = header.get("id")
        try:
            result = handler(header)
        except Exception as err:  # noqa: BLE001 - the caller's error, raised in the front
            if isinstance(reply, int):
                self._reply(reply, error=err)
            elif header["kind"] == "submit" and isinstance(header.get("key"), int):
                self._send({"kind": "failed", "key": header["key"], "error": error_fields(err)})
            else:
                print(f"rollout-engine engine process: command {header['kind']!r} failed: {err}", file=sys.stderr)
            return
        if isinstance(reply, int) and result is not _DEFERRED:
            self._reply(reply, result)

    def _reply(self, reply: int, result=None, error: BaseException | None = None) -> None:
        header = {"kind": "reply", "id": reply, "status": self.status()}
        header |= {"error": error_fields(error)} if error is not None else {"result": result}
        self._send(header)

    def status(self) -> dict:
        engine = self.engine
        return {"sleeping": engine.is_sleeping, "weights_asleep": engine.weight_store.asleep,
                "kv_cache_asleep": engine.kv.asleep, "weight_version": engine.weight_version,
                "weights_ready": not engine.weight_store.stale}

    # ------------------------------------------------------------------ tokens out (RequestControl's hooks)

    def _send_tokens(self, pairs: list[tuple], done: dict) -> None:
        """One message with every grown sample's new tokens (and the finish of those that ended)."""
        cols = {name: [] for name in ("keys", "indices", "counts", "token_ids", "logprobs", "weight_versions",
                                      "top_k", "top_ids", "top_logprobs")}
        finished = []
        for request, seq in pairs:
            start = request.sent.get(seq.index, 0)
            new = seq.token_ids[seq.num_prompt_tokens + start:]
            request.sent[seq.index] = start + len(new)
            for name, values in (("keys", [request.key]), ("indices", [seq.index]), ("counts", [len(new)]),
                                 ("token_ids", new), ("logprobs", seq.logprobs[start:]),
                                 ("weight_versions", seq.weight_versions[start:])):
                cols[name] += values
            k = request.params.logprobs or 0  # k alternatives per token (logprobs=k >= 1)
            cols["top_k"].append(k)
            for top in (seq.top_logprobs or [])[start : start + len(new)] if k else []:
                cols["top_ids"] += top.keys()
                cols["top_logprobs"] += top.values()
            self.send_prompt_scores(request, seq)
            if seq.finish_reason is not None:
                finished.append([request.key, seq.index, seq.finish_reason, seq.text, seq.stop_reason])
                request.finished.add(seq.index)
        if not any(cols["top_k"]):
            del cols["top_k"], cols["top_ids"], cols["top_logprobs"]
        if cols["keys"]:
            self._send({"kind": "tokens", "weight_version": self.engine.weight_version, "finished": finished}, cols)

    def send_prompt_scores(self, request: SentRequest, seq) -> None:
        """The prompt's scores, once, from the first sample to have them all, in "prompt_scores" messages ahead of
        the tokens message (wire.py)."""
        scores = seq.prompt_logprobs
        if request.prompt_sent or scores is None or len(scores) < seq.num_prompt_tokens:
            return
        request.prompt_sent = True
        positions = scores[1:]
        per_message = max(1, PROMPT_ENTRIES // (request.params.prompt_logprobs + 1))
        for first in range(0, max(len(positions), 1), per_message):  # a one-token prompt: one empty message
            part = positions[first : first + per_message]
            self._send({"kind": "prompt_scores", "key": request.key, "positions": len(positions)},
                       {"prompt_sizes": [len(entry) for entry in part], "prompt_ids": [t for e in part for t in e],
                        "prompt_logprobs": [v for e in part for v in e.values()]})

    def _ended(self, request: SentRequest, aborted: bool) -> bool:
        """A request that finished went out with its last tokens; an aborted one's samples not finished yet
        finish "abort" now (no new tokens)."""
        if aborted:
            finished = [[request.key, i, "abort", None, None] for i in range(request.params.n)
                        if i not in request.finished]
            self._send({"kind": "tokens", "weight_version": self.engine.weight_version, "finished": finished})
        return True

    def _refused(self, request: SentRequest, error: BaseException) -> None:
        """A request that a pause held could not be admitted (the engine is asleep), or a step failed while it ran:
        its caller learns why."""
        self._send({"kind": "failed", "key": request.key, "error": error_fields(error)})

    # ------------------------------------------------------------------ commands

    def _validated(self, header: dict) -> SentRequest:
        key, ids, fields = _int(header, "key"), header.get("prompt_token_ids"), header.get("params")
        if not isinstance(fields, dict):
            raise ValueError("params must be a JSON object of SamplingParams fields")
        engine = self.engine
        [(_, ids)], [params] = normalise([{"prompt_token_ids": ids}], SamplingParams(**fields), engine.tokenizer,
                                         engine.cfg.vocab_size, engine.scheduler.max_seq_len)
        if key in self.control:
            raise ValueError(f"key={key} is already in flight")
        return SentRequest(key, params, ids=ids)

    def _submit(self, header: dict) -> None:
        self.control.submit(self._validated(header))

    def _abort(self, header: dict) -> bool:
        return self.control.abort(_int(header, "key")) is not None

    def _pause(self, header: dict):
        mode = header.get("mode")
        check_pause_mode(mode)
        waiter = _int(header, "id") if mode == "wait" else None  # checked before anything changes
        self.asked_pause = mode
        return None if self.control.pause(mode, waiter) else _DEFERRED

    def _continue(self, header: dict) -> None:
        self.asked_pause = None
        self._resume()

    def _sleep(self, header: dict) -> None:
        level, tags, mode = header.get("level", 1), header.get("tags"), header.get("mode")
        check_sleep(level, tags, mode)
        if mode is None:  # the caller paused first, or has nothing in flight
            return self.control.sleep(level, tags)
        self.control.pause(mode, None, lift_waits=False)  # _resume puts the caller's pause back
        try:
            self.control.sleep(level, tags)
        finally:
            self.held_for_wake = self.engine.is_sleeping and (mode == "retract" or self.held_for_wake)
            self._resume()

    def _wake(self, header: dict) -> None:
        try:
            self.control.between_steps(self.engine.wake, header.get("tags"), header.get("allow_resize", False))
        finally:
            if self.held_for_wake and not self.engine.is_sleeping:
                self.held_for_wake = False
                self._resume()

    def _resume(self) -> None:
        """Leave in force the pause that should be: a "retract" sleep's until the wake, else the caller's; with
        neither, generate (the requests the pauses held are admitted)."""
        mode = "retract" if self.held_for_wake else self.asked_pause
        if mode is None:
            self.control.unpause()
        else:  # its action (an abort, a retraction) was done when it began: again, it would hit later requests
            self.control.mode = mode

    def _update_from_disk(self, header: dict) -> int:
        return self.control.between_steps(self.engine.update_weights_from_disk, header.get("path"),
                                          header.get("version"), header.get("model", "target"))

    def _flush_cache(self, header: dict) -> None:
        self.control.between_steps(self.engine.flush_cache)

    def _stats(self, header: dict) -> dict:
        scheduler, blocks = self.engine.scheduler, self.engine.block_manager
        return {"num_seqs_running": len(scheduler.running),
                "num_seqs_waiting": len(scheduler.waiting) + len(self.control.held),  # held by a pause too
                "kv_blocks_used": blocks.num_used, "kv_blocks_cached": blocks.num_cached,
                "kv_blocks_total": blocks.num_blocks}

    def _shutdown(self, header: dict) -> None:
        self.stopping = True
