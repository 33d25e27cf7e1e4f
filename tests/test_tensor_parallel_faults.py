"""Tensor parallelism over worker processes when a call fails part way (on the driver, in the weight relay, on a
worker): the ranks never serve different weights or memory states silently, and a worker is never left waiting
in a collective that will not come. Engine(tensor_parallel_size=2) on the CPU over gloo, as
test_tensor_parallel.py."""
import time

import pytest
import test_tensor_parallel as tp
from helpers import make_prompts

from rollout_engine import EngineAsleepError, EngineDeadError, EngineError, WeightsNotReadyError

checkpoint = tp.checkpoint  # the module-scoped (family, seed) -> (path, HF model) fixture
GREEDY, engine, run, assert_same = tp.GREEDY, tp.engine, tp.run, tp.assert_same
PROMPTS = make_prompts((5, 17))


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt  # Ctrl-C on the driver


@pytest.fixture
def old_and_new(checkpoint):
    """(old path, new path, new HF model, TP=1 tokens of the new weights)."""
    (old, _), (new, new_model) = checkpoint("llama3"), checkpoint("llama3", seed=1)
    return old, new, new_model, run(engine(new), PROMPTS, GREEDY)


def test_update_from_disk_interrupted_on_the_driver_is_stale_on_every_rank(old_and_new, monkeypatch):
    """Ctrl-C before the driver's own copy: the worker reads the checkpoint itself and finishes, so the ranks
    hold different weights; generate refuses until a complete update, which a worker that went ahead accepts
    (its version is the driver's)."""
    old, new, _, want_new = old_and_new
    two = engine(old, tp=2)
    try:
        before = run(two, PROMPTS, GREEDY)
        monkeypatch.setattr(two.weight_store, "update_from_disk", interrupt)
        with pytest.raises(KeyboardInterrupt):
            two.update_weights_from_disk(new)
        monkeypatch.undo()
        with pytest.raises(WeightsNotReadyError):
            two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert two.update_weights_from_disk(new, version=1) == 1
        assert_same(run(two, PROMPTS, GREEDY), want_new)
        assert two.update_weights_from_disk(old) == 2
        assert_same(run(two, PROMPTS, GREEDY), before)
    finally:
        two.shutdown()


def test_relayed_update_interrupted_on_the_driver_never_mixes_the_ranks(old_and_new, monkeypatch):
    """A worker receives a group only once the driver has copied it: Ctrl-C in the driver's check of the first
    group leaves both ranks on the old weights (as on one device); in the second group's, both copied the first
    and the weights are stale until a complete update."""
    old, _, new_model, want_new = old_and_new
    pairs = list(new_model.state_dict().items())
    two = engine(old, tp=2)
    try:
        before = run(two, PROMPTS, GREEDY)
        check, calls = two.weight_store.ops.nonfinite, []

        def interrupted_at(call):
            def nonfinite(*args):
                calls.append(args)
                if len(calls) == call:
                    raise KeyboardInterrupt  # Ctrl-C on the driver, in its check of that group
                return check(*args)
            return nonfinite

        monkeypatch.setattr(two.weight_store.ops, "nonfinite", interrupted_at(1))
        with pytest.raises(KeyboardInterrupt):
            two.update_weights_from_buckets([pairs[:5], pairs[5:]])
        assert two.weight_version == 0
        assert_same(run(two, PROMPTS, GREEDY), before)  # no rank copied anything
        calls.clear()
        monkeypatch.setattr(two.weight_store.ops, "nonfinite", interrupted_at(2))
        with pytest.raises(KeyboardInterrupt):
            two.update_weights_from_buckets([pairs[:5], pairs[5:]])
        monkeypatch.undo()
        with pytest.raises(WeightsNotReadyError):
            two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert two.update_weights(pairs) == 1
        assert_same(run(two, PROMPTS, GREEDY), want_new)
    finally:
        two.shutdown()


def test_a_tensor_the_driver_cannot_send_is_refused_before_anything_is_sent(checkpoint):
    path, model = checkpoint("llama3")
    two = engine(path, tp=2)
    try:
        before = run(two, PROMPTS, GREEDY)
        norm = model.state_dict()["model.norm.weight"]
        start = time.monotonic()
        with pytest.raises(ValueError, match="'model.norm.weight' is a torch.sparse_coo tensor"):
            two.update_weights_from_buckets([[("model.norm.weight", norm.to_sparse())]])
        assert time.monotonic() - start < 5
        assert two.weight_version == 0
        assert_same(run(two, PROMPTS, GREEDY), before)  # still serving, on both ranks
        assert two.update_weights(model.state_dict().items()) == 1
        assert_same(run(two, PROMPTS, GREEDY), before)
    finally:
        two.shutdown()


def test_a_relay_stopped_half_way_through_a_group_fails_the_next_call_at_once(checkpoint, monkeypatch):
    """Ctrl-C between two tensors of a group the worker was told to expect: the worker waits in a broadcast that
    never comes, so the engine is dead at once, not after the collective's timeout."""
    path, model = checkpoint("llama3")
    two = engine(path, tp=2)
    try:
        real, calls = two.tp.group.broadcast, []

        def second_tensor_interrupted(t):
            calls.append(t)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return real(t)

        monkeypatch.setattr(two.tp.group, "broadcast", second_tensor_interrupted)
        start = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            two.update_weights(model.state_dict().items())
        monkeypatch.undo()
        for call in (lambda: two.update_weights(model.state_dict().items()), two.sleep):
            with pytest.raises(EngineDeadError, match="stopped half way through a group"):
                call()
        # generate too, before it would say the weights are stale (the driver copied the group): no update helps
        with pytest.raises(EngineDeadError, match="stopped half way through a group"):
            two.generate(PROMPTS, GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 10
    finally:
        two.shutdown()


def test_a_wake_a_worker_fails_leaves_every_rank_asleep(checkpoint, monkeypatch):
    """The worker has no room for its pool (asked for far more blocks than fit): the driver's pool goes back to
    sleep, the engine stays asleep and consistent, and a later wake works."""
    path, _ = checkpoint("llama3")
    two = engine(path, tp=2)
    try:
        before = run(two, PROMPTS, GREEDY)
        two.sleep(level=1)
        real = two.tp.command

        def worker_without_room(message, *args):
            if message["op"] == "wake" and message["tags"] == ["kv_cache"]:
                message = message | {"blocks": 1 << 40}
            return real(message, *args)

        monkeypatch.setattr(two.tp, "command", worker_without_room)
        with pytest.raises(EngineError, match="rank 1 failed to wake: NoRoomError"):
            two.wake()
        monkeypatch.undo()
        # the weights woke on every rank; the pool on none
        assert two.is_sleeping and two.memory_stats()["asleep"] == ["kv_cache"]
        with pytest.raises(EngineAsleepError):
            two.generate(PROMPTS, GREEDY, use_tqdm=False)
        two.wake()
        assert not two.is_sleeping
        assert_same(run(two, PROMPTS, GREEDY), before)
    finally:
        two.shutdown()


def test_a_sleep_the_driver_fails_wakes_the_workers_again(checkpoint, monkeypatch):
    """The workers put their pools to sleep, then the driver's fails: theirs wake again, so the engine is awake on
    every rank and serves; a later sleep and wake work."""
    path, _ = checkpoint("llama3")
    two = engine(path, tp=2)
    try:
        before = run(two, PROMPTS, GREEDY)

        def fails():
            raise RuntimeError("injected: the driver's pool cannot sleep")

        monkeypatch.setattr(two.kv, "sleep", fails)
        with pytest.raises(RuntimeError, match="injected"):
            two.sleep(level=1)
        monkeypatch.undo()
        assert not two.is_sleeping
        assert_same(run(two, PROMPTS, GREEDY), before)
        two.sleep(level=1)
        two.wake()
        assert_same(run(two, PROMPTS, GREEDY), before)
    finally:
        two.shutdown()


def test_an_engine_that_fails_to_build_stops_its_worker_processes(checkpoint):
    """A build that fails after the workers started (here: a KV budget that holds no block) stops them at once,
    even while the error, whose traceback holds the half-built engine, is kept (a notebook keeps the last one)."""
    import os
    import subprocess

    from rollout_engine import Engine

    def children() -> set[str]:
        return set(subprocess.run(["pgrep", "-P", str(os.getpid())], capture_output=True, text=True).stdout.split())

    path, before = checkpoint("llama3")[0], children()
    with pytest.raises(ValueError, match="holds no block") as kept:
        Engine(path, device="cpu", kv_cache_memory=1000, tensor_parallel_size=2)
    assert kept.value is not None
    assert children() <= before
