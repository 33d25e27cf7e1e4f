"""The engine on a GPU (Triton kernels, CUDA graphs, torch_memory_saver). Skipped without CUDA."""
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers import make_prompts

from rollout_engine import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def greedy(engine, batch):
    return [o.outputs[0].token_ids for o in engine.generate(batch, GREEDY)]


def clear_steps(model, ids, tokens, margin):
    """How many leading greedy steps have a top-2 logit gap above `margin` (no near-tie) under `model`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens], device=model.device)).logits[0, len(ids) - 1 : -1].float()
    top2 = logits.topk(2, dim=-1).values
    gaps = (top2[:, 0] - top2[:, 1]).tolist()
    return next((i for i, g in enumerate(gaps) if g < margin), len(gaps))


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
def test_bf16_on_gpu_equals_cpu_float32_until_a_near_tie(hf_checkpoint, family):
    path, model = hf_checkpoint(family)
    batch = make_prompts()
    cpu = greedy(Engine(path, device="cpu", kv_cache_memory=64 << 20), batch)
    gpu = greedy(Engine(path, device="cuda", dtype="bfloat16", kv_cache_memory=256 << 20), batch)
    compared = 0
    for ids, a, b in zip(batch, cpu, gpu):
        # bf16 keeps 8 mantissa bits: logits of size ~5 move by a few 1e-2 through two layers.
        n = clear_steps(model, ids, a, margin=0.25)
        assert a[:n] == b[:n]
        compared += n
    assert compared >= 16, "too few clear steps to compare"


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
