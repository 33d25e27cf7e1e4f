"""What `Engine.generate` returns."""
from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    logprobs: list[float] | None  # each token's (SamplingParams.logprobs not None)
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort"
    weight_versions: list[int] = field(default_factory=list)  # the weight version that produced each token
    top_logprobs: list[dict[int, float]] | None = None  # logprobs=k >= 1: each token's k most likely, {id: logprob}
    # What stopped a "stop" sample, as vLLM says it: the stop string, or the stop_token_ids token; None for EOS
    stop_reason: int | str | None = None
    # The weight version that computed the KV of its prompt (and of any tokens it resumed with); None if it never
    # ran. Older than its first token's version where an update fell while it held KV (a "keep" pause), even
    # inside its prefill: its tokens then attended to KV of older weights, which weight_versions alone cannot show.
    prompt_weight_version: int | None = None


@dataclass
class RequestOutput:
    request_id: int | str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    weight_version: int
    metrics: dict = field(default_factory=dict)
    # prompt_logprobs=k: per prompt token, None first, then {token: logprob} and its position's k most likely
    prompt_logprobs: list[dict[int, float] | None] | None = None


def final_text(tokenizer, ids, finish_reason) -> str:
    """A finished sample's text where no stop string cut it (that text is the one before the stop string): its
    tokens decoded, less the token that stopped a "stop" sample (EOS, or one of stop_token_ids), whose text is
    not the sample's, as vLLM leaves it out. A special token's text is left out either way. A character that the
    stop token completes (its first bytes in the tokens before) is left out whole, not as U+FFFD: the text stays
    a prefix of the tokens' whole text, which a stream sends and include_stop_str_in_output extends."""
    if finish_reason != "stop" or not ids:
        return tokenizer.decode(ids, skip_special_tokens=True)
    text = tokenizer.decode(ids[:-1], skip_special_tokens=True)
    if text.endswith("\ufffd"):  # maybe a character cut short: where the whole decode differs, it was
        whole = tokenizer.decode(ids, skip_special_tokens=True)
        text = text[:len(os.path.commonprefix([text, whole]))]
    return text


def request_output(text, first, seqs, weight_version: int, tokenizer, speculative: bool) -> RequestOutput:
    """The RequestOutput of a request whose samples `seqs` (Sequence objects) all finished; `first` is the
    request's first sequence (its prompt and prefix-cache figures)."""
    completions = []
    for seq in sorted(seqs, key=lambda s: s.index):
        if seq.text is None and tokenizer is not None:
            seq.text = final_text(tokenizer, seq.output_ids, seq.finish_reason)
        completions.append(CompletionOutput(seq.index, seq.output_ids, sample_logprobs(seq), seq.text,
                                            seq.finish_reason, list(seq.weight_versions), top_logprobs(seq),
                                            seq.stop_reason, seq.prompt_weight_version))
    metrics = {"num_cached_tokens": first.num_cached}
    if speculative:
        metrics |= {"spec_proposed": sum(s.spec_proposed for s in seqs),
                    "spec_accepted": sum(s.spec_accepted for s in seqs)}
    return RequestOutput(first.request_id, text, first.token_ids[: first.num_prompt_tokens], completions,
                         weight_version, metrics, prompt_logprobs(first))


def sample_logprobs(seq) -> list[float] | None:
    """A sample's token logprobs as its params ask (a copy: a running sample's list still grows)."""
    return list(seq.logprobs) if seq.params.logprobs is not None else None


def top_logprobs(seq) -> list[dict[int, float]] | None:
    """A sample's top-k alternatives per token, or None when not asked (cut to its tokens: a stop string trims
    the tokens and their logprobs)."""
    return seq.top_logprobs[: len(seq.logprobs)] if seq.top_logprobs is not None else None


def prompt_logprobs(first) -> list[dict[int, float] | None] | None:
    """The request's prompt logprobs (on its first sample), or None when not asked or not all scored yet (a request
    aborted, or streamed, part way through its prompt): the list always holds one entry per prompt token."""
    scored = first.prompt_logprobs
    return list(scored) if scored is not None and len(scored) == first.num_prompt_tokens else None
