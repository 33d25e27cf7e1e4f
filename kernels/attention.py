"""Paged attention over the block-table KV cache, and the KV-cache store (its reference, and the fp8
store helpers of the fused `rope_store` in rotary.py)."""
import functools
import math

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn
LOG2E = math.log2(math.e)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _gather(cache, scale, tables):
    """Every sequence's context from its blocks, dequantised to fp32: [S, blocks * block_size, KH, D]."""
    x = cache[tables].float()
    if scale is not None:
        x = x * scale[tables][:, :, None, :, None]
    return x.flatten(1, 2)


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                        scale, k_scale=None, v_scale=None):
    """Causal attention of the packed queries q [T, H, D] over their paged context.

    Sequence s owns q rows query_start_loc[s]:query_start_loc[s+1]; they are the last
    positions of its seq_lens[s] tokens, all already in the cache. Rows no sequence owns
    come back as zeros. All sequences at once, padded to the longest (the CPU engine's path)."""
    out = torch.zeros_like(q)
    tokens, heads, head_dim = q.shape
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    starts = query_start_loc.long()
    q_lens, seq_lens = starts[1:] - starts[:-1], seq_lens.long()
    if tokens == 0 or int(q_lens.max()) == 0:
        return out
    width = triton.cdiv(int(seq_lens.max()), block_size)
    tables = block_tables[:, :width].long().clamp(0, num_blocks - 1)  # unused entries may be garbage
    k, v = _gather(k_cache, k_scale, tables), _gather(v_cache, v_scale, tables)   # [S, L, KH, D]
    # Slots past a sequence's end hold whatever the memory held (NaN or inf included): masked
    # scores give them weight 0, but 0 * inf is NaN, so they must not reach the product with V.
    in_context = torch.arange(k.shape[1], device=q.device)[None, :] < seq_lens[:, None]
    v = torch.where(in_context[:, :, None, None], v, 0.0)
    i = torch.arange(int(q_lens.max()), device=q.device)
    owned = i[None, :] < q_lens[:, None]                                             # [S, Q]
    rows = (starts[:-1, None] + i).clamp(max=tokens - 1)
    group = heads // kv_heads
    qs = q[rows].float().view(*rows.shape, kv_heads, group, head_dim)               # [S, Q, KH, G, D]
    scores = torch.einsum("sqkgd,slkd->skgql", qs, k) * scale
    pos = seq_lens[:, None] - q_lens[:, None] + i                                    # [S, Q]
    future = torch.arange(k.shape[1], device=q.device)[None, None, :] > pos[:, :, None]
    scores.masked_fill_(future[:, None, None], float("-inf"))
    probs = scores.softmax(-1).nan_to_num_(0.0)  # rows nobody owns mask every key
    attended = torch.einsum("skgql,slkd->sqkgd", probs, v).reshape(*rows.shape, heads, head_dim)
    out[rows[owned]] = attended[owned].to(q.dtype)
    return out


def _quantise(x, cache, scale, blocks):
    if scale is None:
        return x.to(cache.dtype)
    return (x.float() / scale[blocks][:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write k, v [T, KH, D] to slots block * block_size + offset; negative slots are padding."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = _quantise(k[keep], k_cache, k_scale, blocks)
    v_cache[blocks, offsets] = _quantise(v[keep], v_cache, v_scale, blocks)


# ---------------------------------------------------------------- Triton: KV store

@triton.jit
def _e4m3_bits(x):
    """float8_e4m3fn bit pattern (uint8) of fp32 x already clamped to +-448, rounding half to even.

    By hand because the Triton interpreter rounds fp8 casts wrongly; the hardware cast agrees."""
    a = tl.abs(x)
    exp = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)  # subnormals: 2**-6 scale
    y = a * ((130 - exp) << 23).to(tl.float32, bitcast=True)  # a / 2**(exp - 3), exact, in [0, 16]
    m = y.to(tl.int32)
    frac = y - m.to(tl.float32)
    m += ((frac > 0.5) | ((frac == 0.5) & ((m & 1) == 1))).to(tl.int32)
    sign = (x.to(tl.int32, bitcast=True) >> 24) & 0x80
    return (((exp + 6) * 8 + m) | sign).to(tl.uint8)  # a mantissa carry rolls into the exponent


@triton.jit
def _store_one(x, dst_ptr, scale_ptr, mask, FP8: tl.constexpr):
    """Store values x (in registers) to the cache, as e4m3 over their scale when FP8."""
    if FP8:
        x = x.to(tl.float32) / tl.load(scale_ptr, mask=mask, other=1.0)
        tl.store(dst_ptr, _e4m3_bits(tl.minimum(tl.maximum(x, -448.0), 448.0)), mask=mask)
    else:
        tl.store(dst_ptr, x.to(dst_ptr.dtype.element_ty), mask=mask)


def _store_operands(k_cache, v_cache, k_scale, v_scale):
    """(k_cache, v_cache, k_scale, v_scale, fp8) as the kernels calling _store_one take them."""
    assert k_cache.stride() == v_cache.stride()
    if k_scale is None:
        return k_cache, v_cache, k_cache, k_cache, False  # scales never read
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, True  # raw e4m3 bytes


# ---------------------------------------------------------------- Triton: paged attention

@triton.jit
def _attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, qk_scale, kv_heads, stride_qt, stride_qh, stride_os, stride_ls,
        stride_kb, stride_ks, stride_kh, stride_bt, stride_sb,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr,
        PRECISION: tl.constexpr):
    """One (query tile, sequence x kv head, key split). A tile packs BLOCK_M // GROUP query tokens
    times the GROUP query heads that share this kv head, so each K/V tile is loaded once for all.
    Products run in DOT: q's dtype, or fp16 for an fp8 cache (a hardware cast; bf16 is not)."""
    tile, split = tl.program_id(0), tl.program_id(2)
    seq, kv_head = tl.program_id(1) // kv_heads, tl.program_id(1) % kv_heads
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    TOKENS: tl.constexpr = BLOCK_M // GROUP
    rows = tl.arange(0, BLOCK_M)
    i = tile * TOKENS + rows // GROUP
    row_ok = (i < q_len) & (rows < TOKENS * GROUP)
    head = kv_head * GROUP + rows % GROUP
    pos = context + tl.minimum(i, q_len - 1)  # idle rows copy a real row so they stay finite
    token = (q_start + i).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT)

    # keys up to the tile's last query, cut into NUM_SPLITS chunks of whole key tiles
    n_keys = tl.where(tile * TOKENS < q_len, context + tl.minimum((tile + 1) * TOKENS, q_len), 0)
    chunk = tl.cdiv(tl.cdiv(n_keys, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, n_keys)

    m = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a split may mask every key of a row
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_ok = j < hi
        block = tl.load(table + j // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv = block[:, None] * stride_kb + (j % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        k = tl.load(k_ptr + kv, mask=key_ok[:, None], other=0.0).to(DOT)
        v = tl.load(v_ptr + kv, mask=key_ok[:, None], other=0.0).to(DOT)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        if FP8:  # per-block scales factor out of the dot products
            s *= tl.load(k_scale_ptr + block * stride_sb + kv_head, mask=key_ok, other=0.0)[None, :]
        s = tl.where((j[None, :] <= pos[:, None]) & key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        if FP8:
            p *= tl.load(v_scale_ptr + block * stride_sb + kv_head, mask=key_ok, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
        m = m_new

    safe_l = tl.where(l > 0, l, 1.0)
    row = token * (kv_heads * GROUP) + head  # out and partials are [.., T, H, D] contiguous
    tl.store(out_ptr + split * stride_os + row[:, None] * HEAD_DIM + d[None, :],
             (acc / safe_l[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    if NUM_SPLITS > 1:  # log2-sum-exp2 of this split, for the merge
        tl.store(lse_ptr + split * stride_ls + row, tl.where(l > 0, m + tl.log2(safe_l), float("-inf")),
                 mask=row_ok)


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_ps, stride_ls, NUM_SPLITS: tl.constexpr,
                  SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Combine the per-split outputs of one (token, head) row, weighted by their sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + sp * stride_ls + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + sp[:, None] * stride_ps + row * HEAD_DIM + d[None, :],
                   mask=(sp < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def _config(rows, head_dim, itemsize):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `rows` packed query rows per sequence and kv head."""
    if rows <= 64:  # decode / speculative verify: one tile, bound by the K/V reads
        return max(16, triton.next_power_of_2(rows)), (64 if head_dim <= 128 else 32), 4, 3
    if head_dim * itemsize <= 256:  # the best of a sweep on an H200 for bf16, head dim 128 (docs/benchmarks.md)
        return 128, 32, 4, 3
    return 64, 32, 4, 2


@functools.lru_cache
def _sm_count(device):
    return torch.cuda.get_device_properties(device).multi_processor_count


def _num_splits(programs, max_query_len, max_context, device):
    """Split the keys (flash-decoding) when a decode-shaped launch would leave SMs idle.

    Only host values: the grid must stay fixed for CUDA graphs; each split then takes an
    equal share of its own sequence's keys inside the kernel. Each split keeps at least 128 keys."""
    if device.type != "cuda" or max_query_len > 16:
        return 1
    return max(1, min(32, 2 * _sm_count(device) // programs, max_context // 128))


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                           scale, k_scale=None, v_scale=None):
    """Triton twin of paged_attention_ref. Rows no sequence owns are left unspecified."""
    tokens, heads, head_dim = q.shape
    num_seqs, block_size, kv_heads = seq_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    block_m, block_n, warps, stages = _config(group * max_query_len, head_dim, q.element_size())
    assert group <= block_m, f"{group} query heads per kv head is more than one tile"
    q_tiles = triton.cdiv(max_query_len, block_m // group)
    splits = _num_splits(num_seqs * kv_heads * q_tiles, max_query_len, block_tables.shape[1] * block_size,
                         q.device)
    dest = out if splits == 1 else torch.empty((splits, tokens, heads, head_dim), dtype=torch.float32,
                                               device=q.device)
    lse = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device) if splits > 1 else dest
    fp8 = k_scale is not None
    dot = tl.float16 if fp8 and q.element_size() == 2 else _TL_DTYPES[q.dtype]
    _attention_kernel[(q_tiles, num_seqs * kv_heads, splits)](
        q, k_cache, v_cache, dest, lse, k_scale if fp8 else q, v_scale if fp8 else q, block_tables, seq_lens,
        query_start_loc, scale * LOG2E, kv_heads, q.stride(0), q.stride(1), tokens * heads * head_dim,
        tokens * heads, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        k_scale.stride(0) if fp8 else 0, GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, FP8=fp8, DOT=dot,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge_kernel[(tokens * heads,)](dest, lse, out, tokens * heads * head_dim, tokens * heads,
                                         NUM_SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits),
                                         HEAD_DIM=head_dim)
    return out
