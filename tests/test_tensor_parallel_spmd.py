"""Tensor parallelism, SPMD: every rank of a torch.distributed job builds Engine(path, process_group=pg).

Two processes (gloo, CPU, float32) are started by the test; each runs `_rank_main` on the same calls and
pickles what it saw, and the test compares. TP=2 computes what TP=1 computes except the order of two sums
per layer (the all-reduced o_proj and down_proj partial sums), so float32 logprobs agree to ~1e-6; 1e-4 is
the repo's logprob tolerance (test_tensor_parallel.py, way (a), makes the same comparison). The tiny models'
logits are spread apart, so greedy and seeded tokens are the same tokens.
"""
import functools
import os
import pickle
import shutil
import time
import types
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import make_prompts
from safetensors.torch import load_file, save_file
from test_tensor_parallel import (GPU_GREEDY, GPU_PROMPTS, GREEDY, KV, SAMPLED, SCORED, assert_same, build,
                                  gpu_reference, run)

from rollout_engine import Engine, SamplingParams

FAMILIES = ("llama3", "llama-linear-bias")  # GQA with an untied head; MHA with o/down biases and a tied head
PROMPTS = make_prompts((5, 17, 40))
LIFECYCLE = "llama3"
BUDGETED = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
RUN_TIMEOUT_S = 240  # both ranks' whole run; a rank stuck in a collective fails it after COLLECTIVE_S
COLLECTIVE_S = 60
FAST_CLOCK_S = 10.0  # rank 1's clock in the time-budget call: this many seconds pass per reading


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family or "new" -> (path, HF model): each family at seed 0, and LIFECYCLE's at seed 1 for updates."""
    out = {}
    for name, family, seed in [(f, f, 0) for f in FAMILIES] + [("new", LIFECYCLE, 1)]:
        model, path = build(family, seed), tmp_path_factory.mktemp(f"spmd-{name}")
        model.save_pretrained(path, safe_serialization=True)
        out[name] = (path, model)
    return out


@pytest.fixture(scope="module")
def ranks(checkpoints, tmp_path_factory):
    """[rank 0's results, rank 1's], each a dict of what `_rank_main` saw."""
    work = tmp_path_factory.mktemp("spmd-run")
    paths = {name: str(path) for name, (path, _) in checkpoints.items()}
    _spawn(_rank_main, (str(work), paths))
    return _results(work)


def _spawn(main, args, nprocs=2) -> None:
    """Run main(rank, *args) in `nprocs` fresh processes until all end; a rank's exception is raised here."""
    context = mp.start_processes(main, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not context.join(timeout=1):  # raises, having ended the other rank, when a rank fails
        if time.monotonic() > deadline:
            for proc in context.processes:
                proc.kill()
            pytest.fail(f"the two ranks did not finish within {RUN_TIMEOUT_S} s")


def _results(work) -> list[dict]:
    """What each rank pickled into `work`, in rank order."""
    results = []
    for rank in range(2):
        with open(os.path.join(work, f"rank{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def engine(path, pg, **kw):
    return Engine(path, device="cpu", kv_cache_memory=KV, process_group=pg, **kw)


def outcome(call):
    """(type name, message) of what `call()` raised, or ("ok", its result)."""
    try:
        return "ok", call()
    except Exception as err:
        return type(err).__name__, str(err)


def _rank_main(rank: int, work: str, paths: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2,
                           timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        pg, seen = dist.new_group([0, 1], timeout=timedelta(seconds=COLLECTIVE_S)), {}
        for family in FAMILIES:
            e = engine(paths[family], pg)
            seen[family] = {"heads": e.kv.pools["target"].num_kv_heads, "greedy": run(e, PROMPTS, GREEDY),
                            "sampled": run(e, PROMPTS, SAMPLED),
                            "scored": [o.prompt_logprobs for o in e.generate(PROMPTS[:2], SCORED, use_tqdm=False)]}
            del e
        e = engine(paths[LIFECYCLE], pg, tensor_parallel_size=2)
        # each rank may read its own copy of a checkpoint (as Engine() may): rank 1 updates from one of its own
        own = paths[LIFECYCLE] if rank == 0 else shutil.copytree(paths[LIFECYCLE], os.path.join(work, "rank1"))
        seen |= _lifecycle(e, paths, own)
        seen |= _disagreements(rank, e, paths)
        seen |= _one_rank_failure(rank, e, "wake")
        seen |= _one_rank_failure(rank, e, "sleep")
        seen |= _sharded_updates(rank, e, paths)
        order = ["weights", "kv_cache"] if rank == 0 else ["kv_cache", "weights"]  # the same tags, as a set would
        seen["either_order"] = outcome(lambda: (e.sleep(tags=order), e.wake(tags=order), run(e, PROMPTS, GREEDY))[-1])
        seen |= _one_rank_deeper_sleep_failure(rank, e, own)
        seen |= _one_rank_capture_failure(rank, e)
        seen |= _one_rank_shrinking_pool(rank, e)
        seen |= _a_call_that_cannot_be_put_back(rank, e, "sleep")
        seen |= _a_call_that_cannot_be_put_back(rank, engine(paths[LIFECYCLE], pg, tensor_parallel_size=2), "wake")
        seen |= _a_wake_failing_on_one_rank_after_its_agreements(rank, engine(paths[LIFECYCLE], pg))
        seen |= _a_flush_failing_on_one_rank(rank, engine(paths[LIFECYCLE], pg))
        seen |= _a_call_failing_on_one_rank_before_an_inner_agreement(rank, engine(paths[LIFECYCLE], pg), "wake")
        seen |= _a_call_failing_on_one_rank_before_an_inner_agreement(rank, engine(paths[LIFECYCLE], pg), "sleep")
        seen |= _an_update_whose_flush_fails_on_one_rank(rank, engine(paths[LIFECYCLE], pg), own)
        seen |= _an_update_one_rank_holds_less_of(rank, engine(paths[LIFECYCLE], pg), paths)
        seen |= _a_build_failing_on_one_rank(rank, pg, paths, work)
        seen["different_engine_args"] = outcome(lambda: engine(paths[LIFECYCLE], pg, seed=rank))
        seen["refused"] = [outcome(lambda kw=kw: engine(paths[LIFECYCLE], pg, **kw)) for kw in
                           (dict(tensor_parallel_size=4), dict(tensor_parallel_size=1), dict(quantization="fp8"),
                            dict(batch_invariant=True))]
        with open(os.path.join(work, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(seen, f)
    finally:
        dist.destroy_process_group()


def _lifecycle(e, paths, own: str) -> dict:
    new = load_file(os.path.join(paths["new"], "model.safetensors"))
    seen = {"before": run(e, PROMPTS, GREEDY)}
    e.sleep(level=1)
    e.wake()
    seen["after_wake"] = run(e, PROMPTS, GREEDY)
    e.sleep(level=2)  # weights discarded on both ranks; staged wake, a full update, then the pool
    e.wake(tags=["weights"])
    seen["versions"] = [e.update_weights(new.items())]
    e.wake(tags=["kv_cache"])
    seen["new"] = run(e, PROMPTS, GREEDY)
    seen["versions"].append(e.update_weights_from_disk(own))
    seen["back"] = run(e, PROMPTS, GREEDY)
    pairs = list(new.items())
    seen["versions"].append(e.update_weights_from_buckets([pairs[:5], pairs[5:]]))
    e.flush_cache()
    seen["new_buckets"] = run(e, PROMPTS, GREEDY)
    return seen


def _disagreements(rank: int, e, paths) -> dict:
    """Calls whose arguments or outcome differ between the ranks; the engine serves the same afterwards."""
    other = make_prompts((5, 17, 40), seed=1)
    seen = {"different_prompts": outcome(lambda: run(e, PROMPTS if rank == 0 else other, GREEDY)),
            "one_rank_bad": outcome(lambda: run(e, PROMPTS if rank == 0 else [[10**6]], GREEDY)),
            "different_sleep": outcome(lambda: e.sleep(level=1 + rank)), "sleeping": e.is_sleeping,
            "different_version": outcome(lambda: e.update_weights([], version=10 + rank)),
            "version": e.weight_version, "still": run(e, PROMPTS, GREEDY)}
    # Rank 1's update fails its checks (nothing copied there) after rank 0's copied: both end incomplete, at
    # the version they had, and a complete update on both serves again.
    q = "model.layers.0.self_attn.q_proj.weight"
    named = {q: e.weights.destination(q).new_zeros(e.weights.full_shape(q)) + (0.0 if rank == 0 else float("nan"))}
    seen |= {"half_update": outcome(lambda: e.update_weights(named.items())), "half_version": e.weight_version,
             "half_history": list(e.weight_history), "half_generate": outcome(lambda: run(e, PROMPTS, GREEDY))}
    seen["completed"] = e.update_weights(load_file(os.path.join(paths["new"], "model.safetensors")).items())
    seen["after_complete"] = run(e, PROMPTS, GREEDY)
    # A time budget: rank 1's clock runs fast, so its budget is spent first; both ranks stop at that step.
    from rollout_engine import partial

    real, readings = partial.time, iter(range(1_000_000))
    if rank == 1:
        partial.time = types.SimpleNamespace(monotonic=lambda: FAST_CLOCK_S * next(readings))
    try:
        outs = e.generate(PROMPTS, BUDGETED, use_tqdm=False, time_budget=3 * FAST_CLOCK_S)
    finally:
        partial.time = real
    seen["timed"] = [[(c.token_ids, c.finish_reason) for c in o.outputs] for o in outs]
    return seen


def fail_once(obj, name: str, error: BaseException) -> None:
    """The next call of obj.name raises `error`; later calls run the real method."""
    real = getattr(obj, name)

    def fails(*args, **kwargs):
        setattr(obj, name, real)
        raise error

    setattr(obj, name, fails)


def _one_rank_failure(rank: int, e, op: str) -> dict:
    """The weights' `op` ("wake" or "sleep") fails once on rank 0 only (a CUDA OOM on one GPU; host memory full for
    the copy), at the weights' step: both ranks raise at that tenant's collective, those that did it put it back,
    so each tenant sleeps on both ranks or on neither (a later wake pairs its collectives by the tenants asleep),
    and the next wake serves again."""
    before = run(e, PROMPTS, GREEDY)
    if op == "wake":
        e.sleep(level=1)
    if rank == 0:
        fail_once(e.weight_store, op, MemoryError(f"the weights' {op} failed on this rank"))
    seen = {f"{op}_fails": outcome(getattr(e, op)), f"asleep_after_{op}": e.memory_stats()["asleep"]}
    seen[f"wake_after_{op}"] = outcome(e.wake)
    seen[f"served_after_{op}"] = run(e, PROMPTS, GREEDY) == before
    return seen


def _one_rank_deeper_sleep_failure(rank: int, e, own: str) -> dict:
    """sleep(1), then a sleep(2) whose discard fails on rank 0 only: the weights, asleep before on both ranks,
    stay asleep on both (none is woken back), both need a full update after the wake, and then serve."""
    before = run(e, PROMPTS, GREEDY)
    e.sleep(level=1)
    if rank == 0:
        fail_once(e.weight_store, "sleep", MemoryError("the discard failed on this rank"))
    seen = {"deeper_fails": outcome(lambda: e.sleep(level=2)), "asleep_after_deeper": e.memory_stats()["asleep"]}
    seen["deeper_wake"] = outcome(e.wake)
    seen["deeper_generate"] = outcome(lambda: run(e, PROMPTS, GREEDY))[0]
    e.update_weights_from_disk(own)
    seen["deeper_served"] = run(e, PROMPTS, GREEDY) == before
    return seen


def _one_rank_capture_failure(rank: int, e) -> dict:
    """The graphs' re-capture at the end of a wake fails on rank 0 only (a CUDA OOM on one GPU): both ranks raise
    at the capture's agreement and put every tenant back to sleep (no stale graph runs, the ranks stay in step),
    and the next wake captures and serves."""
    before = run(e, PROMPTS, GREEDY)
    e.sleep(level=1)
    if rank == 0:
        fail_once(e.sleep_wake, "capture_graphs", RuntimeError("out of memory capturing the graphs on this rank"))
    e.sleep_wake.graphs_stale = True  # as after a wake that moved an address (on the CPU none does)
    seen = {"capture_fails": outcome(e.wake)[0], "asleep_after_capture": e.memory_stats()["asleep"]}
    seen["capture_wake"] = outcome(e.wake)
    seen["capture_served"] = run(e, PROMPTS, GREEDY) == before
    return seen


def _one_rank_shrinking_pool(rank: int, e) -> dict:
    """A resizing wake agrees on a block count, then rank 0's free memory drops before its pool is carved: that
    rank may not carve fewer blocks alone (the ranks would schedule differently): both fail, the pools sleep on."""
    from rollout_engine import kv_cache

    before, blocks = run(e, PROMPTS, GREEDY), e.block_manager.num_blocks
    e.sleep(level=1)
    real, reads = kv_cache.available_bytes, []

    def dropping(device):  # the agreement's read sees the memory, the carve's (every later one) a quarter of the pool
        reads.append(device)
        return real(device) if len(reads) == 1 else e.kv.planner.total_bytes(blocks // 4)
    if rank == 0:
        kv_cache.available_bytes = dropping
    try:
        seen = {"shrink_fails": outcome(lambda: e.wake(allow_resize=True))[0]}
    finally:
        kv_cache.available_bytes = real
    seen["asleep_after_shrink"] = e.memory_stats()["asleep"]
    seen["shrink_wake"] = outcome(e.wake)
    seen["shrink_blocks"] = e.block_manager.num_blocks == blocks
    seen["shrink_served"] = run(e, PROMPTS, GREEDY) == before
    return seen


def _a_call_that_cannot_be_put_back(rank: int, e, op: str) -> dict:
    """`op` ("sleep" or "wake") of the weights fails on rank 0, and rank 1 cannot put its part back (its weights'
    wake, or sleep, fails too): the ranks' states differ, so every rank learns it and every later call on every
    rank raises EngineDeadError at once (not a hang, not a false NoRoomError, not one rank dead while the other
    serves on), this call included. It leaves the engine dead."""
    if op == "wake":
        e.sleep(level=1)
    undo = "wake" if op == "sleep" else "sleep"
    fail_once(e.weight_store, op if rank == 0 else undo, MemoryError(f"fails on rank {rank}"))
    seen = {f"stuck_{op}": outcome(getattr(e, op))}
    started = time.monotonic()
    seen[f"stuck_{op}_after"] = [outcome(call)[0] for call in (e.wake, lambda: run(e, PROMPTS, GREEDY))]
    seen[f"stuck_{op}_at_once"] = time.monotonic() - started < COLLECTIVE_S / 2
    return seen


def _dead_at_once(e) -> dict:
    started = time.monotonic()
    after = [outcome(call)[0] for call in (e.wake, lambda: run(e, PROMPTS, GREEDY), e.flush_cache)]
    return {"after": after, "at_once": time.monotonic() - started < COLLECTIVE_S / 2}


def _a_wake_failing_on_one_rank_after_its_agreements(rank: int, e) -> dict:
    """A resizing wake agrees on a smaller pool and both ranks carve it; then rank 0 fails on its own (its block
    manager's reset) and goes to the call's closing agreement while rank 1 is at the wake's next inner one. The
    ranks' states differ and cannot be agreed back: both learn it at that one gather, and this call and every
    later one raise EngineDeadError at once on both (not a hang, not a later call's collectives paired with
    this one's). It leaves the engine dead."""
    from rollout_engine import kv_cache

    blocks = e.block_manager.num_blocks
    e.sleep(level=1)
    real = kv_cache.available_bytes
    kv_cache.available_bytes = lambda device: e.kv.planner.total_bytes(blocks // 2)
    if rank == 0:
        fail_once(e.block_manager, "reset", RuntimeError("the block manager's reset failed on this rank"))
    try:
        seen = {"late_wake": outcome(lambda: e.wake(allow_resize=True))}
    finally:
        kv_cache.available_bytes = real
    return seen | {f"late_wake_{k}": v for k, v in _dead_at_once(e).items()}


def _a_build_failing_on_one_rank(rank: int, pg, paths, work: str) -> dict:
    """Rank 0's own copy of the checkpoint lacks a tensor, so its Engine() fails loading the weights, before the
    pool's block count is agreed: both ranks raise at once (rank 1 does not wait for the group's timeout at that
    agreement, nor pair it with rank 0's next call), and the next Engine() on both builds and serves."""
    path = paths[LIFECYCLE]
    if rank == 0:
        path = os.path.join(work, "rank0-incomplete")
        os.makedirs(path)
        for name in os.listdir(paths[LIFECYCLE]):
            if not name.endswith(".safetensors"):
                shutil.copy(os.path.join(paths[LIFECYCLE], name), path)
        tensors = load_file(os.path.join(paths[LIFECYCLE], "model.safetensors"))
        del tensors["model.norm.weight"]
        save_file(tensors, os.path.join(path, "model.safetensors"))
    started = time.monotonic()
    seen = {"build_fails": outcome(lambda: engine(path, pg)), "build_fails_s": time.monotonic() - started}
    seen["build_again"] = run(engine(paths[LIFECYCLE], pg), PROMPTS, GREEDY)
    return seen


def _a_flush_failing_on_one_rank(rank: int, e) -> dict:
    """flush_cache fails on rank 0 only, after rank 1 flushed: the prefix caches differ (the ranks would schedule
    apart) and a flush has nothing to put back: the engine is dead on both, at once."""
    run(e, PROMPTS, GREEDY)
    if rank == 0:
        fail_once(e.block_manager, "flush", RuntimeError("the flush failed on this rank"))
    seen = {"split_flush": outcome(e.flush_cache)}
    return seen | {f"split_flush_{k}": v for k, v in _dead_at_once(e).items()}


def _a_call_failing_on_one_rank_before_an_inner_agreement(rank: int, e, op: str) -> dict:
    """Rank 0 fails on its own before one of the call's inner agreements (a wake: reading its free memory, before
    the pool's block count is agreed; a sleep: aborting its sequences, before the first tenant's), so it meets
    rank 1 at a later agreement than rank 1's: both learn there that they are out of step, and neither runs
    another collective (no gather left waiting for the timeout, none paired with a later call's)."""
    from rollout_engine import kv_cache

    if op == "wake":
        e.sleep(level=1)
    if rank == 0:
        fail_once(*((kv_cache, "available_bytes") if op == "wake" else (e.scheduler, "abort_running")),
                  RuntimeError(f"the {op} failed on this rank"))
    started = time.monotonic()
    seen = {f"early_{op}": outcome(getattr(e, op))}
    return seen | {f"early_{op}_{k}": v for k, v in _dead_at_once(e).items()} | {
        f"early_{op}_took_s": time.monotonic() - started}


def _an_update_whose_flush_fails_on_one_rank(rank: int, e, own: str) -> dict:
    """update_weights flushes every rank's prefix cache inside the call's agreement, before any copy: where that
    fails on rank 0 alone, rank 1 (which copied) puts its update back (weights incomplete, version unchanged),
    both raise, the next generate raises on both, and a complete update serves again."""
    before = run(e, PROMPTS, GREEDY)
    if rank == 0:
        fail_once(e.block_manager, "flush", RuntimeError("the flush failed on this rank"))
    seen = {"flush_update": outcome(lambda: e.update_weights_from_disk(own))[0], "flush_version": e.weight_version,
            "flush_history": list(e.weight_history)}
    seen["flush_generate"] = outcome(lambda: run(e, PROMPTS, GREEDY))[0]
    seen["flush_complete"] = outcome(lambda: e.update_weights_from_disk(own))
    seen["flush_served"] = run(e, PROMPTS, GREEDY) == before
    return seen


def _an_update_one_rank_holds_less_of(rank: int, e, paths) -> dict:
    """Rank 1's update leaves out one tensor the other rank's holds: each copied its own, so the split tensor would
    serve half new and half old columns. Both raise, neither takes the version, the next generate is refused on
    both, and a complete update serves as it does on one device."""
    new = load_file(os.path.join(paths["new"], "model.safetensors"))
    held = {k: v for k, v in new.items() if not (rank == 1 and k == "model.layers.1.mlp.down_proj.weight")}
    seen = {"less_update": outcome(lambda: e.update_weights(held.items())), "less_version": e.weight_version,
            "less_history": list(e.weight_history), "less_generate": outcome(lambda: run(e, PROMPTS, GREEDY))[0]}
    seen["less_complete"] = outcome(lambda: e.update_weights(new.items()))
    seen["less_served"] = run(e, PROMPTS, GREEDY)
    return seen


ROWS = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")  # split along dimension 0
COLUMNS = ("o_proj.weight", "down_proj.weight")  # split along dimension 1; everything else is whole


def own_slice(name: str, tensor, rank: int, ranks: int = 2):
    """Rank `rank`'s part of a full Hugging Face tensor, by the rule Engine.update_weights documents for
    sharded=True (a trainer's own layout would be cut the same way)."""
    dim = 0 if any(f"{part}." in name for part in ROWS) else 1 if name.endswith(COLUMNS) else None
    if dim is None:
        return tensor
    size = tensor.shape[dim] // ranks
    return tensor.narrow(dim, rank * size, size).contiguous()


def _sharded_updates(rank: int, e, paths) -> dict:
    """update_weights(sharded=True) with each rank's own slices of LIFECYCLE's weights (the engine holds "new"
    ones before); then the refusals, each leaving those weights serving."""
    full = load_file(os.path.join(paths[LIFECYCLE], "model.safetensors"))
    own = {name: own_slice(name, t, rank) for name, t in full.items()}
    seen = {"sharded_version": e.update_weights(own.items(), sharded=True), "sharded": run(e, PROMPTS, GREEDY)}
    seen["sharded_again"] = e.update_weights_from_buckets([list(own.items())], sharded=True)  # a second path
    # The same tensors (a steady group, its plan cached) without the flag: refused, not copied as slices.
    seen["slices_unflagged"] = outcome(lambda: e.update_weights(own.items()))
    seen["full_flagged"] = outcome(lambda: e.update_weights(full.items(), sharded=True))
    seen["sharded_final_version"] = e.weight_version
    seen["sharded_still"] = run(e, PROMPTS, GREEDY)
    return seen


# ---------------------------------------------------------------------- the checks


@functools.cache
def reference(path) -> dict:
    one = Engine(path, device="cpu", kv_cache_memory=KV)
    return {"greedy": run(one, PROMPTS, GREEDY), "sampled": run(one, PROMPTS, SAMPLED),
            "scored": [o.prompt_logprobs for o in one.generate(PROMPTS[:2], SCORED, use_tqdm=False)]}


@pytest.mark.parametrize("family", FAMILIES)
def test_both_ranks_equal_tp1(ranks, checkpoints, family):
    want = reference(checkpoints[family][0])
    for seen in ranks:
        got = seen[family]
        assert got["heads"] == 1  # each rank's pool holds its own KV head(s) only
        assert_same(got["greedy"], want["greedy"])
        assert_same(got["sampled"], want["sampled"])  # n=3 from seeds: the same noise on both ranks
        for g_req, w_req in zip(got["scored"], want["scored"], strict=True):
            for g_pos, w_pos in zip(g_req[1:], w_req[1:], strict=True):
                assert g_pos.keys() == w_pos.keys()
                torch.testing.assert_close(torch.tensor(list(g_pos.values())), torch.tensor(list(w_pos.values())),
                                           atol=1e-4, rtol=0)
    assert ranks[0][family] == ranks[1][family]  # bitwise: one all-gathered set of logits, one sampler


def test_lifecycle_on_both_ranks(ranks, checkpoints):
    want_old, want_new = (reference(checkpoints[name][0])["greedy"] for name in (LIFECYCLE, "new"))
    for seen in ranks:
        assert_same(seen["before"], want_old)
        assert seen["after_wake"] == seen["before"]  # bitwise: the same ranks, the same sums
        assert seen["versions"] == [1, 2, 3]
        assert_same(seen["new"], want_new)
        assert seen["back"] == seen["before"]
        assert_same(seen["new_buckets"], want_new)
    for key in ("before", "new", "back", "new_buckets"):
        assert ranks[0][key] == ranks[1][key]


def test_different_prompts_refused_on_every_rank(ranks):
    for seen in ranks:
        kind, message = seen["different_prompts"]
        assert kind == "EngineError" and "prompts, sampling params and budgets differ" in message
        assert "[[0], [1]]" in message  # the ranks grouped by what they passed


def test_tags_in_another_order_are_the_same_call(ranks):
    """A set of tags iterates in each process's own order; the ranks compare the tags, not their order."""
    for seen in ranks:
        assert seen["either_order"] == ("ok", seen["sharded_still"])


def test_engines_built_with_different_arguments_refused_on_every_rank(ranks):
    """seed=rank (a torchrun habit) would sample other tokens on each rank and break the next collective."""
    for seen in ranks:
        kind, message = seen["different_engine_args"]
        assert kind == "EngineError" and "Engine arguments differ" in message


def test_one_rank_bad_arguments(ranks):
    assert ranks[1]["one_rank_bad"][0] == "ValueError"  # the rank's own error
    kind, message = ranks[0]["one_rank_bad"]
    assert kind == "EngineError" and "failed on tensor-parallel rank(s) [1]" in message


def test_collective_calls_with_different_arguments_change_nothing(ranks):
    for seen in ranks:
        for key in ("different_sleep", "different_version"):
            kind, message = seen[key]
            assert kind == "EngineError" and "arguments differ" in message
        assert seen["sleeping"] is False
        assert seen["version"] == 3
        assert seen["still"] == seen["new_buckets"]  # still serving, the same tokens


def test_update_failing_on_one_rank_leaves_every_rank_incomplete(ranks):
    assert ranks[1]["half_update"][0] == "ValueError" and "NaN" in ranks[1]["half_update"][1]
    assert ranks[0]["half_update"][0] == "EngineError"  # rank 0 copied, then learnt of rank 1's failure
    assert ranks[0]["half_history"] == ranks[1]["half_history"]  # rank 0's rolled-back version is not in it
    for seen in ranks:
        assert seen["half_version"] == 3  # the version the ranks had before
        assert seen["half_generate"][0] in ("WeightsNotReadyError", "EngineError")
        assert seen["completed"] == 4
        assert seen["after_complete"] == seen["new_buckets"]
    assert ranks[0]["half_generate"][0] == "WeightsNotReadyError"


def test_a_wake_failing_on_one_rank_raises_on_both_and_the_next_wake_serves(ranks):
    assert ranks[0]["wake_fails"][0] == "MemoryError"
    assert ranks[1]["wake_fails"][0] == "EngineError" and "rank(s) [0]" in ranks[1]["wake_fails"][1]
    for seen in ranks:
        assert sorted(seen["asleep_after_wake"]) == ["kv_cache", "weights"]
        assert seen["wake_after_wake"] == ("ok", None) and seen["served_after_wake"]


def test_a_sleep_failing_on_one_rank_raises_on_both_and_leaves_them_in_step(ranks):
    assert ranks[0]["sleep_fails"][0] == "MemoryError"
    assert ranks[1]["sleep_fails"][0] == "EngineError" and "rank(s) [0]" in ranks[1]["sleep_fails"][1]
    for seen in ranks:
        assert sorted(seen["asleep_after_sleep"]) == ["kv_cache"]  # the pool slept on both, the weights on neither
        assert seen["wake_after_sleep"] == ("ok", None) and seen["served_after_sleep"]


def test_a_deeper_sleep_failing_on_one_rank_wakes_nothing_back(ranks):
    assert [r["deeper_fails"][0] for r in ranks] == ["MemoryError", "EngineError"]
    for seen in ranks:
        assert sorted(seen["asleep_after_deeper"]) == ["kv_cache", "weights"]
        assert seen["deeper_wake"] == ("ok", None) and seen["deeper_generate"] == "WeightsNotReadyError"
        assert seen["deeper_served"]


def test_a_sleep_no_rank_can_put_back_leaves_the_engine_dead_on_every_rank(ranks):
    assert [r["stuck_sleep"][0] for r in ranks] == ["EngineDeadError"] * 2  # this call tells it already
    assert "fails on rank 0" in ranks[0]["stuck_sleep"][1] and "could not be put back" in ranks[1]["stuck_sleep"][1]
    for seen in ranks:
        assert seen["stuck_sleep_after"] == ["EngineDeadError", "EngineDeadError"] and seen["stuck_sleep_at_once"]


def test_a_capture_failing_on_one_rank_puts_every_tenant_back_to_sleep_on_both(ranks):
    assert [r["capture_fails"] for r in ranks] == ["RuntimeError", "EngineError"]
    for seen in ranks:
        assert sorted(seen["asleep_after_capture"]) == ["kv_cache", "weights"]
        assert seen["capture_wake"] == ("ok", None) and seen["capture_served"]


def test_a_pool_one_rank_cannot_carve_at_the_agreed_count_stays_asleep_on_both(ranks):
    assert [r["shrink_fails"] for r in ranks] == ["NoRoomError", "EngineError"]
    for seen in ranks:
        assert seen["asleep_after_shrink"] == ["kv_cache"]
        assert seen["shrink_wake"] == ("ok", None) and seen["shrink_blocks"] and seen["shrink_served"]


def test_a_wake_no_rank_can_put_back_leaves_the_engine_dead_on_every_rank(ranks):
    assert [r["stuck_wake"][0] for r in ranks] == ["EngineDeadError"] * 2  # this call tells it already
    assert "fails on rank 0" in ranks[0]["stuck_wake"][1] and "could not be put back" in ranks[1]["stuck_wake"][1]
    for seen in ranks:
        assert seen["stuck_wake_after"] == ["EngineDeadError", "EngineDeadError"] and seen["stuck_wake_at_once"]


@pytest.mark.parametrize("call", ["late_wake", "split_flush"])
def test_a_call_one_rank_fails_after_the_others_did_it_leaves_the_engine_dead_on_every_rank(ranks, call):
    for rank, seen in enumerate(ranks):
        assert seen[call][0] == "EngineDeadError", (rank, seen[call])
        assert "rank(s) [0]" in seen[call][1] and "states now differ" in seen[call][1]
        assert seen[f"{call}_after"] == ["EngineDeadError"] * 3 and seen[f"{call}_at_once"]
    assert "failed on this rank" in ranks[0][call][1]


@pytest.mark.parametrize("op", ["wake", "sleep"])
def test_a_call_one_rank_fails_before_an_inner_agreement_leaves_the_engine_dead_at_once(ranks, op):
    assert ranks[0][f"early_{op}"][0] == "EngineDeadError" and f"the {op} failed on this rank" in ranks[0][
        f"early_{op}"][1]
    for seen in ranks:
        assert seen[f"early_{op}"][0] == "EngineDeadError" and "different agreements" in seen[f"early_{op}"][1]
        assert seen[f"early_{op}_after"] == ["EngineDeadError"] * 3
        assert seen[f"early_{op}_took_s"] < COLLECTIVE_S / 2  # nobody waited for the group's timeout


def test_an_update_whose_flush_fails_on_one_rank_is_put_back_on_the_other(ranks):
    assert [r["flush_update"] for r in ranks] == ["RuntimeError", "EngineError"]
    assert ranks[0]["flush_history"] == ranks[1]["flush_history"]  # the version rank 1 took and gave back is not in it
    for seen in ranks:
        assert seen["flush_version"] == 0 and seen["flush_generate"] in ("EngineError", "WeightsNotReadyError")
        assert seen["flush_complete"] == ("ok", 1) and seen["flush_served"]


def test_an_update_whose_ranks_held_different_weights_is_refused_on_every_rank(ranks, checkpoints):
    for seen in ranks:
        assert seen["less_update"][0] == "EngineError" and "weight names the update held" in seen["less_update"][1]
        assert seen["less_version"] == 0 and seen["less_history"] == ranks[0]["less_history"]
        assert seen["less_generate"] == "WeightsNotReadyError"
        assert seen["less_complete"] == ("ok", 1)
        assert_same(seen["less_served"], reference(checkpoints["new"][0])["greedy"])


def test_a_build_failing_on_one_rank_raises_on_every_rank_at_once(ranks):
    assert ranks[0]["build_fails"][0] in ("ValueError", "EngineDeadError")
    assert "model.norm.weight" in ranks[0]["build_fails"][1]
    assert ranks[1]["build_fails"][0] in ("EngineError", "EngineDeadError")
    for seen in ranks:
        assert seen["build_fails_s"] < COLLECTIVE_S / 2
        assert seen["build_again"] == ranks[0]["before"]


def test_sharded_update_equals_tp1_with_full_tensors(ranks, checkpoints):
    want = reference(checkpoints[LIFECYCLE][0])["greedy"]  # TP=1 loaded with the full tensors
    for seen in ranks:
        assert seen["sharded_version"] == 5 and seen["sharded_again"] == 6
        assert_same(seen["sharded"], want)
    assert ranks[0]["sharded"] == ranks[1]["sharded"]


def test_sharded_update_refuses_the_other_shape_on_every_rank(ranks):
    for seen in ranks:
        kind, message = seen["slices_unflagged"]
        assert kind == "ValueError" and "one rank's slice" in message and "sharded=True" in message
        kind, message = seen["full_flagged"]
        assert kind == "ValueError" and "this is the full tensor" in message
        assert seen["sharded_final_version"] == 6  # nothing copied: the sliced weights still serve
        assert seen["sharded_still"] == seen["sharded"]


def test_sharded_update_refused_without_tensor_parallelism(checkpoints):
    path, model = checkpoints[LIFECYCLE]
    one = Engine(path, device="cpu", kv_cache_memory=KV)
    named = dict(model.state_dict())
    for update in (lambda: one.update_weights(named.items(), sharded=True),
                   lambda: one.update_weights_from_buckets([list(named.items())], sharded=True)):
        with pytest.raises(ValueError, match="no tensor parallelism"):
            update()
    with pytest.raises(ValueError, match="sharded='yes' is not allowed; a bool"):
        one.update_weights(named.items(), sharded="yes")
    assert one.weight_version == 0
    assert one.update_weights(named.items()) == 1  # still takes full tensors


def test_time_budget_stops_every_rank_at_the_same_step(ranks):
    timed = ranks[0]["timed"]
    assert timed == ranks[1]["timed"]
    reasons = {reason for samples in timed for _, reason in samples}
    assert reasons == {"abort"}  # rank 1's budget ended rank 0's call too (its own clock is far from 30 s)
    assert all(0 < len(tokens) < BUDGETED.max_tokens for samples in timed for tokens, _ in samples)


def test_bad_arguments_with_a_group_refused(ranks):
    for seen in ranks:
        (k4, m4), (k1, m1), (kq, mq), (kb, mb) = seen["refused"]
        assert k4 == k1 == "ValueError" and "differs from the process_group's size (2)" in m4 + m1
        assert kq == kb == "ValueError" and "cannot be combined" in mq and "cannot be combined" in mb


def _one_rank_main(rank: int, work: str, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=1,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        seen = [outcome(lambda kw=kw: engine(path, dist.group.WORLD, **kw)) for kw in
                (dict(batch_invariant=True), dict(quantization="fp8"))]
        with open(os.path.join(work, "rank0.pkl"), "wb") as f:
            pickle.dump(seen, f)
    finally:
        dist.destroy_process_group()


def test_a_one_rank_group_refuses_a_mode_by_naming_the_group(checkpoints, tmp_path):
    """A process_group of one rank takes the tensor-parallel path, so its refusal of batch_invariant or fp8
    names process_group and says to drop it, rather than suggesting tensor_parallel_size=1, which it is."""
    _spawn(_one_rank_main, (str(tmp_path), str(checkpoints[LIFECYCLE][0])), nprocs=1)
    with open(tmp_path / "rank0.pkl", "rb") as f:
        for (kind, message), name in zip(pickle.load(f), ("batch_invariant=True", "quantization='fp8'")):
            assert kind == "ValueError" and message.startswith("process_group (a group of 1 rank) cannot be "
                                                               f"combined with {name}; "), message
            assert message.endswith("or process_group=None") and "tensor_parallel_size" not in message, message


def test_bad_process_group_refused(checkpoints, tmp_path):
    path = checkpoints[LIFECYCLE][0]
    with pytest.raises(ValueError, match="process_group must be a torch.distributed ProcessGroup"):
        Engine(path, device="cpu", process_group="gloo")
    with pytest.raises(ValueError, match="must be a torch.distributed ProcessGroup"):  # a backend, not a group
        Engine(path, device="cpu", process_group=dist.ProcessGroupGloo(dist.FileStore(str(tmp_path / "a"), 1), 0, 1))
    lone = dist.ProcessGroup(dist.FileStore(str(tmp_path / "b"), 1), 0, 1)  # a group of no initialised job
    with pytest.raises(ValueError, match="not a group of an initialised torch.distributed job"):
        Engine(path, device="cpu", process_group=lone)



def _gpu_rank_main(rank: int, work: str, path: str, enforce_eager: bool) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        e = Engine(path, device="cuda", kv_cache_memory=1 << 30, process_group=dist.group.WORLD,
                   enforce_eager=enforce_eager)
        seen = {"device": str(e.device), "greedy": run(e, GPU_PROMPTS, GPU_GREEDY)}
        e.sleep(level=1)
        e.wake()
        seen["after_wake"] = run(e, GPU_PROMPTS, GPU_GREEDY)
        with open(os.path.join(work, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(seen, f)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
@pytest.mark.parametrize("enforce_eager", [False, True])  # False: decode graphs with NCCL collectives inside
def test_gpu_spmd_greedy_equals_tp1(tmp_path, enforce_eager):
    """Two NCCL ranks, each on its own GPU (as under torchrun), equal TP=1 (way (a)'s GPU model)."""
    want = gpu_reference(tmp_path)
    _spawn(_gpu_rank_main, (str(tmp_path), str(tmp_path), enforce_eager))
    ranks = _results(tmp_path)
    assert [seen["device"] for seen in ranks] == ["cuda:0", "cuda:1"]
    for seen in ranks:
        assert_same(seen["greedy"], want)
        assert_same(seen["after_wake"], want)
    assert ranks[0]["greedy"] == ranks[1]["greedy"]


def test_call_digests_tell_apart_prompts_that_split_the_same_ids_differently():
    """The ranks compare a digest of every call's arguments: prompts [1, 2], [3] on one rank and [1], [2, 3]
    on another are different calls, and so are two outputs whose tokens split the same way."""
    from rollout_engine.parallel.spmd import call_digest, ids_digest

    assert ids_digest([[1, 2], [3]]) != ids_digest([[1], [2, 3]])
    assert call_digest([("", [1, 2]), ("", [3])], None, {}, None) != call_digest([("", [1]), ("", [2, 3])], None, {}, None)
    assert ids_digest([[1, 2], [3]]) == ids_digest([[1, 2], [3]])


STEP_FAILURE_COLLECTIVE_S = 8  # the group's timeout in the step-failure run: rank 1 waits this long, once


def _a_step_failing_on_one_rank_main(rank: int, work: str, path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2,
                            timeout=timedelta(seconds=STEP_FAILURE_COLLECTIVE_S))
    try:
        pg = dist.new_group([0, 1], timeout=timedelta(seconds=STEP_FAILURE_COLLECTIVE_S))
        e, seen = engine(path, pg), {}
        seen["before"] = outcome(lambda: run(e, PROMPTS, GREEDY))
        if rank == 0:  # its third forward raises, as a device's out-of-memory error would on one GPU
            real, calls = e.model.forward, []

            def failing(*args, **kwargs):
                calls.append(1)
                if len(calls) == 3:
                    raise RuntimeError("out of memory on this rank's device")
                return real(*args, **kwargs)
            e.model.forward = failing
        for call in ("failed", "next"):
            start = time.monotonic()
            seen[call] = outcome(lambda: run(e, PROMPTS, GREEDY))
            seen[f"{call}_took_s"] = time.monotonic() - start
        with open(os.path.join(work, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(seen, f)
    finally:
        dist.destroy_process_group()


def test_a_step_failing_on_one_rank_leaves_that_rank_dead_at_once(checkpoints, tmp_path):
    """A forward raising on rank 0 alone leaves rank 1 in the step's collective, which times out there. Rank 0's
    next call raises EngineDeadError at once: its first collective would pair with the one rank 1 waited in, and
    it waited for the group's timeout instead."""
    _spawn(_a_step_failing_on_one_rank_main, (str(tmp_path), str(checkpoints[LIFECYCLE][0])))
    ranks = _results(tmp_path)
    assert [seen["before"][0] for seen in ranks] == ["ok", "ok"]
    assert ranks[0]["failed"] == ("RuntimeError", "out of memory on this rank's device")
    assert ranks[0]["next"][0] == "EngineDeadError" and "generate stopped part-way on this rank" in ranks[0]["next"][1]
    assert ranks[0]["next_took_s"] < STEP_FAILURE_COLLECTIVE_S / 2
    assert ranks[1]["failed"][0] == "EngineDeadError" and ranks[1]["next"][0] == "EngineDeadError"
