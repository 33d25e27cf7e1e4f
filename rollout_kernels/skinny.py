"""Projections of a few rows (more than the GEMV's, up to SKINNY_ROWS) on tensor cores: y = x W^T (+ b) for
bf16, fp16 or float8_e4m3 weights (one scale) and a bf16 or fp16 x, and the gated [gate; up] form with
SiLU-and-mul in its epilogue.

From three rows on, the GEMV's products on the CUDA cores cost more than tensor-core tiles, but cuBLAS at 3-16
rows is latency-bound as well (the 1.7B projections at 4-16 rows take 1.5-3x their bytes' time on the H200). This
kernel puts the weight on the MMA's M side: each program multiplies BLOCK_N whole weight rows by every row of x,
padded to the MMA's 16 columns, so each weight tile is read once and the x tile is small. A weight of many
columns splits K across programs (SPLIT_K), whose float32 partials a second launch sums. Every launch takes
programmatic dependent launch (rollout_kernels/pdl.py): the first weight tile loads before the wait. As on the
GEMV's rows, fp8 is weight-only here: each e4m3 tile is converted to x's dtype (exactly: every e4m3 value is a
bf16 and an fp16 value) and the scale applied to the float32 sums, which spares the launches that quantize the
activation (fp8.py) and keeps every projection of such a step a Triton kernel.

Arithmetic: bf16 and fp16 products are exact in float32 and the MMA sums them in float32, so the result is the
twin's (gemv.gemv_ref) up to the order of the float32 sums, rounded once. Row r's result does not depend on the
other rows (x is always padded to 16 columns, each output column its own sums), so a row has the same bits in
any batch this kernel takes.
"""
import torch
import triton
import triton.language as tl

from . import pdl
from .fp8 import _e4m3_value
from .launch import interpreted

# The most rows this kernel takes (x padded to this many MMA columns); from more rows on, cuBLAS.
SKINNY_ROWS = 16
FLOATS = (torch.bfloat16, torch.float16)
WEIGHTS = FLOATS + (torch.float8_e4m3fn,)


@triton.jit
def _weight_tile(w_ptrs, cols, in_rows, end, DTYPE: tl.constexpr, W_FP8: tl.constexpr, BY_HAND: tl.constexpr):
    """A weight tile in x's dtype, columns from `end` on (and rows past N) 0; e4m3 bits converted (by hand in
    the interpreter, which has no fp8 type)."""
    bits = tl.load(w_ptrs + cols[None, :], mask=in_rows & (cols[None, :] < end), other=0)
    if not W_FP8:
        wv = bits
    elif BY_HAND:
        wv = _e4m3_value(bits).to(DTYPE)
    else:
        wv = bits.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    return wv


@triton.jit
def _rows_times_x(acc, w_tile, x, cols, M, K, end, BLOCK_M: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] + w_tile [BLOCK_N, BLOCK_K] . x[:, cols]^T for x [M, K], its rows past M (and
    columns from `end` on) read as 0."""
    m = tl.arange(0, BLOCK_M)
    xv = tl.load(x + m[None, :] * K + cols[:, None], mask=(m[None, :] < M) & (cols[:, None] < end), other=0.0)
    return tl.dot(w_tile, xv, acc)


@triton.jit
def _skinny_kernel(x, w, w_scale, bias, y, partials, M, N, K, stride_w, k_per_split, W_FP8: tl.constexpr,
                   BY_HAND: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr, SPLIT_K: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, PDL: tl.constexpr):
    """Rows [pid0 * BLOCK_N, + BLOCK_N) of y^T for K columns [pid1 * k_per_split, + k_per_split): stored to y
    (SPLIT_K == 1; GATED: silu(gate) * up, each rounded to y's dtype first, as silu_and_mul computes it) or as
    float32 partials [SPLIT_K, M, N]."""
    DTYPE: tl.constexpr = y.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_rows = rows[:, None] < N
    w_ptrs = w + rows.to(tl.int64)[:, None] * stride_w
    up_ptrs = w + (rows + N).to(tl.int64)[:, None] * stride_w
    start = tl.program_id(1) * k_per_split
    end = tl.minimum(start + k_per_split, K)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    # The weights are not the previous kernel's output: the first tile is on its way before the wait.
    cols = start + tl.arange(0, BLOCK_K)
    wv = _weight_tile(w_ptrs, cols, in_rows, end, DTYPE, W_FP8, BY_HAND)
    if GATED:
        uv = _weight_tile(up_ptrs, cols, in_rows, end, DTYPE, W_FP8, BY_HAND)
    pdl.wait_previous(PDL)
    acc = _rows_times_x(acc, wv, x, cols, M, K, end, BLOCK_M)
    if GATED:
        acc_up = _rows_times_x(acc_up, uv, x, cols, M, K, end, BLOCK_M)
    for k in range(start + BLOCK_K, end, BLOCK_K):
        cols = k + tl.arange(0, BLOCK_K)
        wv = _weight_tile(w_ptrs, cols, in_rows, end, DTYPE, W_FP8, BY_HAND)
        acc = _rows_times_x(acc, wv, x, cols, M, K, end, BLOCK_M)
        if GATED:
            uv = _weight_tile(up_ptrs, cols, in_rows, end, DTYPE, W_FP8, BY_HAND)
            acc_up = _rows_times_x(acc_up, uv, x, cols, M, K, end, BLOCK_M)
    m = tl.arange(0, BLOCK_M)
    out_mask = in_rows & (m[None, :] < M)
    if SPLIT_K > 1:
        tl.store(partials + (tl.program_id(1) * M + m[None, :]) * N + rows[:, None], acc, mask=out_mask)
        return
    if W_FP8:
        acc *= tl.load(w_scale)
        acc_up *= tl.load(w_scale)
    if HAS_BIAS:
        acc += tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
    if GATED:
        if HAS_BIAS:
            acc_up += tl.load(bias + N + rows, mask=rows < N, other=0.0).to(tl.float32)[:, None]
        gate = acc.to(DTYPE).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * acc_up.to(DTYPE).to(tl.float32)
    tl.store(y + m[None, :] * N + rows[:, None], acc.to(DTYPE), mask=out_mask)


@triton.jit
def _sum_splits_kernel(partials, w_scale, bias, y, M, N, W_FP8: tl.constexpr, HAS_BIAS: tl.constexpr,
                       SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """y [M, N] = the sum of the SPLIT_K float32 partials (times the weight's scale, W_FP8; + bias), rounded once."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    pdl.wait_previous(PDL)
    acc = tl.load(partials + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(partials + s * M * N + offs, mask=mask, other=0.0)
    if W_FP8:
        acc *= tl.load(w_scale)
    if HAS_BIAS:
        acc += tl.load(bias + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + offs, acc.to(y.dtype.element_ty), mask=mask)


def skinny_config(k: int, gated: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, SPLIT_K) for a weight of `k` columns: a fixed rule (a result never depends on a timing),
    the best tiles of H200 sweeps at 4, 8 and 16 rows over the 1.7B and 8B projections (docs/benchmarks.md): 64
    rows a program, 256 columns a step (a gated weight, which loads two tiles, 128); from 6,144 columns on
    (down_proj) 128 columns a step over four K splits, which keep more programs reading a short output."""
    if gated:
        return 64, 128, 1
    return (64, 128, 4) if k >= 6144 else (64, 256, 1)


def takes_weight(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether this kernel takes `x` (of rows takes_rows admits) times `weight`: a weight of x's dtype or
    float8_e4m3fn, contiguous along K."""
    return weight.dtype in WEIGHTS and weight.dtype in (x.dtype, torch.float8_e4m3fn) and weight.stride(-1) == 1


def takes_rows(x, most_rows: int) -> bool:
    """Whether `x` (a bf16 or fp16 tensor) has the rows this kernel takes: more than `most_rows`, at most
    SKINNY_ROWS. An fp8 engine's norm and SiLU-and-mul leave such an activation unquantized."""
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOATS or x.shape[-1] == 0:
        return False
    return most_rows < x.numel() // x.shape[-1] <= SKINNY_ROWS


def skinny_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  w_scale: torch.Tensor | None = None, gated: bool = False,
                  config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] W^T (+ bias) for x of 1 to SKINNY_ROWS rows; `w_scale` [1] when `weight` is
    float8_e4m3fn. gated: `weight` (and `bias`) stack a gate and an up projection and y [..., N / 2] is
    silu_and_mul of the product. `config` overrides skinny_config (benchmarks sweep it)."""
    k = weight.shape[1]
    rows = x.numel() // max(x.shape[-1], 1)
    if not 1 <= rows <= SKINNY_ROWS or x.shape[-1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}; skinny takes 1 to {SKINNY_ROWS} rows of {k} columns")
    fp8_weight = weight.dtype == torch.float8_e4m3fn
    if x.dtype not in FLOATS or weight.dtype not in (x.dtype, torch.float8_e4m3fn):
        raise ValueError(f"skinny takes a bf16 or fp16 x and a weight of its dtype or float8_e4m3fn, got x "
                         f"{x.dtype} and weight {weight.dtype}")
    if fp8_weight != (w_scale is not None):
        raise ValueError("w_scale goes with a float8_e4m3fn weight, and only with one")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gated=True needs an even number of weight rows (gate, then up), got {weight.shape[0]}")
    n = weight.shape[0] // (2 if gated else 1)
    block_n, block_k, split = config or skinny_config(k, gated)
    if gated and split > 1:
        raise ValueError("a gated projection takes one K split")
    x2 = x.reshape(rows, k).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    partials = torch.empty(split, rows, n, dtype=torch.float32, device=x.device) if split > 1 else y
    k_per_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    launch = pdl.options(x.device, rows)
    scale = w_scale if fp8_weight else y
    _skinny_kernel[(triton.cdiv(n, block_n), split)](
        x2, weight.view(torch.uint8) if fp8_weight else weight, scale, bias if bias is not None else y, y, partials,
        rows, n, k, weight.stride(0), k_per_split, W_FP8=fp8_weight, BY_HAND=interpreted(), HAS_BIAS=bias is not None,
        GATED=gated, SPLIT_K=split, BLOCK_N=block_n, BLOCK_K=block_k,
        BLOCK_M=max(16, triton.next_power_of_2(SKINNY_ROWS)), num_warps=4, num_stages=4, **launch)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(rows * n, block),)](
            partials, scale, bias if bias is not None else y, y, rows, n, W_FP8=fp8_weight, HAS_BIAS=bias is not None,
            SPLIT_K=split,
            BLOCK=block, **launch)
    return y.view(x.shape[:-1] + (n,))
