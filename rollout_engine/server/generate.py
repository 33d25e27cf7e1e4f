"""One HTTP generation request run on the engine (EngineClient): its engine requests, its answer, its stream.

A request with several prompts (completions) is one engine request per prompt. The client's disconnect aborts
them: a watcher task waits on the ASGI `receive` channel (`http.disconnect`), for a stream or a whole answer. Time
to first token ends at the first token's arrival from the engine process (metrics["first_token_time"]).

Streams are coalesced: a pump task per engine request keeps only its latest cumulative snapshot, and the
writer turns whatever arrived since its last write into one chunk per choice. When the HTTP side keeps up,
that is a chunk per engine step; when it falls behind, chunks carry several tokens and the engine is never
held back by the socket (it runs in its own process anyway).
"""
from __future__ import annotations

import asyncio
import json
import time

from ..errors import EngineError
from ..reasoning import ReasoningStream
from .chat_reply import StreamedReply, prompt_opens, whole_message
from .detokenize import IncrementalDetokenizer, text_offsets
from .generation_state import ChoiceState, EngineRun, Plan
from .logprob_fields import chat_logprobs, completion_logprobs, prompt_fields, prompt_logprobs_field, with_prompt
from .protocol import error_body, usage

_BACKGROUND: set[asyncio.Task] = set()  # fire-and-forget aborts, kept alive until done


def _dumps(obj, allow_nan: bool = True) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=allow_nan)


class Generation:
    def __init__(self, engine, plan: Plan, tokenizer, metrics, active: dict):
        self.engine, self.plan, self.tokenizer, self.metrics, self.active = engine, plan, tokenizer, metrics, active
        many = len(plan.prompts) > 1
        self.offsets = not plan.chat and plan.logprobs is not None  # completions logprobs carry text_offset
        self.runs = []
        for i, ((text, ids), params) in enumerate(zip(plan.prompts, plan.params)):
            hold = max(map(len, params.stop), default=1) - 1
            opens = prompt_opens(plan.reasoning_parser, tokenizer, ids)
            choices = [ChoiceState(IncrementalDetokenizer(tokenizer, hold, self.offsets), reply=self._reply(opens))
                       for _ in range(params.n)]
            self.runs.append(EngineRun(f"{plan.http_id}-{i}" if many else plan.http_id, text, ids, params, i * params.n,
                                  choices, opens=opens))
        self.first_token_at: float | None = None
        self._claimed: list[str] | None = None  # the engine ids claim() reserved under the HTTP id
        self._aborting = 0  # abort_soon tasks not yet done: they release the ids once the engine has let them go
        self._head: str | None = None
        self._run_ended = asyncio.Event()  # a run has ended (its stream's last chunk is not held back)
        self.status = "200"

    def _reply(self, opens: bool) -> StreamedReply | None:
        plan = self.plan
        if plan.tool_parser is None and plan.reasoning_parser is None:
            return None
        reasoning = ReasoningStream(plan.reasoning_parser, opens) if plan.reasoning_parser is not None else None
        return StreamedReply(plan.tool_parser, reasoning)

    # ------------------------------------------------------------------ bookkeeping

    def claim(self) -> None:
        """Reserve this request's HTTP id and engine ids in `active` (the app's table of what is in flight), or
        refuse ids in use by another request. Checked and reserved with no await between, so of two racing
        twins one is refused here, before either reaches the engine: aborting or ending a request only ever
        touches the ids it reserved."""
        engine_ids = [r.engine_id for r in self.runs]
        in_use = set(self.active).union(*self.active.values())
        clash = sorted(in_use & {self.plan.http_id, *engine_ids})
        if clash:
            raise ValueError(f"request_id={self.plan.http_id!r} is already in flight (in use: {clash}); ids must "
                             "be unique")
        self._claimed = self.active[self.plan.http_id] = engine_ids

    def release(self) -> None:
        """Give back what claim() reserved (idempotent; a stream whose body never ran releases here too), but not
        while abort_soon runs: its task releases once the engine let the ids go (a retry under the same id would
        otherwise pass claim() and reach the engine before the abort, which refuses it mid-stream)."""
        if not self._aborting and self._claimed is not None and self.active.get(self.plan.http_id) is self._claimed:
            self.active.pop(self.plan.http_id, None)

    def _start(self) -> None:
        self.metrics.requests_in_flight.inc()
        self.metrics.prompt_tokens.inc(sum(len(r.prompt) for r in self.runs))

    def _end(self) -> None:
        self.release()
        self.metrics.requests_in_flight.dec()
        self.metrics.requests.labels("chat" if self.plan.chat else "completions", self.status).inc()
        self.metrics.latency.observe(time.perf_counter() - self.plan.arrived)

    def _tokens_out(self, count: int, first_token_time: float | None) -> None:  # None: the first came now
        if count:
            self.metrics.generation_tokens.inc(count)
            if self.first_token_at is None:
                self.first_token_at = first_token_time or time.perf_counter()
                self.metrics.ttft.observe(self.first_token_at - self.plan.arrived)

    def _ended(self, run: EngineRun, c) -> None:
        """Count a sample's finish once (a stream cancelled by its client's disconnect ends in abort_soon)."""
        state = run.choices[c.index]
        if not state.finished:
            state.finished = True
            self.metrics.finished.labels(c.finish_reason or "abort").inc()

    def abort_soon(self) -> None:
        """Abort every engine request of this one, from a task of its own (safe inside cancellation)."""
        async def abort():
            try:
                for run in self.runs:
                    try:
                        out = await self.engine.abort(run.engine_id)
                    except EngineError:
                        continue
                    for c in out.outputs if out is not None else []:
                        self._ended(run, c)
            finally:
                self._aborting -= 1
                self.release()
        self._aborting += 1
        task = asyncio.get_running_loop().create_task(abort())
        _BACKGROUND.add(task)
        task.add_done_callback(_BACKGROUND.discard)

    async def _watch(self, receive) -> None:
        """Wait for the client to go away, then abort."""
        while (await receive())["type"] != "http.disconnect":
            pass
        self.status = "disconnected"
        self.abort_soon()

    # ------------------------------------------------------------------ a whole answer

    async def complete(self, receive, answering=None) -> bytes:
        """The whole answer, JSON-encoded. It is built and encoded on `answering` (an executor; None: asyncio's
        default): a scoring request's answer (thousands of prompt tokens, each with its alternatives) takes
        seconds to build, which on the event loop would hold every stream and /health."""
        outs = await self._outputs(receive)
        if self.status == "disconnected":  # nobody to answer: its samples' ends are counted, nothing is built
            for run, c in ((run, c) for run, out in zip(self.runs, outs) for c in out.outputs):
                self._ended(run, c)
            return b""
        return await asyncio.get_running_loop().run_in_executor(answering, self._answer, outs)

    async def _outputs(self, receive) -> list:
        self._start()
        watcher = asyncio.create_task(self._watch(receive))
        tasks = [asyncio.create_task(self.engine.generate(r.prompt, r.params, request_id=r.engine_id))
                 for r in self.runs]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            if any(t.exception() is not None for t in done):
                self.status = "error"
                self.abort_soon()
                await asyncio.wait(tasks)
                raise next(t.exception() for t in tasks if t.exception() is not None)
            outs = [t.result() for t in tasks]
        finally:
            watcher.cancel()
            self._end()
        return outs

    def _answer(self, outs) -> bytes:
        choices, completion_tokens, plan = [], 0, self.plan
        for run, out in zip(self.runs, outs):
            prompt = None if plan.chat else prompt_fields(plan, self.tokenizer, run, out)  # alike for each choice
            for c in out.outputs:
                ids, text = ([], "") if plan.echo_only else (c.token_ids, (c.text or "") + self._kept_stop(c))
                offsets = text_offsets(self.tokenizer, ids) if self.offsets else None
                choice = self._choice(run, c, ids, text, "length" if plan.echo_only else c.finish_reason, whole=True,
                                      offsets=offsets)
                choices.append(choice if plan.chat else with_prompt(choice, prompt))
                completion_tokens += len(ids)
                self._ended(run, c)
        times = [out.metrics["first_token_time"] for out in outs if "first_token_time" in out.metrics]
        self._tokens_out(completion_tokens, min(times, default=None))
        body = {"id": self.plan.http_id, "object": "chat.completion" if self.plan.chat else "text_completion",
                "created": self.plan.created, "model": self.plan.model, "choices": choices,
                "usage": usage(sum(len(r.prompt) for r in self.runs), completion_tokens),
                "weight_version": outs[-1].weight_version}
        if plan.chat and plan.return_ids:
            body["prompt_token_ids"] = self.runs[0].prompt
        if plan.chat and self.runs[0].params.prompt_logprobs is not None:  # vLLM's place for them in chat
            body["prompt_logprobs"] = prompt_logprobs_field(self.tokenizer, outs[0].prompt_logprobs,
                                                            self.runs[0].params.prompt_logprobs)
        return _dumps(body, allow_nan=False).encode()  # a whole answer never carries NaN (JSONResponse's rule)

    def _kept_stop(self, c) -> str:
        """What stopped choice `c` where the request keeps it (else ""): its stop string or stop token's text."""
        if not (self.plan.include_stop_str and c.finish_reason == "stop"):
            return ""
        stop = getattr(c, "stop_reason", None)
        if isinstance(stop, str) or c.text is None:  # no tokenizer, no text
            return stop if isinstance(stop, str) else ""
        whole = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
        return whole[len(c.text):] if whole.startswith(c.text) else ""

    def _cut_stop(self, c):
        """The stop string the engine cut from choice `c`'s text (None: none, or the request keeps it)."""
        return None if self.plan.include_stop_str or c.finish_reason != "stop" else getattr(c, "stop_reason", None)

    def _choice(self, run: EngineRun, c, ids, text: str, finish_reason, whole: bool, first: bool = False,
                offsets: list[int] | None = None) -> dict:
        """One choice (whole) or one chunk's choice (a delta of `ids` and `text` from token `start` on);
        `offsets`: where each of the tokens' text starts (completions logprobs)."""
        state = run.choices[c.index]
        start = 0 if whole else state.sent
        plan, choice = self.plan, {"index": run.first_index + c.index}
        logprobs = None
        if plan.logprobs is not None and c.logprobs is not None:
            lps = c.logprobs[start : start + len(ids)]
            tops = getattr(c, "top_logprobs", None)
            tops = tops[start : start + len(ids)] if tops else None
            logprobs = (chat_logprobs(self.tokenizer, ids, lps, tops, plan.logprobs) if plan.chat else
                        completion_logprobs(self.tokenizer, ids, lps, tops, plan.logprobs, offsets))
        if plan.chat and whole and (plan.tool_parser is not None or plan.reasoning_parser is not None):
            choice["message"], finish_reason = whole_message(plan.tool_parser, plan.reasoning_parser, text,
                                                             finish_reason, run.opens, self._cut_stop(c))
        elif plan.chat:
            choice |= {"message": {"role": "assistant", "content": text}} if whole else {"delta": {"content": text}}
        else:
            choice["text"] = text
        # the engine's reason (a tool call's too; not an echo's that generated nothing, which reads "length")
        ended = finish_reason not in (None, "length") and c.finish_reason == "stop"
        choice |= {"logprobs": logprobs, "finish_reason": finish_reason,  # vLLM's stop_reason: the string or token
                   "stop_reason": getattr(c, "stop_reason", None) if ended else None}
        if plan.return_ids:
            choice |= {"token_ids": list(ids), "weight_versions": c.weight_versions[start : start + len(ids)]}
            if not plan.chat and (whole or first):
                choice["prompt_token_ids"] = run.prompt
        return choice

    # ------------------------------------------------------------------ a stream

    async def _pump(self, run: EngineRun, changed: asyncio.Event) -> None:
        try:
            async for out in self.engine.stream(run.prompt, run.params, request_id=run.engine_id):
                run.latest = out
                changed.set()
            run.done = True
        except Exception as err:  # noqa: BLE001 - the writer reports it to the client
            run.error = err
        finally:
            changed.set()
            self._run_ended.set()

    def _chunk(self, choices: list[dict], **extra) -> str:
        if self._head is None:  # every chunk's fixed fields, encoded once
            head = {"id": self.plan.http_id, "object": "chat.completion.chunk" if self.plan.chat else "text_completion",
                    "created": self.plan.created, "model": self.plan.model}
            self._head = "data: " + _dumps(head)[:-1] + ',"choices":'
        tail = "".join(f",{_dumps(k)}:{_dumps(v)}" for k, v in extra.items())
        return f"{self._head}{_dumps(choices)}{tail}}}\n\n"

    def _deltas(self, run: EngineRun) -> list[dict]:
        """Choice deltas of whatever `run` produced since the last call."""
        out, final = run.latest, run.done
        if out is None or out is run.taken:
            return []
        run.taken, deltas, count = out, [], 0
        for c in out.outputs:
            state = run.choices[c.index]
            if state.finished:
                continue
            # a sample that ended has its final text (cut at its stop string) in every snapshot: its choice ends
            # now, not when the request's slowest sample does
            ends = final or c.finish_reason is not None
            new = c.token_ids[state.pushed :]
            text = state.detok.finish(c.text, new) + self._kept_stop(c) if ends else state.detok.push(new)
            state.pushed = len(c.token_ids)
            # a pending token's text_offset can still move (bytes that a later token shows never form a
            # character), so with offsets a token goes out once its text is stable
            ready = state.detok.read if self.offsets and not ends else len(c.token_ids)
            ids = c.token_ids[state.sent : ready]
            if not ids and not text and not ends:
                continue
            offsets = state.detok.offsets[state.sent : ready] if self.offsets else None
            finish_reason, fields = (c.finish_reason if ends else None), None
            if state.reply is not None and ends:  # the calls (or the held text) go in the last delta
                fields, finish_reason = state.reply.finish(text, finish_reason, self._cut_stop(c))
            elif state.reply is not None:
                fields = state.reply.push(text)
            deltas.append(self._choice(run, c, ids, text, finish_reason, whole=False, first=state.sent == 0,
                                       offsets=offsets))
            if fields is not None:
                deltas[-1]["delta"] = fields
            count += len(new)
            state.sent = ready
            if ends:
                self._ended(run, c)
        self._tokens_out(count, out.metrics.get("first_token_time"))
        return deltas

    async def _quiet(self, interval: float) -> None:
        """Let `interval` seconds pass unless a run ends first (its last chunk goes out at once)."""
        try:
            await asyncio.wait_for(self._run_ended.wait(), interval)
            self._run_ended.clear()  # that end goes out now; the runs still streaming are paced again
        except asyncio.TimeoutError:
            pass

    async def events(self, receive, interval: float = 0.0):
        """The server-sent events of a stream, `data: [DONE]` last; at most one chunk per `interval` seconds
        (the tokens in between come together; the first token and the end are never held)."""
        changed = asyncio.Event()
        self._start()
        pumps = [asyncio.create_task(self._pump(run, changed)) for run in self.runs]
        watcher = asyncio.create_task(self._watch(receive))
        finished = False
        try:
            if self.plan.chat:
                ids = {"token_ids": [], "weight_versions": []} if self.plan.return_ids else {}
                extra = {"prompt_token_ids": self.runs[0].prompt} if self.plan.return_ids else {}
                role = {"delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None,
                        "stop_reason": None, **ids}
                yield "".join(self._chunk([{"index": i, **role}], **extra) for i in range(self.runs[0].params.n))
            while True:
                await changed.wait()
                changed.clear()
                failed = next((r.error for r in self.runs if r.error is not None), None)
                if failed is not None:
                    self.status = "error"
                    kind = "invalid_request_error" if isinstance(failed, ValueError) else "service_unavailable"
                    yield f"data: {_dumps(error_body(str(failed), kind))}\n\n"
                    break
                try:
                    deltas = [d for run in self.runs for d in self._deltas(run)]
                except Exception as err:  # noqa: BLE001 - e.g. the detokenizer's RuntimeError (the final text
                    # does not begin with what was streamed): an error event and [DONE], not a broken connection
                    self.status = "error"
                    yield f"data: {_dumps(error_body(f'{type(err).__name__}: {err}', 'server_error'))}\n\n"
                    break
                if deltas:  # a chunk per choice, as vLLM and OpenAI send them: a client may read choices[0] only
                    yield "".join(self._chunk([delta]) for delta in deltas)
                if all(r.done for r in self.runs):
                    finished = True
                    break
                if interval and deltas:
                    await self._quiet(interval)
            if finished and self.plan.include_usage:
                done = sum(s.sent for r in self.runs for s in r.choices)
                yield self._chunk([], usage=usage(sum(len(r.prompt) for r in self.runs), done))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            if not finished:
                self.abort_soon()
                for pump in pumps:
                    pump.cancel()
            self._end()
