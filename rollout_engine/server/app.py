"""The FastAPI application: OpenAI-compatible generation, admin endpoints, health and metrics, over an EngineClient
(the engine runs in a process of its own; engine_client.py).

Errors are OpenAI's shape, {"error": {"message", "type", ...}}: a ValueError (bad input; the Python API's own
message) is 400, an engine that cannot serve now (asleep, weights not ready, its loop stopped) is 503.
With an API key every path needs `Authorization: Bearer KEY` (401 otherwise), compared in constant time.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException

from ..chat import render_chat
from ..errors import EngineAsleepError, EngineError, WeightsNotReadyError
from ..inputs import normalise, prompt_ids
from ..sampling_params import is_finite_number
from . import protocol
from .engine_process import SLEEP_MODES, check_sleep
from .guards import ApiKey, BrowserGuard, check_api_key
from .generate import Generation, Plan
from .metrics import ServerMetrics
from .chat_reply import check_parsers, parser_for, reasoning_parser_for

MAX_BODY_BYTES = 64 << 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's; chat's default is whatever room the prompt leaves


class _Refused(Exception):
    def __init__(self, status: int, message: str, type_: str, code=None):
        super().__init__(message)
        self.status, self.type, self.code = status, type_, code


GENERATION_PATHS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}  # metrics' endpoint label


def create_app(engine, served_model_name: str | None = None, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, stream_interval: float = 0.0, loopback: bool = False,
               allowed_origins=(), tool_call_parser: str | None = None,
               reasoning_parser: str | None = None) -> FastAPI:
    """The server's app over `engine` (an EngineClient, which the caller owns and shuts down).

    Requests from web pages (an `Origin` header) are refused unless their origin is in `allowed_origins`;
    `loopback` (the server listens on loopback only) also refuses a `Host` that is not a loopback name.

    `stream_interval` (seconds): a stream sends at most one chunk per interval, with every token since the last
    (0: a chunk per engine step, coalesced only when the server falls behind). Fewer chunks cost this process
    less CPU; the engine's pace does not depend on it (it runs in its own process).

    `tool_call_parser` (a name of tool_call_parsers.PARSERS, or None, which refuses requests that offer `tools`
    unless their tool_choice is "none"): chat replies to requests that offer `tools` come back with their tool
    calls parsed. `reasoning_parser` ("qwen3", "deepseek_r1", or None): chat replies come back
    with what the model wrote between <think> and </think> as `reasoning` (server/chat_reply.py)."""
    if not is_finite_number(stream_interval) or stream_interval < 0:
        raise ValueError(f"stream_interval={stream_interval!r} is not allowed; a finite number of seconds >= 0")
    check_api_key(api_key)
    if served_model_name is not None and (not isinstance(served_model_name, str) or not served_model_name.strip()):
        raise ValueError(f"served_model_name={served_model_name!r} is not allowed; a name, or None (the model path)")
    tokenizer, vocab_size = engine.tokenizer, engine.vocab_size
    check_parsers(tool_call_parser, reasoning_parser, tokenizer)
    model_name = served_model_name or engine.model_path
    metrics = ServerMetrics()
    active: dict[str, list[str]] = {}  # HTTP request id -> its engine request ids
    started = int(time.time())
    app = FastAPI(title="rollout-engine", version="0.1.0")
    if api_key is not None:
        app.add_middleware(ApiKey, key=api_key)
    if allowed_origins:  # an allowed page's browser asks first (a preflight carries no key) and reads CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                           allow_headers=["*"])
    app.add_middleware(BrowserGuard, allowed_origins=frozenset(allowed_origins), loopback=loopback)  # outermost

    def counted(request: Request, response):
        """`response`, an error answer, counted in rollout_engine_http_requests by its status where it refuses a
        generation request that never started (one that did counts itself, Generation._end)."""
        endpoint = GENERATION_PATHS.get(request.url.path)
        if endpoint is not None and getattr(request.state, "generation", None) is None:
            metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @app.exception_handler(ValueError)
    async def bad_input(request, err: ValueError):
        return counted(request, protocol.error_response(400, str(err)))

    @app.exception_handler(EngineError)
    async def refused(request, err: EngineError):
        return counted(request, protocol.error_response(503, str(err), "service_unavailable"))

    @app.exception_handler(_Refused)
    async def refused_by_server(request, err: _Refused):
        return counted(request, protocol.error_response(err.status, str(err), err.type, err.code))

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        return counted(request, protocol.error_response(err.status_code, str(err.detail), "invalid_request_error"))

    @app.exception_handler(Exception)  # anything else (a failed step): still OpenAI's shape, with its message
    async def internal_error(request, err: Exception):
        return counted(request, protocol.error_response(500, f"{type(err).__name__}: {err}", "internal_server_error"))

    # Parsing a generation request, rendering its chat and tokenizing its prompts run on one thread of their own:
    # on the event loop, a long prompt would hold every stream and every other request while it is tokenized.
    # One thread, so no two encodes overlap (an encode may set the tokenizer's settings; the event loop's
    # detokenizing only decodes).
    preparing = ThreadPoolExecutor(1, thread_name_prefix="rollout-engine-prepare")
    weakref.finalize(app, preparing.shutdown, wait=False)

    async def prepared(request: Request, prepare):
        """prepare(the request's raw body) on the preparing thread."""
        protocol.refuse_query(request.query_params.multi_items())
        raw = await read_body(request)
        return await asyncio.get_running_loop().run_in_executor(preparing, prepare, raw)

    async def read_body(request: Request) -> bytearray:
        raw = bytearray()
        async for part in request.stream():
            raw += part
            if len(raw) > max_body_bytes:
                raise _Refused(413, f"the request body exceeds {max_body_bytes} bytes", "invalid_request_error")
        return raw

    async def body(request: Request, model_cls):
        return parse(await read_body(request), model_cls, request.query_params.multi_items())

    def parse(raw, model_cls, query=()):
        try:
            data = json.loads(raw) if raw.strip() else {} if issubclass(model_cls, protocol.AdminRequest) else None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"the request body is not valid JSON: {err}") from None
        except RecursionError:  # valid JSON nested deeper than the parser's stack
            raise ValueError("the request body is JSON nested too deeply to parse") from None
        return protocol.parse(model_cls, protocol.with_query(data, query, model_cls))

    def asleep() -> dict:
        return engine.sleep_state

    def limit() -> int:
        return engine.max_seq_len

    # ------------------------------------------------------------------ generation

    def check_model(req) -> None:
        if req.model is not None and req.model != model_name:
            raise _Refused(404, f"the model {req.model!r} does not exist; this server serves {model_name!r}",
                           "invalid_request_error", "model_not_found")

    def check_awake() -> None:
        """Refuse generation (503) before a stream's 200 while the engine cannot serve it: asleep, or its weights
        discarded (a level-2 sleep) and not yet updated."""
        status = engine.status
        if status["sleeping"]:
            raise EngineAsleepError("the engine is asleep: generation is refused until POST /wake brings it back")
        if not status["weights_ready"]:
            pushed = ", or a WeightSender's" if engine.weight_endpoint is not None else ""
            raise WeightsNotReadyError("the engine's weights are discarded (a level-2 sleep) or partly updated: "
                                       f"generation is refused until a complete update (POST /update_weights_from_disk"
                                       f"{pushed})")

    def plan(req, chat: bool, prompts) -> Plan:
        k = protocol.logprobs_asked(req, chat)
        params, given = protocol.sampling_params(req, k)
        protocol.check_choices(len(prompts), params.n)
        default = None if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        per_prompt = [protocol.fit_max_tokens(params, len(ids), limit(), given, default) for _, ids in prompts]
        for (_, ids), one in zip(prompts, per_prompt):  # the engine's own checks, before a stream's 200 goes out
            normalise([{"prompt_token_ids": ids}], one, tokenizer, vocab_size, limit())
        tool_parser = parser_for(tool_call_parser, req.tools, req.tool_choice, req.parallel_tool_calls) if chat else None
        return Plan(chat, req.request_id or f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", model_name,
                    prompts, per_prompt, req.return_token_ids, k,
                    bool(req.stream_options and req.stream_options.include_usage),
                    tool_parser,
                    reasoning_parser_for(reasoning_parser) if chat else None, req.include_stop_str_in_output is True,
                    echo=getattr(req, "echo", False), echo_only=getattr(req, "echo", False) and req.max_tokens == 0,
                    prompt_logprobs=req.prompt_logprobs)

    async def serve(request: Request, generation: Generation, stream: bool):
        generation.claim()
        request.state.generation = generation  # it counts itself in the metrics from here on
        if stream:
            return StreamingResponse(generation.events(request.receive, stream_interval),
                                     media_type="text/event-stream", background=BackgroundTask(generation.release),
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        try:
            # on the preparing thread: its encodes (offsets of an echoed prompt) never overlap another request's
            return Response(await generation.complete(request.receive, preparing), media_type="application/json")
        finally:
            generation.release()

    def completion_input(raw):
        """(request, its prompts as (text or None, ids)) of a /v1/completions body (on the preparing thread)."""
        req = parse(raw, protocol.CompletionRequest)
        check_model(req)
        return req, protocol.completion_prompts(req, tokenizer, vocab_size, limit())

    def chat_input(raw):
        """(request, its one prompt) of a /v1/chat/completions body (on the preparing thread)."""
        req = parse(raw, protocol.ChatRequest)
        check_model(req)
        if req.prompt_token_ids is not None:  # the conversation already rendered (extension)
            given = [name for name in ("messages", "tools", "chat_template_kwargs", "continue_final_message")
                     if getattr(req, name)] + ([] if req.add_generation_prompt else ["add_generation_prompt"])
            if given:  # nothing a request says may go unread (the openai client needs messages: [] passes)
                raise ValueError(f"prompt_token_ids is the conversation rendered: {', '.join(given)} would go unread "
                                 "beside it; send one or the other")
            prompt = req.prompt_token_ids
        elif tokenizer is None:
            raise ValueError("chat needs the checkpoint's tokenizer and chat template; this checkpoint has no "
                             "tokenizer: send prompt_token_ids, or use /v1/completions with token ids")
        else:
            prompt = render_chat(tokenizer, req.messages, tools=req.tools, chat_template_kwargs=req.chat_template_kwargs,
                                 add_generation_prompt=req.add_generation_prompt, name="messages",
                                 max_seq_len=limit(), continue_final_message=req.continue_final_message)
        return req, [prompt_ids(list(prompt), None, vocab_size, limit())]

    async def generate(request: Request, chat: bool):
        req, prompts = await prepared(request, chat_input if chat else completion_input)
        generation = Generation(engine, plan(req, chat, prompts), tokenizer, metrics, active)
        check_awake()
        return await serve(request, generation, req.stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": started,
                                            "owned_by": "rollout-engine", "max_model_len": limit()}]}

    # ------------------------------------------------------------------ admin

    @app.post("/sleep")
    async def sleep(request: Request):
        req = await body(request, protocol.SleepRequest)
        if req.mode not in SLEEP_MODES:  # a sleep over HTTP always pauses first
            raise ValueError(f"mode={req.mode!r} is not allowed; 'abort' (end requests in flight) or 'retract' "
                             "(keep their tokens, resume them after /wake)")
        check_sleep(req.level, req.tags, req.mode)
        # the engine process pauses in `mode`, sleeps, then puts back a /pause_generation in force, so that
        # only /continue_generation lifts it
        await engine.sleep(req.level, req.tags, req.mode)
        return asleep()

    @app.post("/wake")
    @app.post("/wake_up")  # vLLM's name
    async def wake(request: Request):
        req = await body(request, protocol.WakeRequest)
        await engine.wake(req.tags)
        return asleep()

    def stopped():
        """A 503 once the engine process is gone (its last status would be a stale answer), else None."""
        return None if engine.is_running else protocol.error_response(503, "the engine process has stopped",
                                                                       "service_unavailable")

    @app.get("/is_sleeping")  # vLLM's
    async def is_sleeping():
        return stopped() or {"is_sleeping": engine.is_sleeping}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        req = await body(request, protocol.UpdateWeightsFromDiskRequest)
        return {"weight_version": await engine.update_weights_from_disk(req.checkpoint(), req.version)}

    @app.get("/weight_receiver")
    async def weight_receiver():
        """Where a transport.WeightSender on this host pushes new weights (`serve --weight-receiver`)."""
        if engine.weight_endpoint is None:
            return protocol.error_response(404, "this server takes no pushed weights: start it with "
                                                "--weight-receiver", "not_found_error")
        return {"endpoint": engine.weight_endpoint, "weight_version": engine.weight_version}

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        req = await body(request, protocol.PauseRequest)
        await engine.pause_generation(req.engine_mode())
        return {"paused": req.mode}

    @app.post("/continue_generation")
    async def continue_generation(request: Request):
        await body(request, protocol.EmptyRequest)  # a field sent here would go unread: refused
        await engine.continue_generation()
        return {"paused": None}

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = await body(request, protocol.AbortRequest)
        one = req.one_id()
        ids = [rid for rids in list(active.values()) for rid in rids] if one is None else active.get(one, [one])
        outs = [await engine.abort(rid) for rid in ids]
        return {"aborted": any(o is not None for o in outs)}

    @app.post("/flush_cache")
    @app.post("/reset_prefix_cache")  # vLLM's
    async def flush_cache(request: Request):
        req = await body(request, protocol.FlushRequest)
        req.check()
        check_model(req)
        await engine.flush_cache()
        return {"flushed": True}

    # ------------------------------------------------------------------ health and metrics

    @app.get("/health")
    async def health():
        if (refusal := stopped()) is not None:
            return refusal
        status = engine.status
        return {"status": "ok", "sleeping": status["sleeping"], "weights_ready": status["weights_ready"],
                "weight_version": status["weight_version"]}

    @app.get("/metrics")
    async def prometheus():
        try:
            stats = await engine.stats()
        except EngineError:
            stats = None  # the engine is gone: the counters still tell what happened
        return Response(metrics.render(stats), media_type=metrics.content_type)

    return app
