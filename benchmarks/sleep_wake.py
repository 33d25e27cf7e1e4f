"""Sleep and wake on one GPU: seconds per tag and level, device memory returned, cycles without growth.

Qwen3-1.7B- and Llama-3.1-8B-shaped random bf16 models with a large KV pool (40 GB by
default). Device free memory is read with torch.cuda.mem_get_info, which sees what the
driver has, not what PyTorch's caching allocator thinks.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import result_name, machine, plot_bars, print_table, save, shaped_checkpoint  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def free_bytes() -> int:
    """Free device memory, with the caching allocator's idle blocks returned first (they are nobody's)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def pinned_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device -> pinned host copy, bytes per second (the reference for weight offload)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst.copy_(src)
    return nbytes / min(timed(lambda: dst.copy_(src, non_blocking=True)) for _ in range(3))


def median_row(repeats: list[dict]) -> dict:
    """The repeat of median seconds, with how many there were and the slowest."""
    ordered = sorted(repeats, key=lambda r: r["seconds"])
    return ordered[(len(ordered) - 1) // 2] | {"runs": len(ordered), "slowest_s": ordered[-1]["seconds"]}


def run_shape(name: str, kv_bytes: int, cycles: int, root: Path, host_bw: float) -> list[dict]:
    path = shaped_checkpoint(name, root)
    engine = Engine(path, device="cuda", load_format="dummy", kv_cache_memory=kv_bytes, max_num_seqs=256,
                    max_model_len=4096)
    prompt = [[11, 22, 33, 44, 55]]
    before = engine.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    stats = engine.memory_stats()
    held = stats["kv_cache_bytes"] + stats["weights_bytes"]
    graph = engine.runner.graphs.graphs[1]
    rows = []

    def step(label, fn, tenant_bytes):
        free0 = free_bytes()
        seconds = timed(fn)
        delta = free_bytes() - free0
        rows.append({"model": name, "step": label, "seconds": seconds, "free_delta_gb": delta / 1e9,
                     "tenant_gb": tenant_bytes / 1e9,
                     "gb_per_s": tenant_bytes / seconds / 1e9 if "weights" in label and "level 1" in label else
                     float("nan")})
        return delta

    # The first level-1 sleep page-locks its host buffer (reused by every later sleep): timed on its own.
    step("first sleep weights level 1", lambda: engine.sleep(level=1, tags=["weights"]), stats["weights_bytes"])
    engine.wake(tags=["weights"])
    free_awake = free_bytes()
    step("sleep kv_cache", lambda: engine.sleep(level=1, tags=["kv_cache"]), stats["kv_cache_bytes"])
    step("sleep weights level 1", lambda: engine.sleep(level=1, tags=["weights"]), stats["weights_bytes"])
    returned = free_bytes() - free_awake
    step("wake weights level 1", lambda: engine.wake(tags=["weights"]), stats["weights_bytes"])
    for _ in range(2):  # three offloads and restores in all, reported as their median
        step("sleep weights level 1", lambda: engine.sleep(level=1, tags=["weights"]), stats["weights_bytes"])
        step("wake weights level 1", lambda: engine.wake(tags=["weights"]), stats["weights_bytes"])
    step("wake kv_cache", lambda: engine.wake(tags=["kv_cache"]), stats["kv_cache_bytes"])
    after = engine.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    same_graph = engine.runner.graphs.graphs[1] is graph
    step("sleep level 2 (both)", lambda: engine.sleep(level=2), held)
    step("wake level 2 (both)", lambda: engine.wake(), held)
    named = {n: torch.randn_like(engine.weights.destination(n)) for n in engine.weights.names()}
    step("update_weights after level 2", lambda: engine.update_weights(named.items()), stats["weights_bytes"])
    del named

    free_start = free_bytes()
    for _ in range(cycles):
        engine.sleep(level=1, tags=["kv_cache"])
        engine.wake(tags=["kv_cache"])
    growth = free_start - free_bytes()
    print(f"{name}: engine held {held / 1e9:.2f} GB; sleep returned {returned / 1e9:.2f} GB "
          f"({returned / held:.4f}); greedy after wake identical: {after == before}; decode graph kept: {same_graph}; "
          f"{cycles} KV cycles grew device use by {growth / 1e6:.1f} MB; pinned host copy {host_bw / 1e9:.1f} GB/s")
    rows = [median_row([r for r in rows if r["step"] == label]) for label in dict.fromkeys(r["step"] for r in rows)]
    for r in rows:
        r["of_host_bw"] = r["gb_per_s"] * 1e9 / host_bw if r["gb_per_s"] == r["gb_per_s"] else float("nan")
    summary = {"model": name, "held_gb": held / 1e9, "returned_gb": returned / 1e9, "returned_fraction": returned / held,
               "same_outputs_after_wake": after == before, "graph_kept": same_graph, "cycles": cycles,
               "growth_mb": growth / 1e6}
    del engine
    torch.cuda.empty_cache()
    return rows, summary


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--kv-gb", type=float, default=40)
    parser.add_argument("--cycles", type=int, default=200)
    args = parser.parse_args()
    name = result_name("sleep_wake", args, parser)  # before any argument is adjusted below
    host_bw = pinned_copy_bandwidth()
    root = Path(tempfile.mkdtemp())
    rows, summaries = [], []
    for model in args.models:
        r, s = run_shape(model, int(args.kv_gb * 1e9), args.cycles, root, host_bw)
        rows += r
        summaries.append(s)
    print_table(rows, f"sleep/wake, {args.kv_gb:.0f} GB KV pool, {machine()}")
    print_table(summaries, "memory returned and cycles")
    save(name, rows, {"summaries": summaries, "pinned_host_bytes_per_s": host_bw})
    plot_bars(name, [f"{r['model']} {r['step']}" for r in rows], {"ms": [r["seconds"] * 1e3 for r in rows]},
              "milliseconds")


if __name__ == "__main__":
    main()
