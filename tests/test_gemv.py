"""The batch-1 projection kernel (rollout_kernels/gemv.py) against its torch twin, the twin against the math, and
the engine's batch-1 path (rollout_kernels.get_ops) against the large-batch one.

Bound: every product x_i * w_i (bf16, fp16, fp32 or e4m3 values) is exact in float32, so kernel and twin
differ only in the order of K float32 additions (at most K * 2**-24 of sum |x_i w_i|) and in the final
rounding to the output dtype (half an ulp of |y|: 2**-24 in float32, 2**-8 in bfloat16) on each side."""
import pytest
import torch
from compile_check import assert_compiles

from rollout_kernels import fp8, gemv, get_ops, pdl, skinny
from rollout_kernels.gemv import gemv_ref, gemv_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def values(x):
    return x.data.float() * x.scale if isinstance(x, fp8.Fp8Tensor) else x.float()


def bound(x, weight, bias, w_scale, dtype, input_ulp=0.0):
    """The kernel/twin gap allowed for these operands (see the module); input_ulp: each x_i may also differ
    by that much relative to itself."""
    xv, wv = values(x), weight.float() * (w_scale if w_scale is not None else 1.0)
    mag = xv.abs() @ wv.abs().t()
    y = (xv @ wv.t()).abs() + (bias.float().abs() if bias is not None else 0)
    return (2 * weight.shape[1] * 2.0 ** -24 + input_ulp) * mag + 2 * EPS[dtype] * (y + mag * 2.0 ** -20)


def operands(rows, n, k, dtype, weight_fp8, x_fp8, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * torch.linspace(0.2, 3, k)).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) * 0.05).to(DEV)
    b = (torch.randn(n, generator=g) * 0.1).to(dtype).to(DEV) if bias else None
    w_scale = None
    if weight_fp8:
        w, w_scale = fp8.quantize_fp8_ref(w)
    else:
        w = w.to(dtype)
    if x_fp8:
        x = fp8.Fp8Tensor(*fp8.quantize_fp8_ref(x), dtype)
    return x, w, b, w_scale


def check(n, k, dtype, weight_fp8=False, x_fp8=False, bias=True, config=None, rows=1):
    x, w, b, w_scale = operands(rows, n, k, dtype, weight_fp8, x_fp8, bias)
    got = gemv_triton(x, w, b, w_scale, config=config)
    want = gemv_ref(x, w, b, w_scale)
    assert got.shape == want.shape == (rows, n) and got.dtype == want.dtype == dtype
    assert ((got.float() - want.float()).abs() <= bound(x, w, b, w_scale, dtype)).all()


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_fp8,x_fp8", [(False, False), (True, False), (True, True)])
def test_kernel_matches_twin(weight_fp8, x_fp8, bias, rows):
    check(42, 1100, torch.float32, weight_fp8, x_fp8, bias, rows=rows)  # partial tiles both ways (n % 4, k % 1024)


@pytest.mark.parametrize("rows", [2, 3])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_each_of_several_rows_has_the_bits_of_that_row_alone(weight_fp8, gated, rows):
    """Two or three rows share each weight tile's read and nothing else: at the same tile, row r of the
    launch is what a launch over row r alone computes, bit for bit (and no row reads another's columns)."""
    x, w, b, w_scale = operands(rows, 2 * 21, 1100, torch.float32, weight_fp8, False, True)
    tile = gemv.gemv_config(weight_fp8, 1100, gated, rows=rows)
    together = gemv_triton(x, w, b, w_scale, config=tile, gated=gated)
    assert together.shape == (rows, 21 if gated else 42)
    for r in range(rows):
        assert torch.equal(together[r], gemv_triton(x[r:r + 1], w, b, w_scale, config=tile, gated=gated)[0])


@pytest.mark.parametrize("config", [(2, 64, 4), (8, 128, 4), (16, 32, 2)])
def test_every_tile_shape_gives_the_same_sums(config):
    check(48, 136, torch.float32, config=config)
    check(48, 136, torch.float32, weight_fp8=True, config=config)


def test_twin_is_the_scaled_float_product():
    x, w, b, w_scale = operands(3, 24, 64, torch.float32, True, True, True)
    want = values(x).double() @ (w.double() * w_scale.double()).t() + b.double()
    assert torch.allclose(gemv_ref(x, w, b, w_scale).double(), want, rtol=1e-5, atol=1e-6)
    x, w, b, w_scale = operands(3, 24, 64, torch.float32, True, False, False)
    assert torch.allclose(gemv_ref(x, w, None, w_scale).double(), x.double() @ (w.double() * w_scale.double()).t(),
                          rtol=1e-5, atol=1e-6)


def gated_bound(x, w, b, w_scale, dtype, input_ulp=0.0):
    """The gated kernel/twin gap: each of gate and up within `bound`, carried through silu (slope <= 1.1)
    and the product, plus each side's rounding of the result."""
    half = w.shape[0] // 2
    gate_b, up_b = (b[:half], b[half:]) if b is not None else (None, None)
    err_g = bound(x, w[:half], gate_b, w_scale, dtype, input_ulp)
    err_u = bound(x, w[half:], up_b, w_scale, dtype, input_ulp)
    g, u = gemv_ref(x, w[:half], gate_b, w_scale).float(), gemv_ref(x, w[half:], up_b, w_scale).float()
    silu = torch.nn.functional.silu(g)
    return 1.1 * err_g * (u.abs() + err_u) + silu.abs() * err_u + 2 * EPS[dtype] * ((silu * u).abs() + 2.0 ** -20)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("weight_fp8,x_fp8", [(False, False), (True, False), (True, True)])
def test_gated_kernel_is_the_projection_then_silu_and_mul(weight_fp8, x_fp8, bias):
    """One launch computes what the projection's kernel (at the gated kernel's tile) and then SiLU-and-mul
    compute, bit for bit (the same sums in the same order, rounded to the output dtype before the gate), and
    the twin within the bound."""
    from rollout_kernels.activation import silu_and_mul_triton

    x, w, b, w_scale = operands(1, 2 * 21, 1100, torch.float32, weight_fp8, x_fp8, bias)
    got = gemv_triton(x, w, b, w_scale, gated=True)
    assert got.shape == (1, 21) and got.dtype == torch.float32
    same_tile = gemv.gemv_config(weight_fp8, 1100, gated=True)
    assert torch.equal(got, silu_and_mul_triton(gemv_triton(x, w, b, w_scale, config=same_tile)))
    want = gemv_ref(x, w, b, w_scale, gated=True)
    assert ((got - want).abs() <= gated_bound(x, w, b, w_scale, torch.float32)).all()
    with pytest.raises(ValueError, match="even number of weight rows"):
        gemv_triton(x, w[:-1], None, w_scale, gated=True)


def normed_row(k, dtype, residual=True, seed=3):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 2).to(dtype).to(DEV)
    res = torch.randn(1, k, generator=g).to(dtype).to(DEV) if residual else None
    weight = (1 + 0.1 * torch.randn(k, generator=g)).to(dtype).to(DEV)
    return gemv.NormedRow(x, res, weight, 1e-6, torch.full_like(x, float("nan")) if residual else None)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_normed_row_is_the_norm_kernel_then_the_projection(residual, gated, weight_fp8):
    """A NormedRow x: the projection's kernel computes RMSNorm(x + residual) * weight in its prologue, as
    the norm kernel rounds it, and leaves x + residual in residual_out: the same bits as the norm's kernel
    then the projection's here (the interpreter sums the row in one order); the twin agrees within the
    projection's bound."""
    from rollout_kernels.norm import rms_norm_triton

    row = normed_row(1100, torch.float32, residual)
    _, w, b, w_scale = operands(1, 42, 1100, torch.float32, weight_fp8, False, True)
    got = gemv_triton(row, w, b, w_scale, gated=gated)
    normed = rms_norm_triton(row.x, row.weight, row.eps, row.residual)
    normed, total = normed if residual else (normed, None)
    assert torch.equal(got, gemv_triton(normed, w, b, w_scale, gated=gated))
    if residual:
        assert torch.equal(row.residual_out, total)
    want = gemv_ref(normed, w, b, w_scale, gated=gated)
    allowed = (gated_bound if gated else bound)(normed, w, b, w_scale, torch.float32)
    assert ((got - want).abs() <= allowed).all()


def test_norm_for_linear_defers_one_row_only_and_any_consumer_gets_the_norm():
    """ops.rms_norm_for_linear: a NormedRow at one row on the fused path (its residual_out is what the call
    returned), the plain norm from two rows on and in batch-invariant mode; a NormedRow that reaches a
    projection off the batch-1 kernel is normalised by the norm op first (materialize)."""
    ops = get_ops("cuda:0")
    row = normed_row(64, torch.float32)
    deferred, total = ops.rms_norm_for_linear(row.x, row.weight, row.eps, row.residual)
    assert isinstance(deferred, gemv.NormedRow) and deferred.residual_out is total
    two, _ = ops.rms_norm_for_linear(row.x.repeat(2, 1), row.weight, row.eps, row.residual.repeat(2, 1))
    assert not isinstance(two, gemv.NormedRow)
    invariant = get_ops("cuda:0", batch_invariant=True).rms_norm_for_linear(row.x, row.weight, row.eps)
    assert not isinstance(invariant, gemv.NormedRow)
    w = torch.randn(64, 24, device=DEV).t()  # not unit-stride along K: the cuBLAS path, which needs a tensor
    y = ops.linear(deferred, w)
    normed, want_total = ops.rms_norm(row.x, row.weight, row.eps, row.residual)
    assert torch.allclose(y, normed @ w.t(), rtol=1e-5, atol=1e-5) and torch.equal(total, want_total)


def test_engine_op_fuses_one_row_only_and_outside_batch_invariant_mode():
    """ops.linear_silu_and_mul: the Triton set (run here by the interpreter) takes one gated kernel at one row
    and the projection then silu_and_mul from two rows on; the torch set and batch-invariant mode never
    fuse. Every path equals its projection followed by its SiLU-and-mul."""
    x, w, b, _ = operands(2, 48, 64, torch.float32, False, False, True)
    for device, invariant in (("cuda:0", False), ("cpu", False), ("cuda:0", True)):
        ops = get_ops(device, batch_invariant=invariant)
        for rows in (x[:1], x):
            want = ops.silu_and_mul(ops.linear(rows, w, b))
            assert torch.equal(ops.linear_silu_and_mul(rows, w, b), want), (device, invariant, len(rows))
    calls = []
    triton_ops = get_ops("cuda:0")
    real = gemv.gemv_triton
    try:
        gemv.gemv_triton = lambda *a, **k: calls.append(k.get("gated")) or real(*a, **k)
        triton_ops.linear_silu_and_mul(x[:1], w, b)
    finally:
        gemv.gemv_triton = real
    assert calls == [True]


def test_one_row_with_leading_dims_and_refusals():
    x, w, b, _ = operands(1, 24, 64, torch.float32, False, False, True)
    assert gemv_triton(x.view(1, 1, 64), w, b).shape == (1, 1, 24)
    assert gemv_triton(torch.zeros(2, 1, 64, device=DEV), w).shape == (2, 1, 24)
    with pytest.raises(ValueError, match="one to three rows"):
        gemv_triton(torch.zeros(4, 64, device=DEV), w)
    with pytest.raises(ValueError, match="a NormedRow: one"):
        gemv_triton(gemv.NormedRow(torch.zeros(2, 64, device=DEV), None, torch.ones(64, device=DEV), 1e-6, None), w)
    with pytest.raises(ValueError, match="w_scale"):
        gemv_triton(x, w, None, torch.ones(1, device=DEV))


def test_batch1_path_is_weight_only_fp8_and_larger_batches_quantize_activations():
    """get_ops: at one row the fp8 producers leave the activation unquantized and the projection is
    x (engine dtype) times the e4m3 weight; past GEMV_ROWS rows, the Fp8Tensor path. On every device."""
    ops = get_ops(DEV)
    x, w, b, w_scale = operands(1, 32, 64, torch.float32, True, False, True)
    norm_w = torch.ones(64, device=DEV)
    one = ops.rms_norm_fp8(x, norm_w, 1e-6)
    assert not isinstance(one, fp8.Fp8Tensor)
    assert not isinstance(ops.silu_and_mul_fp8(torch.randn(1, 64, device=DEV)), fp8.Fp8Tensor)
    y = ops.fp8_linear(one, w, w_scale, b)
    assert ((y - gemv_ref(one, w, b, w_scale)).abs() <= bound(one, w, b, w_scale, torch.float32)).all()
    more = gemv.GEMV_ROWS + 1
    many = ops.rms_norm_fp8(x.repeat(more, 1), norm_w, 1e-6)
    assert isinstance(many, fp8.Fp8Tensor)
    assert isinstance(ops.silu_and_mul_fp8(torch.randn(more, 64, device=DEV)), fp8.Fp8Tensor)


@pytest.mark.parametrize("most", [2, 3])
def test_rows_up_to_gemv_rows_take_the_gemv(monkeypatch, most):
    """GEMV_ROWS = 2 or 3: that many rows go where one does (fp8 weight-only, the gated kernel, the GEMV for
    float weights on the Triton set, here the interpreter), a NormedRow still only at one row; one row more
    keeps cuBLAS(Lt) and fp8 activations. Each path within the twin's bound."""
    monkeypatch.setattr(gemv, "GEMV_ROWS", most)
    calls = []
    real = gemv.gemv_triton
    monkeypatch.setattr(gemv, "gemv_triton", lambda *a, **k: calls.append(1) or real(*a, **k))
    ops = get_ops("cuda:0")
    x, w, b, w_scale = operands(most, 32, 64, torch.float32, True, False, True)
    norm_w = torch.ones(64, device=DEV)
    act = ops.rms_norm_fp8(x, norm_w, 1e-6)
    assert not isinstance(act, fp8.Fp8Tensor) and not isinstance(ops.silu_and_mul_fp8(x), fp8.Fp8Tensor)
    y = ops.fp8_linear(act, w, w_scale, b)
    assert ((y - gemv_ref(act, w, b, w_scale)).abs() <= bound(act, w, b, w_scale, torch.float32)).all()
    gated = ops.linear_silu_and_mul(act, w, b, w_scale)
    assert ((gated - gemv_ref(act, w, b, w_scale, gated=True)).abs() <= gated_bound(act, w, b, w_scale, torch.float32)).all()
    float_w = (torch.randn(24, 64) * 0.1).to(DEV)
    assert torch.allclose(ops.linear(x, float_w), x @ float_w.t(), rtol=1e-5, atol=1e-5)
    assert len(calls) == 3
    normed, _ = ops.rms_norm_for_linear(x, norm_w, 1e-6, torch.zeros_like(x))
    assert not isinstance(normed, gemv.NormedRow)
    more = ops.rms_norm_fp8(torch.randn(most + 1, 64, device=DEV), norm_w, 1e-6)
    assert isinstance(more, fp8.Fp8Tensor)
    ops.fp8_linear(more, w, w_scale, b)
    assert len(calls) == 3
    assert not gemv.takes_gemv(torch.zeros(0, 64)) and gemv.takes_gemv(torch.zeros(most, 1, 64))


def test_batch1_path_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(gemv, "BATCH1_PATH", False)
    ops = get_ops(DEV)
    x = torch.randn(1, 64, device=DEV)
    assert isinstance(ops.rms_norm_fp8(x, torch.ones(64, device=DEV), 1e-6), fp8.Fp8Tensor)


COMPILE_ONE_ROW = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import gemv
pointers = ("x", "w", "bias", "y", "x_scale", "w_scale", "res", "norm_w", "res_out")
signature = {name: "*bf16" for name in pointers} | {"eps": "fp32", "N": "constexpr", "K": "i32", "stride_w": "i32"}
rows = int(sys.argv[2])
constants = dict(N=1, X_FP8=False, W_FP8=False, BY_HAND=False, HAS_BIAS=False, GATED=sys.argv[1] == "gated",
                 NORM=rows == 1, HAS_RES=rows == 1, KP=1024, ROWS=rows, BLOCK_N=2, BLOCK_K=1024, PDL=False)
triton.compile(ASTSource(gemv._gemv_kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
"""


@pytest.mark.parametrize("rows", ["1", "2", "3"])
@pytest.mark.parametrize("gated", ["gated", "plain"])
def test_kernel_compiles_for_one_output_row(gated, rows):
    """A weight of one output row (a value or reward head): Triton specialises N == 1 into a Python int,
    which the interpreter does not, so the compiler builds it (compile_check), for one to three rows of x."""
    assert_compiles(COMPILE_ONE_ROW, gated, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 6144), (12288, 2048), (6144, 4096), (4096, 14336),
                                 (151936, 2048)])
@pytest.mark.parametrize("weight_fp8,x_fp8", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_cuda_kernel_at_model_sizes(n, k, weight_fp8, x_fp8, rows):
    check(n, k, torch.bfloat16, weight_fp8, x_fp8, bias=n == 4096, rows=rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k", [(12288, 2048), (28672, 4096), (36, 1100)])
@pytest.mark.parametrize("weight_fp8", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3])
def test_cuda_gated_kernel_at_model_sizes(n, k, weight_fp8, rows):
    """The 1.7B and 8B gate_up shapes (and a ragged one): the gated kernel against its twin, in bf16."""
    x, w, b, w_scale = operands(rows, n, k, torch.bfloat16, weight_fp8, False, n == 36)
    got = gemv_triton(x, w, b, w_scale, gated=True).float()
    want = gemv_ref(x, w, b, w_scale, gated=True).float()
    assert ((got - want).abs() <= gated_bound(x, w, b, w_scale, torch.bfloat16)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n,k,gated", [(4096, 2048, False), (12288, 2048, True), (6144, 4096, False),
                                       (28672, 4096, True)])
@pytest.mark.parametrize("weight_fp8", [False, True])
def test_cuda_normed_row_at_model_sizes(n, k, gated, weight_fp8):
    """qkv and gate_up of the 1.7B and 8B shapes with the norm in the prologue, against the norm kernel's
    output through the twin. The row's sum of squares may add in another order than the norm kernel's, which
    moves 1 / RMS by a few float32 ulps and so a normalised value across a bf16 rounding now and then: the
    bound lets every input differ by one bf16 ulp (2**-7 relative) on top of the projection's own."""
    from rollout_kernels.norm import rms_norm_triton

    row = normed_row(k, torch.bfloat16)
    _, w, b, w_scale = operands(1, n, k, torch.bfloat16, weight_fp8, False, False)
    got = gemv_triton(row, w, None, w_scale, gated=gated).float()
    normed, total = rms_norm_triton(row.x, row.weight, row.eps, row.residual)
    assert torch.equal(row.residual_out, total)
    want = gemv_ref(normed, w, None, w_scale, gated=gated).float()
    allowed = (gated_bound if gated else bound)(normed, w, None, w_scale, torch.bfloat16, input_ulp=2.0 ** -7)
    assert ((got - want).abs() <= allowed).all()


def test_launches_over_the_gemvs_rows_take_pdl(monkeypatch):
    """A launch over 1..GEMV_ROWS rows, a step whose projections are GEMV kernels, asks for programmatic
    dependent launch on a capable GPU; a wider one (cuBLAS projections between) does not. (Here the few-row
    kernel is off: tests/test_skinny.py checks its rows.)"""
    monkeypatch.setattr(skinny, "SKINNY_ROWS", 0)
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "_capable", lambda index: True)
    monkeypatch.setattr(pdl, "interpreted", lambda: False)
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(gemv, "GEMV_ROWS", 2)
    assert [pdl.options(cuda, rows)["PDL"] for rows in (0, 1, 2, 3)] == [False, True, True, False]
    monkeypatch.setattr(gemv, "GEMV_ROWS", 1)
    assert [pdl.options(cuda, rows)["launch_pdl"] for rows in (1, 2)] == [True, False]
    assert not pdl.options(torch.device("cpu"), 1)["PDL"]
