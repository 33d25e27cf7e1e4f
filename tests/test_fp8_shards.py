"""rollout_kernels/fp8.py quantize_shards_plan: a group's fp8 weights loaded at once. The Triton plan (four launches
for any number of weights) against the reference (each weight by itself, as Fp8Shards describes), bit for
bit: shards that arrive, siblings that do not (re-quantized, or kept when the scale stays), any mix of sizes
and source dtypes. On the CPU through Triton's interpreter; on CUDA at the Llama-3.1-8B shapes. Then the
engine's updates whose groups split a fused layer's shards (rollout_engine/shard_staging.py)."""
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rollout_engine.weight_store as weight_store
from rollout_kernels import copies, fp8
from rollout_engine import Engine, SamplingParams, WeightsNotReadyError
from rollout_engine.shard_staging import ShardStage

DEV = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn


def loaded(sizes, columns, spreads, seed, device=DEV):
    """An Fp8Shards as a complete load leaves it: shards of `sizes` rows, values N(0, spread) per shard."""
    g = torch.Generator().manual_seed(seed)
    rows, start = [], 0
    for size in sizes:
        rows.append((start, size))
        start += size
    job = fp8.Fp8Shards(torch.empty(start, columns, dtype=E4M3, device=device), torch.zeros(1, device=device),
                        torch.zeros(len(sizes), device=device), tuple(rows),
                        {i: (torch.randn(n, columns, generator=g) * s).to(device) for i, (n, s) in
                         enumerate(zip(sizes, spreads))})
    fp8.quantize_shards_plan_ref([job])()
    return job


def arriving(job, sources: dict):
    return job._replace(sources=sources)


def copied(job):
    return job._replace(weight=job.weight.clone(), weight_scale=job.weight_scale.clone(),
                        shard_scale=job.shard_scale.clone())


def bits(job):
    return job.weight.view(torch.uint8)


def assert_same(got, want):
    assert torch.equal(bits(got), bits(want))
    assert torch.equal(got.weight_scale, want.weight_scale) and torch.equal(got.shard_scale, want.shard_scale)


def group(columns: int):
    """Four weights in one group, by what arrives: (stays) one shard of three, smaller than the max: the
    scale stays; (rises) one shard of two at 10x: the scale rises; (alone) a one-shard weight; (whole) every
    shard of a weight. Sources in fp32, fp16 and bf16."""
    stays = loaded((3, 5, 7), columns, (1.0, 0.5, 2.0), seed=1)
    rises = loaded((6, 2), columns, (0.1, 0.1), seed=2)
    alone = loaded((4,), columns, (3.0,), seed=3)
    whole = loaded((5, 3), columns, (0.01, 0.02), seed=4)
    g = torch.Generator().manual_seed(5)

    def new(job, i, spread, dtype=torch.float32):
        return (torch.randn(job.rows[i][1], columns, generator=g) * spread).to(dtype).to(DEV)

    return [arriving(stays, {1: new(stays, 1, 0.25)}),
            arriving(rises, {1: new(rises, 1, 1.0, torch.float16)}),
            arriving(alone, {0: new(alone, 0, 0.5, torch.bfloat16)}),
            arriving(whole, {0: new(whole, 0, 0.03), 1: new(whole, 1, 0.01, torch.bfloat16)})]


@pytest.mark.parametrize("columns", [33, 32])  # 33: no size a multiple of 16 bytes; 32: every one (vector hints)
def test_batched_plan_is_bitwise_the_reference(columns):
    jobs = group(columns)
    want, got = [copied(job) for job in jobs], [copied(job) for job in jobs]
    fp8.quantize_shards_plan_ref(want)()
    plan = fp8.quantize_shards_plan_triton(got)
    assert plan.launch is not None and plan.rest is None  # all batched: the plan holds no tensor
    plan()
    for g, w in zip(got, want):
        assert_same(g, w)
    stays, rises = jobs[0], jobs[1]
    assert torch.equal(got[0].weight_scale, stays.weight_scale)  # the scale stays: the siblings keep their bits
    for start, size in (stays.rows[0], stays.rows[2]):
        assert torch.equal(bits(got[0])[start:start + size], bits(stays)[start:start + size])
    assert got[1].weight_scale > rises.weight_scale  # it rises: the sibling is re-quantized
    start, size = rises.rows[0]
    assert not torch.equal(bits(got[1])[start:start + size], bits(rises)[start:start + size])
    assert torch.equal(got[1].weight_scale, fp8.power_of_two_up_ref(fp8.quantize_fp8_ref(rises.sources[1])[1]))


def test_a_plan_quantizes_what_its_sources_hold_when_it_runs():
    """Planned once, run twice with the sources changed in place between: each run as the reference's."""
    jobs = group(32)
    got = [copied(job) for job in jobs]
    plan = fp8.quantize_shards_plan_triton(got)
    plan()
    for job in jobs:
        for src in job.sources.values():
            src.mul_(3.0)
    want = [copied(job) for job in got]
    fp8.quantize_shards_plan_ref(want)()
    plan()
    for g, w in zip(got, want):
        assert_same(g, w)


def test_sources_the_kernels_cannot_read_go_one_weight_at_a_time():
    """A strided source (a tensor-parallel column slice): that weight by the per-weight path, the others
    batched; all as the reference."""
    jobs = group(32)
    wide = torch.randn(jobs[0].rows[1][1], 64, generator=torch.Generator().manual_seed(6)).to(DEV)
    jobs[0] = arriving(jobs[0], {1: wide[:, 16:48]})
    want, got = [copied(job) for job in jobs], [copied(job) for job in jobs]
    fp8.quantize_shards_plan_ref(want)()
    plan = fp8.quantize_shards_plan_triton(got)
    assert plan.launch is not None and plan.rest is not None
    plan()
    for g, w in zip(got, want):
        assert_same(g, w)


class TorchOps(TorchDispatchMode):
    """Counts the torch operations run under it (each a launch, or an allocation, on a device)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("weights", [1, 4, 16])
def test_a_group_costs_four_launches_however_many_weights_it_holds(weights, monkeypatch):
    """A run of the batched plan: four Triton launches and no torch operation, for 1 or 16 weights (the
    Llama-shaped decoder layer has 4, with 7 shards). The per-weight path, for comparison, launches 2 per
    arriving shard, 1 per shard, and a max and a copy per weight, and allocates per shard (printed)."""
    launches = []
    monkeypatch.setattr(type(fp8._shards_cast_kernel), "run", lambda self, *a, **k: launches.append(self))
    jobs = [job for _ in range(weights // 4 or 1) for job in group(32)][:weights]
    plan = fp8.quantize_shards_plan_triton([copied(job) for job in jobs])
    with TorchOps() as ops:
        plan()
    assert len(launches) == 4 and ops.count == 0
    launches.clear()
    with TorchOps() as ops:
        fp8._quantize_each([copied(job) for job in jobs], fp8.fp8_scale_triton, fp8.quantize_fp8_scaled_triton)
    print(f"\n{weights} weights: per-weight path {len(launches)} Triton launches + {ops.count} torch ops; "
          "batched 4 + 0")
    assert len(launches) > 4 * weights


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_llama_8b_shapes_on_cuda_are_bitwise_the_reference():
    """Two Llama-3.1-8B decoder layers' weights (qkv 6144x4096, gate_up 28672x4096, o 4096x4096, down
    4096x14336) from bf16: layer 0 whole, layer 1 with k alone at 10x (q and v re-quantized) and up alone at
    half (the scale stays: gate keeps its bits)."""
    shapes = [((4096, 1024, 1024), 4096), ((14336, 14336), 4096), ((4096,), 4096), ((4096,), 14336)]
    g = torch.Generator(device="cuda").manual_seed(7)

    def bf16(rows, columns, spread):
        return (torch.randn(rows, columns, generator=g, device="cuda") * spread).to(torch.bfloat16)

    jobs = []
    for layer in range(2):
        for seed, (sizes, columns) in enumerate(shapes):
            job = loaded(sizes, columns, [0.02] * len(sizes), seed=10 * layer + seed, device="cuda")
            jobs.append(arriving(job, {i: bf16(n, columns, 0.02 * (1 + i)) for i, n in enumerate(sizes)}))
    jobs[4] = arriving(jobs[4], {1: bf16(1024, 4096, 0.2)})
    jobs[5] = arriving(jobs[5], {1: bf16(14336, 4096, 0.001)})
    want, got = [copied(job) for job in jobs], [copied(job) for job in jobs]
    fp8.quantize_shards_plan_ref(want)()
    plan = fp8.quantize_shards_plan_triton(got)
    assert plan.rest is None
    plan()
    torch.cuda.synchronize()
    for g8, w in zip(got, want):
        assert_same(g8, w)
    assert torch.equal(bits(got[5])[:14336], bits(jobs[5])[:14336])


# ---------------------------------------------------------------- a fused weight's shards across an update's groups

KV = 16 << 20
QKV0 = "model.layers.0.self_attn.{}_proj.weight"


@pytest.fixture
def tame(tame_checkpoint):
    """(path, HF model): qwen2 (GQA, qkv biases, tied head) with the projections at a quarter."""
    return tame_checkpoint("qwen2")


def fp8_engine(path):
    return Engine(path, device="cpu", kv_cache_memory=KV, quantization="fp8")


def state(engine) -> dict:
    """Every fp8 weight (as its bits) and every scale."""
    return {n: (t.detach().view(torch.uint8) if t.dtype == E4M3 else t.detach()).clone()
            for n, t in [*engine.model.named_parameters(), *engine.model.named_buffers()]
            if t.dtype == E4M3 or n.endswith("_scale")}


def assert_fresh(engine, fresh):
    got, want = state(engine), state(fresh)
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=0, prompt_logprobs=0)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [9, 40, 17, 3, 200]]
    for a, b in zip(engine.generate(prompts, params, use_tqdm=False), fresh.generate(prompts, params, use_tqdm=False)):
        assert a.prompt_logprobs == b.prompt_logprobs
        assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.outputs[0].logprobs == b.outputs[0].logprobs


def big(model, leaf="k_proj", gain=2.0 ** 20):
    """The model with every layer's `leaf` scaled by `gain`: the fused qkv scales rise by it."""
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for layer in changed.model.layers:
            getattr(layer.self_attn, leaf).weight.mul_(gain)
    return changed


@pytest.mark.parametrize("plans", ["reference", "triton"])
def test_a_complete_update_after_a_fall_of_scale_split_one_tensor_a_group_is_a_fresh_load(tame, plans,
                                                                                         monkeypatch):
    """A complete update whose shards come one a group, after a version whose k raised the fused scales by
    2**20: q arrives first, k and v after it. Each fused layer is quantized again once its last shard has
    come, over all its shards, with a scale of the new values only: the weights, scales and logprobs of a
    fresh load. `plans`: the engine's copy and quantize plans, the CPU's or CUDA's (Triton's interpreter)."""
    path, model = tame
    engine, fresh = fp8_engine(path), fp8_engine(path)
    if plans == "triton":
        monkeypatch.setattr(engine.ops, "copy_plan", copies.copy_plan_triton)
        monkeypatch.setattr(engine.ops, "quantize_shards_plan", fp8.quantize_shards_plan_triton)
    engine.update_weights(big(model).state_dict().items())
    assert engine.model.model.layers[0].self_attn.qkv_proj.weight_scale > 2 ** 10 * \
        fresh.model.model.layers[0].self_attn.qkv_proj.weight_scale
    engine.update_weights_from_buckets([[pair] for pair in model.state_dict().items()])
    assert engine.weight_history[-1]["complete"]
    assert_fresh(engine, fresh)


def test_an_update_from_disk_in_small_groups_is_a_fresh_load(tame, monkeypatch):
    """update_weights_from_disk goes in the files' order (k_proj, o_proj, q_proj, v_proj): with small groups a
    fused layer's shards fall in different groups, k first, quantized while the last version's 2**20 v still
    counts; the update is still a fresh load."""
    path, model = tame
    engine, fresh = fp8_engine(path), fp8_engine(path)
    engine.update_weights(big(model, "v_proj").state_dict().items())
    monkeypatch.setattr(weight_store, "GROUP_BYTES", 16 << 10)
    engine.update_weights_from_disk(path)
    assert engine.weight_history[-1]["complete"]
    assert_fresh(engine, fresh)


def test_a_partial_update_quantizes_with_the_siblings_as_they_are(tame):
    """k_proj never sent, q_proj sent alone (a large q, then q back): as before, q is quantized with the
    scale over its own and its siblings' shard scales, the siblings' rows re-quantized in place; the history
    says incomplete, and the engine serves."""
    path, model = tame
    engine = fp8_engine(path)
    qkv = engine.model.model.layers[0].self_attn.qkv_proj
    q = model.state_dict()[QKV0.format("q")]
    for value in (q * 8.0, q):
        want = copied(qkv.loading({"q": value}))
        fp8.quantize_shards_plan_ref([want])()
        engine.update_weights([(QKV0.format("q"), value)])
        assert_same(qkv.loading({}), want)
        assert engine.weight_history[-1]["complete"] is False
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids


def test_partial_shards_in_two_groups_are_quantized_together_at_the_end(tame):
    """After a version whose v raised the scale by 2**20: q in one group, v back in the next, k never sent.
    At the end of the call the layer is quantized again from q and v, as one group holding both gives it (q's
    first quantization, under the old v's scale, does not stay)."""
    path, model = tame
    one, two = fp8_engine(path), fp8_engine(path)
    q, v = (model.state_dict()[QKV0.format(s)] for s in "qv")
    for engine in (one, two):
        engine.update_weights([(QKV0.format("v"), v * 2.0 ** 20)])
    pairs = [(QKV0.format("q"), q * 1.5), (QKV0.format("v"), v)]
    one.update_weights(pairs)
    two.update_weights_from_buckets([[pair] for pair in pairs])
    got, want = state(two), state(one)
    for name in got:
        assert torch.equal(got[name], want[name]), name
    assert two.weight_history[-1]["complete"] is False


@pytest.mark.parametrize("bad", ["nan", "unknown"])
def test_a_failure_in_a_later_group_leaves_the_staged_layer_stale(tame, bad):
    """A complete update, one tensor a group, whose group after layer 0's q fails (a NaN k, an unknown name):
    q's layer is not whole yet, and its names are stale like every name; generate is refused and the version
    stays; a complete update then serves a fresh load."""
    path, model = tame
    engine, fresh = fp8_engine(path), fp8_engine(path)
    engine.update_weights(big(model).state_dict().items())
    pairs = list(model.state_dict().items())
    k = [n for n, _ in pairs].index(QKV0.format("k"))  # after q (and q's bias)
    if bad == "nan":
        pairs[k] = (QKV0.format("k"), torch.full_like(pairs[k][1], float("nan")))
    else:
        pairs.insert(k, ("model.layers.0.self_attn.w_proj.weight", torch.zeros(4)))
    version = engine.weight_version
    with pytest.raises(ValueError, match="NaN or inf" if bad == "nan" else "unknown weight name") as failed:
        engine.update_weights_from_buckets([[pair] for pair in pairs])
    tb, stages = failed.value.__traceback__, []  # a caller keeping the error keeps its frames: no copies with them
    while tb is not None:
        stages += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, ShardStage)]
        tb = tb.tb_next
    assert stages and all(stage.nbytes == 0 and not stage.layers for stage in stages)
    assert engine.weight_version == version
    assert {("target", QKV0.format(s)) for s in "qkv"} <= engine.weight_store.stale
    with pytest.raises(WeightsNotReadyError):
        engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)
    engine.update_weights_from_buckets([[pair] for pair in model.state_dict().items()])
    assert_fresh(engine, fresh)


@pytest.mark.parametrize("limit", [0, 32 << 10])
def test_kept_shards_are_bounded_by_stage_bytes(tame, monkeypatch, limit):
    """STAGE_BYTES bounds the copies an update keeps. 32 KiB holds what one tensor a group needs at a time
    (layer 0's q and k until v comes; gate until up comes): a fresh load. 0 keeps nothing: each shard stays as
    its group quantized it with its siblings as they were (q under the old 2**20 k's scale), not a fresh
    load; the update still completes, serves, and each scale is the new shards' (a fresh load's)."""
    path, model = tame
    engine, fresh = fp8_engine(path), fp8_engine(path)
    monkeypatch.setattr(weight_store, "STAGE_BYTES", limit)
    engine.update_weights(big(model).state_dict().items())
    engine.update_weights_from_buckets([[pair] for pair in model.state_dict().items()])
    assert engine.weight_history[-1]["complete"]
    if limit:
        assert_fresh(engine, fresh)
        return
    got, want = state(engine), state(fresh)
    assert all(torch.equal(got[n], want[n]) for n in got if n.endswith("_scale"))
    assert not torch.equal(got["model.layers.0.self_attn.qkv_proj.weight"],
                           want["model.layers.0.self_attn.qkv_proj.weight"])
    assert engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
