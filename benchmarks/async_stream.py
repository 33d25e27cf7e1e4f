"""What streaming costs the engine: N concurrent `AsyncEngine.stream` consumers in one process against the
same work through `Engine.generate` (and through `AsyncEngine.generate`, which streams nothing).

Host cost dominates on purpose: tiny models (the CLI's tiny Qwen3 with its byte-level BPE tokenizer, and
`--shape`, by default a tiny Qwen3, with random weights and no tokenizer), so a step is mostly Python, and
whatever the stream adds per step per consumer shows in tokens/s. (`--shape qwen3-1.7b` on a GPU: the work of
benchmarks/server.py's in-process row.) Every request: a prompt of `--prompt-len` random token ids, exactly
`--max-tokens` output tokens (ignore_eos, temperature 1), all N submitted at once; best of `--reps` runs after
a warm-up run. The stream consumers read each snapshot's token count (as a rollout worker would), nothing more.

Per row: tokens/s, wall time, `vs_generate` (tokens/s over the Engine.generate row of the same checkpoint),
`step_ms` (the median period between the starts of the engine loop's steps, host work between steps included:
a clock wrapped around `engine.loop.step`, which every path calls once per step), `loop_cpu_ms` (the stepping
thread's CPU time per step: what it computed, not what it waited for, so a stream's per-step cost on the loop
thread shows here even on a loaded machine), `cpu_us_per_token` (the process's CPU time, every thread, per
token) and the snapshots the consumers received.

    python benchmarks/async_stream.py            # GPU (or CPU): 256 streams x (128 + 512) tokens
    python benchmarks/async_stream.py --quick    # CPU: 64 streams x (16 + 256) tokens, one torch thread
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from async_rollout import StepClock, random_prompts, sync  # noqa: E402
from common import QUICK_SHAPES, SHAPES, machine, plot_bars, print_table, save, shaped_checkpoint  # noqa: E402

from rollout_engine import AsyncEngine, Engine, SamplingParams  # noqa: E402
from rollout_engine.tiny_model import make_tiny_model  # noqa: E402


def checkpoints(root: Path, shape: str) -> dict[str, tuple[Path, dict]]:
    """Label -> (checkpoint, extra Engine kwargs)."""
    return {f"{shape}, no tokenizer": (shaped_checkpoint(shape, root), {"load_format": "dummy"}),
            "tiny, tokenizer": (make_tiny_model(root / "tiny-tokenizer"), {})}


def engine_generate(path, kwargs, prompts, params, reps) -> dict:
    engine = Engine(path, **kwargs)
    engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)  # warm-up
    best = None
    for _ in range(reps):
        engine.flush_cache()  # every run prefills its prompts in full
        sync(engine.device)
        with StepClock(engine.loop) as clock:
            t, cpu = time.perf_counter(), time.process_time()
            outs = engine.generate(prompts, params, use_tqdm=False)
            sync(engine.device)
            wall, cpu = time.perf_counter() - t, time.process_time() - cpu
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
        if best is None or wall < best["wall_s"]:
            best = {"tokens": tokens, "wall_s": wall, "cpu_s": cpu, "step_ms": clock.period() * 1e3,
                    "loop_cpu_ms": clock.cpu_period() * 1e3, "snapshots": None}
    engine.sleep(level=2)
    return best


async def one_stream(engine: AsyncEngine, ids, params) -> tuple[int, int]:
    snapshots = tokens = 0
    async for out in engine.stream(ids, params):
        snapshots, tokens = snapshots + 1, len(out.outputs[0].token_ids)
    return snapshots, tokens


async def one_generate(engine: AsyncEngine, ids, params) -> tuple[int, int]:
    return 0, len((await engine.generate(ids, params)).outputs[0].token_ids)


async def async_runs(path, kwargs, prompts, params, reps) -> dict[str, dict]:
    engine = AsyncEngine(path, **kwargs)
    results = {}
    try:
        for label, call in (("AsyncEngine.generate", one_generate), ("AsyncEngine.stream", one_stream)):
            await asyncio.gather(*(call(engine, ids, SamplingParams(max_tokens=8, ignore_eos=True))
                                   for ids in prompts))  # warm-up
            for _ in range(reps):
                await engine.flush_cache()
                sync(engine.engine.device)
                with StepClock(engine.engine.loop) as clock:  # installed while the loop thread idles
                    t, cpu = time.perf_counter(), time.process_time()
                    got = await asyncio.gather(*(call(engine, ids, params) for ids in prompts))
                    sync(engine.engine.device)
                    wall, cpu = time.perf_counter() - t, time.process_time() - cpu
                run = {"tokens": sum(n for _, n in got), "wall_s": wall, "cpu_s": cpu, "step_ms": clock.period() * 1e3,
                       "loop_cpu_ms": clock.cpu_period() * 1e3,
                       "snapshots": sum(s for s, _ in got) if call is one_stream else None}
                if label not in results or wall < results[label]["wall_s"]:
                    results[label] = run
        await engine.sleep(level=2)
    finally:
        engine.shutdown()
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="tiny-qwen3", choices=list(QUICK_SHAPES) + list(SHAPES),
                        help="the checkpoint without a tokenizer (random weights); qwen3-1.7b: server.py's shape")
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--device", default=None)
    parser.add_argument("--tag", default="", help="appended to the results' file names (e.g. before / after)")
    parser.add_argument("--quick", action="store_true", help="CPU: 64 streams x (16 + 256) tokens")
    args = parser.parse_args()
    if args.quick:
        args.streams, args.prompt_len, args.max_tokens, args.device = 64, 16, 256, args.device or "cpu"
    # One intra-op thread on the CPU: the models are tiny, and OpenMP threads only contend with the loop thread.
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cpu":
        torch.set_num_threads(1)
    name = "async_stream" + ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True)
    rows = []
    for label, (path, extra) in checkpoints(Path(tempfile.mkdtemp()), args.shape).items():
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = random_prompts(args.streams, args.prompt_len, vocab, seed=0)
        kwargs = dict(device=device, max_num_seqs=args.streams, max_model_len=args.prompt_len + args.max_tokens + 16,
                      kv_cache_memory=(64 << 20) if device.type == "cpu" else 0.3, seed=0, **extra)
        runs = {"Engine.generate": engine_generate(path, kwargs, prompts, params, args.reps)}
        runs |= asyncio.run(async_runs(path, kwargs, prompts, params, args.reps))
        base = runs["Engine.generate"]["tokens"] / runs["Engine.generate"]["wall_s"]
        for run_label, run in runs.items():
            assert run["tokens"] == args.streams * args.max_tokens, (run_label, run["tokens"])
            rate = run["tokens"] / run["wall_s"]
            rows.append({"checkpoint": label, "run": run_label, "tokens": run["tokens"], "wall_s": run["wall_s"],
                         "tokens_per_s": rate, "vs_generate": rate / base, "step_ms": run["step_ms"],
                         "loop_cpu_ms": run["loop_cpu_ms"], "cpu_us_per_token": run["cpu_s"] / run["tokens"] * 1e6,
                         "snapshots": run["snapshots"]})
    out = save(name, rows, vars(args) | {"device": str(device)})
    plot_bars(name, [f"{r['checkpoint']}: {r['run']}" for r in rows], {"tokens/s": [r["tokens_per_s"] for r in rows]},
              "output tokens/s")
    print_table(rows, f"{args.streams} concurrent requests x ({args.prompt_len} + {args.max_tokens}) tokens, "
                      f"{machine()} ({device}); vs_generate: tokens/s over Engine.generate's; wrote {out}")


if __name__ == "__main__":
    main()
