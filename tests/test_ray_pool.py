"""EnginePool on a local Ray cluster: two CPU engines behave as one engine with twice the room."""
import math
import os
import pickle
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import config_twin, make_prompts, tied_twin

ray = pytest.importorskip("ray", reason="the Ray pool needs the [ray] extra (pip install 'rollout-engine[ray]')")

from rollout_engine import Engine, EngineAsleepError, SamplingParams  # noqa: E402
from rollout_engine import pool_plan, ray_pool  # noqa: E402
from rollout_engine.errors import EngineBusyError, EngineDeadError, EngineError  # noqa: E402
from rollout_engine.pool_plan import balance  # noqa: E402
from rollout_engine.ray_pool import EnginePool, absolute_paths, init_local_ray  # noqa: E402
from trainer_adapters import sync_weights  # noqa: E402

KV = 16 << 20
PARAMS = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    """One local Ray for the module. 4 logical CPUs: the shared pool's 2 engines and another pool's 2."""
    init_local_ray(num_cpus=4)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint):
    return hf_checkpoint("llama3", seed=0), hf_checkpoint("llama3", seed=1)


def engine_kwargs(path):
    return {"model_path": path, "device": "cpu", "kv_cache_memory": KV}


@pytest.fixture(scope="module")
def pool(cluster, checkpoints):
    (path, _), _ = checkpoints
    with EnginePool(2, engine_kwargs(path), num_gpus_per_engine=0) as pool:
        yield pool


def samples(outs):
    return [(o.request_id, o.weight_version, [(c.token_ids, c.finish_reason) for c in o.outputs]) for o in outs]


def assert_same(pool_outs, engine_outs):
    assert samples(pool_outs) == samples(engine_outs)
    for a, b in zip(pool_outs, engine_outs):
        for ca, cb in zip(a.outputs, b.outputs):  # batch composition differs: rounding only
            torch.testing.assert_close(torch.tensor(ca.logprobs), torch.tensor(cb.logprobs), atol=1e-5, rtol=0)


@pytest.mark.parametrize("engines, gpus, arg", [(5, 0, "num_engines=5"), (1, 1000, "num_gpus_per_engine=1000")])
def test_a_pool_the_local_ray_cannot_place_is_refused(cluster, checkpoints, engines, gpus, arg):
    """The module's Ray has 4 CPUs and one node: actors that cannot all be placed would wait forever."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=arg):
        EnginePool(engines, engine_kwargs(checkpoints[0][0]), num_gpus_per_engine=gpus)
    assert time.monotonic() - start < 10


def test_local_ray_listens_on_loopback_only(cluster):
    assert ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    assert {n["NodeManagerAddress"] for n in ray.nodes()} == {"127.0.0.1"}


def test_balance_spreads_expected_tokens_greedily():
    # largest first: 10 -> e0, 9 -> e1, 2 -> e1 (11), 1 -> e0 (11), 1 -> e0 (tie: the lower, 12), 1 -> e1 (12)
    assert balance([10, 1, 1, 1, 9, 2], 2) == [[0, 1, 2], [3, 4, 5]]
    assert balance([5], 3) == [[0], [], []]


def test_outputs_in_order_and_equal_to_one_fresh_engine(pool, checkpoints):
    """No seeds given: the pool seeds request i as a fresh Engine(seed=0) does, so every output equals that
    engine's, whichever pool engine ran it, and both engines get work."""
    (path, _), _ = checkpoints
    prompts = make_prompts((5, 17, 40, 9, 23, 3), seed=3)
    lengths = [SamplingParams(n=2, temperature=1.0, max_tokens=m, ignore_eos=True) for m in (4, 8, 2, 12, 6, 3)]
    base = pool.next_request
    got = pool.generate(prompts, lengths)
    assert [o.prompt_token_ids for o in got] == prompts
    assert [o.request_id for o in got] == list(range(base, base + 6))
    assert [len(o.outputs[0].token_ids) for o in got] == [4, 8, 2, 12, 6, 3]
    reference = Engine(path, device="cpu", kv_cache_memory=KV)
    if base:  # use up the request ids the pool has used, so the next ones match
        reference.generate([[1]] * base, SamplingParams(max_tokens=1), use_tqdm=False)
    assert_same(got, reference.generate(prompts, lengths, use_tqdm=False))
    assert all(balance([len(p) + 2 * s.max_tokens for p, s in zip(prompts, lengths)], 2))  # both engines ran some


def test_given_seeds_are_kept(pool, checkpoints):
    (path, _), _ = checkpoints
    prompts = make_prompts((7, 30, 11, 4), seed=4)
    params = [SamplingParams(n=3, temperature=0.9, top_p=0.95, max_tokens=6, seed=s) for s in (11, 12, 11, 40)]
    got = pool.generate(prompts, params)
    want = Engine(path, device="cpu", kv_cache_memory=KV).generate(prompts, params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]


def test_updates_reach_every_engine(pool, checkpoints):
    (_, model_a), (path_b, model_b) = checkpoints
    prompts = make_prompts((5, 17, 40, 9), seed=5)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = Engine(checkpoints[0][0], device="cpu", kv_cache_memory=KV)
    start = pool.weight_version
    version = pool.update_weights((n, p.detach()) for n, p in model_b.named_parameters())
    assert version == start + 1 == pool.weight_version
    reference.update_weights_from_disk(path_b)
    want = reference.generate(prompts, greedy, use_tqdm=False)
    got = pool.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert {o.weight_version for o in got} == {version}
    assert all(set(o.outputs[0].weight_versions) == {version} for o in got)
    version = pool.update_weights_from_disk(checkpoints[0][0], version=version + 5)
    assert version == start + 6 == pool.weight_version
    reference.update_weights((n, p.detach()) for n, p in model_a.named_parameters())
    got = pool.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids
                                                     for o in reference.generate(prompts, greedy, use_tqdm=False)]
    assert {o.weight_version for o in got} == {version}


def test_a_rejected_update_names_the_engine_and_changes_nothing(pool, checkpoints):
    _, (_, model_b) = checkpoints
    start = pool.weight_version
    with pytest.raises(ValueError, match=r"engine 0 of the pool's 2: .*shape"):
        pool.update_weights([("model.embed_tokens.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="version"):
        pool.update_weights(model_b.named_parameters(), version=start)
    assert pool.weight_version == start
    assert pool.generate(make_prompts((5,))[0], PARAMS)[0].weight_version == start


def test_sleep_wake_round_trip(pool):
    prompts = make_prompts((5, 17, 40, 9), seed=6)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before = pool.generate(prompts, greedy)
    pool.sleep(level=1)
    assert pool.is_sleeping is True
    with pytest.raises(EngineError, match="asleep"):
        pool.generate(prompts, greedy)
    pool.wake()
    assert pool.is_sleeping is False
    pool.flush_cache()
    after = pool.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]


def test_engines_that_disagree_on_sleeping_are_an_error_not_an_answer(pool):
    """is_sleeping reads as one engine's: a bool (a list of bools was truthy whatever it held), and an
    EngineError naming each engine's state when they differ."""
    ray.get(pool.actors[0].call.remote("sleep", 1))
    try:
        with pytest.raises(EngineError, match=r"is_sleeping differ: \{0: True, 1: False\}"):
            pool.is_sleeping
    finally:
        ray.get(pool.actors[0].call.remote("wake"))
    assert pool.is_sleeping is False


def test_bad_arguments_are_value_errors(cluster, checkpoints, pool):
    (path, _), _ = checkpoints
    with pytest.raises(ValueError, match="num_engines"):
        EnginePool(0, engine_kwargs(path))
    with pytest.raises(ValueError, match="model_path"):
        EnginePool(1, {"device": "cpu"})
    with pytest.raises(ValueError, match="num_gpus_per_engine"):
        EnginePool(1, engine_kwargs(path), num_gpus_per_engine=-1)
    for gpus in (1, 0.5):  # Ray would show each engine one GPU (or part of one) for its two ranks
        with pytest.raises(ValueError, match="num_gpus_per_engine=2"):
            EnginePool(1, engine_kwargs(path) | {"tensor_parallel_size": 2}, num_gpus_per_engine=gpus)
    with pytest.raises(ValueError, match="max_num_seqs"):  # the Engine's own check, raised in its actor
        EnginePool(1, engine_kwargs(path) | {"max_num_seqs": 0}, num_gpus_per_engine=0)
    with pytest.raises(ValueError, match="empty"):
        pool.generate([[1, 2], []], PARAMS)
    assert len(pool.generate([[1, 2]], PARAMS)[0].outputs) == 2  # still usable


def test_gpus_and_placement_group_are_checked_before_any_actor(cluster, checkpoints):
    (path, _), _ = checkpoints
    for gpus in (math.nan, math.inf, -math.inf):  # NaN passes a "< 0" check and would reach Ray
        with pytest.raises(ValueError, match=f"num_gpus_per_engine={gpus} is not allowed; a finite number >= 0"):
            EnginePool(1, engine_kwargs(path), num_gpus_per_engine=gpus)
    with pytest.raises(ValueError, match="placement_group='pg' is not allowed; a Ray PlacementGroup"):
        EnginePool(1, engine_kwargs(path), num_gpus_per_engine=0, placement_group="pg")


def test_placement_group_bundles(cluster, checkpoints):
    from ray.util.placement_group import placement_group, remove_placement_group

    (path, _), _ = checkpoints
    group = placement_group([{"CPU": 1}], strategy="PACK")
    with pytest.raises(ValueError, match="1 bundles; one per engine \\(2\\)"):
        EnginePool(2, engine_kwargs(path), num_gpus_per_engine=0, placement_group=group)
    ray.get(group.ready())
    with EnginePool(1, engine_kwargs(path), num_gpus_per_engine=0, placement_group=group) as pool:
        assert len(pool.generate(make_prompts((5, 9)), PARAMS)) == 2
    remove_placement_group(group)


def test_a_killed_engine_raises_at_once_and_a_new_pool_works(cluster, checkpoints):
    (path, _), _ = checkpoints
    prompts = make_prompts((5, 17, 40, 9), seed=7)
    broken = EnginePool(2, engine_kwargs(path), num_gpus_per_engine=0)
    pid = ray.get(broken.actors[1].__ray_call__.remote(lambda actor: os.getpid()))
    os.kill(pid, signal.SIGKILL)  # a crash (an OOM kill), not a polite ray.kill
    t = time.perf_counter()
    with pytest.raises(EngineDeadError, match="engine 1 of the pool's 2 is dead"):
        broken.generate(prompts, PARAMS)
    assert time.perf_counter() - t < 10
    with pytest.raises(EngineDeadError, match="engine 1"):
        broken.sleep()
    broken.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        broken.generate(prompts, PARAMS)
    with pytest.raises(EngineError, match="shut down"):  # sync_weights' first call on a pool
        broken.check_model({"model.norm.weight": (64,)})
    with EnginePool(2, engine_kwargs(path), num_gpus_per_engine=0) as rebuilt:
        assert [o.prompt_token_ids for o in rebuilt.generate(prompts, PARAMS)] == prompts


def test_relative_checkpoint_paths_are_the_callers(pool, checkpoints, monkeypatch):
    """A relative path names a directory in the caller's working directory, not in the actors' (Ray's, where it
    would name another checkpoint, served under the new version, or none)."""
    (path_a, _), (path_b, _) = checkpoints
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = make_prompts((5, 17), seed=6)
    want = Engine(path_b, device="cpu", kv_cache_memory=KV).generate(prompts, greedy, use_tqdm=False)
    monkeypatch.chdir(os.path.dirname(path_b))
    try:
        version = pool.update_weights_from_disk(os.path.basename(path_b))
        got = pool.generate(prompts, greedy)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
        assert {o.weight_version for o in got} == {version}
    finally:
        pool.update_weights_from_disk(path_a)
    kwargs = absolute_paths({"model_path": "ckpt", "draft_model": Path("draft"), "device": "cpu"})
    assert kwargs == {"model_path": os.path.join(os.getcwd(), "ckpt"),
                      "draft_model": os.path.join(os.getcwd(), "draft"), "device": "cpu"}
    assert absolute_paths({"model_path": "ckpt", "draft_model": "[ngram]"})["draft_model"] == "[ngram]"


def test_shutdown_from_another_thread_stops_a_running_call(cluster, checkpoints, monkeypatch):
    """shutdown() is not refused while another thread's generate runs (a trainer's signal handler or watchdog
    stops a pool that way): the running call raises EngineError, a second shutdown is a no-op. The running
    call is held in its first ray.wait (its requests sent, no result gathered) until shutdown returns."""
    busy = EnginePool(2, engine_kwargs(checkpoints[0][0]), num_gpus_per_engine=0)
    wait, inside, release, caught = ray.wait, threading.Event(), threading.Event(), []

    def held_wait(*args, **kwargs):
        inside.set()
        release.wait(60)
        return wait(*args, **kwargs)

    monkeypatch.setattr(ray, "wait", held_wait)

    def run():
        try:
            busy.generate([[5, 6, 7]] * 4, PARAMS)
        except EngineError as err:
            caught.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    assert inside.wait(60), "generate never waited for its engines"
    busy.shutdown()  # while generate holds the pool's one-call guard
    release.set()
    thread.join(timeout=60)
    monkeypatch.undo()
    assert not thread.is_alive() and caught, "the running call neither stopped nor raised"
    # cut in a wait ("was shut down while this call ran") or at the call's next fan-out ("is shut down")
    assert "shut down" in str(caught[0]) and "of the pool's 0" not in str(caught[0])
    busy.shutdown()
    with pytest.raises(EngineError, match="shut down"):
        busy.generate([[5, 6, 7]], PARAMS)


@pytest.mark.skipif(not hasattr(ray.runtime_context.RuntimeContext, "is_canceled"),
                    reason="an engine reads its task's cancel flag through RuntimeContext.is_canceled (late-2025 Ray)")
def test_an_interrupted_call_stops_its_engines_work(cluster, checkpoints):
    """Ctrl-C (a SIGINT to this process, three seconds into the call, while it waits for its engines): the call
    cancels each engine's part, which stops after its current step, and raises having changed nothing. The
    interrupted call holds about 13M tokens, minutes of CPU work, so the pool's next call, which would queue behind
    it, returns only if the engines stopped; it gives what a fresh engine gives (the same request ids and seeds)."""
    path = checkpoints[0][0]
    busy = EnginePool(2, engine_kwargs(path), num_gpus_per_engine=0)
    ctrl_c = threading.Timer(3.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            busy.generate([[5, 6, 7]] * 4096, SamplingParams(n=8, max_tokens=400, ignore_eos=True))
        prompts, outs = make_prompts(), []
        thread = threading.Thread(target=lambda: outs.append(busy.generate(prompts, PARAMS)))
        thread.start()
        thread.join(timeout=120)
        assert not thread.is_alive(), "the next call waited for the interrupted call's work"
        assert_same(outs[0], Engine(path, device="cpu", kv_cache_memory=KV).generate(prompts, PARAMS))
    finally:
        ctrl_c.cancel()
        busy.shutdown()


def greedy_tokens(generate_outs):
    return [o.outputs[0].token_ids for o in generate_outs]


def test_a_call_from_a_second_thread_is_refused_and_changes_nothing(pool):
    """As an Engine: while one thread's call runs, another thread's call raises EngineBusyError at once and
    takes no request ids, so no two requests share an id or a sampling seed."""
    long_params = SamplingParams(n=2, temperature=1.0, max_tokens=48, ignore_eos=True)
    done, results = [], {"first": [], "second": []}

    def first():
        try:
            results["first"].append(pool.generate(make_prompts((5, 9, 13, 7), seed=9), long_params))
        except EngineBusyError as err:  # the second thread got in first: the roles swap
            results["first"].append(err)
        done.append(True)

    thread = threading.Thread(target=first)
    thread.start()
    while not done:
        try:
            results["second"].append(pool.generate([[5, 6, 7, 8]], PARAMS))
        except EngineBusyError as err:
            results["second"].append(err)
        time.sleep(0.01)
    thread.join()
    refusals = [r for rs in results.values() for r in rs if isinstance(r, EngineBusyError)]
    served = [o for rs in results.values() for r in rs if isinstance(r, list) for o in r]
    ids = [o.request_id for o in served]
    assert len(set(ids)) == len(ids), f"request ids handed out twice: {sorted(ids)}"
    assert refusals, "no call overlapped another"
    assert all("one thread at a time" in str(err) and "EnginePool.generate()" in str(err) for err in refusals)
    assert pool.next_request == max(ids) + 1  # refused calls took no ids
    assert pool.generate([[5, 6, 7]], PARAMS)[0].request_id == max(ids) + 1  # the pool serves on


def test_update_weights_takes_what_engine_takes(pool, checkpoints):
    """A state dict works as with Engine.update_weights; what Engine refuses the pool refuses with the
    Engine's own ValueError, and the pool's weights stay as they were."""
    ((path_a, model_a), (path_b, model_b)) = checkpoints
    prompts = make_prompts((5, 17, 40, 9), seed=10)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    reference = Engine(path_a, device="cpu", kv_cache_memory=KV)
    before, start = greedy_tokens(pool.generate(prompts, greedy)), pool.weight_version
    bad = {"a bare tensor": torch.zeros(3), "None": None, "a list of names": ["model.norm.weight"],
           "a (name, list) pair": [("model.norm.weight", [1.0] * 64)],
           "a triple": [("model.norm.weight", torch.ones(64), 0)]}
    for what, arg in bad.items():
        with pytest.raises(ValueError) as engine_err:
            reference.update_weights(arg)
        with pytest.raises(ValueError) as pool_err:
            pool.update_weights(arg)
        assert str(pool_err.value).endswith(str(engine_err.value)), what
    assert pool.weight_version == start and greedy_tokens(pool.generate(prompts, greedy)) == before
    state_b = {n: p.detach() for n, p in model_b.state_dict().items()}
    assert pool.update_weights(state_b) == start + 1
    reference.update_weights_from_disk(path_b)
    assert greedy_tokens(pool.generate(prompts, greedy)) == greedy_tokens(reference.generate(prompts, greedy,
                                                                                              use_tqdm=False))
    pool.update_weights({n: p.detach() for n, p in model_a.state_dict().items()})
    assert greedy_tokens(pool.generate(prompts, greedy)) == before


def test_sync_weights_into_a_pool_checks_the_model_first(pool, checkpoints):
    """trainer_adapters.sync_weights takes a pool as it takes an Engine: a model that fits updates every engine; a
    tied model (its update would leave the untied engines' old lm_head serving), one with another RMSNorm epsilon or a
    value head is refused, naming the engine, before anything is sent, and the pool serves on at its version."""
    ((path_a, model_a), (path_b, model_b)) = checkpoints
    prompts = make_prompts((5, 17, 40, 9), seed=12)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    before, start = greedy_tokens(pool.generate(prompts, greedy)), pool.weight_version
    critic = config_twin(model_b)
    critic.v_head = torch.nn.Linear(model_b.config.hidden_size, 1)
    refused = {r"\['lm_head.weight'\].*tie_word_embeddings differs": tied_twin(model_b), "v_head.weight": critic,
               "rms_norm_eps": config_twin(model_b, rms_norm_eps=10 * model_b.config.rms_norm_eps)}
    for says, model in refused.items():
        with pytest.raises(ValueError, match=f"engine 0 of the pool's 2: .*{says}"):
            sync_weights(pool, model)
    assert pool.weight_version == start and greedy_tokens(pool.generate(prompts, greedy)) == before
    assert sync_weights(pool, model_b) == start + 1 == pool.weight_version
    reference = Engine(path_b, device="cpu", kv_cache_memory=KV)
    assert greedy_tokens(pool.generate(prompts, greedy)) == greedy_tokens(reference.generate(prompts, greedy,
                                                                                              use_tqdm=False))
    sync_weights(pool, model_a)
    assert greedy_tokens(pool.generate(prompts, greedy)) == before


@pytest.mark.parametrize("level", [1, 2])
def test_an_update_into_a_sleeping_pool_is_refused_before_anything_is_put(pool, checkpoints, monkeypatch, level):
    """As an Engine refuses an update into sleeping weights before it reads a tensor, the pool refuses before it
    gathers or puts any (a trainer's whole model went into the object store, then every engine refused it)."""
    (_, model_a), (_, model_b) = checkpoints
    start, put = pool.weight_version, []
    monkeypatch.setattr(ray, "put", lambda obj, **kw: put.append(obj))
    pool.sleep(level)
    try:
        for update in (lambda: sync_weights(pool, model_b), lambda: pool.update_weights(model_b.named_parameters())):
            with pytest.raises(EngineAsleepError, match="engine 0 of the pool's 2: the weights are asleep"):
                update()
        assert put == []
    finally:
        pool.wake()
    if level == 2:  # the weights were discarded: put them back
        monkeypatch.undo()
        sync_weights(pool, model_a)
    assert pool.weight_version == start + (level == 2)


def test_views_of_one_buffer_send_their_own_bytes(pool, checkpoints, monkeypatch):
    """Parameters that are views of one flat buffer (FSDP flat parameters, a fused qkv split by chunk()):
    each goes into the object store as its own bytes, not its whole storage, in buckets of BUCKET_BYTES."""
    ((_, model_a), (path_b, model_b)) = checkpoints
    named = [(n, p.detach()) for n, p in model_b.named_parameters()]
    # 2-D weights stored transposed, so their views are also not contiguous
    flat = torch.cat([(p.t() if p.dim() == 2 else p).reshape(-1) for _, p in named])
    views, offset = [], 0
    for n, p in named:
        chunk = flat[offset:offset + p.numel()]
        views.append((n, chunk.view(p.shape[::-1]).t() if p.dim() == 2 else chunk.view(p.shape)))
        offset += p.numel()
    assert all(torch.equal(v, p) for (_, v), (_, p) in zip(views, named))
    payload = flat.numel() * flat.element_size()
    largest = max(p.numel() * p.element_size() for _, p in named)
    monkeypatch.setattr(ray_pool, "BUCKET_BYTES", payload // 4)
    sent, put = [], ray.put
    monkeypatch.setattr(ray, "put", lambda obj, **kw: sent.append(len(pickle.dumps(obj))) or put(obj, **kw))
    pool.update_weights(views)
    overhead = 1 << 16  # pickling's names, shapes and framing
    assert sum(sent) < payload + overhead, f"{sum(sent) / payload:.1f}x the weights' bytes went to the object store"
    assert len(sent) > 1 and all(size < payload // 4 + largest + overhead for size in sent), sent
    monkeypatch.undo()
    reference = Engine(path_b, device="cpu", kv_cache_memory=KV)
    prompts = make_prompts((5, 17, 40, 9), seed=11)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    assert greedy_tokens(pool.generate(prompts, greedy)) == greedy_tokens(reference.generate(prompts, greedy,
                                                                                              use_tqdm=False))
    pool.update_weights((n, p.detach()) for n, p in model_a.named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_gpu_engines_equal_one(checkpoints):
    """One engine per GPU; greedy outputs equal one engine's on the driver's GPU."""
    (path, _), _ = checkpoints
    if not ray.is_initialized():
        init_local_ray()
    prompts = make_prompts((5, 17, 40, 9, 23, 31, 12, 3), seed=8)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kwargs = {"model_path": path, "kv_cache_memory": 1 << 30}
    with EnginePool(2, kwargs, num_gpus_per_engine=1) as pool:
        assert all(s["device_total_bytes"] > 0 for s in pool.memory_stats())
        gpu_ids = [ray.get(a.__ray_call__.remote(lambda actor: tuple(ray.get_gpu_ids()))) for a in pool.actors]
        assert len(set(gpu_ids)) == 2 and all(len(ids) == 1 for ids in gpu_ids)  # one GPU each, not the same
        got = pool.generate(prompts, greedy)
    want = Engine(path, kv_cache_memory=1 << 30).generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_split_tokens_keeps_a_pool_wide_budget():
    assert pool_plan.split_tokens(10, [3, 1]) == [8, 2]  # in proportion to the shares' expected tokens
    assert pool_plan.split_tokens(7, [5, 5, 5]) == [3, 2, 2]  # the remainder to the lower engines
    assert pool_plan.split_tokens(1, [9, 1]) == [1, 1]  # each engine's budget is at least 1
    # the floors of 1 come out of the largest parts: the pool's total is kept
    assert pool_plan.split_tokens(10, [1, 1, 1000]) == [1, 1, 8]
    for total, loads in [(100, [1] * 5 + [10000] * 2), (7, [1, 1, 1, 1, 50]), (64, [3, 1, 7, 1, 1, 9])]:
        parts = pool_plan.split_tokens(total, loads)
        assert sum(parts) == max(total, len(loads)) and min(parts) >= 1, (total, loads, parts)


def test_resumed_outputs_continue_their_samples_and_keep_their_ids(pool, checkpoints):
    """A pool call stopped by token_budget, resumed by the pool after other calls, gives the tokens of one
    uninterrupted Engine run and keeps its request ids; later requests take ids past them."""
    (path, _), _ = checkpoints
    prompts = make_prompts((5, 9, 13), seed=12)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True)
    with pytest.raises(ValueError, match="token_budget"):
        pool.generate(prompts, params, token_budget=0)
    base = pool.next_request
    part = pool.generate(prompts, params, token_budget=8)
    assert [o.request_id for o in part] == [base, base + 1, base + 2]
    assert {c.finish_reason for o in part for c in o.outputs} == {"abort"}
    assert sum(len(c.token_ids) for o in part for c in o.outputs) < 6 * 12
    pool.generate([[7, 7, 7]], SamplingParams(max_tokens=2))  # the pool serves on between the calls
    got = pool.generate(part[::-1], params)
    reference = Engine(path, device="cpu", kv_cache_memory=KV)
    if base:  # request ids as the pool's
        reference.generate([[1]] * base, SamplingParams(max_tokens=1), use_tqdm=False)
    want = reference.generate(prompts, params, use_tqdm=False)
    assert [o.request_id for o in got] == [base + 2, base + 1, base]
    assert [[c.token_ids for c in o.outputs] for o in got[::-1]] == [[c.token_ids for c in o.outputs] for o in want]
    later = pool.generate([part[0], [4, 5, 6]], params)  # an old id resumed again: new ids still go past it
    assert later[1].request_id == pool.next_request - 1 > base + 3


def test_engines_on_different_weight_versions_refuse_to_generate(pool, checkpoints):
    """An update that reached one engine only (engine 0 left asleep by a wake that failed there): generate
    refuses, naming each engine's version, rather than mixing versions in one call's outputs."""
    (path_a, _), (path_b, _) = checkpoints
    start = pool.weight_version
    ray.get(pool.actors[0].call.remote("sleep", 1))
    try:
        pool.update_weights_from_disk(path_b)
    except EngineError:
        pass  # an engine may refuse an update while asleep; the pool's versions differ either way
    pool.wake()
    versions = ray.get([actor.call.remote("weight_version") for actor in pool.actors])
    assert len(set(versions)) == 2
    with pytest.raises(EngineError, match=rf"weight_version differ: \{{0: {versions[0]}, 1: {versions[1]}\}}"):
        pool.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(max_tokens=3))
    assert pool.update_weights_from_disk(path_a) == max(versions) + 1  # the retry needs no version
    assert pool.weight_version == max(versions) + 1 > start


@pytest.mark.parametrize("field, value", [("max_tokens", None), ("n", "2")])
def test_a_field_changed_after_construction_is_the_engines_value_error(pool, field, value):
    params = SamplingParams(max_tokens=4, seed=7)
    setattr(params, field, value)
    with pytest.raises(ValueError, match=f"{field}={value!r} is not allowed"):
        pool.generate([[1, 2, 3], [4, 5]], params)


def built_within(seconds, build):
    """What `build()` returned or raised, asserting that it did so within `seconds` (run in a thread, so a
    build that waits forever fails the test rather than hanging it)."""
    result = {}

    def run():
        try:
            result["pool"] = build()
        except Exception as err:  # noqa: BLE001 - the test reads it
            result["err"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"EnginePool() still waiting after {seconds} s"
    return result


def test_a_pool_that_does_not_fit_in_free_resources_is_refused(pool, checkpoints, monkeypatch):
    """The module's Ray has 4 CPUs and the shared pool holds 2: 3 more engines would wait forever."""
    monkeypatch.setattr(ray_pool, "ROOM_WAIT_S", 0.5)
    result = built_within(20, lambda: EnginePool(3, engine_kwargs(checkpoints[0][0]), num_gpus_per_engine=0))
    assert isinstance(result.get("err"), ValueError), result
    assert "num_engines=3 is not allowed now" in str(result["err"]) and "free" in str(result["err"])


def test_a_pool_a_ray_of_the_callers_cannot_place_is_refused_after_the_schedule_wait(pool, checkpoints,
                                                                                     monkeypatch):
    """On a Ray that is not the module's loopback one (a plain ray.init() binds the host's address) the room check
    leaves what does not fit to an autoscaler, which a one-node Ray lacks: EnginePool() waited forever. Its actors
    are now refused once not placed within SCHEDULE_WAIT_S, and none is left holding resources."""
    from rollout_engine import ray_cluster

    monkeypatch.setattr(ray_cluster, "_on_loopback", lambda: False)  # as on the caller's ray.init()
    monkeypatch.setattr(ray_pool, "SCHEDULE_WAIT_S", 3)
    free = ray.available_resources().get("CPU", 0)
    result = built_within(60, lambda: EnginePool(3, engine_kwargs(checkpoints[0][0]), num_gpus_per_engine=0))
    assert isinstance(result.get("err"), ValueError), result
    assert "num_engines=3 is not allowed here" in str(result["err"]) and "not placed within 3 s" in str(result["err"])
    deadline = time.monotonic() + 20
    while ray.available_resources().get("CPU", 0) < free and time.monotonic() < deadline:
        time.sleep(0.1)  # the refused pool's actors are killed: their CPUs come back
    assert ray.available_resources().get("CPU", 0) == free


def test_an_update_whose_version_an_engine_has_reached_changes_no_engine(pool, checkpoints):
    """Engines left apart (engine 0 alone took version v+1, an update that failed on engine 1), then the trainer's
    next weights sent as version v+1: engine 0 refused them and engine 1 took them, and the pool read as one
    version naming two sets of weights. Now refused before anything is sent, naming the engine."""
    (path_a, _), (path_b, model_b) = checkpoints
    start = pool.weight_version
    ray.get(pool.actors[0].call.remote("update_weights_from_disk", str(path_b), start + 1))
    with pytest.raises(ValueError, match=rf"version={start + 1} is not allowed.*engines \{{0: {start + 1}\}}"):
        pool.update_weights(((n, p.detach()) for n, p in model_b.named_parameters()), version=start + 1)
    with pytest.raises(ValueError, match=rf"version={start + 1} is not allowed"):
        pool.update_weights_from_disk(path_a, version=start + 1)
    versions = ray.get([actor.call.remote("weight_version") for actor in pool.actors])
    assert versions == [start + 1, start]  # engine 1 unchanged
    assert pool.update_weights_from_disk(path_a) == start + 2 == pool.weight_version


def test_a_placement_group_never_placed_is_refused(cluster, checkpoints, monkeypatch):
    from ray.util.placement_group import placement_group, remove_placement_group

    monkeypatch.setattr(ray_pool, "PLACEMENT_WAIT_S", 1)
    group = placement_group([{"CPU": 8}] * 2)  # more than the node has
    try:
        result = built_within(20, lambda: EnginePool(2, engine_kwargs(checkpoints[0][0]), num_gpus_per_engine=0,
                                                     placement_group=group))
    finally:
        remove_placement_group(group)
    assert isinstance(result.get("err"), ValueError), result
    assert "placement_group is not allowed: it was not placed within 1 s" in str(result["err"])


def test_a_placement_group_whose_bundle_a_trainer_holds_is_refused(cluster, checkpoints, monkeypatch):
    """Colocated: a trainer actor holds bundle 0, so engine 0 would wait for it forever (the pool waited in
    actor.start). Refused after ROOM_WAIT_S naming the bundle, with no engine left in bundle 1; a bundle that holds
    too little for an engine is refused at once."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    @ray.remote(num_cpus=1)
    class Trainer:
        def ping(self):
            return 1

    monkeypatch.setattr(ray_pool, "ROOM_WAIT_S", 0.5)
    path, group = checkpoints[0][0], placement_group([{"CPU": 1}, {"CPU": 1}])
    assert group.wait(10)
    trainer = Trainer.options(scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0)).remote()
    try:
        ray.get(trainer.ping.remote())
        taken = built_within(15, lambda: EnginePool(2, engine_kwargs(path), num_gpus_per_engine=0,
                                                    placement_group=group))
        bundle_1 = ray.available_resources().get(f"CPU_group_1_{group.id.hex()}", 0)
        no_gpu = built_within(15, lambda: EnginePool(1, engine_kwargs(path), num_gpus_per_engine=1,
                                                     placement_group=group))
    finally:
        ray.kill(trainer)
        remove_placement_group(group)
    assert isinstance(taken.get("err"), ValueError), taken
    assert "placement_group is not allowed now: each engine needs {'CPU': 1}" in str(taken["err"])
    assert "bundle(s) [0] have only {0: {'CPU': 0}} free after 0.5 s" in str(taken["err"])
    assert bundle_1 == 1, "an engine was left holding bundle 1"
    assert isinstance(no_gpu.get("err"), ValueError), no_gpu
    assert "bundle 0 holds {'CPU': 1.0} and engine 0 needs {'CPU': 1, 'GPU': 1}" in str(no_gpu["err"])


def test_a_pool_with_a_draft_updates_the_draft_after_a_level_2_sleep(cluster, checkpoints):
    """sleep(2) discards the draft's weights with the target's: model="draft" (as Engine takes it, no version)
    brings them back through the pool, from tensors and from disk, and the pool serves again, with the tokens it
    gave before the sleep (greedy speculation keeps the target's tokens)."""
    (path, model), (draft_path, draft) = checkpoints
    kwargs = engine_kwargs(path) | {"draft_model": draft_path, "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with EnginePool(1, kwargs, num_gpus_per_engine=0) as pool:
        before = [o.outputs[0].token_ids for o in pool.generate(make_prompts(), params)]
        pool.sleep(2)
        pool.wake()
        version = pool.update_weights((n, p.detach()) for n, p in model.named_parameters())
        with pytest.raises(EngineError, match="discarded"):
            pool.generate(make_prompts(), params)
        assert pool.update_weights(((n, p.detach()) for n, p in draft.named_parameters()), model="draft") == version
        assert [o.outputs[0].token_ids for o in pool.generate(make_prompts(), params)] == before
        pool.sleep(2)
        pool.wake()
        pool.update_weights_from_disk(path)
        pool.update_weights_from_disk(draft_path, model="draft")
        assert [o.outputs[0].token_ids for o in pool.generate(make_prompts(), params)] == before


def test_tensor_rows_go_to_the_engines_as_their_own_token_ids():
    """A row of a tokenized batch is a view of the batch: pickled as it is, each row would carry the whole
    batch's storage to its engine (rows x batch bytes). The plan sends integer arrays as lists of ints (in a
    dict too), so a call ships about its own tokens; other prompts go as they are."""
    batch = torch.randint(0, 400, (256, 64))
    rows = list(batch)
    prompts, _ = pool_plan.requests(rows[:-2] + [{"prompt_token_ids": rows[-2]}, rows[-1].numpy()], PARAMS)
    assert prompts[:-2] == [r.tolist() for r in rows[:-2]] and prompts[-1] == rows[-1].tolist()
    assert prompts[-2] == {"prompt_token_ids": rows[-2].tolist()}
    assert len(pickle.dumps(prompts)) < 2 * batch.numel() * batch.element_size()
    assert pool_plan.requests(["text", [1, 2]], PARAMS)[0] == ["text", [1, 2]]
    as_items = pool_plan.requests([list(rows[0]), tuple(rows[1])], PARAMS)[0]  # 0-d views, each of the batch
    assert as_items == [rows[0].tolist(), rows[1].tolist()] and len(pickle.dumps(as_items)) < 4096


def test_a_refused_prompt_stops_the_other_engines_at_once(pool):
    """One prompt the engines refuse (longer than max_model_len) fails the call as one Engine fails it; the
    other engines' shares, whose outputs the failed call throws away, are cancelled rather than run to their
    end, and the pool serves the next call."""
    long_params = SamplingParams(n=4, temperature=1.0, max_tokens=1500, ignore_eos=True)
    too_long = list(range(1, 3000))
    start = time.monotonic()
    with pytest.raises(ValueError, match="3000|2999") as refused:
        pool.generate([[1, 2, 3]] * 8 + [too_long], long_params)
    assert "succeeded" not in str(refused.value), refused.value  # the other engine's share did not run out
    assert time.monotonic() - start < ray_pool.CANCEL_WAIT_S
    assert len(pool.generate([[5, 6, 7]], PARAMS)[0].outputs) == 2


def test_properties_from_a_second_thread_are_refused_at_once(pool):
    """weight_version and is_sleeping ask every engine, whose actors answer after their running call: from
    another thread they are refused at once (EngineBusyError), as every other call is, rather than waiting
    out a rollout."""
    long_params = SamplingParams(n=4, temperature=1.0, max_tokens=600, ignore_eos=True)

    def rollout():
        while True:  # refused while the main thread's probe below runs: try again
            try:
                return pool.generate([[1, 2, 3]] * 8, long_params)
            except EngineBusyError:
                time.sleep(0.001)

    thread = threading.Thread(target=rollout)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the rollout runs: a public call is refused
            try:
                pool.memory_stats()
            except EngineBusyError:
                break
        for name in ("weight_version", "is_sleeping"):
            start = time.monotonic()
            with pytest.raises(EngineBusyError, match="another thread"):
                getattr(pool, name)
            assert time.monotonic() - start < 1
    finally:
        thread.join()
    assert pool.weight_version >= 0 and pool.is_sleeping is False


def test_a_call_from_inside_a_call_says_so(pool, checkpoints):
    """The weights an update iterates may call back into the pool (a trainer's hook): refused, naming the call
    it came from inside, as an Engine says, not "another thread"."""
    (_, model), _ = checkpoints
    version = pool.weight_version

    def weights():
        pool.memory_stats()
        yield from model.state_dict().items()

    with pytest.raises(EngineBusyError, match=r"from inside EnginePool.update_weights\(\)"):
        pool.update_weights(weights())
    assert pool.weight_version == version
