"""The demo task one step off policy (trainer_adapters.demo's task, policy and batch sizes over AsyncRollouts):
the engine never sleeps, samples batch t+1 while step t trains, and takes the weights after every step."""
from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time
from pathlib import Path

import torch

from rollout_engine import SamplingParams

from .async_rollouts import AsyncRollouts


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
