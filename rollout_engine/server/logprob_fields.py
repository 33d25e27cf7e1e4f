"""The logprobs of the server's responses, in OpenAI's shapes and vLLM's extensions.

Sampled tokens (`logprobs=k` in completions, `logprobs` + `top_logprobs` in chat): the sampled token's
log-probability from the distribution it was sampled from (after temperature and truncation, renormalised: the
engine's "processed" mode), and the k most likely tokens of that distribution (a token the truncation removed has
-9999.0: JSON has no -inf). Asking for alternatives makes the request's steps eager in the engine.

Prompt tokens (vLLM's `prompt_logprobs=k`: per choice in completions, at the top level in chat): per prompt
token, null first, then {token id: {"logprob", "rank", "decoded_token"}} for the token itself and its position's k
most likely tokens, in the distribution at the request's temperature before any truncation (the engine's
"temperature" mode; temperature 0 scores with the model's own distribution). `rank` is the place among those k (1:
the likeliest); the prompt token's is null when it is not among them (the engine does not rank the whole
vocabulary). A request that scores its prompt skips the prefix cache.

Completions' `echo=true`: the choice's text begins with the prompt, and with `logprobs=k` its logprobs begin with
the prompt's tokens (the first one's logprob and alternatives null), scored as `prompt_logprobs=k` scores them;
with `max_tokens=0` the prompt is scored and nothing is generated (lm-eval-harness's loglikelihood request).
"""
from __future__ import annotations

import math

from .detokenize import text_offsets, token_bytes, token_strings

NEG_INF_LOGPROB = -9999.0  # JSON has no -inf


def _finite(x: float) -> float:
    return x if math.isfinite(x) else NEG_INF_LOGPROB


def _tops(tops, t: int):
    """{token_id: logprob} alternatives of token t ({} when none were asked)."""
    return tops[t] if tops is not None and t < len(tops) and tops[t] else {}


def completion_logprobs(tokenizer, ids, logprobs, tops, k: int, offsets: list[int]) -> dict:
    """OpenAI's completions logprobs for a run of tokens; `offsets`: where each token's text starts in the
    choice's text (IncrementalDetokenizer's offsets). Each token's `top_logprobs`, as vLLM gives them: the
    sampled token, then its k likeliest alternatives (k + 1 entries at most; logprobs=0: the sampled one)."""
    top = []
    for t, (token, logprob) in enumerate(zip(ids, logprobs)):
        alts = [(token, logprob)] + sorted(_tops(tops, t).items(), key=lambda kv: -kv[1])[:k]
        entry = {}  # tokens that read alike share a key: it keeps the likeliest one's logprob
        for text, (_, v) in zip(token_strings(tokenizer, [a for a, _ in alts]), alts):
            entry[text] = max(entry.get(text, -math.inf), _finite(v))
        top.append(entry)
    return {"tokens": token_strings(tokenizer, ids), "token_logprobs": [_finite(x) for x in logprobs],
            "top_logprobs": top, "text_offset": list(offsets)}


def chat_logprobs(tokenizer, ids, logprobs, tops, k: int) -> dict:
    """OpenAI's chat logprobs ({"content": [...]}) for a run of tokens."""
    strings, raw = token_strings(tokenizer, ids), token_bytes(tokenizer, ids)
    content = []
    for t, (s, b, lp) in enumerate(zip(strings, raw, logprobs)):
        alts = sorted(_tops(tops, t).items(), key=lambda kv: -kv[1])[:k] if k else []
        alt_ids = [a for a, _ in alts]
        top = [{"token": ts, "logprob": _finite(v), "bytes": tb} for ts, tb, (_, v) in
               zip(token_strings(tokenizer, alt_ids), token_bytes(tokenizer, alt_ids), alts)]
        content.append({"token": s, "logprob": _finite(lp), "bytes": b, "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_field(tokenizer, entries, k: int, shown: int | None = None) -> list[dict | None] | None:
    """vLLM's `prompt_logprobs` of the engine's RequestOutput.prompt_logprobs scored at `prompt_logprobs=k`, shown
    at `shown` <= k (None: k; echo may score the prompt at more than the field asks), as a request scored at `shown`
    shows it. None: the prompt was not scored, e.g. the request was aborted first."""
    if entries is None:
        return None
    shown = k if shown is None else shown
    shown_entries = [_shown(entry, k, shown) for entry in entries[1:]]
    texts = iter(token_strings(tokenizer, [t for ids, _ in shown_entries for t in ids]))
    field = [None]
    for entry, (ids, rank) in zip(entries[1:], shown_entries):
        field.append({str(t): {"logprob": _finite(entry[t]), "rank": rank.get(t), "decoded_token": next(texts)}
                      for t in ids})
    return field


def _shown(entry: dict, k: int, shown: int) -> tuple[list[int], dict[int, int]]:
    """An entry scored at prompt_logprobs=k (the prompt token, then its position's likeliest others: k of them, or
    k - 1 and itself) as one scored at `shown` <= k: (the prompt token and the `shown` likeliest, their ranks)."""
    ids = list(entry)
    top = sorted(ids if len(ids) == k else ids[1:], key=lambda t: -entry[t])[:shown]
    rank = {t: r for r, t in enumerate(top, 1)}
    return [t for t in ids if t == ids[0] or t in rank], rank


def prompt_logprobs_of_echo(tokenizer, prompt_ids, entries, scored: int, k: int, prompt_text: str | None) -> dict:
    """The prompt's part of completions' logprobs with `echo` (the same for each choice of a prompt): its tokens
    (`entries` as in prompt_logprobs_field, scored at `scored` >= k; a position not scored, as in a request aborted
    first, is null), each with its k likeliest others at most, as the completion's tokens have, whatever more the
    prompt was scored for. `prompt_text`: the prompt as sent, which the echo shows, or None (token ids: decoded)."""
    scored_entries = list(entries or [None])[1:]
    scored_entries += [None] * (len(prompt_ids) - 1 - len(scored_entries))
    kept = [_shown(entry, scored, k)[0] if entry else [] for entry in scored_entries]  # the prompt token first
    texts = iter(token_strings(tokenizer, [t for ids in kept for t in ids]))
    logprobs, tops = [None], [None]
    for token, entry, ids in zip(prompt_ids[1:], scored_entries, kept):
        top = {}  # as completion_logprobs: tokens that read alike share a key, the likeliest one's logprob
        for t in ids:
            text = next(texts)
            top[text] = max(top.get(text, -math.inf), _finite(entry[t]))
        logprobs.append(_finite(entry[token]) if entry else None)
        tops.append(top if entry else None)
    return {"tokens": token_strings(tokenizer, prompt_ids), "token_logprobs": logprobs, "top_logprobs": tops,
            "text_offset": _prompt_offsets(tokenizer, prompt_ids, prompt_text)}


def prompt_fields(plan, tokenizer, run, out) -> dict:
    """What a completions choice of `run` (an EngineRun of `plan`) carries of its prompt: vLLM's
    `prompt_logprobs`, and with `echo` the prompt's text and the prompt's part of the logprobs (with_prompt puts
    them in each choice)."""
    fields = {} if plan.prompt_logprobs is None else {  # none where only echo scored the prompt
        "prompt_logprobs": prompt_logprobs_field(tokenizer, out.prompt_logprobs, run.params.prompt_logprobs,
                                                 plan.prompt_logprobs)}
    if plan.echo:
        fields["text"] = run.prompt_text if run.prompt_text is not None else (
            tokenizer.decode(run.prompt, skip_special_tokens=True) if tokenizer is not None else "")
        if plan.logprobs is not None:
            fields["logprobs"] = prompt_logprobs_of_echo(tokenizer, run.prompt, out.prompt_logprobs,
                                                         run.params.prompt_logprobs, plan.logprobs, run.prompt_text)
    return fields


def _prompt_offsets(tokenizer, ids, text: str | None) -> list[int]:
    """Where each prompt token's text starts in the echoed prompt. A text prompt's are its own characters', from
    the tokenizer's offset mapping: a special token written in the text (<|im_start|>) spans what it spells there,
    an added one (a BOS) nothing, which decoding without special tokens cannot tell apart. Token ids, or a
    tokenizer without offsets: the decoded ids' (text_offsets)."""
    if text is not None and getattr(tokenizer, "is_fast", False):
        encoded = tokenizer(text, return_offsets_mapping=True)
        if encoded["input_ids"] == list(ids):
            return [start for start, _ in encoded["offset_mapping"]]
    return text_offsets(tokenizer, ids)


def joined(prompt: dict, completion: dict, shift: int) -> dict:
    """The prompt's logprobs then the completion's, whose text offsets move by `shift` (the echoed prompt's
    length)."""
    return {"tokens": prompt["tokens"] + completion["tokens"],
            "token_logprobs": prompt["token_logprobs"] + completion["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + completion["top_logprobs"],
            "text_offset": prompt["text_offset"] + [shift + o for o in completion["text_offset"]]}


def with_prompt(choice: dict, prompt: dict) -> dict:
    """A completions choice with what prompt_fields gave of its prompt: `prompt_logprobs`, and with
    `echo` the prompt's text ahead of the choice's, its logprobs ahead of the choice's."""
    if "prompt_logprobs" in prompt:
        choice["prompt_logprobs"] = prompt["prompt_logprobs"]
    if "text" in prompt:
        if choice["logprobs"] is not None:
            choice["logprobs"] = joined(prompt["logprobs"], choice["logprobs"], len(prompt["text"]))
        choice["text"] = prompt["text"] + choice["text"]
    return choice
