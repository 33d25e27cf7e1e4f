"""Where a decode step's time goes: host preparation, the graph replay (model and sampler), the whole step
(CUDA events + torch.profiler)."""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, print_table, shaped_checkpoint  # noqa: E402
from decode_roofline import decode_batch, fill_pool_random  # noqa: E402

from rollout_engine import Engine  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="qwen3-1.7b")
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--quantization", default=None, help="Engine(quantization=...), e.g. fp8")
    parser.add_argument("--kv-cache-dtype", default="auto", help="Engine(kv_cache_dtype=...), e.g. fp8")
    parser.add_argument("--rows", type=int, default=25, help="kernels listed in the profile table")
    args = parser.parse_args()
    engine = Engine(shaped_checkpoint(args.model, Path(tempfile.mkdtemp())), device="cuda", load_format="dummy",
                    max_num_seqs=max(args.batches), max_model_len=args.context + 16, kv_cache_memory=0.5,
                    quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    fill_pool_random(engine)
    runner = engine.runner
    rows = []
    for size in args.batches:
        batch = decode_batch(engine, size, args.context)
        seqs, bucket = batch.seqs, runner.graphs.bucket(size)
        begins = [s.num_computed for s in seqs]
        tokens = [[s.token_ids[b]] for s, b in zip(seqs, begins)]

        def prepare():  # what runner.step does before the replay
            runner.buffers.begin()
            runner.write_tokens(seqs, begins, tokens)
            runner.write_padding(size, size, bucket, 1)
            runner.write_sampling(seqs)
            runner.buffers.upload(bucket)

        prepare()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(100):
            prepare()
        host_ms = (time.perf_counter() - t) * 10
        graph = runner.graphs.graphs[bucket]
        rows.append({"batch": size, "host_prepare_ms": host_ms,
                     "graph_ms (model + sampling)": cuda_time(graph.replay, reps=50) * 1e3,
                     "step_ms": cuda_time(lambda: runner.step(batch), reps=50) * 1e3})
        if size == args.batches[0]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                                    torch.profiler.ProfilerActivity.CPU]) as prof:
                for _ in range(10):
                    runner.step(batch)
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows, max_name_column_width=60))
        for seq in batch.seqs:
            engine.block_manager.free_seq(seq)
    print_table(rows, f"{args.model} ({args.quantization or 'bf16'}, kv {args.kv_cache_dtype}) decode step breakdown "
                      f"at context {args.context}")


if __name__ == "__main__":
    main()
