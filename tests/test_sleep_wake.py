"""Sleep and wake on the CPU: memory really released, no stale views, identical outputs after wake."""
import gc
import os
import weakref

import pytest
import torch
from helpers import hf_greedy, make_prompts

import rollout_engine.kv_cache as kv_cache_module
from rollout_engine import Engine, EngineAsleepError, NoRoomError, SamplingParams, WeightsNotReadyError

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture
def engine(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    return Engine(path, device="cpu", kv_cache_memory=32 << 20)


def greedy(engine, prompts=None):
    return [o.outputs[0].token_ids for o in engine.generate(prompts or make_prompts(), GREEDY)]


def test_sleep_releases_every_view_and_wake_restores_outputs(engine):
    before = greedy(engine)
    old_buf = weakref.ref(engine.kv.planner.buf.untyped_storage())
    assert engine.memory_stats()["kv_cache_bytes"] > 0
    engine.sleep(level=1)
    gc.collect()
    stats = engine.memory_stats()
    assert stats["kv_cache_bytes"] == 0 and stats["weights_bytes"] == 0 and engine.is_sleeping
    assert all(m.k_cache is None and m.v_cache is None for m in engine.model.attention_modules())
    assert old_buf() is None, "something still holds a view into the released pool"
    with pytest.raises(EngineAsleepError, match="wake"):
        engine.generate(make_prompts(), GREEDY)
    engine.wake()
    assert not engine.is_sleeping and engine.memory_stats()["kv_cache_bytes"] > 0
    assert greedy(engine) == before


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_fifty_cycles_leave_rss_flat(engine):
    before = greedy(engine)
    for cycle in range(50):
        engine.sleep(level=1)
        engine.wake()
        if cycle == 4:
            gc.collect()
            baseline = rss_bytes()
        if cycle % 10 == 9:
            assert greedy(engine) == before
    gc.collect()
    # The pool alone is 32 MiB: a leak of one pool (or of weights) per cycle would show as > 1 GiB.
    assert rss_bytes() - baseline < 8 << 20


def test_level2_refuses_until_weights_arrive_then_matches_them(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3", seed=0)
    _, new_model = hf_checkpoint("qwen3", seed=1)
    engine = Engine(path, device="cpu", kv_cache_memory=32 << 20)
    engine.sleep(level=2)
    engine.wake()
    with pytest.raises(WeightsNotReadyError, match="update_weights"):
        engine.generate(make_prompts(), GREEDY)
    engine.update_weights(new_model.state_dict().items())
    ids = make_prompts()[1]
    out = engine.generate([ids], GREEDY)[0].outputs[0]
    tokens, logprobs = hf_greedy(new_model, ids, 16)
    assert out.token_ids == tokens
    torch.testing.assert_close(torch.tensor(out.logprobs), logprobs, atol=1e-4, rtol=0)


def test_staged_wake(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3", seed=0)
    _, new_model = hf_checkpoint("qwen3", seed=1)
    engine = Engine(path, device="cpu", kv_cache_memory=32 << 20)
    engine.sleep(level=2)
    with pytest.raises(EngineAsleepError, match="weights"):
        engine.update_weights(new_model.state_dict().items())
    engine.wake(tags=["weights"])
    assert engine.memory_stats()["kv_cache_bytes"] == 0  # the pool stays released until asked for
    engine.update_weights(new_model.state_dict().items())
    with pytest.raises(EngineAsleepError, match="kv_cache"):
        engine.generate(make_prompts(), GREEDY)
    engine.wake(tags=["kv_cache"])
    ids = make_prompts()[0]
    assert engine.generate([ids], GREEDY)[0].outputs[0].token_ids == hf_greedy(new_model, ids, 16)[0]


def test_wake_without_room_raises_and_a_later_wake_succeeds(engine, monkeypatch):
    before = greedy(engine)
    blocks = engine.kv.num_blocks
    need = engine.kv.planner.total_bytes(blocks)
    engine.sleep(level=1)
    monkeypatch.setattr(kv_cache_module, "available_bytes", lambda device: need - 1)
    with pytest.raises(NoRoomError, match=f"needs {need} bytes.*only {need - 1}"):
        engine.wake()
    assert engine.is_sleeping and "kv_cache" in engine.memory_stats()["asleep"]
    with pytest.raises(EngineAsleepError):
        engine.generate(make_prompts(), GREEDY)
    monkeypatch.undo()
    engine.wake()
    assert engine.kv.num_blocks == blocks and greedy(engine) == before


def test_a_weights_wake_that_fails_part_way_keeps_the_host_copy_for_the_next(engine, monkeypatch):
    """The weights' wake fails after their values are back but before the model's buffers are (a host copy
    that cannot be read, an allocation): they stay asleep with their host copy, and the next wake serves the
    same tokens, not whatever the re-allocated memory held."""
    before = greedy(engine)
    engine.sleep(level=1)
    store, real = engine.weight_store, engine.weight_store.buffers

    def fails():
        monkeypatch.setattr(store, "buffers", real)
        raise RuntimeError("restoring the buffers failed")

    monkeypatch.setattr(store, "buffers", fails)
    with pytest.raises(RuntimeError, match="restoring the buffers failed"):
        engine.wake()
    assert "weights" in engine.memory_stats()["asleep"] and engine.memory_stats()["host_weights_bytes"] > 0
    engine.wake()
    assert greedy(engine) == before


def test_wake_with_resize_shrinks_the_pool(engine, monkeypatch):
    before = greedy(engine)
    small = engine.kv.planner.total_bytes(20)
    engine.sleep(level=1)
    monkeypatch.setattr(kv_cache_module, "available_bytes", lambda device: small)
    engine.wake(allow_resize=True)
    assert engine.kv.num_blocks == engine.block_manager.num_blocks == 20
    assert engine.memory_stats()["kv_cache_bytes"] <= small
    assert greedy(engine) == before  # fewer blocks, same greedy outputs (preemption makes room)


def test_a_pool_shrunk_by_a_resizing_wake_grows_back_at_the_next_one_with_room(engine, monkeypatch):
    """A plain wake keeps the shrunk count; the next wake(allow_resize=True) with room asks for the engine's
    first count again, rather than keeping the shrunk pool (and its shorter sequences) for good."""
    before, blocks = greedy(engine), engine.kv.num_blocks
    engine.sleep(level=1)
    with monkeypatch.context() as m:
        m.setattr(kv_cache_module, "available_bytes", lambda device: engine.kv.planner.total_bytes(20))
        engine.wake(allow_resize=True)
    assert engine.kv.num_blocks == 20
    engine.sleep(level=1)
    engine.wake()
    assert engine.kv.num_blocks == 20
    engine.sleep(level=1)
    with monkeypatch.context() as m:
        m.setattr(kv_cache_module, "available_bytes", lambda device: engine.kv.planner.total_bytes(30))
        engine.wake(allow_resize=True)  # room for 30: more than now, fewer than first
    assert engine.kv.num_blocks == engine.block_manager.num_blocks == 30
    engine.sleep(level=1)
    engine.wake(allow_resize=True)
    assert engine.kv.num_blocks == engine.block_manager.num_blocks == blocks
    assert engine.memory_stats()["kv_cache_bytes"] == engine.kv.planner.total_bytes(blocks)
    assert greedy(engine) == before


def test_a_pool_moved_while_the_weights_sleep_is_captured_again_when_they_wake(engine, monkeypatch):
    """With torch_memory_saver (stood in for here: addresses kept across pause and resume) a resizing wake of
    the KV cache alone moves the pool while the weights still sleep, so no capture can run yet; the weights'
    wake later moves nothing itself, and the graphs must still be captured again: they hold the old pool."""
    import contextlib
    import types

    class KeepsAddresses:
        _impl = types.SimpleNamespace(_mem_pools={})

        def region(self, tag):
            return contextlib.nullcontext()

        def pause(self, tag):
            pass

        def resume(self, tag):
            pass

    monkeypatch.setattr(engine.memory, "saver", KeepsAddresses())
    for name in ("empty_cache", "synchronize"):  # the saver's paths call them; no CUDA here
        monkeypatch.setattr(torch.cuda, name, lambda *args: None)
    captures = []
    capture = engine.sleep_wake.capture_graphs
    monkeypatch.setattr(engine.sleep_wake, "capture_graphs", lambda: captures.append(1) or capture())
    before = greedy(engine)
    engine.sleep(level=1)
    small = engine.kv.planner.total_bytes(20)
    with monkeypatch.context() as m:
        m.setattr(kv_cache_module, "available_bytes", lambda device: small)
        engine.wake(tags=["kv_cache"], allow_resize=True)
    assert engine.kv.num_blocks == 20 and captures == []
    engine.wake(tags=["weights"])
    assert captures == [1] and greedy(engine) == before
    engine.sleep(level=1)
    engine.wake()
    assert captures == [1] and engine.kv.num_blocks == 20  # nothing moved since
    engine.sleep(level=1)
    engine.wake(allow_resize=True)  # room again: back to the first count, in a new (larger) buffer
    assert engine.kv.num_blocks == engine.kv.configured_blocks > 20 and captures == [1, 1]
    assert greedy(engine) == before


def test_bad_sleep_arguments_leave_the_engine_awake(engine):
    with pytest.raises(ValueError, match="level"):
        engine.sleep(level=3)
    with pytest.raises(ValueError, match="tags"):
        engine.sleep(tags=["optimizer"])
    assert not engine.is_sleeping
    assert greedy(engine)


@pytest.mark.parametrize("first", [dict(level=1), dict(level=1, tags="weights")])
def test_level2_after_level1_discards_the_host_copy_and_refuses_until_weights_arrive(hf_checkpoint, first):
    """sleep(1) then sleep(2) is a level-2 sleep: the trainer may count on the host copy being gone and on
    generate refusing after wake, until a full update, as after sleep(2) alone."""
    path, _ = hf_checkpoint("qwen3", seed=0)
    _, new_model = hf_checkpoint("qwen3", seed=1)
    engine = Engine(path, device="cpu", kv_cache_memory=32 << 20)
    engine.sleep(**first)
    assert engine.memory_stats()["host_weights_bytes"] > 0
    engine.sleep(level=2)
    assert engine.memory_stats()["host_weights_bytes"] == 0
    assert engine.memory_stats()["asleep"] == ["kv_cache", "weights"]
    engine.wake()
    with pytest.raises(WeightsNotReadyError, match="update_weights"):
        engine.generate(make_prompts(), GREEDY)
    engine.update_weights(new_model.state_dict().items())
    ids = make_prompts()[0]
    assert engine.generate([ids], GREEDY)[0].outputs[0].token_ids == hf_greedy(new_model, ids, 16)[0]


def test_level1_after_level2_keeps_the_weights_discarded(engine):
    engine.sleep(level=2)
    engine.sleep(level=1)
    assert engine.memory_stats()["host_weights_bytes"] == 0
    engine.wake()
    with pytest.raises(WeightsNotReadyError):
        engine.generate(make_prompts(), GREEDY)


def test_an_engine_shut_down_refuses_to_generate(engine):
    """Engine.shutdown() says the engine cannot run after; on one device it had nothing to stop and served on."""
    from rollout_engine import EngineDeadError

    assert greedy(engine)
    engine.shutdown()
    with pytest.raises(EngineDeadError, match="shutdown"):
        greedy(engine)


def test_an_engine_shut_down_refuses_updates_sleep_and_wake(engine, hf_checkpoint):
    """A trainer pushing weights into an engine it shut down got a new version back, as if it served them."""
    from rollout_engine import EngineDeadError

    path = hf_checkpoint("qwen3", seed=1)[0]
    engine.shutdown()
    for call in (lambda: engine.update_weights_from_disk(path), lambda: engine.sleep(level=1),
                 lambda: engine.wake(), engine.flush_cache):
        with pytest.raises(EngineDeadError, match="shutdown"):
            call()
    assert engine.weight_version == 0 and not engine.is_sleeping
