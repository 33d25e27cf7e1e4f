"""Paged attention speed on the GPU: decode against the device-copy roofline, split-K, verify, prefill.

Qwen3-1.7B-like heads (16 query heads, 8 kv heads, head dim 128), bf16, block size 16, block
tables shuffled over the pool. Decode is bound by reading K and V, so its figure is GB/s of
K/V bytes read over the bandwidth of a device-to-device copy (bytes read + written) measured
in the same run. Medians of triton.testing.do_bench, which flushes L2 between runs.

    python benchmarks/attention_bench.py [--sweep]   # --sweep also tries split counts, prefill tiles

Writes JSON to $OUT/attention_bench.json (attention_bench_sweep.json with --sweep) when OUT is set, else
benchmarks/results/. An fp8 cache's bytes include its float32 scale per (token, kv head)."""
import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_kernels import attention  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 16, 8, 128, 16


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e-3  # seconds


def copy_bandwidth():
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / bench(lambda: dst.copy_(src))


def make_case(batch, context, q_len, fp8=False):
    """Every sequence has `context` tokens in the cache, the last q_len of them are queries."""
    blocks_per_seq = triton.cdiv(context, BLOCK)
    num_blocks = batch * blocks_per_seq
    k_cache, v_cache = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda",
                                   dtype=torch.bfloat16).unbind(0)
    scales = {}
    if fp8:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        scales = dict(k_scale=torch.ones(num_blocks, BLOCK, KV_HEADS, device="cuda"),
                      v_scale=torch.ones(num_blocks, BLOCK, KV_HEADS, device="cuda"))
    tables = torch.randperm(num_blocks, device="cuda").view(batch, blocks_per_seq).to(torch.int32)
    args = dict(q=torch.randn(batch * q_len, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
                k_cache=k_cache, v_cache=v_cache, block_tables=tables,
                seq_lens=torch.full((batch,), context, device="cuda", dtype=torch.int32),
                query_start_loc=torch.arange(0, batch * q_len + 1, q_len, device="cuda", dtype=torch.int32),
                max_query_len=q_len, scale=HEAD_DIM ** -0.5, **scales)
    kv_bytes = 2 * batch * context * KV_HEADS * (HEAD_DIM * k_cache.element_size() + 4 * fp8)  # + fp8's fp32 scales
    causal_pairs = batch * q_len * (context - (q_len - 1) / 2)
    flops = 4 * causal_pairs * HEADS * HEAD_DIM
    return args, kv_bytes, flops


def run_case(name, batch, context, q_len, copy_bw, fp8=False):
    args, kv_bytes, flops = make_case(batch, context, q_len, fp8)
    seconds = bench(lambda: attention.paged_attention_triton(**args))
    row = dict(case=name, batch=batch, context=context, q_len=q_len, us=seconds * 1e6,
               kv_GBps=kv_bytes / seconds / 1e9, of_copy=kv_bytes / seconds / copy_bw,
               TFLOPs=flops / seconds / 1e12)
    del args
    torch.cuda.empty_cache()
    return row


def patched(name, value, case, *shape, copy_bw, note, fp8=False):
    """run_case with attention.<name> replaced; a config that fails to build is reported, not fatal."""
    old = getattr(attention, name)
    setattr(attention, name, value)
    try:
        return dict(run_case(case, *shape, copy_bw, fp8=fp8), note=note)
    except Exception as e:  # e.g. out of shared memory
        return dict(case=case, note=f"{note}: {type(e).__name__}")
    finally:
        setattr(attention, name, old)


def sweep(copy_bw):
    """Split counts for one long sequence, and prefill tile configs."""
    rows = [patched("_num_splits", lambda *_, n=n: n, "split-K sweep", 1, 32768, 1, copy_bw=copy_bw,
                    note=f"splits={n}") for n in (8, 16, 32, 64, 128)]
    for c in [(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (128, 32, 4, 3), (64, 64, 4, 3),
              (64, 128, 4, 2), (128, 64, 4, 2)]:
        rows.append(patched("_config", lambda *_, c=c: c, "prefill sweep", 4, 2048, 2048, copy_bw=copy_bw,
                            note="BLOCK_M={} BLOCK_N={} warps={} stages={}".format(*c)))
    # an fp8 cache: key tiles of 64 keys (half the bytes of bf16's) and of 128 (as many bytes)
    for c in [(16, 64, 4, 3), (16, 128, 4, 3), (16, 128, 4, 4), (16, 128, 8, 3), (16, 256, 4, 2)]:
        for shape in [(64, 4096, 1), (8, 8192, 1)]:
            rows.append(patched("_config", lambda *_, c=c: c, "decode fp8 sweep", *shape, copy_bw=copy_bw,
                                note="BLOCK_M={} BLOCK_N={} warps={} stages={}".format(*c), fp8=True))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    opts = parser.parse_args()
    copy_bw = copy_bandwidth()
    rows = [run_case("decode", 64, 4096, 1, copy_bw),
            run_case("decode fp8 KV", 64, 4096, 1, copy_bw, fp8=True),
            run_case("verify k=4", 64, 4096, 5, copy_bw),
            run_case("decode", 8, 8192, 1, copy_bw),
            run_case("decode fp8 KV", 8, 8192, 1, copy_bw, fp8=True),
            run_case("decode split-K", 1, 32768, 1, copy_bw),
            run_case("split-K fp8 KV", 1, 32768, 1, copy_bw, fp8=True),
            patched("_num_splits", lambda *_: 1, "decode", 1, 32768, 1, copy_bw=copy_bw, note="no split"),
            run_case("prefill", 4, 2048, 2048, copy_bw)]
    swept = sweep(copy_bw) if opts.sweep else []
    print(f"{torch.cuda.get_device_name()}  copy {copy_bw / 1e9:.0f} GB/s (read + write)")
    print(f"{'case':18} {'batch':>5} {'ctx':>6} {'q':>5} {'us':>9} {'KV GB/s':>8} {'of copy':>8} {'TFLOP/s':>8}")
    for r in rows + swept:
        if "us" not in r:
            print(f"{r['case']:18} {r['note']}")
            continue
        print(f"{r['case']:18} {r['batch']:5} {r['context']:6} {r['q_len']:5} {r['us']:9.1f} {r['kv_GBps']:8.0f} "
              f"{r['of_copy']:8.1%} {r['TFLOPs']:8.1f}  {r.get('note', '')}")
    result = dict(date=datetime.date.today().isoformat(), gpu=torch.cuda.get_device_name(),
                  torch=torch.__version__, triton=triton.__version__, copy_GBps=copy_bw / 1e9, rows=rows, sweep=swept)
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ("attention_bench_sweep.json" if opts.sweep else "attention_bench.json")).write_text(
        json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
