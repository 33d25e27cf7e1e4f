"""A small GRPO/PPO toolkit around the engine's public API (not a framework).

    outs = engine.generate(prompts, SamplingParams(n=G, ...))       # rollouts + behaviour logprobs
    batch = build_batch(outs, rewards, pad_id)                        # padded ids, masks, old logprobs
    adv = group_advantages(batch.rewards, G)                           # GRPO: normalise within each prompt
    loss = policy_loss(token_logprobs(model, batch), batch, adv)       # clipped policy gradient

`hybrid_step` runs one whole RL step with the engine asleep while the trainer works.
"""
from __future__ import annotations

import numbers
import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from rollout_engine import SamplingParams, processed_logprobs
from rollout_engine.sampling_params import is_int

from .step_checks import (check_cap, check_clip, check_finished, check_gradients, check_loss_inputs, check_pad_id,
                          check_logprob_values, check_logprobs,
                          check_step_arguments, rewards_tensor)
from .sync import sync_weights, weights_sleep_level


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor         # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor    # [N, L]
    completion_mask: torch.Tensor   # [N, L] 1 where the token at t was sampled (its logprob sits at t)
    old_logprobs: torch.Tensor      # [N, L] the engine's logprob of each sampled token (0 elsewhere)
    rewards: torch.Tensor           # [N]


def build_batch(outputs, rewards, pad_id: int) -> RolloutBatch:
    """Flatten RequestOutputs (prompt-major, sample-minor) and their per-sample rewards into tensors.
    A sample with finish_reason "abort" (a partial rollout, unfinished) is a ValueError (check_finished)."""
    rows = [(o.prompt_token_ids, c) for o in outputs for c in o.outputs]
    if len(rows) != len(rewards):
        raise ValueError(f"rewards has {len(rewards)} entries for {len(rows)} samples")
    if not rows:
        raise ValueError("outputs holds no samples; build_batch needs at least one RequestOutput with a completion")
    check_finished(rows)
    check_logprobs(rows)
    check_pad_id(pad_id)
    width = max(len(p) + len(c.token_ids) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    completion = torch.zeros(len(rows), width)
    old = torch.zeros(len(rows), width)
    for i, (prompt, c) in enumerate(rows):
        p, n = len(prompt), len(c.token_ids)
        ids[i, : p + n] = torch.tensor(prompt + c.token_ids)
        attention[i, : p + n] = 1
        completion[i, p : p + n] = 1
        old[i, p : p + n] = torch.tensor(c.logprobs)
    check_logprob_values(old)
    return RolloutBatch(ids, attention, completion, old, rewards_tensor(rewards, len(rows)))


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (groups are consecutive).
    A group whose rewards are all equal gets advantages of exactly 0. The arithmetic runs in float64; the result
    has the rewards' dtype (integer or bool rewards: float32). A NaN or inf reward is a ValueError naming its index.
    `eps` (added to each group's std): a finite number >= 0; a negative one could flip the advantages' sign."""
    if not is_int(group_size) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} is not allowed; an int >= 2 (a group of one sample has no "
                         "spread to compare against: sample n >= 2 per prompt)")
    group_size = int(group_size)  # numpy's integers too
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not 0 <= eps < float("inf"):
        raise ValueError(f"eps={eps!r} is not allowed; a finite number >= 0 (added to each group's std)")
    rewards = torch.as_tensor(rewards)
    if not rewards.is_floating_point():
        rewards = rewards.float()  # mean() and std() take floats only
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} values, not a multiple of group_size={group_size}")
    bad = (~torch.isfinite(rewards.flatten())).nonzero().flatten().tolist()
    if bad:  # one would make its whole group's advantages NaN, and a step on them NaN weights
        raise ValueError(f"rewards has non-finite values at indices {bad[:8]}{' ...' if len(bad) > 8 else ''}; "
                         "every reward must be a finite number")
    groups = rewards.view(-1, group_size).double()  # a float32 mean of equal rewards can miss them by an ulp
    spread = groups.amax(1, keepdim=True) > groups.amin(1, keepdim=True)
    centred = groups - groups.mean(1, keepdim=True)
    advantages = torch.where(spread, centred / (groups.std(1, keepdim=True) + eps), 0.0)  # all equal: no signal
    return advantages.flatten().to(rewards.dtype)


def check_rotary_buffers(model) -> list[str]:
    """Warn (once per model) when its rotary `inv_freq` buffers are not float32, and name them.

    `model.to(torch.bfloat16)` on a transformers model also casts those buffers: every position's angles are then
    rounded, and the trainer's logprobs drift from the engine's (which keeps them in float32) far beyond bf16 noise.
    Load the model in its dtype instead: `from_pretrained(path, dtype=torch.bfloat16)`."""
    if model in _checked_models:
        return []
    _checked_models.add(model)
    bad = [name for name, buf in model.named_buffers() if name.endswith("inv_freq") and buf.dtype != torch.float32]
    if bad:
        dtype = dict(model.named_buffers())[bad[0]].dtype
        warnings.warn(f"rotary buffers {bad[:3]} are {dtype}, not float32 (a model.to({dtype}) casts them): its "
                      "logprobs will not match the engine's; load the model in its dtype with "
                      "from_pretrained(..., dtype=...) instead of converting it", stacklevel=3)
    return bad


_checked_models: weakref.WeakSet = weakref.WeakSet()


def token_logprobs(model, batch: RolloutBatch, temperature: float = 1.0, params=None) -> torch.Tensor:
    """[N, L] log-probability under `model` of each token given the ones before it (0 at position 0).

    With `params` (the rollout's SamplingParams) they are in params.logprobs_mode, as the engine reported them:
    "processed" (the default): params.temperature (not `temperature`), then top-k / top-p / min-p, renormalised
    over the kept tokens (rollout_engine.processed_logprobs); "temperature": the softmax over params.temperature,
    no filter; "raw": the softmax of the logits. An importance ratio against the engine's logprobs then compares
    like with like. Without `params`: the softmax of the logits over `temperature`. Temperature 0 (greedy) divides
    by 1, as the engine's logprobs do; a negative or non-finite one is a ValueError. A sampled token that the
    trainer's own filter drops gets probability 0 (floor_dropped), and a warning (dropped_tokens counts them)."""
    divisor = softmax_divisor(temperature, params)
    check_rotary_buffers(model)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    if params is not None and params.logprobs_mode == "processed":
        picked = floor_dropped(processed_logprobs(logits[:, :-1], batch.input_ids[:, 1:], params))
        if dropped_tokens(picked, batch.completion_mask[:, 1:]):
            warnings.warn("the trainer's top-k/top-p/min-p filter drops tokens the engine sampled (numerics differ "
                          "at its edge): ratio 0, no gradient; the loss statistics count them as 'dropped_tokens'",
                          stacklevel=2)  # one text: the warnings registry shows it once per call site
    else:
        picked = (logits[:, :-1] / divisor).log_softmax(-1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0))


def floor_dropped(logprobs: torch.Tensor) -> torch.Tensor:
    """`logprobs` with -inf raised to the dtype's most negative finite number, which still means probability 0.

    A token the filters drop has logprob -inf: a prompt or padding token, which a loss masks out (-inf * 0 would
    be NaN, its gradient too), or a sampled token at the filter's edge that the trainer's numerics (bf16, say) cut
    and the engine's kept. The floor's gradient is 0: such a sampled token's ratio is 0, it teaches nothing."""
    return logprobs.clamp(min=torch.finfo(logprobs.dtype).min)


def dropped_tokens(logprobs: torch.Tensor, completion_mask: torch.Tensor) -> int:
    """How many sampled tokens (completion_mask set) have probability 0 in `logprobs` (-inf or floor_dropped's)."""
    return int((completion_mask.bool() & (logprobs.detach() <= torch.finfo(logprobs.dtype).min)).sum().item())


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`x` where `mask` (0/1, or bool) is set, 0 elsewhere: a selection, not a product, so a NaN or inf outside the
    mask (a logprob of a prompt token a filter drops) reaches neither the loss nor the gradient."""
    return torch.where(mask.bool(), x, 0)


def softmax_divisor(temperature, params) -> float:
    """What token_logprobs divides the logits by where no filter applies: the temperature (params' if given), 1 at
    temperature 0 (the engine reports a greedy token's logprob at temperature 1) and in "raw" mode. The
    temperature is checked by the engine's own rule (SamplingParams: 0, or a finite number >= MIN_TEMPERATURE)."""
    if params is None:
        params = SamplingParams(temperature=temperature)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params is a {type(params).__name__}; the rollouts' SamplingParams, or None")
    params.validate()
    return 1.0 if params.logprobs_mode == "raw" else params.temperature or 1.0


def policy_loss(new_logprobs: torch.Tensor, batch: RolloutBatch, advantages: torch.Tensor, clip_eps: float = 0.2,
                trainer_old_logprobs: torch.Tensor | None = None, is_cap: float = 2.0) -> torch.Tensor:
    """Clipped policy-gradient loss with the engine's logprobs as the behaviour policy: the mean over every
    completion token of the batch (a long sample weighs by its length, as in DAPO; the GRPO paper averages each
    sample's tokens first), with no KL term to a reference model (add one to the returned loss if wanted).

    Truncated importance sampling (TIS): with `trainer_old_logprobs` (the trainer's own logprobs before the
    update) the ratio is taken against those, detached, and each token's term is multiplied by the weight
    min(exp(trainer_old - engine), is_cap), detached: it corrects for the rollout engine sampling from a
    slightly different distribution (an fp8 engine, or bf16 numerics) without letting a rare token whose
    rollout probability was far too low dominate the step.

    Shapes: `advantages` (N,), one per sample; `new_logprobs` and `trainer_old_logprobs` completion_mask's [N, L].
    Anything else is a ValueError: broadcasting would run silently (advantages [N, 1] give a loss of exactly 0).
    `is_cap`: a number > 0 (inf: no truncation). `clip_eps`: a finite number in (0, 1)."""
    check_loss_inputs(batch, advantages, new_logprobs=new_logprobs, trainer_old_logprobs=trainer_old_logprobs)
    check_cap("is_cap", is_cap, none_allowed=False)
    check_clip(clip_eps)
    mask = batch.completion_mask
    # The reference is a constant of the step: one carrying a graph would cancel new_logprobs' gradient.
    reference = (batch.old_logprobs if trainer_old_logprobs is None else trainer_old_logprobs).detach()
    log_ratio = masked(new_logprobs - reference, mask)
    if trainer_old_logprobs is not None:
        weight = torch.exp(masked(trainer_old_logprobs - batch.old_logprobs, mask)).clamp(max=is_cap).detach()
        # A token of weight 0 (the trainer's filter dropped it: its floored reference) teaches nothing; its ratio
        # against that floor is inf, and inf x 0 would make the loss NaN.
        log_ratio = torch.where(weight > 0, log_ratio, 0.0)
    ratio = torch.exp(log_ratio)
    adv = advantages.detach()[:, None]  # constants of the step: a critic's output gets no policy gradient
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if trainer_old_logprobs is not None:
        surrogate = surrogate * weight
    return -masked(surrogate, mask).sum() / mask.sum().clamp(min=1)


def hybrid_step(engine, model, optimizer, prompts, reward_fn, params, pad_id: int,
                micro_batch: int | None = None, tis_cap: float | None = None) -> dict:
    """One RL step on shared hardware: generate -> sleep -> train -> wake weights -> sync -> wake KV. The sleep
    discards the weights (level 2), or keeps them on the host (level 1) where the engine holds a speculative draft
    model, whose weights the trainer does not push (sync.weights_sleep_level).

    `reward_fn(prompt_index, completion)` scores one sample. The gradient is accumulated over micro-batches of
    `micro_batch` samples (all at once by default). `tis_cap` (say 2.0): truncated importance sampling against the
    rollout's logprobs (policy_loss); one optimizer step per batch, so the trainer's logprobs before the update are
    its current ones, detached. Returns the mean reward, the loss, dropped_tokens (sampled tokens the trainer's
    filter drops: token_logprobs) and timings.

    Every argument is checked before the engine generates or sleeps. A failure after the sleep (reward_fn
    raising, a NaN reward, a non-finite loss or gradient: FloatingPointError before the step) leaves the model's
    weights as they were (no optimizer step; gradients cleared) and the engine awake, synced with those weights
    as after a step (weight_version goes up by one); then the error propagates."""
    check_step_arguments(engine, model, reward_fn, params, pad_id, micro_batch, tis_cap)
    timings, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        now = time.perf_counter()
        timings[name] = now - t
        t = now

    outputs = engine.generate(prompts, params, use_tqdm=False)
    lap("generate")
    engine.sleep(level=weights_sleep_level(engine))  # the trainer gets the memory; the weights come back from it
    lap("sleep")
    try:
        stats = train_step(model, optimizer, outputs, reward_fn, params, pad_id, micro_batch, tis_cap)
    except Exception:
        optimizer.zero_grad()  # a failed step leaves no gradient behind for the next one to add to
        raise
    finally:  # after a failure too: an engine asleep without weights would refuse every later call
        model.eval()
        lap("train")
        engine.wake(tags=["weights"])
        try:
            sync_weights(engine, model)
            lap("sync")
        finally:  # a refused sync leaves the engine awake (its weights incomplete), not asleep
            engine.wake(tags=["kv_cache"])
            lap("wake")
    return stats | {"timings": timings}


def train_step(model, optimizer, outputs, reward_fn, params, pad_id: int, micro_batch: int | None,
               tis_cap: float | None) -> dict:
    """hybrid_step's training: rewards, advantages, gradients accumulated over micro-batches, one optimizer step.
    Returns the mean reward, the loss and dropped_tokens. A non-finite micro-batch loss raises FloatingPointError
    before its backward, and non-finite gradients before the optimizer step: the optimizer never steps on NaN/inf."""
    rewards = [reward_fn(i, c) for i, o in enumerate(outputs) for c in o.outputs]
    device = next(model.parameters()).device
    batch = RolloutBatch(*(t.to(device) for t in vars(build_batch(outputs, rewards, pad_id)).values()))
    advantages = group_advantages(batch.rewards, params.n)
    model.train()
    optimizer.zero_grad()
    size, tokens, loss, dropped = len(advantages), batch.completion_mask.sum().clamp(min=1), 0.0, 0
    step = micro_batch or size
    for start in range(0, size, step):
        part = RolloutBatch(*(t[start : start + step] for t in vars(batch).values()))
        share = part.completion_mask.sum() / tokens  # micro-batch means, weighted back to the batch mean
        new = token_logprobs(model, part, params=params)  # the rollout's temperature, filters and logprobs_mode
        tis = {} if tis_cap is None else {"trainer_old_logprobs": new.detach(), "is_cap": tis_cap}
        part_loss = policy_loss(new, part, advantages[start : start + step], **tis) * share
        if not torch.isfinite(part_loss):
            raise FloatingPointError(f"non-finite loss {part_loss.item()} on samples {start}..{start + len(new) - 1}; "
                                     "the model is not stepped")
        part_loss.backward()
        loss += part_loss.item()
        dropped += dropped_tokens(new, part.completion_mask)
    check_gradients(model)
    optimizer.step()
    return {"reward": batch.rewards.mean().item(), "loss": loss, "dropped_tokens": dropped}
