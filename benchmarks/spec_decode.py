"""Speculative decoding on one GPU: decode tokens/s with and without a draft, and the acceptance length.

Target: Llama-3.1-8B shape; draft: Qwen3-1.7B shape with the target's vocabulary; random bf16 weights,
greedy decoding. Random weights make acceptance meaningless, so acceptance is controlled:
"aligned" zeroes every o_proj and down_proj in both models (still read every step, so the timing
is a real 8B/1.7B step) and gives each the head = its embedding, so both predict their input token
again and every proposal is accepted; "random" keeps the draft random, so nearly nothing is
accepted and the run shows what adaptive speculation costs then: each sequence probes ceil(PROBE_PROPOSALS / k)
speculative steps and turns off (the goal: >= 0.97x plain at batch 1). "spec_steps" and "turned_off" are the speculative
steps and the sequences turned off in the measured (1 + new_tokens) call. "ngram" proposes by prompt lookup (no
draft model) on the same target, whose output repeats, so every proposal is accepted; "ngram-counting"
gives the target's head its embedding shifted by one row, so it counts up (x -> x + 1), nothing repeats
and nearly nothing is accepted.

The weights are set through `update_weights` (the trainer's path), so an fp8 model quantizes them on the way in
and keeps valid scales (an all-zero tensor gets a tiny positive one). `--quantization fp8` runs the plain and
speculative runs again on an fp8 target; `--draft-quantization fp8` runs each speculative one again with an fp8
draft (Engine(draft_quantization="fp8")), on every target format. "speedup" is over plain decoding on the same
target format, "vs_bf16_plain" over plain decoding on the unquantized target. "step_cost": a speculative step's
time in plain steps (acceptance length / speedup), where every step speculated (no sequence turned off);
"model_cost": the engine's cost model's figure for it (`spec_break_even`, spec/policy.py). Issue #23's row (the 8B target,
the fp8 1.7B-shaped draft, k=2 at acceptance length 3, batch 1): `--drafts aligned --ks 2 --batches 1
--draft-quantization fp8 [--quantization fp8]`. `--quick`: tiny shapes on the CPU (a smoke test of the script).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUANTIZATIONS, QUICK_SHAPES, SHAPES, format_label, machine, plot_bars,  # noqa: E402
                    print_table, result_name, save, shaped_checkpoint, sync, weight_formats)

from rollout_kernels import gemv  # noqa: E402
from rollout_engine import Engine, SamplingParams  # noqa: E402
from rollout_engine.spec import NGRAM  # noqa: E402


def aligned_weights(table, shift: int):
    """(name, tensor) pairs for `align`: zeros for every o_proj and down_proj (one tensor per shape), and an
    untied head = the embedding's rows shifted."""
    zeros = {}
    for name in sorted(table.names()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            shape = tuple(table.destination(name).shape)
            yield name, zeros.setdefault(shape, torch.zeros(shape, dtype=table.dtype, device=table.destination(name).device))
    if "lm_head.weight" in table.names():
        yield "lm_head.weight", table.destination("model.embed_tokens.weight").roll(shift, dims=0)
    else:
        assert shift == 0, "a tied head is the embedding itself"


def align(engine, model: str = "target", shift: int = 0) -> None:
    """Greedy x -> x + shift: the residual stream is the input's embedding, the head its rows shifted. Through
    update_weights, so fp8 weights are quantized with their scales."""
    engine.update_weights(aligned_weights(engine.weight_store.tables[model], shift), model=model)


def checkpoints(root: Path, target_shape: str, draft_shape: str) -> tuple[Path, Path]:
    """The target and the draft shaped like draft_shape with the target's vocabulary and EOS (config only)."""
    target = shaped_checkpoint(target_shape, root)
    draft = root / "draft"
    draft.mkdir()
    shapes = SHAPES | QUICK_SHAPES
    vocabulary = {key: shapes[target_shape][key] for key in ("vocab_size", "eos_token_id")}  # the target's tokens
    (draft / "config.json").write_text(json.dumps(shapes[draft_shape] | vocabulary))
    return target, draft


def tokens_per_s(engine, batch: int, prompt_len: int, new_tokens: int, reps: int) -> float:
    """Decode tokens/s: (generate of 1 + new_tokens - generate of 1) / new_tokens, so prefill cancels; the
    median of `reps` such pairs (one pair varied by about 3% from run to run)."""
    g = torch.Generator().manual_seed(batch)
    vocab = min(engine.cfg.vocab_size, 128000)
    prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist() for _ in range(batch)]

    def seconds(max_tokens: int) -> float:
        engine.flush_cache()  # every run prefills the same work
        sync(engine.device)
        t = time.perf_counter()
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                        use_tqdm=False)
        sync(engine.device)
        return time.perf_counter() - t

    seconds(1 + new_tokens)  # warm-up: Triton compiles for these shapes
    return statistics.median(batch * new_tokens / (seconds(1 + new_tokens) - seconds(1)) for _ in range(reps))


def measure(engine, args, labels: dict) -> list[dict]:
    """One row per batch: decode tokens/s and the acceptance length of this engine."""
    rows = []
    for batch in args.batches:
        before = dict(engine.stats())
        rate = tokens_per_s(engine, batch, args.prompt_len, args.new_tokens, args.reps)
        after = engine.stats()
        delta = {key: after[key] - before[key] for key in ("spec_proposed", "spec_accepted", "spec_steps",
                                                          "spec_sequences_turned_off")}
        proposed, k = delta["spec_proposed"], labels["k"]
        # tokens_per_s generates 1 + new_tokens 1 + reps times (warm-up, measured) and 1 token (no speculative
        # step) reps times: per-run counts are the totals over 1 + reps
        runs = 1 + args.reps
        rows.append(labels | {"batch": batch, "tokens_per_s": rate,
                              "acceptance_length": 1 + delta["spec_accepted"] * k / proposed if proposed else float("nan"),
                              "spec_steps": delta["spec_steps"] // runs,
                              "turned_off": delta["spec_sequences_turned_off"] // runs,
                              "model_cost": after.get("spec_break_even", float("nan")) if k else float("nan")})
    return rows


def speedups(rows: list[dict]) -> None:
    """speedup: over plain decoding on the same target format; vs_bf16_plain: over the unquantized target's."""
    plain = {(r["target"], r["batch"]): r["tokens_per_s"] for r in rows if r["draft"] == "none"}
    unquantized = rows[0]["target"]
    for r in rows:
        r["speedup"] = r["tokens_per_s"] / plain[r["target"], r["batch"]]
        r["vs_bf16_plain"] = r["tokens_per_s"] / plain[unquantized, r["batch"]]
        every_step = r["k"] and not r["turned_off"]
        r["step_cost"] = r["acceptance_length"] / r["speedup"] if every_step else float("nan")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 4, 16, 64])
    parser.add_argument("--ks", nargs="+", type=int, default=[2, 4, 6])
    parser.add_argument("--prompt-len", type=int, default=64)
    # 210 is a multiple of k + 1 for k = 2, 4, 6: with full acceptance no run ends on a step whose tokens
    # max_tokens cuts off (at 64 tokens k = 6 took 10 steps for 64 tokens, 70 emitted; ~9% of the work wasted).
    parser.add_argument("--new-tokens", type=int, default=210)
    parser.add_argument("--reps", type=int, default=3, help="timed pairs per row; the median is reported")
    parser.add_argument("--drafts", nargs="+", default=["aligned", "random", "ngram", "ngram-counting"],
                        help="which speculative runs (plain decoding always runs: it is the baseline)")
    parser.add_argument("--quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                        help="also run everything on targets with these weight formats, after the unquantized one")
    parser.add_argument("--draft-quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                        help="also run each draft-model run with the draft in these formats, after the unquantized one")
    parser.add_argument("--gemv-rows", type=int, default=gemv.GEMV_ROWS, choices=[1, 2, 3],
                        help="rollout_kernels.gemv.GEMV_ROWS: the most rows of x a projection sends to the GEMV, not cuBLAS(Lt)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke test of the script")
    args = parser.parse_args()
    result = result_name("spec_decode", args, parser)  # before --quick changes the arguments
    gemv.GEMV_ROWS = args.gemv_rows
    device = "cpu" if args.quick else "cuda"
    shapes = ("tiny-llama", "tiny-qwen3") if args.quick else ("llama-3.1-8b", "qwen3-1.7b")
    if args.quick:
        args.batches, args.ks, args.prompt_len, args.new_tokens = [1, 2], [2], 8, 12
    target, draft = checkpoints(Path(tempfile.mkdtemp()), *shapes)
    common = dict(device=device, dtype="bfloat16", load_format="dummy", max_num_seqs=max(args.batches),
                  kv_cache_memory=64 << 20 if args.quick else 0.2, max_model_len=args.prompt_len + args.new_tokens + 16)
    rows = []
    every_k = {"aligned": (draft, args.ks), "random": (draft, args.ks), "ngram": (NGRAM, args.ks),
               "ngram-counting": (NGRAM, [max(args.ks)])}
    runs = [(quantization, "none", 0, None, None) for quantization in weight_formats(args.quantization)]
    for quantization in weight_formats(args.quantization):
        for name in args.drafts:
            path, ks = every_k[name]
            formats = weight_formats(args.draft_quantization) if path == draft else [None]
            runs += [(quantization, name, k, path, d) for d in formats for k in ks]
    runs.sort(key=lambda run: run[0] is not None)  # stable: the unquantized target's runs first
    for quantization, acceptance, k, draft_path, draft_quantization in runs:
        drafted = dict(draft_quantization=draft_quantization) if draft_path == draft else {}
        engine = Engine(target, draft_model=draft_path, num_speculative_tokens=k, quantization=quantization,
                        **drafted, **common)
        align(engine, shift=int(acceptance == "ngram-counting"))
        if acceptance == "aligned":
            align(engine, model="draft")
        labels = {"target": format_label(quantization, engine.dtype), "draft": acceptance,
                  "draft_weights": format_label(draft_quantization, engine.dtype) if drafted else "", "k": k}
        rows += measure(engine, args, labels)
        del engine
        gc.collect()  # the engine's modules reference each other: free its pool now
        if device == "cuda":
            torch.cuda.empty_cache()
        speedups(rows)
        print_table(rows, f"speculative decoding, {shapes[0]} target + {shapes[1]}-shaped draft or n-gram lookup, "
                          f"greedy, {machine()}")
        save(result, rows, vars(args))  # after each engine, so a run cut short keeps what it measured
    plot_bars(result, [f"{r['target']} {r['draft']} {r['draft_weights']} k{r['k']} b{r['batch']}" for r in rows],
              {"speed-up": [r["speedup"] for r in rows]}, "x plain decoding")


if __name__ == "__main__":
    main()
