"""Speculative decoding on one GPU: decode tokens/s with and without a draft, and the acceptance length.

Target: Llama-3.1-8B shape; draft: Qwen3-1.7B shape with the target's vocabulary; random bf16 weights,
greedy decoding. Random weights make acceptance meaningless, so acceptance is controlled:
"aligned" zeroes every o_proj and down_proj in both models (still read every step, so the timing
is a real 8B/1.7B step) and gives each the head = its embedding, so both predict their input token
again and every proposal is accepted; "random" keeps the draft random, so nearly nothing is
accepted and the run shows the cost of speculating for nothing. "ngram" proposes by prompt lookup (no
draft model) on the same target, whose output repeats, so every proposal is accepted; "ngram-counting"
gives the target's head its embedding shifted by one row, so it counts up (x -> x + 1), nothing repeats
and nearly nothing is accepted.
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, machine, plot_bars, print_table, save, shaped_checkpoint  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402
from rollout_engine.spec import NGRAM  # noqa: E402


def align(model, shift: int = 0) -> None:
    """Greedy x -> x + shift: the residual stream is the input's embedding, the head its rows shifted."""
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        if model.cfg.tie_word_embeddings:
            assert shift == 0, "a tied head is the embedding itself"
        else:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight.roll(shift, dims=0))


def checkpoints(root: Path) -> tuple[Path, Path]:
    """The 8B-shaped target and the 1.7B-shaped draft with the target's vocabulary (config only)."""
    target = shaped_checkpoint("llama-3.1-8b", root)
    draft = root / "draft"
    draft.mkdir()
    (draft / "config.json").write_text(json.dumps(SHAPES["qwen3-1.7b"] | {"vocab_size": SHAPES["llama-3.1-8b"]["vocab_size"]}))
    return target, draft


def tokens_per_s(engine, batch: int, prompt_len: int, new_tokens: int) -> float:
    """Decode tokens/s: (generate of 1 + new_tokens - generate of 1) / new_tokens, so prefill cancels."""
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, 128000, (prompt_len,), generator=g).tolist() for _ in range(batch)]

    def seconds(max_tokens: int) -> float:
        engine.flush_cache()  # every run prefills the same work
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    seconds(1 + new_tokens)  # warm-up: Triton compiles for these shapes
    return batch * new_tokens / (seconds(1 + new_tokens) - seconds(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6])
    parser.add_argument("--prompt-len", type=int, default=64)
    # 210 is a multiple of k + 1 for k = 2, 4, 6: with full acceptance no run ends on a step whose tokens
    # max_tokens cuts off (at 64 tokens k = 6 took 10 steps for 64 tokens, 70 emitted; ~9% of the work wasted).
    parser.add_argument("--new-tokens", type=int, default=210)
    parser.add_argument("--drafts", nargs="+", default=["aligned", "random", "ngram", "ngram-counting"],
                        help="which speculative runs (plain decoding always runs: it is the baseline)")
    args = parser.parse_args()
    target, draft = checkpoints(Path(tempfile.mkdtemp()))
    common = dict(device="cuda", load_format="dummy", max_num_seqs=max(args.batches), kv_cache_memory=0.2,
                  max_model_len=args.prompt_len + args.new_tokens + 16)
    rows = []
    every_k = {"aligned": (draft, args.ks), "random": (draft, [max(args.ks)]), "ngram": (NGRAM, args.ks),
               "ngram-counting": (NGRAM, [max(args.ks)])}
    runs = [("none", 0, None)] + [(name, k, every_k[name][0]) for name in args.drafts for k in every_k[name][1]]
    for acceptance, k, draft_path in runs:
        engine = Engine(target, draft_model=draft_path, num_speculative_tokens=k, **common)
        align(engine.model, shift=int(acceptance == "ngram-counting"))
        if acceptance == "aligned":
            align(engine.models["draft"])
        for batch in args.batches:
            before = dict(engine.stats())
            rate = tokens_per_s(engine, batch, args.prompt_len, args.new_tokens)
            after = engine.stats()
            proposed = after["spec_proposed"] - before["spec_proposed"]
            accepted = after["spec_accepted"] - before["spec_accepted"]
            rows.append({"draft": acceptance, "k": k, "batch": batch, "tokens_per_s": rate,
                         "acceptance_length": 1 + accepted * k / proposed if proposed else float("nan")})
        del engine
        gc.collect()  # the engine's modules reference each other: free its pool now
        torch.cuda.empty_cache()
        plain = {r["batch"]: r["tokens_per_s"] for r in rows if r["draft"] == "none"}
        for r in rows:
            r["speedup"] = r["tokens_per_s"] / plain[r["batch"]]
        print_table(rows, f"speculative decoding, 8B target + 1.7B-shaped draft or n-gram lookup, greedy, {machine()}")
        save("spec_decode", rows, vars(args))  # after each engine, so a run cut short keeps what it measured
    plot_bars("spec_decode", [f"{r['draft']} k{r['k']} b{r['batch']}" for r in rows],
              {"speed-up": [r["speedup"] for r in rows]}, "x plain decoding")


if __name__ == "__main__":
    main()
