"""FP8 (float8_e4m3fn) with one scale per tensor: the quantizers, and the fp8 linear layer.

quantize_fp8: scale = max|x| / 448 (float32), q = round_half_even(clamp(x / scale, +-448)). Weights and
activations use the same rule. A weight is written in place with a scale given (quantize_fp8_scaled), so
CUDA graphs holding its address stay valid, and a fused weight's shards share one scale: fp8_scale gives
a shard's own scale, the weight's is the least power of two >= their max (power_of_two_up), and
quantize_fp8_scaled also re-quantizes fp8 rows from their old scale to a new one ((q * old) / new, which is q
bit for bit when new == old, and an exact shift of exponent between powers of two unless it reaches e4m3's
subnormals). A weight update
loads a group's fp8 weights at once (quantize_shards_plan, Fp8Shards: on CUDA four launches for any number of
them, so the host's launch time does not grow with the layers).

An activation arrives at the matmul as an Fp8Tensor made by the kernel that produced it (RMSNorm,
SiLU-and-mul: rollout_kernels/norm.py, rollout_kernels/activation.py), or as a float tensor that fp8_linear quantizes.
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
import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .attention import FP8_MAX, MIN_AMAX, _cast, _magnitude, _scale_of_amax, amax_scale
from .copies import CopyPlan, in_turn

FP8 = torch.float8_e4m3fn
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
    return amax_scale(amax).reshape(1)


def quantize_fp8_ref(x: torch.Tensor, rows: torch.Tensor | None = None):
    """(q, scale): q = e4m3 of x / scale, scale = max|x| / 448 as float32 [1]. `rows` (int [1], on x's device):
    only x's first rows[0] rows (x [T, K]) set the scale, as the rows past them hold no token (a CUDA graph's
    padding, whatever its memory held); all are cast."""
    scale = _scale_of(x if rows is None else x[: int(rows[0])])
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_scale_ref(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out [1] (float32) = max|x| / 448: the scale quantize_fp8_ref would give x."""
    return out.copy_(_scale_of(x).to(out.device))


def power_of_two_up_ref(scale: torch.Tensor) -> torch.Tensor:
    """The least power of two >= each float32 scale (positive, normal); NaN and inf unchanged. A weight's
    scale is one: a sibling shard re-quantized from one such scale to another is then only shifted in
    exponent, exact unless it falls among e4m3's subnormals, so repeated partial updates cannot drift. A rise and
    fall is not undone: a shard sent once much larger, then back, leaves its siblings with the bits they kept at
    the larger scale (those that fell among the subnormals or to zero there stay so) until they are sent again."""
    bits = scale.float().contiguous().view(torch.int32)
    exponent = bits & 0x7F800000
    up = torch.where((bits & 0x007FFFFF) == 0, bits, exponent + 0x00800000)
    return torch.where(exponent == 0x7F800000, bits, up).view(torch.float32)


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
    # the sign as a bit: compiled, -x is 0 - x, which makes -0 (0x80) +0; S.1111.111 is e4m3fn's NaN
    value = (mag.to(tl.int32, bitcast=True) | ((b & 0x80) << 24)).to(tl.float32, bitcast=True)
    return tl.where((b & 0x7F) == 0x7F, float("nan"), value)


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
    return _scale_of_amax(tl.max(acc, 0), min_amax)


@triton.jit
def _counted(n, rows_ptr, width, ROWS: tl.constexpr):
    """The elements that set a scale: n, or (ROWS) the first rows_ptr[0] rows of `width` of them."""
    if ROWS:
        n = tl.minimum(n, tl.load(rows_ptr).to(tl.int64) * width)
    return n


@triton.jit
def _amax_kernel(x, partial, n, rows_ptr, width, TILE: tl.constexpr, ROWS: tl.constexpr = False):
    n = _counted(n, rows_ptr, width, ROWS)
    step = tl.num_programs(0) * TILE
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(tl.program_id(0).to(tl.int64) * TILE, n, step):
        idx = start + tl.arange(0, TILE)
        acc = tl.maximum(acc, _magnitude(tl.load(x + idx, mask=idx < n, other=0.0).to(tl.float32)))
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
def _quantize_one_kernel(x, out, scale_out, n, min_amax, rows_ptr, width, TILE: tl.constexpr,
                         ROWS: tl.constexpr = False):
    """One program: the max of all of x (ROWS: of its first rows_ptr[0] rows), then the cast of all of x (x is
    read twice; it is small)."""
    acc = tl.zeros([TILE], dtype=tl.float32)
    counted = _counted(n, rows_ptr, width, ROWS)
    for start in range(0, counted, TILE):
        idx = start + tl.arange(0, TILE)
        acc = tl.maximum(acc, _magnitude(tl.load(x + idx, mask=idx < counted, other=0.0).to(tl.float32)))
    scale = _scale_of_amax(tl.max(acc, 0), min_amax)
    _cast_tiles(x, out, 0, n, TILE, scale, TILE)
    tl.store(scale_out, scale)


@triton.jit
def _cast_or_nan(v, scale):
    """_cast, but a NaN value gives e4m3's NaN, as the reference's cast does: a weight's rows re-quantized from a NaN
    scale (their values lost) must not come back finite (the clamp in _cast reads NaN as -448)."""
    return tl.where(v == v, _cast(v, scale), 0x7F).to(tl.uint8)


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
        tl.store(out + idx, _cast_or_nan(v, s), mask=mask)


def _programs(n: int) -> int:
    return max(1, min(triton.cdiv(n, _TILE), _PROGRAMS))


def cast_from_partials(x: torch.Tensor, partial: torch.Tensor, out: torch.Tensor, scale_out: torch.Tensor) -> None:
    """The second launch of a per-tensor quantization: scale = max(partial) / 448 into scale_out [1], and
    out (e4m3 bits as uint8, x's size) = x / scale."""
    n = x.numel()
    programs = _programs(n)
    _cast_partials_kernel[(programs,)](x, out, partial, partial.numel(), scale_out, n, MIN_AMAX, TILE=_TILE,
                                       PARTS=min(_PARTS, triton.next_power_of_2(partial.numel())))


def quantize_fp8_triton(x: torch.Tensor, rows: torch.Tensor | None = None):
    """Triton twin of quantize_fp8_ref (bitwise equal): one launch up to ONE_PROGRAM elements, else two. `rows`
    is read on the device (a CUDA graph's step holds it in its buffers)."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=FP8, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    n = x.numel()
    counted = dict(rows_ptr=scale if rows is None else rows, width=x.shape[-1] if x.dim() else 1,
                   ROWS=rows is not None)
    if n <= ONE_PROGRAM:
        _quantize_one_kernel[(1,)](x, out.view(torch.uint8), scale, n, MIN_AMAX, TILE=_TILE, **counted)
        return out, scale
    partial = torch.empty(_programs(n), dtype=torch.float32, device=x.device)
    _amax_kernel[(partial.numel(),)](x, partial, n, TILE=_TILE, **counted)
    cast_from_partials(x, partial, out.view(torch.uint8), scale)
    return out, scale


def fp8_scale_triton(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton twin of fp8_scale_ref (x may live on the host: it is brought to out's device)."""
    x = x.to(out.device).contiguous()
    partial = torch.empty(_programs(x.numel()), dtype=torch.float32, device=out.device)
    _amax_kernel[(partial.numel(),)](x, partial, x.numel(), out, 1, TILE=_TILE)
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

def fp8_linear_ref(x, weight, scale_w, bias=None, rows=None):
    """x (an Fp8Tensor, or [T, in] float: quantized per tensor here, its first `rows` rows setting the scale:
    quantize_fp8_ref) times the e4m3 `weight` [out, in]: the float32 product of the fp8 values times
    scale_x * scale_w ([1]), plus `bias`; in x's dtype."""
    a = x if isinstance(x, Fp8Tensor) else Fp8Tensor(*quantize_fp8_ref(x, rows), x.dtype)
    y = (a.data.float() @ weight.float().t()) * (a.scale * scale_w)
    if bias is not None:
        y = y + bias.float()
    return y.to(a.dtype)


def fp8_linear_triton(x, weight, scale_w, bias=None, rows=None):
    """CUDA twin of fp8_linear_ref: a float x quantized by quantize_fp8_triton, the matmul on
    torch._scaled_mm (weight.t() is the column-major operand it needs), the bias in place on its output."""
    a = x if isinstance(x, Fp8Tensor) else Fp8Tensor(*quantize_fp8_triton(x.reshape(-1, x.shape[-1]), rows),
                                                     x.dtype)
    y = torch._scaled_mm(a.data, weight.t(), scale_a=a.scale, scale_b=scale_w, out_dtype=a.dtype)
    if bias is not None:
        y.add_(bias)
    return y if isinstance(x, Fp8Tensor) else y.view(*x.shape[:-1], weight.shape[0])


# ---------------------------------------------------------------- a group's fp8 weights, quantized at once

class Fp8Shards(NamedTuple):
    """One fp8 weight being loaded: its e4m3 `weight` [rows, in] (contiguous), its float32 `weight_scale` [1]
    and `shard_scale` [shards] (each shard's own max|x| / 448), each shard's (start, size) rows, and the
    `sources` that arrive: {shard index: float tensor of that shard's shape}.

    Loading it (quantize_shards_plan): each arriving shard's scale into shard_scale; the weight's scale is
    the least power of two >= the max of shard_scale; arriving shards are cast with it, the rows of the others re-quantized from
    weight_scale to it ((q * old) / new: q bit for bit when the scale stays); weight_scale is set last. A shard
    holding NaN or inf makes the weight's scale NaN, which loses every shard's values: a sibling re-quantized from
    a NaN scale stays NaN (_cast_or_nan), so the weight serves NaN until each shard has been sent again, in one
    load or several."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    shard_scale: torch.Tensor
    rows: tuple
    sources: dict


def _quantize_shards(job: Fp8Shards, fp8_scale, quantize_fp8_scaled) -> None:
    """One weight, by a launch or two per shard."""
    sources = {i: src.to(job.weight.device) for i, src in job.sources.items()}  # read twice: brought over once
    for i, src in sources.items():
        fp8_scale(src, job.shard_scale[i:i + 1])
    scale = power_of_two_up_ref(job.shard_scale.amax()).reshape(1)
    for i, (start, size) in enumerate(job.rows):
        rows = job.weight[start:start + size]
        if i in sources:
            quantize_fp8_scaled(sources[i], scale, rows)
        else:
            quantize_fp8_scaled(rows, scale, rows, job.weight_scale)
    job.weight_scale.copy_(scale)


def _quantize_each(jobs: list[Fp8Shards], fp8_scale, quantize_fp8_scaled) -> None:
    for job in jobs:
        _quantize_shards(job, fp8_scale, quantize_fp8_scaled)


def quantize_shards_plan_ref(jobs: list[Fp8Shards]) -> CopyPlan:
    """A plan that loads every weight of `jobs` (Fp8Shards says how) from what its sources hold when it runs."""
    return CopyPlan(rest=functools.partial(_quantize_each, jobs, fp8_scale_ref, quantize_fp8_scaled_ref))


# A shard's kind in the batched kernels' table: how its values are read.
_KINDS = {torch.float8_e4m3fn: 0, torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_FIELDS = tl.constexpr(5)  # a shard's row: destination, source, elements, layer, kind
# elements: with every offset and size a multiple (16 bytes of the narrowest kind), the kernels read and write
# whole 16-byte vectors
_VECTOR = tl.constexpr(16)


@triton.jit
def _shard_values(x, idx, mask, x_scale, KIND: tl.constexpr):
    """fp32 values of a shard at x + idx: KIND 0 e4m3 bits times x_scale, 1 bf16 bits (widened by hand: the
    interpreter has no bfloat16), 2 fp16, 3 fp32."""
    if KIND == 0:
        v = _e4m3_value(tl.load(x + idx, mask=mask, other=0)) * x_scale
    elif KIND == 1:
        v = (tl.load(x + idx, mask=mask, other=0).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        v = tl.load(x + idx, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def _shard_amax(x, n, KIND: tl.constexpr, TILE: tl.constexpr):
    """This program's max |value| over its tiles of the shard at x (every num_programs-th)."""
    acc = tl.zeros([TILE], dtype=tl.float32)
    for start in range(tl.program_id(0).to(tl.int64) * TILE, n, tl.num_programs(0) * TILE):
        idx = tl.multiple_of(start, TILE) + tl.arange(0, TILE)
        acc = tl.maximum(acc, _magnitude(_shard_values(x, idx, idx < n, 1.0, KIND)))
    return tl.max(acc, 0)


@triton.jit
def _shard_cast(out, x, n, scale, x_scale, KIND: tl.constexpr, TILE: tl.constexpr):
    """This program's tiles of the shard's rows `out` = e4m3 of its values (at x) / scale."""
    for start in range(tl.program_id(0).to(tl.int64) * TILE, n, tl.num_programs(0) * TILE):
        idx = tl.multiple_of(start, TILE) + tl.arange(0, TILE)
        mask = idx < n
        tl.store(out + idx, _cast_or_nan(_shard_values(x, idx, mask, x_scale, KIND), scale), mask=mask)


# The kernels read two tables of int64: a row per shard (_FIELDS: destination and source as element offsets
# from `base`, the table's own address, so a plan keeps no other tensor alive; elements; layer; kind), the
# arriving ones first, and a row per layer (`width`: its shard_scale and weight_scale as offsets from base,
# its shard count, then each shard's row in the first table, or -1 where the shard does not arrive). The
# bases are the table's address read as each element type.

@triton.jit
def _shards_amax_kernel(i16, f16, f32, shards, arriving, partial, ALIGNED: tl.constexpr, TILE: tl.constexpr):
    # partial[t, program]: this program's max over arriving shard t (0 where it has no tile of it)
    for t in range(arriving):
        row = shards + t * _FIELDS
        off, n, kind = tl.load(row + 1), tl.load(row + 2), tl.load(row + 4)
        if ALIGNED:  # whole vectors (the hints here, in the kernel's body, are the ones the compiler keeps)
            off, n = tl.multiple_of(off, _VECTOR), tl.multiple_of(n, _VECTOR)
        if kind == 1:
            m = _shard_amax(i16 + off, n, 1, TILE)
        elif kind == 2:
            m = _shard_amax(f16 + off, n, 2, TILE)
        else:
            m = _shard_amax(f32 + off, n, 3, TILE)
        tl.store(partial + t * tl.num_programs(0) + tl.program_id(0), m)


@triton.jit
def _power_of_two_up(scale):
    """power_of_two_up_ref of a float32 scalar."""
    bits = scale.to(tl.int32, bitcast=True)
    exponent = bits & 0x7F800000
    up = tl.where((bits & 0x007FFFFF) == 0, bits, exponent + 0x00800000)
    return tl.where(exponent == 0x7F800000, bits, up).to(tl.float32, bitcast=True)


@triton.jit
def _shards_scale_kernel(f32, layers, width, partial, parts, new_scale, min_amax, PARTS: tl.constexpr):
    # one program per layer: its arriving shards' scales into shard_scale, new_scale[layer] = the least power
    # of two >= their max
    row = layers + tl.program_id(0) * width
    shard_scale = tl.load(row)
    new = tl.zeros([], dtype=tl.float32)
    for i in range(tl.load(row + 2)):
        t = tl.load(row + 3 + i)
        if t >= 0:
            s = _scale_from(partial + t * parts, parts, min_amax, PARTS)
            tl.store(f32 + shard_scale + i, s)
        else:
            s = tl.load(f32 + shard_scale + i)
        new = tl.maximum(new, _magnitude(s))  # a NaN shard scale (read as inf) makes the weight's NaN
    tl.store(new_scale + tl.program_id(0), _power_of_two_up(tl.where(new == float("inf"), float("nan"), new)))


@triton.jit
def _shards_cast_kernel(u8, i16, f16, f32, shards, count, layers, width, new_scale, ALIGNED: tl.constexpr,
                        TILE: tl.constexpr):
    # every shard: arriving ones cast from their source, the others re-quantized in place from weight_scale
    for t in range(count):
        row = shards + t * _FIELDS
        dst, off, n, layer, kind = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3), tl.load(row + 4)
        if ALIGNED:
            dst, off, n = tl.multiple_of(dst, _VECTOR), tl.multiple_of(off, _VECTOR), tl.multiple_of(n, _VECTOR)
        scale = tl.load(new_scale + layer)
        if kind == 0:
            old = tl.load(f32 + tl.load(layers + layer * width + 1))
            _shard_cast(u8 + dst, u8 + off, n, scale, old, 0, TILE)
        elif kind == 1:
            _shard_cast(u8 + dst, i16 + off, n, scale, scale, 1, TILE)
        elif kind == 2:
            _shard_cast(u8 + dst, f16 + off, n, scale, scale, 2, TILE)
        else:
            _shard_cast(u8 + dst, f32 + off, n, scale, scale, 3, TILE)


@triton.jit
def _shards_set_scale_kernel(f32, layers, width, new_scale):
    tl.store(f32 + tl.load(layers + tl.program_id(0) * width + 1), tl.load(new_scale + tl.program_id(0)))


def _batchable(job: Fp8Shards) -> bool:
    """Whether the batched kernels take the job: everything on the weight's device, contiguous, of a kind
    they read, each source of its shard's size (else the per-weight path, which brings sources over)."""
    weight, columns = job.weight, job.weight.shape[-1]
    tensors = [weight, job.weight_scale, job.shard_scale, *job.sources.values()]
    return (weight.dtype == FP8 and all(t.device == weight.device and t.is_contiguous() and t.dtype in _KINDS
                                        and t.data_ptr() % t.element_size() == 0 for t in tensors)
            and all(src.numel() == job.rows[i][1] * columns for i, src in job.sources.items()))


def _batched(jobs: list[Fp8Shards]):
    """The four launches that load `jobs` (all batchable): a table built here, once, and the launches' scratch."""
    arriving, siblings, layers = [], [], []
    for layer, job in enumerate(jobs):
        entries = []
        for i, (start, size) in enumerate(job.rows):
            rows = job.weight[start:start + size]
            source = job.sources.get(i)
            entries.append(-1 if source is None else len(arriving))
            (siblings if source is None else arriving).append((rows, rows if source is None else source, layer))
        layers.append((job.shard_scale, job.weight_scale, entries))
    shards = arriving + siblings
    device, width = jobs[0].weight.device, 3 + max(len(job.rows) for job in jobs)
    table = torch.empty(_FIELDS.value * len(shards) + width * len(layers), dtype=torch.int64, device=device)
    origin = table.data_ptr()

    def at(t: torch.Tensor) -> int:
        return (t.data_ptr() - origin) // t.element_size()

    rows = [(at(dst), at(src), src.numel(), layer, _KINDS[src.dtype]) for dst, src, layer in shards]
    rows += [(at(shard_scale), at(weight_scale), len(entries), *entries, *[-1] * (width - 3 - len(entries)))
             for shard_scale, weight_scale, entries in layers]
    table.copy_(torch.tensor([v for row in rows for v in row], dtype=torch.int64, pin_memory=table.is_cuda),
                non_blocking=True)
    aligned = all(v % _VECTOR.value == 0 for row in rows[:len(shards)] for v in row[:3])
    reading = _programs(sum(src.numel() for _, src, _ in arriving))
    parts = min(_PARTS, triton.next_power_of_2(reading))
    partial = torch.empty(len(arriving) * reading, dtype=torch.float32, device=device)
    new_scale = torch.empty(len(layers), dtype=torch.float32, device=device)
    shard_rows, layer_rows = table[:_FIELDS.value * len(shards)], table[_FIELDS.value * len(shards):]
    u8, i16, f16, f32 = (table.view(dtype) for dtype in (torch.uint8, torch.int16, torch.float16, torch.float32))
    return in_turn(
        functools.partial(_shards_amax_kernel[(reading,)], i16, f16, f32, shard_rows, len(arriving), partial,
                          ALIGNED=aligned, TILE=_TILE),
        functools.partial(_shards_scale_kernel[(len(layers),)], f32, layer_rows, width, partial, reading, new_scale,
                          MIN_AMAX, PARTS=parts),
        functools.partial(_shards_cast_kernel[(_programs(sum(src.numel() for _, src, _ in shards)),)], u8, i16, f16,
                          f32, shard_rows, len(shards), layer_rows, width, new_scale, ALIGNED=aligned, TILE=_TILE),
        functools.partial(_shards_set_scale_kernel[(len(layers),)], f32, layer_rows, width, new_scale))


def quantize_shards_plan_triton(jobs: list[Fp8Shards]) -> CopyPlan:
    """Triton twin of quantize_shards_plan_ref (bitwise equal): the weights whose tensors all sit on their
    device, contiguous, in four launches however many they are (the amax of every arriving source; each
    weight's new scale; every cast and re-quantization; each weight_scale), over a table built once (the
    plan's `launch`, holding addresses only); any others one by one (its `rest`)."""
    batched = [job for job in jobs if _batchable(job)]
    others = [job for job in jobs if not _batchable(job)]
    return CopyPlan(launch=_batched(batched) if batched else None,
                    rest=functools.partial(_quantize_each, others, fp8_scale_triton, quantize_fp8_scaled_triton)
                    if others else None)
