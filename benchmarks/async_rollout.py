"""A long-tailed GRPO rollout through Engine.generate and through AsyncEngine, with and without early abort.

One GRPO batch: 128 prompts x 8 samples, prompts of 256 random tokens, output lengths long-tailed (the
lognormal quantiles of longtail_rollout.py: median 256, sigma 1.19 so p99 ~4k, cut at 8,192 with the longest
exactly 8,192), each sample its own request (n=1, its own max_tokens, ignore_eos, temperature 1; the
prompt repeated 8 times, so 7 of 8 prefills hit the prefix cache). Qwen3-1.7B shape, random bf16 weights
(load_format="dummy"). Runs:

  (a) engine.generate   the 1,024 requests in one Engine.generate call
  (b) async, at once    the 1,024 requests submitted at once to an AsyncEngine (1,024 generate() calls)
  (c) async, abort 6/8  as (b); once 6 of a group's 8 samples have finished, its other 2 are aborted
                        (a group whose advantage is decided); they return what they had

Per run: output tokens (aborted samples count what they generated), wall time, tokens/s, and the time the
last 5% of requests take (wall time minus the time at which 95% had finished; per-request finish times come
from AsyncEngine only: Engine.generate returns everything at once, so (a) has none).

Host overhead of the loop: decode steps at a fixed batch (256 requests, the same length each, all admitted
at once) through Engine.generate and through AsyncEngine. A step's time is measured two ways: the median
period between the starts of the loop's steps in the T2-token run (a clock wrapped around
`engine.loop.step`, which both paths call once per step: host work between steps included), and the
difference of the T2- and T1-token runs' wall times over T2 - T1 (prefill and fixed costs cancel, the
public API only). Best of `--reps` runs each, after a warm-up run at that batch.

    python benchmarks/async_rollout.py            # H200, about 3-4 minutes
    python benchmarks/async_rollout.py --quick    # CPU smoke test, tiny model, under a minute
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_name, QUICK_SHAPES, SHAPES, machine, plot_bars, print_table, save, shaped_checkpoint  # noqa: E402
from longtail_rollout import longtail_lengths  # noqa: E402

from rollout_engine import AsyncEngine, Engine, SamplingParams  # noqa: E402

TAIL_FRACTION = 0.05


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def tail_seconds(finish: list[float], wall: float) -> float:
    """Wall time minus the time by which (1 - TAIL_FRACTION) of the requests had finished."""
    ordered = sorted(finish)
    return wall - ordered[math.ceil((1 - TAIL_FRACTION) * len(ordered)) - 1]


class StepClock:
    """Start times of the engine loop's steps while installed (it wraps `loop.step`, which both Engine.generate
    and the AsyncEngine's loop thread call once per step); the median period is the wall time of a step,
    host work between steps included. The stepping thread's CPU time at each start gives its CPU time per
    step (what it computed, not what it waited for: the GPU, or the interpreter lock held by another thread)."""

    def __init__(self, loop):
        self.loop, self.starts, self.cpu = loop, [], []

    def __enter__(self) -> "StepClock":
        step = type(self.loop).step.__get__(self.loop)

        def timed_step():
            self.starts.append(time.perf_counter())
            self.cpu.append(time.thread_time())
            return step()

        self.loop.step = timed_step
        return self

    def __exit__(self, *exc) -> None:
        del self.loop.step

    def period(self) -> float:
        return float(np.median(np.diff(self.starts))) if len(self.starts) > 2 else float("nan")

    def cpu_period(self) -> float:
        return float(np.median(np.diff(self.cpu))) if len(self.cpu) > 2 else float("nan")


def per_sample_params(lengths: list[int]) -> list[SamplingParams]:
    return [SamplingParams(n=1, temperature=1.0, max_tokens=length, ignore_eos=True) for length in lengths]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (length,), generator=g).tolist() for _ in range(count)]


# ------------------------------------------------------------------ Engine


def engine_runs(path, kwargs, prompts, params, overhead_prompts, args) -> tuple[dict, dict]:
    engine = Engine(path, **kwargs)
    device = engine.device
    engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    engine.flush_cache()
    sync(device)
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False)
    sync(device)
    wall = time.perf_counter() - t
    got = [len(c.token_ids) for o in outs for c in o.outputs]
    assert got == [p.max_tokens for p in params], "output lengths differ from those asked for"
    run = {"tokens": sum(got), "wall_s": wall, "finish": None, "aborted": 0,
           "preemptions": engine.stats()["preemptions"]}

    def timed(tokens: int) -> tuple[float, float]:
        best, period = float("inf"), float("inf")
        engine.flush_cache()
        engine.generate(overhead_prompts, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm-up
        for _ in range(args.reps):
            engine.flush_cache()  # every run prefills its prompts in full
            sync(device)
            with StepClock(engine.loop) as clock:
                t = time.perf_counter()
                engine.generate(overhead_prompts, SamplingParams(max_tokens=tokens, ignore_eos=True), use_tqdm=False)
                sync(device)
                best = min(best, time.perf_counter() - t)
            period = min(period, clock.period())
        return best, period

    (t1, _), (t2, period) = timed(args.t1), timed(args.t2)
    overhead = {"t1_s": t1, "t2_s": t2, "step_period_s": period}
    engine.sleep(level=2)
    del engine, outs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return run, overhead


# ------------------------------------------------------------------ AsyncEngine


async def submit_all(engine: AsyncEngine, prompts, params, tag: str) -> dict:
    t0 = time.perf_counter()
    finish = [0.0] * len(prompts)

    async def one(i):
        out = await engine.generate(prompts[i], params[i], request_id=f"{tag}-{i}")
        finish[i] = time.perf_counter() - t0
        return out

    outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    wall = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    assert got == [p.max_tokens for p in params], "output lengths differ from those asked for"
    return {"tokens": sum(got), "wall_s": wall, "finish": finish, "aborted": 0}


async def submit_abort_decided(engine: AsyncEngine, prompts, params, n: int, decided: int, tag: str) -> dict:
    """Each group of n consecutive requests: once `decided` have finished, abort the rest."""
    t0 = time.perf_counter()
    finish = [0.0] * len(prompts)
    outs = [None] * len(prompts)

    async def group(g):
        ids = [f"{tag}-{i}" for i in range(g * n, (g + 1) * n)]
        done = 0

        async def one(i, rid):
            nonlocal done
            out = await engine.generate(prompts[i], params[i], request_id=rid)
            finish[i], outs[i] = time.perf_counter() - t0, out
            if out.outputs[0].finish_reason != "abort":
                done += 1
                if done == decided:  # the group's advantage is decided: the others are not needed
                    await asyncio.gather(*(engine.abort(r) for j, r in enumerate(ids) if outs[g * n + j] is None))

        await asyncio.gather(*(one(g * n + j, rid) for j, rid in enumerate(ids)))

    await asyncio.gather(*(group(g) for g in range(len(prompts) // n)))
    wall = time.perf_counter() - t0
    aborted = [o for o in outs if o.outputs[0].finish_reason == "abort"]
    finished = [o for o in outs if o.outputs[0].finish_reason != "abort"]
    assert len(finished) >= decided * (len(prompts) // n)
    return {"tokens": sum(len(o.outputs[0].token_ids) for o in outs), "wall_s": wall, "finish": finish,
            "aborted": len(aborted), "aborted_tokens": sum(len(o.outputs[0].token_ids) for o in aborted),
            "tokens_not_generated": sum(p.max_tokens for p in params) - sum(len(o.outputs[0].token_ids) for o in outs)}


async def async_runs(path, kwargs, prompts, params, overhead_prompts, args) -> tuple[dict, dict, dict]:
    engine = AsyncEngine(path, **kwargs)
    device = engine.engine.device
    try:
        await asyncio.gather(*(engine.generate(p, SamplingParams(n=2, max_tokens=16, ignore_eos=True))
                               for p in prompts[:2]))  # warm-up
        await engine.flush_cache()
        b = await submit_all(engine, prompts, params, "b")
        b["preemptions"] = (await engine.stats())["preemptions"]
        await engine.flush_cache()
        c = await submit_abort_decided(engine, prompts, params, args.n, args.decided, "c")
        c["preemptions"] = (await engine.stats())["preemptions"] - b["preemptions"]

        async def timed(tokens: int) -> tuple[float, float]:
            best, period = float("inf"), float("inf")
            await engine.flush_cache()
            await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=4, ignore_eos=True))
                                   for p in overhead_prompts))  # warm-up
            for _ in range(args.reps):
                await engine.flush_cache()
                sync(device)
                with StepClock(engine.engine.loop) as clock:  # installed while the loop thread idles
                    t = time.perf_counter()
                    await asyncio.gather(*(engine.generate(p, SamplingParams(max_tokens=tokens, ignore_eos=True))
                                           for p in overhead_prompts))
                    sync(device)
                    best = min(best, time.perf_counter() - t)
                period = min(period, clock.period())
            return best, period

        (t1, _), (t2, period) = await timed(args.t1), await timed(args.t2)
        overhead = {"t1_s": t1, "t2_s": t2, "step_period_s": period}
        await engine.sleep(level=2)
    finally:
        engine.shutdown()
    return b, c, overhead


# ------------------------------------------------------------------ main


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES) + list(QUICK_SHAPES))
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--decided", type=int, default=6, help="(c): abort a group's rest once this many finished")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median", type=float, default=256)
    parser.add_argument("--sigma", type=float, default=1.19,
                        help="lognormal sigma: 1.19 puts p99 near 4k at median 256")
    parser.add_argument("--cap", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--kv-cache-memory", type=float, default=0.6)
    parser.add_argument("--overhead-batch", type=int, default=256)
    parser.add_argument("--t1", type=int, default=64, help="overhead: tokens per request of the short run")
    parser.add_argument("--t2", type=int, default=192, help="overhead: tokens per request of the long run")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny model, 8 prompts x 8, short lengths")
    args = parser.parse_args()
    name = result_name("async_rollout", args, parser)  # before any argument is adjusted below
    if args.quick:
        args.shape, args.device = "tiny-qwen3", args.device or "cpu"
        args.prompts, args.prompt_len, args.median, args.sigma, args.cap = 8, 16, 16, 1.19, 256
        args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory = 256, 1024, 64 << 20
        args.t1, args.t2, args.reps = 8, 40, 3
        # One intra-op thread: on 2 shared cores, 2 OpenMP threads made the main thread's Engine steps 5-20x
        # slower than the same steps on the AsyncEngine's loop thread (measured), which is not what is compared.
        torch.set_num_threads(1)
    else:
        args.kv_cache_memory = args.kv_cache_memory if args.kv_cache_memory < 1 else int(args.kv_cache_memory)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    vocab = (SHAPES.get(args.shape) or QUICK_SHAPES[args.shape])["vocab_size"]
    path = shaped_checkpoint(args.shape, Path(tempfile.mkdtemp()))

    samples = args.prompts * args.n
    lengths = longtail_lengths(samples, args.median, args.sigma, args.cap, args.seed)
    group_prompts = random_prompts(args.prompts, args.prompt_len, vocab, args.seed)
    prompts = [p for p in group_prompts for _ in range(args.n)]  # prompt-major: a group's samples in a row
    params = per_sample_params(lengths)
    overhead_prompts = random_prompts(args.overhead_batch, args.prompt_len, vocab, args.seed + 1)
    kwargs = dict(device=device, load_format="dummy", max_num_seqs=max(args.max_num_seqs, args.overhead_batch),
                  kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_model_len=args.prompt_len + max(args.cap, args.t2) + 16, seed=args.seed)

    t = time.perf_counter()
    a, engine_overhead = engine_runs(path, kwargs, prompts, params, overhead_prompts, args)
    engine_phase_s = time.perf_counter() - t
    t = time.perf_counter()
    b, c, async_overhead = asyncio.run(async_runs(path, kwargs, prompts, params, overhead_prompts, args))
    async_phase_s = time.perf_counter() - t

    rows = []
    for label, run in (("(a) engine.generate", a), ("(b) async, at once", b),
                       (f"(c) async, abort {args.decided}/{args.n}", c)):
        rows.append({"run": label, "requests": samples, "tokens": run["tokens"], "wall_s": run["wall_s"],
                     "tokens_per_s": run["tokens"] / run["wall_s"],
                     "last5pct_s": tail_seconds(run["finish"], run["wall_s"]) if run["finish"] else None,
                     "aborted": run["aborted"], "preemptions": run["preemptions"],
                     "vs_a": run["wall_s"] / a["wall_s"]})
    steps = args.t2 - args.t1
    overheads = {"engine": engine_overhead, "async": async_overhead}
    step = {k: o["step_period_s"] for k, o in overheads.items()}
    diff = {k: (o["t2_s"] - o["t1_s"]) / steps for k, o in overheads.items()}
    for label, key in (("decode step, Engine", "engine"), ("decode step, AsyncEngine", "async")):
        o = overheads[key]
        rows.append({"run": f"{label} @{args.overhead_batch}", "requests": args.overhead_batch,
                     "tokens": args.overhead_batch * args.t2, "wall_s": o["t2_s"],
                     "tokens_per_s": args.overhead_batch / step[key], "step_ms": step[key] * 1e3,
                     "step_ms_diff": diff[key] * 1e3, "vs_a": step[key] / step["engine"]})

    lens = np.array(lengths)
    meta = vars(args) | {"device": str(device), "lengths": {
        "mean": float(lens.mean()), "p50": float(np.percentile(lens, 50)), "p95": float(np.percentile(lens, 95)),
        "p99": float(np.percentile(lens, 99)), "max": int(lens.max()), "total": int(lens.sum())},
        "overhead": {"engine": engine_overhead, "async": async_overhead},
        "finish_s": {"b": b["finish"], "c": c["finish"]},
        "c_aborted_tokens": c["aborted_tokens"], "c_tokens_not_generated": c["tokens_not_generated"],
        "engine_phase_s": engine_phase_s, "async_phase_s": async_phase_s}
    out = save(name, rows, meta)
    plot_bars(name, [r["run"] for r in rows[:3]],
              {"wall s": [r["wall_s"] for r in rows[:3]],
               f"last {TAIL_FRACTION:.0%} of requests s": [r["last5pct_s"] or 0.0 for r in rows[:3]]}, "seconds")

    print(f"{args.shape} ({machine()}): {args.prompts} prompts x {args.n} samples, one request each, prompt "
          f"{args.prompt_len} tokens; output lengths mean {lens.mean():.0f}, p50 {np.percentile(lens, 50):.0f}, "
          f"p95 {np.percentile(lens, 95):.0f}, p99 {np.percentile(lens, 99):.0f}, max {lens.max()}, total "
          f"{lens.sum()}; phases: Engine {engine_phase_s:.1f} s, AsyncEngine {async_phase_s:.1f} s (with start-up)")
    print(f"(c) aborted {c['aborted']} samples ({c['aborted_tokens']} tokens generated by them, "
          f"{c['tokens_not_generated']} never generated); wall {c['wall_s'] / b['wall_s']:.2f}x of (b)")
    print(f"(b)/(a): wall {b['wall_s'] / a['wall_s']:.3f}x, "
          f"tokens/s {rows[1]['tokens_per_s'] / rows[0]['tokens_per_s']:.3f}x")
    print(f"loop host overhead at batch {args.overhead_batch} ({args.overhead_batch} requests x {args.t2} tokens): "
          f"AsyncEngine step {step['async'] * 1e3:.3f} ms vs Engine {step['engine'] * 1e3:.3f} ms = "
          f"{step['async'] / step['engine']:.3f}x ({(step['async'] - step['engine']) * 1e3:+.3f} ms per step; by "
          f"differencing {args.t1}- and {args.t2}-token runs: {diff['async'] * 1e3:.3f} vs "
          f"{diff['engine'] * 1e3:.3f} ms "
          f"= {diff['async'] / diff['engine']:.3f}x); wrote {out}")
    print_table(rows, f"async rollout, {args.shape}, {machine()} (vs_a: wall / (a)'s wall for the rollouts, "
                      "step time / Engine's step time for the decode-step rows; step_ms: median period between loop "
                      "steps; step_ms_diff: (wall of T2 run - wall of T1 run) / (T2 - T1))")


if __name__ == "__main__":
    main()
