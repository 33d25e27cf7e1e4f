"""GRPO with fp8 rollouts: does the demo learn as fast from an fp8 engine, with and without truncated IS?

The demo (trainer_adapters.demo.run_demo: a tiny Qwen3 policy learns addition mod 10, 100 prompts x 8 samples
a step) runs with the same seeds in three configurations: a bf16 engine, an fp8 engine (bf16 activations)
whose rollouts are corrected by truncated importance sampling (TIS), and the fp8 engine without it. The
trainer is float32 in all three, so the engine's numerics are the only difference. For each run: the first
step at which the running mean reward (a trailing window of whole steps) reaches a threshold, a fraction of
the bf16 runs' final running mean, and the greedy accuracy at the end. Target: fp8 + TIS reaches the
threshold within 10% of bf16's steps (mean over seeds).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, save  # noqa: E402

from trainer_adapters.demo import run_demo  # noqa: E402

REFERENCE = "bf16"
CORRECTED = "fp8+TIS"
TARGET_RATIO = 1.10  # fp8 + TIS steps to the threshold over bf16's: "within 10% of the steps"


def configs(tis_cap: float) -> dict[str, dict]:
    """run_demo's engine arguments per configuration, the reference first (the threshold comes from it)."""
    return {REFERENCE: dict(engine_dtype="bfloat16"),
            CORRECTED: dict(engine_dtype="bfloat16", quantization="fp8", tis_cap=tis_cap),
            "fp8": dict(engine_dtype="bfloat16", quantization="fp8")}


def running_mean(rewards: list[float], window: int) -> list[float]:
    """Mean reward of steps s - window + 1 .. s for s = window .. len(rewards) (whole windows only: early
    steps would otherwise rest on one or two batches)."""
    return [statistics.fmean(rewards[end - window:end]) for end in range(window, len(rewards) + 1)]


def steps_to_threshold(rewards: list[float], window: int, threshold: float) -> int | None:
    """The first step whose running mean reaches `threshold`; None if no step does."""
    return next((window + i for i, r in enumerate(running_mean(rewards, window)) if r >= threshold), None)


def run_config(name: str, engine_args: dict, seeds: list[int], args) -> list[dict]:
    runs = []
    for seed in seeds:
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            log = run_demo(tmp, steps=args.steps, prompts_per_step=args.prompts, n=args.n, seed=seed,
                           device=args.device, eval_every=args.steps, progress=False, **engine_args)
        seconds = time.perf_counter() - start
        rewards = [s["reward"] for s in log["steps"]]
        runs.append({"config": name, "seed": seed, "engine_dtype": log["engine_dtype"],
                     "quantization": log["quantization"], "tis_cap": log["tis_cap"], "rewards": rewards,
                     "final_greedy_accuracy": log["final_greedy_accuracy"], "seconds": seconds,
                     "step_seconds": statistics.fmean(sum(s["timings"].values()) for s in log["steps"])})
        print(f"{name} seed {seed}: final running mean reward {running_mean(rewards, args.window)[-1]:.3f}, "
              f"greedy accuracy {log['final_greedy_accuracy']:.2f}, {seconds:.1f} s", flush=True)
    return runs


def summary_row(name: str, runs: list[dict], window: int, last_step: int) -> dict:
    steps = [r["steps_to_threshold"] for r in runs]
    reached = [s for s in steps if s is not None]
    first = runs[0]
    engine = " + ".join(filter(None, (first["engine_dtype"], first["quantization"])))
    return {"config": name, "engine": engine, "tis_cap": first["tis_cap"],
            "steps_to_threshold": statistics.fmean(reached) if len(reached) == len(steps) else None,
            # How far the seeds' crossing steps spread: a 10% difference of means is only meaningful against it.
            "steps_sd": statistics.stdev(reached) if len(reached) == len(steps) > 1 else None,
            # A run that never reaches the threshold counted as reaching it at the last step: a lower bound on the
            # mean, defined when a seed of either configuration stalls (RL runs do, bf16's too)
            "steps_capped": statistics.fmean(last_step if s is None else s for s in steps),
            "per_seed": " ".join("-" if s is None else str(s) for s in steps),
            "reached": f"{len(reached)}/{len(steps)}",
            "final_running_reward": statistics.fmean(running_mean(r["rewards"], window)[-1] for r in runs),
            "greedy_accuracy": statistics.fmean(r["final_greedy_accuracy"] for r in runs),
            "step_seconds": statistics.fmean(r["step_seconds"] for r in runs)}


def verdict(ratio: float | None) -> str:
    if ratio is None:
        return "not measured (a run never reached the threshold)"
    return f"{ratio:.3f}, target <= {TARGET_RATIO}: {'met' if ratio <= TARGET_RATIO else 'NOT met'}"


def plot(path: Path, runs: list[dict], window: int, threshold: float, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name in dict.fromkeys(r["config"] for r in runs):
        curves = [running_mean(r["rewards"], window) for r in runs if r["config"] == name]
        steps = range(window, window + len(curves[0]))
        line, = ax.plot(steps, [statistics.fmean(c) for c in zip(*curves)], lw=2, label=f"{name} (mean of seeds)")
        for curve in curves:
            ax.plot(steps, curve, lw=0.8, alpha=0.35, color=line.get_color())
    ax.axhline(threshold, ls="--", c="gray", label=f"threshold {threshold:.3f}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel(f"running mean sample reward ({window} steps)")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", type=int, default=3, help="runs per configuration, seeds 0 .. SEEDS - 1")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--window", type=int, default=10, help="steps in the running mean of the reward")
    parser.add_argument("--threshold-fraction", type=float, default=0.9,
                        help="the threshold, as a fraction of the bf16 runs' final running mean reward")
    parser.add_argument("--tis-cap", type=float, default=2.0)
    parser.add_argument("--without-plain-fp8", action="store_true",
                        help=f"run {REFERENCE} and {CORRECTED} only (the target's two), not fp8 without TIS")
    parser.add_argument("--prompts", type=int, default=100, help="prompts per step")
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test (the CPU test runs it): 1 seed, 20 steps of 20 prompts x 4")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.prompts, args.n = 1, 20, 20, 4
    if args.seeds < 1 or args.window < 1 or args.window > args.steps:
        parser.error(f"need --seeds >= 1 and 1 <= --window <= --steps; got seeds {args.seeds}, window "
                     f"{args.window}, steps {args.steps}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    seeds = list(range(args.seeds))
    chosen = {name: engine_args for name, engine_args in configs(args.tis_cap).items()
              if name in (REFERENCE, CORRECTED) or not args.without_plain_fp8}
    runs = [run for name, engine_args in chosen.items() for run in run_config(name, engine_args, seeds, args)]
    reference_final = statistics.fmean(running_mean(r["rewards"], args.window)[-1]
                                       for r in runs if r["config"] == REFERENCE)
    threshold = args.threshold_fraction * reference_final
    for r in runs:
        r["steps_to_threshold"] = steps_to_threshold(r["rewards"], args.window, threshold)
    rows = [summary_row(name, [r for r in runs if r["config"] == name], args.window, args.steps)
            for name in chosen]
    reference_steps = rows[0]["steps_to_threshold"]
    for row in rows:
        both = reference_steps is not None and row["steps_to_threshold"] is not None
        row[f"steps_vs_{REFERENCE}"] = row["steps_to_threshold"] / reference_steps if both else None
        row[f"capped_vs_{REFERENCE}"] = row["steps_capped"] / rows[0]["steps_capped"]
    ratio = next(r[f"steps_vs_{REFERENCE}"] for r in rows if r["config"] == CORRECTED)
    name = "fp8_demo" + "_quick" * args.quick
    path = save(name, rows, vars(args) | {"threshold": threshold, "reference_final_running_reward": reference_final,
                                          "ratio": ratio, "target_ratio": TARGET_RATIO,
                                          "target_met": ratio is not None and ratio <= TARGET_RATIO, "runs": runs})
    title = (f"GRPO demo, {args.prompts} prompts x {args.n}, {args.steps} steps, seeds {seeds}, {machine()}\nsteps "
             f"until the {args.window}-step running mean reward reaches {threshold:.3f} ({args.threshold_fraction:.0%} "
             f"of {REFERENCE}'s final {reference_final:.3f})")
    plot(path.with_suffix(".png"), runs, args.window, threshold, title)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    capped = next(r[f"capped_vs_{REFERENCE}"] for r in rows if r["config"] == CORRECTED)
    print_table(rows, f"{title}\n{CORRECTED} / {REFERENCE} steps: {verdict(ratio)}; with runs that never reach it "
                      f"counted at step {args.steps}: {capped:.3f}")


if __name__ == "__main__":
    main()
