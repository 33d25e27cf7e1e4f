"""Decode step time against the HBM roofline, for Qwen3-1.7B- and Llama-3.1-8B-shaped random bf16 models.

One decode step must read every weight once and the K/V of every running sequence, so
its floor is (weight bytes + KV bytes) / bandwidth, with the bandwidth a device-to-device
copy reaches in this same run. A step here is the engine's own: host-side batch
preparation, the CUDA-graph forward (all layers + logits), sampling, and reading the
tokens back ("step": one synchronous step; "pipelined": a step of the engine's generate loop,
where each decode step is launched before the previous one's tokens are read, timed over
PIPELINED_STEPS steps of sequences whose context is already in the pool; its roofline uses
the mean context of those steps).

`--quantization fp8` runs every shape again with fp8 projections (Engine(quantization="fp8")) after the
unquantized engine: rows side by side, "weights" naming the format, "speedup" the unquantized step time over
this one. The roofline counts the bytes the engine holds: fp8 weights at 1 byte plus their float32 scales.
`--batch-invariant` runs every shape again with Engine(batch_invariant=True): its "speedup" (below 1) is the
default step time over the batch-invariant one, so its cost is 1 / speedup - 1.
`--tensor-parallel N` runs every engine with tensor_parallel_size=N (N GPUs, one process each; on the CPU, gloo):
the weight and KV bytes are one rank's shard, so the roofline is per GPU. "allreduce_ms" is the step's collectives
timed alone on the same ranks (2 all-reduces of [batch, hidden] per layer and the all-gather of [batch, vocab / N]
logits, in the model's dtype, from a CUDA graph); "compute_ms" is step_ms less that, and "compute_of_roofline" /
"pipelined_compute_of_roofline" the roofline over the step times without the collectives.
`--cublas` runs every weight format first with each projection on cuBLAS(Lt) (rollout_kernels.gemv.BATCH1_PATH = False:
the batch-1 kernel off, fp8 activations at batch 1 too), the baseline of "speedup".
`--unfused` does the same with the batch-1 path's fusions off: first all (rollout_kernels.gemv.FUSED_GATE and
FUSED_NORM = False: the norms, gate_up's GEMV and SiLU-and-mul each a launch of its own; rollout_kernels.decode_attention.
FUSED_ROPE = False: rope_store and attention two launches; rollout_kernels.attention.FIRST_TILE_AHEAD = False: attention's
first keys loaded after the wait for the previous kernel), then the norms alone, then attention's alone, then
with a step's inputs and results moved by the copy engine (rollout_engine.step_buffers.KERNEL_COPIES = False).
`--quick` runs tiny shapes on the CPU (a smoke test of the script, not a measurement).
"""
from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUANTIZATIONS, QUICK_SHAPES, copy_bandwidth, format_label, machine, plot_bars,  # noqa: E402
                    print_table, result_name, save, shaped_checkpoint, sync, weight_formats)

from rollout_kernels import attention, decode_attention, gemv  # noqa: E402
from rollout_engine import Engine, SamplingParams, step_buffers  # noqa: E402
from rollout_engine.scheduler import Batch  # noqa: E402
from rollout_engine.sequence import Sequence, Status  # noqa: E402
from rollout_engine.parallel import fill_kv_random  # noqa: E402

PIPELINED_STEPS = 48


def fill_pool_random(engine: Engine) -> None:
    """Every rank's KV pool to noise: attention over the contexts the benchmark never computed reads real values."""
    if engine.tp is not None:
        engine.tp.fill_kv_random(engine.kv)
    else:
        fill_kv_random(engine.kv)


def decode_batch(engine: Engine, batch_size: int, context: int, max_tokens: int = 1 << 20) -> Batch:
    """`batch_size` sequences whose first context-1 tokens are in the pool; each decodes its last token."""
    g = torch.Generator().manual_seed(batch_size * 7919 + context)
    batch = Batch()
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch_size):
        ids = torch.randint(0, engine.cfg.vocab_size, (context,), generator=g).tolist()
        seq = Sequence(i, 0, ids, params, seed=i)
        assert engine.block_manager.grow(seq, context)
        seq.num_computed = context - 1
        batch.add(seq, 1)
    return batch


def pipelined_step(engine: Engine, batch_size: int, context: int) -> float:
    """Median seconds per decode step of the engine's own loop (each step launched before the previous
    one's tokens are read), over PIPELINED_STEPS steps of sequences whose context is already in the pool."""
    steps = []
    for _ in range(4):  # the first is warm-up
        for seq in decode_batch(engine, batch_size, context, max_tokens=PIPELINED_STEPS).seqs:
            seq.status = Status.RUNNING
            engine.scheduler.running.append(seq)
        sync(engine.device)
        t = time.perf_counter()
        finished = list(engine.loop.run())
        sync(engine.device)
        assert len(finished) == batch_size and all(len(s.output_ids) == PIPELINED_STEPS for s in finished)
        steps.append((time.perf_counter() - t) / PIPELINED_STEPS)
    return sorted(steps[1:])[1]


def weight_bytes_read(engine: Engine) -> int:
    """Bytes one decode step reads from weights on one device: everything but the embedding table, except the
    rows a tied head reads (all of them on one device; under tensor parallelism each rank keeps the whole table
    but its logits read only its slice of the vocabulary). Each parameter at its stored size: an fp8 weight 1
    byte a value, plus its float32 scale."""
    embed = engine.model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in engine.model.parameters()) - embed.numel() * embed.element_size()
    if engine.cfg.tie_word_embeddings:
        total += embed.numel() * embed.element_size() // engine.config.tensor_parallel_size
    scales = [b for name, b in engine.model.named_buffers() if name.endswith("weight_scale")]
    return total + sum(b.numel() * b.element_size() for b in scales)


def kv_bytes_per_token(engine: Engine) -> int:
    return engine.kv.planner.block_bytes // engine.block_size


def context_reads(spans, prompt_len: int, prompt_readers: int = 1) -> float:
    """KV entries read to generate tokens first..last-1 of each sample, (first, last) in `spans`: each token
    reads its sample's whole context (the prompt and the tokens before it), the prompt's part shared by
    `prompt_readers` samples that decode together (the n samples of a prompt, read once for all of them)."""
    return sum(prompt_len * (last - first) / prompt_readers + (last * (last - 1) - first * (first - 1)) // 2
               for first, last in spans)


def floor_seconds(spans, prompt_len: int, steps: int, kv_per_token: int, weights: int, bandwidth: float,
                  prompt_readers: int = 1) -> float:
    """The memory floor of a run's decode: its context reads (context_reads) and the weights once per step. The
    KV part depends on the lengths alone, whatever the schedule: a long-tailed batch reads far more KV per
    token than a fixed one."""
    return (context_reads(spans, prompt_len, prompt_readers) * kv_per_token + steps * weights) / bandwidth


def run_shape(name: str, batches, contexts, bandwidth: float, root: Path, device: str,
              quantization: str | None = None, batch_invariant: bool = False, tp: int = 1,
              baseline: str | None = None) -> list[dict]:
    """baseline "cublas": every projection on cuBLAS(Lt), the batch-1 path off (rollout_kernels.gemv.BATCH1_PATH =
    False); "unfused": without the batch-1 overlaps and fusions (FUSED_GATE, FUSED_NORM, FUSED_ROPE,
    FIRST_TILE_AHEAD); "unfused norm": without the norms in the projections' kernels (FUSED_NORM); "unfused
    attention": rope_store and attention apart, attention's first keys loaded after the wait (FUSED_ROPE,
    FIRST_TILE_AHEAD); "copy engine": a step's inputs and results moved by cudaMemcpyAsync, not copy_step's
    kernel (step_buffers.KERNEL_COPIES)."""
    in_attention = [(decode_attention, "FUSED_ROPE"), (attention, "FIRST_TILE_AHEAD")]
    switches = {"cublas": [(gemv, "BATCH1_PATH")],
                "unfused": [(gemv, "FUSED_GATE"), (gemv, "FUSED_NORM")] + in_attention,
                "unfused norm": [(gemv, "FUSED_NORM")], "unfused attention": in_attention,
                "copy engine": [(step_buffers, "KERNEL_COPIES")]}.get(baseline, [])
    before = [(module, flag, getattr(module, flag)) for module, flag in switches]
    for module, flag in switches:
        setattr(module, flag, False)
    try:
        return _run_shape(name, batches, contexts, bandwidth, root, device, quantization, batch_invariant, tp,
                          f" {baseline}" if baseline else "")
    finally:
        for module, flag, value in before:
            setattr(module, flag, value)


def _run_shape(name, batches, contexts, bandwidth, root, device, quantization, batch_invariant, tp, label):
    need_tokens = max(batches) * max(contexts)
    engine = Engine(shaped_checkpoint(name, root), device=device, load_format="dummy", max_num_seqs=max(batches),
                    max_model_len=max(contexts) + PIPELINED_STEPS + 1, kv_cache_memory=0.9,
                    quantization=quantization, batch_invariant=batch_invariant, tensor_parallel_size=tp)
    fill_pool_random(engine)
    per_token = kv_bytes_per_token(engine)
    weights = weight_bytes_read(engine)
    rows = []
    for context in contexts:
        for batch_size in batches:
            row = {"model": name,
                   "weights": format_label(quantization, engine.dtype) + " batch-invariant" * batch_invariant + label,
                   "tp": tp, "batch": batch_size,
                   "context": context}
            if batch_size * (context + PIPELINED_STEPS) > engine.block_manager.num_blocks * engine.block_size:
                rows.append(row | {"step_ms": float("nan"), "roofline_ms": float("nan"), "of_roofline": float("nan"),
                                   "pipelined_ms": float("nan"), "pipelined_of_roofline": float("nan"),
                                   "tokens_per_s": float("nan"), "note": "KV does not fit"})
                continue
            batch = decode_batch(engine, batch_size, context)
            for _ in range(3):
                engine.runner.step(batch)
            times = []
            for _ in range(20):
                sync(device)
                t = time.perf_counter()
                engine.runner.step(batch)  # ends by reading tokens back: a full synchronous step
                times.append(time.perf_counter() - t)
            step = sorted(times)[len(times) // 2]
            for seq in batch.seqs:
                engine.block_manager.free_seq(seq)
            roofline = (weights + batch_size * context * per_token) / bandwidth
            piped = pipelined_step(engine, batch_size, context)
            piped_roofline = (weights + batch_size * (context + PIPELINED_STEPS // 2) * per_token) / bandwidth
            rows.append(row | {"step_ms": step * 1e3, "roofline_ms": roofline * 1e3, "of_roofline": roofline / step,
                               "pipelined_ms": piped * 1e3, "pipelined_of_roofline": piped_roofline / piped,
                               "tokens_per_s": batch_size / piped, "note": ""})
            if engine.tp is not None:
                rows[-1] |= collectives_split(engine, batch_size, step, roofline, piped, piped_roofline)
    del engine
    gc.collect()  # the engine's modules reference each other: free them now, not at some later collection
    if device == "cuda":
        torch.cuda.empty_cache()
    print(f"{name} ({rows[0]['weights']}): {need_tokens} tokens of KV at most, {per_token} KV bytes per token, "
          f"{weights / 1e9:.3f} GB weights read per step")
    return rows


def collectives_split(engine: Engine, batch_size: int, step: float, roofline: float, piped: float,
                      piped_roofline: float) -> dict:
    """The step's collectives timed alone, and the share of the per-GPU roofline without them."""
    collectives = engine.tp.time_collectives(batch_size, engine.cfg, engine.dtype)
    return {"allreduce_ms": collectives * 1e3, "compute_ms": (step - collectives) * 1e3,
            "compute_of_roofline": roofline / (step - collectives),
            "pipelined_compute_of_roofline": piped_roofline / (piped - collectives)}


def add_speedups(rows: list[dict]) -> None:
    """Each row's pipelined step time over the unquantized engine's for the same model, batch and context."""
    base = {(r["model"], r["batch"], r["context"]): r["pipelined_ms"] for r in rows if r["weights"] == rows[0]["weights"]}
    for r in rows:
        r["speedup"] = base.get((r["model"], r["batch"], r["context"]), float("nan")) / r["pipelined_ms"]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 8, 64, 256])
    parser.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096])
    parser.add_argument("--quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                        help="also run each shape with these weight formats, after the unquantized engine")
    parser.add_argument("--batch-invariant", action="store_true", help="also run each shape with batch_invariant=True")
    parser.add_argument("--cublas", action="store_true",
                        help="first run each weight format with every projection on cuBLAS(Lt) (the baseline of 'speedup')")
    parser.add_argument("--unfused", action="store_true",
                        help="first run each weight format without the decode fusions, then without the fused norms, "
                             "then without attention's, then with the step's copies on the copy engine")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="tensor_parallel_size of every engine")
    parser.add_argument("--gemv-rows", type=int, default=gemv.GEMV_ROWS, choices=[1, 2, 3],
                        help="rollout_kernels.gemv.GEMV_ROWS: the most rows of x a projection sends to the GEMV, not cuBLAS(Lt)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU: a smoke test of the script")
    args = parser.parse_args()
    result = result_name("decode_roofline", args, parser)
    gemv.GEMV_ROWS = args.gemv_rows
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.models, args.batches, args.contexts = list(QUICK_SHAPES), [1, 4], [32]
    bandwidth = copy_bandwidth(device=device)
    root = Path(tempfile.mkdtemp())
    rows = []
    for name in args.models:  # saved after each shape, so a run cut short keeps what it measured
        for quantization in weight_formats(args.quantization):
            baselines = ["cublas"] * args.cublas + ["unfused", "unfused norm", "unfused attention",
                                                    "copy engine"] * args.unfused
            for baseline in baselines + [None]:
                rows += run_shape(name, args.batches, args.contexts, bandwidth, root, device, quantization,
                                  tp=args.tensor_parallel, baseline=baseline)
        if args.batch_invariant:
            rows += run_shape(name, args.batches, args.contexts, bandwidth, root, device, batch_invariant=True,
                              tp=args.tensor_parallel)
        add_speedups(rows)
        print_table(rows, f"decode step vs roofline (copy bandwidth {bandwidth / 1e12:.2f} TB/s), {machine()}")
        save(result, rows, {"copy_bandwidth_bytes_per_s": bandwidth})
    labels = [f"{r['model']} {r['weights']} b{r['batch']} c{r['context']}" for r in rows]
    series = {"measured ms": [r["step_ms"] for r in rows], "roofline ms": [r["roofline_ms"] for r in rows]}
    plot_bars(result, labels, series, "ms per decode step")


if __name__ == "__main__":
    main()
