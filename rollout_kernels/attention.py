"""Paged attention over the block-table KV cache, and the KV-cache store (its reference, and the fp8
store helpers of the fused `rope_store` in rotary.py)."""
import math

import torch
import triton
import triton.language as tl

from . import pdl
from .launch import interpreted, sm_count

FP8_MAX = 448.0  # largest finite float8_e4m3fn
MIN_AMAX = 1e-12  # an all-zero tensor (or KV head) gets a tiny positive scale: its values quantize to 0
LOG2E = math.log2(math.e)
_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}
# fixed_split=True (batch-invariant mode): one query's keys are reduced in chunks of FIXED_SPLIT_KEYS at
# fixed positions, under one tile shape (BLOCK_M, BLOCK_N, num_warps, num_stages) in every launch of a model: the
# decode shape of _config, since decode is most of a rollout (a prefill then packs fewer queries per tile), with
# BLOCK_M widened to hold one token's query heads where a kv head has more than 16.
FIXED_SPLIT_KEYS = 256
# Whether a one-row paged_attention launch loads its first key tile before the previous kernel's end
# (FIRST_AHEAD in _attention_kernel); False loads it after the wait, for comparisons. The engine's batch-1
# step takes decode_attention's one launch instead, which always loads ahead (off: FUSED_ROPE there). Read at
# each launch, so set it before an engine captures its CUDA graphs.
FIRST_TILE_AHEAD = True
FIXED_TILE = (16, 64, 4, 3)
FIXED_REF_ROWS = 32      # the torch twin's fixed split takes query rows in padded blocks of this many


def _gather(cache, scale, tables):
    """Every sequence's context from its blocks, dequantised to fp32: [S, blocks * block_size, KH, D]."""
    x = cache[tables].float()
    if scale is not None:
        x = x * scale[tables][..., None]
    return x.flatten(1, 2)


def paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                        scale, k_scale=None, v_scale=None, fixed_split=False, shared=None):
    """Causal attention of the packed queries q [T, H, D] over their paged context.

    Sequence s owns q rows query_start_loc[s]:query_start_loc[s+1]; they are the last
    positions of its seq_lens[s] tokens, all already in the cache. Rows no sequence owns
    come back as zeros. All sequences at once, padded to the longest (the CPU engine's path);
    fixed_split: each row alone, in fixed shapes (_fixed_split_ref). `shared` changes only how the Triton twin
    reads the keys (a shared prefix once a group), not the result, so it is not read here."""
    if fixed_split:
        return _fixed_split_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale)
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
    probs = scores.softmax(-1)  # an owned row sees key 0 at least: NaN here is a NaN query or key, and stays
    attended = torch.einsum("skgql,slkd->sqkgd", probs, v).reshape(*rows.shape, heads, head_dim)
    out[rows[owned]] = attended[owned].to(q.dtype)
    return out


def _gather_keys(cache, scale, blocks, offsets):
    """The keys (or values) at blocks [R, C] and offsets [C], dequantised to fp32: [R, C, KH, D]."""
    x = cache[blocks, offsets[None, :]].float()
    return x if scale is None else x * scale[blocks, offsets[None, :]][..., None]


def _row_positions(seq_lens, query_start_loc):
    """(token, sequence, position) of every query row a sequence owns."""
    starts, seq_lens = query_start_loc.long(), seq_lens.long()
    q_lens = starts[1:] - starts[:-1]
    seqs = torch.repeat_interleave(torch.arange(len(q_lens), device=starts.device), q_lens)
    token = starts[seqs] + torch.arange(len(seqs), device=starts.device) - (q_lens.cumsum(0) - q_lens)[seqs]
    return token, seqs, seq_lens[seqs] - q_lens[seqs] + token - starts[seqs]


def _fold_ref(state, part, lse):
    """_fold's recurrence in natural-log units (m starts at -1e30): a chunk without keys changes nothing; a NaN
    chunk makes the row NaN."""
    o, m, l = state
    take = lse != float("-inf")
    m_new = torch.where(take, torch.maximum(m, lse), m)
    a = torch.exp(m - m_new)
    b = torch.exp(lse - m_new)
    return torch.where(take[..., None], o * a[..., None] + part * b[..., None], o), m_new, torch.where(take, l * a + b, l)


def _fixed_split_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale):
    """paged_attention_ref with fixed_split: rows in padded blocks of FIXED_REF_ROWS, keys in chunks of
    FIXED_SPLIT_KEYS at fixed positions, every op on [FIXED_REF_ROWS, KH, G, FIXED_SPLIT_KEYS]-shaped
    tensors and the chunks folded in order, so a row's bits depend on nothing else in the launch."""
    out = torch.zeros_like(q)
    heads, head_dim = q.shape[1:]
    num_blocks, block_size, kv_heads = k_cache.shape[:3]
    token, seqs, pos = _row_positions(seq_lens, query_start_loc)
    keys = torch.arange(FIXED_SPLIT_KEYS, device=q.device)
    for first in range(0, len(token), FIXED_REF_ROWS):
        rows = torch.arange(first, first + FIXED_REF_ROWS, device=q.device).clamp(max=len(token) - 1)
        t, s, p = token[rows], seqs[rows], pos[rows]
        qs = q[t].float().view(FIXED_REF_ROWS, kv_heads, heads // kv_heads, head_dim)
        state = (torch.zeros_like(qs), torch.full(qs.shape[:3], -1.0e30, device=q.device),
                 torch.zeros(qs.shape[:3], device=q.device))
        for lo in range(0, int(p.max()) + 1, FIXED_SPLIT_KEYS):
            j = lo + keys
            blocks = block_tables[s[:, None], (j // block_size).clamp(max=block_tables.shape[1] - 1)]
            blocks = blocks.long().clamp(0, num_blocks - 1)                        # [R, C]: each key's block
            k, v = (_gather_keys(c, sc, blocks, j % block_size) for c, sc in ((k_cache, k_scale), (v_cache, v_scale)))
            seen = j[None, :] <= p[:, None]                                        # [R, C]
            v = torch.where(seen[:, :, None, None], v, 0.0)  # masked slots may hold inf or NaN
            scores = torch.einsum("rkgd,rckd->rkgc", qs, k) * scale
            scores = scores.masked_fill(~seen[:, None, None, :], float("-inf"))
            m = scores.amax(-1)
            e = torch.exp(scores - torch.where(m > float("-inf"), m, 0.0)[..., None])
            l = e.sum(-1)
            kept = l != 0  # no key in the chunk: l is 0; a NaN query or key: l is NaN, and the row goes NaN
            part = torch.einsum("rkgc,rckd->rkgd", e, v) / torch.where(kept, l, 1.0)[..., None]
            state = _fold_ref(state, part, torch.where(kept, m + torch.log(torch.where(kept, l, 1.0)),
                                                       float("-inf")))
        o, _, l = state
        done = (o / torch.where(l != 0, l, 1.0)[..., None]).reshape(FIXED_REF_ROWS, heads, head_dim)
        out[t[: len(token) - first]] = done[: len(token) - first].to(q.dtype)
    return out


def amax_scale(amax: torch.Tensor) -> torch.Tensor:
    """The e4m3 scale of values whose max|x| is `amax` (float32): max(amax, MIN_AMAX) / 448; NaN where amax is
    NaN or inf (values holding one), so every value dequantizes to NaN and nothing downstream reads as finite."""
    amax = amax.float()
    amax = torch.where(torch.isfinite(amax), amax.clamp(min=MIN_AMAX), float("nan"))
    # a tensor divisor: torch on CUDA multiplies by the reciprocal of a Python-number divisor (1 ulp off the
    # quotient the Triton kernels' div_rn gives)
    return amax / torch.full_like(amax, FP8_MAX)


def _head_scales(x):
    """The scale of each (token, kv head) of x [T, KH, D]: float32 [T, KH]."""
    return amax_scale(x.float().abs().amax(-1))


def _quantise(x, cache, scale, blocks, offsets):
    """x in the cache's dtype; for a 1-byte cache, e4m3 over each head's own scale, written to `scale`."""
    if scale is None:
        return x.to(cache.dtype)
    head_scale = _head_scales(x)
    scale[blocks, offsets] = head_scale
    return (x.float() / head_scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(cache.dtype)


def store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scale=None, v_scale=None):
    """Write k, v [T, KH, D] to slots block * block_size + offset; negative slots are padding. A 1-byte cache
    holds each (token, kv head) as e4m3 over its own scale, max|x| / 448, written to k_scale / v_scale
    [blocks, block_size, KH] at the same slot."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[blocks, offsets] = _quantise(k[keep], k_cache, k_scale, blocks, offsets)
    v_cache[blocks, offsets] = _quantise(v[keep], v_cache, v_scale, blocks, offsets)


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


# Compiled, the hardware's round-half-even cast gives _e4m3_bits's bits in one instruction instead of about
# twenty: the casts of activations and KV stores run that per value.
_HARDWARE_E4M3 = tl.constexpr(not interpreted())
_MIN_AMAX = tl.constexpr(MIN_AMAX)


@triton.jit
def _e4m3(x):
    """float8_e4m3fn bit pattern (uint8) of fp32 x already clamped to +-448, rounding half to even."""
    if _HARDWARE_E4M3:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    return _e4m3_bits(x)


@triton.jit
def _fp16_of_e4m3(bits):
    """fp16 values of e4m3 bit patterns (uint8), four at a time: the same cvt as `.to(tl.float16)`.

    The V tile converts here because the conversion is opaque to Triton: with a plain cast Triton moves the
    tile's dot-operand layout above it, so each thread gathers its transposed e4m3 values from shared memory
    a byte at a time (128 byte loads a tile); an asm statement with side effects keeps the layout change
    after the cast, where ldmatrix transposes 16-bit values. Register use falls from 242 to 192 a thread
    (sm_90, Triton 3.6), and 1.7B-shaped decode attention over an fp8 cache runs 6-10% faster on an H200."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r", [bits], dtype=tl.float16, is_pure=False, pack=4)


@triton.jit
def _magnitude(v):
    """|v| for a running max, a NaN read as inf: Triton's max drops NaNs, which would leave a scale finite."""
    a = tl.abs(v)
    return tl.where(a == a, a, float("inf"))


@triton.jit
def _scale_of_amax(amax, min_amax):
    """amax_scale of a max of _magnitude values: inf there (a NaN or inf among them) gives a NaN scale."""
    return tl.where(amax == float("inf"), float("nan"), tl.math.div_rn(tl.maximum(amax, min_amax), 448.0))


@triton.jit
def _cast(v, scale):
    """e4m3 bits of v / scale (IEEE division, as the references'), clamped to the format."""
    return _e4m3(tl.minimum(tl.maximum(tl.math.div_rn(v, scale), -448.0), 448.0))


@triton.jit
def _store_heads(x1, x2, dst_ptr, half, scale_ptr, mask, head_ok, FP8: tl.constexpr):
    """Store heads [BLOCK_KH, BLOCK_D] (in registers, their two halves x1 and x2) at dst_ptr and dst_ptr + half.
    FP8: as e4m3 over each head's own scale, max|x| / 448 (store_kv_ref's), written to scale_ptr [BLOCK_KH, 1].
    A head holding NaN or inf gets a NaN scale, so it reads back as NaN as the reference's does."""
    if FP8:
        a1 = tl.where(mask, _magnitude(x1.to(tl.float32)), 0.0)
        a2 = tl.where(mask, _magnitude(x2.to(tl.float32)), 0.0)
        scale = _scale_of_amax(tl.max(tl.maximum(a1, a2), 1), _MIN_AMAX)[:, None]
        tl.store(scale_ptr, scale, mask=head_ok)
        tl.store(dst_ptr, _cast(x1.to(tl.float32), scale), mask=mask)
        tl.store(dst_ptr + half, _cast(x2.to(tl.float32), scale), mask=mask)
    else:
        tl.store(dst_ptr, x1.to(dst_ptr.dtype.element_ty), mask=mask)
        tl.store(dst_ptr + half, x2.to(dst_ptr.dtype.element_ty), mask=mask)


def _store_operands(k_cache, v_cache, k_scale, v_scale):
    """(k_cache, v_cache, k_scale, v_scale, fp8) as the kernels calling _store_heads take them."""
    assert k_cache.stride() == v_cache.stride()
    if k_scale is None:
        return k_cache, v_cache, k_cache, k_cache, False  # scales never read
    assert k_scale.stride() == v_scale.stride() and k_scale.shape == k_cache.shape[:3]
    return k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, True  # raw e4m3 bytes


# ---------------------------------------------------------------- Triton: paged attention

@triton.jit
def _tile_rows(query_start_loc_ptr, seq_lens_ptr, tile, seq, kv_head, GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The packed rows of one query tile: (row_ok, token, head, pos, n_keys, context). A tile packs
    BLOCK_M // GROUP query tokens times the GROUP query heads sharing this kv head; n_keys: the keys
    up to the tile's last query; context: the keys before this step's (which the step writes first)."""
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    context = tl.load(seq_lens_ptr + seq) - q_len
    TOKENS: tl.constexpr = BLOCK_M // GROUP
    rows = tl.arange(0, BLOCK_M)
    i = tile * TOKENS + rows // GROUP
    row_ok = (i < q_len) & (rows < TOKENS * GROUP)
    pos = context + tl.minimum(i, q_len - 1)  # idle rows copy a real row so they stay finite
    n_keys = tl.where(tile * TOKENS < q_len, context + tl.minimum((tile + 1) * TOKENS, q_len), 0)
    return row_ok, (q_start + i).to(tl.int64), kv_head * GROUP + rows % GROUP, pos, n_keys, context


@triton.jit
def _kv_at(j, block, kv_head, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM: tl.constexpr,
           BLOCK_SIZE: tl.constexpr):
    """Offsets of keys j (in pages `block`): of their K/V rows [BLOCK_N, HEAD_DIM] and of their scales."""
    d = tl.arange(0, HEAD_DIM)
    kv = block[:, None] * stride_kb + (j % BLOCK_SIZE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
    return kv, block * stride_sb + (j % BLOCK_SIZE) * stride_ss + kv_head  # each key's own scales


@triton.jit
def _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at, load, FP8: tl.constexpr, CACHE: tl.constexpr):
    """The raw K and V rows (and, FP8, their scales) of the keys where `load`; zeros elsewhere. CACHE: the
    loads' cache modifier."""
    k = tl.load(k_ptr + kv, mask=load[:, None], other=0.0, cache_modifier=CACHE)
    v = tl.load(v_ptr + kv, mask=load[:, None], other=0.0, cache_modifier=CACHE)
    if FP8:
        k_scale = tl.load(k_scale_ptr + scale_at, mask=load, other=0.0, cache_modifier=CACHE)
        v_scale = tl.load(v_scale_ptr + scale_at, mask=load, other=0.0, cache_modifier=CACHE)
    else:
        k_scale = 0.0
        v_scale = 0.0
    return k, v, k_scale, v_scale


@triton.jit
def _softmax_tile(q, k, v, k_scale, v_scale, j, key_ok, pos, m, l, acc, qk_scale, FP8: tl.constexpr,
                  DOT: tl.constexpr, PRECISION: tl.constexpr):
    """The running (max, sum, unnormalised output) of the rows q after one tile of keys j, in log2 units."""
    k = k.to(DOT)
    v = (_fp16_of_e4m3(v.to(tl.uint8, bitcast=True)) if FP8 and _HARDWARE_E4M3 else v).to(DOT)  # fp32 queries: DOT is fp32
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if FP8:  # each key's scales factor out of the dot products
        s *= k_scale[None, :]
    s = tl.where((j[None, :] <= pos[:, None]) & key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m - m_new)
    l = l * alpha + tl.sum(p, 1)
    if FP8:  # the tile's largest value scale factors out: p times the others' ratios to it stays in (0, 1],
        # clear of fp16's subnormals (values scaled by max|v| / 448 of a small head are far below them)
        v_top = tl.maximum(tl.max(v_scale, 0), 1e-30)
        acc = acc * alpha[:, None] + tl.dot((p * (v_scale / v_top)[None, :]).to(DOT), v,
                                            input_precision=PRECISION) * v_top
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT), v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _empty_state(BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
    """(max, sum, output) before any key: the max is finite, as a split may mask every key of a row."""
    return (tl.full([BLOCK_M], -1.0e30, tl.float32), tl.zeros([BLOCK_M], tl.float32),
            tl.zeros([BLOCK_M, HEAD_DIM], tl.float32))


@triton.jit
def _attend(q, lo, hi, pos, m, l, acc, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table, kv_head, qk_scale,
            stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr,
            PRECISION: tl.constexpr):
    """Online softmax of the query rows q over keys [lo, hi) (causal: key j only for rows at pos >= j),
    BLOCK_N keys at a time from lo, continuing the running (m, l, acc)."""
    # An fp8 cache loads each tile's pages one tile ahead: its K/V addresses then do not wait on a page-table
    # load of their own iteration, and the pipeliner overlaps the next tile's copies with this tile's math
    # (0.91-0.94x the kernel's time on an H200). A bf16 tile, twice the bytes a key, is bandwidth-bound either
    # way, and ran slower so at 64 x 4k keys (1.19x), so it loads its pages in its own iteration.
    AHEAD: tl.constexpr = FP8
    if AHEAD:
        first = lo + tl.arange(0, BLOCK_N)
        next_block = tl.load(table + first // BLOCK_SIZE, mask=first < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        key_ok = j < hi
        if AHEAD:
            block = next_block
            next_block = tl.load(table + (j + BLOCK_N) // BLOCK_SIZE, mask=j + BLOCK_N < hi, other=0).to(tl.int64)
        else:
            block = tl.load(table + j // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        kv, scale_at = _kv_at(j, block, kv_head, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM,
                              BLOCK_SIZE)
        k, v, k_scale, v_scale = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at, key_ok, FP8, "")
        m, l, acc = _softmax_tile(q, k, v, k_scale, v_scale, j, key_ok, pos, m, l, acc, qk_scale, FP8, DOT,
                                  PRECISION)
    return m, l, acc


@triton.jit
def _chunk_result(m, l, acc):
    """A chunk's normalised output and its log2-sum-exp2 (-inf where the chunk held no key of a row: l is 0; a NaN
    query or key makes l NaN, which stays)."""
    safe_l = tl.where(l != 0, l, 1.0)
    return acc / safe_l[:, None], tl.where(l != 0, m + tl.log2(safe_l), float("-inf"))


@triton.jit
def _fold(o, m, l, part, lse):
    """Fold one chunk (part, lse) into the running (o, m, l) of a row (m starts at -1e30: finite, so no
    inf - inf); a chunk without keys (lse -inf) changes nothing, a NaN one makes the row NaN.
    The fixed-split path's only merge: in-program and across programs alike, chunk after chunk."""
    take = lse != float("-inf")
    m_new = tl.where(take, tl.maximum(m, lse), m)
    a = tl.exp2(m - m_new)  # 0 for the first chunk folded: m starts at -1e30
    b = tl.exp2(lse - m_new)
    return tl.where(take[:, None], o * a[:, None] + part * b[:, None], o), m_new, tl.where(take, l * a + b, l)


@triton.jit
def _older_keys_ahead(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table, lo, hi, context, kv_head, stride_kb, stride_ks,
                      stride_kh, stride_sb, stride_ss, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                      BLOCK_N: tl.constexpr, FP8: tl.constexpr):
    """The first key tile [lo, lo + BLOCK_N) as far as it can load before the wait for the previous kernel:
    (j, key_ok, kv, scale_at, k, v, k_scale, v_scale) with the keys before `context` (earlier steps' writes)
    loaded; _with_step_keys adds the step's own after the wait. The page table is the step's upload. These
    loads skip L1 (.cg): an fp8 cache's scales of several slots share a 32-byte sector, and a sector cached
    before the wait would hold the step's key's old scale for the loads after it."""
    j = lo + tl.arange(0, BLOCK_N)
    key_ok = j < hi
    block = tl.load(table + j // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
    kv, scale_at = _kv_at(j, block, kv_head, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM,
                          BLOCK_SIZE)
    k, v, k_scale, v_scale = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at, key_ok & (j < context),
                                      FP8, ".cg")
    return j, key_ok, kv, scale_at, k, v, k_scale, v_scale


@triton.jit
def _with_step_keys(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at, new, k, v, k_scale, v_scale,
                    FP8: tl.constexpr):
    """The tile of _older_keys_ahead with the keys `new` (the step's, after the wait) loaded in their place."""
    k_new, v_new, k_scale_new, v_scale_new = _load_kv(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at, new, FP8,
                                                      "")
    k, v = tl.where(new[:, None], k_new, k), tl.where(new[:, None], v_new, v)
    if FP8:
        k_scale, v_scale = tl.where(new, k_scale_new, k_scale), tl.where(new, v_scale_new, v_scale)
    return k, v, k_scale, v_scale


@triton.jit
def _first_tile_ahead(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table, lo, hi, context, pos, token, head,
                      row_ok, kv_head, qk_scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_sb,
                      stride_ss, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                      PDL: tl.constexpr):
    """The queries and the running state after keys [lo, lo + BLOCK_N): the older keys load before the wait
    for the previous kernel (with PDL it still runs: it writes q and this step's keys, loaded after it)."""
    j, key_ok, kv, scale_at, k, v, k_scale, v_scale = _older_keys_ahead(
        k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table, lo, hi, context, kv_head, stride_kb, stride_ks, stride_kh,
        stride_sb, stride_ss, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8)
    pdl.wait_previous(PDL)
    k, v, k_scale, v_scale = _with_step_keys(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, kv, scale_at,
                                             key_ok & (j >= context), k, v, k_scale, v_scale, FP8)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0).to(DOT)
    m, l, acc = _empty_state(BLOCK_M, HEAD_DIM)
    m, l, acc = _softmax_tile(q, k, v, k_scale, v_scale, j, key_ok, pos, m, l, acc, qk_scale, FP8, DOT, PRECISION)
    return q, m, l, acc


@triton.jit
def _group_prefix(q_ptr, k_ptr, v_ptr, part_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                  query_start_loc_ptr, members_ptr, group_keys_ptr, group, kv_head, num_groups, z, qk_scale,
                  kv_heads, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
                  stride_m, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MEMBERS: tl.constexpr, FP8: tl.constexpr,
                  DOT: tl.constexpr, PRECISION: tl.constexpr, PREFIX_SPLITS: tl.constexpr):
    """One (group, kv head, key split z) of a decode step's shared prefixes: its members' query rows (MEMBERS x
    GROUP <= BLOCK_M) over chunk z of PREFIX_SPLITS of the keys [0, group_keys_ptr[group]) of the first member's
    table (every member's, up there), as one partial (output, log2-sum-exp2) a row (lse -inf where the chunk
    holds no key). A group at or past num_groups, or unused (0 keys), writes nothing."""
    used = group < num_groups
    n_keys = tl.load(group_keys_ptr + group, mask=used, other=0)
    r = tl.arange(0, BLOCK_M)
    member = r // GROUP
    seq = tl.load(members_ptr + group * stride_m + member, mask=member < tl.where(used, MEMBERS, 0), other=-1)
    row_ok = (seq >= 0) & ((tl.zeros_like(seq) + n_keys) > 0)
    token = tl.load(query_start_loc_ptr + seq, mask=row_ok, other=0).to(tl.int64)  # decode: a row's one query
    head = kv_head * GROUP + r % GROUP
    table = block_tables_ptr + tl.load(members_ptr + group * stride_m, mask=used, other=0).to(tl.int64) * stride_bt
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :], mask=row_ok[:, None],
                other=0.0).to(DOT)
    m, l, acc = _empty_state(BLOCK_M, HEAD_DIM)
    newest = tl.zeros([BLOCK_M], tl.int32) + n_keys  # every prefix key is older than each member's query
    chunk = tl.cdiv(tl.cdiv(n_keys, PREFIX_SPLITS), BLOCK_N) * BLOCK_N  # this program's keys: chunk z
    lo = z * chunk
    m, l, acc = _attend(q, lo, tl.minimum(lo + chunk, n_keys), newest, m, l, acc, k_ptr, v_ptr, k_scale_ptr,
                        v_scale_ptr, table, kv_head, qk_scale, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss,
                        HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8, DOT, PRECISION)
    part, lse = _chunk_result(m, l, acc)
    row = token * (kv_heads * GROUP) + head
    tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], part, mask=row_ok[:, None])
    tl.store(lse_ptr + row, lse, mask=row_ok)


@triton.jit
def _attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, first_key_ptr, members_ptr, group_keys_ptr, qk_scale, kv_heads, num_groups, stride_qt,
        stride_qh, stride_os, stride_ls, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss, stride_m,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr, FOLD: tl.constexpr,
        FIRST_AHEAD: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
        PDL: tl.constexpr = False, SUFFIX: tl.constexpr = False, MEMBERS: tl.constexpr = 1,
        PREFIX_SPLITS: tl.constexpr = 1):
    """One (query tile, sequence x kv head, key split), each K/V tile loaded once for all GROUP heads.
    Products run in DOT: q's dtype, or fp16 for an fp8 cache (a hardware cast; bf16 is not).

    CHUNK 0: the tile's keys cut into NUM_SPLITS equal runs of whole key tiles (merged by _merge_kernel);
    FIRST_AHEAD: the first key tile loads before the wait for the previous kernel (_first_tile_ahead).
    CHUNK > 0 (fixed split): keys in chunks [c * CHUNK, (c + 1) * CHUNK) at fixed positions, each
    from its own start; FOLD: this program folds every chunk in order (_fold) and writes the output;
    else program `split` writes chunks split, split + NUM_SPLITS, ... for _fold_chunks_kernel.
    SUFFIX (equal split, decode; shared_prefix.py): the grid has PREFIX_SPLITS more key splits, the first. Their
    programs (group, kv head, split z) attend chunk z of the keys [0, group_keys_ptr[group]) that a group's
    members share (_group_prefix); the others a sequence's own keys from first_key_ptr[seq] on. The prefix's
    partials are slots NUM_SPLITS on; split 0 of the others writes lse -inf there for a sequence without one
    (first key 0)."""
    tl.static_assert(CHUNK == 0 or not FIRST_AHEAD, "only the equal split loads keys ahead")
    tl.static_assert(not SUFFIX or (CHUNK == 0 and not FIRST_AHEAD), "a suffix is an equal split's")
    if not FIRST_AHEAD:
        pdl.wait_previous(PDL)
    if SUFFIX and tl.program_id(2) < PREFIX_SPLITS:  # first in the grid, as its programs read the most keys
        z = tl.program_id(2)
        _group_prefix(q_ptr, k_ptr, v_ptr, out_ptr + (NUM_SPLITS + z) * stride_os,
                      lse_ptr + (NUM_SPLITS + z) * stride_ls, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                      query_start_loc_ptr, members_ptr, group_keys_ptr, tl.program_id(1) // kv_heads,
                      tl.program_id(1) % kv_heads, num_groups, z, qk_scale, kv_heads, stride_qt, stride_qh,
                      stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss, stride_m, GROUP, HEAD_DIM,
                      BLOCK_SIZE, BLOCK_M, BLOCK_N, MEMBERS, FP8, DOT, PRECISION, PREFIX_SPLITS)
    else:
        split = tl.program_id(2) - (PREFIX_SPLITS if SUFFIX else 0)
        _split_attention(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
                         seq_lens_ptr, query_start_loc_ptr, first_key_ptr, split, qk_scale, kv_heads, stride_qt,
                         stride_qh, stride_os, stride_ls, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb,
                         stride_ss, GROUP, HEAD_DIM, BLOCK_SIZE, BLOCK_M, BLOCK_N, NUM_SPLITS,
                         CHUNK, FOLD, FIRST_AHEAD, FP8, DOT, PRECISION, PDL, SUFFIX, PREFIX_SPLITS)


@triton.jit
def _split_attention(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
                     query_start_loc_ptr, first_key_ptr, split, qk_scale, kv_heads, stride_qt, stride_qh, stride_os,
                     stride_ls, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
                     GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr, FOLD: tl.constexpr,
                     FIRST_AHEAD: tl.constexpr, FP8: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr, SUFFIX: tl.constexpr, PREFIX_SPLITS: tl.constexpr = 1):
    """_attention_kernel's program (query tile, sequence x kv head, key split `split`) of a sequence's keys."""
    tile = tl.program_id(0)
    seq, kv_head = tl.program_id(1) // kv_heads, tl.program_id(1) % kv_heads
    row_ok, token, head, pos, n_keys, context = _tile_rows(query_start_loc_ptr, seq_lens_ptr, tile, seq, kv_head,
                                                           GROUP, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    row = token * (kv_heads * GROUP) + head  # out and partials are [.., T, H, D] contiguous
    if CHUNK == 0:
        first_key = tl.load(first_key_ptr + seq) if SUFFIX else 0
        chunk = tl.cdiv(tl.cdiv(n_keys - first_key, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = first_key + split * chunk
        hi = tl.minimum(lo + chunk, n_keys)
        if FIRST_AHEAD:
            q, m, l, acc = _first_tile_ahead(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table, lo, hi, context,
                                             pos, token, head, row_ok, kv_head, qk_scale, stride_qt, stride_qh,
                                             stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM,
                                             BLOCK_SIZE, BLOCK_M, BLOCK_N, FP8, DOT, PRECISION, PDL)
            lo += BLOCK_N
        else:
            q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                        mask=row_ok[:, None], other=0.0).to(DOT)
            m, l, acc = _empty_state(BLOCK_M, HEAD_DIM)
        m, l, acc = _attend(q, lo, hi, pos, m, l, acc, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table, kv_head,
                            qk_scale, stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM, BLOCK_SIZE,
                            BLOCK_N, FP8, DOT, PRECISION)
        part, lse = _chunk_result(m, l, acc)
        tl.store(out_ptr + split * stride_os + row[:, None] * HEAD_DIM + d[None, :],
                 part.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        if NUM_SPLITS > 1 or SUFFIX:  # log2-sum-exp2 of this split, for the merge
            tl.store(lse_ptr + split * stride_ls + row, lse, mask=row_ok)
        if SUFFIX and split == 0:  # the merge weighs the prefix's partials by 0: they must be finite too
            no_prefix = row_ok & ((tl.zeros([BLOCK_M], tl.int32) + first_key) == 0)
            for z in tl.static_range(PREFIX_SPLITS):
                tl.store(out_ptr + (NUM_SPLITS + z) * stride_os + row[:, None] * HEAD_DIM + d[None, :],
                         tl.zeros([BLOCK_M, HEAD_DIM], tl.float32), mask=no_prefix[:, None])
                tl.store(lse_ptr + (NUM_SPLITS + z) * stride_ls + row,
                         tl.full([BLOCK_M], float("-inf"), tl.float32), mask=no_prefix)
    else:
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None], other=0.0).to(DOT)
        if FOLD:
            o = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
            m_o = tl.full([BLOCK_M], -1.0e30, tl.float32)
            l_o = tl.zeros([BLOCK_M], tl.float32)
            for lo in range(0, n_keys, CHUNK):
                m, l, acc = _empty_state(BLOCK_M, HEAD_DIM)
                m, l, acc = _attend(q, lo, tl.minimum(lo + CHUNK, n_keys), pos, m, l, acc, k_ptr, v_ptr, k_scale_ptr,
                                    v_scale_ptr, table, kv_head, qk_scale, stride_kb, stride_ks, stride_kh, stride_sb,
                                    stride_ss, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8, DOT, PRECISION)
                part, lse = _chunk_result(m, l, acc)
                o, m_o, l_o = _fold(o, m_o, l_o, part, lse)
            tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :],
                     (o / tl.where(l_o > 0, l_o, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
        else:
            for lo in range(split * CHUNK, n_keys, NUM_SPLITS * CHUNK):
                m, l, acc = _empty_state(BLOCK_M, HEAD_DIM)
                m, l, acc = _attend(q, lo, tl.minimum(lo + CHUNK, n_keys), pos, m, l, acc, k_ptr, v_ptr, k_scale_ptr,
                                    v_scale_ptr, table, kv_head, qk_scale, stride_kb, stride_ks, stride_kh, stride_sb,
                                    stride_ss, HEAD_DIM, BLOCK_SIZE, BLOCK_N, FP8, DOT, PRECISION)
                part, lse = _chunk_result(m, l, acc)
                c = lo // CHUNK
                tl.store(out_ptr + c * stride_os + row[:, None] * HEAD_DIM + d[None, :], part, mask=row_ok[:, None])
                tl.store(lse_ptr + c * stride_ls + row, lse, mask=row_ok)


@triton.jit
def _fold_chunks_kernel(part_ptr, lse_ptr, out_ptr, seq_lens_ptr, query_start_loc_ptr, kv_heads, stride_ps,
                        stride_ls, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                        CHUNK: tl.constexpr):
    """One (query tile, sequence x kv head) of the fixed split: its rows' chunks folded in chunk order,
    exactly as a FOLD program of _attention_kernel folds them."""
    tile = tl.program_id(0)
    seq, kv_head = tl.program_id(1) // kv_heads, tl.program_id(1) % kv_heads
    row_ok, token, head, pos, n_keys, _ = _tile_rows(query_start_loc_ptr, seq_lens_ptr, tile, seq, kv_head,
                                                     GROUP, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    row = token * (kv_heads * GROUP) + head
    o = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    m_o = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_o = tl.zeros([BLOCK_M], tl.float32)
    for c in range(0, tl.cdiv(n_keys, CHUNK)):
        lse = tl.load(lse_ptr + c * stride_ls + row, mask=row_ok, other=float("-inf"))
        part = tl.load(part_ptr + c * stride_ps + row[:, None] * HEAD_DIM + d[None, :], mask=row_ok[:, None],
                       other=0.0)
        o, m_o, l_o = _fold(o, m_o, l_o, part, lse)
    tl.store(out_ptr + row[:, None] * HEAD_DIM + d[None, :],
             (o / tl.where(l_o > 0, l_o, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, stride_ps, stride_ls, NUM_SPLITS: tl.constexpr,
                  SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr):
    """Combine the per-split outputs of one (token, head) row, weighted by their sum-exp."""
    pdl.wait_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_POW2)
    d = tl.arange(0, HEAD_DIM)
    lse = tl.load(lse_ptr + sp * stride_ls + row, mask=sp < NUM_SPLITS, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    part = tl.load(part_ptr + sp[:, None] * stride_ps + row * HEAD_DIM + d[None, :],
                   mask=(sp < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(w[:, None] * part, 0) / tl.sum(w, 0)
    tl.store(out_ptr + row * HEAD_DIM + d, out.to(out_ptr.dtype.element_ty))


def _config(rows, head_dim, itemsize, fp8_cache=False):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for `rows` packed query rows per sequence and kv head."""
    if rows <= 64:  # decode / speculative verify: one tile, bound by the K/V reads
        block_m = max(16, triton.next_power_of_2(rows))
        if fp8_cache and block_m == 16 and head_dim <= 128:
            # an fp8 cache: 64-key tiles on 2 warps. Its tiles are converted to fp16 in registers; 128-key tiles
            # on 4 warps take 211 registers a thread, which halves the programs an SM holds. On an H200 (256 x
            # 512, 256 x 1k, 64 x 4k keys; 2 and 4 query heads per kv head) 0.78-0.90x their time.
            return block_m, 64, 2, 3
        return block_m, (64 if head_dim <= 128 else 32) * (2 if fp8_cache else 1), 4, 3
    if head_dim * itemsize <= 256:  # the best of a sweep on an H200 for bf16, head dim 128 (docs/benchmarks.md)
        return 128, 32, 4, 3
    return 64, 32, 4, 2


def _num_splits(programs, max_query_len, max_context, device):
    """Split the keys (flash-decoding) when a decode-shaped launch would leave SMs idle.

    Only host values: the grid must stay fixed for CUDA graphs; each split then takes an
    equal share of its own sequence's keys inside the kernel. Each split keeps at least 128 keys."""
    if device.type != "cuda" or max_query_len > 16:
        return 1
    return max(1, min(32, 2 * sm_count(device) // programs, max_context // 128))


def _fixed_splits(programs, max_query_len, chunks, device):
    """Grid splits of the fixed split: programs of their own for the key chunks only when a decode-shaped
    launch would leave SMs idle; 1: each program folds all its chunks itself. Speed only: the bits are
    the same either way."""
    if max_query_len > 16:
        return 1
    return max(1, min(chunks, 2 * sm_count(device) // programs))


def _attention_launch(grid, q, k_cache, v_cache, dest, lse, k_scale, v_scale, block_tables, seq_lens,
                      query_start_loc, scale, shared=None, **meta):
    """_attention_kernel over `grid` with the operands every launch passes alike; `meta`: the tile shape and
    the kernel's switches; `shared` (shared_prefix.SharedPrefix): a SUFFIX launch's groups, whose prefixes the
    grid's first split attends."""
    tokens, heads, head_dim = q.shape
    fp8 = k_scale is not None
    assert not fp8 or k_scale.shape == v_scale.shape == k_cache.shape[:3], "one scale per (slot, kv head)"
    meta = {"FIRST_AHEAD": False, "SUFFIX": shared is not None} | meta
    first_key = shared.first_key if shared is not None else seq_lens
    members, group_keys = (shared.members, shared.keys) if shared is not None and shared.keys.numel() else (
        seq_lens, seq_lens[:0])  # no group: the first split's programs find none
    _attention_kernel[grid](
        q, k_cache, v_cache, dest, lse, k_scale if fp8 else q, v_scale if fp8 else q, block_tables, seq_lens,
        query_start_loc, first_key, members, group_keys, scale * LOG2E, k_cache.shape[2], group_keys.shape[0],
        q.stride(0), q.stride(1), tokens * heads * head_dim, tokens * heads, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), *(k_scale.stride()[:2] if fp8 else (0, 0)), members.stride(0),
        GROUP=heads // k_cache.shape[2], HEAD_DIM=head_dim, MEMBERS=members.shape[1] if members.dim() == 2 else 1,
        BLOCK_SIZE=k_cache.shape[1], FP8=fp8, DOT=tl.float16 if fp8 and q.element_size() == 2 else _TL_DTYPES[q.dtype],
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", **meta)


def _launch_fixed(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                  k_scale, v_scale, out):
    """The fixed split: one tile shape whatever the launch, keys in FIXED_SPLIT_KEYS chunks folded in order.
    No FMA contraction (enable_fp_fusion=False), so a fold rounds alike in either kernel."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    _, block_n, warps, stages = FIXED_TILE if head_dim <= 128 else (*FIXED_TILE[:1], 32, *FIXED_TILE[2:])
    # A tile holds at least one query token's heads; the group is the model's, so the shape is still one per engine.
    block_m = max(FIXED_TILE[0], triton.next_power_of_2(group))
    grid = (triton.cdiv(max_query_len, block_m // group), seq_lens.shape[0] * kv_heads)
    chunks = triton.cdiv(block_tables.shape[1] * k_cache.shape[1], FIXED_SPLIT_KEYS)
    splits = _fixed_splits(grid[0] * grid[1], max_query_len, chunks, q.device)
    dest = out if splits == 1 else torch.empty((chunks, tokens, heads, head_dim), dtype=torch.float32,
                                               device=q.device)
    lse = dest if splits == 1 else torch.empty((chunks, tokens, heads), dtype=torch.float32, device=q.device)
    _attention_launch((*grid, splits), q, k_cache, v_cache, dest, lse, k_scale, v_scale, block_tables, seq_lens,
                      query_start_loc, scale, BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits,
                      CHUNK=FIXED_SPLIT_KEYS, FOLD=splits == 1, num_warps=warps, num_stages=stages,
                      enable_fp_fusion=False)
    if splits > 1:
        _fold_chunks_kernel[grid](dest, lse, out, seq_lens, query_start_loc, kv_heads, tokens * heads * head_dim,
                                  tokens * heads, GROUP=group, HEAD_DIM=head_dim, BLOCK_M=block_m,
                                  CHUNK=FIXED_SPLIT_KEYS, num_warps=warps, enable_fp_fusion=False)
    return out


def paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                           scale, k_scale=None, v_scale=None, fixed_split=False, shared=None):
    """Triton twin of paged_attention_ref. Rows no sequence owns are left unspecified. `shared` (a
    shared_prefix.SharedPrefix, decode only): the prefixes groups of sequences share are attended once a group."""
    if shared is not None:
        from .shared_prefix import shared_prefix_attention  # it launches this module's kernels
        return shared_prefix_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                       k_scale, v_scale, shared)
    tokens, heads, head_dim = q.shape
    num_seqs, block_size, kv_heads = seq_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and q.stride(2) == 1
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype, device=q.device)
    if tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    if fixed_split:
        return _launch_fixed(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                             k_scale, v_scale, out)
    block_m, block_n, warps, stages = _config(group * max_query_len, head_dim, q.element_size(), k_scale is not None)
    assert group <= block_m, f"{group} query heads per kv head is more than one tile"
    q_tiles = triton.cdiv(max_query_len, block_m // group)
    splits = _num_splits(num_seqs * kv_heads * q_tiles, max_query_len, block_tables.shape[1] * block_size,
                         q.device)
    dest = out if splits == 1 else torch.empty((splits, tokens, heads, head_dim), dtype=torch.float32,
                                               device=q.device)
    lse = torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device) if splits > 1 else dest
    _attention_launch((q_tiles, num_seqs * kv_heads, splits), q, k_cache, v_cache, dest, lse, k_scale, v_scale,
                      block_tables, seq_lens, query_start_loc, scale, BLOCK_M=block_m, BLOCK_N=block_n,
                      NUM_SPLITS=splits, CHUNK=0, FOLD=False, FIRST_AHEAD=FIRST_TILE_AHEAD and tokens == 1,
                      num_warps=warps, num_stages=stages, **pdl.options(q.device, tokens))
    if splits > 1:
        _merge_kernel[(tokens * heads,)](dest, lse, out, tokens * heads * head_dim, tokens * heads,
                                         NUM_SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits),
                                         HEAD_DIM=head_dim, **pdl.options(q.device, tokens))
    return out
