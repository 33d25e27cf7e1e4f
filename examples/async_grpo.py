"""One-step-off-policy GRPO on the demo task, against the synchronous demo in the same process.

    python examples/async_grpo.py                    # CPU: both runs, about a minute on 2 cores
    python examples/async_grpo.py --steps 150 --push-mode keep

Synchronous (trainer_adapters.demo.run_demo): generate -> sleep -> train -> wake -> sync, one after the other.
One step off (trainer_adapters.async_demo.run_async_demo): while the trainer does step t on batch t, an
AsyncEngine samples batch t+1 (100 requests of n=8, submitted through AsyncEngine.generate from an asyncio
loop on another thread); after the optimizer step the weights go in with pause_generation("retract") ->
update_weights -> continue_generation. The loss takes per-token importance ratios from each token's
weight version: ratio 1 for tokens of the trainer's current version, exp(logp_now - logp_behaviour),
clipped, for tokens of an older one. Both runs use the same task, tiny policy, batch sizes and steps.

Both runs use `--threads` torch intra-op threads (default 1); the one-step-off run has two busy threads
(trainer, engine loop), so on 2 cores the overlap is what uses the second core.

Exit status 1 if the one-step-off run's mean sample reward over its last 5 steps is below 0.8 (the figure
`rollout-engine demo` prints as "mean sample reward A -> B").
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers  # noqa: F401 - imported before either run is timed

from trainer_adapters.async_demo import run_async_demo
from trainer_adapters.demo import run_demo


def last5(log) -> float:
    steps = log["steps"]
    return sum(s["reward"] for s in steps[-5:]) / min(5, len(steps))


def first5(log) -> float:
    steps = log["steps"]
    return sum(s["reward"] for s in steps[:5]) / min(5, len(steps))


def first_step_at(log, level: float = 0.8) -> int | None:
    """The first step whose 5-step running mean reward reaches `level`."""
    r = [s["reward"] for s in log["steps"]]
    return next((i + 1 for i in range(4, len(r)) if sum(r[i - 4: i + 1]) / 5 >= level), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--out", default=None, help="where the logs and plots go (default: a temporary folder)")
    parser.add_argument("--push-mode", default="retract", choices=["retract", "keep"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads per thread (default 1: on 2 shared, loaded cores, 2 OpenMP "
                             "threads on the main thread made the synchronous demo ~5x slower; measured)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out or tempfile.mkdtemp())

    load = [os.getloadavg()[0]]
    t, cpu = time.perf_counter(), time.process_time()
    sync_log = run_demo(out / "sync", steps=args.steps, seed=args.seed, device=args.device, progress=False)
    sync_s, sync_cpu = time.perf_counter() - t, time.process_time() - cpu
    load.append(os.getloadavg()[0])
    sync_steps_s = sum(sum(s["timings"].values()) for s in sync_log["steps"])

    async_log = run_async_demo(out / "async", steps=args.steps, seed=args.seed, device=args.device,
                               push_mode=args.push_mode, progress=False)
    async_cpu = time.process_time() - cpu - sync_cpu
    load.append(os.getloadavg()[0])
    async_s, async_steps_s = async_log["wall_s"], async_log["loop_s"]

    print(f"\none-step-off GRPO (push mode {args.push_mode!r}), per step: reward, off-policy token fraction, "
          "mean ratio on off-policy tokens, clipped fraction, wait/train/push ms")
    for s in async_log["steps"]:
        if s["step"] <= 3 or s["step"] % 10 == 0 or s["step"] == args.steps:
            t_ = s["timings"]
            print(f"  step {s['step']:3d}  reward {s['reward']:.2f}  off-policy {s['off_policy_fraction']:.2f} "
                  f"(versions {s['versions']}, trainer {s['trainer_version']})  ratio {s['ratio_mean_off']:.3f}  "
                  f"clipped {s['clip_fraction']:.2f}  {t_['wait'] * 1e3:.0f}/{t_['train'] * 1e3:.0f}/"
                  f"{t_['push'] * 1e3:.0f} ms")
    mean_ms = lambda log, key: statistics.mean(s["timings"][key] for s in log["steps"][1:]) * 1e3  # noqa: E731
    print(f"\nsynchronous demo, per step: generate {mean_ms(sync_log, 'generate'):.0f} ms, train "
          f"{mean_ms(sync_log, 'train'):.0f} ms, sleep+sync+wake "
          f"{mean_ms(sync_log, 'sleep') + mean_ms(sync_log, 'sync') + mean_ms(sync_log, 'wake'):.0f} ms")
    print(f"one step off, per step:       wait for rollouts {mean_ms(async_log, 'wait'):.0f} ms, train "
          f"{mean_ms(async_log, 'train'):.0f} ms, push {mean_ms(async_log, 'push'):.0f} ms")
    rows = [("synchronous demo", sync_log, sync_s, sync_steps_s, sync_cpu),
            ("one step off", async_log, async_s, async_steps_s, async_cpu)]
    print(f"\n{args.steps} steps of 100 prompts x 8, same process ({torch.get_num_threads()} torch threads, "
          f"{os.cpu_count()} cores; 1-min load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} at start / "
          "between / end)")
    print(f"{'run':18s} {'wall s':>7s} {'steps s':>8s} {'CPU s':>6s} {'reward first5 -> last5':>23s} "
          f"{'5-step mean >= 0.8 at':>22s} {'greedy acc':>11s}")
    for name, log, wall, steps_s, cpu_s in rows:
        print(f"{name:18s} {wall:7.1f} {steps_s:8.1f} {cpu_s:6.1f} {first5(log):14.2f} -> {last5(log):.2f} "
              f"{str(first_step_at(log)):>22s} {log['eval'][0][1]:5.2f} -> {log['final_greedy_accuracy']:.2f}")
    print(f"saving: wall {1 - async_s / sync_s:.0%} ({sync_s - async_s:.1f} s), steps only "
          f"{1 - async_steps_s / sync_steps_s:.0%} ({sync_steps_s - async_steps_s:.1f} s)")
    print(f"logs and reward curves in {out}")
    ok = last5(async_log) >= 0.8
    print(f"one-step-off mean sample reward, last 5 steps: {last5(async_log):.2f} "
          f"({'PASS' if ok else 'FAIL'}: needs >= 0.8)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
