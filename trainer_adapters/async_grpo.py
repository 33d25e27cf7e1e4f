"""One-step-off-policy GRPO over AsyncEngine: the rollouts of step t+1 are sampled while step t trains.

    rollouts = AsyncRollouts(path, **engine_kwargs)      # async_rollouts.py: AsyncEngine + a client loop thread
    pending = rollouts.submit(prompts, params)            # one AsyncEngine.generate request per prompt (n samples)
    for step in range(steps):
        outputs = pending.result()                         # batch t: sampled (mostly) by the previous policy
        pending = rollouts.submit(next_prompts, params)    # batch t+1 starts now, beside the training below
        stats = rollouts.step(model, optimizer, outputs, rewards, params.n, pad_id, params=params)
        rollouts.push_weights(model)                       # pause("retract") -> update_weights -> continue

Threads: the trainer (the caller's thread) and the AsyncEngine's loop thread do the work; a third thread
only runs the asyncio loop that hands requests to the engine and answers the futures.

Importance ratios, per token. Every completion token carries the weight version that produced it
(CompletionOutput.weight_versions). A token produced by the version the trainer holds now is on-policy: its
reference logprob is the trainer's own (detached), so its ratio is exactly 1 and its gradient is the plain
policy gradient (the engine/trainer numerical mismatch does not enter). A token produced by an older
version is off-policy: its reference is the behaviour logprob the engine reported, and the ratio
exp(logp_now - logp_behaviour) is clipped PPO-style, min(r A, clip(r, 1-eps, 1+eps) A).

Pause mode around the weight push. "retract" (the default) frees the KV of the requests in flight and keeps
their tokens; they are re-prefilled under the new weights, so every token labelled with the new version
really is the new policy's (on-policy, ratio 1 is exact). The price is one re-prefill of each in-flight
sequence (prompt + tokens so far) per update. "keep" keeps their KV: no recompute, but tokens sampled after
the switch attend to KV that the old weights computed, so they are neither policy's; with "keep" such
tokens (any token after an older one in its sample, or after a prompt whose KV older weights computed: a
request part-way through its prefill at the switch, CompletionOutput.prompt_weight_version) are treated as
off-policy, their reference being the engine's reported logprob (what actually sampled them).
"""
from __future__ import annotations

import torch

from .grpo import (RolloutBatch, build_batch, dropped_tokens, group_advantages, masked, softmax_divisor,
                   token_logprobs)
from .step_checks import check_clip, check_current_version, check_gradients, check_loss_inputs, check_pad_id

PUSH_MODES = ("retract", "keep")


# ------------------------------------------------------------------ the loss: per-token importance ratios


def token_versions(outputs, width: int) -> torch.Tensor:
    """[N, width] long: the weight version that produced the token at t (its logprob sits at t); at the prompt's
    last one, the one that computed the prompt's KV; -1 elsewhere. Rows: build_batch's (prompt-major)."""
    rows = [(o.prompt_token_ids, c) for o in outputs for c in o.outputs]
    versions = torch.full((len(rows), width), -1, dtype=torch.long)
    for i, (prompt, c) in enumerate(rows):
        if len(c.weight_versions) != len(c.token_ids):
            raise ValueError(f"sample {i} has {len(c.token_ids)} tokens but {len(c.weight_versions)} weight versions")
        versions[i, len(prompt): len(prompt) + len(c.token_ids)] = torch.tensor(c.weight_versions, dtype=torch.long)
        versions[i, len(prompt) - 1] = -1 if c.prompt_weight_version is None else c.prompt_weight_version
    return versions


def on_policy_mask(versions: torch.Tensor, completion_mask: torch.Tensor, current_version: int,
                   mode: str = "retract") -> torch.Tensor:
    """[N, L] bool: sampled tokens that the trainer's current policy produced.

    "retract": exactly the tokens of `current_version`. "keep": those, minus any token sampled over KV that older
    weights computed: one after an older token in its sample, or after a prompt whose KV an older version made.
    `current_version` None: the trainer's weights are no engine version's (it stepped since its last push), so
    no token is on-policy."""
    if mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; one of {PUSH_MODES}")
    check_current_version(current_version)
    sampled = completion_mask.bool()
    if current_version is None:
        return torch.zeros_like(sampled)
    current = sampled & (versions == current_version)
    if mode == "keep":
        stale_before = torch.cumsum(((versions >= 0) & (versions != current_version)).long(), dim=1) > 0
        current = current & ~stale_before
    return current


def importance_ratios(new_logprobs: torch.Tensor, batch: RolloutBatch, on_policy: torch.Tensor) -> torch.Tensor:
    """exp(logp_now - reference): reference = logp_now detached on on-policy tokens (ratio exactly 1, gradient
    intact), the engine's behaviour logprob on off-policy ones; 1 outside the completion."""
    reference = torch.where(on_policy, new_logprobs.detach(), batch.old_logprobs)
    return torch.exp(masked(new_logprobs - reference, batch.completion_mask))


def off_policy_loss(new_logprobs: torch.Tensor, batch: RolloutBatch, advantages: torch.Tensor,
                    on_policy: torch.Tensor, clip_eps: float = 0.2,
                    dual_clip: float | None = 3.0) -> tuple[torch.Tensor, dict]:
    """Clipped policy-gradient loss with per-token importance ratios; returns (loss, statistics). The statistics'
    "dropped_tokens": sampled tokens the trainer's filter gives probability 0 (grpo.token_logprobs): ratio 0.

    `dual_clip` c (Ye et al. 2020): a negative-advantage token's surrogate is bounded below by c * A, so a
    token the newer policy made much likelier than the behaviour policy did (r >> 1) cannot dominate the step:
    None or a finite number > 1; `clip_eps` a finite number in (0, 1) (step_checks.check_clip).
    Shapes as grpo.policy_loss's: `advantages` (N,); `new_logprobs` and `on_policy` completion_mask's [N, L]."""
    check_loss_inputs(batch, advantages, new_logprobs=new_logprobs, on_policy=on_policy)
    check_clip(clip_eps, dual_clip)
    mask = batch.completion_mask
    ratio = importance_ratios(new_logprobs, batch, on_policy)
    adv = advantages.detach()[:, None]  # constants of the step: a critic's output gets no policy gradient
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    if dual_clip is not None:
        surrogate = torch.where(adv < 0, torch.maximum(surrogate, dual_clip * adv), surrogate)
    tokens = mask.sum().clamp(min=1)
    loss = -masked(surrogate, mask).sum() / tokens
    with torch.no_grad():
        off = mask.bool() & ~on_policy
        r = ratio.detach()
        clipped = ((adv > 0) & (r > 1 + clip_eps)) | ((adv < 0) & (r < 1 - clip_eps))  # no gradient there
        if dual_clip is not None:
            clipped = clipped | ((adv < 0) & (r > dual_clip))
        stats = {"tokens": int(mask.sum().item()), "off_policy_tokens": int(off.sum().item()),
                 "off_policy_fraction": (off.sum() / tokens).item(),
                 "ratio_mean_off": r[off].mean().item() if off.any() else 1.0,
                 "ratio_max_dev_on": (r[on_policy] - 1).abs().max().item() if on_policy.any() else 0.0,
                 "clip_fraction": (clipped & mask.bool()).sum().item() / tokens.item(),
                 "dropped_tokens": dropped_tokens(new_logprobs, mask)}  # probability 0 under the trainer's filter
    return loss, stats


def off_policy_step(model, optimizer, outputs, rewards, group_size: int, pad_id: int, current_version: int | None, *,
                    mode: str, temperature: float = 1.0, clip_eps: float = 0.2, dual_clip: float | None = 3.0,
                    params=None) -> dict:
    """One optimizer step on a batch that may mix policy versions. Returns the loss and the ratio statistics.
    `mode`: the pause mode the weights were pushed under (AsyncRollouts.push_mode; AsyncRollouts.step passes it),
    which decides which tokens are on-policy: no default, as the wrong one gives ratio 1 to tokens sampled over
    the old weights' KV ("keep") or treats exact ones as off-policy ("retract").
    `params`: the rollouts' SamplingParams, so the trainer's logprobs are processed as the engine's were
    (its temperature, then top-k / top-p / min-p: grpo.token_logprobs); without it, a softmax over `temperature`.
    `group_size` must be every output's sample count (len(o.outputs), the rollouts' n): the advantages are
    normalised over each run of group_size samples. Every sample must have finished: one that ended "abort" (a
    partial rollout) is refused, as build_batch does. `current_version`: the engine version the model's weights
    are (None once it has stepped since it last pushed them: every token off-policy). A bad argument is refused
    before the model is touched; a non-finite loss or gradient raises FloatingPointError with the model not
    stepped."""
    check_clip(clip_eps, dual_clip)
    softmax_divisor(temperature, params)  # refuses a bad temperature or params
    check_group_size(outputs, group_size)
    batch = build_batch(outputs, rewards, pad_id)  # refuses unfinished ("abort") samples
    check_pad_id(pad_id, model)  # one of the model's embedding rows
    device = next(model.parameters()).device
    versions = token_versions(outputs, batch.input_ids.shape[1]).to(device)
    batch = RolloutBatch(*(t.to(device) for t in vars(batch).values()))
    on_policy = on_policy_mask(versions, batch.completion_mask, current_version, mode)
    advantages = group_advantages(batch.rewards, group_size)
    model.train()
    optimizer.zero_grad()
    try:
        loss, stats = off_policy_loss(token_logprobs(model, batch, temperature, params), batch, advantages, on_policy,
                                      clip_eps, dual_clip)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"non-finite loss {loss.item()}")
        loss.backward()
        check_gradients(model)
        optimizer.step()
    except BaseException:
        optimizer.zero_grad(set_to_none=True)  # a failed step leaves no gradient behind for the next one to add to
        raise
    finally:
        model.eval()
    sampled = versions[batch.completion_mask.bool()]
    return stats | {"loss": loss.item(), "reward": batch.rewards.mean().item(),
                    "versions": sorted(set(sampled.tolist())), "trainer_version": current_version}


def check_group_size(outputs, group_size) -> None:
    """ValueError naming group_size unless every output holds exactly group_size samples: a group that is not one
    prompt's samples baselines each reward against the wrong ones (half a prompt's, or two prompts' pooled)."""
    counts = [len(o.outputs) for o in outputs]
    bad = [i for i, n in enumerate(counts) if n != group_size]
    if bad:
        raise ValueError(f"group_size={group_size!r} does not match the rollouts: output(s) {bad[:8]}"
                         f"{' ...' if len(bad) > 8 else ''} hold {sorted({counts[i] for i in bad})} samples; "
                         "group_size must be each prompt's sample count (its SamplingParams.n)")


def __getattr__(name: str):
    """The rollout side (async_rollouts.py) and the demo (async_demo.py) under this module's names too: they import
    this module, so they are found when first asked for rather than imported here."""
    if name == "AsyncRollouts":
        from .async_rollouts import AsyncRollouts
        return AsyncRollouts
    if name in ("run_async_demo", "greedy_accuracy_async"):
        from . import async_demo
        return getattr(async_demo, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
