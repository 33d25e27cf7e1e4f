"""A small GRPO/PPO toolkit around the engine's public API (not a framework).

    outs = engine.generate(prompts, SamplingParams(n=G, ...))       # rollouts + behaviour logprobs
    batch = build_batch(outs, rewards, pad_id)                        # padded ids, masks, old logprobs
    adv = group_advantages(batch.rewards, G)                           # GRPO: normalise within each prompt
    loss = policy_loss(token_logprobs(model, batch), batch, adv)       # clipped policy gradient

`hybrid_step` runs one whole RL step with the engine asleep while the trainer works.
"""
from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass

import torch

from rollout_engine import processed_logprobs

from .sync import sync_weights


@dataclass
class RolloutBatch:
    input_ids: torch.Tensor         # [N, L] prompt + completion, right-padded
    attention_mask: torch.Tensor    # [N, L]
    completion_mask: torch.Tensor   # [N, L] 1 where the token at t was sampled (its logprob sits at t)
    old_logprobs: torch.Tensor      # [N, L] the engine's logprob of each sampled token (0 elsewhere)
    rewards: torch.Tensor           # [N]


def build_batch(outputs, rewards, pad_id: int) -> RolloutBatch:
    """Flatten RequestOutputs (prompt-major, sample-minor) and their per-sample rewards into tensors."""
    rows = [(o.prompt_token_ids, c) for o in outputs for c in o.outputs]
    if len(rows) != len(rewards):
        raise ValueError(f"rewards has {len(rewards)} entries for {len(rows)} samples")
    width = max(len(p) + len(c.token_ids) for p, c in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), width, dtype=torch.long)
    completion = torch.zeros(len(rows), width)
    old = torch.zeros(len(rows), width)
    for i, (prompt, c) in enumerate(rows):
        p, n = len(prompt), len(c.token_ids)
        if c.logprobs is None:
            raise ValueError("outputs need logprobs: generate with SamplingParams(logprobs=True)")
        ids[i, : p + n] = torch.tensor(prompt + c.token_ids)
        attention[i, : p + n] = 1
        completion[i, p : p + n] = 1
        old[i, p : p + n] = torch.tensor(c.logprobs)
    return RolloutBatch(ids, attention, completion, old, torch.as_tensor(rewards, dtype=torch.float32))


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages: each reward minus its group's mean, over the group's std (groups are consecutive)."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size={group_size!r} is not allowed; an int >= 2 (a group of one sample has no "
                         "spread to compare against: sample n >= 2 per prompt)")
    if rewards.numel() % group_size:
        raise ValueError(f"rewards has {rewards.numel()} values, not a multiple of group_size={group_size}")
    groups = rewards.view(-1, group_size)
    return ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + eps)).flatten()


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

    With `params` (the rollout's SamplingParams) they are processed as the engine's default logprobs are:
    params.temperature (not `temperature`), then top-k / top-p / min-p, renormalised over the kept tokens
    (rollout_engine.processed_logprobs); an importance ratio against the engine's logprobs then compares like
    with like. Without `params`: the softmax of the logits over `temperature`."""
    check_rotary_buffers(model)
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    if params is not None:
        picked = processed_logprobs(logits[:, :-1], batch.input_ids[:, 1:], params)
        # a token the filters drop (at a prompt or padding position) is -inf, and masking it (-inf * 0) gives NaN:
        # a finite floor instead, which still means probability 0
        picked = picked.clamp(min=torch.finfo(picked.dtype).min)
    else:
        picked = (logits[:, :-1] / temperature).log_softmax(-1).gather(2, batch.input_ids[:, 1:, None])[..., 0]
    return torch.nn.functional.pad(picked, (1, 0))


def policy_loss(new_logprobs: torch.Tensor, batch: RolloutBatch, advantages: torch.Tensor, clip_eps: float = 0.2,
                trainer_old_logprobs: torch.Tensor | None = None, is_cap: float = 2.0) -> torch.Tensor:
    """Clipped policy-gradient loss with the engine's logprobs as the behaviour policy.

    Truncated importance sampling (TIS): with `trainer_old_logprobs` (the trainer's own logprobs before the
    update) the ratio is taken against those and each token's term is multiplied by the weight
    min(exp(trainer_old - engine), is_cap), detached: it corrects for the rollout engine sampling from a
    slightly different distribution (an fp8 engine, or bf16 numerics) without letting a rare token whose
    rollout probability was far too low dominate the step."""
    mask = batch.completion_mask
    reference = batch.old_logprobs if trainer_old_logprobs is None else trainer_old_logprobs
    ratio = torch.exp((new_logprobs - reference) * mask)
    adv = advantages[:, None]
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if trainer_old_logprobs is not None:
        surrogate = surrogate * torch.exp((trainer_old_logprobs - batch.old_logprobs) * mask).clamp(max=is_cap).detach()
    return -(surrogate * mask).sum() / mask.sum().clamp(min=1)


def hybrid_step(engine, model, optimizer, prompts, reward_fn, params, pad_id: int,
                micro_batch: int | None = None, tis_cap: float | None = None) -> dict:
    """One RL step on shared hardware: generate -> sleep -> train -> wake weights -> sync -> wake KV.

    `reward_fn(prompt_index, completion)` scores one sample. The gradient is accumulated over
    micro-batches of `micro_batch` samples (all at once by default). `tis_cap` (say 2.0): truncated
    importance sampling against the rollout's logprobs (policy_loss); one optimizer step per batch, so the
    trainer's logprobs before the update are its current ones, detached. Returns rewards and timings."""
    if tis_cap is not None and (isinstance(tis_cap, bool) or not isinstance(tis_cap, (int, float)) or tis_cap <= 0):
        raise ValueError(f"tis_cap={tis_cap!r} is not allowed; None or a positive number (the weight's cap)")
    timings, t = {}, time.perf_counter()

    def lap(name):
        nonlocal t
        now = time.perf_counter()
        timings[name] = now - t
        t = now

    outputs = engine.generate(prompts, params, use_tqdm=False)
    lap("generate")
    engine.sleep(level=2)  # the trainer gets the memory; the weights come back from the trainer anyway
    lap("sleep")
    rewards = [reward_fn(i, c) for i, o in enumerate(outputs) for c in o.outputs]
    device = next(model.parameters()).device
    batch = RolloutBatch(*(t.to(device) for t in vars(build_batch(outputs, rewards, pad_id)).values()))
    advantages = group_advantages(batch.rewards, params.n)
    model.train()
    optimizer.zero_grad()
    size, tokens, loss = len(advantages), batch.completion_mask.sum().clamp(min=1), 0.0
    for start in range(0, size, micro_batch or size):
        part = RolloutBatch(*(t[start : start + (micro_batch or size)] for t in vars(batch).values()))
        share = part.completion_mask.sum() / tokens  # micro-batch means, weighted back to the batch mean
        new = token_logprobs(model, part, params=params)  # the rollout's temperature and filters
        tis = {} if tis_cap is None else {"trainer_old_logprobs": new.detach(), "is_cap": tis_cap}
        part_loss = policy_loss(new, part, advantages[start : start + (micro_batch or size)], **tis) * share
        part_loss.backward()
        loss += part_loss.item()
    optimizer.step()
    model.eval()
    lap("train")
    engine.wake(tags=["weights"])
    sync_weights(engine, model)
    lap("sync")
    engine.wake(tags=["kv_cache"])
    lap("wake")
    return {"reward": batch.rewards.mean().item(), "loss": loss, "timings": timings}
