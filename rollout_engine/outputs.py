"""What `Engine.generate` returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort"
    weight_versions: list[int] = field(default_factory=list)  # the weight version that produced each token


@dataclass
class RequestOutput:
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    weight_version: int
    metrics: dict = field(default_factory=dict)
