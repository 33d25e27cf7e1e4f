"""A dropped engine is freed when its last reference goes, not whenever the cyclic garbage collector runs: its
parts hold no reference back to it, so a tensor-parallel engine's worker processes (and, on GPUs, their
devices' memory) go at once."""
import gc
import time
import weakref

import pytest
from conftest import build_hf_model

from rollout_engine import Engine, SamplingParams

KV = 32 << 20


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("release")
    build_hf_model("llama3").save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def test_a_dropped_engine_is_freed_without_the_cyclic_collector(checkpoint, no_cyclic_gc):
    engine = Engine(checkpoint, device="cpu", kv_cache_memory=KV)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    engine.sleep(level=1)
    engine.wake()
    dropped = weakref.ref(engine)
    del engine
    assert dropped() is None


def test_a_dropped_tensor_parallel_engine_stops_its_workers_at_once(checkpoint, no_cyclic_gc):
    engine = Engine(checkpoint, device="cpu", kv_cache_memory=KV, tensor_parallel_size=2)
    procs = list(engine.tp.procs)
    del engine
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and any(p.poll() is None for p in procs):
        time.sleep(0.1)
    assert all(p.poll() is not None for p in procs)
