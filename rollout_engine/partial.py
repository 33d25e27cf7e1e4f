"""Partial rollouts: a generate() call that stops when its budget is spent, and samples continued from where an
earlier call stopped them (the "partial rollout" of asynchronous RL).

A budget stops a call after a number of generated tokens, a number of seconds, or once a fraction of its
samples have finished, whichever comes first. The samples still running then end with finish_reason "abort"
and keep their tokens, logprobs and weight versions. Passing such a RequestOutput back to generate() as a
prompt continues its "abort" samples from their tokens: the old tokens keep their logprobs and versions,
max_tokens and the stop conditions count over the whole sample, and each sample keeps its seed, so with
unchanged weights it draws the tokens an uninterrupted run draws (the noise is keyed by seed and position).
With speculative decoding (a draft model or prompt lookup) at temperature > 0 it draws from the same
distribution but not the same tokens: whether a position's token is an accepted draft, a residual draw or a
bonus draw depends on where the speculative steps fall, and a resume moves them. With fp8 weights a step's
activations are quantized over one scale for its whole batch, so a resumed sample's logprobs (and tokens at
near-ties) move with the batches it runs in.
"""
from __future__ import annotations

import math
import numbers
import time

from .outputs import CompletionOutput, RequestOutput
from .sampling_params import is_finite_number, is_int
from .sequence import Sequence, Status

FINISH_REASONS = ("stop", "length", "abort")


class RolloutBudget:
    """When a generate() call stops early; built by `from_args`, which validates the arguments."""

    def __init__(self, token_budget: int | None, time_budget: float | None, finish_fraction: float | None):
        self.token_budget, self.time_budget, self.finish_fraction = token_budget, time_budget, finish_fraction
        self.deadline = self.needed = None
        self.tokens = self.finished = 0
        self.counted: dict[int, int] = {}  # id(sequence) -> its output tokens already counted
        self.started: dict[int, int] = {}  # id(sequence) -> its output tokens when the call started
        self.owed: list[Sequence] | None = None  # past the deadline: the samples that get a token before it stops

    @classmethod
    def from_args(cls, token_budget, time_budget, finish_fraction) -> "RolloutBudget | None":
        """The budget of generate()'s arguments (None: the call runs every sample to its end)."""
        def bad(name, value, allowed):
            raise ValueError(f"{name}={value!r} is not allowed; {name} must be None or {allowed}")

        if token_budget is not None and (not is_int(token_budget) or token_budget < 1):
            bad("token_budget", token_budget, "an int >= 1 (tokens generated in this call, over all samples)")
        if time_budget is not None and (not is_finite_number(time_budget) or time_budget <= 0):
            bad("time_budget", time_budget, "a finite number of seconds > 0")
        if finish_fraction is not None and (not is_finite_number(finish_fraction) or not 0 < finish_fraction <= 1):
            bad("finish_fraction", finish_fraction, "a number in (0, 1] (the fraction of this call's samples)")
        if token_budget is None and time_budget is None and finish_fraction is None:
            return None
        return cls(None if token_budget is None else int(token_budget),
                   None if time_budget is None else float(time_budget),
                   None if finish_fraction is None else float(finish_fraction))

    def start(self, seqs: list[Sequence], num_samples: int) -> None:
        """Start the clock; `seqs` are the call's queued sequences, `num_samples` the samples it runs."""
        if self.time_budget is not None:
            self.deadline = time.monotonic() + self.time_budget
        if self.finish_fraction is not None:
            # at least one: the fraction is > 0 (the 1e-9 keeps 0.95 x 20 = 19.000000000000004 at 19)
            self.needed = max(1, math.ceil(self.finish_fraction * num_samples - 1e-9))
        self.counted = {id(s): len(s) - s.num_prompt_tokens for s in seqs}  # resumed tokens are not this call's
        self.started = dict(self.counted)

    def spent(self, grown: list[Sequence], running: list[Sequence]) -> bool:
        """Account one step's grown sequences (`running`: the batch's); whether the call must stop now."""
        if self.token_budget is not None:
            for seq in grown:
                length = len(seq) - seq.num_prompt_tokens
                self.tokens += max(0, length - self.counted.get(id(seq), 0))
                self.counted[id(seq)] = length
        self.finished += sum(seq.finish_reason is not None for seq in grown)
        return ((self.token_budget is not None and self.tokens >= self.token_budget)
                or (self.needed is not None and self.finished >= self.needed) or self._out_of_time(running))

    def _out_of_time(self, running: list[Sequence]) -> bool:
        """Past the deadline, once every sample that was being prefilled then has its first token of this call:
        a resumed sample's re-prefill (whole after a weight update empties the prefix cache) may outlast any
        deadline, and a loop that stopped it there would resume it forever without a token."""
        if self.deadline is None or time.monotonic() < self.deadline:
            return False
        if self.owed is None:
            self.owed = [seq for seq in running if not self._grew(seq)]
        self.owed = [seq for seq in self.owed if seq.status is Status.RUNNING and not self._grew(seq)]
        return not self.owed

    def _grew(self, seq: Sequence) -> bool:
        return len(seq) - seq.num_prompt_tokens > self.started.get(id(seq), 0)


# ------------------------------------------------------------------ resuming


def keeps_request_id(request_id) -> bool:
    """Whether an Engine resuming an output with this request id keeps the id, and so its samples' seeds: an int
    in [0, 2**63) (numpy's too), never a bool (no Engine's), a negative int or a string (AsyncEngine's, the
    server's), nor an id no Engine counts up to (kept, every later request's id and default seed would move)."""
    return is_int(request_id) and 0 <= request_id < 1 << 63


def resumed_prompts(prompts):
    """Split generate()'s prompts: RequestOutputs (to resume) are replaced by their prompt ids, so the usual
    checks apply to them; returns (prompts, {position: RequestOutput})."""
    if isinstance(prompts, RequestOutput):
        prompts = [prompts]
    if not isinstance(prompts, (list, tuple)) or not any(isinstance(p, RequestOutput) for p in prompts):
        return prompts, {}
    resumed = {i: p for i, p in enumerate(prompts) if isinstance(p, RequestOutput)}
    ids = [out.request_id for out in resumed.values()]
    if len({int(i) if is_int(i) else repr(i) for i in ids}) != len(ids):  # 5 and numpy's 5 are one id
        raise ValueError(f"prompts resume request ids {ids} more than once; resume each RequestOutput once (outputs "
                         "of different engines may share an id: resume them on their own engines)")
    return [{"prompt_token_ids": p.prompt_token_ids} if i in resumed else p for i, p in enumerate(prompts)], resumed


def _is_logprob(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and x <= 0  # NaN is not <= 0


def check_resumable(out: RequestOutput, params, vocab_size: int, max_seq_len: int, eos_token_ids=()) -> None:
    """Every completion of `out` must be one `params` could have produced, and the "abort" ones have room to go on:
    none holds a token its sample would have stopped at (an EOS of `eos_token_ids` unless params.ignore_eos, or one
    of params.stop_token_ids). Token ids, weight versions and logprobs are checked for what they are, as the
    trainer reads them from the resumed output."""
    def bad(what):
        raise ValueError(f"cannot resume request {out.request_id!r}: {what}")

    comps = out.outputs
    if not isinstance(comps, (list, tuple)) or not all(isinstance(c, CompletionOutput) for c in comps):
        bad(f"its outputs must be a list of CompletionOutput, got {type(comps).__name__}")
    if not all(is_int(getattr(c, "index", None)) for c in comps) or sorted(c.index for c in comps) != list(
            range(params.n)):
        bad(f"its completions' indices must be 0..{params.n - 1} (sampling_params.n={params.n}), "
            f"got {[getattr(c, 'index', None) for c in comps]}")
    for c in comps:
        name = f"completion {c.index}"
        if c.finish_reason not in FINISH_REASONS:
            bad(f"{name} has finish_reason={c.finish_reason!r}; one of {FINISH_REASONS}")
        if not isinstance(c.token_ids, (list, tuple)) or not all(
                is_int(t) and 0 <= t < vocab_size for t in c.token_ids):
            bad(f"{name}'s token_ids must be a list of ints in [0, {vocab_size})")
        versions = c.weight_versions
        if not isinstance(versions, (list, tuple)) or not all(is_int(v) and v >= 0 for v in versions):
            bad(f"{name}'s weight_versions must be a list of ints >= 0")
        if not (c.prompt_weight_version is None or is_int(c.prompt_weight_version) and c.prompt_weight_version >= 0):
            bad(f"{name}'s prompt_weight_version must be None or an int >= 0")
        if c.logprobs is not None and (not isinstance(c.logprobs, (list, tuple))
                                       or not all(_is_logprob(x) for x in c.logprobs)):
            bad(f"{name}'s logprobs must be None or a list of numbers <= 0")
        if len(c.weight_versions) != len(c.token_ids) or (c.logprobs is not None and len(c.logprobs) != len(c.token_ids)):
            bad(f"{name} has {len(c.token_ids)} token_ids, {len(c.weight_versions)} weight_versions and "
                f"{'no' if c.logprobs is None else len(c.logprobs)} logprobs; they must be equally long")
        # finished samples too: the output reports what the Sequence holds, NaN where logprobs were missing
        if c.logprobs is None and params.logprobs is not None:  # validated: False is None by now
            bad(f"{name} has no logprobs and sampling_params asks for them; resume with the params of its call")
        if params.logprobs and len(getattr(c, "top_logprobs", None) or []) != len(c.token_ids):
            bad(f"{name} needs one top_logprobs entry per token (sampling_params.logprobs={params.logprobs}); "
                "resume with the params of its call")
        if c.finish_reason != "abort":
            continue
        ends = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        stop = next((i for i, t in enumerate(c.token_ids) if t in ends), None)
        if stop is not None:
            bad(f"{name} holds token {c.token_ids[stop]} at position {stop}, where its sample would have stopped "
                "(an EOS or one of sampling_params.stop_token_ids); only unfinished samples go on")
        if params.stop and not isinstance(c.text, str):  # a stop string it holds would go unseen (read far back)
            bad(f"{name} has no text and sampling_params.stop is set: a stop string is looked for in the text; "
                "resume the output as generate returned it")
        held = next((s for s in params.stop if s in c.text), None)
        if held is not None:  # its text would be cut at the stop, the tokens before the resume with it
            bad(f"{name}'s text holds the stop string {held!r}, where its sample would have stopped (resume with "
                "the params of its call); only unfinished samples go on")
        if len(c.token_ids) >= params.max_tokens:
            bad(f"{name} already has {len(c.token_ids)} tokens, sampling_params.max_tokens={params.max_tokens}")
        total = len(out.prompt_token_ids) + len(c.token_ids)
        # a prompt of max_seq_len tokens gets one (generate takes it); a sample with tokens ends at that length
        if total > max_seq_len or c.token_ids and total == max_seq_len:
            bad(f"{name} and its prompt hold {total} tokens; sequences hold at most {max_seq_len} here")
    if (params.prompt_logprobs is not None and any(c.token_ids for c in comps)  # else the prompt never ran
            and len(out.prompt_logprobs or []) != len(out.prompt_token_ids)):
        bad(f"sampling_params.prompt_logprobs={params.prompt_logprobs} and the output has "
            f"{'no' if out.prompt_logprobs is None else len(out.prompt_logprobs)} prompt_logprobs for its "
            f"{len(out.prompt_token_ids)} prompt tokens; resume with the params of its call")
    if params.prompt_logprobs is not None and len(out.prompt_logprobs or []) == len(out.prompt_token_ids):
        # carried over, never scored again: each must score its own prompt token (the engine's always do)
        prompt, scores = out.prompt_token_ids, out.prompt_logprobs
        off = next((t for t in range(1, len(prompt)) if not (isinstance(scores[t], dict) and prompt[t] in scores[t])),
                   None)
        if off is not None:
            bad(f"its prompt_logprobs[{off}] does not score prompt_token_ids[{off}]={prompt[off]}: the prompt or its "
                "scores were changed; resume the output as generate returned it")


def resumed_sequences(out: RequestOutput, params, request_id: int, seeds: list[int]) -> list[Sequence]:
    """One Sequence per completion of `out` (checked by check_resumable), in index order: the finished ones as
    they are, the "abort" ones waiting to continue from their tokens with the sample's seed (their top logprobs
    carried over, and the request's prompt logprobs when complete; a prompt that never ran computes them anew)."""
    prompt = list(out.prompt_token_ids)
    seqs = []
    for c in sorted(out.outputs, key=lambda c: c.index):
        seq = Sequence(request_id, int(c.index), prompt + list(c.token_ids), params, seeds[c.index])
        seq.num_prompt_tokens = len(prompt)
        seq.logprobs = list(c.logprobs) if c.logprobs is not None else [math.nan] * len(c.token_ids)
        seq.weight_versions = list(c.weight_versions)
        seq.prompt_weight_version = c.prompt_weight_version  # admission resets it: kept for a sample that never runs
        # check_resumable found no stop string in the old text; the first check's window still reaches back
        # over the boundary, and a check from 0 would decode every prefix of a run of byte pieces
        seq.stop_checked = len(c.token_ids)
        if seq.top_logprobs is not None:  # logprobs=k >= 1
            seq.top_logprobs = list(c.top_logprobs or [])
        if params.prompt_logprobs is not None and len(out.prompt_logprobs or []) == len(prompt):
            seq.prompt_logprobs = list(out.prompt_logprobs)  # on every sample: none recomputes them, any reports them
        if c.finish_reason != "abort":
            seq.status, seq.finish_reason, seq.text = Status.FINISHED, c.finish_reason, c.text
            seq.stop_reason = c.stop_reason
        seqs.append(seq)
    return seqs
