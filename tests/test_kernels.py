"""Every Triton kernel against its torch reference, and every reference against a naive version.

Without a GPU the Triton kernels run in Triton's interpreter (numpy, float32/float16 only), so
the shapes here stay small. The `gpu` tests repeat the comparisons in bfloat16 at model sizes."""
import math

import pytest
import torch
import torch.nn.functional as F
import triton
from compile_check import assert_compiles
from helpers import cos_sin

from rollout_kernels import activation, attention, copies, fp8, get_ops, norm, rotary, sampling

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET=1 before anything imported triton.

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# Tolerances. float32: both sides accumulate in fp32 in different orders, a few ulp of values
# of order 1-10 -> 2e-5. float16 attention: the kernel rounds softmax weights to fp16 for the
# PV product (rel 2**-11) and the output to fp16 (half an ulp of ~1 is 5e-4) -> 3e-3.
# bfloat16: 8 mantissa bits, one rounding of p and of the output (2**-8 each) -> 2e-2.
TOL = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


# ---------------------------------------------------------------- paged attention

def paged_batch(q_lens, ctx_lens, heads, kv_heads, head_dim, dtype=torch.float32, block_size=16, fp8=False,
                seed=0, device=DEV):
    """Queries plus a shuffled, gappy block table over a K/V pool that already holds every token."""
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    used = [triton.cdiv(n, block_size) for n in seq_lens]
    num_blocks = sum(used) + 7  # 7 blocks nobody owns
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.randint(-9, 2**30, (len(q_lens), max(used) + 3), generator=g)  # garbage past the end
    tables[:, ::2] = -1
    offset = 0
    for s, n in enumerate(used):
        tables[s, :n] = ids[offset:offset + n]
        offset += n
    pool = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)  # one layer's K, V
    scales = None
    if fp8:
        scales = torch.rand(2, num_blocks, block_size, kv_heads, generator=g) * 0.02 + 0.004  # per (slot, head)
        pool = (pool / scales[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        pool = pool.to(dtype)
    q = torch.randn(sum(q_lens) + 2, heads, head_dim, generator=g).to(dtype)  # 2 rows nobody owns
    qsl = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    args = dict(q=q, k_cache=pool[0], v_cache=pool[1], block_tables=tables.to(torch.int32),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl,
                max_query_len=max(q_lens), scale=head_dim ** -0.5)
    if fp8:
        args.update(k_scale=scales[0], v_scale=scales[1])
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in args.items()}


def dense_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, scale,
                    k_scale=None, v_scale=None):
    """Naive: read every key position by position, then SDPA with an explicit causal mask."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    heads, kv_heads, block_size = q.shape[1], k_cache.shape[2], k_cache.shape[1]
    for s, length in enumerate(seq_lens.tolist()):
        q0, q1 = query_start_loc[s].item(), query_start_loc[s + 1].item()
        if q1 == q0:
            continue
        blocks = [block_tables[s, p // block_size].item() for p in range(length)]
        k = torch.stack([k_cache[b, p % block_size].float() for p, b in enumerate(blocks)])
        v = torch.stack([v_cache[b, p % block_size].float() for p, b in enumerate(blocks)])
        if k_scale is not None:
            k = k * torch.stack([k_scale[b, p % block_size] for p, b in enumerate(blocks)])[..., None]
            v = v * torch.stack([v_scale[b, p % block_size] for p, b in enumerate(blocks)])[..., None]
        k, v = (t.repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for t in (k, v))
        positions = torch.arange(length - (q1 - q0), length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]
        out[q0:q1] = F.scaled_dot_product_attention(q[q0:q1].float().transpose(0, 1), k, v, attn_mask=mask,
                                                    scale=scale).transpose(0, 1)
    return out


# decode (1), speculative verify (5), idle padding row (0), long prefill, chunked prefill on a cache
MIXED = dict(q_lens=[1, 5, 0, 100, 20], ctx_lens=[37, 200, 5, 0, 50])


def owned(args):
    return slice(0, args["query_start_loc"][-1].item())


@pytest.mark.parametrize("fp8", [False, True])
def test_attention_reference_matches_dense(fp8):
    args = paged_batch(**MIXED, heads=8, kv_heads=2, head_dim=64, fp8=fp8, device="cpu")
    rows = owned(args)
    torch.testing.assert_close(attention.paged_attention_ref(**args)[rows], dense_attention(**args)[rows],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_attention_triton_matches_reference(group, head_dim, dtype):
    args = paged_batch(**MIXED, heads=2 * group, kv_heads=2, head_dim=head_dim, dtype=dtype)
    rows = owned(args)
    out = attention.paged_attention_triton(**args)
    assert out.dtype == dtype
    torch.testing.assert_close(out[rows].float(), attention.paged_attention_ref(**args)[rows].float(),
                               atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("splits", [2, 5, 32])
def test_attention_split_k_matches_reference(monkeypatch, splits):
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    args = paged_batch(q_lens=[1, 5, 0, 3], ctx_lens=[300, 90, 7, 0], heads=8, kv_heads=2, head_dim=64,
                       block_size=8)
    rows = owned(args)
    torch.testing.assert_close(attention.paged_attention_triton(**args)[rows],
                               attention.paged_attention_ref(**args)[rows], atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("context", [0, 5, 300])
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_one_row_decode_loads_its_first_keys_ahead(monkeypatch, splits, context, fp8):
    """A one-row launch (batch-1 decode) loads its first key tile before the wait for the previous kernel and
    this step's key after it: the bits of the launch that loads everything after the wait, with the step's key
    in a first tile, a later tile or a later split (and splits without keys)."""
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    args = paged_batch([1], [context], heads=8, kv_heads=2, head_dim=64, fp8=fp8, block_size=8)
    args["q"] = args["q"][:1]
    ahead = attention.paged_attention_triton(**args)
    monkeypatch.setattr(attention, "FIRST_TILE_AHEAD", False)
    assert torch.equal(ahead, attention.paged_attention_triton(**args))
    torch.testing.assert_close(ahead, attention.paged_attention_ref(**args), atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


COMPILE_ATTENTION = """
import itertools
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import attention
ints = ("kv_heads", "num_groups", "stride_qt", "stride_qh", "stride_os", "stride_ls", "stride_kb", "stride_ks",
        "stride_kh", "stride_bt", "stride_sb", "stride_ss", "stride_m")
for fp8, ahead, suffix in itertools.product([False, True], [False, True], [False, True]):
    if ahead and suffix:
        continue
    kv = "*fp8e4nv" if fp8 else "*bf16"
    signature = dict(q_ptr="*bf16", k_ptr=kv, v_ptr=kv, out_ptr="*fp32", lse_ptr="*fp32", k_scale_ptr="*fp32",
                     v_scale_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32", query_start_loc_ptr="*i32",
                     first_key_ptr="*i32", members_ptr="*i32", group_keys_ptr="*i32", qk_scale="fp32"
                     ) | dict.fromkeys(ints, "i32")
    constants = dict(GROUP=2, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=32, CHUNK=0,
                     FOLD=False, FIRST_AHEAD=ahead, FP8=fp8, DOT=tl.float16 if fp8 else tl.bfloat16,
                     PRECISION="tf32", PDL=not suffix, SUFFIX=suffix, MEMBERS=8, PREFIX_SPLITS=4 if suffix else 1)
    signature |= dict.fromkeys(constants, "constexpr")
    triton.compile(ASTSource(attention._attention_kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
"""


def test_attention_kernel_compiles_for_the_gpu():
    """The decode launch's variants (bf16 or fp8 cache, first keys ahead or not, shared_prefix.py's launch of
    groups' prefixes and sequences' suffixes) built by the compiler, not the interpreter (compile_check)."""
    assert_compiles(COMPILE_ATTENTION)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_fp8_matches_dequantised_reference(monkeypatch, splits, dtype):
    """An fp8 cache under float32 and float16 queries (compiled, the V tile converts in an asm statement, then to
    the queries' product type)."""
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    args = paged_batch(**MIXED, heads=8, kv_heads=2, head_dim=64, fp8=True, dtype=dtype)
    rows = owned(args)
    torch.testing.assert_close(attention.paged_attention_triton(**args)[rows].float(),
                               attention.paged_attention_ref(**args)[rows].float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_attention_fp8_matches_dequantised_reference_compiled(monkeypatch, dtype):
    test_attention_fp8_matches_dequantised_reference(monkeypatch, 3, dtype)


def test_attention_without_queries_reads_nothing():
    args = paged_batch(q_lens=[0, 0], ctx_lens=[5, 9], heads=4, kv_heads=2, head_dim=64)
    args["block_tables"].fill_(2**30)  # any read would fault
    for fn in (attention.paged_attention_ref, attention.paged_attention_triton):
        fn(**{**args, "max_query_len": 1})


# ---------------------------------------------------------------- KV store

def store_batch(fp8, dtype=torch.float32, device=DEV, tokens=23, kv_heads=2, head_dim=64, block_size=4):
    g = torch.Generator().manual_seed(1)
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g) * 4 for _ in range(2))
    blocks = triton.cdiv(2 * tokens, block_size)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[::5] = -1  # padding
    cache_dtype = torch.float8_e4m3fn if fp8 else dtype
    caches = torch.zeros(2, blocks, block_size, kv_heads, head_dim, dtype=cache_dtype)
    scales = torch.rand(2, blocks, block_size, kv_heads, generator=g) * 0.05 + 0.01 if fp8 else (None, None)
    return [t.to(device) if t is not None else None
            for t in (k.to(dtype), v.to(dtype), caches[0], caches[1], slots, *scales)]


def test_store_kv_reference_writes_slots_and_skips_padding():
    k, v, kc, vc, slots, _, _ = store_batch(False, device="cpu")
    attention.store_kv_ref(k, v, kc, vc, slots)
    flat = kc.flatten(0, 1)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat[slot], k[t])
    assert (flat.abs().sum((1, 2)) > 0).sum() == (slots >= 0).sum()


def test_fp8_rounding_matches_torch():
    """Every e4m3 value, every midpoint between neighbours (ties go to even), random values, stored by
    rope_store at position 0, where the rotation is the identity. Each head also holds 448 in its second
    half, so its own scale is 448 / 448 = 1 and the stored bits are the values' own e4m3 rounding."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[grid.isfinite()].unique()
    x = torch.cat([grid, (grid[1:] + grid[:-1]) / 2, torch.randn(2000) * 60, torch.rand(100) * 0.02])
    x = torch.cat([x, -x]).clamp(-448, 448)
    x = torch.cat([x, x.new_zeros(-len(x) % 32)])
    n = len(x) // 32  # tokens of one kv head of dim 64, one token per block; x fills each first half
    second = torch.ones(n, 1, 32)
    second[:, :, 0] = 448.0
    k = torch.cat([x.view(n, 1, 32), second], dim=2).to(DEV)  # second half: x1 * sin(0) adds 0
    cache = torch.zeros(n, 1, 1, 64, dtype=torch.float8_e4m3fn, device=DEV)
    scales = torch.zeros(2, n, 1, 1, device=DEV)
    rotary.rope_store_triton(k.clone(), k, k, torch.zeros(n, dtype=torch.int64, device=DEV), cos_sin(1, 64).to(DEV),
                             cache, cache.clone(), torch.arange(n, device=DEV), *scales)
    assert torch.equal(scales[0].flatten().cpu(), torch.ones(n))
    want = x.to(torch.float8_e4m3fn)
    assert torch.equal(cache[..., :32].flatten().cpu().view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp8_cache_scales_each_key_and_value_by_its_own_max(dtype):
    """An e4m3 cache holds each (token, kv head) over its own scale, max|x| / 448: heads of about 1e3 (past
    e4m3's 448) and 1e-3 (below its normal range at scale 1) come back within one e4m3 rounding (2**-4 of the
    value, or 2**-10 of the scale where the value is subnormal). The Triton store (rope_store at position 0:
    the rotation is the identity) writes the reference's bits, scales included."""
    g = torch.Generator().manual_seed(5)
    tokens, kv_heads, dim, block_size = 9, 3, 64, 4
    magnitude = torch.tensor([1e3, 1.0, 1e-3])[None, :, None]
    k, v = ((torch.randn(tokens, kv_heads, dim, generator=g) * magnitude).to(dtype).to(DEV) for _ in range(2))
    slots = torch.randperm(3 * block_size, generator=g)[:tokens].to(DEV)
    stored = {}
    for name, fn in (("ref", rotary.rope_store_ref), ("triton", rotary.rope_store_triton)):
        caches = torch.zeros(2, 3, block_size, kv_heads, dim, dtype=torch.float8_e4m3fn, device=DEV)
        scales = torch.ones(2, 3, block_size, kv_heads, device=DEV)  # as the engine carves them
        fn(k.clone(), k.clone(), v, torch.zeros(tokens, dtype=torch.int64, device=DEV), cos_sin(1, dim).to(DEV),
           *caches, slots, *scales)
        stored[name] = caches, scales
        blocks, offsets = slots // block_size, slots % block_size
        for x, cache, scale in ((k, caches[0], scales[0]), (v, caches[1], scales[1])):
            want_scale = x.float().abs().amax(-1) / 448
            torch.testing.assert_close(scale[blocks, offsets], want_scale, rtol=2.0 ** -23, atol=0)
            back = cache[blocks, offsets].float() * scale[blocks, offsets][..., None]
            bound = 2.0 ** -4 * x.float().abs() * (1 + 2.0 ** -20) + 2.0 ** -10 * want_scale[..., None]
            assert ((back - x.float()).abs() <= bound).all(), name
    for got, want in zip(stored["triton"], stored["ref"]):
        assert torch.equal(got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                           want.view(torch.uint8) if want.dtype == torch.float8_e4m3fn else want)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_fp8_cache_head_holding_nan_or_inf_reads_back_nan(bad):
    """A value head with a NaN or an inf reads back as NaN from both stores (the reference's arithmetic gives a
    NaN or inf scale); Triton's max and min drop NaNs, which made that head finite and wrong. Its neighbours
    are untouched."""
    tokens, dim = 2, 64
    positions = torch.zeros(tokens, dtype=torch.int64, device=DEV)
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(tokens, 2, dim, generator=g).to(DEV) for _ in range(2))
    v[1, 0, 5] = bad
    for fn in (rotary.rope_store_ref, rotary.rope_store_triton):
        caches = torch.zeros(2, 2, 4, 2, dim, dtype=torch.float8_e4m3fn, device=DEV)
        scales = torch.ones(2, 2, 4, 2, device=DEV)
        fn(k.clone(), k.clone(), v.clone(), positions, cos_sin(1, dim).to(DEV), *caches,
           torch.arange(tokens, device=DEV), *scales)
        back = caches[1, 0].float() * scales[1, 0][..., None]  # block 0's slots: [4, 2 heads, dim]
        assert back[1, 0].isnan().all(), fn.__name__
        assert back[1, 1].isfinite().all() and back[0].isfinite().all(), fn.__name__


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1e-3, 1e-4, 1e-5])
def test_fp8_attention_keeps_small_value_heads(dtype, magnitude):
    """Values about 1e-4 have scales about 1e-7: p times such a scale in fp16 (the dot's type for an fp8 cache)
    falls into fp16's subnormals. Factored out per tile, the Triton output stays within the roundings of p and
    of the output to the dtype (2**-11 and eps) of the torch reference over the same cache."""
    g = torch.Generator().manual_seed(1)
    ctx, block_size, dim = 128, 16, 64
    k = torch.randn(ctx, 1, dim, generator=g)
    v = torch.randn(ctx, 1, dim, generator=g) * magnitude
    caches = torch.zeros(2, ctx // block_size, block_size, 1, dim, dtype=torch.float8_e4m3fn)
    scales = torch.ones(2, ctx // block_size, block_size, 1)
    attention.store_kv_ref(k, v, caches[0], caches[1], torch.arange(ctx), scales[0], scales[1])
    args = dict(q=(torch.randn(1, 2, dim, generator=g) * 0.5).to(dtype), k_cache=caches[0], v_cache=caches[1],
                block_tables=torch.arange(ctx // block_size, dtype=torch.int32)[None],
                seq_lens=torch.tensor([ctx], dtype=torch.int32), query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                max_query_len=1, scale=dim ** -0.5, k_scale=scales[0], v_scale=scales[1])
    args = {name: a.to(DEV) if torch.is_tensor(a) else a for name, a in args.items()}
    want = attention.paged_attention_ref(**args).float()
    got = attention.paged_attention_triton(**args).float()
    bound = 4 * 2.0 ** -11 + 2 * torch.finfo(dtype).eps
    assert (got - want).norm() <= bound * want.norm()


# ---------------------------------------------------------------- norm, rotary, activation

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype, with_residual):
    g = torch.Generator().manual_seed(2)
    x, residual = (torch.randn(9, 200, generator=g).to(dtype).to(DEV) for _ in range(2))
    weight = (torch.rand(200, generator=g) + 0.5).to(dtype).to(DEV)
    res = residual if with_residual else None
    want = norm.rms_norm_ref(x, weight, 1e-6, res)
    got = norm.rms_norm_triton(x, weight, 1e-6, res)
    # independent check: torch's rms_norm in fp32, cast to x.dtype, times weight (the HF recipe)
    summed = (x + residual) if with_residual else x
    naive = weight * F.rms_norm(summed.float(), (200,), eps=1e-6).to(dtype)
    if with_residual:
        (want, want_res), (got, got_res) = want, got
        assert torch.equal(want_res, summed) and torch.equal(got_res, summed)
    torch.testing.assert_close(want, naive, atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(got, want, atol=TOL[dtype], rtol=TOL[dtype])


def test_rotary_reference_is_hf_rotate_half():
    """rotary_ref (which rope_store's references compose) against HF's q * cos + rotate_half(q) * sin."""
    g = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads, dim = 7, 4, 2, 64
    q, k = torch.randn(tokens, heads, dim, generator=g), torch.randn(tokens, kv_heads, dim, generator=g)
    positions = torch.randint(0, 50, (tokens,), generator=g)
    cache = cos_sin(50, dim)
    got_q, got_k = rotary.rotary_ref(q.clone(), k.clone(), positions, cache)
    cos, sin = (torch.cat([c, c], -1)[:, None] for c in cache[positions].chunk(2, -1))
    for got, x in ((got_q, q), (got_k, k)):
        rotated = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
        torch.testing.assert_close(got, x * cos + rotated * sin, atol=1e-6, rtol=1e-6)


def prologue_batch(tokens, heads, kv_heads, head_dim, dtype, fp8, norm, seed=0, grid=False, device=DEV):
    """rope_store's arguments, with q, k, v as one fused qkv output; slots with padding, filled caches.
    grid: activations are multiples of 1/8 up to 4, so every sum of their squares is exact in fp32."""
    g = torch.Generator().manual_seed(seed)
    size = (tokens, (heads + 2 * kv_heads) * head_dim)
    qkv = torch.randint(-32, 33, size, generator=g) / 8 if grid else torch.randn(size, generator=g) * 2
    block_size, blocks = 4, triton.cdiv(2 * tokens, 4)
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens]
    slots[1::4] = -1  # padding (a single token is not)
    caches = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g)
    scales = torch.rand(2, blocks, block_size, kv_heads, generator=g) * 0.05 + 0.01 if fp8 else (None, None)
    weights = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype) if norm else None for _ in range(2)]
    args = [qkv.to(dtype), torch.randint(0, 100, (tokens,), generator=g), cos_sin(100, head_dim),
            *caches.to(torch.float8_e4m3fn if fp8 else dtype), slots, *scales, *weights]
    return [t.to(device) if t is not None else None for t in args]


def run_prologue(fn, qkv, positions, table, k_cache, v_cache, slots, k_scale, v_scale, *weights, heads, kv_heads):
    """fn on copies, through q/k/v views of the copied qkv: (qkv after, returned q, k_cache, v_cache, k_scale,
    v_scale)."""
    qkv, k_cache, v_cache = qkv.clone(), k_cache.clone(), v_cache.clone()
    k_scale, v_scale = (None if s is None else s.clone() for s in (k_scale, v_scale))
    dim = qkv.shape[1] // (heads + 2 * kv_heads)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    q = fn(q.view(-1, heads, dim), k.view(-1, kv_heads, dim), v.view(-1, kv_heads, dim), positions, table,
           k_cache, v_cache, slots, k_scale, v_scale, *weights)
    return qkv, q, k_cache, v_cache, k_scale, v_scale


# rope_store's bound, relative to the largest |value|. Without norm weights the fused kernel does
# the unfused references' fp32 operations in their order, with their roundings: the same bits.
# With them, each head's D squares are summed in another order (each side within (D-1)u of the
# exact sum, u = 2**-24), so rstd (half that, plus the division, + eps and rsqrt) differs by
# e <= (D + 4)u. Each later rounding to the dtype (epsilon eps) turns an input difference d into
# at most d + one ulp (eps |x|): normed <= (e + eps)|n|, times w <= (e + 2 eps)|o|, rotated
# (|cos|, |sin| <= 1, |o1| + |o2| <= 2 max|y|) <= (2e + 5 eps) max|y|. An fp8 cache rounds once
# more. On a GPU the rotation may also be contracted to an fma: one more rounding either way.
def prologue_bound(dtype, head_dim, norm, gpu=False):
    eps = torch.finfo(dtype).eps
    fma = eps if gpu else 0.0
    return 2 * (head_dim + 4) * 2.0 ** -24 + 5 * eps + fma if norm else fma


def assert_within(got, want, bound):
    """|got - want| <= bound * max|want|; bound 0: the same bits."""
    if bound == 0:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=0,
                                   atol=bound * want.float().abs().max().item())


def check_prologue(args, heads, kv_heads, bound, fp8):
    shape = dict(heads=heads, kv_heads=kv_heads)
    want = run_prologue(rotary.rope_store_ref, *args, **shape)
    got = run_prologue(rotary.rope_store_triton, *args, **shape)
    q_cols = want[1].shape[1] * want[1].shape[2]
    assert torch.equal(got[0][:, q_cols:], args[0][:, q_cols:])  # k and v left as given
    assert torch.equal(want[0][:, q_cols:], args[0][:, q_cols:])
    assert_within(got[0][:, :q_cols], want[0][:, :q_cols], bound)  # q rotated in place...
    assert got[1].data_ptr() == got[0].data_ptr() and torch.equal(got[1].flatten(1), got[0][:, :q_cols])
    assert_within(got[2], want[2], bound + torch.finfo(torch.float8_e4m3fn).eps if fp8 and bound else bound)
    assert_within(got[3], want[3], 0)  # ...k and v in their slots, padding skipped; v is only rounded
    if fp8:  # each head's scale: max|k| / 448 within k's bound, v's the same bits
        assert_within(got[4], want[4], bound)
        assert_within(got[5], want[5], 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_rope_store_matches_unfused_reference(group, head_dim, fp8, norm, dtype):
    g = torch.Generator().manual_seed(group * head_dim)
    kv_heads, tokens = int(torch.randint(1, 4, (), generator=g)), int(torch.randint(1, 20, (), generator=g))
    args = prologue_batch(tokens, group * kv_heads, kv_heads, head_dim, dtype, fp8, norm, seed=group + head_dim)
    check_prologue(args, group * kv_heads, kv_heads, prologue_bound(dtype, head_dim, norm, DEV == "cuda"), fp8)


@pytest.mark.skipif(DEV == "cuda", reason="the GPU's rsqrt is approximate")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("head_dim", [32, 96, 128])
def test_rope_store_norm_is_bit_exact_when_sums_are(head_dim, fp8, dtype):
    """On the grid the sums of squares are exact in any order and the interpreter's rsqrt is
    1 / sqrt as torch's, so rstd agrees and every later rounding must agree too."""
    check_prologue(prologue_batch(13, 8, 2, head_dim, dtype, fp8, norm=True, grid=True), 8, 2, 0, fp8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_silu_and_mul(dtype):
    x = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEV)
    want = activation.silu_and_mul_ref(x)
    torch.testing.assert_close(want, (F.silu(x[:, :300].float()) * x[:, 300:].float()).to(dtype),
                               atol=TOL[dtype], rtol=TOL[dtype])
    torch.testing.assert_close(activation.silu_and_mul_triton(x), want, atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------- fused fp8 producers (RMSNorm, SiLU-and-mul)

def same_fp8(a: fp8.Fp8Tensor, q, scale, dtype):
    return torch.equal(a.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(a.scale, scale) and \
        a.dtype == dtype


def check_rms_norm_fp8(rows, n, dtype, device):
    """The fused kernel is the unfused Triton norm, then the Triton quantizer, bit for bit (the residual too);
    its reference is the same composition of references. Against each other the twins differ as the
    unfused ones do (sum order), so there the values are compared within one e4m3 step."""
    g = torch.Generator().manual_seed(rows)
    x, residual = (torch.randn(rows, n, generator=g).to(dtype).to(device) for _ in range(2))
    weight = (torch.rand(n, generator=g) + 0.5).to(dtype).to(device)
    for res in (None, residual):
        got = norm.rms_norm_fp8_triton(x, weight, 1e-6, res)
        plain = norm.rms_norm_triton(x, weight, 1e-6, res)
        if res is not None:
            (got, got_res), (plain, plain_res) = got, plain
            assert torch.equal(got_res, plain_res)
        q, scale = fp8.quantize_fp8_triton(plain)
        if device == "cuda":  # compiled apart, the two kernels sum a row's squares in float32 in other orders:
            # the scales of 1 x 200 and 2 x 200 rows came out 1-3 ulp apart on an H200, the e4m3 bits equal
            assert torch.equal(got.data.view(torch.uint8), q.view(torch.uint8)) and got.dtype == dtype
            torch.testing.assert_close(got.scale, scale, rtol=4 * 2.0 ** -23, atol=0)
        else:
            assert same_fp8(got, q, scale, dtype)
        want, plain_ref = norm.rms_norm_fp8_ref(x, weight, 1e-6, res), norm.rms_norm_ref(x, weight, 1e-6, res)
        if res is not None:
            want, plain_ref = want[0], plain_ref[0]
        assert same_fp8(want, *fp8.quantize_fp8_ref(plain_ref), dtype)
        # one e4m3 step: 2**-3 relative in the normal range, 2**-9 of the scale below it
        torch.testing.assert_close(got.scale, want.scale, rtol=TOL[dtype], atol=0)
        torch.testing.assert_close(got.data.float() * got.scale, want.data.float() * want.scale,
                                   rtol=2.0 ** -3, atol=2.0 ** -9 * want.scale.item())


def check_silu_and_mul_fp8(rows, inter, dtype, device):
    """As check_rms_norm_fp8, for SiLU-and-mul."""
    x = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(rows)).to(dtype).to(device)
    got = activation.silu_and_mul_fp8_triton(x)
    assert same_fp8(got, *fp8.quantize_fp8_triton(activation.silu_and_mul_triton(x)), dtype)
    want = activation.silu_and_mul_fp8_ref(x)
    assert same_fp8(want, *fp8.quantize_fp8_ref(activation.silu_and_mul_ref(x)), dtype)
    torch.testing.assert_close(got.scale, want.scale, rtol=TOL[dtype], atol=0)
    torch.testing.assert_close(got.data.float() * got.scale, want.data.float() * want.scale,
                               rtol=2.0 ** -3, atol=2.0 ** -9 * want.scale.item())


# rows x width at or below fp8.ONE_PROGRAM run as one program, above it as two launches
@pytest.mark.parametrize("rows,n", [(1, 200), (3, 1000), (40, 500), (0, 64)])
def test_rms_norm_fp8_is_the_norm_then_the_quantizer(rows, n):
    assert (rows * n <= fp8.ONE_PROGRAM) == (rows != 40)
    check_rms_norm_fp8(rows, n, torch.float32, DEV)


@pytest.mark.parametrize("rows,inter", [(1, 300), (2, 3000), (9, 2000), (0, 64)])
def test_silu_and_mul_fp8_is_the_activation_then_the_quantizer(rows, inter):
    check_silu_and_mul_fp8(rows, inter, torch.float32, DEV)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16, 64, 256])
@pytest.mark.parametrize("hidden,inter", [(2048, 6144), (4096, 14336)])  # the 1.7B and 8B shapes
def test_cuda_fused_fp8_producers_at_model_sizes(rows, hidden, inter):
    check_rms_norm_fp8(rows, hidden, torch.bfloat16, "cuda")
    check_silu_and_mul_fp8(rows, inter, torch.bfloat16, "cuda")


# ---------------------------------------------------------------- copies

def copy_cases(device, dtype):
    """(destinations, sources, the indices the kernel may not take) over one guarded destination buffer."""
    g = torch.Generator().manual_seed(6)
    sizes = [10008, 64, 24, 7, 1000]  # elements: 3 tiles with a partial one, aligned, aligned, 7 x 4 bytes, ...
    buf = torch.full((sum(sizes) + 8 * len(sizes) + 3,), -7.0, dtype=dtype, device=device)  # -7: guard
    destinations, offset = [], 4  # 16-byte aligned for 4-byte dtypes
    for n in sizes:
        destinations.append(buf[offset : offset + n])
        offset += n + 8
    sources = [torch.randn(n, generator=g).to(dtype).to(device) for n in sizes]
    sources[4] = torch.randn(25, 40, generator=g).to(dtype).to(device).t()  # strided
    destinations[4] = destinations[4].view(40, 25)
    sources[2] = sources[2].double()  # a cast
    return buf, destinations, sources, {2, 3, 4}


def test_copy_many_triton_copies_every_pair_exactly(monkeypatch):
    """Bit-exact copies, nothing written outside the destinations, and only the pairs the kernel cannot
    take (a cast, a size not a multiple of 16 bytes, a strided source) go through the reference."""
    buf, destinations, sources, fallback = copy_cases(DEV, torch.float32)
    guard = torch.ones_like(buf, dtype=torch.bool)
    for d in destinations:
        guard[(d.data_ptr() - buf.data_ptr()) // 4 :][: d.numel()] = False
    referred = []
    ref = copies.copy_many_ref
    monkeypatch.setattr(copies, "copy_many_ref", lambda d, s: (referred.extend(s), ref(d, s)))
    copies.copy_many_triton(destinations, sources)
    for d, s in zip(destinations, sources):
        assert torch.equal(d, s.to(d.dtype))
    assert (buf[guard] == -7).all()
    assert {i for i, s in enumerate(sources) if any(s is r for r in referred)} == fallback


@pytest.mark.parametrize("plan", [copies.copy_plan_ref, copies.copy_plan_triton])
def test_a_copy_plan_copies_what_the_sources_hold_when_it_runs(plan):
    """A weight transport runs one plan per unchanged bucket, update after update."""
    _, destinations, sources, _ = copy_cases(DEV, torch.float32)
    run = plan(destinations, sources)
    for step in range(2):
        for s in sources:
            s.add_(1.0)  # an optimizer step, in place
        run()
        for d, s in zip(destinations, sources):
            assert torch.equal(d, s.to(d.dtype)), step


# ---------------------------------------------------------------- sampling

def hash_spec(seed, position, token):
    """The noise hash exactly as the design states it, on Python ints."""
    m = 0xFFFFFFFF

    def mix32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & m
        x ^= x >> 15
        x = (x * 0x846CA68B) & m
        return x ^ (x >> 16)

    stream = mix32(mix32((seed & m) ^ 0x9E3779B9) ^ ((seed >> 32) & m))
    key = mix32((mix32(stream ^ (position & m)) + stream) & m)
    return mix32((key + token * 0x9E3779B9) & m)


def stream_values(seeds):
    """The seed's stream value of hash_spec, for a tensor of seeds (the same arithmetic, vectorised)."""
    m = 0xFFFFFFFF

    def mix32(x):
        for shift, c in ((16, 0x7FEB352D), (15, 0x846CA68B)):
            x = x ^ (x >> shift)
            x = (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & m
        return x ^ (x >> 16)

    return mix32(mix32((seeds & m) ^ 0x9E3779B9) ^ ((seeds >> 32) & m))


def test_seeds_whose_streams_differ_in_low_bits_share_no_noise():
    """Two seeds whose stream values differ by d in their low bits (a ^ a' = d): were a position folded in as
    mix(a ^ position) alone, the second stream would be the first one read at position ^ d, and two samples
    would share their noise over their whole length. Seeds found among 2**17 (about 30 pairs with d < 64): no
    key of one at position p is the other's at p ^ d (a chance match has probability 2**-32)."""
    seeds = torch.arange(2 ** 17) * 7919 + (5 << 40)
    a = stream_values(seeds)
    order = torch.argsort(a >> 6)
    close = ((a[order][1:] >> 6) == (a[order][:-1] >> 6)).nonzero()[:, 0]
    assert len(close) >= 10
    p = torch.arange(4096)
    for i in close.tolist():
        s1, s2 = seeds[order[i]], seeds[order[i + 1]]
        d = a[order[i]] ^ a[order[i + 1]]
        same = sampling.noise_key(s1.expand(4096), p) == sampling.noise_key(s2.expand(4096), p ^ d)
        assert same.sum() == 0, (s1, s2, d)


def test_the_samples_of_a_request_have_streams_of_their_own():
    """Sample j of a request keys its noise from the request seed's digest plus j in the low 32 bits (high bits
    equal): n <= MAX_N samples take n different stream values, never two the same (31-bit digests collided
    with probability n**2 / 2**32: 6% at n = 16384)."""
    from rollout_engine.loop import sample_seed
    from rollout_engine.sampling_params import MAX_N, SEED_LIMIT

    from rollout_engine.spec.state import draft_seed

    for base in (0, 4, 2 ** 62 + 3):
        seeds = [sample_seed(base, j) for j in range(MAX_N)]
        drafts = [draft_seed(seed) for seed in seeds]  # a draft model's proposals: streams of their own too
        assert all(0 <= seed < SEED_LIMIT for seed in seeds + drafts)
        assert len(set(stream_values(torch.tensor(seeds + drafts)).tolist())) == 2 * MAX_N


def test_noise_hash_matches_spec():
    g = torch.Generator().manual_seed(5)
    seeds = torch.randint(-2**62, 2**62, (50,), generator=g)
    positions = torch.randint(0, 2**40, (50,), generator=g)
    tokens = torch.randint(0, 2**18, (50,), generator=g)
    u = sampling.uniform_noise(sampling.noise_key(seeds, positions), tokens)
    for s, p, t, got in zip(seeds.tolist(), positions.tolist(), tokens.tolist(), u.tolist()):
        want = torch.tensor((hash_spec(s, p, t) + 0.5) * 2.0 ** -32, dtype=torch.float64)
        assert got == min(want.float().item(), sampling.BELOW_ONE)
    assert 0 < u.min() and u.max() < 1


def every_uniform(spread):
    """The uniforms of hash values 0 .. 2**32 - 1 at log-spaced points, each with its neighbours."""
    base = torch.logspace(0, 32, 400, base=2.0, dtype=torch.float64).long()
    h = (base[:, None] + torch.arange(-spread, spread + 1)).flatten().clamp(0, 2 ** 32 - 1).unique()
    return sampling.uniform_of(h)


def test_exponential_noise_is_accurate_near_zero():
    """E = -log(1 - u) in float32 must hold its relative precision where u (and E) is tiny: that is where a rare
    token's draw is decided. Below SERIES_BELOW the series gives E to a few float32 ulps; above it 1 - u is
    rounded by at most 2**-25 in a number of at least 1/2 while E >= 2**-7, a relative error of at most 2**-17."""
    u = every_uniform(3)
    e = sampling.exponential_of(u).double()
    want = -torch.log1p(-u.double())
    assert ((e - want).abs() / want).max() <= 2 ** -17 + 4 * 2 ** -24
    assert (e[1:] >= e[:-1]).all()  # monotone in u, across the switch to the logarithm
    assert e.min() > 0 and torch.isfinite(e).all()


@pytest.mark.parametrize("p", [1e-4, 1e-6, 1e-7, 1e-8, 1e-9])
def test_the_race_draws_a_rare_token_at_its_probability(p):
    """A token of probability p against one of 1 - p wins the exponential race when E_rare / p < E_common /
    (1 - p); over every hash value h of the rare token's noise (E_common an exact Exp(1) draw), its chance is
    sum_h 2**-32 exp(-E(h) (1 - p) / p), which is p for an exact E. Summed past E = 40 p, the rest is below
    e**-40. The midpoint rule over h steps of 2**-32 is within (2**-32 / p)**2 / 24 (0.3% at 1e-9)."""
    h = torch.arange(0, int(40 * p / (1 - p) * 2 ** 32) + 2)
    e = sampling.exponential_of(sampling.uniform_of(h)).double()
    chance = (torch.exp(-e * (1 - p) / p).sum() * 2.0 ** -32).item()
    assert chance == pytest.approx(p, rel=0.01)


def sampling_batch(batch, vocab, mode, dtype=torch.float32, seed=6, device=DEV):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, vocab, generator=g) * 3
    if mode == "ties":
        logits = logits.round()  # many exact ties in every filter
    temperature = torch.rand(batch, generator=g) + 0.3
    temperature[::5] = 0.0  # greedy rows
    top_k = torch.full((batch,), -1, dtype=torch.int32)
    top_p, min_p = torch.ones(batch), torch.zeros(batch)
    if mode != "plain":
        top_k = torch.randint(1, vocab // 4, (batch,), generator=g, dtype=torch.int32)
        top_k[::3], top_k[1::7] = -1, vocab + 3
        top_p = torch.rand(batch, generator=g) * 0.9 + 0.1
        top_p[::2] = 1.0
        min_p = torch.rand(batch, generator=g) * 0.3
        min_p[1::3] = 0.0
    seeds = torch.randint(-2**62, 2**62, (batch,), generator=g)
    positions = torch.randint(0, 2**34, (batch,), generator=g)
    return [t.to(device) for t in (logits.to(dtype), temperature, top_k, top_p, min_p, seeds, positions)]


def check_same_draws(a, b, tol, min_equal=0.99):
    """Identical tokens up to ties within float rounding; logprobs within tol where tokens agree."""
    same = a[0] == b[0]
    assert same.float().mean() >= min_equal
    for x, y in zip(a[1:], b[1:]):
        torch.testing.assert_close(x[same], y[same], atol=tol, rtol=tol)


COMPILE_TRUNCATED = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import sampling
for draw in (False, True):
    signature = dict(logits_ptr="*bf16", stride_l="i32", vocab="i32", temperature_ptr="*fp32", top_k_ptr="*i32",
                     top_p_ptr="*fp32", min_p_ptr="*fp32", seed_ptr="*i64", position_ptr="*i64", token_ptr="*i64",
                     processed_ptr="*fp32", raw_ptr="*fp32", DRAW="constexpr", BLOCK="constexpr")
    constants = dict(DRAW=draw, BLOCK=sampling.TRUNCATED_BLOCK)
    triton.compile(ASTSource(sampling._sample_truncated_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=sampling.TRUNCATED_WARPS))
"""


def test_truncated_sampling_kernel_compiles_for_the_gpu():
    """The truncated rows' launch (its data-dependent branches inside the scan) built by the compiler at the
    tile and warps the launcher uses, not the interpreter (compile_check)."""
    assert_compiles(COMPILE_TRUNCATED)


@pytest.mark.parametrize("mode", ["plain", "filtered", "ties"])
def test_sample_triton_matches_reference(mode):
    args = sampling_batch(40, 256, mode)
    tri, ref = sampling.sample_triton(*args), sampling.sample_ref(*args)
    check_same_draws(tri, ref, 1e-5)
    assert torch.isfinite(tri[1]).all() and torch.isfinite(tri[2]).all()


@pytest.mark.parametrize("mode", ["plain", "filtered"])
@pytest.mark.parametrize("splits", [2, 4])
def test_sample_split_across_programs_matches_reference(mode, splits):
    """Small batches cut each untruncated row into chunks merged afterwards; truncated rows stay whole.
    The same walk gives given tokens' logprobs."""
    args = sampling_batch(3, 256, mode)
    tri, ref = sampling._launch_rows(*args, None, splits=splits)[:3], sampling.sample_ref(*args)
    check_same_draws(tri, ref, 1e-5, min_equal=1.0)
    given = sampling._launch_rows(*args[:5], None, None, ref[0], splits=splits)[1:3]
    torch.testing.assert_close(given, ref[1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("filters", [dict(top_k=2), dict(top_p=0.85), dict(top_k=3, top_p=0.99)])
def test_signed_zeros_tie_in_the_filters(filters):
    """-0.0 and +0.0 are equal logits: a top-k or top-p threshold on one keeps the other (rounded or underflowing
    logits hold both). Same kept set, tokens and logprobs as the reference, greedy rows included."""
    row = torch.tensor([2.0, 0.0, -0.0, -3.0, -3.0, -4.0, -5.0, -6.0])
    rows = 64
    logits = row.repeat(rows, 1).to(DEV)
    logits[1::2, 1], logits[1::2, 2] = -0.0, 0.0  # either order
    temperature = torch.full((rows,), 2.0, device=DEV)
    temperature[::8] = 0.0
    top_k = torch.full((rows,), filters.get("top_k", -1), dtype=torch.int32, device=DEV)
    top_p = torch.full((rows,), filters.get("top_p", 1.0), device=DEV)
    min_p = torch.zeros(rows, device=DEV)
    seeds, positions = torch.arange(rows, device=DEV) * 7919, torch.arange(rows, device=DEV)
    args = (logits, temperature, top_k, top_p, min_p, seeds, positions)
    tri, ref = sampling.sample_triton(*args), sampling.sample_ref(*args)
    assert torch.equal(tri[0], ref[0])
    torch.testing.assert_close(tri[1:], ref[1:], atol=1e-6, rtol=1e-6)
    assert (ref[0] == 2).any() and (ref[0] == 1).any()  # both zeros are drawn
    everyone = torch.full((rows,), 2, device=DEV)  # the given token -0.0 or +0.0: kept, finite
    torch.testing.assert_close(sampling.token_logprobs_triton(logits, everyone, *args[1:5]),
                               sampling.token_logprobs_ref(logits, everyone, *args[1:5]), atol=1e-6, rtol=1e-6)


def test_top_p_decides_likelier_on_the_logits_not_on_rounded_probabilities():
    """64 distinct logits 1e-9 apart (a huge temperature flattens real ones so): their float32 probabilities all
    round to 1/64, a 64-way tie that kept every token, while exact arithmetic, and the kernel, keep the 32 likeliest
    at top_p 0.5 (the mass strictly above token i is (63 - i) / 64). Same kept set and logprobs in both twins."""
    rows, vocab = 4, 64
    logits = (torch.arange(vocab, dtype=torch.float32) * 1e-9).repeat(rows, 1).to(DEV)
    temperature, top_k = torch.ones(rows, device=DEV), torch.full((rows,), -1, dtype=torch.int32, device=DEV)
    top_p, min_p = torch.full((rows,), 0.5, device=DEV), torch.zeros(rows, device=DEV)
    kept = torch.isfinite(sampling.mode_logprobs(logits, temperature, top_k, top_p, min_p, "processed"))
    assert kept.sum(1).tolist() == [32] * rows and kept[:, 32:].all()
    args = (logits, temperature, top_k, top_p, min_p, torch.arange(rows, device=DEV) * 7919,
            torch.arange(rows, device=DEV))
    tri, ref = sampling.sample_triton(*args), sampling.sample_ref(*args)
    assert torch.equal(tri[0], ref[0]) and (ref[0] >= 32).all()
    torch.testing.assert_close(tri[1], ref[1], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ref[1], torch.full((rows,), math.log(1 / 32), device=DEV), atol=1e-6, rtol=0)

def test_sampling_an_empty_batch():
    args = sampling_batch(0, 64, "filtered")
    for got in (*sampling.sample_triton(*args), *sampling.token_logprobs_triton(args[0], args[0].new_zeros(0).long(),
                                                                                *args[1:5])):
        assert got.shape == (0,)


def test_token_logprobs_match_sample():
    args = sampling_batch(40, 256, "filtered")
    tokens, processed, raw = sampling.sample_ref(*args)
    for fn in (sampling.token_logprobs_ref, sampling.token_logprobs_triton):
        got_processed, got_raw = fn(args[0], tokens, *args[1:5])
        torch.testing.assert_close(got_processed, processed, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_raw, raw, atol=1e-5, rtol=1e-5)
    # any tokens: filtered ones get -inf, the rest agree between the twins
    others = torch.arange(40, device=DEV) * 5 % 256
    ref = sampling.token_logprobs_ref(args[0], others, *args[1:5])
    tri = sampling.token_logprobs_triton(args[0], others, *args[1:5])
    assert torch.isinf(ref[0]).any() and torch.equal(torch.isinf(ref[0]), torch.isinf(tri[0]))
    finite = torch.isfinite(ref[0])
    torch.testing.assert_close(tri[0][finite], ref[0][finite], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(tri[1], ref[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode,filters", [("plain", None), ("plain", False), ("filtered", None)])
def test_processed_probs_triton_matches_reference(mode, filters):
    """The distributions speculation compares: softmax(x / t), one-hot at the raw argmax for greedy rows;
    rows cut into chunks (3 rows: 3 splits each on the CPU). Rows with filters take the reference;
    filters=False promises there are none."""
    args = sampling_batch(3 if mode == "plain" else 12, 300, mode)[:5]
    ref, tri = sampling.processed_probs_ref(*args, filters), sampling.processed_probs_triton(*args, filters)
    greedy = args[1] == 0
    assert greedy.any() and (~greedy).any()
    # float32 sums over 300 terms in another order: a few ulps of each probability
    torch.testing.assert_close(tri, ref, atol=1e-6, rtol=1e-5)
    assert torch.equal(tri[greedy].argmax(1), args[0][greedy].float().argmax(1)) and (tri[greedy].sum(1) == 1).all()


def test_sampling_kernels_refuse_strided_rows():
    """A one-row parameter expanded over k+1 positions is a stride-0 view: indexed by row, rows past the
    first would read whatever follows it in memory. The launchers refuse it, naming the argument."""
    logits, temperature, top_k, top_p, min_p, seeds, positions = sampling_batch(1, 64, "plain")
    spread = lambda t: t[:, None].expand(-1, 3).reshape(-1)
    assert spread(temperature).stride() == (0,)
    with pytest.raises(ValueError, match="top_p must be contiguous"):
        sampling.token_logprobs_triton(logits.expand(3, -1), torch.zeros(3, dtype=torch.long, device=DEV),
                                       spread(temperature).contiguous(), spread(top_k).contiguous(), spread(top_p),
                                       spread(min_p).contiguous())
    args = speculative_batch(2, 2, 64)
    with pytest.raises(ValueError, match="seeds must be contiguous"):
        sampling.rejection_sample_triton(*args[:3], args[3].repeat_interleave(2)[::2], args[4])


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_draw_does_not_depend_on_the_batch(impl):
    sample = getattr(sampling, f"sample_{impl}")
    args = sampling_batch(12, 128, "filtered")
    whole = sample(*args)[0]
    order = torch.randperm(12, generator=torch.Generator().manual_seed(7)).to(DEV)
    assert torch.equal(sample(*[a[order] for a in args])[0], whole[order])
    assert torch.equal(sample(*[a[3:4] for a in args])[0], whole[3:4])


def test_filtered_tokens_are_never_chosen():
    batch, vocab = 24, 200
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)).expand(batch, vocab) * 2
    top5 = set(logits[0].topk(5).indices.tolist())
    args = [logits.contiguous(), torch.full((batch,), 2.0), torch.full((batch,), 5, dtype=torch.int32),
            torch.ones(batch), torch.zeros(batch), torch.arange(batch), torch.zeros(batch, dtype=torch.long)]
    args = [a.to(DEV) for a in args]
    for fn in (sampling.sample_ref, sampling.sample_triton):
        tokens, processed, _ = fn(*args)
        assert set(tokens.tolist()) <= top5 and len(set(tokens.tolist())) > 1
        assert torch.isfinite(processed).all()


@pytest.mark.parametrize("filters", [dict(), dict(top_k=4), dict(top_p=0.7), dict(min_p=0.2),
                                     dict(top_k=6, top_p=0.8, min_p=0.05)])
def test_reference_samples_the_filtered_softmax(filters):
    """Frequencies over 40000 seeds match the filtered distribution (within 5 sigma)."""
    n, vocab = 40000, 10
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(9)) * 1.5
    temperature = 0.8
    p = (logits / temperature).softmax(0)
    keep = torch.ones(vocab, dtype=torch.bool)
    if "top_k" in filters:
        keep &= logits >= logits.topk(filters["top_k"]).values[-1]
    p = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
    if "top_p" in filters:
        keep &= torch.tensor([p[p > x].sum() < filters["top_p"] for x in p])
    if "min_p" in filters:
        keep &= p >= filters["min_p"] * p.max()
    want = torch.where(keep, p, 0) / torch.where(keep, p, 0).sum()
    tokens, _, _ = sampling.sample_ref(
        logits.expand(n, vocab), torch.full((n,), temperature),
        torch.full((n,), filters.get("top_k", -1), dtype=torch.int32), torch.full((n,), filters.get("top_p", 1.0)),
        torch.full((n,), filters.get("min_p", 0.0)), torch.arange(n) * 7919, torch.full((n,), 3))
    freq = torch.bincount(tokens, minlength=vocab).float() / n
    assert (freq[~keep] == 0).all()
    assert ((freq - want).abs() <= 5 * (want * (1 - want) / n).sqrt() + 1e-9).all()


# ---------------------------------------------------------------- rejection sampling

def speculative_batch(batch, k, vocab, seed=10, device=DEV, sharp=1.0):
    g = torch.Generator().manual_seed(seed)
    draft = (torch.randn(batch, k, vocab, generator=g) * sharp).softmax(-1)
    target = (torch.randn(batch, k + 1, vocab, generator=g) * sharp).softmax(-1)
    target[:, :k] = 0.5 * target[:, :k] + 0.5 * draft  # overlap, so some drafts get accepted
    tokens = torch.multinomial(draft.flatten(0, 1), 1, generator=g).view(batch, k)
    seeds = torch.randint(0, 2**62, (batch,), generator=g)
    positions = torch.randint(0, 2**20, (batch,), generator=g)
    return [t.to(device) for t in (tokens, draft, target, seeds, positions)]


@pytest.mark.parametrize("splits", [1, 3, 5])
def test_rejection_sample_triton_matches_reference(splits):
    """Each row's races cut into chunks merged afterwards give the whole row's draws."""
    args = speculative_batch(48, 4, 300, sharp=3.0)
    out_ref, num_ref = sampling.rejection_sample_ref(*args)
    out_tri, num_tri = sampling.rejection_sample_triton(*args, splits=splits)
    assert len(set(num_ref.tolist())) > 2  # a spread of acceptance lengths
    assert torch.equal(num_tri, num_ref) and torch.equal(out_tri, out_ref)
    for row, drafts, n in zip(out_ref.tolist(), args[0].tolist(), num_ref.tolist()):
        assert row[:n - 1] == drafts[:n - 1]  # accepted drafts, then one sampled token, then -1
        assert row[n - 1] >= 0 and all(t == -1 for t in row[n:])


def test_rejection_sample_keeps_the_target_distribution():
    """The first emitted token is distributed as the target's first distribution."""
    n, k, vocab = 40000, 2, 6
    g = torch.Generator().manual_seed(11)
    draft = torch.randn(k, vocab, generator=g).softmax(-1)
    target = torch.randn(k + 1, vocab, generator=g).softmax(-1)
    tokens = torch.multinomial(draft, n, replacement=True, generator=g).T.contiguous()
    out, num = sampling.rejection_sample_ref(tokens, draft.expand(n, k, vocab), target.expand(n, k + 1, vocab),
                                             torch.arange(n) * 104729, torch.zeros(n, dtype=torch.long))
    freq = torch.bincount(out[:, 0], minlength=vocab).float() / n
    assert ((freq - target[0]).abs() <= 5 * (target[0] * (1 - target[0]) / n).sqrt()).all()
    accept_rate = torch.minimum(target[0], draft[0]).sum()  # P(accept) = sum min(p, q)
    assert abs((num > 1).float().mean() - accept_rate) < 0.02


def test_rejection_sample_one_hot_is_greedy_verification():
    vocab = 50
    target_tokens = torch.tensor([[4, 7, 9, 1], [4, 8, 9, 1], [5, 7, 9, 2]])
    draft_tokens = torch.tensor([[4, 7, 9], [4, 7, 9], [4, 7, 9]])
    args = [draft_tokens, F.one_hot(draft_tokens, vocab).float(), F.one_hot(target_tokens, vocab).float(),
            torch.arange(3), torch.zeros(3, dtype=torch.long)]
    for fn in (sampling.rejection_sample_ref, sampling.rejection_sample_triton):
        out, num = fn(*[a.to(DEV) for a in args])
        assert num.tolist() == [4, 2, 1]
        assert out.tolist() == [[4, 7, 9, 1], [4, 8, -1, -1], [5, -1, -1, -1]]


def test_get_ops_picks_by_device():
    ops = get_ops("cpu")
    assert ops.paged_attention is attention.paged_attention_ref and ops.sample is sampling.sample_ref
    assert get_ops("cuda:0").rejection_sample is sampling.rejection_sample_triton
    assert ops.linear is torch.nn.functional.linear
    names = {"paged_attention", "rms_norm", "rope_store", "silu_and_mul", "sample", "token_logprobs",
             "processed_probs", "rejection_sample", "copy_many", "copy_plan", "nonfinite", "quantize_fp8",
             "fp8_scale", "quantize_fp8_scaled", "fp8_linear", "rms_norm_fp8", "silu_and_mul_fp8", "linear",
             "quantize_shards_plan", "linear_silu_and_mul", "rms_norm_for_linear", "rope_store_attention",
             "projection_launches"}
    assert set(vars(ops)) == names
    for device in ("cpu", "cuda:0"):
        assert set(vars(get_ops(device, batch_invariant=True))) == names


def test_get_ops_batch_invariant_swaps_the_batch_dependent_ops():
    """rollout_kernels/batch_invariant.py's audit: the matmul, attention's key split and (Triton) the vocabulary split."""
    from rollout_kernels import batch_invariant

    cpu, cuda = get_ops("cpu", batch_invariant=True), get_ops("cuda:0", batch_invariant=True)
    assert cpu.linear is batch_invariant.batch_invariant_linear_ref
    assert cuda.linear is batch_invariant.batch_invariant_linear_triton
    assert cpu.paged_attention.func is attention.paged_attention_ref and cpu.paged_attention.keywords == {
        "fixed_split": True}
    assert cuda.paged_attention.func is attention.paged_attention_triton
    assert cpu.sample is sampling.sample_ref and cpu.rms_norm is norm.rms_norm_ref
    for name in ("sample", "token_logprobs", "processed_probs", "rejection_sample"):
        assert getattr(cuda, name).keywords == {"splits": sampling.FIXED_VOCAB_SPLITS}


# ---------------------------------------------------------------- GPU: bfloat16 at model sizes

@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("shape", ["mixed", "decode", "single"])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8), (28, 4)])
def test_gpu_attention_bf16(heads, kv_heads, shape, fp8):
    q_lens, ctx_lens = {
        "mixed": ([1, 5, 0, 700, 300, 1], [4000, 2000, 10, 0, 1500, 3]),
        "decode": ([1] * 48, torch.randint(1, 4096, (48,), generator=torch.Generator().manual_seed(0)).tolist()),
        "single": ([5], [4091]),  # split-K
    }[shape]
    args = paged_batch(q_lens, ctx_lens, heads, kv_heads, 128, dtype=torch.bfloat16, fp8=fp8)
    rows = owned(args)
    torch.testing.assert_close(attention.paged_attention_triton(**args)[rows].float(),
                               attention.paged_attention_ref(**args)[rows].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_attention_split_k_under_cuda_graph():
    """Decode captured once, replayed with other context lengths (the split grid is fixed)."""
    args = paged_batch([1] * 4, [4000] * 4, 16, 8, 128, dtype=torch.bfloat16)  # tables cover 4001 tokens
    assert attention._num_splits(4 * 8, 1, args["block_tables"].shape[1] * 16, args["q"].device) > 1
    attention.paged_attention_triton(**args)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.paged_attention_triton(**args)
    for lens in ([4001, 100, 2000, 2], [17, 3000, 5, 3999]):
        args["seq_lens"].copy_(torch.tensor(lens))
        graph.replay()
        torch.testing.assert_close(out[:4].float(), attention.paged_attention_ref(**args)[:4].float(),
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8), (28, 4)])  # 4 kv heads: two slots' scales a sector
def test_gpu_one_row_decode_reads_the_key_its_step_just_stored(heads, kv_heads, fp8):
    """Batch-1 decode as the engine launches it: rope_store writes this step's key and value, and attention,
    launched while rope_store still runs (dependent launch), loads its older keys before waiting for it. The
    step's key points along its query, so its value dominates the output: a value read before rope_store's
    store (the previous replay's) would show at once. Captured once, replayed 50 times with new inputs."""
    context = 1023
    args = paged_batch([1], [context], heads, kv_heads, 128, dtype=torch.bfloat16, fp8=fp8)
    table = args["block_tables"][0].long()
    slot = (table[context // 16] * 16 + context % 16).view(1)
    group = heads // kv_heads
    q_in = torch.empty(1, heads, 128, dtype=torch.bfloat16, device=DEV)
    k_in, v_in = (torch.empty(1, kv_heads, 128, dtype=torch.bfloat16, device=DEV) for _ in range(2))
    position, table_cos_sin = torch.tensor([context], device=DEV), cos_sin(context + 1, 128).to(DEV)

    def step():
        q = rotary.rope_store_triton(q_in, k_in, v_in, position, table_cos_sin, args["k_cache"], args["v_cache"], slot,
                                     args.get("k_scale"), args.get("v_scale"))
        return q, attention.paged_attention_triton(**(args | {"q": q}))

    def new_inputs(seed):
        g = torch.Generator(device=DEV).manual_seed(seed)
        q_in.copy_(torch.randn(q_in.shape, generator=g, device=DEV))
        k_in.copy_(q_in[:, ::group] * 2)  # the step's key scores 2 q.q / sqrt(128), about 23; the others about 1
        v_in.copy_(torch.randn(v_in.shape, generator=g, device=DEV) * 4)

    new_inputs(0)
    step()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, out = step()
    for seed in range(1, 51):
        new_inputs(seed)
        graph.replay()
        want = attention.paged_attention_ref(**(args | {"q": q})).float()
        torch.testing.assert_close(out.float(), want, atol=4e-2, rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_norm_silu_bf16():
    x, res = (torch.randn(512, 2048, device=DEV, dtype=torch.bfloat16) for _ in range(2))
    w = torch.rand(2048, device=DEV, dtype=torch.bfloat16) + 0.5
    for got, want in zip(norm.rms_norm_triton(x, w, 1e-6, res), norm.rms_norm_ref(x, w, 1e-6, res)):
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    x = torch.randn(512, 2 * 6144, device=DEV, dtype=torch.bfloat16)
    torch.testing.assert_close(activation.silu_and_mul_triton(x), activation.silu_and_mul_ref(x), atol=2e-2,
                               rtol=2e-2)


@pytest.mark.gpu
@needs_cuda
def test_gpu_copy_many_bf16():
    """A 1.7B-shaped layer into fused destinations, plus a thousand small pairs (every program walks them all)."""
    qkv, gate_up = (torch.zeros(n, 2048, device=DEV, dtype=torch.bfloat16) for n in (4096, 12288))
    sources = [torch.randn(n, 2048, device=DEV, dtype=torch.bfloat16) for n in (2048, 1024, 1024, 6144, 6144)]
    destinations = [qkv[:2048], qkv[2048:3072], qkv[3072:], gate_up[:6144], gate_up[6144:]]
    tiny = torch.zeros(1000, 2056, device=DEV, dtype=torch.bfloat16)  # rows of 4112 bytes: one partial tile
    tiny_sources = torch.randn(1000, 2056, device=DEV, dtype=torch.bfloat16)
    copies.copy_many_triton(destinations + list(tiny), sources + list(tiny_sources))
    assert all(torch.equal(d, s) for d, s in zip(destinations, sources))
    assert torch.equal(tiny, tiny_sources)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 512])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (28, 4, 128), (16, 2, 64)])
def test_gpu_rope_store_bf16(heads, kv_heads, head_dim, tokens, norm, fp8):
    args = prologue_batch(tokens, heads, kv_heads, head_dim, torch.bfloat16, fp8, norm)
    check_prologue(args, heads, kv_heads, prologue_bound(torch.bfloat16, head_dim, norm, gpu=True), fp8)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("mode", ["plain", "filtered"])
def test_gpu_sample_bf16_full_vocab(mode):
    args = sampling_batch(64, 151936, mode, dtype=torch.bfloat16)
    # logprobs: fp32 sums over 152k terms in different orders
    check_same_draws(sampling.sample_triton(*args), sampling.sample_ref(*args), 1e-3)
    tokens = sampling.sample_ref(*args)[0]
    for got, want in zip(sampling.token_logprobs_triton(args[0], tokens, *args[1:5]),
                         sampling.token_logprobs_ref(args[0], tokens, *args[1:5])):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.gpu
@needs_cuda
def test_gpu_rejection_sample_full_vocab():
    args = speculative_batch(32, 4, 151936, sharp=8.0)
    out_tri, num_tri = sampling.rejection_sample_triton(*args)
    out_ref, num_ref = sampling.rejection_sample_ref(*args)
    assert (num_tri == num_ref).float().mean() >= 0.95
    assert (out_tri == out_ref).all(1).float().mean() >= 0.95


def test_attention_ignores_garbage_past_the_context():
    """Pool memory past a sequence's last token is uninitialised and may hold inf or NaN."""
    args = paged_batch(q_lens=[1, 3], ctx_lens=[20, 9], heads=4, kv_heads=2, head_dim=64)
    owned = slice(0, 4)  # the two trailing q rows belong to no sequence
    clean = attention.paged_attention_ref(**args)[owned]
    tables, seq_lens = args["block_tables"].long(), args["seq_lens"].tolist()
    used = {(int(tables[s, p // 16]), p % 16) for s in range(2) for p in range(seq_lens[s])}
    for b in range(args["k_cache"].shape[0]):
        for o in range(16):
            if (b, o) not in used:
                args["k_cache"][b, o], args["v_cache"][b, o] = float("nan"), float("inf")
    for fn in (attention.paged_attention_ref, attention.paged_attention_triton):
        torch.testing.assert_close(fn(**args)[owned], clean, atol=TOL[torch.float32], rtol=0)
