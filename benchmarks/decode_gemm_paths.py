"""What a small-batch decode step's pieces cost inside a CUDA graph, against HBM: each projection GEMM of the
1.7B and 8B shapes through cuBLAS(Lt) paths and the engine's batch-1 kernel (rollout_kernels/gemv.py: a sweep of
its tile shapes beside the fixed rule it uses, bf16 and fp8 weights, the LM heads too), and decode
attention by number of key splits. `--gemv-only` runs the kernel sweep alone (`--rows 2` or `3`: for that many
rows of x, each weight tile read once for all of them, against cuBLAS(Lt) at as many rows); `--fused` times the batch-1
path's fusions (the norm in qkv's and gate_up's kernel, SiLU-and-mul in gate_up's) against the same ops
launched apart, over a sweep of the fused kernel's tiles.

Weights rotate through copies larger than L2 so no repeat reads from cache."""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import SHAPES, copy_bandwidth, plot_bars, print_table, save  # noqa: E402

import rollout_kernels.attention as attention  # noqa: E402
from rollout_kernels import fp8, gemv  # noqa: E402

ROTATE_BYTES = 512 << 20


def graph_us(calls, reps=20):
    """Median microseconds of one call, each call replayed inside one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return triton.testing.do_bench(graph.replay, warmup=5, rep=reps * 5, return_mode="median") * 1e3 / len(calls)


def gemm_rows(bandwidth):
    rows = []
    for name, proj, n, k in projections():
        nbytes = n * k * 2
        copies = max(2, ROTATE_BYTES // nbytes)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        row = {"model": name, "proj": proj, "N": n, "K": k, "MB": nbytes / 2 ** 20,
               "roofline_us": nbytes / bandwidth * 1e6}
        for batch in (1, 8):
            x = torch.randn(batch, k, device="cuda", dtype=torch.bfloat16)
            for lib in ("cublaslt", "cublas"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
                row[f"{lib}_b{batch}_us"] = us
            torch.backends.cuda.preferred_blas_library("cublaslt")
        x1 = torch.randn(k, device="cuda", dtype=torch.bfloat16)
        row["mv_b1_us"] = graph_us([lambda w=w: torch.mv(w, x1) for w in ws])
        row["best_cublas_b1_of_roofline"] = row["roofline_us"] / min(row["cublaslt_b1_us"], row["cublas_b1_us"],
                                                                     row["mv_b1_us"])
        rows.append(row)
        del ws
    return rows


def projections(lm_head: bool = False):
    """(model, proj, N, K) of every projection of the two shapes (and their LM heads)."""
    for name in ("qwen3-1.7b", "llama-3.1-8b"):
        s = SHAPES[name]
        h, i = s["hidden_size"], s["intermediate_size"]
        qkv = (s["num_attention_heads"] + 2 * s["num_key_value_heads"]) * s["head_dim"]
        shapes = {"qkv": (qkv, h), "o": (h, s["num_attention_heads"] * s["head_dim"]), "gate_up": (2 * i, h),
                  "down": (h, i)} | ({"lm_head": (s["vocab_size"], h)} if lm_head else {})
        for proj, (n, k) in shapes.items():
            yield name, proj, n, k


def gemv_configs():
    """The tiles swept (both weight formats)."""
    return [(bn, bk, w) for bn in (2, 4, 8) for bk in (512, 1024, 2048) for w in (4, 8)]


def gemv_rows(bandwidth, x_rows: int = 1):
    """Per projection and weight format at `x_rows` rows of x (batch 1 by default): cuBLAS(Lt) (F.linear; for fp8
    torch._scaled_mm with the activation quantized beforehand, as the large-batch path does), the batch-1 kernel
    with its fixed tile rule (for fp8 with the bf16 activation, as the engine runs it), and the best tile of a
    sweep."""
    rows = []
    for name, proj, n, k in projections(lm_head=True):
        for fmt in ("bf16", "fp8"):
            item = 1 if fmt == "fp8" else 2
            copies = max(2, ROTATE_BYTES // (n * k * item))
            ws, scales = [], []
            for _ in range(copies):
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                if fmt == "fp8":
                    w, sw = fp8.quantize_fp8_triton(w)
                    scales.append(sw)
                ws.append(w)
            x = torch.randn(x_rows, k, device="cuda", dtype=torch.bfloat16)
            row = {"model": name, "proj": proj, "weights": fmt, "rows": x_rows,
                   "roofline_us": n * k * item / bandwidth * 1e6}
            if fmt == "fp8":
                xq = fp8.Fp8Tensor(*fp8.quantize_fp8_triton(x), x.dtype)
                row["cublas_us"] = graph_us([lambda w=w, s=s: fp8.fp8_linear_triton(xq, w, s) for w, s in zip(ws, scales)])
            else:
                row["cublas_us"] = graph_us([lambda w=w: torch.nn.functional.linear(x, w) for w in ws])
            sw = scales or [None] * len(ws)

            def timed(config):
                return graph_us([lambda w=w, s=s: gemv.gemv_triton(x, w, None, s, config=config) for w, s in zip(ws, sw)])

            rule = gemv.gemv_config(fmt == "fp8", k, rows=x_rows)
            row["rule"], row["rule_us"] = str(rule), timed(rule)
            tried = {c: timed(c) for c in gemv_configs()}
            best = min(tried, key=tried.get)
            row["best"], row["best_us"] = str(best), tried[best]
            row["rule_of_roofline"] = row["roofline_us"] / row["rule_us"]
            row["best_of_roofline"] = row["roofline_us"] / row["best_us"]
            row["cublas_of_roofline"] = row["roofline_us"] / row["cublas_us"]
            rows.append(row)
            del ws
    return rows


def fused_configs():
    return [(bn, bk, w) for bn in (1, 2, 4, 8, 16) for bk in (1024, 2048) for w in (4, 8)]


def fused_rows(bandwidth):
    """The batch-1 path's fusions, us per layer in a graph, bf16 and fp8 weights: qkv after the input norm
    and gate_up after the post-attention norm with SiLU-and-mul. "unfused": the norm's kernel, the
    projection's, (silu_and_mul); "fused": one kernel (a NormedRow x; gated for gate_up) at its rule and at
    the best tile of a sweep."""
    from rollout_kernels.activation import silu_and_mul_triton
    from rollout_kernels.norm import rms_norm_triton

    rows = []
    for name, proj, n, k in projections():
        if proj not in ("qkv", "gate_up"):
            continue
        gated = proj == "gate_up"
        for fmt in ("bf16", "fp8"):
            item = 1 if fmt == "fp8" else 2
            ws, scales = [], []
            for _ in range(max(2, ROTATE_BYTES // (n * k * item))):
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                if fmt == "fp8":
                    w, sw = fp8.quantize_fp8_triton(w)
                    scales.append(sw)
                ws.append(w)
            sw = scales or [None] * len(ws)
            x, res = (torch.randn(1, k, device="cuda", dtype=torch.bfloat16) for _ in range(2))
            norm_w = torch.ones(k, device="cuda", dtype=torch.bfloat16)
            row = {"model": name, "proj": proj, "weights": fmt, "roofline_us": n * k * item / bandwidth * 1e6}

            def unfused(w, s):
                y = gemv.gemv_triton(rms_norm_triton(x, norm_w, 1e-6, res)[0], w, None, s)
                return silu_and_mul_triton(y) if gated else y

            row["unfused_us"] = graph_us([lambda w=w, s=s: unfused(w, s) for w, s in zip(ws, sw)])

            def timed(config):
                return graph_us([lambda w=w, s=s: gemv.gemv_triton(
                    gemv.NormedRow(x, res, norm_w, 1e-6, torch.empty_like(x)), w, None, s, config=config,
                    gated=gated) for w, s in zip(ws, sw)])

            rule = gemv.gemv_config(fmt == "fp8", k, gated, norm=True)
            row["rule"], row["fused_us"] = str(rule), timed(rule)
            tried = {c: timed(c) for c in fused_configs()}
            best = min(tried, key=tried.get)
            row["best"], row["best_us"] = str(best), tried[best]
            row["saved_us"] = row["unfused_us"] - row["fused_us"]
            rows.append(row)
            del ws
    return rows


def attention_rows(bandwidth):
    rows, block_size, heads, kv_heads, head_dim = [], 16, 16, 8, 128
    original = attention._num_splits
    for batch in (1, 8):
        for context in (1024, 4096):
            width = context // block_size
            blocks = batch * width
            k_cache = torch.randn(blocks * 32, block_size, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
            v_cache = torch.randn_like(k_cache)
            tables = torch.randperm(blocks * 32, device="cuda", dtype=torch.int32).view(32, batch, width)
            seq_lens = torch.full((batch,), context, device="cuda", dtype=torch.int32)
            starts = torch.arange(batch + 1, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, heads, head_dim, device="cuda", dtype=torch.bfloat16)
            kv_bytes = 2 * batch * context * kv_heads * head_dim * 2
            row = {"batch": batch, "context": context, "roofline_us": kv_bytes / bandwidth * 1e6}

            def timed():  # one decode attention per block table, under whatever config is patched in
                return graph_us([lambda t=t: attention.paged_attention_triton(
                    q, k_cache, v_cache, t, seq_lens, starts, 1, head_dim ** -0.5) for t in tables])

            for splits in (1, 2, 4, 8, 16, 32):
                attention._num_splits = lambda *a, s=splits: s
                row[f"splits{splits}_us"] = timed()
            attention._num_splits = original
            row["default_splits"] = original(batch * kv_heads, 1, context, q.device)
            if batch == 1:  # the latency-bound case: which tile shape, warps and stages are quickest
                config = attention._config
                tried = {}
                for splits in (16, 32):
                    for block_n in (32, 64):
                        for warps in (2, 4):
                            for stages in (1, 3):
                                attention._num_splits = lambda *a, s=splits: s
                                attention._config = lambda *a, c=(16, block_n, warps, stages): c
                                tried[(splits, block_n, warps, stages)] = timed()
                attention._num_splits, attention._config = original, config
                best = min(tried, key=tried.get)
                row["best (splits, block_n, warps, stages)"] = str(best)
                row["best_us"] = tried[best]
            rows.append(row)
    return rows


def main():
    bandwidth = copy_bandwidth()
    if "--fused" in sys.argv:
        fused = fused_rows(bandwidth)
        save("decode_fused_gemv", fused, {"copy_bandwidth_bytes_per_s": bandwidth})
        print_table(fused, f"norm (+ SiLU-and-mul) with the projection at batch 1 in a graph, us "
                           f"(copy {bandwidth / 1e12:.2f} TB/s)")
        return
    x_rows = int(sys.argv[sys.argv.index("--rows") + 1]) if "--rows" in sys.argv else 1
    small = gemv_rows(bandwidth, x_rows)
    save("decode_gemv" + (f"_rows-{x_rows}" if x_rows > 1 else ""), small, {"copy_bandwidth_bytes_per_s": bandwidth})
    print_table(small, f"projections at {x_rows} row(s) of x in a graph, us (copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
    if "--gemv-only" in sys.argv:
        return
    gemms, attn = gemm_rows(bandwidth), attention_rows(bandwidth)
    save("decode_gemm_paths", gemms + attn, {"copy_bandwidth_bytes_per_s": bandwidth})
    for r in attn:
        r.setdefault("best (splits, block_n, warps, stages)", "")
        r.setdefault("best_us", float("nan"))
    print_table(attn, "decode attention (bf16, GQA 2, head dim 128, block 16) by key splits, us in a graph")
    print_table([{k: v for k, v in r.items() if k not in ("N", "K")} for r in gemms],
                f"decode GEMMs in a graph, us (copy bandwidth {bandwidth / 1e12:.2f} TB/s)")
    plot_bars("decode_gemm_paths", [f"{r['model']} {r['proj']} {r['weights']}" for r in small],
              {"cuBLAS(Lt), batch 1": [r["cublas_of_roofline"] for r in small],
               "batch-1 kernel": [r["rule_of_roofline"] for r in small]}, "fraction of HBM roofline")


if __name__ == "__main__":
    main()
