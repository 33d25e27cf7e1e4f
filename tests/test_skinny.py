"""The few-row tensor-core projection (rollout_kernels/skinny.py) against the twin (gemv.gemv_ref), each row's bits
against the same row in another batch, and the engine's ops sending 3 to SKINNY_ROWS rows to it.

Bound (test_gemv's): every fp16/bf16 product is exact in float32, so kernel and twin differ only in the order of
the float32 sums and in each side's final rounding. On the CPU the kernels run in the Triton interpreter, which
has no bfloat16: fp16 there, bf16 on the GPU."""
import pytest
import torch
from compile_check import assert_compiles
from helpers import agreeing_runs, make_prompts
from test_gemv import bound, gated_bound

from rollout_engine import Engine, SamplingParams
from rollout_kernels import fp8, gemv, get_ops, pdl, skinny
from rollout_kernels.gemv import gemv_ref
from rollout_kernels.skinny import skinny_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float16


def operands(rows, n, k, bias, weight_fp8=False, seed=0, dtype=DTYPE):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * torch.linspace(0.2, 3, k)).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype).to(DEV) if bias else None
    w, w_scale = fp8.quantize_fp8_ref(w) if weight_fp8 else (w.to(dtype), None)
    return x, w, b, w_scale


def check(rows, n, k, bias, gated=False, config=None, weight_fp8=False, dtype=DTYPE):
    x, w, b, w_scale = operands(rows, n, k, bias, weight_fp8, dtype=dtype)
    got = skinny_triton(x, w, b, w_scale, gated=gated, config=config)
    want = gemv_ref(x, w, b, w_scale, gated=gated)
    assert got.shape == want.shape == (rows, n // 2 if gated else n) and got.dtype == dtype
    allowed = (gated_bound if gated else bound)(x, w, b, w_scale, dtype)
    assert ((got.float() - want.float()).abs() <= allowed).all()


@pytest.mark.parametrize("rows", [3, 7, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("config", [None, (16, 128, 1), (32, 64, 3)])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_kernel_matches_twin(rows, bias, config, weight_fp8):
    """Partial tiles both ways (n % 16, k % 128), K splits of 256 + 256 + 88; e4m3 weights weight-only."""
    check(rows, 40, 600, bias, config=config, weight_fp8=weight_fp8)


@pytest.mark.parametrize("rows", [3, 16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_gated_kernel_is_the_projection_then_silu_and_mul(rows, bias, weight_fp8):
    check(rows, 2 * 20, 300, bias, gated=True, config=(16, 64, 1), weight_fp8=weight_fp8)
    check(rows, 2 * 20, 300, bias, gated=True, weight_fp8=weight_fp8)
    x, w, b, _ = operands(rows, 2 * 20, 300, bias)
    with pytest.raises(ValueError, match="one K split"):
        skinny_triton(x, w, b, gated=True, config=(16, 64, 2))
    with pytest.raises(ValueError, match="even number of weight rows"):
        skinny_triton(x, w[:-1], None, gated=True)


def test_a_long_weight_splits_k_and_sums_the_partials_once():
    """From 6,144 columns the rule splits K in four; the sum of the float32 partials is rounded once, so the
    result stays within the one-rounding bound (two roundings would not hold it at bf16's 2**-8)."""
    assert skinny.skinny_config(6144, False)[2] == 4 and skinny.skinny_config(2048, False)[2] == 1
    check(5, 24, 6144 + 40, True)
    check(5, 24, 6144 + 40, True, weight_fp8=True)


@pytest.mark.parametrize("config", [None, (32, 128, 2)])
def test_each_row_has_the_same_bits_in_any_batch_the_kernel_takes(config):
    """x is padded to 16 MMA columns whatever the rows, and each column sums alone: row r of a 16-row launch is
    row r of a 3-row launch over the same first rows, bit for bit."""
    x, w, b, _ = operands(16, 48, 520, True)
    whole = skinny_triton(x, w, b, config=config)
    for rows in (3, 9):
        assert torch.equal(skinny_triton(x[:rows], w, b, config=config), whole[:rows])


def test_refusals_name_what_is_allowed():
    x, w, _, _ = operands(3, 16, 64, False)
    with pytest.raises(ValueError, match="1 to 16 rows"):
        skinny_triton(torch.zeros(17, 64, dtype=DTYPE, device=DEV), w)
    with pytest.raises(ValueError, match="bf16 or fp16 x"):
        skinny_triton(x.float(), w.float())
    with pytest.raises(ValueError, match="w_scale goes with"):
        skinny_triton(x, w, None, torch.ones(1, device=DEV))
    assert not skinny.takes_rows(x.float(), 2) and not skinny.takes_rows(x[:2], 2) and skinny.takes_rows(x, 2)
    assert not skinny.takes_weight(x, w.float()) and not skinny.takes_weight(x, w.t()) and skinny.takes_weight(x, w)


def test_engine_ops_send_more_rows_than_the_gemv_up_to_skinny_rows_here(monkeypatch):
    """On the Triton set (here the interpreter), inside a bf16/fp16 model's forward (ops.projection_launches, whose
    launches over these rows take PDL), a projection of 3 to SKINNY_ROWS rows takes this kernel, gated ones too;
    two rows keep the GEMV, 17 rows and float32 weights cuBLAS (F.linear), and batch-invariant mode its own
    matmul. Outside such a forward (tensor parallelism, an fp8 model's LM head) the rows stay on cuBLAS: without
    PDL over them the kernel measured slower there."""
    calls = []
    real = skinny.skinny_triton
    monkeypatch.setattr(skinny, "skinny_triton", lambda *a, **k: calls.append(k.get("gated", False)) or real(*a, **k))
    ops = get_ops("cuda:0")
    x, w, b, _ = operands(17, 32, 64, True)
    with ops.projection_launches(DTYPE, False, False):
        for rows in (2, 3, 16, 17):
            y = ops.linear(x[:rows], w, b)
            assert ((y.float() - gemv_ref(x[:rows], w, b).float()).abs() <= bound(x[:rows], w, b, None, DTYPE)).all()
        assert calls == [False, False]
        ops.linear(x[:4].float(), w.float())
        assert calls == [False, False]
        gated = ops.linear_silu_and_mul(x[:5], w, b)
        assert calls == [False, False, True]
        assert ((gated.float() - gemv_ref(x[:5], w, b, gated=True).float()).abs()
                <= gated_bound(x[:5], w, b, None, DTYPE)).all()
        get_ops("cuda:0", batch_invariant=True).linear(x[:4].float(), w.float())
        monkeypatch.setattr(gemv, "BATCH1_PATH", False)
        ops.linear(x[:4], w, b)
        assert calls == [False, False, True]
        monkeypatch.setattr(gemv, "BATCH1_PATH", True)
    for args in [(DTYPE, False, True), (DTYPE, True, False)]:  # tensor parallel; fp8 projections
        with ops.projection_launches(*args):
            ops.linear(x[:4], w, b), ops.linear_silu_and_mul(x[:5], w, b)
    ops.linear(x[:4], w, b)  # outside any forward
    assert calls == [False, False, True]


@pytest.mark.parametrize("device", ["cuda:0", "cpu"])
def test_an_fp8_step_of_few_rows_is_weight_only_on_both_sets(monkeypatch, device):
    """With gemv.FP8_FEW_ROWS (off by default: slower at the tile rule swept for bf16), 3 to SKINNY_ROWS rows of
    a bf16/fp16 activation: the fp8 engine's norm and SiLU-and-mul leave it
    unquantized and its projections take it as it is (this kernel on the Triton set, the twin on the torch set,
    so the CPU engine computes what the CUDA one does); 17 rows, or a float32 activation, keep the quantized path."""
    monkeypatch.setattr(gemv, "FP8_FEW_ROWS", True)
    calls = []
    real = skinny.skinny_triton
    monkeypatch.setattr(skinny, "skinny_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    ops = get_ops(device)
    x, w, b, w_scale = operands(17, 32, 64, True, weight_fp8=True)
    norm_w = torch.ones(64, dtype=DTYPE, device=DEV)
    act = ops.rms_norm_fp8(x[:5], norm_w, 1e-6)
    assert not isinstance(act, fp8.Fp8Tensor) and not isinstance(ops.silu_and_mul_fp8(x[:5]), fp8.Fp8Tensor)
    y = ops.fp8_linear(act, w, w_scale, b)
    assert ((y.float() - gemv_ref(act, w, b, w_scale).float()).abs() <= bound(act, w, b, w_scale, DTYPE)).all()
    gated = ops.linear_silu_and_mul(act, w, b, w_scale)
    assert ((gated.float() - gemv_ref(act, w, b, w_scale, gated=True).float()).abs()
            <= gated_bound(act, w, b, w_scale, DTYPE)).all()
    assert len(calls) == (2 if device != "cpu" else 0)
    assert isinstance(ops.rms_norm_fp8(x, norm_w, 1e-6), fp8.Fp8Tensor)
    assert isinstance(ops.rms_norm_fp8(x[:5].float(), norm_w.float(), 1e-6), fp8.Fp8Tensor)
    monkeypatch.setattr(gemv, "FP8_FEW_ROWS", False)
    assert isinstance(ops.rms_norm_fp8(x[:5], norm_w, 1e-6), fp8.Fp8Tensor)


def test_launches_up_to_skinny_rows_take_pdl_only_in_steps_whose_projections_are_triton(monkeypatch):
    """A model's forward runs in ops.projection_launches: on the Triton set, for a bf16/fp16 model without fp8
    projections or collectives between layers (every projection of 3-16 rows is this kernel), launches up to
    SKINNY_ROWS take programmatic dependent launch; otherwise (cuBLAS(Lt) between) only the GEMV's rows do."""
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    cuda = torch.device("cuda", 0)
    rows = (0, 1, 2, 3, 16, 17)

    def pdl_rows(ops, *args):
        with ops.projection_launches(*args):
            return [pdl.options(cuda, r)["PDL"] for r in rows]

    gemv_only, all_rows = [False, True, True, False, False, False], [False, True, True, True, True, False]
    triton = get_ops("cuda:0")
    assert pdl_rows(triton, torch.bfloat16, False, False) == all_rows
    assert [pdl.options(cuda, r)["launch_pdl"] for r in rows] == gemv_only  # outside a forward
    assert pdl_rows(triton, torch.float16, False, False) == all_rows
    for args in [(torch.float32, False, False), (torch.bfloat16, True, False), (torch.bfloat16, False, True)]:
        assert pdl_rows(triton, *args) == gemv_only
    assert pdl_rows(get_ops("cuda:0", batch_invariant=True), torch.bfloat16, False, False) == gemv_only
    assert pdl_rows(get_ops("cpu"), torch.bfloat16, False, False) == gemv_only
    monkeypatch.setattr(gemv, "FP8_FEW_ROWS", True)
    assert pdl_rows(triton, torch.bfloat16, True, False) == all_rows
    monkeypatch.setattr(skinny, "SKINNY_ROWS", 2)
    assert pdl_rows(triton, torch.bfloat16, False, False) == gemv_only


COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import skinny
gated, k, fp8_weight = sys.argv[1] == "gated", int(sys.argv[2]), sys.argv[3] == "fp8"
block_n, block_k, split = skinny.skinny_config(k, gated)
pointers = ("x", "w", "bias", "y")
signature = {name: "*bf16" for name in pointers} | {"w": "*u8" if fp8_weight else "*bf16", "w_scale": "*fp32",
                                                   "partials": "*fp32", "M": "i32", "N": "i32", "K": "i32",
                                                   "stride_w": "i32", "k_per_split": "i32"}
constants = dict(W_FP8=fp8_weight, BY_HAND=False, HAS_BIAS=True, GATED=gated, SPLIT_K=split, BLOCK_N=block_n,
                 BLOCK_K=block_k, BLOCK_M=16, PDL=True)
triton.compile(ASTSource(skinny._skinny_kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
               options={"num_warps": 4, "num_stages": 4})
signature = {"partials": "*fp32", "w_scale": "*fp32", "bias": "*bf16", "y": "*bf16", "M": "i32", "N": "i32"}
constants = dict(W_FP8=fp8_weight, HAS_BIAS=True, SPLIT_K=max(split, 2), BLOCK=1024, PDL=True)
triton.compile(ASTSource(skinny._sum_splits_kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.parametrize("gated,k", [("gated", "2048"), ("plain", "2048"), ("plain", "6144")])
@pytest.mark.parametrize("weight", ["bf16", "fp8"])
def test_kernel_compiles_for_sm90(gated, k, weight):
    """The rule's tiles (skinny_config at k columns) build for the H200 with the device's Triton."""
    assert_compiles(COMPILE, gated, k, weight)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 2048), (2048, 6144), (6144, 4096), (4096, 14336),
                                 (151936, 2048)])
@pytest.mark.parametrize("rows", [3, 8, 16])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_cuda_kernel_at_model_sizes(n, k, rows, weight_fp8):
    check(rows, n, k, bias=n == 4096, weight_fp8=weight_fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(12288, 2048), (28672, 4096)])
@pytest.mark.parametrize("rows", [4, 16])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_cuda_gated_kernel_at_model_sizes(n, k, rows, weight_fp8):
    check(rows, n, k, bias=False, gated=True, weight_fp8=weight_fp8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bf16_engine_keeps_its_greedy_tokens_at_few_rows(tiny_checkpoint, monkeypatch):
    """8 prompts decoded together (8 rows a step, then fewer as none finish early: all 8) with the kernel and
    with cuBLAS (SKINNY_ROWS = 2): bf16 changes only the order of the projections' float32 sums, so the greedy
    tokens agree but at near-ties, and the logprobs before a divergence within a few bf16 steps."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = make_prompts(lens=(5, 9, 17, 23, 31, 40, 41, 60))

    def run():
        engine = Engine(tiny_checkpoint, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20)
        outs = [o.outputs[0] for o in engine.generate(prompts, params)]
        return [(o.token_ids, o.logprobs) for o in outs]

    calls = []
    real = skinny.skinny_triton
    monkeypatch.setattr(skinny, "skinny_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    with_kernel = run()
    assert calls, "no step took the kernel"
    monkeypatch.setattr(skinny, "SKINNY_ROWS", 2)
    plain = run()
    assert agreeing_runs(with_kernel, plain) >= 6
