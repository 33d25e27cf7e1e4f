"""Decode attention over an e4m3 cache on CUDA cores (rollout_kernels/e4m3_decode.py) against the torch reference,
and which launches paged_attention_triton sends it."""
import pytest
import torch
from compile_check import assert_compiles
from test_kernels import DEV, paged_batch

from rollout_kernels import attention, e4m3_decode


# Both sides dequantise the same e4m3 values exactly and work in float32 (the kernel's products are float32, not
# the tile kernel's fp16), so they differ by summation order: a few ulp of outputs of order 1 -> 2e-5. float16
# queries and outputs: the output's rounding (half an ulp of ~1, 5e-4) -> 1e-3.
TOL = {torch.float32: 2e-5, torch.float16: 1e-3}


@pytest.fixture(autouse=True)
def enabled(monkeypatch):
    monkeypatch.setattr(e4m3_decode, "ENABLED", True)


def decode_batch(group, dtype=torch.float32, ctx_lens=(37, 200, 0, 64, 129), block_size=8):
    """One query row a sequence over an fp8 cache; the two rows paged_batch leaves unowned dropped."""
    args = paged_batch([1] * len(ctx_lens), list(ctx_lens), heads=2 * group, kv_heads=2, head_dim=64, fp8=True,
                       dtype=dtype, block_size=block_size)
    args["q"] = args["q"][:len(ctx_lens)]
    return args


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits", [1, 3, 32])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_e4m3_decode_matches_reference(monkeypatch, group, splits, dtype):
    """1-4 query heads a kv head, keys split 1, 3 or 32 ways (splits without keys included), a sequence of one
    key, float32 and float16 queries."""
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    args = decode_batch(group, dtype)
    assert e4m3_decode.takes(args["q"], args["k_scale"], 1, False, None)
    got = attention.paged_attention_triton(**args)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), attention.paged_attention_ref(**args).float(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@pytest.mark.parametrize("tile", [(16, 4, 3), (32, 4, 3), (64, 8, 2)])
def test_e4m3_decode_tiles_agree(tile):
    args = decode_batch(2)
    out = e4m3_decode.e4m3_decode_attention(
        *(args[n] for n in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "scale",
                            "k_scale", "v_scale")), torch.empty_like(args["q"]), tile=tile)
    torch.testing.assert_close(out, attention.paged_attention_ref(**args), atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


def test_e4m3_decode_ignores_slots_past_the_end():
    """Slots after a sequence's last key (in its last page) hold NaN bytes and NaN scales: they get weight 0 and
    are never multiplied into the output, which stays the reference's."""
    args = decode_batch(2, ctx_lens=(20, 3))
    want = attention.paged_attention_ref(**args)
    block_size = args["k_cache"].shape[1]
    for s, n in enumerate(args["seq_lens"].tolist()):
        page = args["block_tables"][s, (n - 1) // block_size].long()
        for cache, scale in ((args["k_cache"], args["k_scale"]), (args["v_cache"], args["v_scale"])):
            cache.view(torch.uint8)[page, n % block_size or block_size:] = 0x7F  # e4m3 NaN
            scale[page, n % block_size or block_size:] = float("nan")
    got = attention.paged_attention_triton(**args)
    assert got.isfinite().all()
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_e4m3_decode_takes_only_one_row_decode_over_an_fp8_cache(monkeypatch):
    """Only when ENABLED. Verify and prefill rows, a bf16 cache, more than MAX_GROUP query heads a kv head, pages
    that are not a whole number of key tiles, batch-invariant mode and shared prefixes stay on the tile kernel."""
    args = decode_batch(2)
    q, scale = args["q"], args["k_scale"]
    assert e4m3_decode.takes(q, scale, 1, False, None)
    monkeypatch.setattr(e4m3_decode, "ENABLED", False)
    assert not e4m3_decode.takes(q, scale, 1, False, None)
    monkeypatch.setattr(e4m3_decode, "ENABLED", True)
    assert not e4m3_decode.takes(q, scale, 2, False, None)
    assert not e4m3_decode.takes(q, None, 1, False, None)
    assert not e4m3_decode.takes(q, scale, 1, True, None)
    assert not e4m3_decode.takes(q, scale, 1, False, object())
    odd_pages = decode_batch(2, block_size=24)  # 16-key tiles would cross pages
    assert not e4m3_decode.takes(odd_pages["q"], odd_pages["k_scale"], 1, False, None)
    wide = decode_batch(e4m3_decode.MAX_GROUP + 1)
    assert not e4m3_decode.takes(wide["q"], wide["k_scale"], 1, False, None)
    torch.testing.assert_close(attention.paged_attention_triton(**wide), attention.paged_attention_ref(**wide),
                               atol=TOL[torch.float32], rtol=TOL[torch.float32])


@pytest.mark.parametrize("members, splits", [(2, 1), (4, 3)])
def test_shared_prefix_suffixes_match_the_reference(monkeypatch, members, splits):
    """With groups, each sequence's own keys here and the groups' prefixes on the tile kernel, merged: rows in a
    group and rows in none (whose prefix partials this kernel leaves empty), the own keys split 1 or 3 ways."""
    from test_shared_prefix import grouped_batch, shared_of
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    launched = []
    monkeypatch.setattr(e4m3_decode, "launch", lambda *a, **k: launched.append(1) or LAUNCH(*a, **k))
    args = grouped_batch(fp8=True)
    shared = shared_of(args, members)
    assert 0 in shared.first_key.tolist()
    got = attention.paged_attention_triton(**args, shared=shared)
    assert launched
    torch.testing.assert_close(got, attention.paged_attention_ref(**args), atol=TOL[torch.float32],
                               rtol=TOL[torch.float32])


LAUNCH = e4m3_decode.launch

COMPILE = """
import itertools
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from rollout_kernels import e4m3_decode
ints = ("kv_heads", "stride_qt", "stride_qh", "stride_os", "stride_ls", "stride_kb", "stride_ks", "stride_kh",
        "stride_bt", "stride_sb", "stride_ss")
for group, prefix_splits, pdl in itertools.product([1, 2, 3, 4], [0, 4], [False, True]):
    signature = dict(q_ptr="*bf16", k_ptr="*u8", v_ptr="*u8", k_scale_ptr="*fp32", v_scale_ptr="*fp32",
                     out_ptr="*fp32", lse_ptr="*fp32", block_tables_ptr="*i32", seq_lens_ptr="*i32",
                     query_start_loc_ptr="*i32", first_key_ptr="*i32", qk_scale="fp32") | dict.fromkeys(ints, "i32")
    constants = dict(GROUP=group, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=e4m3_decode.TILE[0], NUM_SPLITS=8, PDL=pdl,
                     PREFIX_SPLITS=prefix_splits, GROUP_POW2=4 if group > 2 else group)
    signature |= dict.fromkeys(constants, "constexpr")
    compile(ASTSource(e4m3_decode._e4m3_decode_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
            options=dict(num_warps=e4m3_decode.TILE[1], num_stages=e4m3_decode.TILE[2]))
"""


def test_e4m3_decode_compiles_for_the_gpu():
    """1-4 query heads a kv head, plain and suffix launches, with and without PDL, built by the compiler
    (compile_check): the hardware e4m3 conversion is a path the interpreter never takes."""
    assert_compiles(COMPILE)


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="needs CUDA")
@pytest.mark.parametrize("group", [2, 4])
def test_e4m3_decode_matches_reference_bf16_compiled(group):
    """Compiled (the hardware's e4m3 conversion) with bf16 queries: one rounding of the output to bf16."""
    args = decode_batch(group, torch.bfloat16, ctx_lens=(1000, 37, 4096, 1))
    got = attention.paged_attention_triton(**args).float()
    want = attention.paged_attention_ref(**args).float()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
