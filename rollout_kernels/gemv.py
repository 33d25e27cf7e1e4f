"""Batch-1 projections: y = x W^T (+ b) for one row of x, with bf16/fp16/fp32 or fp8 weights, and the
engine's dispatch to it.

At batch 1 a projection reads every weight once for one row, so its time is the weight's bytes plus the
kernel's latency. This kernel gives each program BLOCK_N whole weight rows (contiguous along K, so every
load is coalesced), folds each tile's float32 products into sums of the columns one thread loads in one
vector (16 e4m3 or 8 bf16 values) and sums across the row once at the end: a whole tile of float32
accumulators would take twice the registers, and so fewer programs an SM and fewer loads in flight, which
e4m3 weights (half the bytes a column) need most. On the H200
(`decode_gemm_paths.py`) it matches or beats cuBLAS(Lt) at one row for bf16 weights, and reads e4m3
weights faster than tensorwise `torch._scaled_mm`, without an fp8 activation: at batch 1 an fp8 engine
keeps its activations in bf16 (weight-only fp8), which spares the single-program kernels that quantize
them (`rms_norm_fp8`, `silu_and_mul_fp8`) and is closer to the bf16 model. Two rows of x (a speculative
draft pass, a batch of two, a k = 1 verify) share each weight tile's read (ROWS = 2), which beats cuBLAS(Lt)
there too (a decode step at batch 2: 3-30% faster on the 1.7B and 8B shapes, bf16 and fp8). Larger batches
keep the cuBLAS path and fp8 activations, whose tensor-core tiles win from three rows on: the kernel at ROWS = 3
(a k = 2 verify, a batch of three) is correct, but on the H200 a batch-3 decode step is slower with it on three of
the four shapes, and the fp8 projections most (each e4m3 weight is converted, and multiplied once per row, on the
CUDA cores, where cuBLASLt multiplies fp8 on tensor cores), so three rows take cuBLAS(Lt) by default.

The weight is float or float8_e4m3fn with one scale (`w_scale` [1]); x is float or an fp8.Fp8Tensor. The
products (bf16, fp16, fp32 or e4m3 values) are exact in float32, so the result is the float32 sum of
x_i * w_i, times the scales, plus the bias, rounded once: the twin's arithmetic up to the order of the
float32 sums. fp8 values are read as uint8 bits (so masked lanes read 0) and reinterpreted as e4m3 on
CUDA, or converted by hand on the CPU, where the Triton interpreter has no fp8 type.
"""

import dataclasses

import torch
import triton
import triton.language as tl

from . import pdl, skinny
from .launch import interpreted
from .activation import silu_and_mul_ref
from .norm import rms_norm_ref
from .fp8 import Fp8Tensor, _e4m3_value

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
# Whether the engine takes the batch-1 path (with_batch1_path); False puts every projection on cuBLAS(Lt)
# with fp8 activations at every batch, for comparisons. Read at each call, so set it before an engine
# captures its CUDA graphs.
BATCH1_PATH = True
# The most rows of x (1 to 3) that take the GEMV on that path; from more rows on, cuBLAS(Lt) and fp8
# activations. 1 sends two rows to cuBLAS(Lt) and 3 sends three to the GEMV, for comparisons (three rows on the
# GEMV measured slower: docs/benchmarks.md, "Three rows stay on cuBLAS(Lt)"). Read at each call, like BATCH1_PATH.
GEMV_ROWS = 2
# Whether an fp8 engine's steps of more than GEMV_ROWS rows, up to skinny.SKINNY_ROWS, run weight-only on the
# few-row kernel (its norm and SiLU-and-mul leaving the activation unquantized). Off: converting each e4m3 tile
# costs what its bytes save, so even at its best tile it measured 1.3-2.2x slower than torch._scaled_mm on every
# 1.7B and 8B projection (docs/benchmarks.md, "e4m3 weights on the few-row kernel"); read at each call.
FP8_FEW_ROWS = False
# Whether one row of a [gate; up] projection and its SiLU-and-mul run as one gated kernel on that path
# (with_fused_ops); False launches them apart, for comparisons. Read at each call, like BATCH1_PATH.
FUSED_GATE = True
# Whether, on that path, an RMSNorm that feeds a projection is computed in the projection's kernel
# (rms_norm_for_linear, NormedRow). Read at each call, like BATCH1_PATH.
FUSED_NORM = True


@dataclasses.dataclass
class NormedRow:
    """One row's RMSNorm(x + residual) * weight, not computed yet: the projection that takes it normalises
    the row in its kernel's prologue (rollout_kernels/gemv.py), sparing the norm's launch, and its program 0 writes
    x + residual into `residual_out`, the tensor the norm call already returned as the new residual."""
    x: torch.Tensor
    residual: torch.Tensor | None
    weight: torch.Tensor
    eps: float
    residual_out: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.x.dtype

    def materialize(self, rms_norm) -> torch.Tensor:
        """The normalised row by `rms_norm` (an ops.rms_norm), for a consumer without the prologue; the new
        residual lands in residual_out as the fused kernel would have left it."""
        if self.residual is None:
            return rms_norm(self.x, self.weight, self.eps)
        out, total = rms_norm(self.x, self.weight, self.eps, self.residual)
        self.residual_out.copy_(total)
        return out


@triton.jit
def _values(v, BITS: tl.constexpr, BY_HAND: tl.constexpr):
    """float32 of `v`: e4m3 bit patterns (BITS) reinterpreted as fp8 on the GPU or converted by hand in the
    interpreter (BY_HAND), else float values."""
    if BITS:
        if BY_HAND:
            return _e4m3_value(v)
        return v.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    return v.to(tl.float32)


@triton.jit
def _fold(p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr):
    """[BLOCK_N, BLOCK_K] products -> [BLOCK_N, BLOCK_K / G] sums of G neighbouring columns. G is the columns
    one thread loads in one vector, so the sums stay inside the thread (no shuffles)."""
    return tl.sum(tl.reshape(p, (BLOCK_N, BLOCK_K // G, G)), 2)


@triton.jit
def _scaled(sums, x_scale, w_scale, bias, rows, N, X_FP8: tl.constexpr, W_FP8: tl.constexpr,
            HAS_BIAS: tl.constexpr):
    """Row sums times the scales, plus the bias, in float32."""
    if X_FP8:
        sums = sums * (tl.load(x_scale) * tl.load(w_scale))  # the twin's order: the scales' product first
    elif W_FP8:
        sums = sums * tl.load(w_scale)
    if HAS_BIAS:
        sums += tl.load(bias + rows, mask=rows < N, other=0.0).to(tl.float32)
    return sums


@triton.jit
def _x_tile(x, res, norm_w, cols, K, rstd, X_FP8: tl.constexpr, BY_HAND: tl.constexpr, NORM: tl.constexpr,
            HAS_RES: tl.constexpr, DTYPE: tl.constexpr):
    """float32 of x's columns `cols`; NORM: of RMSNorm(x + res) * norm_w there, rounded as rms_norm rounds."""
    v = tl.load(x + cols, mask=cols < K, other=0)
    if NORM:
        if HAS_RES:
            v = (v.to(tl.float32) + tl.load(res + cols, mask=cols < K, other=0).to(tl.float32)).to(DTYPE)
        normed = (v.to(tl.float32) * rstd).to(DTYPE).to(tl.float32)
        return (tl.load(norm_w + cols, mask=cols < K, other=0).to(tl.float32) * normed).to(DTYPE).to(tl.float32)
    return _values(v, X_FP8, BY_HAND)


@triton.jit
def _row_rstd(x, res, res_out, K, eps, HAS_RES: tl.constexpr, DTYPE: tl.constexpr, KP: tl.constexpr):
    """1 / RMS of x (+ res) over its K columns, read whole (KP >= K); program 0 stores x + res in res_out."""
    cols = tl.arange(0, KP)
    h = tl.load(x + cols, mask=cols < K, other=0)
    if HAS_RES:
        h = (h.to(tl.float32) + tl.load(res + cols, mask=cols < K, other=0).to(tl.float32)).to(DTYPE)
        if tl.program_id(0) == 0:
            tl.store(res_out + cols, h, mask=cols < K)
    hf = h.to(tl.float32)
    return tl.rsqrt(tl.sum(hf * hf, 0) / K + eps)


@triton.jit
def _row_sums(wv, x, res, norm_w, cols, K, rstd, X_FP8: tl.constexpr, W_FP8: tl.constexpr, BY_HAND: tl.constexpr,
              NORM: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """One weight tile `wv` times x's row at `cols`, folded to sums of 16 (e4m3) or 8 columns. The tile's values
    are converted here, after x's (a tile converted first holds its float32 values in registers through a
    NORM prologue's math); for a second row the compiler reuses the conversion."""
    xv = _x_tile(x, res, norm_w, cols, K, rstd, X_FP8, BY_HAND, NORM, HAS_RES, DTYPE)[None, :]
    return _fold(_values(wv, W_FP8, BY_HAND) * xv, BLOCK_N, BLOCK_K, 16 if W_FP8 else 8)


@triton.jit
def _tile_sums(wv, uv, x, res, norm_w, cols, K, rstd, X_FP8: tl.constexpr, W_FP8: tl.constexpr,
               BY_HAND: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, DTYPE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GATED: tl.constexpr, ROWS: tl.constexpr):
    """One weight tile's folded sums for each of ROWS rows of x, and (GATED) its up tile `uv`'s: (rows 0, 1, 2,
    up rows 0, 1, 2). A row past ROWS, or an up row without GATED, repeats row 0's sums; nobody reads it."""
    s0 = _row_sums(wv, x, res, norm_w, cols, K, rstd, X_FP8, W_FP8, BY_HAND, NORM, HAS_RES, DTYPE, BLOCK_N, BLOCK_K)
    s1, s2, u0, u1, u2 = s0, s0, s0, s0, s0
    if ROWS >= 2:
        s1 = _row_sums(wv, x + K, res, norm_w, cols, K, rstd, X_FP8, W_FP8, BY_HAND, NORM, HAS_RES, DTYPE, BLOCK_N,
                       BLOCK_K)
    if ROWS == 3:
        s2 = _row_sums(wv, x + 2 * K, res, norm_w, cols, K, rstd, X_FP8, W_FP8, BY_HAND, NORM, HAS_RES, DTYPE,
                       BLOCK_N, BLOCK_K)
    if GATED:
        u0 = _row_sums(uv, x, res, norm_w, cols, K, rstd, X_FP8, W_FP8, BY_HAND, NORM, HAS_RES, DTYPE, BLOCK_N,
                       BLOCK_K)
        if ROWS >= 2:
            u1 = _row_sums(uv, x + K, res, norm_w, cols, K, rstd, X_FP8, W_FP8, BY_HAND, NORM, HAS_RES, DTYPE,
                           BLOCK_N, BLOCK_K)
        if ROWS == 3:
            u2 = _row_sums(uv, x + 2 * K, res, norm_w, cols, K, rstd, X_FP8, W_FP8, BY_HAND, NORM, HAS_RES, DTYPE,
                           BLOCK_N, BLOCK_K)
    return s0, s1, s2, u0, u1, u2


@triton.jit
def _finish(acc, acc_up, y, x_scale, w_scale, bias, rows, N, X_FP8: tl.constexpr, W_FP8: tl.constexpr,
            HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    """Stores one row of y from its folded sums (and the up projection's, GATED)."""
    out = _scaled(tl.sum(acc, 1), x_scale, w_scale, bias, rows, N, X_FP8, W_FP8, HAS_BIAS)
    if GATED:
        gate = out.to(y.dtype.element_ty).to(tl.float32)
        up = _scaled(tl.sum(acc_up, 1), x_scale, w_scale, bias + N, rows, N, X_FP8, W_FP8, HAS_BIAS)
        out = gate / (1.0 + tl.exp(-gate)) * up.to(y.dtype.element_ty).to(tl.float32)
    tl.store(y + rows, out.to(y.dtype.element_ty), mask=rows < N)


@triton.jit
def _gemv_kernel(x, w, bias, y, x_scale, w_scale, res, norm_w, res_out, eps, N, K, stride_w,
                 X_FP8: tl.constexpr, W_FP8: tl.constexpr, BY_HAND: tl.constexpr, HAS_BIAS: tl.constexpr,
                 GATED: tl.constexpr, NORM: tl.constexpr, HAS_RES: tl.constexpr, KP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """N output rows for ROWS (1 to 3) rows of x, [ROWS, K] contiguous: each weight tile is read once for
    all of them. GATED: the weight is [gate; up], 2N rows, and row r of y is silu(gate r) * up r, each rounded to
    y's dtype first, as silu_and_mul computes it from the projection's output. NORM (one row): x is
    RMSNorm(x + res) * norm_w (a NormedRow), which every program computes from the row (L2-resident)."""
    DTYPE: tl.constexpr = y.dtype.element_ty
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    w_ptrs = w + rows.to(tl.int64)[:, None] * stride_w
    # rows + N, not N.to(): N == 1 is specialised to a Python int, which has no .to
    up_ptrs = w + (rows + N).to(tl.int64)[:, None] * stride_w
    in_rows = rows[:, None] < N
    # The weights are not the previous kernel's output: the first tile's load is on its way while that
    # kernel finishes (with PDL this program starts before it ends), and while a NORM prologue reads the
    # row. Loading every tile ahead of its math instead held two tiles in registers and ran slower.
    cols = tl.arange(0, BLOCK_K)
    mask = in_rows & (cols[None, :] < K)
    wv = tl.load(w_ptrs + cols[None, :], mask=mask, other=0)
    if GATED:
        uv = tl.load(up_ptrs + cols[None, :], mask=mask, other=0)
    pdl.wait_previous(PDL)
    if NORM:
        rstd = _row_rstd(x, res, res_out, K, eps, HAS_RES, DTYPE, KP)
    else:
        rstd = 1.0
    acc, acc1, acc2, up, up1, up2 = _tile_sums(wv, uv if GATED else wv, x, res, norm_w, cols, K, rstd, X_FP8, W_FP8,
                                               BY_HAND, NORM, HAS_RES, DTYPE, BLOCK_N, BLOCK_K, GATED, ROWS)
    for start in range(BLOCK_K, K, BLOCK_K):
        cols = start + tl.arange(0, BLOCK_K)
        mask = in_rows & (cols[None, :] < K)
        wv = tl.load(w_ptrs + cols[None, :], mask=mask, other=0)
        if GATED:
            uv = tl.load(up_ptrs + cols[None, :], mask=mask, other=0)
        s0, s1, s2, u0, u1, u2 = _tile_sums(wv, uv if GATED else wv, x, res, norm_w, cols, K, rstd, X_FP8, W_FP8,
                                            BY_HAND, NORM, HAS_RES, DTYPE, BLOCK_N, BLOCK_K, GATED, ROWS)
        acc, acc1, acc2, up, up1, up2 = acc + s0, acc1 + s1, acc2 + s2, up + u0, up1 + u1, up2 + u2
    _finish(acc, up, y, x_scale, w_scale, bias, rows, N, X_FP8, W_FP8, HAS_BIAS, GATED)
    if ROWS >= 2:
        _finish(acc1, up1, y + N, x_scale, w_scale, bias, rows, N, X_FP8, W_FP8, HAS_BIAS, GATED)
    if ROWS == 3:
        _finish(acc2, up2, y + 2 * N, x_scale, w_scale, bias, rows, N, X_FP8, W_FP8, HAS_BIAS, GATED)


def gemv_config(fp8_weight: bool, k: int, gated: bool = False, norm: bool = False,
                rows: int = 1) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for a weight of `k` columns: a fixed rule, so a result never depends on
    a timing. Each projection of the 1.7B and 8B shapes takes the best tile of an H200 sweep
    (decode_gemm_paths.py; a decode step in generate checked the set): a normalising program (norm: qkv,
    gate_up) pays the row's read per program, so it takes many rows; a gated program (gate_up) reads
    BLOCK_N rows of the gate and as many of the up projection; plain weights (o, down_proj, the LM head)
    by width. A gated weight without the norm (FUSED_NORM off) keeps 2 x 1,024. Two rows of x take 4 x 1,024
    for every weight (at most 11% slower than the best tile of each projection alone, plain weights); three
    rows, not swept yet, the same."""
    if rows > 1:
        return 4, 1024, 4
    if gated and not norm:
        return 2, 1024, 4
    if fp8_weight:
        if norm:
            return (4, 2048 if k >= 4096 else 1024, 4) if gated else (8, 2048, 4)
        return (8, 2048, 8) if k >= 8192 else (2, 2048, 8) if k >= 6144 else (4, 2048, 4) if k >= 4096 else (8, 2048, 8)
    if norm:
        return (2 if k >= 4096 else 4, 1024, 4) if gated else (8, 1024, 4 if k >= 4096 else 8)
    return (8, 2048, 8) if k >= 8192 else (2, 2048, 8) if k >= 6144 else (8, 1024, 8) if k >= 4096 else (8, 1024, 4)


def gemv_triton(x, weight: torch.Tensor, bias: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
                config: tuple[int, int, int] | None = None, gated: bool = False):
    """y [..., N] = x [..., K] W^T (+ bias) for x of one to three rows (a float tensor or an Fp8Tensor) or a
    NormedRow (one row);
    `w_scale` [1] when `weight` is float8_e4m3fn. gated: `weight` (and `bias`) stack a gate and an up
    projection, and y [..., N / 2] is silu_and_mul of that product, in the same kernel. `config` overrides
    gemv_config (benchmarks sweep it)."""
    norm = x if isinstance(x, NormedRow) else None
    if norm is not None:
        data, x_scale, dtype = norm.x, None, norm.x.dtype
    else:
        data, x_scale, dtype = (x.data, x.scale, x.dtype) if isinstance(x, Fp8Tensor) else (x, None, x.dtype)
    rows = data.numel() // max(data.shape[-1], 1)
    if rows not in (1, 2, 3) or rows > 1 and norm is not None:
        raise ValueError(f"x has shape {tuple(data.shape)}; gemv takes one to three rows (a NormedRow: one)")
    fp8_weight = weight.dtype == torch.float8_e4m3fn
    if fp8_weight != (w_scale is not None) or (x_scale is not None and not fp8_weight):
        raise ValueError("w_scale goes with a float8_e4m3fn weight, and an Fp8Tensor x needs one")
    if gated and weight.shape[0] % 2:
        raise ValueError(f"gated=True needs an even number of weight rows (gate, then up), got {weight.shape[0]}")
    data = data.reshape(-1).contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    n, k = weight.shape[0] // (2 if gated else 1), weight.shape[1]
    block_n, block_k, warps = config or gemv_config(fp8_weight, k, gated, norm is not None, rows)
    y = torch.empty(rows * n, dtype=dtype, device=data.device)
    has_res = norm is not None and norm.residual is not None
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        data.view(torch.uint8) if x_scale is not None else data, weight.view(torch.uint8) if fp8_weight else weight,
        bias if bias is not None else y, y, x_scale if x_scale is not None else y,
        w_scale if w_scale is not None else y, norm.residual.reshape(-1) if has_res else y,
        norm.weight if norm is not None else y, norm.residual_out.reshape(-1) if has_res else y,
        norm.eps if norm is not None else 0.0, n, k, weight.stride(0),
        X_FP8=x_scale is not None, W_FP8=fp8_weight, BY_HAND=interpreted(), HAS_BIAS=bias is not None,
        GATED=gated, NORM=norm is not None, HAS_RES=has_res, KP=triton.next_power_of_2(k), ROWS=rows,
        BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, **pdl.options(data.device, rows))
    return y.view(data_shape(x)[:-1] + (n,))


def gemv_ref(x, weight: torch.Tensor, bias: torch.Tensor | None = None, w_scale: torch.Tensor | None = None,
             config=None, gated: bool = False):
    """Twin of gemv_triton (any number of rows): the float32 product of the values, times the scales, plus
    the bias, rounded once; gated, silu_and_mul of that; a NormedRow x is rms_norm_ref's output first.
    (`config` is accepted and unused, so both take the same arguments.)"""
    if isinstance(x, NormedRow):
        x = x.materialize(rms_norm_ref)
    if isinstance(x, Fp8Tensor):
        xv, scale, dtype = x.data.float(), x.scale * w_scale, x.dtype
    else:
        xv, scale, dtype = x.float(), w_scale, x.dtype
    y = xv @ weight.float().t()
    if scale is not None:
        y = y * scale
    if bias is not None:
        y = y + bias.float()
    return silu_and_mul_ref(y.to(dtype)) if gated else y.to(dtype)


def data_shape(x) -> torch.Size:
    return (x.data if isinstance(x, Fp8Tensor) else x).shape


def _path_rows(x) -> int:
    """The rows of `x` (a float tensor or an Fp8Tensor) the batch-1 path sees: 0 when it is off or x is empty."""
    shape = data_shape(x)
    return shape.numel() // shape[-1] if BATCH1_PATH and shape[-1] > 0 else 0


def one_row(x) -> bool:
    """Whether `x` is one row on the batch-1 path (what a NormedRow defers)."""
    return _path_rows(x) == 1


def takes_gemv(x) -> bool:
    """Whether the engine sends `x` to the GEMV: 1 to GEMV_ROWS rows on the batch-1 path."""
    return 1 <= _path_rows(x) <= GEMV_ROWS


def few_rows(x) -> bool:
    """Whether `x` (a float tensor) has the rows the batch-1 path sends to the few-row kernel (skinny.py):
    more than GEMV_ROWS, at most skinny.SKINNY_ROWS."""
    return BATCH1_PATH and skinny.takes_rows(x, GEMV_ROWS)


def float_few_rows(x) -> bool:
    """Whether a bf16/fp16 projection of `x` takes the few-row kernel: few_rows, inside a forward whose launches
    over those rows take PDL (pdl.over_few_rows: without it the kernel measured slower than cuBLAS at the step)."""
    return few_rows(x) and pdl.over_few_rows_now()


def fp8_few_rows(x) -> bool:
    """Whether an fp8 projection of `x` runs weight-only on the few-row kernel (FP8_FEW_ROWS)."""
    return FP8_FEW_ROWS and few_rows(x)


# ---------------------------------------------------------------- the engine's ops

def with_batch1_path(ops: dict, triton_ops: bool) -> dict:
    """get_ops' kernel set with one row (up to GEMV_ROWS) sent to the batch-1 path, and from there up to
    skinny.SKINNY_ROWS rows of a bf16 or fp16 activation to the few-row tensor-core kernel (fp8 weights there
    with FP8_FEW_ROWS only). fp8 on both is weight-only on every device (the producers leave the activation in
    the engine's dtype, the projection takes it as it is), so the CPU engine computes what the CUDA one does (the
    twin, gemv_ref, takes any rows); float projections take the kernels on CUDA only (on the CPU torch's linear is
    the same arithmetic)."""
    gemv = gemv_triton if triton_ops else gemv_ref
    few = skinny.skinny_triton if triton_ops else gemv_ref
    large = {name: ops[name] for name in ("linear", "fp8_linear", "rms_norm_fp8", "silu_and_mul_fp8")}
    small_norm, small_act = ops["rms_norm"], ops["silu_and_mul"]

    def linear(x, weight, bias=None):
        if takes_gemv(x) and weight.dtype in FLOATS and weight.stride(-1) == 1:
            return gemv(x, weight, bias)
        if float_few_rows(x) and skinny.takes_weight(x, weight):
            return skinny.skinny_triton(x, weight, bias)
        return large["linear"](dense(x), weight, bias)

    def fp8_linear(x, weight, scale_w, bias=None, rows=None):  # rollout_kernels/fp8.py's contract
        if takes_gemv(x):
            return gemv(x, weight, bias, scale_w)
        if fp8_few_rows(x) and skinny.takes_weight(x, weight):
            return few(x, weight, bias, scale_w)
        return large["fp8_linear"](dense(x), weight, scale_w, bias, rows)

    def dense(x):
        return x.materialize(small_norm) if isinstance(x, NormedRow) else x

    def rms_norm_fp8(x, weight, eps, residual=None, rows=None):
        if takes_gemv(x) or fp8_few_rows(x):
            return small_norm(x, weight, eps, residual)
        return large["rms_norm_fp8"](x, weight, eps, residual, rows)

    def silu_and_mul_fp8(x, rows=None):
        return small_act(x) if takes_gemv(x) or fp8_few_rows(x) else large["silu_and_mul_fp8"](x, rows)

    return ops | {"fp8_linear": fp8_linear, "rms_norm_fp8": rms_norm_fp8, "silu_and_mul_fp8": silu_and_mul_fp8} | (
        {"linear": linear} if triton_ops else {})


def with_fused_ops(ops: dict, fused: bool) -> dict:
    """ops | linear_silu_and_mul and rms_norm_for_linear, the batch-1 path's fusions. `fused` (Triton on
    CUDA, outside batch-invariant mode) lets the GEMV's rows take them (the norm: one row); otherwise both
    are the ops they stand for, launched one after the other.

    linear_silu_and_mul(x, weight, bias, w_scale, fp8_out, rows): silu(gate) * up of a [gate; up] projection; for
    the GEMV's rows one gated GEMV kernel, else the projection (ops.linear, or ops.fp8_linear with `w_scale`) then
    ops.silu_and_mul (fp8_out: its fp8 twin, whose scale only the first `rows` rows set).
    rms_norm_for_linear(x, weight, eps, residual, fp8_out, rows): ops.rms_norm (fp8_out: rms_norm_fp8, as
    above) whose output only a projection reads; at one row a NormedRow, which the projection's kernel
    normalises."""
    def linear_silu_and_mul(x, weight, bias=None, w_scale=None, fp8_out=False, rows=None):
        if fused and FUSED_GATE and takes_gemv(x) and (w_scale is not None or weight.dtype in FLOATS and weight.stride(-1) == 1):
            return gemv_triton(x, weight, bias, w_scale, gated=True)
        if (fused and FUSED_GATE and (float_few_rows(x) if w_scale is None else fp8_few_rows(x))
                and skinny.takes_weight(x, weight)):
            return skinny.skinny_triton(x, weight, bias, w_scale, gated=True)
        y = ops["linear"](x, weight, bias) if w_scale is None else ops["fp8_linear"](x, weight, w_scale, bias, rows)
        return ops["silu_and_mul_fp8"](y, rows) if fp8_out else ops["silu_and_mul"](y)

    def rms_norm_for_linear(x, weight, eps, residual=None, fp8_out=False, rows=None):
        if fused and FUSED_NORM and one_row(x):
            total = None if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
            row = NormedRow(x, residual, weight, eps, total)
            return row if residual is None else (row, total)
        if fp8_out:
            return ops["rms_norm_fp8"](x, weight, eps, residual, rows)
        return ops["rms_norm"](x, weight, eps, residual)

    def projection_launches(dtype: torch.dtype, quantized: bool, parallel: bool):
        """The context a model's forward runs in: PDL over the few-row kernel's rows when every projection of
        such a step is a Triton kernel (this set's, a bf16/fp16 model, fp8 only with FP8_FEW_ROWS, no collective
        between layers)."""
        return pdl.over_few_rows(fused and dtype in skinny.FLOATS and (not quantized or FP8_FEW_ROWS) and not parallel)

    return ops | {"linear_silu_and_mul": linear_silu_and_mul, "rms_norm_for_linear": rms_norm_for_linear,
                  "projection_launches": projection_launches}
