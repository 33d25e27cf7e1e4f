"""The GRPO adapters' argument checks: each refuses a bad argument with a ValueError naming it and what is allowed,
before the engine generates or sleeps and before the model is touched."""
from __future__ import annotations

import math
import numbers

import torch

from rollout_engine import SamplingParams
from rollout_engine.sampling_params import is_int

from .sync import check_model_fits, unwrap


def check_pad_id(pad_id, model=None) -> None:
    """pad_id pads the trainer model's input rows: a token id (an int >= 0), and one of the model's embedding rows."""
    if not is_int(pad_id) or pad_id < 0:
        raise ValueError(f"pad_id={pad_id!r} is not allowed; a token id (an int >= 0)")
    if model is not None and pad_id >= (rows := unwrap(model).get_input_embeddings().num_embeddings):
        raise ValueError(f"pad_id={pad_id} is not allowed; a token id of the model, below its {rows} embedding rows")


def check_current_version(current_version) -> None:
    """The engine version the trainer's weights are: None or an int >= 0 (a str or float would match no token's
    version, so every token would be off-policy without a word)."""
    if current_version is not None and (not is_int(current_version) or current_version < 0):
        raise ValueError(f"current_version={current_version!r} is not allowed; None or an int >= 0 (the engine's "
                         "weight_version that the trainer's weights are)")


def check_finished(rows) -> None:
    """ValueError naming the samples of `outputs` that ended "abort": a partial rollout's unfinished samples are
    meant to be resumed, and trained on as they are they would count a cut-off completion as a whole one."""
    aborted = [i for i, (_, c) in enumerate(rows) if c.finish_reason == "abort"]
    if aborted:
        raise ValueError(f"outputs has {len(aborted)} unfinished sample(s) (finish_reason 'abort') at indices "
                         f"{aborted[:8]}{' ...' if len(aborted) > 8 else ''} (prompt-major, sample-minor, as "
                         "rewards); every sample must have finished: resume them (pass their RequestOutputs back "
                         "to generate as prompts) or drop them with the rest of their prompt's group")


def check_logprobs(rows) -> None:
    """ValueError naming the first sample whose logprobs are missing or not one per token."""
    for i, (_, c) in enumerate(rows):
        if c.logprobs is None:
            raise ValueError("outputs need logprobs: generate with SamplingParams(logprobs=True)")
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(f"outputs' sample {i} has {len(c.token_ids)} tokens but {len(c.logprobs)} logprobs")


def is_logprob(x) -> bool:
    """A logprob as the engine reports it: a real number (not a bool), finite and <= 0."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and -math.inf < x <= 0


def rewards_tensor(rewards, count: int) -> torch.Tensor:
    """`rewards` as a float32 tensor of shape (count,), one per sample, or a ValueError naming rewards."""
    try:
        out = torch.as_tensor(rewards, dtype=torch.float32)
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"rewards must be numbers, one per sample: {err}") from None
    if tuple(out.shape) != (count,):
        raise ValueError(f"rewards has shape {tuple(out.shape)}; it must be ({count},), one number per sample")
    return out


def check_logprob_values(old_logprobs: torch.Tensor) -> None:
    """ValueError naming the samples (rows) holding a value that is no logprob (NaN, inf, above 0): the loss would
    be NaN, or its ratios wrong, with nothing said."""
    bad = (~(torch.isfinite(old_logprobs) & (old_logprobs <= 0))).any(1).nonzero().flatten().tolist()
    if bad:
        raise ValueError(f"outputs' samples {bad[:8]}{' ...' if len(bad) > 8 else ''} have logprobs that are NaN, "
                         "inf or above 0; a logprob is a finite number <= 0")


def check_loss_inputs(batch, advantages, **per_token) -> None:
    """ValueError unless `advantages` is (N,) and every per-token tensor given (None: absent) has completion_mask's
    shape [N, L]: broadcasting a mis-shaped one runs silently (advantages [N, 1] against [N, L] give a loss of
    exactly 0, since a group's advantages sum to 0; [1] gives every sample the first one's)."""
    shape = tuple(batch.completion_mask.shape)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != shape[:1]:
        raise ValueError(f"advantages is {describe(advantages)}; it must be a tensor of shape ({shape[0]},), one "
                         "advantage per sample (flatten an [N, 1] tensor)")
    for name, x in per_token.items():
        if x is not None and (not isinstance(x, torch.Tensor) or tuple(x.shape) != shape):
            raise ValueError(f"{name} is {describe(x)}; it must be a tensor of completion_mask's shape {shape}")


def describe(x) -> str:
    return f"of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def check_cap(name: str, cap, none_allowed: bool) -> None:
    """A truncated-importance-sampling cap: a number > 0 (inf: no truncation), or None (no TIS) where allowed.
    0 would zero the loss, a negative cap flip its sign, NaN make it NaN."""
    if cap is None and none_allowed:
        return
    if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not cap > 0:  # NaN fails cap > 0
        allowed = "None (no TIS) or a number > 0" if none_allowed else "a number > 0"
        raise ValueError(f"{name}={cap!r} is not allowed; {allowed} (the importance weight's cap; inf: no cap)")


def check_clip(clip_eps, dual_clip=None) -> None:
    """PPO's clip range, a finite number in (0, 1), and the dual clip c, None (none) or a finite number > 1.

    A clip_eps <= 0 clamps every ratio to a point or an empty range (a negative one pins it at 1 - clip_eps), one
    >= 1 lets the lower bound reach 0, NaN makes the loss NaN. A dual clip c <= 1 bounds a negative-advantage
    token's surrogate at or above its value at ratio 1, so on-policy tokens (ratio exactly 1) get no gradient."""
    if isinstance(clip_eps, bool) or not isinstance(clip_eps, numbers.Real) or not 0 < clip_eps < 1:
        raise ValueError(f"clip_eps={clip_eps!r} is not allowed; a number in (0, 1) (the ratio is clipped to "
                         "[1 - clip_eps, 1 + clip_eps])")
    if dual_clip is not None and (isinstance(dual_clip, bool) or not isinstance(dual_clip, numbers.Real)
                                  or not 1 < dual_clip < float("inf")):
        raise ValueError(f"dual_clip={dual_clip!r} is not allowed; None (no dual clip) or a finite number > 1 (a "
                         "negative-advantage token's surrogate is bounded below by dual_clip * advantage)")


def check_step_arguments(engine, model, reward_fn, params, pad_id, micro_batch, tis_cap) -> None:
    """hybrid_step's arguments, checked before the engine generates or sleeps: a refusal costs nothing then.
    pad_id pads the trainer model's input rows: one of its embedding rows. The model's weights must fit the
    engine's (check_model_fits), or the sync after training would fail with the engine asleep."""
    check_cap("tis_cap", tis_cap, none_allowed=True)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params is a {type(params).__name__}; it must be a SamplingParams")
    params.validate()
    if params.n < 2:
        raise ValueError(f"params.n={params.n} is not allowed; GRPO needs n >= 2 samples per prompt (a group of one "
                         "has no spread to compare against)")
    if params.logprobs is None:
        raise ValueError("params.logprobs=None is not allowed; 0 or more (the rollout's logprobs are the behaviour "
                         "policy's)")
    if micro_batch is not None and (not is_int(micro_batch) or micro_batch < 1):
        raise ValueError(f"micro_batch={micro_batch!r} is not allowed; None (the whole batch at once) or an int >= 1")
    check_pad_id(pad_id, model)
    if not callable(reward_fn):
        raise ValueError(f"reward_fn is a {type(reward_fn).__name__}; it must be callable as "
                         "reward_fn(prompt_index, completion)")
    check_model_fits(engine, model)


def check_gradients(model) -> None:
    """FloatingPointError naming the parameters whose gradient holds NaN or inf (a finite loss can still give one,
    e.g. an overflow inside the backward): the optimizer would write it into every weight it touches."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if grads and not bool(torch.stack([g.isfinite().all() for g in grads]).all()):  # one host sync
        bad = [name for name, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
        raise FloatingPointError(f"non-finite gradients in {len(bad)} parameters (e.g. {', '.join(bad[:3])}); the "
                                 "model is not stepped")
