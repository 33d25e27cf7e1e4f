"""A process-level effect on CUDA-graph replays: one engine's batch-1 decode graph (8B shape), replayed
alone, before and after the process captures more graphs (12 graphs of 400 tiny kernels), and after those
are dropped. Seen on an H200 (2026-11-29): 4424 -> 4580 -> 4571 us; the extra time is gaps between
kernels (about 0.1 us each in the first state, 0.4 us in the second, profile_spec.py). An engine with a draft model, or
with more batch-size buckets, captures more graphs and runs in the second state.

`--toy` reproduces it without the engine, each case in a fresh process: a graph of 400 tiny kernels, replayed
before and after 12 more such graphs are captured, with 128 MB of live memory written either as sixteen 8 MB
tensors or as one. Seen (H200, 2026-11-29): sixteen: 0.86 -> 1.03 us per kernel; one: no change; sixteen
allocated but never written: no change; a single extra graph: no change."""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, machine, print_table, save, shaped_checkpoint  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402


def toy(tensors: int) -> dict:
    """Per-kernel us of a 400-kernel graph before and after 12 more graphs, with 128 MB in `tensors` tensors."""
    live = [torch.ones((128 << 20) // tensors, dtype=torch.uint8, device="cuda") for _ in range(tensors)]
    x = torch.ones(1024, device="cuda")

    def chain():
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(400):
                x.add_(1)
        return graph

    victim = chain()
    before = cuda_time(victim.replay, reps=20) * 1e6 / 400
    others = [chain() for _ in range(12)]
    row = {"live_tensors": tensors, "us_per_kernel_before": before,
           "us_per_kernel_after": cuda_time(victim.replay, reps=20) * 1e6 / 400}
    del live, others
    return row


def toys():
    rows = []
    for tensors in (16, 1):
        out = subprocess.run([sys.executable, __file__, "--toy-case", str(tensors)], capture_output=True, text=True,
                             check=True)
        rows.append(json.loads(out.stdout.splitlines()[-1]))
    print_table(rows, f"400-kernel graph before/after 12 more graphs, 128 MB live, {machine()}")
    save("graph_gaps_toy", rows)


def main():
    engine = Engine(shaped_checkpoint("llama-3.1-8b", Path(tempfile.mkdtemp())), device="cuda",
                    load_format="dummy", max_num_seqs=4, kv_cache_memory=0.2, max_model_len=512)
    engine.generate([list(range(100, 164))], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                    use_tqdm=False)
    decode = engine.runner.graphs.graphs[1]
    rows = [{"state": "one engine (3 decode graphs)", "decode_graph_us": cuda_time(decode.replay, reps=30) * 1e6}]
    x = torch.ones(1024, device="cuda")
    others = []
    for _ in range(12):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(400):
                x.add_(1)
        others.append(graph)
    rows.append({"state": "+ 12 graphs of 400 kernels", "decode_graph_us": cuda_time(decode.replay, reps=30) * 1e6})
    del others, graph
    gc.collect()
    rows.append({"state": "those dropped", "decode_graph_us": cuda_time(decode.replay, reps=30) * 1e6})
    print_table(rows, f"batch-1 decode graph replayed alone, {machine()}")
    save("graph_gaps", rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--toy-case"]:
        print(json.dumps(toy(int(sys.argv[2]))))
    elif sys.argv[1:2] == ["--toy"]:
        toys()
    else:
        main()
