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


def request_output(text, first, seqs, weight_version: int, tokenizer, speculative: bool) -> RequestOutput:
    """The RequestOutput of a request whose samples `seqs` (Sequence objects) all finished; `first` is the
    request's first sequence (its prompt and prefix-cache figures)."""
    completions = []
    for seq in sorted(seqs, key=lambda s: s.index):
        if seq.text is None and tokenizer is not None:
            seq.text = tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        completions.append(CompletionOutput(seq.index, seq.output_ids, seq.logprobs if seq.params.logprobs else None,
                                            seq.text, seq.finish_reason, list(seq.weight_versions)))
    metrics = {"num_cached_tokens": first.num_cached}
    if speculative:
        metrics |= {"spec_proposed": sum(s.spec_proposed for s in seqs),
                    "spec_accepted": sum(s.spec_accepted for s in seqs)}
    return RequestOutput(first.request_id, text, first.token_ids[: first.num_prompt_tokens], completions,
                         weight_version, metrics)
