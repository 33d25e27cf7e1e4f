"""FP8 (float8_e4m3fn) with one scale per tensor: the quantizers, and the fp8 linear layer.

quantize_fp8: scale = max|x| / 448 (float32), q = round_half_even(clamp(x / scale, +-448)). Weights and
activations use the same rule. A weight is written in place with a scale given (quantize_fp8_scaled), so
CUDA graphs holding its address stay valid, and a fused weight's shards share one scale: fp8_scale gives
a shard's own scale, the weight's is their max, and quantize_fp8_scaled also re-quantizes fp8 rows from
their old scale to a new one ((q * old) / new, which is q bit for bit when new == old).

An activation arrives at the matmul as an Fp8Tensor made by the kernel that produced it (RMSNorm,
SiLU-and-mul: kernels/norm.py, kernels/activation.py), or as a float tensor that fp8_linear quantizes.
Those producers and quantize_fp8_triton share this file's two ways to a per-tensor scale without a host
sync (graph-safe): up to ONE_PROGRAM elements, one program computes every value and its max, then casts
them (one launch); above it, one program per row writes the row's values and max (`partial`), and
cast_from_partials reduces the maxima and casts (two launches).

fp8_linear: y = (q_x @ q_w^T) * scale_x * scale_w [+ bias]. On CUDA the matmul is torch._scaled_mm
(cuBLASLt, tensorwise scales: faster than bf16 on an H200, where rowwise scales are slower); its dims (in
and out features) must be multiples of 16. The reference dequantizes nothing early: the products of two
e4m3 values are exact in float32, so a float32 matmul of the fp8 values, then the scales, is the
hardware's arithmetic up to the order of the float32 sums.
"""
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention import FP8_MAX, _e4m3_bits

FP8 = torch.float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero tensor gets a tiny positive scale (its values quantize to 0)
_TILE = 2048  # elements per program and step
_PROGRAMS = 1024  # at most, for a grid-stride pass over a large tensor
_PARTS = 1024  # partial maxima read per step
# Up to this many output elements one program makes and casts a whole activation (one launch instead of
# two): at decode sizes (batch 1: a hidden row of 2-4k values, an MLP row of 6-14k) one SM reads and writes
# those few tens of KB in well under the microseconds a second launch costs.
ONE_PROGRAM = 16384


class Fp8Tensor(NamedTuple):
    """An activation already quantized per tensor: e4m3 `data` [T, K], its float32 `scale` [1], and the
    dtype it stands for (the matmul's output dtype)."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype


def _scale_of(x: torch.Tensor) -> torch.Tensor:
    amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    return (amax.clamp(min=MIN_AMAX) / FP8_MAX).reshape(1)


def quantize_fp8_ref(x: torch.Tensor):
    """(q, scale): q = e4m3 of x / scale, scale = max|x| / 448 as float32 [1]."""
    scale = _scale_of(x)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_scale_ref(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [1] (float32) = max|x| / 448: the scale quantize_fp8_ref would give x."""
    return out.copy_(_scale_of(x).to(out.device))


def quantize_fp8_scaled_ref(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                            x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """out (e4m3, x's shape) = e4m3 of v / scale, v = x, or (x's e4m3 values * x_scale) when x is fp8 (a
    re-quantization; x may be out itself)."""
    v = x.float() * x_scale if x_scale is not None else x.to(out.device).float()
    return out.copy_((v / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8))


# ---------------------------------------------------------------- Triton

@triton.jit
def _e4m3_value(bits):
    """fp32 value of float8_e4m3fn bit patterns (uint8): by hand, as the interpreter has no fp8 loads."""
    b = bits.to(tl.int32)
    exp = (b >> 3) & 0xF
    man = b & 7
    normal = (((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)  # 1.man * 2**(exp - 7)
    mag = tl.where(exp == 0, man.to(tl.float32) * 0.001953125, normal)  # subnormal: man * 2**-9
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _cast(v, scale):
    """e4m3 bits of v / scale (IEEE division, as the reference's), clamped to the format."""
    return _e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))


@triton.jit
def _cast_tiles(src, dst, first, n, step, scale, TILE: tl.constexpr):
    """dst[i] = e4m3 of src[i] / scale for i in first + k * step + [0, TILE) below n."""
    for start in range(first, n, step):
        idx = start + tl.arange(0, TILE)
        mask = idx < n
        tl.store(dst + idx, _cast(tl.load(src + idx, mask=mask, other=0.0).to(tl.float32), scale), mask=mask)


@triton.jit
def _scale_from(partial, parts, min_amax, BLOCK: tl.constexpr):
    """The scale of the max over `parts` partial maxima."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, parts, BLOCK):
        p = start + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, tl.load(partial + p, mask=p < parts, other=0.0))
    return tl.math.div_rn(tl.maximum(tl.max(acc, 0), min_amax), 448.0)


@triton.jit
def _amax_kernel(x, partial, n, TILE: tl.constexpr):
    step = tl.num_programs(0) * TILE
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(tl.program_id(0).to(tl.int64) * TILE, n, step):
        idx = start + tl.arange(0, TILE)
        acc = tl.maximum(acc, tl.abs(tl.load(x + idx, mask=idx < n, other=0.0).to(tl.float32)))
    tl.store(partial + tl.program_id(0), tl.max(acc, 0))


@triton.jit
def _cast_partials_kernel(x, out, partial, parts, scale_out, n, min_amax, TILE: tl.constexpr,
                          PARTS: tl.constexpr):
    scale = _scale_from(partial, parts, min_amax, PARTS)
    _cast_tiles(x, out, tl.program_id(0).to(tl.int64) * TILE, n, tl.num_programs(0) * TILE, scale, TILE)
    if tl.program_id(0) == 0:
        tl.store(scale_out, scale)


@triton.jit
def _scale_kernel(partial, parts, scale_out, min_amax, PARTS: tl.constexpr):
    tl.store(scale_out, _scale_from(partial, parts, min_amax, PARTS))


@triton.jit
def _quantize_one_kernel(x, out, scale_out, n, min_amax, TILE: tl.constexpr):
    """One program: the max of all of x, then the cast (x is read twice; it is small)."""
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(0, n, TILE):
        idx = start + tl.arange(0, TILE)
        acc = tl.maximum(acc, tl.abs(tl.load(x + idx, mask=idx < n, other=0.0).to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(acc, 0), min_amax), 448.0)
    _cast_tiles(x, out, 0, n, TILE, scale, TILE)
    tl.store(scale_out, scale)


@triton.jit
def _quantize_scaled_kernel(x, out, scale, x_scale, n, FP8_IN: tl.constexpr, TILE: tl.constexpr):
    s = tl.load(scale)
    step = tl.num_programs(0) * TILE
    for start in range(tl.program_id(0).to(tl.int64) * TILE, n, step):
        idx = start + tl.arange(0, TILE)
        mask = idx < n
        if FP8_IN:
            v = _e4m3_value(tl.load(x + idx, mask=mask, other=0)) * tl.load(x_scale)
        else:
            v = tl.load(x + idx, mask=mask, other=0.0).to(tl.float32)
        tl.store(out + idx, _cast(v, s), mask=mask)


def _programs(n: int) -> int:
    return max(1, min(triton.cdiv(n, _TILE), _PROGRAMS))


def cast_from_partials(x: torch.Tensor, partial: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """The second launch of a per-tensor quantization: scale = max(partial) / 448 into scale_out [1], and
    out (e4m3 bits as uint8, x's size) = x / scale."""
    n = x.numel()
    programs = _programs(n)
    _cast_partials_kernel[(programs,)](x, out, partial, partial.numel(), scale_out, n, MIN_AMAX, TILE=_TILE,
                                       PARTS=min(_PARTS, triton.next_power_of_2(partial.numel())))


def quantize_fp8_triton(x: torch.Tensor):
    """Triton twin of quantize_fp8_ref (bitwise equal): one launch up to ONE_PROGRAM elements, else two."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n <= ONE_PROGRAM:
        _quantize_one_kernel[(1,)](x, out.view(torch.uint8), scale, n, MIN_AMAX, TILE=_TILE)
        return out, scale
    partial = torch.empty(_programs(n), dtype=torch.float32, device=x.device)
    _amax_kernel[(partial.numel(),)](x, partial, n, TILE=_TILE)
    cast_from_partials(x, partial, out.view(torch.uint8), scale)
    return out, scale


def fp8_scale_triton(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton twin of fp8_scale_ref (x may live on the host: it is brought to out's device)."""
    x = x.to(out.device).contiguous()
    partial = torch.empty(_programs(x.numel()), dtype=torch.float32, device=out.device)
    _amax_kernel[(partial.numel(),)](x, partial, x.numel(), TILE=_TILE)
    _scale_kernel[(1,)](partial, partial.numel(), out, MIN_AMAX,
                        PARTS=min(_PARTS, triton.next_power_of_2(partial.numel())))
    return out


def quantize_fp8_scaled_triton(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
                               x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Triton twin of quantize_fp8_scaled_ref (bitwise equal); `out` must be contiguous."""
    fp8_in = x_scale is not None
    x = x.view(torch.uint8) if fp8_in else x.to(out.device).contiguous()
    n = x.numel()
    _quantize_scaled_kernel[(_programs(n),)](x, out.view(torch.uint8), scale, x_scale if fp8_in else scale, n,
                                             FP8_IN=fp8_in, TILE=_TILE)
    return out


# ---------------------------------------------------------------- the linear layer

def fp8_linear_ref(x, weight, scale_w, bias=None):
    """x (an Fp8Tensor, or [..., in] float: quantized per tensor here) times the e4m3 `weight` [out, in]:
    the float32 product of the fp8 values times scale_x * scale_w ([1]), plus `bias`; in x's dtype."""
    a = x if isinstance(x, Fp8Tensor) else Fp8Tensor(*quantize_fp8_ref(x), x.dtype)
    y = (a.data.float() @ weight.float().t()) * (a.scale * scale_w)
    if bias is not None:
        y = y + bias.float()
    return y.to(a.dtype)


def fp8_linear_triton(x, weight, scale_w, bias=None):
    """CUDA twin of fp8_linear_ref: a float x quantized by quantize_fp8_triton, the matmul on
    torch._scaled_mm (weight.t() is the column-major operand it needs), the bias in place on its output."""
    a = x if isinstance(x, Fp8Tensor) else Fp8Tensor(*quantize_fp8_triton(x.reshape(-1, x.shape[-1])), x.dtype)
    y = torch._scaled_mm(a.data, weight.t(), scale_a=a.scale, scale_b=scale_w, out_dtype=a.dtype)
    if bias is not None:
        y.add_(bias)
    return y if isinstance(x, Fp8Tensor) else y.view(*x.shape[:-1], weight.shape[0])
