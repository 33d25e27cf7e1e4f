"""Rotary position embedding, non-interleaved (HF rotate_half) convention, and the fused attention
prologue of a decoder layer (q/k RMSNorm, rotary, KV store) in one launch."""
import torch
import triton
import triton.language as tl

from . import pdl
from .attention import _store_heads, _store_operands, store_kv_ref
from .norm import rms_norm_ref


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


def _head_norm(x, weight, eps):
    return rms_norm_ref(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def rope_store_ref(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None,
                   v_scale=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """rms_norm_ref over each head of q and of k where their weights are given (Qwen3), then
    rotary_ref, then store_kv_ref of the rotated k and of v. q [T, H, D] is updated in place and
    returned; k and v are left as given (the rotated k lives only in the cache)."""
    if q_norm_weight is not None:
        q.copy_(_head_norm(q, q_norm_weight, eps))
    k = _head_norm(k, k_norm_weight, eps) if k_norm_weight is not None else k.clone()
    rotary_ref(q, k, positions, cos_sin_cache)
    store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    return q


@triton.jit
def _rotated(ptr, mask, cos, sin, half, w_ptr, eps, NORM: tl.constexpr, BLOCK_D: tl.constexpr):
    """The heads at ptr (first halves [BLOCK_H, BLOCK_D], second halves at ptr + half), RMS-normed
    with weight w when NORM, then rotated; both halves rounded to their dtype. Every rounding is
    where rms_norm_ref and rotary_ref round."""
    dtype = ptr.dtype.element_ty
    x1 = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr + half, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.rsqrt((tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * half) + eps)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        w1 = tl.load(w_ptr + d, mask=d < half, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + half + d, mask=d < half, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def _cos_sin(pos_ptr, cache_ptr, token, stride_c, half, BLOCK_D: tl.constexpr):
    d = tl.arange(0, BLOCK_D)[None, :]
    row = cache_ptr + tl.load(pos_ptr + token) * stride_c
    return tl.load(row + d, mask=d < half, other=0.0), tl.load(row + half + d, mask=d < half, other=0.0)


@triton.jit
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                       k_scale_ptr, v_scale_ptr, q_w_ptr, k_w_ptr, eps, heads, kv_heads, half, block_size,
                       stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_c,
                       stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                       Q_NORM: tl.constexpr, K_NORM: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_KH: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """One token: q normed and rotated in place, k normed, rotated and stored with v in its slot."""
    pdl.wait_previous(PDL)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)  # first: its latency hides behind q's work
    cos, sin = _cos_sin(pos_ptr, cos_sin_ptr, token, stride_c, half, BLOCK_D)
    d = tl.arange(0, BLOCK_D)[None, :]
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < heads) & (d < half)
    q = q_ptr + token * stride_qt + h * stride_qh + d
    q1, q2 = _rotated(q, mask, cos, sin, half, q_w_ptr, eps, Q_NORM, BLOCK_D)
    tl.store(q, q1, mask=mask)
    tl.store(q + half, q2, mask=mask)

    if slot >= 0:  # negative slots are padding tokens
        kh = tl.arange(0, BLOCK_KH)[:, None]
        kv_mask = (kh < kv_heads) & (d < half)
        k1, k2 = _rotated(k_ptr + token * stride_kt + kh * stride_kh + d, kv_mask, cos, sin, half, k_w_ptr, eps,
                          K_NORM, BLOCK_D)
        v = v_ptr + token * stride_vt + kh * stride_vh + d
        v1, v2 = tl.load(v, mask=kv_mask, other=0.0), tl.load(v + half, mask=kv_mask, other=0.0)
        block, offset = slot // block_size, slot % block_size
        dst = block * stride_cb + offset * stride_cs + kh * stride_ch + d
        scale = block * stride_sb + offset * stride_ss + kh
        _store_heads(k1, k2, k_cache_ptr + dst, half, k_scale_ptr + scale, kv_mask, kh < kv_heads, FP8)
        _store_heads(v1, v2, v_cache_ptr + dst, half, v_scale_ptr + scale, kv_mask, kh < kv_heads, FP8)


def rope_store_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale=None,
                      v_scale=None, q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """Triton twin of rope_store_ref in one launch (up to four unfused): one program per token for all
    its heads. q, k, v may be strided views (of a fused qkv output); their head dims must be unit-stride."""
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1
    k_cache, v_cache, k_scale, v_scale, fp8 = _store_operands(k_cache, v_cache, k_scale, v_scale)
    tokens, heads, dim = q.shape
    if tokens:  # a missing norm weight's pointer is never read: q or k stands in
        _rope_store_kernel[(tokens,)](
            q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
            q if q_norm_weight is None else q_norm_weight, k if k_norm_weight is None else k_norm_weight, eps,
            heads, k.shape[1], dim // 2, k_cache.shape[1], q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos_sin_cache.stride(0), *k_cache.stride()[:3],
            *(k_scale.stride()[:2] if fp8 else (0, 0)), Q_NORM=q_norm_weight is not None,
            K_NORM=k_norm_weight is not None, FP8=fp8, BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_KH=triton.next_power_of_2(k.shape[1]), BLOCK_D=triton.next_power_of_2(dim // 2),
            **pdl.options(q.device, tokens))
    return q
