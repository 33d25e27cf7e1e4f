"""What batch-invariant mode's kernels cost against the default ones, in CUDA graphs: the batch-invariant
matmul against torch (cuBLAS) on every projection of the 1.7B and 8B shapes and the LM head at
M = 1, 64, 256, 2048 (plus one decode step's projections together), and decode attention with and
without the fixed key split at batch 1 and 64, 1k and 4k context.

  python benchmarks/batch_invariant_cost.py          # GPU
  python benchmarks/batch_invariant_cost.py --quick  # CPU smoke run: tiny shapes, the torch twins, wall time

Weights (and K/V) rotate through copies larger than L2, so small-M timings read HBM as a decode step does."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

QUICK = "--quick" in sys.argv
if QUICK:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; the twins run, not Triton

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import QUICK_SHAPES, SHAPES, plot_bars, print_table, result_name, save, wall_time  # noqa: E402

from rollout_kernels import attention, batch_invariant  # noqa: E402

ROTATE_BYTES = 512 << 20
ROWS = (1, 64, 256, 2048)
BLOCK_SIZE = 16
MAX_MODEL_LEN = 8192  # block-table width of the attention launches, as an engine's max_model_len sets it


def timer():
    """us per call: replayed in a CUDA graph on the GPU, wall time on the CPU."""
    if torch.cuda.is_available():
        from decode_gemm_paths import graph_us
        return graph_us
    return lambda calls: wall_time(lambda: [c() for c in calls]) * 1e6 / len(calls)


def projections(shape: dict) -> dict:
    """(N, K) of each projection of one layer, and of the LM head."""
    h, i = shape["hidden_size"], shape["intermediate_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * i, h), "down": (h, i),
            "lm_head": (shape["vocab_size"], h)}


def gemm_rows(shapes, rows, device, dtype, invariant, time_us):
    out = []
    for name, shape in shapes.items():
        for proj, (n, k) in projections(shape).items():
            nbytes = n * k * dtype.itemsize
            ws = [torch.randn(n, k, device=device, dtype=dtype) * k ** -0.5
                  for _ in range(max(2, ROTATE_BYTES // nbytes) if device == "cuda" else 1)]
            for m in rows:
                x = torch.randn(m, k, device=device, dtype=dtype)
                base = time_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
                inv = time_us([lambda w=w: invariant(x, w) for w in ws])
                out.append({"model": name, "proj": proj, "N": n, "K": k, "M": m, "torch_us": base,
                            "invariant_us": inv, "ratio": inv / base})
            del ws
    return out


def step_rows(gemms, shapes):
    """One forward's projections together: every layer's four, plus the LM head, per model and M."""
    out = []
    for name, shape in shapes.items():
        for m in sorted({r["M"] for r in gemms}):
            mine = [r for r in gemms if r["model"] == name and r["M"] == m]
            count = lambda r: 1 if r["proj"] == "lm_head" else shape["num_hidden_layers"]
            base = sum(r["torch_us"] * count(r) for r in mine)
            inv = sum(r["invariant_us"] * count(r) for r in mine)
            out.append({"model": name, "M": m, "torch_ms": base / 1e3, "invariant_ms": inv / 1e3, "ratio": inv / base})
    return out


def attention_rows(shapes, batches, contexts, device, dtype, paged_attention, time_us):
    out = []
    for name, shape in shapes.items():
        heads, kv_heads, head_dim = shape["num_attention_heads"], shape["num_key_value_heads"], shape["head_dim"]
        for batch in batches:
            for context in contexts:
                width = max(context, MAX_MODEL_LEN) // BLOCK_SIZE
                kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
                copies = max(2, ROTATE_BYTES // kv_bytes) if device == "cuda" else 1
                used = context // BLOCK_SIZE
                k_cache = torch.randn(copies * batch * used, BLOCK_SIZE, kv_heads, head_dim, device=device, dtype=dtype)
                v_cache = torch.randn_like(k_cache)
                ids = torch.randperm(copies * batch * used, device=device, dtype=torch.int32).view(copies, batch, used)
                tables = torch.zeros(copies, batch, width, device=device, dtype=torch.int32)
                tables[:, :, :used] = ids
                seq_lens = torch.full((batch,), context, device=device, dtype=torch.int32)
                starts = torch.arange(batch + 1, device=device, dtype=torch.int32)
                q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
                row = {"model": name, "batch": batch, "context": context}
                for label, fixed in (("default_us", False), ("fixed_split_us", True)):
                    row[label] = time_us([lambda t=t: paged_attention(q, k_cache, v_cache, t, seq_lens, starts, 1,
                                                                      head_dim ** -0.5, fixed_split=fixed)
                                          for t in tables])
                row["ratio"] = row["fixed_split_us"] / row["default_us"]
                out.append(row)
                del k_cache, v_cache
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: tiny shapes, the torch twins")
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.quick
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = SHAPES if cuda else QUICK_SHAPES
    invariant = batch_invariant.batch_invariant_linear_triton if cuda else batch_invariant.batch_invariant_linear_ref
    paged = attention.paged_attention_triton if cuda else attention.paged_attention_ref
    time_us = timer()
    gemms = gemm_rows(shapes, ROWS if cuda else (1, 64), device, dtype, invariant, time_us)
    steps = step_rows(gemms, shapes)
    attn = attention_rows(shapes, (1, 64) if cuda else (1, 4), (1024, 4096) if cuda else (256, 600), device, dtype,
                          paged, time_us)
    name = result_name("batch_invariant_cost", args, parser)
    path = save(name, gemms + steps + attn, {"dtype": str(dtype), "quick": args.quick})
    print_table(gemms, f"projection GEMMs, us per call ({'CUDA graph' if cuda else 'CPU wall'}): torch vs batch-invariant")
    print_table(steps, "one forward's projections (layers x 4 + LM head), ms")
    print_table(attn, "decode attention, us per call: default split vs fixed split")
    labels = [f"{r['model']} M={r['M']}" for r in steps] + [f"{r['model']} attn b{r['batch']} {r['context']}"
                                                           for r in attn]
    plot_bars(name, labels, {"batch-invariant / default": [r["ratio"] for r in steps + attn]},
              "time ratio (1 = free)", out_dir=path.parent)
    print(f"\nwrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
