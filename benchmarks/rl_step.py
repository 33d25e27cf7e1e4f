"""One RL step's wall time, split into generate / sleep / train / sync / wake (the number users compare).

On a GPU: a Qwen3-1.7B-shaped policy (random bf16 weights) trained by transformers with AdamW,
the engine colocated on the same device. On the CPU: the demo's tiny policy. Each phase is
the median over the timed steps, after one warm-up step.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, plot_bars, print_table, result_name, save, shaped_checkpoint  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402
from trainer_adapters.grpo import hybrid_step  # noqa: E402

PHASES = ("generate", "sleep", "train", "sync", "wake")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoConfig, AutoModelForCausalLM

    cuda = torch.cuda.is_available()
    if cuda:
        path = shaped_checkpoint("qwen3-1.7b", Path(tempfile.mkdtemp()))
        engine = Engine(path, load_format="dummy", kv_cache_memory=0.3, max_num_seqs=args.prompts * args.n,
                        max_model_len=args.prompt_len + args.output_len + 16)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.bfloat16)
        model.load_state_dict({n: engine.weights.destination(n) for n in engine.weights.names()}, strict=False)
        vocab = 151000
    else:
        from rollout_engine.tiny_model import make_tiny_model

        path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
        engine = Engine(path, kv_cache_memory=64 << 20, max_num_seqs=args.prompts * args.n)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        vocab = 400
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.output_len, ignore_eos=True)
    reward = lambda i, c: float(sum(c.token_ids) % 2)  # noqa: E731  any cheap, non-constant reward
    results = [hybrid_step(engine, model, optimizer, prompts, reward, params, pad_id=0,
                           micro_batch=args.micro_batch) for _ in range(args.steps + 1)][1:]
    rows = [{"phase": p, "seconds": statistics.median(r["timings"][p] for r in results)} for p in PHASES]
    total = sum(r["seconds"] for r in rows)
    rows.append({"phase": "total", "seconds": total})
    for r in rows:
        r["share"] = r["seconds"] / total
    print_table(rows, f"one RL step: {args.prompts} prompts x n={args.n}, prompt {args.prompt_len}, output "
                      f"{args.output_len}, {'qwen3-1.7b shape bf16' if cuda else 'tiny policy'}, {machine()}")
    name = result_name("rl_step", args, parser)
    save(name, rows, vars(args))
    plot_bars(name, [r["phase"] for r in rows[:-1]], {"seconds": [r["seconds"] for r in rows[:-1]]}, "seconds")


if __name__ == "__main__":
    main()
