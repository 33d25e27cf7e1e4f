"""rollout_kernels/decode_attention.py: rope_store + paged_attention at one row in one launch, against the two launches
it replaces (the same bits in the interpreter: it computes what they compute, in their order) and against the
torch references."""
import pytest
import torch
import triton
from compile_check import assert_compiles
from helpers import cos_sin

from rollout_kernels import attention, decode_attention, get_ops, rotary

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def decode_step(context, heads, kv_heads, head_dim, dtype, fp8, norm, block_size=8, seed=0):
    """One sequence's decode step after `context` tokens: the qkv output, the step's position and slot, a
    shuffled block table over a pool whose other slots hold noise, and the attention arguments."""
    g = torch.Generator().manual_seed(seed)
    blocks = triton.cdiv(context + 1, block_size) + 3
    table = torch.randperm(blocks, generator=g)[None, :].to(torch.int32)
    pool = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g)
    scales = [None, None]
    if fp8:
        scales = list(torch.rand(2, blocks, block_size, kv_heads, generator=g) * 0.02 + 0.004)
        pool = (pool / torch.stack(scales)[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    else:
        pool = pool.to(dtype)
    qkv = (torch.randn(1, (heads + 2 * kv_heads) * head_dim, generator=g) * 2).to(dtype)
    slot = table[0, context // block_size].long() * block_size + context % block_size
    weights = [(torch.rand(head_dim, generator=g) + 0.5).to(dtype) for _ in range(2)] if norm else []
    step = dict(qkv=qkv, positions=torch.tensor([context]), cos_sin_cache=cos_sin(context + 1, head_dim),
                k_cache=pool[0], v_cache=pool[1], slot_mapping=slot.view(1), block_tables=table,
                seq_lens=torch.tensor([context + 1], dtype=torch.int32),
                query_start_loc=torch.tensor([0, 1], dtype=torch.int32), max_query_len=1, scale=head_dim ** -0.5,
                k_scale=scales[0], v_scale=scales[1], weights=weights, heads=heads, kv_heads=kv_heads)
    return {k: v.to(DEV) if torch.is_tensor(v) else [w.to(DEV) for w in v] if k == "weights" else v
            for k, v in step.items()}


def run(fn, step):
    """fn on copies of the step's qkv output and caches: (its output, k_cache, v_cache, k_scale, v_scale, qkv)."""
    s = {k: v.clone() if torch.is_tensor(v) else v for k, v in step.items()}
    dim = s["qkv"].shape[1] // (s["heads"] + 2 * s["kv_heads"])
    q, k, v = s["qkv"].split([s["heads"] * dim, s["kv_heads"] * dim, s["kv_heads"] * dim], dim=1)
    out = fn(q.view(1, -1, dim), k.view(1, -1, dim), v.view(1, -1, dim), s["positions"], s["cos_sin_cache"],
             s["k_cache"], s["v_cache"], s["slot_mapping"], s["block_tables"], s["seq_lens"], s["query_start_loc"],
             s["max_query_len"], s["scale"], s["k_scale"], s["v_scale"], *s["weights"])
    return out, s["k_cache"], s["v_cache"], s["k_scale"], s["v_scale"], s["qkv"]


TWO_LAUNCHES = decode_attention.composed(rotary.rope_store_triton, attention.paged_attention_triton)
REFERENCES = decode_attention.composed(rotary.rope_store_ref, attention.paged_attention_ref)


def same_bits(a, b):
    return a is None and b is None or torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("context", [0, 5, 300])
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_one_launch_gives_the_bits_of_the_two(monkeypatch, splits, context, norm, fp8):
    """Output, the step's key and value in the cache (and an fp8 cache's scales) as rope_store then
    paged_attention leave them, with the step's key in a first tile, a later tile or a later split; the qkv
    output is read, not written."""
    monkeypatch.setattr(attention, "_num_splits", lambda *_: splits)
    step = decode_step(context, heads=8, kv_heads=2, head_dim=64, dtype=torch.float32, fp8=fp8, norm=norm)
    fused = run(decode_attention.rope_store_attention_triton, step)
    apart = run(TWO_LAUNCHES, step)
    for got, want in zip(fused[:5], apart[:5]):
        assert same_bits(got, want)
    assert torch.equal(fused[5], step["qkv"])
    want = run(REFERENCES, step)
    torch.testing.assert_close(fused[0], want[0], atol=1e-4, rtol=1e-4)


def test_float16_queries_over_an_fp8_cache():
    step = decode_step(40, heads=8, kv_heads=2, head_dim=64, dtype=torch.float16, fp8=True, norm=True)
    for got, want in zip(run(decode_attention.rope_store_attention_triton, step)[:5], run(TWO_LAUNCHES, step)[:5]):
        assert same_bits(got, want)


def test_the_op_fuses_one_row_only_and_outside_batch_invariant_mode(monkeypatch):
    """ops.rope_store_attention: one row of one sequence takes the one-launch kernel where the ops are Triton's
    and not batch-invariant; otherwise, and with FUSED_ROPE off, the two ops it stands for."""
    fused = []
    monkeypatch.setattr(decode_attention, "rope_store_attention_triton", lambda *a: fused.append(1))
    ops = decode_attention.with_fused_attention(
        {"rope_store": lambda q, *a: q, "paged_attention": lambda q, *a: "apart"}, fused=True)
    q1, q2 = torch.zeros(1, 4, 8), torch.zeros(2, 4, 8)
    one, two = torch.zeros(1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    call = ops["rope_store_attention"]
    call(q1, None, None, None, None, None, None, None, None, one, None, 1, 1.0)
    assert fused == [1]
    assert call(q2, None, None, None, None, None, None, None, None, two, None, 1, 1.0) == "apart"
    assert call(q1, None, None, None, None, None, None, None, None, one, None, 2, 1.0) == "apart"  # a verify
    assert call(torch.zeros(1, 4, 6), None, None, None, None, None, None, None, None, one, None, 1, 1.0) == "apart"
    monkeypatch.setattr(decode_attention, "FUSED_ROPE", False)
    assert call(q1, None, None, None, None, None, None, None, None, one, None, 1, 1.0) == "apart"
    assert fused == [1]
    unfused = decode_attention.with_fused_attention({"rope_store": lambda q, *a: q,
                                                    "paged_attention": lambda q, *a: "apart"}, fused=False)
    assert unfused["rope_store_attention"](q1, None, None, None, None, None, None, None, None, one, None, 1,
                                           1.0) == "apart"
    cpu = get_ops("cpu")
    step = decode_step(9, heads=4, kv_heads=2, head_dim=16, dtype=torch.float32, fp8=False, norm=True)
    assert torch.equal(run(cpu.rope_store_attention, step)[0], run(REFERENCES, step)[0])


COMPILE = """
import itertools
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import decode_attention
ints = ("half", "stride_qh", "stride_kh", "stride_vh", "stride_c", "stride_kb", "stride_ks", "stride_kh_cache",
        "stride_sb", "stride_ss", "stride_os", "stride_ls")
for fp8, norm in itertools.product([False, True], [False, True]):
    kv = "*fp8e4nv" if fp8 else "*bf16"
    signature = dict(q_ptr="*bf16", k_ptr="*bf16", v_ptr="*bf16", pos_ptr="*i64", cos_sin_ptr="*fp32",
                     slot_ptr="*i64", q_w_ptr="*bf16", k_w_ptr="*bf16", eps="fp32", k_cache_ptr=kv, v_cache_ptr=kv,
                     k_store_ptr="*u8" if fp8 else kv, v_store_ptr="*u8" if fp8 else kv, k_scale_ptr="*fp32",
                     v_scale_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32", table="*i32", seq_lens_ptr="*i32",
                     qk_scale="fp32") | dict.fromkeys(ints, "i32")
    constants = dict(GROUP=2, HEAD_DIM=128, BLOCK_D=64, BLOCK_SIZE=16, BLOCK_M=16, BLOCK_N=64, NUM_SPLITS=32,
                     Q_NORM=norm, K_NORM=norm, FP8=fp8, DOT=tl.float16 if fp8 else tl.bfloat16, PRECISION="tf32",
                     PDL=True)
    signature |= dict.fromkeys(constants, "constexpr")
    triton.compile(ASTSource(decode_attention._rope_attention_kernel, signature, constants),
                   target=GPUTarget("cuda", 90, 32))
"""


def test_kernel_compiles_for_the_gpu():
    """Built by the compiler, not the interpreter (compile_check)."""
    assert_compiles(COMPILE)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("heads,kv_heads,norm", [(16, 8, True), (32, 8, False), (28, 4, True)])
@pytest.mark.parametrize("context", [0, 1023, 4000])
def test_gpu_one_launch_at_model_shapes(heads, kv_heads, norm, context, fp8):
    """The 1.7B (Qwen3, q/k norms) and 8B head shapes in bfloat16 against the two launches: the cache the same
    bits (the same code computes the step's key), the output within bf16 rounding of theirs (the compiled
    rotation may contract differently), and within the references' bound."""
    step = decode_step(context, heads, kv_heads, 128, torch.bfloat16, fp8, norm, block_size=16)
    fused, apart = run(decode_attention.rope_store_attention_triton, step), run(TWO_LAUNCHES, step)
    for got, want in zip(fused[1:5], apart[1:5]):
        assert same_bits(got, want)
    torch.testing.assert_close(fused[0].float(), apart[0].float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(fused[0].float(), run(REFERENCES, step)[0].float(), atol=4e-2, rtol=2e-2)
