"""How an EnginePool plans one generate call, without Ray: the call's requests checked as one Engine checks them,
each request's expected tokens, their spread over the engines, and each engine's share of the budgets; and the
version one weight update gives every engine."""
from __future__ import annotations

import dataclasses

from .inputs import integer_dtype, one_prompt, token_values
from .loop import sample_seed
from .outputs import RequestOutput
from .partial import RolloutBudget, keeps_request_id, resumed_prompts
from .sampling_params import SamplingParams

BYTES_PER_TEXT_TOKEN = 4  # a text prompt's token count, estimated from its UTF-8 bytes (balancing only)


def requests(prompts, sampling_params) -> tuple[list, list]:
    """generate()'s prompts as a list and one validated SamplingParams per prompt (a field set after
    construction is checked too, with the Engine's ValueError)."""
    prompts = [prompts] if one_prompt(prompts) or isinstance(prompts, RequestOutput) else prompts
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be one prompt or a non-empty list of prompts")
    resumed_prompts(prompts)  # refuses a request id resumed twice, which would go to two engines unseen
    params = sampling_params if sampling_params is not None else SamplingParams()
    params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
        raise ValueError("sampling_params must be one SamplingParams or a list with one per prompt")
    for p in {id(p): p for p in params}.values():
        p.validate()
    return [_sendable(prompt) for prompt in prompts], params


def _sendable(prompt):
    """`prompt` as it goes to an engine actor: a 1-D integer array as a list of ints (a tensor row of a batch
    pickles the batch's whole storage), in a dict too; anything else as it is, for the engine to check."""
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return {**prompt, "prompt_token_ids": _sendable(prompt["prompt_token_ids"])}
    if getattr(prompt, "ndim", None) == 1 and integer_dtype(prompt.dtype):
        return prompt.tolist()
    if isinstance(prompt, (list, tuple)) and prompt and getattr(prompt[0], "ndim", None) == 0:  # list(row)
        return token_values(prompt)
    return prompt


def _keeps_id(prompt) -> bool:
    """Whether an Engine resuming `prompt` keeps its request id (an int >= 0, never a bool), and so its seeds."""
    return isinstance(prompt, RequestOutput) and keeps_request_id(prompt.request_id)


def engine_budgets(budget: RolloutBudget | None, loads: list[int]) -> list[tuple]:
    """Each busy engine's (token_budget, time_budget, finish_fraction), `loads` being its share's expected
    tokens: the token budget split by split_tokens, the others as they are."""
    if budget is None:
        return [(None, None, None)] * len(loads)
    tokens = [None] * len(loads) if budget.token_budget is None else split_tokens(budget.token_budget, loads)
    return [(t, budget.time_budget, budget.finish_fraction) for t in tokens]


def split_tokens(total: int, loads: list[int]) -> list[int]:
    """`total` split in proportion to `loads` (largest remainders first, ties: the lower index), each part at
    least 1 (an Engine's token_budget is >= 1): the parts sum to `total`, or to len(loads) when that is more."""
    whole = sum(loads)
    parts = [max(1, total * load // whole) for load in loads]
    by_remainder = sorted(range(len(loads)), key=lambda i: (-(total * loads[i] % whole), i))
    for i in by_remainder[:max(0, total - sum(parts))]:
        parts[i] += 1
    while sum(parts) > max(total, len(loads)):  # the floors of 1 are paid back by the largest parts
        parts[max(range(len(parts)), key=lambda i: (parts[i], -i))] -= 1
    return parts


def expected_tokens(prompt, params: SamplingParams) -> int:
    """Tokens a request will hold at most: its prompt plus n x max_tokens."""
    if isinstance(prompt, RequestOutput):
        prompt = prompt.prompt_token_ids
    if isinstance(prompt, str):
        length = len(prompt.encode()) // BYTES_PER_TEXT_TOKEN + 1
    else:  # a malformed prompt counts 0 here; its engine rejects it with the Engine's own ValueError
        ids = prompt.get("prompt_token_ids", ()) if isinstance(prompt, dict) else prompt
        length = len(ids) if hasattr(ids, "__len__") else 0
    return length + params.n * params.max_tokens


def balance(costs: list[int], num_engines: int) -> list[list[int]]:
    """Request indices per engine: largest cost first, each to the engine with the least so far (ties: the
    lower engine); each engine's indices in ascending order."""
    loads, shares = [0] * num_engines, [[] for _ in range(num_engines)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        engine = min(range(num_engines), key=lambda e: (loads[e], e))
        loads[engine] += costs[i]
        shares[engine].append(i)
    return [sorted(share) for share in shares]


def numbered(prompts: list, params: list, seed: int, next_request: int) -> tuple[list, list, int]:
    """Request ids and seeds as one Engine gives them: a resumed output with an int id keeps it (its engine
    derives its seeds from it); the other resumed outputs, then the new prompts, take the next indices from
    `next_request` in order, past every kept id. Returns (each new prompt's id, None for a resumed one; the
    params, a missing seed filled from the index with the pool's `seed`; the pool's next index)."""
    index = max([next_request, *(int(p.request_id) + 1 for p in prompts if _keeps_id(p))])
    resumed = [i for i, p in enumerate(prompts) if isinstance(p, RequestOutput) and not _keeps_id(p)]
    new = [i for i, p in enumerate(prompts) if not isinstance(p, RequestOutput)]
    ids, params = [None] * len(prompts), list(params)
    for i in resumed + new:
        if params[i].seed is None:
            params[i] = dataclasses.replace(params[i], seed=sample_seed(seed, index))
        ids[i] = None if isinstance(prompts[i], RequestOutput) else index
        index += 1
    return ids, params, index


def update_version(current: list[int], version: int | None) -> int | None:
    """The version a target update gives every engine, from the engines' `current` ones: None is one above the
    highest (engines left apart by a failed update take the retry as they are). One given must be above every
    engine's, or nothing is sent: engines that took it beside one that refused it would give one version to two
    sets of weights."""
    if version is None:
        return max(current) + 1
    reached = {i: v for i, v in enumerate(current) if isinstance(version, int) and v >= version}
    if reached:
        raise ValueError(f"version={version!r} is not allowed; it must be above every engine's weight version, and "
                         f"engines {reached} (index: version) have reached it: give a higher one, or None")
    return version
