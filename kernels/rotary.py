"""Rotary position embedding, non-interleaved (HF rotate_half) convention."""
import torch
import triton
import triton.language as tl


def _rotate(x, cos, sin):
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rotary_ref(q, k, positions, cos_sin_cache):
    """Rotate q [T, H, D] and k [T, KH, D] in place (views are fine) and return them.

    cos_sin_cache [max_pos, D] fp32 holds cos of the D/2 frequencies, then their sin."""
    cos, sin = cos_sin_cache[positions].unsqueeze(1).chunk(2, dim=-1)
    q.copy_(_rotate(q, cos, sin))
    k.copy_(_rotate(k, cos, sin))
    return q, k


@triton.jit
def _rotate_heads(x_ptr, token, stride_t, stride_h, heads, cos, sin, half, BLOCK_H: tl.constexpr,
                  BLOCK_D: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < half)
    ptr = x_ptr + token * stride_t + h * stride_h + d
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr + half, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cache_ptr, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
                   heads, kv_heads, half, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr,
                   BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)[None, :]
    row = cache_ptr + tl.load(pos_ptr + token) * stride_c
    cos = tl.load(row + d, mask=d < half, other=0.0)
    sin = tl.load(row + half + d, mask=d < half, other=0.0)
    _rotate_heads(q_ptr, token, stride_qt, stride_qh, heads, cos, sin, half, BLOCK_H, BLOCK_D)
    _rotate_heads(k_ptr, token, stride_kt, stride_kh, kv_heads, cos, sin, half, BLOCK_KH, BLOCK_D)


def rotary_triton(q, k, positions, cos_sin_cache):
    """Triton twin of rotary_ref: rotates in place through the strides of q and k
    (the head dim must be unit-stride, e.g. slices of a fused qkv output)."""
    tokens, heads, dim = q.shape
    if tokens:
        _rotary_kernel[(tokens,)](q, k, positions, cos_sin_cache, q.stride(0), q.stride(1), k.stride(0),
                                  k.stride(1), cos_sin_cache.stride(0), heads, k.shape[1], dim // 2,
                                  BLOCK_H=triton.next_power_of_2(heads),
                                  BLOCK_KH=triton.next_power_of_2(k.shape[1]),
                                  BLOCK_D=triton.next_power_of_2(dim // 2))
    return q, k
