"""The OpenAI request and response shapes, with the engine's extensions, and their validation.

Sampling fields go to SamplingParams untouched, so a bad value gets the Python API's own message. Extensions
(an OpenAI client passes them in `extra_body`): `top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `request_id`
(to abort a request by its id), `return_token_ids` (default on: `prompt_token_ids`, and per choice `token_ids`
and `weight_versions`, the weight version that produced each token), `prompt_token_ids` (the prompt as token
ids; in a chat request it replaces the rendered messages), `chat_template_kwargs`, `add_generation_prompt`,
`continue_final_message`.

Logprobs (`logprobs`, `top_logprobs`, and vLLM's `prompt_logprobs` and completions' `echo`): what each means and
the response shapes are logprob_fields.py's.
"""
from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError

from ..inputs import prompt_ids
from ..sampling_params import MAX_LOGPROBS, MAX_N, NEUTRAL, SEED_LIMIT, SamplingParams, check_neutral, is_int

MAX_CHOICES = MAX_N  # samples of one HTTP request (prompts x n)
# Fields the engine does not implement: refused unless left at their neutral value (the sampling ones: NEUTRAL;
# vLLM's clients often send its extensions at their defaults, which is what this server does anyway), but
# include_stop_str_in_output, which the server does itself (it puts the stop back on the engine's text).
UNSUPPORTED = {k: v for k, v in NEUTRAL.items() if k != "include_stop_str_in_output"} | {
    "suffix": (None, ""), "response_format": (None, {"type": "text"}), "functions": (None,),
    "function_call": (None, "none", "auto"), "tool_choice": (None, "none", "auto"), "logprobs_mode": (None,),
    "return_tokens_as_token_ids": (None, False), "priority": (None, 0)}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    n: Any = 1
    max_tokens: Any = None
    temperature: Any = 1.0
    top_p: Any = 1.0
    top_k: Any = -1
    min_p: Any = 0.0
    stop: Any = None
    stop_token_ids: Any = None
    seed: Any = None
    ignore_eos: Any = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    return_token_ids: StrictBool = True
    request_id: StrictStr | None = Field(None, min_length=1, max_length=256)
    # accepted and ignored
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    # refused unless neutral (UNSUPPORTED)
    frequency_penalty: Any = None
    presence_penalty: Any = None
    logit_bias: Any = None
    logprobs_mode: Any = None
    repetition_penalty: Any = None
    min_tokens: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    include_stop_str_in_output: StrictBool | None = None  # vLLM's: the stop string stays at the text's end
    return_tokens_as_token_ids: Any = None
    truncate_prompt_tokens: Any = None
    priority: Any = None
    prompt_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's (logprob_fields.py)


class CompletionRequest(_Request):
    prompt: Any = None
    prompt_token_ids: Any = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: StrictBool = False  # the prompt ahead of the text and logprobs (logprob_fields.py)
    best_of: Any = None
    suffix: Any = None


class ChatRequest(_Request):
    messages: list[dict] | None = None
    prompt_token_ids: list[StrictInt] | None = None
    max_completion_tokens: Any = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None  # false: a reply's first tool call only (chat_reply.py)
    chat_template_kwargs: dict | None = None
    add_generation_prompt: StrictBool = True
    continue_final_message: StrictBool = False
    response_format: Any = None
    functions: Any = None
    function_call: Any = None


class AdminRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EmptyRequest(AdminRequest):
    """The body of an admin endpoint that takes no fields (/continue_generation): none, or {}."""


class FlushRequest(AdminRequest):
    """/flush_cache (/reset_prefix_cache): the fields vLLM's and Ray Serve's clients send, at what this flush does."""
    model: StrictStr | None = None  # Ray Serve names the model: checked as a generation request's is
    device: StrictStr | None = None  # vLLM's: the prefix cache on the GPU ("gpu"), the only one here
    reset_running_requests: StrictBool = False  # vLLM's: true would also preempt the running requests

    def check(self) -> None:
        if self.device not in (None, "gpu", "cuda"):
            raise ValueError(f"device={self.device!r} is not allowed; 'gpu' (the engine's one prefix cache) or none")
        if self.reset_running_requests:
            raise ValueError("reset_running_requests=true is not supported: the flush leaves running requests "
                             "their KV (pause with mode 'retract' first to drop theirs)")


class SleepRequest(AdminRequest):
    level: Any = 1
    tags: Any = None
    mode: Any = "abort"  # how requests in flight end first: "abort", or "retract" (resumed after /wake)


class WakeRequest(AdminRequest):
    tags: Any = None


class UpdateWeightsFromDiskRequest(AdminRequest):
    path: StrictStr | None = None
    model_path: StrictStr | None = None  # SGLang's name for path
    version: Any = None

    def checkpoint(self) -> str:
        if (self.path is None) == (self.model_path is None):
            raise ValueError("path: give the checkpoint directory once, as path (or model_path, SGLang's name)")
        return self.path if self.path is not None else self.model_path


class PauseRequest(AdminRequest):
    mode: Any = "abort"

    def engine_mode(self):
        return "keep" if self.mode == "in_place" else self.mode  # SGLang's in_place: held with their KV


class AbortRequest(AdminRequest):
    request_id: StrictStr | None = None
    rid: StrictStr | None = None  # SGLang's name for request_id
    abort_all: StrictBool = False  # SGLang's: every request in flight

    def one_id(self) -> str | None:
        """The request to abort, or None for every one (abort_all)."""
        given = [x for x in (self.request_id, self.rid) if x is not None]
        if len(given) + self.abort_all != 1:
            raise ValueError("request_id: give one request id (request_id, or rid as SGLang names it), or "
                             "abort_all=true")
        return given[0] if given else None


def parse(model_cls, body) -> _Request:
    """The request model of a JSON body, or a ValueError that names the field and what is wrong."""
    if not isinstance(body, dict):
        raise ValueError(f"the request body must be a JSON object, got {type(body).__name__}")
    # An explicit null is the field left out, as OpenAI's API reads it (its client sends null for a None argument),
    # a field this server does not model too (a wrapper that sends every field it knows, unset ones as null)
    fields = model_cls.model_fields
    body = {k: v for k, v in body.items() if v is not None}
    try:
        req = model_cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            takes = sorted(fields) or "no fields"
            raise ValueError(f"unknown field {where!r}; {model_cls.__name__} takes {takes}") from None
        raise ValueError(f"{where}: {first['msg']}") from None
    for name in UNSUPPORTED:
        check_neutral(name, getattr(req, name, None), UNSUPPORTED, n=getattr(req, "n", 1))
    check_stream_options(req)
    return req


def with_query(data, query, model_cls):
    """An admin body (`data`) with its endpoint's fields given as query parameters added, as vLLM's clients send
    them (POST /sleep?level=2; a repeated `tags` is a list; level's and version's digits an int). Elsewhere
    (model_cls not an AdminRequest) a query parameter is refused: nothing a request says may go unread."""
    query = list(query)
    if not query:
        return data
    if not issubclass(model_cls, AdminRequest) or not isinstance(data, dict):
        refuse_query(query)
    data, fields = dict(data), model_cls.model_fields
    for key in dict.fromkeys(k for k, _ in query):
        values = [v for k, v in query if k == key]
        if key not in fields or key in data:
            raise ValueError(f"query parameter {key!r} is " + ("given in the body too" if key in fields else
                             f"not a field of this endpoint; its fields: {sorted(fields)}"))
        if len(values) > 1 and key != "tags":
            raise ValueError(f"query parameter {key!r} is given {len(values)} times")
        number = key in ("level", "version") and values[0].lstrip("-").isdigit()
        flag = fields[key].annotation is bool and values[0] in ("true", "false")  # vLLM's ?reset_running_requests=
        data[key] = (values if key == "tags" else int(values[0]) if number else values[0] == "true" if flag
                     else values[0])
    return data


def refuse_query(query) -> None:
    """A ValueError naming the query parameters of a request that takes none (a generation request)."""
    query = list(query)
    if query:
        raise ValueError(f"query parameters {sorted({k for k, _ in query})} are not taken here: send the request's "
                         "fields in its JSON body")


def check_stream_options(req) -> None:
    """stream_options belong to a stream (OpenAI's rule), and usage comes once, in the stream's last chunk. A
    stream does not score its prompt (prompt_logprobs, echo)."""
    if getattr(req, "stream", False) is True and (getattr(req, "echo", False) or req.prompt_logprobs is not None):
        name = "echo=true" if getattr(req, "echo", False) else "prompt_logprobs"
        raise ValueError(f"{name} is not supported with stream=true here; ask for it without streaming")
    options = getattr(req, "stream_options", None)
    if options is None:
        return
    if req.stream is not True:
        raise ValueError("stream_options is only allowed with stream=true")
    if options.continuous_usage_stats:
        raise ValueError("stream_options.continuous_usage_stats=true is not supported by this engine; "
                         "include_usage=true sends the usage in the stream's last chunk")


def logprobs_asked(req: _Request, chat: bool) -> int | None:
    """How many alternatives the response's logprobs carry per token: None (no logprobs), 0 or k."""
    if chat and req.top_logprobs and not req.logprobs:
        raise ValueError("top_logprobs needs logprobs=true")
    return ((req.top_logprobs or 0) if req.logprobs else None) if chat else req.logprobs


def sampling_params(req: _Request, logprobs: int | None) -> tuple[SamplingParams, str | None]:
    """The request's SamplingParams (a ValueError with the Python API's message if a field is bad), and the field
    that gave max_tokens (max_tokens, or max_completion_tokens in chat; None: neither). `logprobs`: what
    `logprobs_asked` says the response shows; the sampled tokens' logprobs are kept even when it shows none (0
    alternatives then). max_tokens=0 with echo runs the prompt's step and its token is dropped (Generation); echo
    with logprobs=k scores the prompt at k."""
    name = "max_completion_tokens" if getattr(req, "max_completion_tokens", None) is not None else "max_tokens"
    given, echo = getattr(req, name), getattr(req, "echo", False)
    if given is not None and (not is_int(given) or given < (0 if echo else 1)):
        raise ValueError(f"{name}={given!r} is not allowed; {name} must be an int >= 1" + (
            ", or 0 with echo=true (the prompt scored, nothing generated)" if hasattr(req, "echo") else ""))
    seed = req.seed
    # OpenAI's and vLLM's seeds are any int64: the negative ones fold onto [0, 2**63), where SamplingParams takes them
    if is_int(seed) and -SEED_LIMIT <= seed < 0:
        seed = seed % SEED_LIMIT
    scored = req.prompt_logprobs  # echo with logprobs=k needs the prompt scored at k; each field is cut to its own
    if echo and logprobs is not None and (scored is None or (is_int(scored) and 0 <= scored < logprobs)):
        scored = logprobs
    params = SamplingParams(n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                          max_tokens=given or 1, stop=req.stop, stop_token_ids=req.stop_token_ids,
                          ignore_eos=req.ignore_eos, seed=seed, logprobs=logprobs or 0, prompt_logprobs=scored)
    return params, name if given is not None else None


def check_choices(prompts: int, n: int) -> None:
    """One HTTP request's samples, prompts x n, at most MAX_CHOICES: the front holds a record of each before the
    engine runs any (a huge request would stall every other one)."""
    if prompts * n > MAX_CHOICES:
        raise ValueError(f"{prompts} prompts x n={n} is {prompts * n} choices; one request may ask for at most "
                         f"{MAX_CHOICES}: split it")


def fit_max_tokens(params: SamplingParams, prompt_len: int, limit: int, given: str | None,
                   default: int | None) -> SamplingParams:
    """One prompt's params: prompt + max_tokens must fit the longest sequence the server holds (max_model_len,
    or the KV pool if smaller), but for a prompt that fills it, which gets the one token its prefill samples.
    max_tokens left out (`given`, the field that gave it, None) is `default` (None: all the room left), capped."""
    room = max(limit - prompt_len, 1)
    if given is None:
        return replace(params, max_tokens=room if default is None else min(default, room))
    if params.max_tokens > room:
        raise ValueError(f"{given}={params.max_tokens} is not allowed: with the prompt's {prompt_len} tokens that "
                         f"is {prompt_len + params.max_tokens}; sequences hold at most {limit} tokens here "
                         f"(max_model_len, or the KV pool if smaller): ask for {given} <= {room}")
    return params


def completion_prompts(req: CompletionRequest, tokenizer, vocab_size: int,
                       limit: int) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) of each prompt: `prompt` is a string, a list of token ids, or a list of
    either; `prompt_token_ids` (extension) is a list of token ids or a list of them."""
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise ValueError("give exactly one of prompt (a string, a list of token ids, or a list of those) "
                         "and prompt_token_ids")
    prompts = req.prompt if req.prompt is not None else req.prompt_token_ids
    if req.prompt_token_ids is not None and isinstance(prompts, str):
        raise ValueError("prompt_token_ids must be a list of token ids (or a list of such lists), not a string")
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
                                    and not isinstance(prompts[0], bool)):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise ValueError("prompt must be a non-empty string, a list of token ids, or a non-empty list of those")
    check_choices(len(prompts), 1)
    out = []
    for p in prompts:
        if not isinstance(p, (str, list)):
            raise ValueError(f"a prompt of type {type(p).__name__} is not allowed; a string or a list of token ids")
        out.append(prompt_ids(p, tokenizer, vocab_size, limit))
    return out


# ---------------------------------------------------------------------------------------------- responses

def error_response(status: int, message: str, type_: str = "invalid_request_error", code=None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, code), status_code=status)


def error_body(message: str, type_: str = "invalid_request_error", code: int | str | None = None) -> dict:
    if type_ == "invalid_request_error":  # the engine's checks name a field of its sampling_params argument, which
        message = message.removeprefix("sampling_params.")  # a request gives at its top level
    param = _param_of(message) if type_ == "invalid_request_error" else None
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _param_of(message: str) -> str | None:
    """OpenAI's error.param: the request field a refusal names first (every message begins with the field at
    fault where one is), or None."""
    word = re.match(r"[a-z_]+", message)
    return word[0] if word and word[0] in _FIELDS else None


_FIELDS = frozenset().union(*(cls.model_fields for cls in (CompletionRequest, ChatRequest, SleepRequest, WakeRequest,
                                                          UpdateWeightsFromDiskRequest, PauseRequest, AbortRequest,
                                                          FlushRequest)))


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
