"""Partial-rollout stopping rules on the long-tailed lengths, in a step model (CPU only, no engine).

The step cost model is the one `longtail_rollout.py` fitted on the GPU (`results/longtail_rollout.json`:
decode step seconds by batch at short context, seconds per extra KV token, per prefill token). Each call
of the model takes the samples the last call left unfinished first (their context re-prefilled, as after a
weight update) and then new long-tailed samples, admits them FIFO into `--seats` seats, runs decode steps,
and stops by its rule:
  all-F     F of all the call's samples finished (Engine.generate(finish_fraction=F) today)
  new-F     F of the call's new samples finished
  tokens-B  B tokens generated, with a backlog: the call tops its pool up to --pool samples, so seats stay full
Tokens per second over the steady calls are compared with a fixed-length batch (every sample the mean
length) in the same model. A model, not a measurement: `longtail_rollout.py` measures the engine.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, plot_bars, print_table, save  # noqa: E402
from longtail_rollout import longtail_lengths, step_cost  # noqa: E402


def run_call(cost: dict, carried: list, new: list[int], seats: int, prompt_len: int, stop) -> tuple:
    """One call: (tokens, seconds, unfinished [(left, context)], finished)."""
    waiting = [[left, context, False] for left, context in carried] + [[n, prompt_len, True] for n in new]
    total, total_new = len(waiting), len(new)
    running, tokens, seconds, done, done_new = [], 0, cost["fixed_s"], 0, 0
    while not stop(done, done_new, total, total_new, tokens):
        while waiting and len(running) < seats:
            sample = waiting.pop(0)
            seconds += cost["per_prefill_token_s"] * sample[1]
            running.append(sample)
        if not running:
            break
        seconds += step_cost(cost, len(running), sum(s[1] for s in running), 0)
        tokens += len(running)
        for s in running:
            s[0] -= 1
            s[1] += 1
        done += sum(s[0] == 0 for s in running)
        done_new += sum(s[0] == 0 and s[2] for s in running)
        running = [s for s in running if s[0] > 0]
    return tokens, seconds, [(s[0], s[1]) for s in running + waiting], done


def steady(cost: dict, args, rule: str, value: float, seats: int) -> dict:
    """Tokens/s over calls after the warm-up under one rule."""
    stops = {"all": lambda d, dn, t, tn, tok: d >= value * t, "new": lambda d, dn, t, tn, tok: dn >= value * tn,
             "tokens": lambda d, dn, t, tn, tok: tok >= value}
    carried, tokens, seconds, finished = [], 0, 0.0, 0
    for call in range(args.calls):
        count = args.pool - len(carried) if rule == "tokens" else args.samples
        new = longtail_lengths(max(count, 1), args.median, args.sigma, args.cap, args.seed + call)[:count]
        t, s, carried, f = run_call(cost, carried, new, seats, args.prompt_len, stops[rule])
        if call >= args.warmup:
            tokens, seconds, finished = tokens + t, seconds + s, finished + f
    return {"rule": f"{rule}-{value:g}", "seats": seats, "tokens_per_s": tokens / seconds,
            "finished_per_call": finished / (args.calls - args.warmup), "carried_at_end": len(carried)}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=1024, help="new samples per call (all-F, new-F)")
    parser.add_argument("--pool", type=int, default=1280, help="samples in each call (tokens-B)")
    parser.add_argument("--seats", type=int, nargs="+", default=[256, 512])
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--median", type=float, default=262)
    parser.add_argument("--sigma", type=float, default=1.22)
    parser.add_argument("--cap", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="fewer samples and calls: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.pool, args.calls, args.warmup, args.seats = 64, 80, 4, 1, [16]
    source = json.loads((RESULTS / "longtail_rollout.json").read_text())
    cost = next(s for s in source["shapes"] if s["shape"] == "qwen3-1.7b")["cost_model"]
    mean = round(sum(longtail_lengths(args.samples, args.median, args.sigma, args.cap, args.seed)) / args.samples)
    rows = []
    for seats in args.seats:
        t, s, _, _ = run_call(cost, [], [mean] * args.samples, seats, args.prompt_len, lambda *a: False)
        fixed = t / s
        t, s, _, _ = run_call(cost, [], longtail_lengths(args.samples, args.median, args.sigma, args.cap, args.seed),
                              seats, args.prompt_len, lambda *a: False)
        rows.append({"rule": "no budget", "seats": seats, "tokens_per_s": t / s, "finished_per_call": args.samples,
                     "carried_at_end": 0})
        for rule, value in (("all", 0.95), ("all", 0.9), ("new", 0.95), ("new", 0.9), ("tokens", 300_000),
                            ("tokens", 150_000)):
            rows.append(steady(cost, args, rule, value if rule != "tokens" or not args.quick else value / 500, seats))
        for r in rows:
            if r["seats"] == seats:
                r["vs_fixed_mean"] = r["tokens_per_s"] / fixed
    save("longtail_policy_model" + "_quick" * args.quick, rows, {"cost_model": "longtail_rollout.json qwen3-1.7b"})
    print_table(rows, f"partial-rollout stopping rules in the step model (fixed length {mean} = 1.0 at the same seats)")
    plot_bars("longtail_policy_model" + "_quick" * args.quick, [f"{r['rule']} {r['seats']}" for r in rows],
              {"vs fixed mean length": [r["vs_fixed_mean"] for r in rows]}, "tokens/s ratio (model)")


if __name__ == "__main__":
    main()
