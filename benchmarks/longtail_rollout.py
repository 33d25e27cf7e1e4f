"""The rollout tail: a GRPO-shaped batch whose output lengths are long-tailed, against fixed lengths.

Reasoning RL produces a few very long samples among many short ones. Every sample here gets its
own max_tokens (ignore_eos, temperature 1), drawn from a lognormal (median 262, sigma 1.22: p95
~1.9k, p99 ~4.4k; cut at 8,192 and the longest exactly 8,192; the lengths are the lognormal's
quantiles at (i + 0.5) / N, shuffled with a fixed seed, so every run and every N has the same
distribution). Runs, for each shape, one Engine with random weights (load_format="dummy"):

  fixed-512  the old figure's batch: n=8 per prompt, every sample 512 tokens (default: qwen3-1.7b only)
  fixed-L    every sample L = mean of the long-tailed lengths: about the same tokens as the long tail
  long-tail  the long-tailed lengths
  (fixed-L and long-tail submit each sample as its own request: the prompt repeated n times, n=1)

  budget     partial rollout (Engine.generate(finish_fraction=...)): a steady run of calls, each one new
             batch of long-tailed samples (new prompts, new lengths from the same distribution) plus the
             samples the call before carried over; a call stops once --budget-finish (95%) of its samples have
             finished, and its unfinished ones ("abort") join the next call, continued from their tokens. The
             prefix cache is flushed between calls, as a weight update does, so a carried sample's prompt and
             tokens are recomputed. Tokens are every token generated in a call (a carried sample's new tokens
             included, its carried-in ones not), over the calls' wall time; steady state is the calls after the
             first --budget-warmup (the first call has nothing carried in, and the carried pool needs a few
             calls to fill). A budget call has no tail by construction (it ends when 95% have finished): the
             tail's tokens are generated inside later calls' bulk; `carried_tokens` counts them.

Wall time and tokens/s are measured directly (authoritative). `floor_s` is each run's memory floor at the
copy bandwidth measured in the run (every generated token reads its sample's whole context from the KV cache,
its prompt's part once for the n samples of its group, as the engine's prefix groups read it while they decode
together: counted so for every token, a lower bound; every step the weights; the budget row's steps as full
batches), `of_floor` the run's share of it, and
`vs_fixed_L_at_same_share` the ratio to the fixed-L run this run would have at the fixed run's share of its
own floor: what the lengths allow, whatever the schedule. The bulk/tail split (the time until 95%
of the samples have finished, and after) needs a timeline, which the public API does not give; it is
rebuilt by a step model: the scheduler's admission is simulated (FIFO, at most max_num_seqs samples
running, a token budget per step, decodes first, then prefill chunks, repeated prompts hit the prefix
cache once published), and each simulated step is priced by a cost model fitted to a measured sweep
(decode step seconds at batch 1, 2, 4, ..., max_num_seqs and short context, one longer-context point for
the per-KV-token cost, the prefill cost per token from the sweep's intercepts). The model's own
predicted wall time is reported beside the measured one as a check; the bulk/tail seconds are the
measured wall time split in the model's proportion.
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from statistics import NormalDist

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_name, QUICK_SHAPES, SHAPES, copy_bandwidth, machine, print_table, save, shaped_checkpoint  # noqa: E402
from decode_roofline import floor_seconds, kv_bytes_per_token, weight_bytes_read  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402

BULK_FRACTION = 0.95


def longtail_lengths(num: int, median: float, sigma: float, cap: int, seed: int) -> list[int]:
    """Lognormal output lengths at its (i + 0.5) / num quantiles, cut at cap, the longest exactly cap, shuffled."""
    z = np.array([NormalDist().inv_cdf((i + 0.5) / num) for i in range(num)])
    lengths = np.clip(np.round(median * np.exp(sigma * z)), 1, cap).astype(int)
    lengths[-1] = cap
    np.random.default_rng(seed).shuffle(lengths)
    return lengths.tolist()


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed_generate(engine: Engine, prompts, params, **budget) -> tuple[list, float]:
    sync(engine.device)
    t = time.perf_counter()
    outs = engine.generate(prompts, params, use_tqdm=False, **budget)
    sync(engine.device)
    return outs, time.perf_counter() - t


# ------------------------------------------------------------------ the step cost model


def measure_cost_model(engine: Engine, vocab: int, batches: list[int], prompt_len: int, t1: int, t2: int,
                       long_prompt: int, long_batch: int) -> dict:
    """Decode step seconds per batch size (by differencing runs of t1 and t2 tokens: prefill and fixed costs
    cancel), the cost per KV token read (one longer-context point), and prefill seconds per prompt token."""
    g = torch.Generator().manual_seed(1234)

    def step_seconds(b: int, plen: int) -> tuple[float, float]:
        prompts = [torch.randint(0, vocab, (plen,), generator=g).tolist() for _ in range(b)]
        times = {}
        for t in (t1, t2):
            best = float("inf")
            for _ in range(2):
                engine.flush_cache()  # every run prefills its prompts in full
                best = min(best, timed_generate(engine, prompts, SamplingParams(max_tokens=t, ignore_eos=True))[1])
            times[t] = best
        step = (times[t2] - times[t1]) / (t2 - t1)
        return step, times[t1] - (t1 - 1) * step  # intercept: prefill + fixed costs

    step, intercept = {}, {}
    for b in batches:
        step[b], intercept[b] = step_seconds(b, prompt_len)
    ctx0 = prompt_len + (t1 + t2) / 2  # mean context of the differenced steps
    ctx_long = long_prompt + (t1 + t2) / 2
    long_step, _ = step_seconds(long_batch, long_prompt)
    short = float(np.interp(long_batch, batches, [step[b] for b in batches]))
    per_kv_token = max(0.0, (long_step - short) / (long_batch * (ctx_long - ctx0)))
    # intercept(b) = fixed + per_prefill_token * b * prompt_len (least squares)
    x = np.array([b * prompt_len for b in batches], dtype=float)
    y = np.array([intercept[b] for b in batches])
    slope, fixed = np.polyfit(x, y, 1) if len(batches) > 1 else (0.0, y[0])
    engine.flush_cache()
    return {"batches": batches, "step_s": [step[b] for b in batches], "intercept_s": [intercept[b] for b in batches],
            "sweep_context": ctx0, "long_context": ctx_long, "long_batch": long_batch, "long_step_s": long_step,
            "per_kv_token_s": per_kv_token, "per_prefill_token_s": max(0.0, float(slope)),
            "fixed_s": max(0.0, float(fixed))}


def step_cost(model: dict, decodes: int, context_sum: int, prefill_tokens: int) -> float:
    base = float(np.interp(max(decodes, 1), model["batches"], model["step_s"]))
    extra_kv = max(0.0, context_sum - decodes * model["sweep_context"])
    return base + model["per_kv_token_s"] * extra_kv + model["per_prefill_token_s"] * prefill_tokens


# ------------------------------------------------------------------ the scheduler, simulated


def simulate(requests: list[tuple[int, list[int]]], prompt_len: int, max_num_seqs: int, token_budget: int,
             block_size: int, cost: dict) -> dict:
    """Step-by-step replay of the engine's admission (see the module docstring) for requests given as
    (prompt id, [output length of each sample]). Returns per-step arrays and each sample's finish step."""
    cached = ((prompt_len - 1) // block_size) * block_size  # a published prompt's reusable full blocks
    waiting = deque(range(len(requests)))
    prefilling: list[list[int]] = []  # [request, tokens left]
    decoding: list[list[int]] = []   # [tokens left, context]
    published: set[int] = set()
    seats = 0
    steps = {"decodes": [], "running": [], "tokens": [], "context": [], "prefill": [], "seconds": []}
    finish_steps: list[int] = []
    step = 0
    while waiting or prefilling or decoding:
        budget = token_budget
        d = decoding[:budget]
        context = sum(c for _, c in d)
        for s in d:
            s[0] -= 1
            s[1] += 1
        budget -= len(d)
        emitted, prefill, done = len(d), 0, []
        for p in prefilling:
            n = min(p[1], budget)
            p[1] -= n
            budget -= n
            prefill += n
            if p[1] == 0:
                done.append(p)
        while waiting and budget and seats + min(len(requests[waiting[0]][1]), max_num_seqs) <= max_num_seqs:
            r = waiting.popleft()
            prompt, lengths = requests[r]
            seats += len(lengths)
            left = prompt_len - (cached if prompt in published else 0)
            n = min(left, budget)
            budget -= n
            prefill += n
            p = [r, left - n]
            prefilling.append(p)
            if p[1] == 0:
                done.append(p)
        for p in done:
            prefilling.remove(p)
            prompt, lengths = requests[p[0]]
            published.add(prompt)
            emitted += len(lengths)  # the prefill samples each sample's first token
            decoding += [[length - 1, prompt_len + 1] for length in lengths]
        running = len(decoding) + sum(len(requests[p[0]][1]) for p in prefilling)
        finished = [s for s in decoding if s[0] == 0]
        if finished:
            decoding = [s for s in decoding if s[0] > 0]
            seats -= len(finished)
            finish_steps += [step] * len(finished)
        steps["decodes"].append(len(d))
        steps["running"].append(running)
        steps["tokens"].append(emitted)
        steps["context"].append(context)
        steps["prefill"].append(prefill)
        steps["seconds"].append(step_cost(cost, len(d), context, prefill))
        step += 1
    return {k: np.array(v) for k, v in steps.items()} | {"finish_steps": np.array(sorted(finish_steps))}


def split(sim: dict, wall: float) -> dict:
    """Bulk (until BULK_FRACTION of the samples finished) vs tail, by the simulated timeline."""
    finish = sim["finish_steps"]
    bulk_end = int(finish[int(np.ceil(BULK_FRACTION * len(finish))) - 1])  # step that finished the 95th pct
    seconds, tokens = sim["seconds"], sim["tokens"]
    model_total = float(seconds.sum() + sim["fixed_s"])
    bulk_model = float(seconds[: bulk_end + 1].sum() + sim["fixed_s"])
    scale = wall / model_total
    tail = slice(bulk_end + 1, None)
    return {"steps": len(seconds), "bulk_steps": bulk_end + 1, "tail_steps": len(seconds) - bulk_end - 1,
            "model_wall_s": model_total, "bulk_s": bulk_model * scale, "tail_s": (model_total - bulk_model) * scale,
            "bulk_tokens": int(tokens[: bulk_end + 1].sum()), "tail_tokens": int(tokens[tail].sum()),
            "tail_mean_batch": float(sim["decodes"][tail].mean()) if len(seconds) > bulk_end + 1 else 0.0,
            "_scale": scale, "_bulk_end": bulk_end}


def timeline(sim: dict, info: dict, points: int = 400) -> dict:
    """Running samples and tokens/s against time (the model's cumulative step cost, scaled to the measured wall)."""
    t_end = (np.cumsum(sim["seconds"]) + sim["fixed_s"]) * info["_scale"]
    points = min(points, len(t_end))
    edges = np.linspace(0, t_end[-1], points + 1)
    # tokens arrive evenly within a step: interpolate the cumulative count (no aliasing of steps against bins)
    cumulative = np.interp(edges, np.concatenate([[sim["fixed_s"] * info["_scale"]], t_end]),
                           np.concatenate([[0], np.cumsum(sim["tokens"])]))
    idx = np.minimum(np.searchsorted(t_end, edges[1:], side="left"), len(t_end) - 1)
    return {"t": edges[1:].round(4).tolist(), "running": sim["running"][idx].tolist(),
            "tokens_per_s": (np.diff(cumulative) / np.diff(edges)).round(1).tolist(),
            "bulk_end_s": float(t_end[info["_bulk_end"]])}


# ------------------------------------------------------------------ partial rollout with a budget


def budget_rollout(engine: Engine, args, vocab: int, prompts_count: int, floor) -> tuple[dict, list[dict]]:
    """Steady-state partial rollout (see the module docstring): (the steady state's row, one record per call).
    `floor(spans, steps)`: floor_seconds for the steady calls' tokens, weights over full batches only."""
    n, carry, calls, spans = args.n, [], [], []  # carry: (RequestOutput cut by the last call, its SamplingParams)
    for call in range(args.budget_calls):
        g = torch.Generator().manual_seed(args.seed * 1000 + call + 1)
        prompts = [torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(prompts_count)]
        lengths = longtail_lengths(prompts_count * n, args.median, args.sigma, args.cap, args.seed + call + 1)
        new = [(p, SamplingParams(n=1, temperature=1.0, max_tokens=length, ignore_eos=True))
               for p, length in zip((p for p in prompts for _ in range(n)), lengths)]
        items = carry + new
        carried_in = [len(out.outputs[0].token_ids) for out, _ in carry]
        engine.flush_cache()  # a trainer's weight update between calls flushes it too
        outs, wall = timed_generate(engine, [x for x, _ in items], [p for _, p in items],
                                    finish_fraction=args.budget_finish)
        got = [len(o.outputs[0].token_ids) for o in outs]
        done = [o.outputs[0].finish_reason != "abort" for o in outs]
        assert all(length == p.max_tokens for length, (_, p), d in zip(got, items, done) if d)
        assert all(length < p.max_tokens for length, (_, p), d in zip(got, items, done) if not d)
        carried_tokens = sum(got[: len(carry)]) - sum(carried_in)
        if call >= args.budget_warmup:
            spans += list(zip(carried_in + [0] * len(new), got))
        carry = [(o, p) for o, (_, p), d in zip(outs, items, done) if not d]
        tokens = sum(got) - sum(carried_in)
        calls.append({"call": call + 1, "carried_in": len(carried_in), "new": len(new), "finished": sum(done),
                      "carried_out": len(carry), "tokens": tokens, "carried_tokens": carried_tokens,
                      "carried_in_tokens": sum(carried_in), "wall_s": wall, "tokens_per_s": tokens / wall})
    steady = calls[args.budget_warmup:]
    tokens, wall = sum(c["tokens"] for c in steady), sum(c["wall_s"] for c in steady)
    row = {"run": f"budget, finish {args.budget_finish:.0%} (calls {steady[0]['call']}-{steady[-1]['call']})",
           "samples": sum(c["new"] for c in steady), "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
           "carried_tokens": sum(c["carried_tokens"] for c in steady),
           "mean_carried": sum(c["carried_in"] for c in steady) / len(steady)}
    row["floor_s"] = floor(spans, -(-tokens // args.max_num_seqs))
    row["of_floor"] = row["floor_s"] / wall
    return row, calls


# ------------------------------------------------------------------ one shape


def run_shape(name: str, args, root: Path, prompts_count: int) -> tuple[list[dict], dict]:
    cfg = SHAPES.get(name) or QUICK_SHAPES[name]
    vocab = cfg["vocab_size"]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = args.n
    samples = prompts_count * n
    lengths = longtail_lengths(samples, args.median, args.sigma, args.cap, args.seed)
    mean_len = round(sum(lengths) / samples)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, vocab - 1, (args.prompt_len,), generator=g).tolist() for _ in range(prompts_count)]
    max_model_len = args.prompt_len + max(args.cap, args.fixed_len, args.t2) + 16
    engine = Engine(shaped_checkpoint(name, root), device=device, load_format="dummy", max_num_seqs=args.max_num_seqs,
                    kv_cache_memory=args.kv_cache_memory, max_model_len=max(max_model_len, args.long_prompt + args.t2 + 16),
                    max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, seed=args.seed)
    engine.generate(prompts[:2], SamplingParams(n=2, max_tokens=16, ignore_eos=True), use_tqdm=False)  # warm-up
    t = time.perf_counter()
    batches = [b for b in args.sweep_batches if b <= args.max_num_seqs]
    cost = measure_cost_model(engine, vocab - 1, batches, args.prompt_len, args.t1, args.t2, args.long_prompt,
                              min(args.long_batch, args.max_num_seqs))
    sweep_s = time.perf_counter() - t

    runs = []  # (label, prompts, params, requests for the simulation, expected lengths)
    if name in args.fixed_512_shapes or args.quick:
        runs.append((f"fixed-{args.fixed_len} (n={n}/prompt)", prompts,
                     SamplingParams(n=n, temperature=1.0, max_tokens=args.fixed_len, ignore_eos=True),
                     [(i, [args.fixed_len] * n) for i in range(prompts_count)], [args.fixed_len] * samples))
    per_sample = [p for p in prompts for _ in range(n)]  # prompt-major: each prompt's n samples in a row
    runs.append((f"fixed-{mean_len} (per-sample)", per_sample,
                 [SamplingParams(n=1, temperature=1.0, max_tokens=mean_len, ignore_eos=True)] * samples,
                 [(i // n, [mean_len]) for i in range(samples)], [mean_len] * samples))
    runs.append(("long-tail (per-sample)", per_sample,
                 [SamplingParams(n=1, temperature=1.0, max_tokens=length, ignore_eos=True) for length in lengths],
                 [(i // n, [length]) for i, length in enumerate(lengths)], lengths))

    rows, timelines = [], {}
    bandwidth, kv_per_token, weights = copy_bandwidth(device=device.type), kv_bytes_per_token(engine), weight_bytes_read(engine)
    for label, run_prompts, params, requests, expected in runs:
        engine.flush_cache()
        before = engine.stats()["preemptions"]
        outs, wall = timed_generate(engine, run_prompts, params)
        got = [len(c.token_ids) for o in outs for c in o.outputs]
        assert sorted(got) == sorted(expected), f"{label}: output lengths differ from those asked for"
        tokens = sum(got)
        sim = simulate(requests, args.prompt_len, args.max_num_seqs, args.max_num_batched_tokens, args.block_size, cost)
        sim["fixed_s"] = cost["fixed_s"]
        assert int(sim["tokens"].sum()) == tokens
        info = split(sim, wall)
        timelines[label] = timeline(sim, info)
        floor = floor_seconds([(0, length) for length in expected], args.prompt_len, len(sim["seconds"]), kv_per_token,
                              weights, bandwidth, prompt_readers=n)
        rows.append({"shape": name, "run": label, "samples": samples, "tokens": tokens, "wall_s": wall,
                     "tokens_per_s": tokens / wall, "floor_s": floor, "of_floor": floor / wall}
                    | {k: v for k, v in info.items() if not k.startswith("_")}
                    | {"preemptions": engine.stats()["preemptions"] - before})
    budget_calls = []
    if args.budget_calls:
        row, budget_calls = budget_rollout(engine, args, vocab, prompts_count, lambda spans, steps: floor_seconds(
            spans, args.prompt_len, steps, kv_per_token, weights, bandwidth, prompt_readers=n))
        rows.append({"shape": name} | row)
    fixed = next(r for r in rows if r["run"].startswith(f"fixed-{mean_len} "))
    old = next((r for r in rows if r["run"].startswith(f"fixed-{args.fixed_len} (n=")), None)
    for r in rows:
        r["vs_fixed_L"] = r["tokens_per_s"] / fixed["tokens_per_s"]
        # the ratio this run would have at the fixed run's share of its own floor: what the lengths allow
        r["vs_fixed_L_at_same_share"] = (r["tokens"] * fixed["of_floor"] / r["floor_s"] / fixed["tokens_per_s"]
                                         if "floor_s" in r else None)
        r["vs_fixed_512"] = r["tokens_per_s"] / old["tokens_per_s"] if old else None
    meta = {"shape": name, "prompts": prompts_count, "n": n, "lengths": {
        "mean": sum(lengths) / samples, "p50": float(np.percentile(lengths, 50)),
        "p95": float(np.percentile(lengths, 95)), "p99": float(np.percentile(lengths, 99)), "max": max(lengths),
        "total": sum(lengths)}, "copy_bandwidth_bytes_per_s": bandwidth, "cost_model": cost, "sweep_s": sweep_s,
        "timelines": timelines,
        "budget_calls": budget_calls}
    engine.sleep(level=2)  # give the memory back before the next shape's engine
    del engine, outs
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows, meta


def plot(name: str, metas: list[dict], out_dir: Path | None = None) -> Path:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir or os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    fig, axes = plt.subplots(2, len(metas), figsize=(6.5 * len(metas), 7), squeeze=False)
    for col, meta in enumerate(metas):
        top, bottom = axes[0][col], axes[1][col]
        for label, tl in meta["timelines"].items():
            line, = top.plot(tl["t"], tl["running"], label=label)
            bottom.plot(tl["t"], tl["tokens_per_s"], label=label, color=line.get_color())
            if label.startswith("long-tail"):
                for ax in (top, bottom):
                    ax.axvline(tl["bulk_end_s"], ls="--", color=line.get_color(), alpha=0.6)
        top.set_title(f"{meta['shape']}: {meta['prompts']} prompts x {meta['n']}\n(dashed: 95% of long-tail samples done)",
                      fontsize=9)
        top.set_ylabel("running samples")
        bottom.set_ylabel("output tokens / s")
        bottom.set_xlabel("seconds")
        top.legend(fontsize=8)
    fig.suptitle(f"{name} ({machine()}): time axis = measured wall time split by a step-cost model "
                 "(simulated admission, step cost from a measured batch-size sweep)", fontsize=9)
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"], choices=list(SHAPES))
    parser.add_argument("--prompts", type=int, default=128)
    parser.add_argument("--prompts-8b", type=int, default=32, help="prompts for llama-3.1-8b (keeps the run short)")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median", type=float, default=262)
    parser.add_argument("--sigma", type=float, default=1.22)
    parser.add_argument("--cap", type=int, default=8192)
    parser.add_argument("--fixed-len", type=int, default=512, help="the old figure's fixed length")
    parser.add_argument("--fixed-512-shapes", nargs="*", default=["qwen3-1.7b"],
                        help="shapes that also run the old figure's fixed-length batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=0.6)
    parser.add_argument("--sweep-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--t1", type=int, default=16, help="sweep: tokens of the short run")
    parser.add_argument("--t2", type=int, default=80, help="sweep: tokens of the long run")
    parser.add_argument("--long-prompt", type=int, default=4096, help="sweep: context of the per-KV-token point")
    parser.add_argument("--long-batch", type=int, default=16)
    parser.add_argument("--budget-calls", type=int, default=6, help="partial-rollout calls (0: no budget run)")
    parser.add_argument("--budget-warmup", type=int, default=2, help="first calls left out of the steady state")
    parser.add_argument("--budget-finish", type=float, default=0.95,
                        help="finish_fraction: a budget call stops once this fraction of its samples finished")
    parser.add_argument("--device", default=None)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny models, 8 prompts x 4, short lengths")
    args = parser.parse_args()
    name = result_name("longtail_rollout", args, parser)  # before any argument is adjusted below
    if args.budget_calls and not 0 <= args.budget_warmup < args.budget_calls:
        parser.error("--budget-warmup must be >= 0 and below --budget-calls (the steady state needs a call)")
    if args.quick:
        args.shape = ["tiny-qwen3", "tiny-llama"]
        args.device = args.device or "cpu"
        args.prompts, args.n, args.prompt_len, args.median, args.cap, args.fixed_len = 8, 4, 16, 16, 512, 32
        args.max_num_seqs, args.max_num_batched_tokens, args.kv_cache_memory = 8, 256, 64 << 20
        args.sweep_batches, args.t1, args.t2, args.long_prompt, args.long_batch = [1, 2, 4, 8], 8, 24, 256, 4
        args.budget_calls, args.budget_warmup = min(args.budget_calls, 4), min(args.budget_warmup, 1)
    else:
        args.kv_cache_memory = args.kv_cache_memory if args.kv_cache_memory < 1 else int(args.kv_cache_memory)
    rows, metas = [], []
    for shape in args.shape:  # saved after each shape, so a run cut short keeps what it measured
        count = args.prompts_8b if shape == "llama-3.1-8b" else args.prompts
        shape_rows, meta = run_shape(shape, args, Path(tempfile.mkdtemp()), count)
        rows += shape_rows
        metas.append(meta)
        lens = meta["lengths"]
        print(f"{shape}: {count} prompts x {args.n}, prompt {args.prompt_len} tokens; long-tail lengths mean "
              f"{lens['mean']:.0f}, p50 {lens['p50']:.0f}, p95 {lens['p95']:.0f}, p99 {lens['p99']:.0f}, max "
              f"{lens['max']}, total {lens['total']}; cost-model sweep took {meta['sweep_s']:.1f} s; step ms at "
              + ", ".join(f"b{b}: {s * 1e3:.2f}" for b, s in zip(meta["cost_model"]["batches"],
                                                                  meta["cost_model"]["step_s"])))
        for c in meta["budget_calls"]:
            print(f"  budget call {c['call']}: {c['carried_in']} carried in ({c['carried_in_tokens']} tokens) + "
                  f"{c['new']} new, {c['finished']} finished, {c['carried_out']} carried out; {c['tokens']} tokens "
                  f"({c['carried_tokens']} for carried samples) in {c['wall_s']:.2f} s: {c['tokens_per_s']:.0f} tokens/s")
        save(name, rows, {k: v for k, v in vars(args).items()} | {"shapes": metas})
    plot(name, metas)
    print_table(rows, f"long-tailed vs fixed output lengths, {machine()} (wall_s, tokens_per_s: measured; "
                      f"model_wall_s: the step-cost model's prediction; bulk = until {BULK_FRACTION:.0%} of samples "
                      "finished, bulk_s/tail_s = measured wall split in the model's proportion)")


if __name__ == "__main__":
    main()
