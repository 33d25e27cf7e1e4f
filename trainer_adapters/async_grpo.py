"""One-step-off-policy GRPO over AsyncEngine: the rollouts of step t+1 are sampled while step t trains.

    rollouts = AsyncRollouts(path, **engine_kwargs)      # AsyncEngine + an asyncio client loop on its own thread
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

import asyncio
import concurrent.futures
import json
import random
import threading
import time
from pathlib import Path

import torch

from rollout_engine import AsyncEngine, EngineError, SamplingParams

from .grpo import (RolloutBatch, build_batch, check_clip, check_gradients, check_loss_inputs, dropped_tokens,
                   group_advantages, masked, token_logprobs)
from .sync import hf_named_parameters

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
    weights computed: one after an older token in its sample, or after a prompt whose KV an older version made."""
    if mode not in PUSH_MODES:
        raise ValueError(f"mode={mode!r} is not allowed; one of {PUSH_MODES}")
    sampled = completion_mask.bool()
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
    None or a finite number > 1; `clip_eps` a finite number in (0, 1) (grpo.check_clip).
    Shapes as grpo.policy_loss's: `advantages` (N,); `new_logprobs` and `on_policy` completion_mask's [N, L]."""
    check_loss_inputs(batch, advantages, new_logprobs=new_logprobs, on_policy=on_policy)
    check_clip(clip_eps, dual_clip)
    mask = batch.completion_mask
    ratio = importance_ratios(new_logprobs, batch, on_policy)
    adv = advantages[:, None]
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


def off_policy_step(model, optimizer, outputs, rewards, group_size: int, pad_id: int, current_version: int, *,
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
    partial rollout) is refused, as build_batch does. A bad argument is refused before the model is touched; a
    non-finite loss or gradient raises FloatingPointError with the model not stepped."""
    check_clip(clip_eps, dual_clip)
    check_group_size(outputs, group_size)
    batch = build_batch(outputs, rewards, pad_id)  # refuses unfinished ("abort") samples
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


# ------------------------------------------------------------------ the rollout side: AsyncEngine on its own loop


class AsyncRollouts:
    """An AsyncEngine plus an asyncio loop on a thread, driven from a synchronous trainer thread."""

    def __init__(self, model_path, push_mode: str = "retract", **engine_kwargs):
        if push_mode not in PUSH_MODES:
            raise ValueError(f"push_mode={push_mode!r} is not allowed; one of {PUSH_MODES}")
        self.push_mode = push_mode
        self.engine = AsyncEngine(model_path, **engine_kwargs)
        self.trainer_version = self.engine.weight_version  # the version of the weights the trainer holds
        self.loop = asyncio.new_event_loop()
        self._closed = False
        self._lock = threading.Lock()  # a coroutine is scheduled only on a loop that close() has not stopped
        self._thread = threading.Thread(target=self._serve, name="async-grpo-client", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Run the client loop until close(); then cancel what is left on it, so that no future waits forever."""
        try:
            self.loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:  # gather() of nothing would look for this thread's (absent) current loop
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    def run(self, coro) -> concurrent.futures.Future:
        """Schedule a coroutine on the client loop; returns a concurrent future. After close() it has already failed
        with EngineError (a stopped loop would never answer it), as AsyncEngine's calls after its shutdown do."""
        with self._lock:
            if not self._closed:
                return asyncio.run_coroutine_threadsafe(coro, self.loop)
        coro.close()  # never run: close it so that it is not reported as never awaited
        refused = concurrent.futures.Future()
        refused.set_exception(EngineError("the AsyncRollouts is closed; build a new one"))
        return refused

    def submit(self, prompts, params: SamplingParams) -> concurrent.futures.Future:
        """One AsyncEngine.generate request per prompt, all at once; the future gives the outputs in prompt order
        (after close(): a future that has failed with EngineError, as run)."""
        async def batch():
            return await asyncio.gather(*(self.engine.generate(p, params) for p in prompts))
        return self.run(batch())

    def step(self, model, optimizer, outputs, rewards, group_size: int, pad_id: int, **kwargs) -> dict:
        """off_policy_step against the weights the trainer holds and with this rollouts' push mode."""
        return off_policy_step(model, optimizer, outputs, rewards, group_size, pad_id, self.trainer_version,
                               mode=self.push_mode, **kwargs)

    def push_weights(self, model) -> int:
        """Copy the model's weights into the engine between two steps (requests in flight paused with
        `push_mode`, then continued); blocks the caller until done. Returns the new version. After close():
        EngineError at once."""
        async def push():
            await self.engine.pause_generation(self.push_mode)
            try:
                with torch.no_grad():
                    return await self.engine.update_weights(hf_named_parameters(model))  # one tensor at a time
            finally:
                await self.engine.continue_generation()
        self.trainer_version = self.run(push()).result()
        return self.trainer_version

    def close(self) -> None:
        """Shut the engine down (requests in flight fail with EngineError) and stop the client loop; later calls
        are refused with EngineError. A second close() does nothing."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)

    def __enter__(self) -> "AsyncRollouts":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------ the demo task, one step off


def greedy_accuracy_async(rollouts: AsyncRollouts, tasks) -> concurrent.futures.Future:
    """Future of (accuracy, weight versions that answered): the demo's greedy accuracy, as engine requests."""
    async def evaluate():
        outs = await asyncio.gather(*(rollouts.engine.generate(p, SamplingParams(temperature=0, max_tokens=1))
                                      for p, _ in tasks))
        correct = sum(o.outputs[0].text == answer for o, (_, answer) in zip(outs, tasks))
        return correct / len(tasks), sorted({v for o in outs for v in o.outputs[0].weight_versions})
    return rollouts.run(evaluate())


def run_async_demo(out_dir, steps: int = 150, prompts_per_step: int = 100, n: int = 8, lr: float = 1e-3,
                   seed: int = 0, hidden_size: int = 128, device=None, eval_every: int = 20,
                   push_mode: str = "retract", clip_eps: float = 0.2, dual_clip: float | None = 3.0,
                   lr_end_factor: float = 0.1, progress: bool = True) -> dict:
    """trainer_adapters.demo.run_demo, one step off policy: same task, policy, optimizer and batch sizes; the
    engine never sleeps (it samples while the trainer trains) and takes the weights after every step.

    lr is half the synchronous demo's and decays linearly to lr * lr_end_factor over the run. At 2e-3 each
    AdamW step moves this tiny policy so far that one step of staleness under a 0.2 clip stalls it (mean reward
    ~0.6 after 60-80 steps, 10-45% of tokens clipped). At a constant 1e-3 it reaches ~0.93 by step 50-60 and
    then sags to 0.77-0.87 by step 70-100 (seeds 0, 1; with or without the dual clip, and without any clip;
    on-policy at 1e-3 it holds 0.99): the decay (1e-3 -> 1e-4) holds it at ~0.97 to step 100."""
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM

    from rollout_engine.tiny_model import make_tiny_model

    from .demo import ALPHABET, plot, task_prompts

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    t_start = time.perf_counter()
    path = make_tiny_model(out_dir / "policy", hidden_size=hidden_size, num_layers=2, intermediate_size=4 * hidden_size,
                           max_position_embeddings=64, alphabet=ALPHABET, seed=seed)
    # Room for one batch in flight, the evaluation requests, and a batch arriving early.
    rollouts = AsyncRollouts(path, push_mode=push_mode, device=device, kv_cache_memory=64 << 20,
                             max_num_seqs=2 * prompts_per_step * n, seed=seed)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(rollouts.engine.engine.device).eval()
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        schedule = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, lr_end_factor, total_iters=max(steps - 1, 1))
        pad_id = rollouts.engine.engine.tokenizer.pad_token_id
        tasks = task_prompts()
        params = SamplingParams(n=n, temperature=1.0, max_tokens=1)
        log = {"task": "addition mod 10, first token (one step off policy)", "push_mode": push_mode, "steps": [],
               "eval": [(0, greedy_accuracy_async(rollouts, tasks).result()[0])]}
        batches = [rng.sample(tasks, prompts_per_step) for _ in range(steps)]
        pending = rollouts.submit([p for p, _ in batches[0]], params)
        evals = []  # (step, future)
        t_loop = time.perf_counter()
        bar = tqdm(range(1, steps + 1), desc="GRPO one-step-off", disable=not progress)
        for step in bar:
            t0 = time.perf_counter()
            outputs = pending.result()
            t1 = time.perf_counter()
            if step < steps:  # batch step+1 is sampled by the current weights while this step trains
                pending = rollouts.submit([p for p, _ in batches[step]], params)
            batch = batches[step - 1]
            rewards = [float(c.text == batch[i][1]) for i, o in enumerate(outputs) for c in o.outputs]
            result = rollouts.step(model, optimizer, outputs, rewards, n, pad_id, clip_eps=clip_eps,
                                   dual_clip=dual_clip, params=params)
            schedule.step()
            t2 = time.perf_counter()
            rollouts.push_weights(model)
            t3 = time.perf_counter()
            result |= {"step": step, "timings": {"wait": t1 - t0, "train": t2 - t1, "push": t3 - t2}}
            log["steps"].append(result)
            if step % eval_every == 0 or step == steps:
                evals.append((step, greedy_accuracy_async(rollouts, tasks)))  # answered beside the next step
            bar.set_postfix(reward=f"{result['reward']:.2f}", off=f"{result['off_policy_fraction']:.2f}",
                            wait=f"{(t1 - t0) * 1e3:.0f}ms", train=f"{(t2 - t1) * 1e3:.0f}ms",
                            push=f"{(t3 - t2) * 1e3:.0f}ms")
        log["loop_s"] = time.perf_counter() - t_loop
        for step, future in evals:
            accuracy, versions = future.result()
            log["eval"].append((step, accuracy))
            log.setdefault("eval_versions", []).append((step, versions))
        log["wall_s"] = time.perf_counter() - t_start
        log["final_greedy_accuracy"] = log["eval"][-1][1]
        log["chance"] = 1 / len(rollouts.engine.engine.tokenizer)
    finally:
        rollouts.close()
    (out_dir / "async_demo_log.json").write_text(json.dumps(log, indent=1))
    plot(log, out_dir / "async_reward_curve.png")
    return log
