"""A process-level effect on CUDA-graph replays: one engine's batch-1 decode graph (8B shape), replayed
alone, before and after the process captures more graphs (12 graphs of 400 tiny kernels), and after those
are dropped. Seen on an H200 (2026-11-29): 4424 -> 4580 -> 4571 us; the extra time is gaps between
kernels (about 0.1 us each in the first state, 0.4 us in the second, profile_spec.py). An engine with a draft model, or
with more batch-size buckets, captures more graphs and runs in the second state."""
from __future__ import annotations

import gc
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, machine, print_table, save, shaped_checkpoint  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402


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
    main()
