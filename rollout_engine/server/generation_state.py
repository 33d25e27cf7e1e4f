"""What a Generation (generate.py) works from and keeps: the validated request (Plan), each of its engine requests
(EngineRun: one per prompt) and each choice's progress in a stream (ChoiceState)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..detokenize import IncrementalDetokenizer
from .chat_reply import StreamedReply


@dataclass
class Plan:
    """A validated generation request."""
    chat: bool
    http_id: str
    model: str
    prompts: list[tuple[str | None, list[int]]]
    params: list  # a SamplingParams per prompt
    return_ids: bool
    logprobs: int | None  # None: none; k: the sampled token's plus k alternatives
    include_usage: bool = False
    tool_parser: object = None  # chat replies' tool calls are parsed (chat_reply.py)
    reasoning_parser: object = None  # chat replies' reasoning is parsed (chat_reply.py)
    include_stop_str: bool = False  # vLLM's include_stop_str_in_output: a stop string ends the text it stopped
    echo: bool = False  # completions: the prompt begins each choice's text and logprobs (logprob_fields.py)
    echo_only: bool = False  # echo with max_tokens=0: the prompt's one step ran, its token is dropped
    prompt_logprobs: int | None = None  # the request's vLLM prompt_logprobs=k (echo may score the prompt at more)
    created: int = field(default_factory=lambda: int(time.time()))
    arrived: float = field(default_factory=time.perf_counter)


@dataclass(eq=False)
class ChoiceState:
    detok: IncrementalDetokenizer  # its `offsets` are the text_offset of completions logprobs
    pushed: int = 0        # tokens given to detok
    sent: int = 0          # tokens sent (their ids, logprobs, offsets)
    finished: bool = False
    reply: StreamedReply | None = None  # with a parser: the delta fields a stream may send so far


@dataclass(eq=False)
class EngineRun:
    engine_id: str
    prompt_text: str | None
    prompt: list[int]
    params: object
    first_index: int       # choice index of its sample 0
    choices: list[ChoiceState]
    latest: object = None  # the newest snapshot (a RequestOutput)
    taken: object = None   # the snapshot the writer handled last
    done: bool = False     # `latest` is the final output
    error: BaseException | None = None
    opens: bool = False    # its prompt opens a reasoning block: the reply begins inside it
