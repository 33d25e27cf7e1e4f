"""A decoder layer's attention prologue and attention at one row (batch-1 decode) in one launch.

`rope_store_attention` is rope_store (q/k RMSNorm, rotary, K/V into their slots) then paged_attention (and
its split merge). At one row every attention program rotates its query heads from the qkv projection's output
itself, and the program whose keys include the step's own stores that key and value where rope_store would:
the rope_store launch, and its wait for the projection, are gone. Its older keys load before the wait for the
projection, as a one-row paged_attention's do (_older_keys_ahead). Elsewhere (two rows on, batch-invariant mode, the
CPU) the two ops run one after the other."""
import torch
import triton
import triton.language as tl

from . import attention, pdl
from .attention import (LOG2E, _TL_DTYPES, _attend, _chunk_result, _empty_state, _older_keys_ahead, _softmax_tile,
                        _store_heads, _store_operands, _with_step_keys)
from .rotary import _cos_sin, _rotated

# Whether one row takes the fused launch; False runs rope_store then paged_attention, for comparisons. Read
# at each call, so set it before an engine captures its CUDA graphs.
FUSED_ROPE = True


def composed(rope_store, paged_attention):
    """rope_store_attention as the two ops it stands for (each a reference, a Triton twin, or a partial). q's
    contents afterwards are unspecified (rope_store rotates them in place; the one launch leaves them)."""
    def rope_store_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                             seq_lens, query_start_loc, max_query_len, scale, k_scale=None, v_scale=None,
                             q_norm_weight=None, k_norm_weight=None, eps=1e-6, shared=None):
        q = rope_store(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                       q_norm_weight, k_norm_weight, eps)
        return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                               k_scale, v_scale, **({} if shared is None else {"shared": shared}))
    return rope_store_attention


def with_fused_attention(ops: dict, fused: bool) -> dict:
    """ops | rope_store_attention: composed from ops' rope_store and paged_attention; with `fused` (Triton on
    CUDA, outside batch-invariant mode) one row takes the one-launch kernel."""
    both = composed(ops["rope_store"], ops["paged_attention"])
    if not fused:
        return ops | {"rope_store_attention": both}

    def rope_store_attention(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                             seq_lens, query_start_loc, max_query_len, scale, k_scale=None, v_scale=None,
                             q_norm_weight=None, k_norm_weight=None, eps=1e-6, shared=None):
        args = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables, seq_lens,
                query_start_loc, max_query_len, scale, k_scale, v_scale, q_norm_weight, k_norm_weight, eps)
        if shared is None and takes_fused(q, seq_lens, max_query_len):
            return rope_store_attention_triton(*args)
        return both(*args, shared=shared)
    return ops | {"rope_store_attention": rope_store_attention}


def takes_fused(q, seq_lens, max_query_len) -> bool:
    """One query row of one sequence, a power-of-two head size the tile holds whole, FUSED_ROPE on."""
    head_dim = q.shape[2]
    return (FUSED_ROPE and q.shape[0] == 1 and seq_lens.shape[0] == 1 and max_query_len == 1
            and head_dim == triton.next_power_of_2(head_dim) and q.stride(2) == 1)


@triton.jit
def _store_step_key(k_ptr, v_ptr, k_store_ptr, v_store_ptr, k_scale_ptr, v_scale_ptr, k_w_ptr, slot, kv_head, cos,
                    sin, half, eps, stride_kh, stride_vh, stride_cb, stride_cs, stride_ch, stride_sb, stride_ss,
                    BLOCK_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, K_NORM: tl.constexpr, FP8: tl.constexpr):
    """This kv head's k (normed, rotated) and v of the step into `slot`, computed and stored as rope_store does."""
    d = tl.arange(0, BLOCK_D)[None, :]
    head = kv_head + tl.zeros([1, 1], tl.int32)
    mask = d < half
    k1, k2 = _rotated(k_ptr + kv_head * stride_kh + d, mask, cos, sin, half, k_w_ptr, eps, K_NORM, BLOCK_D)
    v = v_ptr + kv_head * stride_vh + d
    v1, v2 = tl.load(v, mask=mask, other=0.0), tl.load(v + half, mask=mask, other=0.0)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    dst = block * stride_cb + offset * stride_cs + head * stride_ch + d
    scale = block * stride_sb + offset * stride_ss + head
    _store_heads(k1, k2, k_store_ptr + dst, half, k_scale_ptr + scale, mask, head >= 0, FP8)
    _store_heads(v1, v2, v_store_ptr + dst, half, v_scale_ptr + scale, mask, head >= 0, FP8)


@triton.jit
def _rope_attention_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, cos_sin_ptr, slot_ptr, q_w_ptr, k_w_ptr, eps, k_cache_ptr, v_cache_ptr,
        k_store_ptr, v_store_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr, table, seq_lens_ptr, qk_scale, half,
        stride_qh, stride_kh, stride_vh, stride_c, stride_kb, stride_ks, stride_kh_cache, stride_sb, stride_ss,
        stride_os, stride_ls, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
        Q_NORM: tl.constexpr, K_NORM: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr):
    """One (kv head, key split) of the one query row: _attention_kernel's CHUNK 0 program with FIRST_AHEAD,
    whose queries are rotated here from the projection's output and whose step key this program stores when
    the key is in its split. The step's position and slot, the rotary table and the older keys load before the
    wait for the projection; the merge of the splits is _merge_kernel's."""
    kv_head, split = tl.program_id(0), tl.program_id(1)
    n_keys = tl.load(seq_lens_ptr)
    context = n_keys - 1
    chunk = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    slot = tl.load(slot_ptr)
    cos, sin = _cos_sin(pos_ptr, cos_sin_ptr, 0, stride_c, half, BLOCK_D)
    j, key_ok, kv, scale_at, k, v, k_scale, v_scale = _older_keys_ahead(
        k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, table, lo, hi, context, kv_head, stride_kb, stride_ks,
        stride_kh_cache, stride_sb, stride_ss, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8)
    pdl.wait_previous(PDL)
    if (context >= lo) & (context < hi) & (slot >= 0):
        _store_step_key(k_ptr, v_ptr, k_store_ptr, v_store_ptr, k_scale_ptr, v_scale_ptr, k_w_ptr, slot, kv_head,
                        cos, sin, half, eps, stride_kh, stride_vh, stride_kb, stride_ks, stride_kh_cache, stride_sb,
                        stride_ss, BLOCK_SIZE, BLOCK_D, K_NORM, FP8)
        tl.debug_barrier()  # the stores before any thread of the program loads the key back
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP
    head = kv_head * GROUP + rows
    d = tl.arange(0, BLOCK_D)[None, :]
    q1, q2 = _rotated(q_ptr + head[:, None] * stride_qh + d, row_ok[:, None] & (d < half), cos, sin, half, q_w_ptr,
                      eps, Q_NORM, BLOCK_D)
    q = tl.reshape(tl.permute(tl.join(q1, q2), (0, 2, 1)), (BLOCK_M, HEAD_DIM)).to(DOT)  # [first half, second]
    k, v, k_scale, v_scale = _with_step_keys(k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at,
                                             key_ok & (j >= context), k, v, k_scale, v_scale, FP8)
    pos = context + tl.zeros([BLOCK_M], tl.int32)
    m, l, acc = _empty_state(BLOCK_M, HEAD_DIM)
    m, l, acc = _softmax_tile(q, k, v, k_scale, v_scale, j, key_ok, pos, m, l, acc, qk_scale, FP8, DOT, PRECISION)
    m, l, acc = _attend(q, lo + BLOCK_N, hi, pos, m, l, acc, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
                        table, kv_head, qk_scale, stride_kb, stride_ks, stride_kh_cache, stride_sb, stride_ss,
                        HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8, DOT, PRECISION)
    part, lse = _chunk_result(m, l, acc)
    dh = tl.arange(0, HEAD_DIM)
    tl.store(out_ptr + split * stride_os + head[:, None] * HEAD_DIM + dh[None, :], part.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None])
    if NUM_SPLITS > 1:
        tl.store(lse_ptr + split * stride_ls + head, lse, mask=row_ok)


def rope_store_attention_triton(q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping, block_tables,
                                seq_lens, query_start_loc, max_query_len, scale, k_scale=None, v_scale=None,
                                q_norm_weight=None, k_norm_weight=None, eps=1e-6):
    """The one-launch rope_store + paged_attention of one query row (takes_fused); q, k, v: [1, heads, D]
    views of the qkv output, left as given (the rotated q lives only in the kernel)."""
    _, heads, head_dim = q.shape
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    assert k.stride(2) == v.stride(2) == 1 and k_cache.stride(3) == 1
    k_store, v_store, k_scale_arg, v_scale_arg, fp8 = _store_operands(k_cache, v_cache, k_scale, v_scale)
    block_m, block_n, warps, stages = attention._config(group, head_dim, q.element_size(), fp8)
    assert group <= block_m, f"{group} query heads per kv head is more than one tile"
    splits = attention._num_splits(kv_heads, 1, block_tables.shape[1] * block_size, q.device)
    out = torch.empty((1, heads, head_dim), dtype=q.dtype, device=q.device)
    dest = out if splits == 1 else torch.empty((splits, 1, heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits, 1, heads), dtype=torch.float32, device=q.device) if splits > 1 else dest
    on_pdl = pdl.options(q.device, 1)
    _rope_attention_kernel[(kv_heads, splits)](
        q, k, v, positions, cos_sin_cache, slot_mapping, q if q_norm_weight is None else q_norm_weight,
        k if k_norm_weight is None else k_norm_weight, eps, k_cache, v_cache, k_store, v_store, k_scale_arg,
        v_scale_arg, dest, lse, block_tables, seq_lens, scale * LOG2E, head_dim // 2, q.stride(1), k.stride(1),
        v.stride(1), cos_sin_cache.stride(0), *k_cache.stride()[:3], *(k_scale.stride()[:2] if fp8 else (0, 0)),
        heads * head_dim, heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=head_dim // 2, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, Q_NORM=q_norm_weight is not None,
        K_NORM=k_norm_weight is not None, FP8=fp8,
        DOT=tl.float16 if fp8 and q.element_size() == 2 else _TL_DTYPES[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages, **on_pdl)
    if splits > 1:
        attention._merge_kernel[(heads,)](dest, lse, out, heads * head_dim, heads, NUM_SPLITS=splits,
                                          SPLITS_POW2=triton.next_power_of_2(splits), HEAD_DIM=head_dim, **on_pdl)
    return out
