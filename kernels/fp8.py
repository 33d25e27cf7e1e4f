"""FP8 (float8_e4m3fn) with one scale per tensor: the quantizer, and the fp8 linear layer.

quantize_fp8: scale = max|x| / 448 (float32), q = round_half_even(clamp(x / scale, +-448)). Weights and
activations use the same rule; the weight path writes into the engine's storage in place (`out`,
`scale_out`), so CUDA graphs holding those addresses stay valid.

fp8_linear: y = (q_x @ q_w^T) * scale_x * scale_b [* row_scale] [+ bias]. On CUDA the matmul is
torch._scaled_mm (cuBLASLt, tensorwise scales: faster than bf16 on an H200, where rowwise scales are
slower); its dims (in and out features) must be multiples of 16. The reference dequantizes nothing
early: the products of two e4m3 values are exact in float32, so a float32 matmul of the fp8 values,
then the scales, is the hardware's arithmetic up to the order of the float32 sums.

The Triton quantizer takes two launches and no host sync (graph-safe): a grid-stride max of |x| into
one partial per program, then every program reduces the partials, and quantizes its tiles.
"""
import torch
import triton
import triton.language as tl

from .attention import FP8_MAX, _e4m3_bits

FP8 = torch.float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero tensor gets a tiny positive scale (its values quantize to 0)
_TILE = 2048  # elements per program and step
_PROGRAMS = 1024  # at most (a power of two: the partial maxima are read as one vector)


def quantize_fp8_ref(x: torch.Tensor, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None):
    """(q, scale): q = e4m3 of x / scale, scale = max|x| / 448 as float32 [1]. With `out` (float8_e4m3fn,
    x's shape, any device) and `scale_out` (float32, every element gets the scale) the results land there."""
    amax = x.detach().abs().amax().float() if x.numel() else x.new_zeros((), dtype=torch.float32)
    scale = amax.clamp(min=MIN_AMAX) / FP8_MAX
    q = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    out = q if out is None else out.copy_(q)
    scale_out = scale.reshape(1) if scale_out is None else scale_out.copy_(scale.to(scale_out.device))
    return out, scale_out


@triton.jit
def _amax_kernel(x, partial, n, TILE: tl.constexpr):
    step = tl.num_programs(0) * TILE
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(tl.program_id(0).to(tl.int64) * TILE, n, step):
        idx = start + tl.arange(0, TILE)
        acc = tl.maximum(acc, tl.abs(tl.load(x + idx, mask=idx < n, other=0.0).to(tl.float32)))
    tl.store(partial + tl.program_id(0), tl.max(acc, 0))


@triton.jit
def _quantize_kernel(x, out, partial, parts, scale_out, scales, n, min_amax, TILE: tl.constexpr,
                     PARTS: tl.constexpr):
    p = tl.arange(0, PARTS)
    amax = tl.max(tl.load(partial + p, mask=p < parts, other=0.0), 0)
    scale = tl.math.div_rn(tl.maximum(amax, min_amax), 448.0)  # IEEE division, as the reference's
    step = tl.num_programs(0) * TILE
    first = tl.program_id(0).to(tl.int64) * TILE
    for start in range(first, n, step):
        idx = start + tl.arange(0, TILE)
        mask = idx < n
        v = tl.math.div_rn(tl.load(x + idx, mask=mask, other=0.0).to(tl.float32), scale)
        tl.store(out + idx, _e4m3_bits(tl.minimum(tl.maximum(v, -448.0), 448.0)), mask=mask)
    for start in range(first, scales, step):
        idx = start + tl.arange(0, TILE)
        tl.store(scale_out + idx, tl.zeros([TILE], dtype=tl.float32) + scale, mask=idx < scales)


def quantize_fp8_triton(x: torch.Tensor, out: torch.Tensor | None = None, scale_out: torch.Tensor | None = None):
    """Triton twin of quantize_fp8_ref (bitwise equal): two launches, no host sync."""
    device = (out if out is not None else x).device
    x = x.to(device).contiguous()  # a checkpoint tensor read on the host, or a strided view
    out = torch.empty(x.shape, dtype=FP8, device=device) if out is None else out
    scale_out = torch.empty(1, dtype=torch.float32, device=device) if scale_out is None else scale_out
    n = x.numel()
    programs = max(1, min(triton.cdiv(n, _TILE), _PROGRAMS))
    partial = torch.empty(programs, dtype=torch.float32, device=device)
    _amax_kernel[(programs,)](x, partial, n, TILE=_TILE)
    _quantize_kernel[(programs,)](x, out.view(torch.uint8), partial, programs, scale_out, scale_out.numel(), n,
                                  MIN_AMAX, TILE=_TILE, PARTS=triton.next_power_of_2(programs))
    return out, scale_out


def fp8_linear_ref(x, weight, scale_b, row_scale=None, bias=None):
    """x [..., in] (float) times the e4m3 `weight` [out, in]: x quantized per tensor (quantize_fp8_ref), the
    float32 product of the fp8 values times scale_x * scale_b ([1]), times `row_scale` [out] if given, plus
    `bias`; in x's dtype."""
    q, scale = quantize_fp8_ref(x)
    y = (q.float() @ weight.float().t()) * (scale * scale_b)
    if row_scale is not None:
        y = y * row_scale
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_linear_triton(x, weight, scale_b, row_scale=None, bias=None):
    """CUDA twin of fp8_linear_ref: the activation quantized by quantize_fp8_triton, the matmul on
    torch._scaled_mm (weight.t() is the column-major operand it needs); the row scale and the bias in place
    on its output."""
    q, scale = quantize_fp8_triton(x.reshape(-1, x.shape[-1]))
    y = torch._scaled_mm(q, weight.t(), scale_a=scale, scale_b=scale_b, out_dtype=x.dtype)
    if row_scale is not None:
        y.mul_(row_scale)
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], weight.shape[0])
