"""EngineClient: the HTTP front's handle on the engine process (engine_process.py), with AsyncEngine's calls.

The front starts the engine process, waits until its model is loaded (a failure there is raised here with the
engine's own message), and talks to it through an EngineLink (engine_link.py: the process and its two sockets).
Prompts are validated and tokenized here, so bad input is refused before it crosses; the engine validates again
(it trusts no message). Detokenization stays here too.

A reader task on the caller's event loop takes each "tokens" message (one per engine step) and extends its
requests' samples; a stream wakes once per message at most, and if it fell behind, its next snapshot carries
every token since. If the engine process dies, the reader fails every pending call with EngineError within
DEATH_CHECK_MS, and every later call raises it at once. One event loop at a time uses a client.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import asdict
from pathlib import Path

import zmq
import zmq.asyncio

from ..request_control import check_pause_mode, check_request_id, request_id_of
from ..chat import render_chat
from ..cli_args import check_switch_interval_s
from ..errors import EngineError
from ..inputs import load_tokenizer, normalise
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .engine_link import EngineLink
from .request_records import RequestRecord, SampleRecord, add_prompt_scores, extend_samples
from .wire import error_from, unpack

DEATH_CHECK_MS = 250       # how often the reader, with nothing to read, checks that the engine process lives


class EngineClient:
    def __init__(self, model_path, *, startup_timeout_s: float = 900.0, switch_interval_s: float | None = None,
                 weight_receiver: bool = False, **engine_kwargs):
        """Start the engine process for `model_path` (Engine's keyword arguments, JSON values) and wait, up to
        `startup_timeout_s`, until it serves; its start-up error (a bad path, no room) is raised here.
        `weight_receiver`: the engine takes updates from a WeightSender at `weight_endpoint` (weight_inbox.py)."""
        if not isinstance(weight_receiver, bool):
            raise ValueError(f"weight_receiver={weight_receiver!r} is not allowed; True or False")
        check_switch_interval_s(switch_interval_s)
        try:
            json.dumps(engine_kwargs)
        except TypeError as err:
            raise ValueError(f"engine_kwargs must be JSON values (they cross to the engine process): {err}") from None
        self._link = EngineLink({"model": str(model_path), "engine_kwargs": engine_kwargs,
                                 "switch_interval_s": switch_interval_s}, weight_receiver)
        self.command_endpoint, self.weight_endpoint = self._link.command_endpoint, self._link.weight_endpoint
        self._error: BaseException | None = None
        self._records: dict[int, RequestRecord] = {}
        self._keys: dict[str, int] = {}  # caller's request id -> key
        self._replies: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None
        try:
            info = self._link.wait_ready(startup_timeout_s)
            self.tokenizer = load_tokenizer(Path(info["model_path"]))
        except BaseException:
            self.shutdown()
            raise
        self.vocab_size, self.max_seq_len, self.model_path = info["vocab_size"], info["max_seq_len"], info["model_path"]
        self._status: dict = info["status"]

    # ------------------------------------------------------------------ state

    @property
    def is_running(self) -> bool:
        """Whether the engine process lives and serves."""
        return self._error is None and self._link.exit_code() is None

    def _current(self) -> dict:
        """The engine's status with what it has sent since: a pushed update's "status" message comes unasked,
        maybe before any call has started the reader (on the caller's event loop only: one loop uses a client)."""
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return self._status
        if self._error is None and not self._link.closed:
            self._dispatch_waiting()
        return self._status

    @property
    def status(self) -> dict:
        """One state of the engine, read at once (each property below reads the engine's latest, which a status
        message arriving between two reads changes): sleeping, weights_asleep, kv_cache_asleep, weight_version,
        weights_ready."""
        return dict(self._current())

    @property
    def weight_version(self) -> int:
        return self._current()["weight_version"]

    @property
    def is_sleeping(self) -> bool:
        return self._current()["sleeping"]

    @property
    def weights_ready(self) -> bool:  # false after a level-2 sleep, until a complete update
        return self._current()["weights_ready"]

    @property
    def sleep_state(self) -> dict:
        status = self._current()
        return {key: status[key] for key in ("sleeping", "weights_asleep", "kv_cache_asleep")}

    def _check_running(self) -> None:
        if self._error is None and (code := self._link.exit_code()) is not None:
            self._fail(EngineError(f"the engine process exited with code {code}"))
        if self._error is not None:
            raise EngineError(f"the engine is not running: {self._error}") from self._error
        if self._reader is None or self._reader.done() or self._reader.get_loop() is not asyncio.get_running_loop():
            self._reader = asyncio.get_running_loop().create_task(self._read())

    # ------------------------------------------------------------------ what comes back

    async def _read(self) -> None:
        poller = zmq.asyncio.Socket.from_socket(self._link.outputs)
        try:
            while self._error is None:
                if await poller.poll(DEATH_CHECK_MS) and not self._dispatch_waiting():
                    return
                if (code := self._link.exit_code()) is not None:
                    self._fail(EngineError(f"the engine process exited with code {code}"))
        except zmq.ZMQError:
            if not self._link.closed:  # else shutdown() closed the socket under the poll: the reader's end
                raise
        self._fail(self._error or EngineError("the engine was shut down"))  # shut down: what waits hears it

    def _dispatch_waiting(self) -> bool:
        """Dispatch every message waiting; False once a malformed one (the engine's bug) has stopped the engine."""
        while (frames := self._link.received()) is not None:
            try:
                self._dispatch(*unpack(frames))
            except (ValueError, KeyError, TypeError, IndexError) as err:
                self._fail(EngineError(f"the engine process sent a malformed message: {err!r}"))
                self._link.proc.kill()
                return False
        return True

    def _dispatch(self, header: dict, columns: dict) -> None:
        kind = header["kind"]
        if kind == "tokens":
            self._tokens(header, columns)
        elif kind == "prompt_scores":
            add_prompt_scores(self._records, header, columns)
        elif kind == "reply":
            self._status = header["status"]
            future = self._replies.pop(header["id"], None)
            if future is not None and not future.done():
                if "error" in header:
                    future.set_exception(error_from(header["error"]))
                else:
                    future.set_result(header["result"])
        elif kind == "status":  # after a pushed weight update
            self._status = header["status"]
        elif kind == "failed":
            record = self._records.get(header["key"])
            if record is not None:
                self._forget(record)
                record.end(error=error_from(header["error"]))
        elif kind == "fatal":
            self._fail(error_from(header["error"]))
        else:
            raise ValueError(f"unknown message kind {kind!r}")

    def _tokens(self, header: dict, columns: dict) -> None:
        self._status["weight_version"] = header["weight_version"]
        for record in extend_samples(self._records, header, columns).values():
            if all(s.finish_reason is not None for s in record.samples):
                self._forget(record)
                record.end(output=record.output(self.tokenizer, self._status["weight_version"], final=True))
            elif record.changed is not None:
                record.changed.set()

    def _forget(self, record: RequestRecord) -> None:
        self._records.pop(record.key, None)
        self._keys.pop(record.request_id, None)

    def _fail(self, error: BaseException) -> None:
        """The engine is gone: every pending call and request fails with `error`, and every later call too."""
        self._error = error
        for record in list(self._records.values()):
            self._forget(record)
            record.end(error=error)
        for future in self._replies.values():
            if not future.done():
                future.set_exception(error)
        self._replies = {}

    # ------------------------------------------------------------------ requests

    def _submit(self, prompt, params, request_id, streaming: bool) -> RequestRecord:
        self._check_running()
        rid = request_id_of(request_id)
        if rid in self._keys:
            raise ValueError(f"request_id={rid!r} is already in flight; ids must be unique")
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise ValueError("params must be a SamplingParams (one prompt per call)")
        [(text, ids)], [params] = normalise([prompt], params, self.tokenizer, self.vocab_size, self.max_seq_len)
        key = next(self._ids)
        loop = asyncio.get_running_loop()
        record = RequestRecord(key, rid, text, ids, params, loop.create_future(),
                               asyncio.Event() if streaming else None, [SampleRecord() for _ in range(params.n)])
        self._link.send({"kind": "submit", "key": key, "prompt_token_ids": ids, "params": asdict(params)})
        self._records[key], self._keys[rid] = record, key
        return record

    async def generate(self, prompt, params=None, request_id: str | None = None) -> RequestOutput:
        """AsyncEngine.generate: `params.n` completions of one prompt; a cancelled caller aborts its request."""
        record = self._submit(prompt, params, request_id, streaming=False)
        try:
            return await asyncio.shield(record.done)
        except asyncio.CancelledError:
            self._abort_quietly(record)
            raise

    async def chat(self, conversation, params=None, request_id: str | None = None, tools=None,
                   chat_template_kwargs=None) -> RequestOutput:
        """generate() for one conversation, rendered by the checkpoint's chat template straight to token ids."""
        ids = render_chat(self.tokenizer, conversation, tools, chat_template_kwargs, max_seq_len=self.max_seq_len)
        return await self.generate({"prompt_token_ids": ids}, params, request_id)

    async def stream(self, prompt, params=None, request_id: str | None = None):
        """Cumulative RequestOutput snapshots as tokens arrive (text None); the last is what generate() returns."""
        record = self._submit(prompt, params, request_id, streaming=True)
        try:
            while True:
                await record.changed.wait()
                record.changed.clear()
                if record.error is not None:
                    raise record.error
                if record.done.done():
                    yield record.done.result()
                    return
                yield record.output(self.tokenizer, self._status["weight_version"], final=False)
        finally:
            self._abort_quietly(record)  # the consumer stopped early: nobody wants the rest

    def _abort_quietly(self, record: RequestRecord) -> None:
        if not record.done.done() and self._error is None:
            try:
                self._link.send({"kind": "abort", "key": record.key})
            except EngineError:
                pass  # the engine is gone: nothing left to abort

    async def _call(self, kind: str, **fields):
        self._check_running()
        reply = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._link.send({"kind": kind, "id": reply, **fields})
        self._replies[reply] = future
        return await future

    async def abort(self, request_id: str) -> RequestOutput | None:
        """End a request now: its partial output (finish_reason "abort"), or None if unknown or finished."""
        key = self._keys.get(check_request_id(request_id))
        record = self._records.get(key)
        if record is None or not await self._call("abort", key=key):
            return None
        return record.done.result()  # its "abort" finish came before the reply

    async def pause_generation(self, mode: str = "abort") -> None:
        check_pause_mode(mode)
        await self._call("pause", mode=mode)

    async def continue_generation(self) -> None:
        await self._call("continue")

    async def update_weights_from_disk(self, path, version: int | None = None, model: str = "target") -> int:
        return await self._call("update_weights_from_disk", path=str(path), version=version, model=model)

    async def sleep(self, level: int = 1, tags=None, mode: str | None = None) -> None:
        """AsyncEngine.sleep; with `mode` ("abort" or "retract") it pauses in that mode first, and a pause asked
        for by pause_generation is in force again afterwards ("retract": the requests resume after the wake)."""
        await self._call("sleep", level=level, tags=tags, mode=mode)

    async def wake(self, tags=None, allow_resize: bool = False) -> None:
        await self._call("wake", tags=tags, allow_resize=allow_resize)

    async def flush_cache(self) -> None:
        await self._call("flush_cache")

    async def stats(self) -> dict:
        """The engine's gauges: sequences running and waiting, KV blocks used and total; with its status."""
        return await self._call("stats") | self._status

    # ------------------------------------------------------------------ the end

    def shutdown(self, timeout_s: float = 15) -> None:
        """Stop the engine process (asked, then terminated, then killed) and remove the sockets' directory."""
        self._link.close(timeout_s)
        self._error = self._error or EngineError("the engine was shut down")

    def __enter__(self) -> "EngineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
