"""A GRPO-shaped rollout on one GPU: many prompts x n samples, engine vs transformers.generate.

Qwen3-1.7B-shaped random bf16 weights; prompts of 256 random tokens; every sample runs to
its full length (ignore_eos), so both systems do exactly the same work. transformers runs
the same kind of batch at the engine's concurrency (by default max_num_seqs / n of the prompts, all n
samples at once: as many sequences as the engine decodes together) and its throughput is reported per
output token, as measured, not extrapolated in time.

`--quantization fp8` runs the same rollout again on an fp8 engine (Engine(quantization="fp8")) after the
unquantized one: a row each, "speedup" their throughput over the unquantized engine's, and the decode roofline
of each from the bytes it holds (fp8 weights at 1 byte plus float32 scales). transformers runs the unquantized
weights. `--fp8-kv` runs each weight format once more with an fp8 KV cache (kv_cache_dtype="fp8"), whose
roofline counts the cache's own bytes. `--batch-invariant` runs it once more on Engine(batch_invariant=True)
(its "speedup" below 1 is the mode's cost). `--plain-attention` turns off the decode attention that reads a
prompt once for its n samples (rollout_engine/prefix_groups.py), for comparison. `--no-transformers` skips the
transformers row. "decode_roofline_s" is the decode's memory floor with each sample reading its prompt's KV,
"shared_roofline_s" with the n samples of a prompt reading it once (what the shared path can reach).
`--top-p` / `--top-k` sample every row truncated (both systems), for what a truncated row's thresholds cost;
`--model llama-3.1-8b` for the 8B shape;
`--quick` a tiny shape on the CPU (a smoke test).
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUANTIZATIONS, QUICK_SHAPES, SHAPES, copy_bandwidth, format_label, machine,  # noqa: E402
                    plot_bars, print_table, result_name, save, shaped_checkpoint, sync, weight_formats)
from decode_roofline import floor_seconds, kv_bytes_per_token, weight_bytes_read  # noqa: E402

from rollout_engine import Engine, SamplingParams, prefix_groups  # noqa: E402


def transformers_row(path, named: dict, prompts: list, args, device: str) -> dict:
    """transformers.generate on a slice of the same prompts with the unquantized engine's weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=named["model.norm.weight"].dtype).eval()
    model.load_state_dict(named, strict=False)
    del named
    hf_ids = torch.tensor(prompts[: args.hf_prompts], device=device)
    hf_kwargs = dict(do_sample=True, temperature=1.0, top_k=max(0, args.top_k), top_p=args.top_p,
                     num_return_sequences=args.n,
                     max_new_tokens=args.output_len, min_new_tokens=args.output_len,
                     attention_mask=torch.ones_like(hf_ids))
    with torch.no_grad():
        model.generate(hf_ids[:1], **{**hf_kwargs, "max_new_tokens": 8, "min_new_tokens": 8,
                                      "attention_mask": torch.ones_like(hf_ids[:1])})  # warm-up
        sync(device)
        t = time.perf_counter()
        out = model.generate(hf_ids, **hf_kwargs)
        sync(device)
        hf_s = time.perf_counter() - t
    hf_tokens = (out.shape[1] - args.prompt_len) * out.shape[0]

    return {"system": "transformers.generate", "samples": args.hf_prompts * args.n, "output_tokens": hf_tokens,
            "seconds": hf_s, "tokens_per_s": hf_tokens / hf_s, "decode_roofline_s": float("nan"),
            "of_roofline": float("nan"), "shared_roofline_s": float("nan"), "of_shared_roofline": float("nan")}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-prompts", type=int, default=None,
                        help="prompts transformers.generate runs (x n samples); default max_num_seqs / n")
    parser.add_argument("--model", default="qwen3-1.7b", choices=sorted(SHAPES))
    parser.add_argument("--top-p", type=float, default=1.0, help="every sample's top_p")
    parser.add_argument("--top-k", type=int, default=-1, help="every sample's top_k (-1: off)")
    parser.add_argument("--quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                        help="also run the rollout on engines with these weight formats, after the unquantized one")
    parser.add_argument("--fp8-kv", action="store_true", help="also run each weight format with kv_cache_dtype='fp8'")
    parser.add_argument("--batch-invariant", action="store_true", help="also run on Engine(batch_invariant=True)")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers.generate row")
    parser.add_argument("--plain-attention", action="store_true",
                        help="every sample reads its prompt's KV itself (prefix_groups.ENABLED = False)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape on the CPU: a smoke test of the script")
    args = parser.parse_args()
    name = result_name("rollout", args, parser)
    prefix_groups.ENABLED = not args.plain_attention
    if args.hf_prompts is None:  # the engine's concurrency, so neither side is compared at another batch
        args.hf_prompts = max(1, args.max_num_seqs // args.n)
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.model, args.prompts, args.n, args.prompt_len, args.output_len, args.hf_prompts = "tiny-qwen3", 4, 2, 16, 8, 2
    bandwidth = copy_bandwidth(device=device)
    path = shaped_checkpoint(args.model, Path(tempfile.mkdtemp()))
    vocab = (QUICK_SHAPES | SHAPES)[args.model]["vocab_size"]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    params = SamplingParams(n=args.n, temperature=1.0, top_p=args.top_p, top_k=args.top_k, max_tokens=args.output_len,
                            ignore_eos=True)

    rows, named = [], None
    formats = weight_formats(args.quantization)
    variants = ([(q, None, False) for q in formats] + [(q, "fp8", False) for q in formats] * args.fp8_kv
                + [(None, None, True)] * args.batch_invariant)
    for quantization, kv_cache_dtype, invariant in variants:
        engine = Engine(path, device=device, load_format="dummy", max_num_seqs=args.max_num_seqs, kv_cache_memory=0.6,
                        max_model_len=args.prompt_len + args.output_len + 16, quantization=quantization,
                        kv_cache_dtype=kv_cache_dtype, batch_invariant=invariant)
        engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=16), use_tqdm=False)  # warm-up
        engine.flush_cache()  # the timed run prefills every prompt in full, the warm-up's two too
        sync(device)
        t = time.perf_counter()
        outs = engine.generate(prompts, params, use_tqdm=False)
        engine_s = time.perf_counter() - t
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        assert tokens == args.prompts * args.n * args.output_len
        # the decode's memory floor: every sample's output_len tokens, in waves of max_num_seqs
        steps = -(-args.prompts * args.n // args.max_num_seqs) * args.output_len
        floors = [floor_seconds([(0, args.output_len)] * (args.prompts * args.n), args.prompt_len, steps,
                                kv_bytes_per_token(engine), weight_bytes_read(engine), bandwidth, readers)
                  for readers in (1, args.n)]
        label = (format_label(quantization, engine.dtype) + f", {kv_cache_dtype} KV" * (kv_cache_dtype is not None)
                 + " batch-invariant" * invariant)
        rows.append({"system": f"rollout-engine {label}",
                     "samples": args.prompts * args.n, "output_tokens": tokens, "seconds": engine_s,
                     "tokens_per_s": tokens / engine_s, "decode_roofline_s": floors[0],
                     "of_roofline": floors[0] / engine_s,
                     "shared_roofline_s": floors[1], "of_shared_roofline": floors[1] / engine_s})
        rows[-1]["speedup"] = rows[-1]["tokens_per_s"] / rows[0]["tokens_per_s"]
        if named is None:  # same weights for transformers: the unquantized engine's own tensors
            named = {name: engine.weights.destination(name).clone() for name in engine.weights.names()}
        del engine, outs
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()

    if not args.no_transformers:
        rows.append(transformers_row(path, named, prompts, args, device))
    print_table(rows, f"GRPO-shaped rollout, {args.model} shape, prompt {args.prompt_len}, output "
                      f"{args.output_len}, n={args.n}, {machine()}")
    if not args.no_transformers:
        print(f"engine tokens/s over transformers tokens/s: {rows[0]['tokens_per_s'] / rows[-1]['tokens_per_s']:.1f}x")
    save(name, rows, vars(args) | {"copy_bandwidth_bytes_per_s": bandwidth})
    plot_bars(name, [r["system"] for r in rows], {"output tokens/s": [r["tokens_per_s"] for r in rows]},
              "output tokens / s")


if __name__ == "__main__":
    main()
