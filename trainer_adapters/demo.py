"""`rollout-engine demo`: GRPO from scratch on a toy task, with sleep/wake and weight sync every step.

The policy is a tiny random Qwen3 checkpoint with a one-token-per-character tokenizer. The
task is addition mod 10: the prompt "7+5=" is rewarded 1 when the first token is "2". A
random policy is right about 1 time in 15 (the vocabulary size); GRPO has to find the table.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rollout_engine import Engine, SamplingParams

from .grpo import hybrid_step

ALPHABET = "0123456789+="


def task_prompts():
    return [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]


def greedy_accuracy(engine: Engine, tasks) -> float:
    outs = engine.generate([p for p, _ in tasks], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    return sum(o.outputs[0].text == answer for o, (_, answer) in zip(outs, tasks)) / len(tasks)


def run_demo(out_dir, steps: int = 150, prompts_per_step: int = 100, n: int = 8, lr: float = 2e-3, seed: int = 0,
             hidden_size: int = 128, device=None, eval_every: int = 20, progress: bool = True,
             quantization: str | None = None, tis_cap: float | None = None, engine_dtype="auto") -> dict:
    """GRPO on the task for `steps` steps; writes demo_log.json and reward_curve.png into `out_dir`.

    `quantization` and `engine_dtype` are the rollout engine's (Engine's `quantization`, `dtype`); the trainer
    stays float32 whatever they are. `tis_cap` corrects the gap between the engine's sampling distribution and
    the trainer's by truncated importance sampling (hybrid_step)."""
    from transformers import AutoModelForCausalLM

    from rollout_engine.tiny_model import make_tiny_model

    out_dir = Path(out_dir)
    torch.manual_seed(seed)
    rng = random.Random(seed)
    path = make_tiny_model(out_dir / "policy", hidden_size=hidden_size, num_layers=2, intermediate_size=4 * hidden_size,
                           max_position_embeddings=64, alphabet=ALPHABET, seed=seed)
    engine = Engine(path, device=device, dtype=engine_dtype, kv_cache_memory=64 << 20,
                    max_num_seqs=prompts_per_step * n, seed=seed, quantization=quantization)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad_id = engine.tokenizer.pad_token_id
    tasks = task_prompts()
    params = SamplingParams(n=n, temperature=1.0, max_tokens=1)
    log = {"task": "addition mod 10, first token", "engine_dtype": str(engine.dtype).removeprefix("torch."),
           "quantization": quantization, "tis_cap": tis_cap, "steps": [], "eval": [(0, greedy_accuracy(engine, tasks))]}
    bar = tqdm(range(1, steps + 1), desc="GRPO", disable=not progress)
    for step in bar:
        batch = rng.sample(tasks, prompts_per_step)
        result = hybrid_step(engine, model, optimizer, [p for p, _ in batch],
                             lambda i, c: float(c.text == batch[i][1]), params, pad_id, tis_cap=tis_cap)
        result["step"] = step
        log["steps"].append(result)
        if step % eval_every == 0 or step == steps:
            log["eval"].append((step, greedy_accuracy(engine, tasks)))
        t = result["timings"]
        bar.set_postfix(reward=f"{result['reward']:.2f}", acc=f"{log['eval'][-1][1]:.2f}",
                        gen=f"{t['generate'] * 1e3:.0f}ms", train=f"{t['train'] * 1e3:.0f}ms",
                        sync=f"{(t['sleep'] + t['sync'] + t['wake']) * 1e3:.0f}ms")
    log["final_greedy_accuracy"] = log["eval"][-1][1]
    log["chance"] = 1 / len(engine.tokenizer)
    (out_dir / "demo_log.json").write_text(json.dumps(log, indent=1))
    plot(log, out_dir / "reward_curve.png")
    return log


def plot(log: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in log["steps"]]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, [s["reward"] for s in log["steps"]], label="mean sample reward", alpha=0.6)
    ax.plot(*zip(*log["eval"]), "o-", label="greedy accuracy (all 100 prompts)")
    ax.axhline(log["chance"], ls="--", c="gray", label="chance")
    ax.set_xlabel("GRPO step")
    ax.set_ylim(0, 1.02)
    ax.set_title(log["task"])
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
