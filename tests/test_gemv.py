"""The small-batch projection kernel (kernels/gemv.py) against its torch twin, and the twin against the math.

Bound: every product x_i * w_i (bf16, fp16, fp32 or e4m3 values) is exact in float32, so kernel and twin
differ only in the order of K float32 additions (at most K * 2**-24 of sum |x_i w_i|, for each) and in the
final rounding to the output dtype (half an ulp of |y|: 2**-24 in float32, 2**-8 in bfloat16) on each side."""
import pytest
import torch

from kernels import fp8, get_ops
from kernels.gemv import SMALL_BATCH_ROWS, small_linear_ref, small_linear_triton, takes_small

DEV = "cuda" if torch.cuda.is_available() else "cpu"
EPS = {torch.float32: 2.0 ** -24, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def bound(x, weight, bias, w_scale, dtype):
    """The kernel/twin gap allowed for these operands (see the module)."""
    xv = x.data.float() * x.scale if isinstance(x, fp8.Fp8Tensor) else x.float()
    wv = weight.float() * (w_scale if w_scale is not None else 1.0)
    mag = xv.abs() @ wv.abs().t()
    y = (xv @ wv.t()).abs() + (bias.float().abs() if bias is not None else 0)
    return 2 * weight.shape[1] * 2.0 ** -24 * mag + 2 * EPS[dtype] * (y + mag * 2.0 ** -20)


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


def check(rows, n, k, dtype, weight_fp8=False, x_fp8=False, bias=True, config=None):
    x, w, b, w_scale = operands(rows, n, k, dtype, weight_fp8, x_fp8, bias)
    got = small_linear_triton(x, w, b, w_scale, config=config)
    want = small_linear_ref(x, w, b, w_scale)
    assert got.shape == want.shape == (rows, n) and got.dtype == want.dtype == dtype
    assert ((got.float() - want.float()).abs() <= bound(x, w, b, w_scale, dtype)).all()
    return got


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
@pytest.mark.parametrize("weight_fp8,x_fp8", [(False, False), (True, False), (True, True)])
def test_kernel_matches_twin(rows, weight_fp8, x_fp8):
    # n and k leave partial tiles in both directions
    check(rows, 40, 200, torch.float32, weight_fp8, x_fp8, bias=rows != 2)


@pytest.mark.parametrize("config", [(8, 64, 4), (16, 128, 4), (32, 32, 2)])
def test_every_tile_shape_gives_the_same_sums(config):
    for rows in (1, 3):
        check(rows, 48, 136, torch.float32, config=config)


def test_twin_is_the_scaled_float_product():
    x, w, b, w_scale = operands(3, 24, 64, torch.float32, True, True, True)
    want = (x.data.double() * x.scale.double()) @ (w.double() * w_scale.double()).t() + b.double()
    got = small_linear_ref(x, w, b, w_scale).double()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    x, w, b, _ = operands(3, 24, 64, torch.float32, False, False, True)
    assert torch.allclose(small_linear_ref(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-6)


def test_leading_dims_are_kept_and_rows_limited():
    x, w, b, _ = operands(6, 24, 64, torch.float32, False, False, True)
    assert small_linear_triton(x.view(2, 3, 64), w, b).shape == (2, 3, 24)
    many = torch.zeros(SMALL_BATCH_ROWS + 1, 64, device=DEV)
    with pytest.raises(ValueError, match="at most 16"):
        small_linear_triton(many, w)
    assert not takes_small(many, w) and takes_small(x, w)
    with pytest.raises(ValueError, match="w_scale"):
        small_linear_triton(x, w, None, torch.ones(1, device=DEV))


def test_ops_linear_takes_small_batches_and_equals_the_large_path():
    """get_ops' linear (the one every projection calls) gives the same answer whichever path it takes."""
    ops = get_ops("cuda") if DEV == "cuda" else None
    if ops is None:
        pytest.skip("on the CPU get_ops serves torch's linear; the kernel itself is tested above")
    for rows in (1, 8, 16, 17):
        x, w, b, _ = operands(rows, 256, 512, torch.bfloat16, False, False, True)
        got, want = ops.linear(x, w, b), torch.nn.functional.linear(x, w, b)
        assert ((got.float() - want.float()).abs() <= bound(x, w, b, None, torch.bfloat16)).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(4096, 2048), (2048, 6144), (12288, 2048), (6144, 4096), (4096, 14336)])
@pytest.mark.parametrize("weight_fp8,x_fp8", [(False, False), (True, False), (True, True)])
def test_cuda_kernel_at_model_sizes(rows, n, k, weight_fp8, x_fp8):
    check(rows, n, k, torch.bfloat16, weight_fp8, x_fp8, bias=n == 4096)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen3", "llama-linear-bias"])
@pytest.mark.parametrize("batch", [1, 8])
def test_cuda_engine_decodes_as_on_cublas(family, batch, hf_checkpoint, monkeypatch):
    """bf16 engines with the small-batch kernel and without it (every projection on cuBLAS): the same greedy
    tokens until a near-tie (the two best tokens within bf16 logit noise, 0.05 nats, in the cuBLAS run), and
    the logprobs of the common prefix within bf16 tolerance (a few 2**-8 relative roundings of logits of
    order 10 through the softmax: 0.1)."""
    from rollout_engine import Engine, SamplingParams

    from kernels import gemv

    path, _ = hf_checkpoint(family)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (5, 9, 17, 30, 3, 12, 23, 40)[:batch]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=2)
    runs = {}
    for rows in (0, gemv.MAX_ROWS):
        monkeypatch.setattr(gemv, "SMALL_BATCH_ROWS", rows)
        engine = Engine(path, dtype="bfloat16", kv_cache_memory=16 << 20)
        runs[rows] = [o.outputs[0] for o in engine.generate(prompts, params)]
        del engine
    for cublas, small in zip(runs[0], runs[gemv.MAX_ROWS]):
        same = next((i for i, (a, b) in enumerate(zip(cublas.token_ids, small.token_ids)) if a != b), None)
        end = len(cublas.token_ids) if same is None else same
        assert max(abs(a - b) for a, b in zip(cublas.logprobs[:end], small.logprobs[:end])) <= 0.1
        if same is not None:
            top = sorted(cublas.top_logprobs[same].values(), reverse=True)
            assert top[0] - top[1] <= 0.05, f"diverged at {same} without a near-tie: {cublas.top_logprobs[same]}"
