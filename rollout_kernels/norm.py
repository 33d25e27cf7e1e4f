"""RMSNorm with an optional fused residual add (Hugging Face LlamaRMSNorm numerics), and its fp8 twin that
hands the next projection its input already quantized (rollout_kernels/fp8.py)."""
import torch
import triton
import triton.language as tl

from . import pdl
from .attention import _magnitude, _scale_of_amax
from .fp8 import FP8, MIN_AMAX, ONE_PROGRAM, Fp8Tensor, _cast_tiles, _counted, cast_from_partials, quantize_fp8_ref


def rms_norm_ref(x, weight, eps, residual=None):
    """x [T, N] -> out, or (out, x + residual) when residual is given.

    Normalise in fp32, round to x.dtype, then scale by weight (as HF does)."""
    if residual is not None:
        x = (x.float() + residual.float()).to(x.dtype)
    xf = x.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = (weight.float() * normed.float()).to(x.dtype)
    return out if residual is None else (out, x)


def rms_norm_fp8_ref(x, weight, eps, residual=None, rows=None):
    """rms_norm_ref, its output quantized per tensor (quantize_fp8_ref; `rows`: only the first rows[0] rows set the
    scale): an Fp8Tensor, or (it, x + residual)."""
    out = rms_norm_ref(x, weight, eps, residual)
    normed, res = (out, None) if residual is None else out
    act = Fp8Tensor(*quantize_fp8_ref(normed, rows), x.dtype)
    return act if residual is None else (act, res)


@triton.jit
def _rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, row, n, stride_x, stride_r, eps,
                  HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """Normalise one row into out_ptr (x + residual into res_out_ptr first); its output values returned."""
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    out = (w * normed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * n + cols, out, mask=mask)
    return out


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, stride_x, stride_r, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_previous(PDL)
    _rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, tl.program_id(0).to(tl.int64), n, stride_x,
                  stride_r, eps, HAS_RESIDUAL, BLOCK)


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, partial, q_ptr, scale_out, rows, n,
                         stride_x, stride_r, eps, min_amax, rows_ptr, HAS_RESIDUAL: tl.constexpr, ONE: tl.constexpr,
                         BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """ONE: this program normalises every row into out_ptr, then casts them all over the max (one launch).
    Else: row program_id, its max into partial (cast_from_partials follows). ROWS: rows past rows_ptr[0] are
    normalised and cast but count 0 in the max."""
    counted = _counted(rows, rows_ptr, 1, ROWS)
    if ONE:
        first, last = 0, rows
    else:
        first, last = tl.program_id(0), tl.program_id(0) + 1
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for row in range(first, last):
        out = _rms_norm_row(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, tl.cast(row, tl.int64), n, stride_x,
                            stride_r, eps, HAS_RESIDUAL, BLOCK)
        acc = tl.where(row < counted, tl.maximum(acc, _magnitude(out.to(tl.float32))), acc)
    if ONE:
        tl.debug_barrier()  # every row's values stored before any is read back
        scale = _scale_of_amax(tl.max(acc, 0), min_amax)
        _cast_tiles(out_ptr, q_ptr, 0, rows * n, BLOCK, scale, BLOCK)
        tl.store(scale_out, scale)
    else:
        tl.store(partial + tl.program_id(0), tl.max(acc, 0))


def _warps(n: int) -> int:
    return min(16, max(1, triton.next_power_of_2(n) // 256))


def rms_norm_triton(x, weight, eps, residual=None):
    """Triton twin of rms_norm_ref: one program per row (rows must be unit-stride)."""
    rows, n = x.shape
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        res = residual if residual is not None else x
        _rms_norm_kernel[(rows,)](x, res, weight, out, res_out, n, x.stride(0), res.stride(0), eps,
                                  HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n),
                                  num_warps=_warps(n), **pdl.options(x.device, rows))
    return out if residual is None else (out, res_out)


def rms_norm_fp8_triton(x, weight, eps, residual=None, rows=None):
    """Triton twin of rms_norm_fp8_ref (bitwise equal): one launch up to fp8.ONE_PROGRAM elements, else two.
    `rows` is read on the device (a CUDA graph's step holds it in its buffers)."""
    t, n = x.shape
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)  # the values the fp8 ones are cast from
    res_out = torch.empty_like(out) if residual is not None else out
    q = torch.empty((t, n), dtype=FP8, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    one = t * n <= ONE_PROGRAM
    partial = scale if one else torch.empty(t, dtype=torch.float32, device=x.device)
    res = residual if residual is not None else x
    _rms_norm_fp8_kernel[(1 if one else t,)](
        x, res, weight, out, res_out, partial, q.view(torch.uint8), scale, t, n, x.stride(0), res.stride(0),
        eps, MIN_AMAX, scale if rows is None else rows, HAS_RESIDUAL=residual is not None, ONE=one,
        BLOCK=triton.next_power_of_2(n), ROWS=rows is not None, num_warps=_warps(n))
    if not one:
        cast_from_partials(out, partial, q.view(torch.uint8), scale)
    act = Fp8Tensor(q, scale, x.dtype)
    return act if residual is None else (act, res_out)
