"""SiLU-and-mul: the gate of a SwiGLU MLP, and its fp8 twin that hands down_proj its input already
quantized (rollout_kernels/fp8.py)."""
import torch
import triton
import triton.language as tl

from . import pdl
from .attention import _magnitude, _scale_of_amax
from .fp8 import FP8, MIN_AMAX, ONE_PROGRAM, Fp8Tensor, _cast_tiles, _counted, cast_from_partials, quantize_fp8_ref


def silu_and_mul_ref(x):
    """x [T, 2I] -> silu(x[:, :I]) * x[:, I:], computed in fp32."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_fp8_ref(x, rows=None):
    """silu_and_mul_ref, its output quantized per tensor (quantize_fp8_ref; `rows`: only the first rows[0] rows set
    the scale), as an Fp8Tensor."""
    return Fp8Tensor(*quantize_fp8_ref(silu_and_mul_ref(x), rows), x.dtype)


@triton.jit
def _silu_and_mul_block(x_ptr, out_ptr, row, block, inter, stride_x, BLOCK: tl.constexpr):
    """One block of one row into out_ptr; its output values returned."""
    cols = block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * inter + cols, y, mask=mask)
    return y


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl.wait_previous(PDL)
    _silu_and_mul_block(x_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), inter, stride_x, BLOCK)


@triton.jit
def _silu_and_mul_fp8_kernel(x_ptr, out_ptr, partial, q_ptr, scale_out, rows, inter, stride_x, min_amax, rows_ptr,
                             ONE: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """ONE: this program computes every block of every row into out_ptr, then casts them all over the max
    (one launch). Else: block program_id(1) of row program_id(0), its max into partial. ROWS: rows past
    rows_ptr[0] are computed and cast but count 0 in the max."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    counted = _counted(rows, rows_ptr, 1, ROWS)
    if ONE:
        for row in range(0, rows):
            for block in range(0, tl.cdiv(inter, BLOCK)):
                y = _silu_and_mul_block(x_ptr, out_ptr, tl.cast(row, tl.int64), block, inter, stride_x, BLOCK)
                acc = tl.where(row < counted, tl.maximum(acc, _magnitude(y.to(tl.float32))), acc)
        tl.debug_barrier()  # every value stored before any is read back
        scale = _scale_of_amax(tl.max(acc, 0), min_amax)
        _cast_tiles(out_ptr, q_ptr, 0, rows * inter, BLOCK, scale, BLOCK)
        tl.store(scale_out, scale)
    else:
        y = _silu_and_mul_block(x_ptr, out_ptr, tl.program_id(0).to(tl.int64), tl.program_id(1), inter,
                                stride_x, BLOCK)
        acc = tl.where(tl.program_id(0) < counted, tl.maximum(acc, _magnitude(y.to(tl.float32))), acc)
        tl.store(partial + tl.program_id(0) * tl.num_programs(1) + tl.program_id(1), tl.max(acc, 0))


def _block(inter: int) -> int:
    return min(1024, triton.next_power_of_2(inter))


def silu_and_mul_triton(x):
    """Triton twin of silu_and_mul_ref (rows must be unit-stride)."""
    rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    block = _block(inter)
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](x, out, inter, x.stride(0), BLOCK=block,
                                                                  **pdl.options(x.device, rows))
    return out


def silu_and_mul_fp8_triton(x, rows=None):
    """Triton twin of silu_and_mul_fp8_ref (bitwise equal): one launch up to fp8.ONE_PROGRAM output
    elements, else two. `rows` is read on the device (a CUDA graph's step holds it in its buffers)."""
    t, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((t, inter), dtype=x.dtype, device=x.device)  # the values the fp8 ones are cast from
    q = torch.empty((t, inter), dtype=FP8, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    block = _block(inter)
    one = t * inter <= ONE_PROGRAM
    grid = (1, 1) if one else (t, triton.cdiv(inter, block))
    partial = scale if one else torch.empty(grid[0] * grid[1], dtype=torch.float32, device=x.device)
    _silu_and_mul_fp8_kernel[grid](x, out, partial, q.view(torch.uint8), scale, t, inter, x.stride(0), MIN_AMAX,
                                   scale if rows is None else rows, ONE=one, BLOCK=block, ROWS=rows is not None)
    if not one:
        cast_from_partials(out, partial, q.view(torch.uint8), scale)
    return Fp8Tensor(q, scale, x.dtype)
