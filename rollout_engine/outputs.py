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


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    weight_version: int
    metrics: dict = field(default_factory=dict)
