"""A GRPO-shaped batch on the CPU: 32 prompts x n=8 with the tiny model, engine vs transformers.generate."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, plot_bars, print_table, result_name, save  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402
from rollout_engine.tiny_model import make_tiny_model  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()

    path = make_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 400, (int(torch.randint(16, 48, (1,), generator=g)),), generator=g).tolist()
               for _ in range(args.prompts)]
    work = args.prompts * args.n * args.max_tokens
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True)

    engine = Engine(path, device="cpu", max_num_seqs=args.prompts * args.n)
    engine.generate(prompts[:2], params, use_tqdm=False)  # warm-up
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    engine_s = time.perf_counter() - t
    assert sum(len(c.token_ids) for o in outs for c in o.outputs) == work

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    width = max(map(len, prompts))
    pad = model.config.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])  # left padding
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    hf_kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, num_return_sequences=args.n,
                     max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens)
    with torch.no_grad():
        model.generate(ids[:2], **{**hf_kwargs, "attention_mask": mask[:2]})  # warm-up
        t = time.perf_counter()
        out = model.generate(ids, **hf_kwargs)
        hf_s = time.perf_counter() - t
    assert out.shape == (args.prompts * args.n, width + args.max_tokens)

    rows = [{"system": "rollout-engine", "seconds": engine_s, "tokens_per_s": work / engine_s},
            {"system": "transformers.generate", "seconds": hf_s, "tokens_per_s": work / hf_s}]
    print_table(rows, f"{args.prompts} prompts x n={args.n}, {args.max_tokens} new tokens each, tiny Qwen3, {machine()}")
    print(f"engine / transformers: {hf_s / engine_s:.2f}x")
    name = result_name("cpu_generate", args, parser)
    save(name, rows, {"prompts": args.prompts, "n": args.n, "max_tokens": args.max_tokens})
    plot_bars(name, [r["system"] for r in rows], {"tokens/s": [r["tokens_per_s"] for r in rows]},
              "output tokens / s")


if __name__ == "__main__":
    main()
