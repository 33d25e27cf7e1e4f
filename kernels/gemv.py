"""Small-batch projections: y = x W^T (+ b) for at most SMALL_BATCH_ROWS rows of x, read at HBM speed.

At decode batch sizes a projection reads every weight once for a handful of rows, so its time is the
weight's bytes plus the kernel's latency; cuBLAS(Lt) picks tiles made for large M and reaches 32-74% of
the bytes' time on the 1.7B shape at batch 1 (docs/benchmarks.md), and tensorwise-scaled fp8
`torch._scaled_mm` gains little over bf16 there. This kernel gives each program BLOCK_N whole weight rows
(contiguous along K, so every load is coalesced) and all the rows of x: one row of x accumulates
elementwise products and sums once at the end; 2-16 rows go through tl.dot with x padded to 16 rows.

The weight is float (bf16, fp16, fp32) or float8_e4m3fn with one scale (`w_scale` [1]); x is float or an
fp8.Fp8Tensor (e4m3 values and their scale [1], as the fused RMSNorm and SiLU-and-mul make it). Products
of e4m3 or bf16 values are exact in float32, so the result is the float32 sum of x_i * w_i (times
x_scale * w_scale), plus the bias, rounded once to the output dtype: the reference twin's arithmetic up to
the order of the float32 sums.

fp8 values are read as uint8 bits (so masked lanes read 0) and reinterpreted as e4m3 on CUDA, or converted
by hand on the CPU, as the Triton interpreter has no fp8 type.
"""
import os

import torch
import triton
import triton.language as tl

import torch.nn.functional as F

from .fp8 import Fp8Tensor, _e4m3_value, fp8_linear_triton as scaled_mm_linear

MAX_ROWS = 16  # the most rows the kernel takes: one tl.dot tile
# The largest batch the engine's projections send here (kernels.get_ops' linear and fp8_linear on CUDA);
# 0 sends every batch to cuBLAS(Lt), for comparisons. Read when a call is made, so set it before an
# engine captures its CUDA graphs.
SMALL_BATCH_ROWS = MAX_ROWS
FLOATS = (torch.float32, torch.bfloat16, torch.float16)
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _values(v, BITS: tl.constexpr, BY_HAND: tl.constexpr, DTYPE: tl.constexpr):
    """`v` in DTYPE: e4m3 bit patterns (BITS, loaded as uint8 so masked lanes read 0) reinterpreted as fp8
    on the GPU or converted by hand in the interpreter (BY_HAND), else a plain cast of float values."""
    if BITS:
        if BY_HAND:
            return _e4m3_value(v).to(DTYPE)
        return v.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    return v.to(DTYPE)


@triton.jit
def _gemv_kernel(x, w, bias, y, x_scale, w_scale, M, N, K, stride_x, stride_w, stride_y,
                 X_FP8: tl.constexpr, W_FP8: tl.constexpr, BY_HAND: tl.constexpr,
                 HAS_BIAS: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows_w = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_x = tl.arange(0, BLOCK_M)
    w_ptrs = w + rows_w.to(tl.int64)[:, None] * stride_w
    x_ptrs = x + rows_x.to(tl.int64)[:, None] * stride_x
    w_mask, x_mask = rows_w[:, None] < N, rows_x[:, None] < M
    if BLOCK_M == 1:
        wide = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for start in range(0, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        k_mask = cols[None, :] < K
        wv = tl.load(w_ptrs + cols[None, :], mask=w_mask & k_mask, other=0)
        xv = tl.load(x_ptrs + cols[None, :], mask=x_mask & k_mask, other=0)
        if BLOCK_M == 1:
            wide += _values(wv, W_FP8, BY_HAND, tl.float32) * _values(xv, X_FP8, BY_HAND, tl.float32)
        else:
            acc = tl.dot(_values(xv, X_FP8, BY_HAND, DOT_DTYPE), tl.trans(_values(wv, W_FP8, BY_HAND, DOT_DTYPE)), acc,
                         input_precision="ieee")
    if BLOCK_M == 1:
        acc = tl.sum(wide, 1)[None, :]
    if X_FP8:
        acc = acc * (tl.load(x_scale) * tl.load(w_scale))  # the twin's order: the scales' product first
    elif W_FP8:
        acc = acc * tl.load(w_scale)
    if HAS_BIAS:
        acc += tl.load(bias + rows_w, mask=rows_w < N, other=0.0).to(tl.float32)[None, :]
    y_ptrs = y + rows_x.to(tl.int64)[:, None] * stride_y + rows_w[None, :]
    tl.store(y_ptrs, acc.to(y.dtype.element_ty), mask=x_mask & (rows_w[None, :] < N))


def gemv_config(rows: int, n: int, k: int, fp8_weight: bool) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a launch; a fixed rule of the shape, so a shape's result never
    depends on a timing."""
    if rows == 1:
        return 8, (1024 if fp8_weight else 512), 4
    return 32, 128, 4


def _operand(x) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """(2-D tensor the kernel reads, its scale or None, the output dtype) of a float tensor or Fp8Tensor."""
    if isinstance(x, Fp8Tensor):
        data = x.data.reshape(-1, x.data.shape[-1])
        return data.view(torch.uint8), x.scale, x.dtype
    return x.reshape(-1, x.shape[-1]), None, x.dtype


def small_linear_triton(x, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        w_scale: torch.Tensor | None = None, config: tuple[int, int, int] | None = None):
    """y [..., N] = x [..., K] W^T (+ bias) for x of at most MAX_ROWS rows (see the module);
    `w_scale` [1] when `weight` is float8_e4m3fn. `config` overrides gemv_config (benchmarks sweep it)."""
    interpreted = _interpreted()
    data, x_scale, dtype = _operand(x)
    if data.stride(-1) != 1:
        data = data.contiguous()
    fp8_weight = weight.dtype == torch.float8_e4m3fn
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    rows, (n, k) = data.shape[0], weight.shape
    if rows > MAX_ROWS:
        raise ValueError(f"x has {rows} rows; small_linear takes at most {MAX_ROWS}")
    if fp8_weight != (w_scale is not None) or (x_scale is not None and not fp8_weight):
        raise ValueError("w_scale goes with a float8_e4m3fn weight, and an Fp8Tensor x needs one")
    w_arg = weight.view(torch.uint8) if fp8_weight else weight
    block_n, block_k, warps = config or gemv_config(rows, n, k, fp8_weight)
    y = torch.empty(rows, n, dtype=dtype, device=data.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        data, w_arg, bias if bias is not None else y, y, x_scale if x_scale is not None else y,
        w_scale if w_scale is not None else y, rows, n, k, data.stride(0), weight.stride(0), y.stride(0),
        X_FP8=x_scale is not None, W_FP8=fp8_weight, BY_HAND=interpreted,
        HAS_BIAS=bias is not None, DOT_DTYPE=_TL[dtype], BLOCK_M=1 if rows == 1 else 16,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    out_shape = (x.data if isinstance(x, Fp8Tensor) else x).shape[:-1] + (n,)
    return y.view(out_shape)


def small_linear_ref(x, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     w_scale: torch.Tensor | None = None, config=None):
    """Twin of small_linear_triton: the float32 product of the values, times the scales, plus the bias,
    rounded once. (`config` is accepted and unused, so both take the same arguments.)"""
    if isinstance(x, Fp8Tensor):
        xv, scale, dtype = x.data.float(), x.scale * w_scale, x.dtype
    else:
        xv, dtype = x.float(), x.dtype
        scale = w_scale
    y = xv @ weight.float().t()
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def takes_small(x, weight: torch.Tensor) -> bool:
    """Whether small_linear serves this call: few rows, and a weight it reads (float or e4m3) in rows."""
    data = x.data if isinstance(x, Fp8Tensor) else x
    rows = data.numel() // data.shape[-1] if data.shape[-1] else 0
    return (0 < rows <= min(SMALL_BATCH_ROWS, MAX_ROWS) and weight.dim() == 2 and weight.stride(-1) == 1
            and (weight.dtype in FLOATS or weight.dtype == torch.float8_e4m3fn))


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The engine's `linear` on CUDA: small batches here, the rest on cuBLAS(Lt)."""
    return small_linear_triton(x, weight, bias) if takes_small(x, weight) else F.linear(x, weight, bias)


def fp8_linear_triton(x, weight: torch.Tensor, scale_w: torch.Tensor, bias: torch.Tensor | None = None):
    """The engine's `fp8_linear` on CUDA (kernels/fp8.py's contract): small batches here, the rest on
    torch._scaled_mm."""
    if takes_small(x, weight):
        return small_linear_triton(x, weight, bias, scale_w)
    return scaled_mm_linear(x, weight, scale_w, bias)
