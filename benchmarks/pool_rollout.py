"""Data parallelism: a GRPO-shaped rollout through EnginePool(N) (one engine per GPU, on Ray) against one Engine.

The rollout.py batch (Qwen3-1.7B-shaped random bf16 weights, prompts of 256 random tokens, n samples each,
every sample to its full length with ignore_eos) runs first on one Engine in this process, then through an
EnginePool of --engines engines (one GPU each, the same random weights: load_format="dummy" with one seed).
--lengths longtail gives every sample its own max_tokens from longtail_rollout.py's lognormal (one request
per sample), which is what the pool's balancing by expected tokens is for. Then a weight update from this
process to every engine (the engine's own tensors, in host memory) is timed: payload GB/s per engine.

    python benchmarks/pool_rollout.py                          # 2 engines on 2 GPUs
    python benchmarks/pool_rollout.py --engines 8 --lengths longtail
    python benchmarks/pool_rollout.py --quick                  # CPU smoke test: tiny model, 2 CPU engines
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
from common import QUICK_SHAPES, SHAPES, machine, print_table, result_name, save, shaped_checkpoint  # noqa: E402
from longtail_rollout import longtail_lengths  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402
from rollout_engine.ray_pool import EnginePool, init_local_ray  # noqa: E402


def batch(args, vocab: int) -> tuple[list, list]:
    """(prompts, params): n samples of one prompt in one request (fixed), or one request per sample (longtail)."""
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(args.prompts)]
    if args.lengths == "fixed":
        return prompts, [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.output_len, ignore_eos=True)] \
            * len(prompts)
    lengths = longtail_lengths(args.prompts * args.n, args.output_len, args.sigma, args.cap, args.seed)
    return ([p for p in prompts for _ in range(args.n)],
            [SamplingParams(n=1, temperature=1.0, max_tokens=m, ignore_eos=True) for m in lengths])


def timed(generate, prompts, params) -> tuple[float, int]:
    """Seconds and output tokens of one generate call (outputs are back on the host when it returns)."""
    t = time.perf_counter()
    outs = generate(prompts, params)
    seconds = time.perf_counter() - t
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    assert tokens == sum(p.n * p.max_tokens for p in params), "every sample runs to max_tokens (ignore_eos)"
    return seconds, tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=2)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=256, help="per run (rollout.py has 128 on one GPU)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=512, help="fixed: every sample; longtail: the median")
    parser.add_argument("--lengths", choices=["fixed", "longtail"], default="fixed")
    parser.add_argument("--sigma", type=float, default=1.22, help="longtail: lognormal sigma")
    parser.add_argument("--cap", type=int, default=8192, help="longtail: the longest sample")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--kv-cache-memory", type=float, default=0.6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 2 CPU engines, 8 x 4")
    args = parser.parse_args()
    gpus = 0 if args.quick else 1
    if args.quick:
        args.shape, args.prompts, args.n, args.prompt_len, args.output_len, args.cap = "tiny-qwen3", 8, 4, 16, 16, 64
        args.kv_cache_memory = 32 << 20
        torch.set_num_threads(1)  # as each CPU engine actor has (Ray gives an actor its one CPU's threads)
    elif args.kv_cache_memory >= 1:
        args.kv_cache_memory = int(args.kv_cache_memory)
    config = SHAPES.get(args.shape) or QUICK_SHAPES[args.shape]
    path = shaped_checkpoint(args.shape, Path(tempfile.mkdtemp()))
    prompts, params = batch(args, config["vocab_size"])
    longest = max(p.max_tokens for p in params)
    kwargs = dict(model_path=path, device="cpu" if args.quick else "cuda", load_format="dummy", seed=args.seed,
                  max_num_seqs=args.max_num_seqs, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=args.prompt_len + longest + 16)
    warm = (prompts[: 2 * args.engines], SamplingParams(n=2, max_tokens=16, ignore_eos=True))

    engine = Engine(**kwargs)
    engine.generate(*warm, use_tqdm=False)
    engine.flush_cache()  # the timed run prefills every prompt in full, the warm-up's too
    one_s, one_tokens = timed(lambda q, p: engine.generate(q, p, use_tqdm=False), prompts, params)
    named = [(name, engine.weights.destination(name).to("cpu", copy=True)) for name in engine.weights.names()]
    payload = sum(t.numel() * t.element_size() for _, t in named)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()

    init_local_ray(num_cpus=args.engines, **({} if args.quick else {"num_gpus": args.engines}))
    with EnginePool(args.engines, kwargs, num_gpus_per_engine=gpus) as pool:
        pool.generate(*warm)
        pool.flush_cache()
        pool_s, pool_tokens = timed(pool.generate, prompts, params)
        t = time.perf_counter()
        version = pool.update_weights(named)
        update_s = time.perf_counter() - t
        assert pool.generate(*warm)[0].weight_version == version

    rows = [{"system": "one Engine", "engines": 1, "output_tokens": one_tokens, "seconds": one_s,
             "tokens_per_s": one_tokens / one_s},
            {"system": f"EnginePool({args.engines})", "engines": args.engines, "output_tokens": pool_tokens,
             "seconds": pool_s, "tokens_per_s": pool_tokens / pool_s}]
    ratio = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print_table(rows, f"GRPO-shaped rollout through EnginePool, {args.shape}, {args.prompts} prompts x n={args.n}, "
                      f"prompt {args.prompt_len}, {args.lengths} output {args.output_len}, {machine()}")
    print(f"pool tokens/s over one engine: {ratio:.2f}x ({ratio / args.engines:.0%} of linear)")
    print(f"update_weights to {args.engines} engines from this process: {payload / 1e9:.2f} GB each in "
          f"{update_s:.2f} s = {payload / update_s / 1e9:.2f} GB/s per engine "
          f"({args.engines * payload / update_s / 1e9:.2f} GB/s delivered)")
    name = result_name("pool_rollout", args, parser)
    save(name, rows, vars(args) | {"ratio": ratio, "update_payload_bytes": payload, "update_seconds": update_s})


if __name__ == "__main__":
    main()
