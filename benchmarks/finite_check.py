"""The cost of refusing NaN/inf weights: steady in-process update_weights with and without the check.

A trainer's parameters (random bf16 in a public shape, on the engine's device) are pushed into an
engine again and again, as after each optimizer step. The check reads every byte of the update once
(rollout_kernels/finite.py) before its group is copied; the copy reads and writes each byte. Rows: the update
with the check, without it (Engine(check_finite=False)), the check alone, and their ratio.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_name, copy_bandwidth, machine, plot_bars, print_table, save, shaped_checkpoint, wall_time  # noqa: E402

from rollout_engine import Engine  # noqa: E402


def trainer_parameters(engine: Engine) -> dict[str, torch.Tensor]:
    g = torch.Generator(engine.device).manual_seed(1)
    return {n: torch.empty_like(engine.weights.destination(n)).normal_(0, 0.02, generator=g)
            for n in sorted(engine.weights.names())}


def measure(name: str, root: Path, reps: int, quick: bool) -> dict:
    path = shaped_checkpoint(name, root)
    kw = dict(load_format="dummy", kv_cache_memory=(1 << 26) if quick else 0.05, max_num_seqs=8)
    row = {"model": name}
    for check in (True, False):
        engine = Engine(path, check_finite=check, **kw)
        params = trainer_parameters(engine)
        nbytes = sum(t.nbytes for t in params.values())
        seconds = wall_time(lambda: engine.update_weights(params.items()), warmup=2, reps=reps)
        row["GB"] = nbytes / 1e9
        row["ms_checked" if check else "ms_unchecked"] = seconds * 1e3
        if check:
            tensors = list(params.values())
            row["ms_check_alone"] = wall_time(lambda: engine.ops.nonfinite(tensors), warmup=2, reps=reps) * 1e3
        del engine, params
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    row["check_cost"] = row["ms_checked"] / row["ms_unchecked"] - 1
    row["check_GBps"] = row["GB"] / row["ms_check_alone"] * 1e3
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test on a tiny shape")
    args = parser.parse_args()
    name = result_name("finite_check", args, parser)  # before any argument is adjusted below
    models = ["tiny-qwen3"] if args.quick else args.models
    with tempfile.TemporaryDirectory() as tmp:
        rows = [measure(m, Path(tmp), args.reps, args.quick) for m in models]
    meta = {"copy_bandwidth_GBps": copy_bandwidth() / 1e9} if torch.cuda.is_available() else {}
    save(name, rows, meta)
    plot_bars(name, [r["model"] for r in rows],
              {"checked": [r["ms_checked"] for r in rows], "unchecked": [r["ms_unchecked"] for r in rows],
               "check alone": [r["ms_check_alone"] for r in rows]}, "ms per update")
    print_table(rows, f"update_weights with and without the NaN/inf check, {machine()} {meta}")


if __name__ == "__main__":
    main()
