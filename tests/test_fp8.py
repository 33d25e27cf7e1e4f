"""quantization="fp8": the quantizer and the fp8 matmul against their bounds, the engine against transformers
with the same arithmetic emulated, against the unquantized engine, and through every weight path.

Bounds. float8_e4m3fn keeps 3 mantissa bits: a value v = x / scale in the normal range (|v| >= 2**-6) rounds
to the nearest of a grid of spacing 2**(e-3) where 2**e <= |v|, so the error is at most 2**(e-4) <= 2**-4 |v|;
below it the grid is the subnormal one, spacing 2**-9, error at most 2**-10. In x's units:
|x - dq(q(x))| <= 2**-4 |x| + 2**-10 scale (the division x / scale adds 2**-24 relative, covered).
"""
import copy

import pytest
import torch
from compile_check import assert_compiles
from conftest import FAMILIES

from rollout_kernels import activation, copies, fp8, norm
from rollout_engine import Engine, NonFiniteLogitsError, SamplingParams, WeightsNotReadyError
from rollout_engine.config import EngineConfig
from rollout_engine.parallel.bench_ops import fill_kv_random

DEV = "cuda" if torch.cuda.is_available() else "cpu"
REL, SUB = 2.0 ** -4, 2.0 ** -10  # e4m3 rounding: relative in the normal range, absolute (x scale) below it
KV = 16 << 20
MANY = (5, 9, 17, 30, 3, 12, 23, 40)  # prompt lengths for the agreement: 8 x 32 greedy positions


def quant_bound(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return REL * x.abs() + SUB * scale


GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("o_proj",), ("down_proj",))


def shared_scale_quantized(weights: list) -> tuple[list, torch.Tensor]:
    """The engine's fused weight: each shard quantized with the least power of two >= the max of the shards'
    own scales."""
    scale = fp8.power_of_two_up_ref(torch.stack([fp8.quantize_fp8_ref(w)[1] for w in weights]).amax(0))
    return [fp8.quantize_fp8_scaled_ref(w, scale, torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device))
            for w in weights], scale


def emulated(model):
    """A copy of a transformers model whose projections compute as the fp8 engine's: q/k/v quantized with one
    scale (the max of theirs), gate/up likewise, o and down alone, the input quantized per tensor, through
    fp8.fp8_linear_ref. The LM head stays as it is (quantization="fp8")."""
    model = copy.deepcopy(model)
    for name, module in model.named_modules():
        for group in GROUPS:
            linears = [getattr(module, leaf, None) for leaf in group]
            if not all(isinstance(m, torch.nn.Linear) for m in linears):
                continue
            weights, scale = shared_scale_quantized([m.weight.detach() for m in linears])
            for m, w in zip(linears, weights):
                m.forward = lambda x, w=w, s=scale, b=m.bias: fp8.fp8_linear_ref(
                    x.reshape(-1, x.shape[-1]), w, s, b).view(*x.shape[:-1], -1)
    return model


def prompts(lens=(5, 9, 17, 30), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 250, (n,), generator=g).tolist() for n in lens]


def scored(engine, sequences):
    """Each sequence's prompt logprobs (of its own tokens after the first) and the argmax at each position."""
    outs = engine.generate(sequences, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    logprobs, argmax = [], []
    for ids, out in zip(sequences, outs):
        entries = out.prompt_logprobs[1:]
        logprobs.append(torch.tensor([e[t] for e, t in zip(entries, ids[1:])]))
        argmax.append([max(e, key=e.get) for e in entries])
    return logprobs, argmax


def hf_prompt_logprobs(model, ids):
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def fp8_state(engine):
    """The fp8 weights and their scales (buffers: weight_scale, shard_scale)."""
    return {n: p.detach().clone() for n, p in [*engine.model.named_parameters(), *engine.model.named_buffers()]
            if p.dtype == torch.float8_e4m3fn or n.endswith("_scale")}


def assert_same_bits(a: dict, b: dict):
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n].view(torch.uint8) if a[n].element_size() == 1 else a[n],
                           b[n].view(torch.uint8) if b[n].element_size() == 1 else b[n]), n


# ---------------------------------------------------------------- the quantizer and the matmul

@pytest.mark.parametrize("shape,spread", [((64, 96), 1.0), ((3, 4000), 30.0), ((1, 16), 1e-3)])
def test_quantize_dequantize_error_within_e4m3_bound(shape, spread):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * spread * torch.logspace(-4, 0, shape[-1])  # values deep in the subnormals too
    q, scale = fp8.quantize_fp8_ref(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (1,) and scale.dtype == torch.float32
    assert torch.equal(scale, x.abs().max().reshape(1) / 448)
    err = (q.float() * scale - x).abs()
    assert (err <= quant_bound(x, scale)).all()
    assert err.max() > 0.1 * quant_bound(x, scale).max()  # it rounds: the bound is not vacuous


def test_quantize_of_zeros_is_zero_with_a_finite_scale():
    q, scale = fp8.quantize_fp8_ref(torch.zeros(4, 32))
    assert q.float().abs().sum() == 0 and torch.isfinite(scale).all() and scale > 0


@pytest.mark.parametrize("shape", [(1, 64), (7, 333), (3000,)])
def test_triton_quantizer_is_bitwise_the_reference(shape):
    """Through Triton's interpreter on the CPU (its rounding done by hand, as the hardware's), and on CUDA."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 5).to(DEV)
    want, want_scale = fp8.quantize_fp8_ref(x)
    got, got_scale = fp8.quantize_fp8_triton(x)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)


@pytest.mark.parametrize("shape", [(1, 64), (7, 333), (3000,), (9, 4000)])  # (9, 4000): past ONE_PROGRAM
def test_triton_quantizer_paths_and_the_weight_quantizers_are_bitwise_the_reference(shape):
    """quantize_fp8 by one program and by two launches; fp8_scale; quantize_fp8_scaled from a float tensor
    and in place from fp8 values at another scale (a re-quantization): Triton == reference, bit for bit."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 5).to(DEV)
    want, want_scale = fp8.quantize_fp8_ref(x)
    got, got_scale = fp8.quantize_fp8_triton(x)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)) and torch.equal(got_scale, want_scale)
    scales = [fn(x, torch.empty(1, device=DEV)) for fn in (fp8.fp8_scale_ref, fp8.fp8_scale_triton)]
    assert torch.equal(scales[0], want_scale) and torch.equal(scales[1], want_scale)
    larger = want_scale * 3.7
    outs = [fn(x, larger, torch.empty(shape, dtype=torch.float8_e4m3fn, device=DEV))
            for fn in (fp8.quantize_fp8_scaled_ref, fp8.quantize_fp8_scaled_triton)]
    assert torch.equal(outs[0].view(torch.uint8), outs[1].view(torch.uint8))
    for fn in (fp8.quantize_fp8_scaled_ref, fp8.quantize_fp8_scaled_triton):  # the same scale: the same bits
        rows = want.clone()
        assert torch.equal(fn(rows, want_scale, rows, want_scale).view(torch.uint8), want.view(torch.uint8))
    again = [fn(want.clone(), larger, want.clone(), want_scale) for fn in
             (fp8.quantize_fp8_scaled_ref, fp8.quantize_fp8_scaled_triton)]
    assert torch.equal(again[0].view(torch.uint8), again[1].view(torch.uint8))
    dq = want.float() * want_scale  # re-quantized values: one more e4m3 rounding of the old ones (+2 fp32 ops)
    err = (again[0].float() * larger - dq).abs()
    assert (err <= quant_bound(dq, larger) + 2.0 ** -21 * dq.abs()).all()


def broken(shape, bad: float, seed: int = 2) -> torch.Tensor:
    """Random values with one `bad` (NaN or +-inf) among them."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    x.view(-1)[x.numel() // 3] = bad
    return x.to(DEV)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape", [(3, 64), (9, 4000)])  # one program; partial maxima then the cast
def test_one_nan_or_inf_makes_every_quantizer_give_a_nan_scale(bad, shape):
    """A non-finite value anywhere (an activation that overflowed, a weight sent with check_finite=False) gives
    the tensor a NaN scale in the Triton twins as in the references, so all of it dequantizes to NaN and the
    model's logits say so; a scale left finite would serve plausible tokens computed from garbage."""
    x = broken(shape, bad)
    for quantize in (fp8.quantize_fp8_ref, fp8.quantize_fp8_triton):
        q, scale = quantize(x)
        assert torch.isnan(scale).all() and torch.isnan(q.float() * scale).all(), quantize.__name__
    for fp8_scale in (fp8.fp8_scale_ref, fp8.fp8_scale_triton):
        assert torch.isnan(fp8_scale(x, torch.empty(1, device=DEV))).all(), fp8_scale.__name__
    weight = torch.ones(16, x.shape[-1], device=DEV)
    for fn in (norm.rms_norm_fp8_ref, norm.rms_norm_fp8_triton, activation.silu_and_mul_fp8_ref,
               activation.silu_and_mul_fp8_triton):
        out = fn(x, weight[0], 1e-6) if "norm" in fn.__name__ else fn(torch.cat([x, x.abs()], dim=1))
        assert torch.isnan(out.scale).all(), fn.__name__


@pytest.mark.parametrize("plan", [fp8.quantize_shards_plan_ref, fp8.quantize_shards_plan_triton])
def test_a_weight_a_nan_shard_spoiled_serves_nan_until_each_shard_is_sent_again(plan):
    """Loading q, k, v into one fp8 qkv weight (the batched Triton plan and the reference): a NaN in one shard
    gives the whole weight a NaN scale, which loses every shard's values. Each shard sent again comes back, in
    one load or several; until the last has, the others' rows stay NaN (not finite garbage), and then the bits are
    a fresh load's."""
    rows = ((0, 16), (16, 8), (24, 8))
    weight = torch.zeros(32, 64, dtype=torch.float8_e4m3fn, device=DEV)
    weight_scale, shard_scale = torch.ones(1, device=DEV), torch.ones(3, device=DEV)

    def load(sources):
        plan([fp8.Fp8Shards(weight, weight_scale, shard_scale, rows, sources)])()
        return weight.float() * weight_scale

    finite = {i: broken((size, 64), 1.0, seed=i) for i, (_, size) in enumerate(rows)}
    spoiled = finite[1].clone()
    spoiled.view(-1)[5] = float("nan")
    assert torch.isnan(load({**finite, 1: spoiled})).all()
    values = load({1: finite[1]})
    assert torch.isfinite(values[16:24]).all() and torch.isnan(values[:16]).all() and torch.isnan(values[24:]).all()
    values = load({0: finite[0]})
    assert torch.isfinite(values[:24]).all() and torch.isnan(values[24:]).all()
    load({2: finite[2]})
    fresh = torch.zeros_like(weight)
    fresh_scale, fresh_shard_scale = torch.ones(1, device=DEV), torch.ones(3, device=DEV)
    # every tensor a job names is held here: the Triton plan keeps only their addresses (a shard scale made in the
    # call's argument was freed before the plan ran, and its last launch wrote into the freed memory)
    plan([fp8.Fp8Shards(fresh, fresh_scale, fresh_shard_scale, rows, finite)])()
    assert torch.equal(weight_scale, fresh_scale) and torch.equal(weight.view(torch.uint8), fresh.view(torch.uint8))


@pytest.mark.parametrize("shape, rows", [((7, 333), 4), ((9, 4000), 5), ((9, 4000), 0)])  # one program; two
def test_rows_past_the_tokens_do_not_set_the_scale(shape, rows):
    """A CUDA graph's padding rows hold whatever bytes their memory held (an fp8 buffer read as bf16 is up to
    ~4e37): with `rows`, only the first rows set the scale, and those rows quantize as they would alone."""
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 5).to(DEV)
    x[rows:] = 3e37
    count = torch.tensor([rows], dtype=torch.int32, device=DEV)
    alone, alone_scale = fp8.quantize_fp8_ref(x[:rows])
    for quantize in (fp8.quantize_fp8_ref, fp8.quantize_fp8_triton):
        q, scale = quantize(x, count)
        assert torch.equal(scale, alone_scale) and torch.equal(q[:rows].view(torch.uint8), alone.view(torch.uint8))
    assert fp8.quantize_fp8_triton(x)[1] > 1e34  # without `rows` the padding sets it


COMPILE_COUNTED = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import fp8
for rows in (False, True):
    common = dict(n="i32", rows_ptr="*i32", width="i32", TILE="constexpr", ROWS="constexpr")
    for kernel, operands in ((fp8._quantize_one_kernel, dict(x="*bf16", out="*u8", scale_out="*fp32")),
                             (fp8._amax_kernel, dict(x="*bf16", partial="*fp32"))):
        signature = operands | common | ({"min_amax": "fp32"} if kernel is fp8._quantize_one_kernel else {})
        signature = {name: signature[name] for name in kernel.arg_names}
        triton.compile(ASTSource(kernel, signature, dict(TILE=2048, ROWS=rows)), target=GPUTarget("cuda", 90, 32))
"""


def test_quantizers_that_count_rows_compile_for_the_gpu():
    assert_compiles(COMPILE_COUNTED)


PRODUCERS = {"rms_norm_fp8_ref": lambda x, rows=None: norm.rms_norm_fp8_ref(x, torch.ones(x.shape[1]).to(x), 1e-6,
                                                                            rows=rows),
             "rms_norm_fp8_triton": lambda x, rows=None: norm.rms_norm_fp8_triton(x, torch.ones(x.shape[1]).to(x), 1e-6,
                                                                                  rows=rows),
             "silu_and_mul_fp8_ref": activation.silu_and_mul_fp8_ref,
             "silu_and_mul_fp8_triton": activation.silu_and_mul_fp8_triton}


@pytest.mark.parametrize("producer", sorted(PRODUCERS))
@pytest.mark.parametrize("shape, rows", [((7, 334), 4), ((9, 8000), 5), ((9, 8000), 0)])  # one program; two
def test_rows_past_the_tokens_do_not_set_the_scale_of_the_norm_and_activation_producers(producer, shape, rows):
    """The fp8 RMSNorm and SiLU-and-mul quantize their outputs for the next projection: a CUDA graph's padding
    rows, whose inputs come from attention's leftover bytes down the residual stream, set no scale with `rows`,
    and the real rows quantize as they would alone."""
    fn = PRODUCERS[producer]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5)).to(DEV)
    x[rows:] = float("nan")
    alone = fn(x[:rows])
    got = fn(x, torch.tensor([rows], dtype=torch.int32, device=DEV))
    assert torch.equal(got.scale, alone.scale)
    assert torch.equal(got.data[:rows].view(torch.uint8), alone.data.view(torch.uint8))
    assert fn(x).scale.isnan().all()  # without `rows` the padding sets it


COMPILE_PRODUCERS = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import activation, norm
types = dict(x_ptr="*bf16", res_ptr="*bf16", w_ptr="*bf16", out_ptr="*bf16", res_out_ptr="*bf16", partial="*fp32",
             q_ptr="*u8", scale_out="*fp32", rows="i32", n="i32", inter="i32", stride_x="i32", stride_r="i32",
             eps="fp32", min_amax="fp32", rows_ptr="*i32")
for rows in (False, True):
    for one in (False, True):
        for kernel, extra in ((norm._rms_norm_fp8_kernel, dict(HAS_RESIDUAL=True, BLOCK=2048)),
                              (activation._silu_and_mul_fp8_kernel, dict(BLOCK=1024))):
            constants = extra | dict(ONE=one, ROWS=rows)
            signature = {name: "constexpr" if name in constants else types[name] for name in kernel.arg_names}
            triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32))
"""


def test_norm_and_activation_producers_that_count_rows_compile_for_the_gpu():
    assert_compiles(COMPILE_PRODUCERS)


def test_fp8_projection_of_padded_rows_gives_the_real_rows_their_own_product(fp8_engine):
    """The engine's o_proj (an Fp8Linear) passed the rows that hold tokens: the real rows' outputs are those
    of the real rows alone, whatever the padding holds (4 + 4 rows: past the GEMV's three)."""
    engine, _ = fp8_engine
    o_proj = engine.model.model.layers[0].self_attn.o_proj
    x = torch.randn(8, o_proj.weight.shape[1], generator=torch.Generator().manual_seed(3))
    alone = o_proj(x[:4])
    x[4:] = 3e37
    assert torch.equal(o_proj(x, rows=torch.tensor([4], dtype=torch.int32))[:4], alone)
    assert not torch.equal(o_proj(x)[:4], alone)
    calls = []  # and the attention layer passes the step's token count (query_start_loc's last entry)
    forward = o_proj.forward
    o_proj.forward = lambda x, rows=None: calls.append((x.shape[0], rows.tolist())) or forward(x, rows)
    try:
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    finally:
        del o_proj.forward
    assert calls == [(3, [3]), (1, [1])]


@pytest.mark.parametrize("leftover", [1.0, 1e3, float("nan")])
def test_a_graphs_padding_rows_leave_the_real_rows_of_an_fp8_model_as_they_are_alone(fp8_engine, leftover):
    """A decode step padded to a CUDA graph's bucket: attention leaves the padding rows' outputs as their memory
    held them, and o_proj's output for them runs down their residual stream into every later layer's fp8 norm
    and SiLU-and-mul. Only the rows that hold tokens set those scales, so the real rows' hidden states are the
    four rows' alone (they moved by 0.07, or became NaN, when the padding set the scales) up to the order of the
    CPU's float32 sums, which its matmul blocking may change with the row count: a few ulps of values under 4
    (6e-8 measured on one machine, bit-equal on another). 4 + 4 rows: past the GEMV's three, so both runs quantize
    their activations."""
    from rollout_engine.model import AttentionMetadata
    engine, _ = fp8_engine
    ops = engine.model.model.layers[0].self_attn.ops
    attend = ops.rope_store_attention

    def step(padding: int):
        t, i32 = 4 + padding, dict(dtype=torch.int32)
        meta = AttentionMetadata(torch.tensor([0, 16, 32, 48] + [-1] * padding),
                                 torch.tensor([[0], [1], [2], [3]] + [[0]] * padding, **i32), torch.ones(t, **i32),
                                 torch.tensor([0, 1, 2, 3, 4] + [4] * padding, **i32), 1)
        with torch.no_grad():
            return engine.model(torch.tensor([5, 6, 7, 8] + [0] * padding), torch.zeros(t, dtype=torch.int64),
                                meta)[:4]

    def leaving(*args, **kwargs):
        out = attend(*args, **kwargs)
        out[4:] = leftover  # the bytes a padding row holds under a CUDA graph
        return out

    alone = step(0)
    ops.rope_store_attention = leaving
    try:
        torch.testing.assert_close(step(4), alone, rtol=0, atol=1e-5)
    finally:
        ops.rope_store_attention = attend


def matmul_bound(a, w, sa, sw):
    """|fp8 matmul - fp32 matmul| per output: sum_k ea|w| + |a|ew + ea ew with ea, ew each operand's
    quantization bound, plus fp32 summation (K 2**-24 of sum |a||w| per order, two orders)."""
    ea, ew = quant_bound(a, sa), quant_bound(w, sw)
    k = a.shape[-1]
    return ea @ w.abs().t() + a.abs() @ ew.t() + ea @ ew.t() + 2 * k * 2.0 ** -24 * (a.abs() @ w.abs().t())


@pytest.mark.parametrize("rows", [1, 37])
def test_emulated_fp8_matmul_within_the_bound_of_both_quantizations(rows):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(rows, 256, generator=g) * torch.linspace(0.01, 3, 256)
    w = torch.randn(96, 256, generator=g) * 0.05
    w8, sw = fp8.quantize_fp8_ref(w)
    _, sa = fp8.quantize_fp8_ref(a)
    got = fp8.fp8_linear_ref(a, w8, sw)
    err = (got - a @ w.t()).abs()
    bound = matmul_bound(a, w, sa, sw)
    assert (err <= bound).all()
    assert err.max() > 0.01 * bound.max()  # really quantized


def test_shards_sharing_the_max_scale_stay_within_the_bound_of_that_scale():
    """A fused weight's shards quantized with the max of their scales: each value within e4m3's bound at
    that scale (a smaller shard loses relative precision only below 2**-6 of the scale); the fused matmul is
    one matmul per shard."""
    g = torch.Generator().manual_seed(3)
    x, parts = torch.randn(5, 64, generator=g), [torch.randn(n, 64, generator=g) * s for n, s in ((32, 1), (16, 9))]
    weights, scale = shared_scale_quantized(parts)
    assert torch.equal(scale, fp8.power_of_two_up_ref(fp8.quantize_fp8_ref(parts[1])[1]))
    for w, q in zip(parts, weights):
        assert ((q.float() * scale - w).abs() <= quant_bound(w, scale)).all()
    fused = fp8.fp8_linear_ref(x, torch.cat(weights), scale)
    apart = torch.cat([fp8.fp8_linear_ref(x, q, scale) for q in weights], dim=1)
    torch.testing.assert_close(fused, apart, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- the engine

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_engine_is_transformers_with_the_fp8_arithmetic(family, tame_checkpoint):
    """The fp8 engine's logprobs are transformers' with each projection quantized as claimed (per HF tensor,
    activations per tensor): the fp32 emulation's float32 sums in another order, 1e-4."""
    path, model = tame_checkpoint(family)
    engine = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    layer = engine.model.model.layers[0]
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert layer.mlp.down_proj.weight.dtype == torch.float8_e4m3fn
    assert engine.model.model.embed_tokens.weight.dtype == torch.float32  # embedding, norms, head stay
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert_serves_emulated(engine, model)


def assert_serves_emulated(engine, model):
    """One prompt per call: an activation's scale is its step's max, so a batch shares one (the emulation
    runs one sequence)."""
    reference = emulated(model)
    for ids in prompts():
        torch.testing.assert_close(scored(engine, [ids])[0][0], hf_prompt_logprobs(reference, ids), atol=1e-4, rtol=0)


SHORT = pytest.mark.xfail(strict=True, reason="measured 0.910 (KL 1.2e-3): an untied random head over 256 tokens "
                          "has small top-2 margins; llama3, untied too, gives 0.977")


@pytest.mark.parametrize("family", [pytest.param(f, marks=SHORT) if f == "mistral" else f for f in sorted(FAMILIES)])
def test_fp8_engine_agrees_with_the_fp32_engine(family, tame_checkpoint):
    """Teacher-forced on the fp32 engine's greedy tokens, the fp8 engine's argmax is the same token at >= 95%
    of positions; KL(fp32 || fp8) on tokens the fp32 engine samples (k3 estimator) is reported and small.
    Scoring is one prefill of all sequences, so activations share a scale over more tokens than in decode."""
    path, _ = tame_checkpoint(family)
    agreement, kl = agreement_and_kl(Engine(path, device="cpu", kv_cache_memory=KV),
                                     Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8"), family)
    assert 0 < kl < 0.02
    assert agreement >= 0.95


def agreement_and_kl(full, other, label: str, starts=None, tokens: int = 32) -> tuple[float, float]:
    """Teacher-forced on `full`'s greedy tokens, the share of positions where `other`'s argmax is the same
    token; and KL(full || other) on tokens `full` samples (k3 estimator). Both printed."""
    starts = starts or prompts(MANY)
    greedy = full.generate(starts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True), use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(starts, greedy)]
    _, argmax = scored(other, sequences)
    hits = [a == t for p, s, am in zip(starts, sequences, argmax) for a, t in zip(am[len(p) - 1:], s[len(p):])]
    agreement = sum(hits) / len(hits)
    sampled = full.generate(starts, SamplingParams(temperature=1.0, max_tokens=tokens, ignore_eos=True, seed=1,
                                                   logprobs=0), use_tqdm=False)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(starts, sampled)]
    d = torch.cat([(q - f)[len(p) - 1:] for p, q, f in zip(starts, scored(other, sequences)[0],
                                                            scored(full, sequences)[0])])
    kl = (d.exp() - 1 - d).mean().item()
    print(f"\n{label}: greedy agreement {agreement:.3f} over {len(hits)} positions, KL {kl:.2e}, "
          f"mean |dlogp| {d.abs().mean():.2e}")
    return agreement, kl


def test_fp8_lm_head_quantizes_an_untied_head(tame_checkpoint):
    path, _ = tame_checkpoint("llama3")
    engine = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8_lm_head")
    assert engine.model.lm_head.weight.dtype == torch.float8_e4m3fn
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("bad", ["int8", "FP8", "", 8, True, "auto"])
def test_bad_quantization_is_refused_by_name(bad, tame_checkpoint):
    path, _ = tame_checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"quantization=.*allowed: None, 'fp8', 'fp8_lm_head'"):
        Engine(path, device="cpu", kv_cache_memory=KV, quantization=bad)


@pytest.mark.parametrize("combined", [{"batch_invariant": True}, {"tensor_parallel_size": 2}])
def test_a_bad_quantization_is_named_before_a_combination_with_it(combined, tame_checkpoint):
    path, _ = tame_checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"quantization='bogus' is not supported; allowed: None, 'fp8'"):
        Engine(path, device="cpu", kv_cache_memory=KV, quantization="bogus", **combined)


@pytest.mark.parametrize("bad", ["AUTO", "bf17", 3])
def test_a_bad_kv_cache_dtype_names_every_allowed_value(bad, tame_checkpoint):
    path, _ = tame_checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.* allowed: None or 'auto' \(the engine's dtype\), .*'fp8'"):
        Engine(path, device="cpu", kv_cache_memory=KV, kv_cache_dtype=bad)


def test_fp8_on_a_gpu_older_than_ada_is_refused_by_argument(monkeypatch):
    """An A100 (8.0) has no e4m3 tensor cores: each fp8 argument is refused by name there, as nothing on it
    would run; an H100 (9.0) takes them, and the CPU's emulation always does."""
    from rollout_engine.config_checks import check_fp8_device

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    for name, value in (("quantization", "fp8"), ("draft_quantization", "fp8_lm_head"), ("kv_cache_dtype", "fp8")):
        with pytest.raises(ValueError, match=rf"{name}='{value}' needs a GPU of compute capability 8.9 or later"):
            check_fp8_device(cuda, **{name: value})
    check_fp8_device(cuda, quantization=None, kv_cache_dtype=None)
    check_fp8_device(torch.device("cpu"), quantization="fp8")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(cuda, quantization="fp8", kv_cache_dtype="fp8")


def test_fp8_says_which_projections_it_leaves_unquantized(tmp_path, tame_checkpoint):
    """A projection whose sizes fp8 matmuls cannot take (multiples of 16), or fp8_lm_head on a tied head, stays
    unquantized with a warning, never silently."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=100, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.warns(UserWarning, match=r"a projection of 64 -> 200 features stays unquantized"):
        engine = Engine(tmp_path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    mlp = engine.model.model.layers[0].mlp
    assert mlp.gate_up_proj.weight.dtype != torch.float8_e4m3fn and mlp.down_proj.weight.dtype != torch.float8_e4m3fn
    assert engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    with pytest.warns(UserWarning, match=r"this model's LM head is its embedding \(tied\)"):
        Engine(tame_checkpoint("qwen3")[0], device="cpu", kv_cache_memory=KV, quantization="fp8_lm_head")


def test_draft_quantization(tame_checkpoint):
    path, _ = tame_checkpoint("qwen3")
    config = EngineConfig.from_args(path, device="cpu", draft_model=path, num_speculative_tokens=2,
                                    draft_quantization="fp8")
    assert config.model.quantization is None and config.draft.quantization == "fp8"
    config = EngineConfig.from_args(path, device="cpu", draft_model=path, num_speculative_tokens=2,
                                    quantization="fp8")
    assert config.draft.quantization == "fp8"  # "auto": as the target
    config = EngineConfig.from_args(path, device="cpu", draft_model=path, num_speculative_tokens=2,
                                    quantization="fp8", draft_quantization=None)
    assert config.model.quantization == "fp8" and config.draft.quantization is None
    with pytest.raises(ValueError, match="draft_quantization='fp8' needs a draft_model"):
        EngineConfig.from_args(path, device="cpu", draft_quantization="fp8")
    with pytest.raises(ValueError, match="draft_quantization='int4'.*'auto'"):
        EngineConfig.from_args(path, device="cpu", draft_model=path, num_speculative_tokens=2,
                               draft_quantization="int4")


# ---------------------------------------------------------------- every weight path quantizes on the way in

@pytest.fixture
def fp8_engine(tame_checkpoint):
    path, model = tame_checkpoint("qwen2")  # biased qkv: a fused, scaled, biased projection
    return Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8"), model


def test_update_of_one_weight_is_served(fp8_engine):
    engine, model = fp8_engine
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    name = "model.layers.1.mlp.down_proj.weight"
    before = scored(engine, prompts())[0]
    engine.update_weights([(name, changed.state_dict()[name])])
    after = scored(engine, prompts())[0]
    assert all((old - new).abs().max() > 1e-2 for old, new in zip(before, after))  # the update is seen
    assert_serves_emulated(engine, changed)


def qkv_state(engine):
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    return qkv, {shard: qkv.weight[start:start + size].detach().clone() for shard, (start, size) in qkv.shards.items()}


def update_layer0(engine, changed, leaves, path="update_weights"):
    pairs = [(f"model.layers.0.self_attn.{leaf}.weight", changed.state_dict()[f"model.layers.0.self_attn.{leaf}.weight"])
             for leaf in leaves]
    engine.update_weights(pairs) if path == "update_weights" else engine.update_weights_from_buckets([pairs])


@pytest.mark.parametrize("path", ["update_weights", "update_weights_from_buckets"])
def test_update_of_one_qkv_shard_that_keeps_the_scale_keeps_the_others_bits(fp8_engine, path):
    """k_proj alone, halved: the fused scale (the max of q's, k's, v's) stays, so q's and v's rows keep their
    bits; k's rows are the new k quantized with that scale; the engine serves transformers with the new k."""
    engine, model = fp8_engine
    qkv, old = qkv_state(engine)
    old_scale = qkv.weight_scale.clone()
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.weight.mul_(0.5)
    update_layer0(engine, changed, ["k_proj"], path)
    _, new = qkv_state(engine)
    assert torch.equal(qkv.weight_scale, old_scale)
    for shard in ("q", "v"):
        assert torch.equal(new[shard].view(torch.uint8), old[shard].view(torch.uint8))
    want = fp8.quantize_fp8_scaled_ref(changed.model.layers[0].self_attn.k_proj.weight.detach(), old_scale,
                                       torch.empty_like(new["k"]))
    assert torch.equal(new["k"].view(torch.uint8), want.view(torch.uint8))
    assert_serves_emulated(engine, changed)


@pytest.mark.parametrize("path", ["update_weights", "update_weights_from_buckets"])
def test_update_of_one_qkv_shard_that_raises_the_scale_requantizes_the_others(fp8_engine, path):
    """k_proj alone, 10x: the fused scale becomes k's; q's and v's rows are re-quantized to it, their values
    within one e4m3 rounding at the new scale of what they were (plus 2**-21 relative: the fp32 product and
    quotient); k's rows are the new k at that scale. q and v sent again later are quantized afresh, and the
    engine then serves transformers with the new k exactly as emulated."""
    engine, model = fp8_engine
    qkv, old = qkv_state(engine)
    old_scale = qkv.weight_scale.clone()
    before = scored(engine, prompts())[0]
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.weight.mul_(10.0)
    update_layer0(engine, changed, ["k_proj"], path)
    _, new = qkv_state(engine)
    k = changed.model.layers[0].self_attn.k_proj.weight.detach()
    scale = fp8.power_of_two_up_ref(fp8.quantize_fp8_ref(k)[1])
    assert torch.equal(qkv.weight_scale, scale) and scale > old_scale
    assert torch.equal(new["k"].view(torch.uint8),
                       fp8.quantize_fp8_scaled_ref(k, scale, torch.empty_like(new["k"])).view(torch.uint8))
    for shard in ("q", "v"):
        was = old[shard].float() * old_scale
        err = (new[shard].float() * scale - was).abs()
        assert (err <= quant_bound(was, scale) + 2.0 ** -21 * was.abs()).all()
        assert (err[was.abs() >= 2.0 ** -6 * scale] == 0).all()  # a power-of-two step: exact above the subnormals
        assert err.max() > 0  # re-quantized, not left at the old scale
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(before, scored(engine, prompts())[0]))  # k is served
    update_layer0(engine, changed, ["q_proj", "v_proj"], path)
    assert_serves_emulated(engine, changed)


def test_shards_updated_again_and_again_do_not_drift(fp8_engine):
    """The LoRA-like loop: q_proj and v_proj sent at every step, k_proj frozen, q's magnitude moving the fused
    scale up and down. k's rows are re-quantized at each move; with power-of-two scales a move is an exact
    shift of exponent, so k's values (its e4m3 values times the scale) stay what the first move to the
    largest scale left, within e4m3's bound of the true k there (with scales in any ratio, each move rounds
    again and k walks away)."""
    engine, model = fp8_engine
    changed = copy.deepcopy(model)
    attn = changed.model.layers[0].self_attn
    q0 = attn.q_proj.weight.detach().clone()
    qkv, _ = qkv_state(engine)
    seen, scales = [], set()
    for step in range(12):
        with torch.no_grad():
            attn.q_proj.weight.copy_(q0 * (7.3 if step % 2 == 0 else 1.0 + 0.01 * step))
        update_layer0(engine, changed, ["q_proj", "v_proj"])
        scales.add(qkv.weight_scale.item())
        seen.append(qkv_state(engine)[1]["k"].float() * qkv.weight_scale)
    assert len(scales) > 2  # the scale moved both ways, and not between two values only
    assert all(torch.equal(seen[0], later) for later in seen[1:])
    k = attn.k_proj.weight.detach()
    assert ((seen[-1] - k).abs() <= quant_bound(k, torch.tensor([max(scales)]))).all()
    update_layer0(engine, model, ["q_proj", "v_proj"])


def test_a_complete_update_split_across_groups_is_a_fresh_load(tame_checkpoint, monkeypatch):
    """A large model's update copies in groups (GROUP_BYTES), which can split a fused weight's shards: the
    first group quantizes q (say) with a scale that k and v then raise, and q's rows are re-quantized. With
    power-of-two scales that is a shift of exponent, so the weights are a fresh load's: values equal except
    where a double rounding among e4m3's subnormals moves one by a subnormal step (2**-9 of the scale), and
    the same greedy tokens and logprobs."""
    import rollout_engine.weight_store as weight_store

    path, model = tame_checkpoint("llama3")
    fresh = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(0.5)
    engine = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    engine.update_weights(other.state_dict().items())  # the scales fall, to be raised again below
    monkeypatch.setattr(weight_store, "GROUP_BYTES", 16 << 10)
    engine.update_weights(model.state_dict().items())
    for (name, got), (_, want) in zip(engine.model.named_modules(), fresh.model.named_modules()):
        if hasattr(got, "weight_scale"):
            assert torch.equal(got.weight_scale, want.weight_scale), name
            step = (got.weight.float() - want.weight.float()).abs()
            assert (step <= 2.0 ** -9).all(), name
    (got_logprobs, got_argmax), (want_logprobs, want_argmax) = scored(engine, prompts()), scored(fresh, prompts())
    assert got_argmax == want_argmax and all(torch.equal(a, b) for a, b in zip(got_logprobs, want_logprobs))


def test_a_complete_update_split_in_two_after_a_level_2_sleep_is_a_fresh_load(tame_checkpoint):
    """A level-2 sleep discards the weights and their scales: a complete update that then comes in two calls
    (q and gate first, k, v and up after) quantizes as a fresh engine's does. The discarded weights' k and up
    were 50 times larger: their kept shard scales set the scale the first call's shards were cast with, too
    coarse for them, and their bits stayed coarse when the second call lowered it. (A second call whose shards
    raise a fused layer's scale past what the first call's set is a partial update of a whole layer: the first
    call's shards are cast again at the coarser scale, rounded twice, as Fp8Linear says; one call, or whole
    layers per call, is a fresh load's bits.)"""
    path, model = tame_checkpoint("llama3")
    fresh = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    old = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in old.named_parameters():
            if "k_proj" in name or "up_proj" in name:
                p.mul_(50.0)
    engine = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    engine.update_weights(old.state_dict().items())
    engine.sleep(level=2)
    engine.wake()
    later = ("k_proj", "v_proj", "up_proj")
    weights = model.state_dict().items()
    engine.update_weights([(n, t) for n, t in weights if not any(s in n for s in later)])
    engine.update_weights([(n, t) for n, t in weights if any(s in n for s in later)])
    for (name, got), (_, want) in zip(engine.model.named_modules(), fresh.model.named_modules()):
        if hasattr(got, "weight_scale"):
            assert torch.equal(got.weight_scale, want.weight_scale), name
            assert ((got.weight.float() - want.weight.float()).abs() <= 2.0 ** -9).all(), name
    (got_logprobs, got_argmax), (want_logprobs, want_argmax) = scored(engine, prompts()), scored(fresh, prompts())
    assert got_argmax == want_argmax and all(torch.equal(a, b) for a, b in zip(got_logprobs, want_logprobs))


def test_an_update_after_one_that_failed_part_way_is_a_fresh_load(tame_checkpoint, monkeypatch):
    """A failed update copied layer 0's k at 1024 times its size, then stopped at a NaN in a later group: the
    fused qkv scale it raised is zeroed with the failure, so the good weights sent again in two calls (layer 0's
    k last) quantize as a fresh engine's do (the kept scale cast the first call's q and v 0.04 away in logprob)."""
    import rollout_engine.weight_store as weight_store

    path, model = tame_checkpoint("llama3")
    fresh = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    engine = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    weights, k0 = model.state_dict(), "model.layers.0.self_attn.k_proj.weight"
    bad, last = dict(weights), "model.layers.1.mlp.down_proj.weight"
    bad[k0], bad[last] = weights[k0] * 1024, weights[last].clone()
    bad[last][0, 0] = float("nan")
    monkeypatch.setattr(weight_store, "GROUP_BYTES", 64 << 10)  # k0's group is copied before the NaN's is checked
    with pytest.raises(ValueError, match="NaN"):
        engine.update_weights(bad.items())
    monkeypatch.undo()
    engine.update_weights([(n, t) for n, t in weights.items() if n != k0])
    engine.update_weights([(k0, weights[k0])])
    (got_logprobs, got_argmax), (want_logprobs, want_argmax) = scored(engine, prompts()), scored(fresh, prompts())
    assert got_argmax == want_argmax and all(torch.equal(a, b) for a, b in zip(got_logprobs, want_logprobs))


def test_a_complete_update_quantizes_each_shard_once_with_the_final_scale(fp8_engine, tame_checkpoint):
    """All of a fused weight's shards in one update: each is its tensor quantized with the max of their
    scales, bit for bit, whatever the scale was before (here a 10x k had raised it)."""
    engine, model = fp8_engine
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[0].self_attn.k_proj.weight.mul_(10.0)
    update_layer0(engine, changed, ["k_proj"])
    engine.update_weights(model.state_dict().items())
    qkv, got = qkv_state(engine)
    attn = model.model.layers[0].self_attn
    weights, scale = shared_scale_quantized([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
    assert torch.equal(qkv.weight_scale, scale)
    for shard, want in zip("qkv", weights):
        assert torch.equal(got[shard].view(torch.uint8), want.view(torch.uint8))


def test_update_from_disk_and_dummy_load_quantize(fp8_engine, tame_checkpoint):
    engine, _ = fp8_engine
    loaded = fp8_state(engine)
    path, _ = tame_checkpoint("qwen2")
    dummy = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8", load_format="dummy")
    assert any(not torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in
               zip(fp8_state(dummy).values(), loaded.values()) if a.element_size() == 1)
    dummy.update_weights_from_disk(path)
    assert_same_bits(fp8_state(dummy), loaded)


def test_non_finite_and_fp8_sources_are_refused_before_any_copy(fp8_engine):
    engine, model = fp8_engine
    before = fp8_state(engine)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = model.state_dict()[name].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        engine.update_weights([(name, bad)])
    with pytest.raises(ValueError, match=r"stored in fp8 .* got torch.float8_e4m3fn"):
        engine.update_weights([(name, model.state_dict()[name].to(torch.float8_e4m3fn))])
    assert_same_bits(fp8_state(engine), before)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)  # still serving


def test_sleep_wake_round_trips_the_fp8_weights_bitwise(fp8_engine):
    engine, model = fp8_engine
    before, tokens = fp8_state(engine), scored(engine, prompts())[0]
    engine.sleep(level=1)
    engine.wake()
    assert_same_bits(fp8_state(engine), before)
    engine.sleep(level=2)
    engine.wake()
    with pytest.raises(WeightsNotReadyError):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.update_weights(model.state_dict().items())
    assert_same_bits(fp8_state(engine), before)
    for old, new in zip(tokens, scored(engine, prompts())[0]):
        assert torch.equal(old, new)


def test_batched_quantizer_updates_the_engine_as_the_reference(fp8_engine, tame_checkpoint, monkeypatch):
    """An engine with CUDA's plans (Triton's interpreter): the batched fp8 quantizer and the batched copy.
    Through partial updates (k alone, raising layer 0's qkv scale, lowering it, keeping it: q and v
    re-quantized, or kept bit for bit) and complete ones it holds the reference engine's fp8 bits and
    scales; a steady update (the same tensors, changed in place: k twice, all twice) runs the plan made for
    the first, quantizing what the tensors hold then."""
    engine, model = fp8_engine
    path, _ = tame_checkpoint("qwen2")
    batched = Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")
    planned = []
    monkeypatch.setattr(batched.ops, "copy_plan", copies.copy_plan_triton)

    def plan(jobs):
        made = fp8.quantize_shards_plan_triton(jobs)
        planned.append((len(jobs), made.rest is None))  # rest None: all batched, and the plan is kept
        return made

    monkeypatch.setattr(batched.ops, "quantize_shards_plan", plan)
    trained = copy.deepcopy(model)
    k = trained.model.layers[0].self_attn.k_proj.weight
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    for step, gain, moves in (("k", 10.0, 1), ("k", 0.01, -1), ("all", 1.0, None), ("all", 1.0, None),
                               ("k", 2.0, 0)):
        scale = qkv.weight_scale.clone()
        with torch.no_grad():
            k.mul_(gain)
            trained.model.layers[1].mlp.down_proj.weight.mul_(1.5)
        pairs = ([("model.layers.0.self_attn.k_proj.weight", k)] if step == "k"
                 else list(trained.state_dict().items()))
        for e in (engine, batched):
            e.update_weights(pairs)
        assert_same_bits(fp8_state(batched), fp8_state(engine))
        assert moves is None or torch.sign(qkv.weight_scale - scale) == moves
    layers = len(model.model.layers)
    assert planned == [(1, True), (4 * layers, True), (1, True)]  # steady updates (k again, all again) ran the
    # plans made before


# ---------------------------------------------------------------- CUDA: torch._scaled_mm against the twin

# ---------------------------------------------------------------- an fp8 KV cache (kv_cache_dtype)

def kv_state(engine):
    attention = engine.model.model.layers[0].self_attn
    return attention.k_cache.dtype, attention.k_scale is not None


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "float8_e4m3fn", torch.float8_e4m3fn])
def test_kv_cache_dtype_fp8_is_an_e4m3_cache_with_scales(name, tame_checkpoint):
    """vLLM's names ("fp8", "fp8_e4m3") and torch's give the same cache: e4m3 values with their block scales."""
    path, _ = tame_checkpoint("qwen3")
    assert kv_state(Engine(path, device="cpu", kv_cache_memory=KV, kv_cache_dtype=name)) == (torch.float8_e4m3fn, True)


@pytest.mark.parametrize("name", ["float8_e5m2", torch.float8_e5m2, "fp8_e5m2", "int8", torch.int8])
def test_kv_cache_dtype_refuses_formats_the_kernels_do_not_write(name, tame_checkpoint):
    """The KV store kernels write e4m3 bits, so an e5m2 cache would be read back as other numbers: refused,
    by name, with what is allowed; the refusal leaves nothing behind (an engine built next works)."""
    path, _ = tame_checkpoint("qwen3")
    with pytest.raises(ValueError, match=r"kv_cache_dtype=.*allowed:.*'fp8'"):
        Engine(path, device="cpu", kv_cache_memory=KV, kv_cache_dtype=name)
    assert Engine(path, device="cpu", kv_cache_memory=KV).generate([[1, 2]], SamplingParams(max_tokens=2),
                                                                   use_tqdm=False)[0].outputs[0].token_ids


def test_benchmark_fill_writes_noise_into_an_fp8_cache(tame_checkpoint):
    """decode_roofline.py's fill (bench_ops.fill_kv_random) on an e4m3 cache: torch has no normal_ for fp8,
    so the noise is drawn in float32 and cast; its mean square is 1 within sqrt(2 / N) (N in the tens of
    thousands here, so 0.05 fails only for a pool not filled), and the cache holds it."""
    path, _ = tame_checkpoint("qwen3")
    engine = Engine(path, device="cpu", kv_cache_memory=KV, kv_cache_dtype="fp8")
    assert abs(fill_kv_random(engine.kv) - 1) < 0.05
    cache = engine.model.model.layers[0].self_attn.k_cache.float()
    assert torch.isfinite(cache).all() and abs(cache.square().mean().item() - 1) < 0.05


def test_kv_cache_dtype_auto_is_the_models_dtype(tame_checkpoint):
    path, _ = tame_checkpoint("qwen3")
    assert kv_state(Engine(path, device="cpu", kv_cache_memory=KV, kv_cache_dtype="auto")) == (torch.float32, False)


def test_serve_flags_reach_the_engine(tame_checkpoint):
    """`rollout-engine serve --quantization fp8 --kv-cache-dtype fp8` builds the engine vLLM's flags would ask
    for; without them, the model's dtype for both."""
    from rollout_engine.cli import build_parser, serve_engine_kwargs
    path, _ = tame_checkpoint("qwen3")
    base = ["serve", str(path), "--device", "cpu", "--kv-cache-memory", str(KV)]
    fp8_engine = Engine(path, **serve_engine_kwargs(build_parser().parse_args(
        base + ["--quantization", "fp8", "--kv-cache-dtype", "fp8"])))
    assert kv_state(fp8_engine) == (torch.float8_e4m3fn, True)
    assert fp8_engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    plain = Engine(path, **serve_engine_kwargs(build_parser().parse_args(base)))
    assert kv_state(plain) == (torch.float32, False)
    assert plain.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32


def test_serve_takes_an_unquantized_draft_and_refuses_a_draft_format_without_a_draft(tame_checkpoint):
    """--draft-quantization none is the Engine's draft_quantization=None (an fp8 target, a float draft); without
    --draft-model the flag reaches the Engine, which refuses it, rather than being dropped."""
    from rollout_engine.cli import build_parser, serve_engine_kwargs
    path, _ = tame_checkpoint("qwen3")
    base = ["serve", str(path), "--device", "cpu", "--kv-cache-memory", str(KV), "--quantization", "fp8"]
    kwargs = serve_engine_kwargs(build_parser().parse_args(
        base + ["--draft-model", str(path), "--num-speculative-tokens", "2", "--draft-quantization", "None"]))
    engine = Engine(path, **kwargs)
    assert kwargs["draft_quantization"] is None and kwargs["quantization"] == "fp8"
    assert engine.models["draft"].model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float32
    assert engine.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="draft_quantization"):
        Engine(path, **serve_engine_kwargs(build_parser().parse_args(base + ["--draft-quantization", "fp8"])))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fp8_kv_engine_agrees_with_the_fp32_engine(family, tame_checkpoint):
    """Keys and values rounded to e4m3 (2**-4 relative at most) move attention scores by a few percent of
    their spread: teacher-forced greedy agreement >= 95%, KL(fp32 || fp8 KV) small, on weights kept fp32."""
    path, _ = tame_checkpoint(family)
    agreement, kl = agreement_and_kl(Engine(path, device="cpu", kv_cache_memory=KV),
                                     Engine(path, device="cpu", kv_cache_memory=KV, kv_cache_dtype="fp8"),
                                     f"{family}, fp8 KV")
    assert 0 < kl < 0.02
    assert agreement >= 0.95


def test_fp8_kv_engine_keeps_keys_and_values_past_e4m3s_range(tame_checkpoint, tmp_path):
    """Keys and values far past e4m3's 448 (Qwen2-like checkpoints have them): q_proj / 4096 with k_proj * 4096,
    and v_proj * 4096 with o_proj / 4096, compute the same function (powers of two scale exactly), but a cache
    with one fixed scale would clip every key and value. Each (token, kv head) over its own scale keeps the
    fp8-KV engine as close to the fp32 engine as on the tame weights."""
    _, model = tame_checkpoint("llama3")
    model = copy.deepcopy(model)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.div_(4096)
            attn.k_proj.weight.mul_(4096)
            attn.v_proj.weight.mul_(4096)
            attn.o_proj.weight.div_(4096)
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine(tmp_path, device="cpu", kv_cache_memory=KV, kv_cache_dtype="fp8")
    agreement, kl = agreement_and_kl(Engine(tmp_path, device="cpu", kv_cache_memory=KV), engine,
                                     "llama3, keys and values x 4096, fp8 KV")
    assert 0 < kl < 0.02
    assert agreement >= 0.95
    k_scale = engine.model.model.layers[0].self_attn.k_scale
    assert k_scale.max() > 1  # keys past 448 were written: the test is about them


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_cuda_fp8_kv_engine_agrees_with_bf16_under_graphs(quantization, tame_checkpoint):
    """The Triton KV store and attention on an e4m3 cache, decode under CUDA graphs: greedy agreement with the
    bf16 engine as on the CPU, with bf16 or fp8 weights; sleep(1)/wake re-carves the cache and serves the same."""
    path, _ = tame_checkpoint("qwen3")
    full = Engine(path, dtype="bfloat16", kv_cache_memory=KV)
    engine = Engine(path, dtype="bfloat16", kv_cache_memory=KV, kv_cache_dtype="fp8", quantization=quantization)
    agreement, kl = agreement_and_kl(full, engine, f"cuda, fp8 KV, weights {quantization}", tokens=24)
    assert agreement >= 0.95 and kl < 0.02
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in engine.generate(prompts(), greedy, use_tqdm=False)]
    engine.sleep(level=1)
    engine.wake()
    assert [o.outputs[0].token_ids for o in engine.generate(prompts(), greedy, use_tqdm=False)] == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("given", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_matches_the_emulated_twin(rows, given, dtype):
    """Same fp8 operands (the quantizers agree bitwise; `given`: the activation arrives as an Fp8Tensor, as from
    the fused RMSNorm); the float32 sums differ in order (2K 2**-24 of sum |q_a q_w| scaled), and the CUDA path
    rounds to `dtype` after the matmul and after the bias where the twin rounds once: 2 roundings of 2**-8
    (bf16) or 2**-24 (fp32) of |y| + |bias|, bounded here by 3."""
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(rows, 2048, generator=g) * torch.linspace(0.1, 4, 2048)).to(dtype).cuda()
    weight, scale_w = shared_scale_quantized([(torch.randn(n, 2048, generator=g) * s).cuda()
                                              for n, s in ((1024, 0.02), (512, 0.2))])
    weight = torch.cat(weight)
    bias = (torch.randn(weight.shape[0], generator=g) * 0.1).to(dtype).cuda()
    qa, sa = fp8.quantize_fp8_ref(x)
    got = fp8.fp8_linear_triton(fp8.Fp8Tensor(qa, sa, dtype) if given else x, weight, scale_w, bias).float()
    want32 = fp8.fp8_linear_ref(x.float(), weight, scale_w, bias.float())
    mag = (qa.float().abs() @ weight.float().abs().t()) * sa * scale_w
    eps = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -24
    bound = 3 * eps * (want32.abs() + bias.float().abs() + mag * eps) + 2 * 2048 * 2.0 ** -24 * mag
    assert ((got - want32).abs() <= bound).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("quantization, batch_invariant", [(None, False), ("fp8", False), (None, True)])
def test_cuda_engine_with_a_nan_weight_fails_sampling_instead_of_serving_tokens(quantization, batch_invariant,
                                                                                tame_checkpoint):
    """check_finite=False lets a NaN weight in; the CUDA kernels (Triton quantizers, norms, GEMV, cuBLASLt) must
    carry it to the logits, where sampling refuses them, as the bf16 engine does: not plausible tokens."""
    path, model = tame_checkpoint("qwen3")
    engine = Engine(path, dtype="bfloat16", kv_cache_memory=KV, quantization=quantization, check_finite=False,
                    batch_invariant=batch_invariant)
    name = "model.layers.0.self_attn.q_proj.weight"
    weight = model.state_dict()[name].to(torch.bfloat16).clone()
    weight[3, 3] = float("nan")
    engine.update_weights([(name, weight)])
    for rows in (1, 3, 40):  # the GEMV, the few-row kernels, cuBLAS(Lt)
        with pytest.raises(NonFiniteLogitsError):
            engine.generate([[1, 2, 3, 4, 5]] * rows, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_engine_graphs_see_updates_and_sleep(tame_checkpoint):
    """Under CUDA graphs: an update (quantized in place) is served as by an engine loaded with those weights;
    sleep(1)/wake keeps the fp8 bits; greedy agreement with the bf16 engine as on the CPU."""
    path, model = tame_checkpoint("qwen3")
    engine = Engine(path, dtype="bfloat16", kv_cache_memory=KV, quantization="fp8")
    full = Engine(path, dtype="bfloat16", kv_cache_memory=KV)
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    sequences = [p + o.outputs[0].token_ids for p, o in zip(prompts(), full.generate(prompts(), greedy))]
    _, argmax = scored(engine, sequences)
    hits = [a == t for p, s, am in zip(prompts(), sequences, argmax) for a, t in zip(am[len(p) - 1:], s[len(p):])]
    assert sum(hits) / len(hits) >= 0.95
    before = fp8_state(engine)
    engine.sleep(level=1)
    engine.wake()
    assert_same_bits(fp8_state(engine), before)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.model.layers[1].mlp.down_proj.weight.mul_(-3.0)
    name = "model.layers.1.mlp.down_proj.weight"
    engine.update_weights([(name, changed.state_dict()[name].to(torch.bfloat16))])
    fresh = Engine(path, dtype="bfloat16", kv_cache_memory=KV, quantization="fp8")
    fresh.update_weights([(name, changed.state_dict()[name].to(torch.bfloat16))])
    assert_same_bits(fp8_state(engine), fp8_state(fresh))
    got = [o.outputs[0].token_ids for o in engine.generate(prompts(), greedy)]
    assert got == [o.outputs[0].token_ids for o in fresh.generate(prompts(), greedy)]


# ---------------------------------------------------------------- truncated importance sampling (GRPO loss)

def test_truncated_importance_sampling_weights_each_token_by_its_capped_detached_ratio():
    """d loss / d new_logprob at token t is -adv * min(exp(trainer_old - rollout), cap) / tokens (the clip
    is inactive on policy): ratios 5 (capped at 2), 0.5 and 1. trainer_old gets no gradient: the ratio's
    reference and the weight are both detached."""
    from trainer_adapters.grpo import RolloutBatch, policy_loss

    rollout = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    trainer_old = rollout + torch.log(torch.tensor([[1.0, 5.0, 0.5, 1.0]]))
    trainer_old.requires_grad_(True)
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    batch = RolloutBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), mask, rollout,
                         torch.zeros(1))
    new = trainer_old.detach().clone().requires_grad_(True)
    policy_loss(new, batch, torch.tensor([1.5]), trainer_old_logprobs=trainer_old, is_cap=2.0).backward()
    torch.testing.assert_close(new.grad, -1.5 * torch.tensor([[0.0, 2.0, 0.5, 1.0]]) / 3)
    assert trainer_old.grad is None
    plain = rollout.clone().requires_grad_(True)  # trainer == rollout: TIS is the plain loss
    policy_loss(plain, batch, torch.tensor([1.5]), trainer_old_logprobs=rollout, is_cap=2.0).backward()
    torch.testing.assert_close(plain.grad, -1.5 * mask / 3)


def test_hybrid_step_refuses_a_bad_tis_cap():
    from trainer_adapters.grpo import hybrid_step

    for bad in (0, -1.0, True, "2"):
        with pytest.raises(ValueError, match="tis_cap="):
            hybrid_step(None, None, None, [], None, None, 0, tis_cap=bad)


def test_engine_passes_draft_quantization(tame_checkpoint):
    """Engine(draft_quantization=...) reaches the draft model: its projections are stored as fp8, the target's not."""
    path, _ = tame_checkpoint("qwen3")
    engine = Engine(path, device="cpu", kv_cache_memory=KV, draft_model=path, num_speculative_tokens=2,
                    draft_quantization="fp8")
    dtypes = {kind: model.model.layers[0].self_attn.qkv_proj.weight.dtype for kind, model in engine.models.items()}
    assert dtypes == {"target": torch.float32, "draft": torch.float8_e4m3fn}
