"""The engine on a GPU (Triton kernels, CUDA graphs, torch_memory_saver). Skipped without CUDA."""
import gc
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import make_prompts

from rollout_kernels import gemv

from rollout_engine import Engine, SamplingParams
from rollout_engine.spec import NGRAM

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def greedy(engine, batch):
    return [o.outputs[0].token_ids for o in engine.generate(batch, GREEDY)]


def test_fp32_on_gpu_equals_transformers_on_gpu(hf_checkpoint):
    path, model = hf_checkpoint("qwen3")
    batch = make_prompts()
    engine = Engine(path, device="cuda", dtype="float32", kv_cache_memory=256 << 20)
    model = model.to("cuda")
    try:
        for ids, got in zip(batch, greedy(engine, batch)):
            with torch.no_grad():
                hf = model.generate(torch.tensor([ids], device="cuda"), do_sample=False, max_new_tokens=32,
                                    min_new_tokens=32)[0, len(ids):].tolist()
            assert got == hf
    finally:
        model.to("cpu")


@pytest.mark.parametrize("family", ["qwen3", "llama3"])
def test_bf16_on_gpu_picks_the_cpu_float32_token_wherever_it_is_clear(hf_checkpoint, family):
    """Teacher-forced along the CPU float32 greedy path: at every step whose top-2 logit gap exceeds
    what bf16 can move, the GPU (bf16, Triton kernels, CUDA graphs) must choose the same token."""
    path, model = hf_checkpoint(family)
    batch = make_prompts()
    cpu_tokens = greedy(Engine(path, device="cpu", kv_cache_memory=64 << 20), batch)
    prefixes, gaps, expected = [], [], []
    for ids, tokens in zip(batch, cpu_tokens):
        with torch.no_grad():
            logits = model(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 : -1].float()
        top2 = logits.topk(2, dim=-1).values
        gaps += (top2[:, 0] - top2[:, 1]).tolist()
        prefixes += [ids + tokens[:k] for k in range(len(tokens))]
        expected += tokens
    gpu = Engine(path, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20)
    got = [o.outputs[0].token_ids[0] for o in gpu.generate(prefixes, SamplingParams(temperature=0, max_tokens=1))]
    # bf16 rounds weights and activations by 2^-9 relative: through two layers, logits of size ~5 move
    # by a few 1e-2. A gap of 0.1 is beyond that; nearer ties may flip either way.
    clear = [i for i, g in enumerate(gaps) if g > 0.1]
    assert len(clear) >= len(gaps) // 2
    assert [got[i] for i in clear] == [expected[i] for i in clear]


def test_gpu_sleep_wake_returns_memory_and_keeps_graphs(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    engine = Engine(path, device="cuda", kv_cache_memory=4 << 30)
    assert engine.memory.keeps_addresses, "torch_memory_saver should be active on CUDA"
    batch = make_prompts()
    before = greedy(engine, batch)
    graph = engine.runner.graphs.graphs[1]
    kv_bytes = engine.memory_stats()["kv_cache_bytes"]
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep(level=1)
    returned = torch.cuda.mem_get_info()[0] - free_awake
    assert returned >= 0.99 * kv_bytes
    engine.wake()
    assert engine.runner.graphs.graphs[1] is graph  # same addresses: no re-capture
    assert greedy(engine, batch) == before
    engine.sleep(level=2)
    engine.wake()
    with pytest.raises(Exception, match="update_weights"):
        engine.generate(batch, GREEDY)
    engine.update_weights_from_disk(path)
    assert greedy(engine, batch) == before


def test_a_kv_pause_that_fails_leaves_the_pool_awake_and_serving(hf_checkpoint):
    """torch-memory-saver's pause of the KV pool raising (a CUDA error) fails the sleep; the pool is still bound,
    so the engine serves as before and sleeps and wakes later."""
    path, _ = hf_checkpoint("qwen3")
    engine = Engine(path, device="cuda", kv_cache_memory=1 << 30)
    batch = make_prompts()
    before = greedy(engine, batch)
    real = engine.memory.pause

    def pause(tag):
        if tag == "kv_cache":
            engine.memory.pause = real
            raise RuntimeError("the KV pool's pause failed")
        real(tag)

    engine.memory.pause = pause
    with pytest.raises(RuntimeError, match="pause failed"):
        engine.sleep(level=1, tags=["kv_cache"])
    assert engine.memory_stats()["asleep"] == []
    assert greedy(engine, batch) == before
    engine.sleep(level=1)
    engine.wake()
    assert greedy(engine, batch) == before


def test_script_using_sleep_and_wake_exits_zero(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    script = textwrap.dedent(f"""
        from rollout_engine import Engine, SamplingParams
        engine = Engine({str(path)!r}, device="cuda", kv_cache_memory=1 << 30)
        engine.sleep(level=1)
        engine.wake()
        engine.sleep(level=1)
        engine.wake(tags=["weights"])
        engine.wake(tags=["kv_cache"])
        print(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=4))[0].outputs[0].token_ids)
        engine.sleep(level=2)  # exit while asleep: paused memory must not break interpreter shutdown
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_resize_wake_that_shrinks_the_pool_then_sleeps_and_wakes_again(hf_checkpoint):
    """wake(allow_resize=True) into less memory than the paused pool (the trainer holds the rest): the paused buffer
    is dropped and a smaller one carved. With torch-memory-saver the dropped buffer is an unmapped allocation of
    the engine's kv_cache pool; the engine must go on generating the same tokens, sleep and wake again, and exit
    cleanly (in a subprocess: a fault there could end the interpreter)."""
    path, _ = hf_checkpoint("qwen3")
    script = textwrap.dedent(f"""
        import rollout_engine.kv_cache as kv_cache
        from rollout_engine import Engine, SamplingParams
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        engine = Engine({str(path)!r}, device="cuda", kv_cache_memory=1 << 30)
        before = engine.generate([[1, 2, 3]], params)[0].outputs[0].token_ids
        engine.sleep(level=1)
        free = kv_cache.available_bytes
        kv_cache.available_bytes = lambda device: engine.kv.planner.total_bytes(64)
        engine.wake(allow_resize=True)
        kv_cache.available_bytes = free
        assert engine.memory_stats()["kv_blocks"] == 64, engine.memory_stats()
        assert engine.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == before
        engine.sleep(level=1)
        engine.wake()
        assert engine.generate([[1, 2, 3]], params)[0].outputs[0].token_ids == before
        engine.sleep(level=1)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.parametrize("method", ["draft model", "ngram"])
def test_speculative_greedy_equals_plain_on_gpu(hf_checkpoint, method):
    path, _ = hf_checkpoint("qwen3", seed=0)
    draft = hf_checkpoint("qwen3", seed=7)[0] if method == "draft model" else NGRAM
    batch = make_prompts()
    plain = greedy(Engine(path, device="cuda", dtype="float32", kv_cache_memory=256 << 20), batch)
    spec = Engine(path, device="cuda", dtype="float32", kv_cache_memory=256 << 20, draft_model=draft,
                  num_speculative_tokens=3)
    assert greedy(spec, batch) == plain
    assert spec.stats()["spec_steps"] > 0


@pytest.mark.parametrize("most", [2, 3])
def test_rows_through_the_gemv_keep_the_greedy_tokens(hf_checkpoint, monkeypatch, most):
    """rollout_kernels.gemv.GEMV_ROWS = 2 (3) sends steps of two (three) rows (a batch of two (three); a draft's
    catch-up pass; a k=1 (k=2) verify) to the GEMV instead of cuBLAS: the same greedy tokens as with one row
    there, captured and eager, with and without speculation."""
    path, _ = hf_checkpoint("qwen3", seed=0)
    kw = dict(device="cuda", dtype="float32", kv_cache_memory=256 << 20)
    batch = make_prompts()[:most]
    monkeypatch.setattr(gemv, "GEMV_ROWS", 1)
    want = greedy(Engine(path, **kw), batch)
    monkeypatch.setattr(gemv, "GEMV_ROWS", most)
    assert greedy(Engine(path, **kw), batch) == want
    assert greedy(Engine(path, enforce_eager=True, **kw), batch) == want
    spec = Engine(path, draft_model=hf_checkpoint("qwen3", seed=7)[0], num_speculative_tokens=most - 1, **kw)
    assert greedy(spec, batch[:1]) == want[:1] and spec.stats()["spec_steps"] > 0


def test_a_lone_sequence_verifies_every_position_with_its_own_parameters(hf_checkpoint):
    """The verify pass spreads each sequence's sampling parameters over its k+1 positions. For one sequence
    that spread must not read the parameter buffers' next rows, which here hold a previous batch's top-k=3
    and temperature 0.7: its processed logprobs would then be top-3 ones (the bug: a stride-0 view)."""
    path, _ = hf_checkpoint("qwen3", seed=0)
    kw = dict(device="cuda", dtype="float32", kv_cache_memory=256 << 20)
    prompt = make_prompts()[:1]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = Engine(path, **kw).generate(prompt, params)[0].outputs[0]
    spec = Engine(path, draft_model=path, num_speculative_tokens=3, **kw)
    spec.generate(make_prompts()[:4], SamplingParams(temperature=0.7, top_k=3, max_tokens=8, seed=1))
    out = spec.generate(prompt, params)[0].outputs[0]
    assert out.token_ids == plain.token_ids and spec.stats()["spec_steps"] > 0
    # fp32 logits from GEMMs of different row counts (k+1 positions against one): rounding-level differences
    assert out.logprobs == pytest.approx(plain.logprobs, abs=1e-4)


@pytest.mark.parametrize("speculate", [False, True])
def test_graphs_draw_what_eager_draws(hf_checkpoint, speculate):
    """Captured steps (the model and the sampler in one decode graph; the draft's passes and the
    target's verify pass under speculation) draw the same tokens as the same engine run eagerly."""
    path, _ = hf_checkpoint("qwen3")
    kw = dict(device="cuda", dtype="float32", kv_cache_memory=256 << 20)
    if speculate:
        kw |= dict(draft_model=hf_checkpoint("qwen3", seed=7)[0], num_speculative_tokens=3)
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=5)
    eager, graphed = (Engine(path, enforce_eager=e, **kw).generate(make_prompts(), params) for e in (True, False))
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # fp32 logits from GEMMs of different row counts (graph buckets pad): rounding-level differences
        assert a.outputs[0].logprobs == pytest.approx(b.outputs[0].logprobs, abs=1e-4)


def test_engines_sleep_independently_and_a_dropped_engine_returns_its_memory(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    batch = make_prompts()
    first = Engine(path, device="cuda", kv_cache_memory=1 << 30)
    second = Engine(path, device="cuda", kv_cache_memory=1 << 30)
    before = greedy(second, batch)
    first.sleep(level=1)  # unmaps the first engine's memory only
    assert greedy(second, batch) == before
    first.wake()
    stats = first.memory_stats()
    free = torch.cuda.mem_get_info()[0]
    del first
    gc.collect()  # the engine's modules reference each other
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] - free >= 0.99 * (stats["kv_cache_bytes"] + stats["weights_bytes"])
