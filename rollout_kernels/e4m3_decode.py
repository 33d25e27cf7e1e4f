"""Decode attention over an e4m3 KV cache on CUDA cores: one query row a sequence, every product in float32.

attention.py's kernel converts each e4m3 tile to fp16 in registers and pads a kv head's GROUP query heads to a
16-row tensor-core dot. At an fp8 cache's half bytes a key that work, not the bytes, sets its time. Here each
query head is a vector: its scores are dot products over the head dim on CUDA cores, and its output a running
[BLOCK_N, HEAD_DIM] sum of probability-weighted values, reduced over the keys once, at the end. Up to
MAX_GROUP query heads per kv head; paged_attention_triton sends other launches to the tile kernel."""
import torch
import triton
import triton.language as tl

from . import pdl
from .attention import LOG2E, _merge_kernel, _num_splits
from .launch import interpreted

MAX_GROUP = 4
# Whether paged_attention_triton sends the launches `takes` accepts here. Off until GPU measurements say it
# beats the tile kernel (the "CUDA cores" rows of attention_bench.py; rollout.py --e4m3-decode); the CPU tests
# hold it to the reference either way. Read at each launch: set it before an engine captures its graphs.
ENABLED = False
# (BLOCK_N, num_warps, num_stages): 16 keys on 8 warps hold 80-130 registers a thread for 1-4 query heads a kv
# head (sm_90, Triton 3.6); 32 keys or 4 warps take 170-255.
TILE = (16, 8, 3)
_HARDWARE = tl.constexpr(not interpreted())


def takes(q, k_scale, max_query_len, fixed_split, shared) -> bool:
    """Whether a paged_attention_triton launch is this kernel's, when ENABLED: a decode step (one query row a
    sequence) over an e4m3 cache, at most MAX_GROUP query heads a kv head, pages a whole number of key tiles,
    outside batch-invariant mode and shared prefixes (shared_prefix.py sends the suffixes of those here itself)."""
    return (ENABLED and k_scale is not None and max_query_len == 1 and not fixed_split and shared is None
            and q.shape[1] // k_scale.shape[2] <= MAX_GROUP and k_scale.shape[1] % min(TILE[0], k_scale.shape[1]) == 0)


@triton.jit
def _f32_of_e4m3(bits):
    """float32 values of float8_e4m3fn bit patterns (uint8); by hand in the interpreter."""
    if _HARDWARE:
        return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    b = bits.to(tl.int32)
    e = (b >> 3) & 0xF
    mant = (b & 7).to(tl.float32)
    mag = tl.where(e == 0, mant * 0.001953125, (8.0 + mant) * tl.exp2((e - 10).to(tl.float32)))  # 2**-9 = subnormal
    mag = tl.where((b & 0x7F) == 0x7F, float("nan"), mag)
    return tl.where((b & 0x80) != 0, -mag, mag)


@triton.jit
def _head(q, k, k_scale, v_scale, v, m, l, acc, ok, qk_scale):
    """One query head's running state after a tile, in log2 units. Each of the tile's BLOCK_N rows keeps a softmax
    of its own (max m and sum l [BLOCK_N, 1], output sum acc [BLOCK_N, HEAD_DIM]) over the keys it has seen, so a
    tile needs no reduction across rows, which would cross warps; _finish combines the rows once. Every row
    quantity is a [BLOCK_N, 1] column of the tile's own layout: 1-d ones cost a trip through shared memory."""
    s = tl.where(ok, tl.sum(q[None, :] * k, 1, keep_dims=True) * k_scale * qk_scale, float("-inf"))
    m_new = tl.maximum(m, s)
    p = tl.exp2(s - m_new)
    alpha = tl.exp2(m - m_new)
    return m_new, l * alpha + p, acc * alpha + (p * v_scale) * v


@triton.jit
def _finish(out_ptr, lse_ptr, row, acc, m, l, HEAD_DIM: tl.constexpr, PARTIAL: tl.constexpr):
    """Combine a head's row softmaxes; store its normalised output and, PARTIAL, its log2-sum-exp2 (-inf where it
    saw no key). A row without keys keeps m = -1e30 and l = 0, so it adds nothing."""
    top = tl.max(m)
    w = tl.exp2(m - top)
    total = tl.sum(l * w)
    safe = tl.where(total != 0, total, 1.0)
    out = tl.sum(acc * w, 0) / safe
    tl.store(out_ptr + row * HEAD_DIM + tl.arange(0, HEAD_DIM), out.to(out_ptr.dtype.element_ty))
    if PARTIAL:
        tl.store(lse_ptr + row, tl.where(total != 0, top + tl.log2(safe), float("-inf")))


@triton.jit
def _raw_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page, start, hi, kv_head, stride_kb, stride_ks, stride_kh,
              stride_sb, stride_ss, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The e4m3 bytes (K, V: [BLOCK_N, HEAD_DIM]) and scales ([BLOCK_N, 1]) of keys start.. start + BLOCK_N, all in
    `page` (a tile never crosses one); 0 from hi on."""
    r = tl.arange(0, BLOCK_N)[:, None]
    ok = start + r < hi
    slot = start % BLOCK_SIZE + r
    kv = page * stride_kb + slot * stride_ks + kv_head * stride_kh + tl.arange(0, HEAD_DIM)[None, :]
    at = page * stride_sb + slot * stride_ss + kv_head
    return (tl.load(k_ptr + kv, mask=ok, other=0), tl.load(v_ptr + kv, mask=ok, other=0),
            tl.load(k_scale_ptr + at, mask=ok, other=0.0), tl.load(v_scale_ptr + at, mask=ok, other=0.0))


@triton.jit
def _e4m3_decode_kernel(q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, out_ptr, lse_ptr, block_tables_ptr,
                        seq_lens_ptr, query_start_loc_ptr, first_key_ptr, qk_scale, kv_heads, stride_qt, stride_qh,
                        stride_os, stride_ls, stride_kb, stride_ks, stride_kh, stride_bt, stride_sb, stride_ss,
                        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                        NUM_SPLITS: tl.constexpr, PDL: tl.constexpr, PREFIX_SPLITS: tl.constexpr,
                        GROUP_POW2: tl.constexpr):
    """One (sequence x kv head, key split): its GROUP query heads (q0..q3, the unused ones never computed) over
    an equal share of the sequence's keys. PREFIX_SPLITS > 0 (a suffix launch, shared_prefix.py): the keys from
    first_key_ptr[seq] on; the PREFIX_SPLITS partials after the NUM_SPLITS are a group's prefix's, which split 0
    fills with empty ones (lse -inf, output 0: the merge weighs them by 0) for a sequence in no group."""
    tl.static_assert(GROUP <= 4, "MAX_GROUP query heads per kv head")
    seq, kv_head = tl.program_id(0) // kv_heads, tl.program_id(0) % kv_heads
    split = tl.program_id(1)
    pdl.wait_previous(PDL)
    n_keys = tl.load(seq_lens_ptr + seq)
    first = tl.load(first_key_ptr + seq) if PREFIX_SPLITS > 0 else 0
    chunk = tl.cdiv(tl.cdiv(n_keys - first, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, n_keys)
    d = tl.arange(0, HEAD_DIM)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    token = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_at = q_ptr + token * stride_qt + kv_head * GROUP * stride_qh + d
    q0 = tl.load(q_at).to(tl.float32)
    q1 = tl.load(q_at + stride_qh).to(tl.float32) if GROUP > 1 else q0
    q2 = tl.load(q_at + 2 * stride_qh).to(tl.float32) if GROUP > 2 else q0
    q3 = tl.load(q_at + 3 * stride_qh).to(tl.float32) if GROUP > 3 else q0
    m0 = tl.full([BLOCK_N, 1], -1.0e30, tl.float32)  # finite: a row (or a split) may see no key
    l0 = tl.zeros([BLOCK_N, 1], tl.float32)
    m1, m2, m3, l1, l2, l3 = m0, m0, m0, l0, l0, l0
    a0 = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    a1, a2, a3 = a0, a0, a0
    # the tiles start at whole pages (lo: the first key, 0 or a group's whole blocks, plus whole tiles), so each
    # lies in one page: one page-table load a tile, a tile ahead of the tile's own loads
    page = tl.load(table + lo // BLOCK_SIZE, mask=lo < hi, other=0).to(tl.int64)
    k_raw, v_raw, k_scale, v_scale = _raw_tile(k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page, lo, hi, kv_head,
                                               stride_kb, stride_ks, stride_kh, stride_sb, stride_ss, HEAD_DIM,
                                               BLOCK_SIZE, BLOCK_N)
    page = tl.load(table + (lo + BLOCK_N) // BLOCK_SIZE, mask=lo + BLOCK_N < hi, other=0).to(tl.int64)
    for start in range(lo, hi, BLOCK_N):
        # the next tile's bytes, and the page of the one after, load before this tile's math
        ok = start + tl.arange(0, BLOCK_N)[:, None] < hi
        k_next, v_next, k_scale_next, v_scale_next = _raw_tile(
            k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page, start + BLOCK_N, hi, kv_head, stride_kb, stride_ks,
            stride_kh, stride_sb, stride_ss, HEAD_DIM, BLOCK_SIZE, BLOCK_N)
        after = start + 2 * BLOCK_N
        page = tl.load(table + after // BLOCK_SIZE, mask=after < hi, other=0).to(tl.int64)
        k = _f32_of_e4m3(k_raw)
        # slots past the end are masked to 0, not read: 0 * NaN would poison the output sum
        v = tl.where(ok, _f32_of_e4m3(v_raw), 0.0)
        v_scale = tl.where(ok, v_scale, 0.0)
        m0, l0, a0 = _head(q0, k, k_scale, v_scale, v, m0, l0, a0, ok, qk_scale)
        if GROUP > 1:
            m1, l1, a1 = _head(q1, k, k_scale, v_scale, v, m1, l1, a1, ok, qk_scale)
        if GROUP > 2:
            m2, l2, a2 = _head(q2, k, k_scale, v_scale, v, m2, l2, a2, ok, qk_scale)
        if GROUP > 3:
            m3, l3, a3 = _head(q3, k, k_scale, v_scale, v, m3, l3, a3, ok, qk_scale)
        k_raw, v_raw, k_scale, v_scale = k_next, v_next, k_scale_next, v_scale_next
    row = token * (kv_heads * GROUP) + kv_head * GROUP  # out and partials are [.., T, H, D] contiguous
    PARTIAL: tl.constexpr = NUM_SPLITS > 1 or PREFIX_SPLITS > 0
    at, lse_at = out_ptr + split * stride_os, lse_ptr + split * stride_ls
    _finish(at, lse_at, row, a0, m0, l0, HEAD_DIM, PARTIAL)
    if GROUP > 1:
        _finish(at, lse_at, row + 1, a1, m1, l1, HEAD_DIM, PARTIAL)
    if GROUP > 2:
        _finish(at, lse_at, row + 2, a2, m2, l2, HEAD_DIM, PARTIAL)
    if GROUP > 3:
        _finish(at, lse_at, row + 3, a3, m3, l3, HEAD_DIM, PARTIAL)
    if PREFIX_SPLITS > 0:
        if (split == 0) & (first == 0):
            heads = row + tl.arange(0, GROUP_POW2)
            used = tl.arange(0, GROUP_POW2) < GROUP
            for z in tl.static_range(PREFIX_SPLITS):
                tl.store(out_ptr + (NUM_SPLITS + z) * stride_os + heads[:, None] * HEAD_DIM + d[None, :],
                         tl.zeros([GROUP_POW2, HEAD_DIM], tl.float32), mask=used[:, None])
                tl.store(lse_ptr + (NUM_SPLITS + z) * stride_ls + heads,
                         tl.full([GROUP_POW2], float("-inf"), tl.float32), mask=used)


def launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, dest, lse,
           splits, tile=None, first_key=None, prefix_splits=0):
    """The kernel over (sequence x kv head, `splits`) into `dest` (and, split or a suffix, partials
    [splits + prefix_splits, T, H, D] and `lse` [splits + prefix_splits, T, H]). first_key: a suffix launch's."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    block_n, warps, stages = tile or TILE
    block_n = min(block_n, k_cache.shape[1])
    _e4m3_decode_kernel[(seq_lens.shape[0] * kv_heads, splits)](
        q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), k_scale, v_scale, dest, lse, block_tables,
        seq_lens, query_start_loc, seq_lens if first_key is None else first_key, scale * LOG2E, kv_heads,
        q.stride(0), q.stride(1), tokens * heads * head_dim, tokens * heads, k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), block_tables.stride(0), k_scale.stride(0), k_scale.stride(1), GROUP=heads // kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1], BLOCK_N=block_n, NUM_SPLITS=splits,
        PREFIX_SPLITS=prefix_splits, GROUP_POW2=triton.next_power_of_2(heads // kv_heads), num_warps=warps,
        num_stages=stages, **pdl.options(q.device, tokens))


def e4m3_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale,
                          out, tile=None, splits=None):
    """paged_attention_triton of a launch `takes` accepts, into `out`. tile: (BLOCK_N, num_warps, num_stages),
    TILE by default; splits: the key splits, _num_splits's by default."""
    tokens, heads, head_dim = q.shape
    if splits is None:
        splits = _num_splits(seq_lens.shape[0] * k_cache.shape[2], 1, block_tables.shape[1] * k_cache.shape[1],
                             q.device)
    dest = out if splits == 1 else torch.empty((splits, tokens, heads, head_dim), dtype=torch.float32,
                                               device=q.device)
    lse = dest if splits == 1 else torch.empty((splits, tokens, heads), dtype=torch.float32, device=q.device)
    launch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale, dest, lse, splits,
           tile)
    if splits > 1:
        _merge_kernel[(tokens * heads,)](dest, lse, out, tokens * heads * head_dim, tokens * heads,
                                         NUM_SPLITS=splits, SPLITS_POW2=triton.next_power_of_2(splits),
                                         HEAD_DIM=head_dim, **pdl.options(q.device, tokens))
    return out
