"""One-step-off-policy GRPO (trainer_adapters.async_grpo): per-token importance ratios from weight versions."""
import asyncio
import math
import re
import time

import pytest
import torch

from rollout_engine import SamplingParams
from trainer_adapters.async_demo import run_async_demo
from trainer_adapters.async_grpo import importance_ratios, off_policy_step, on_policy_mask, token_versions
from trainer_adapters.async_rollouts import AsyncRollouts
from trainer_adapters.grpo import build_batch, token_logprobs

ALPHABET = "0123456789+="


def test_masks_and_ratios_on_hand_made_versions():
    # two samples, completion at positions 2..5; sample 0 spans an update (versions 3, 3, 4, 4)
    versions = torch.tensor([[-1, -1, 3, 3, 4, 4], [-1, -1, 4, 4, 4, -1]])
    completion = (versions >= 0).float()
    retract = on_policy_mask(versions, completion, current_version=4, mode="retract")
    keep = on_policy_mask(versions, completion, current_version=4, mode="keep")
    assert retract.tolist() == [[False, False, False, False, True, True], [False, False, True, True, True, False]]
    # keep: the version-4 tokens of sample 0 were sampled over KV that version 3 computed
    assert keep.tolist() == [[False] * 6, [False, False, True, True, True, False]]
    assert not on_policy_mask(versions, completion, current_version=5).any()
    with pytest.raises(ValueError, match="mode"):
        on_policy_mask(versions, completion, 4, mode="abort")
    for bad in ("4", 4.0, -1, True):  # matched no token's version: every token off-policy, without a word
        with pytest.raises(ValueError, match=r"current_version=.* is not allowed; None or an int >= 0"):
            on_policy_mask(versions, completion, bad)

    batch = type("B", (), {})()
    batch.completion_mask, batch.old_logprobs = completion, torch.full((2, 6), -2.0) * completion
    new = torch.full((2, 6), -1.5, requires_grad=True)
    ratio = importance_ratios(new, batch, retract)
    assert torch.equal(ratio[retract], torch.ones(int(retract.sum())))
    off = completion.bool() & ~retract
    assert torch.allclose(ratio[off], torch.full((int(off.sum()),), 0.5).exp())
    ratio.sum().backward()  # on-policy tokens keep their gradient: d ratio / d logp = 1 there
    assert torch.allclose(new.grad[retract], torch.ones(int(retract.sum())))


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory):
    from rollout_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("async_grpo") / "policy", hidden_size=64, intermediate_size=128,
                           max_position_embeddings=512, alphabet=ALPHABET, seed=0)


def _mid_flight(rollouts, prompts, params, min_tokens):
    """Submit `prompts` and a probe that shares their steps; once the probe has `min_tokens`, pause ("keep") so
    that the trainer's step happens with every request part-way. Returns the future of the outputs. The batch and
    the probe are admitted together (a "keep" pause holds them, the continue admits them in one step): submitted
    one after the other, the loop thread could step between them, and the batch would be that many tokens behind."""
    engine = rollouts.engine

    async def probe():
        async for out in engine.stream(prompts[0], params):
            if min(len(c.token_ids) for c in out.outputs) >= min_tokens:
                await engine.pause_generation("keep")
                return out
        raise AssertionError("the probe finished before it was paused")

    async def start():
        await engine.pause_generation("keep")
        batch = asyncio.gather(*(engine.generate(p, params) for p in prompts))
        probed = asyncio.ensure_future(probe())
        await asyncio.sleep(0)  # every request is in the loop thread's inbox
        await engine.continue_generation()
        await probed
        return batch

    async def outputs(batch):
        return await batch

    return rollouts.run(outputs(rollouts.run(start()).result(timeout=60)))


def test_off_policy_step_scores_filtered_rollouts_as_the_engine_did(tiny_policy):
    """Rollouts sampled with top-k, scored as off-policy (the trainer one version on, its weights unchanged):
    given their params, the trainer's logprobs are the engine's (ratios 1 up to float32 rounding) and the loss
    is finite though prompt and padding tokens fall outside the filter; a full-vocabulary softmax would bias
    every ratio."""
    from transformers import AutoModelForCausalLM

    from rollout_engine import Engine

    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    params = SamplingParams(n=2, temperature=0.8, top_k=3, max_tokens=6, seed=1, ignore_eos=True)
    engine = Engine(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    outputs = engine.generate(["1+2=", "3+4="], params, use_tqdm=False)
    pad_id = engine.tokenizer.pad_token_id
    rewards = [float(i % 2) for i in range(4)]

    def step(**kw):
        frozen = torch.optim.SGD(model.parameters(), lr=0.0)  # the same weights for both calls
        stats = off_policy_step(model, frozen, outputs, rewards, 2, pad_id, engine.weight_version + 1, mode="retract",
                                **kw)
        assert stats["off_policy_fraction"] == 1.0 and math.isfinite(stats["loss"])
        return stats["ratio_mean_off"]

    assert abs(step(params=params) - 1) < 1e-4
    assert abs(step(temperature=params.temperature) - 1) > 1e-2


class Untouchable:
    """Fails the test on any use: a refused argument must be refused before the model or optimizer is touched."""

    def __getattr__(self, name):
        raise AssertionError(f".{name} was used before the arguments were checked")


def test_off_policy_step_refuses_a_group_size_that_is_not_the_rollouts_n(tiny_policy):
    """Rollouts of n=4 per prompt: group_size 2 would baseline each reward against half its prompt's samples, 8
    against two prompts' pooled; both are refused naming group_size before the model is touched, and 4 trains."""
    from transformers import AutoModelForCausalLM

    from rollout_engine import Engine

    engine = Engine(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    params = SamplingParams(n=4, max_tokens=2, seed=0, ignore_eos=True)
    outputs = engine.generate(["1+2=", "3+4="], params, use_tqdm=False)
    rewards, pad_id = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0], engine.tokenizer.pad_token_id
    for bad in (2, 8, 1):
        with pytest.raises(ValueError, match=rf"group_size={bad} does not match the rollouts: output\(s\) \[0, 1\] "
                                             r"hold \[4\] samples"):
            off_policy_step(Untouchable(), Untouchable(), outputs, rewards, bad, pad_id, engine.weight_version,
                            mode="retract", params=params)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    stats = off_policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), outputs, rewards, 4, pad_id,
                            engine.weight_version, mode="retract", params=params)
    assert math.isfinite(stats["loss"])


def test_off_policy_step_refuses_a_partial_rollout_until_it_is_resumed(tiny_policy):
    """A rollout cut short by a token budget ends its samples "abort": the step refuses them, naming them, before
    the model is touched; passed back to generate they finish, and the step trains on them."""
    from transformers import AutoModelForCausalLM

    from rollout_engine import Engine

    engine = Engine(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    params = SamplingParams(n=2, max_tokens=12, seed=0, ignore_eos=True)
    partial = engine.generate(["1+2=", "3+4="], params, use_tqdm=False, token_budget=8)
    aborted = [i for i, c in enumerate(c for o in partial for c in o.outputs) if c.finish_reason == "abort"]
    assert aborted
    rewards, pad_id = [1.0, 0.0, 0.0, 1.0], engine.tokenizer.pad_token_id
    with pytest.raises(ValueError, match=rf"outputs has {len(aborted)} unfinished sample\(s\) .*indices "
                                         rf"{re.escape(str(aborted))} .*resume them"):
        off_policy_step(Untouchable(), Untouchable(), partial, rewards, 2, pad_id, engine.weight_version,
                        mode="retract", params=params)
    resumed = engine.generate(partial, params, use_tqdm=False)
    assert all(c.finish_reason == "length" for o in resumed for c in o.outputs)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    stats = off_policy_step(model, torch.optim.SGD(model.parameters(), lr=0.0), resumed, rewards, 2, pad_id,
                            engine.weight_version, mode="retract", params=params)
    assert math.isfinite(stats["loss"]) and stats["tokens"] == 4 * 12


@pytest.mark.parametrize("bad", [dict(clip_eps=-0.2), dict(clip_eps=1.5), dict(dual_clip=1.0),
                                 dict(dual_clip=math.nan), dict(temperature=-1.0), dict(temperature=math.nan)])
def test_off_policy_step_refuses_bad_arguments_before_touching_the_model(bad):
    """Before, a bad temperature was found inside token_logprobs: after the model was put in train mode and its
    gradients zeroed."""
    name, value = next(iter(bad.items()))
    with pytest.raises(ValueError, match=f"{name}={value!r} is not allowed"):
        off_policy_step(Untouchable(), Untouchable(), [], [], 2, 0, 0, mode="retract", **bad)
    with pytest.raises(ValueError, match="params is a dict; the rollouts' SamplingParams, or None"):
        off_policy_step(Untouchable(), Untouchable(), [], [], 2, 0, 0, mode="retract", params={"temperature": 1})


def test_a_second_step_before_the_push_scores_every_token_against_the_engine(tiny_policy):
    """PPO epochs: after a step the trainer's weights are no engine version's, so a second step on the same batch
    treats every token as off-policy (ratio against the engine's logprob, clipped). Before, its tokens kept ratio
    exactly 1 and the clip never acted. The push makes the trainer's weights a version again."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    with AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20, seed=0) as rollouts:
        pad_id = rollouts.engine.engine.tokenizer.pad_token_id
        params = SamplingParams(n=4, max_tokens=4, ignore_eos=True)
        outs = rollouts.submit(["1+2=", "3+4="], params).result(timeout=60)
        rewards = [float(c.token_ids[0] % 2) for o in outs for c in o.outputs]
        first = rollouts.step(model, optimizer, outs, rewards, 4, pad_id, params=params)
        assert first["off_policy_tokens"] == 0 and first["trainer_version"] == 0
        assert rollouts.trainer_version is None
        second = rollouts.step(model, optimizer, outs, rewards, 4, pad_id, params=params)
        assert second["off_policy_tokens"] == second["tokens"] == 32
        assert abs(second["ratio_mean_off"] - 1) > 1e-3  # the first step moved the policy
        assert rollouts.push_weights(model) == 1 == rollouts.trainer_version


def test_off_policy_step_has_no_default_push_mode():
    """Which tokens are on-policy depends on the mode the weights were pushed under: a default "retract" would give
    ratio 1 to tokens a "keep" push sampled over the old weights' KV. AsyncRollouts.step passes its own."""
    with pytest.raises(TypeError, match="mode"):
        off_policy_step(Untouchable(), Untouchable(), [], [], 2, 0, 0)


@pytest.mark.parametrize("mode", ["retract", "keep"])
def test_one_step_off_mechanics(tiny_policy, mode):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    with AsyncRollouts(tiny_policy, push_mode=mode, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=64,
                       seed=0) as rollouts:
        pad_id = rollouts.engine.engine.tokenizer.pad_token_id
        prompts = [f"{a}+{b}=" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8)]]
        reward = lambda outs: [float(c.token_ids[0] % 2) for o in outs for c in o.outputs]  # noqa: E731

        # Step 1 on a batch the current weights (version 0) sampled: every token on-policy, every ratio 1.
        first = rollouts.submit(prompts, SamplingParams(n=4, max_tokens=4, ignore_eos=True)).result(timeout=60)
        assert rollouts.trainer_version == 0
        # batch 2 is sampled while step 1 trains; frozen part-way so that it certainly spans the update
        params = SamplingParams(n=2, max_tokens=64, ignore_eos=True)
        pending = _mid_flight(rollouts, prompts, params, min_tokens=3)
        before = [p.detach().clone() for p in model.parameters()]
        stats = off_policy_step(model, optimizer, first, reward(first), 4, pad_id, current_version=0, mode=mode)
        assert stats["off_policy_tokens"] == 0 and stats["versions"] == [0]
        assert stats["ratio_max_dev_on"] == 0.0 and stats["clip_fraction"] == 0.0
        assert torch.isfinite(torch.tensor(stats["loss"]))
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters())), "the weights did not change"
        assert rollouts.push_weights(model) == 1 == rollouts.trainer_version == rollouts.engine.weight_version

        # Batch 2 finishes under version 1: its samples switch from version 0 to version 1 part-way.
        second = pending.result(timeout=120)
        samples = [c for o in second for c in o.outputs]
        assert all(len(c.token_ids) == 64 and c.finish_reason == "length" for c in samples)
        for c in samples:
            switch = c.weight_versions.index(1)
            assert 3 <= switch < 64
            assert set(c.weight_versions[:switch]) == {0} and set(c.weight_versions[switch:]) == {1}

        batch = build_batch(second, reward(second), pad_id)
        versions = token_versions(second, batch.input_ids.shape[1])
        sampled = batch.completion_mask.bool()
        on = on_policy_mask(versions, batch.completion_mask, current_version=1, mode=mode)
        with torch.no_grad():
            now = token_logprobs(model, batch)
            ratio = importance_ratios(now, batch, on)
        old_tokens = sampled & (versions == 0)
        new_tokens = sampled & (versions == 1)
        # off-policy = produced by an older version (and, with "keep", anything sampled after it)
        assert torch.equal(sampled & ~on, old_tokens if mode == "retract" else sampled)
        assert torch.equal(ratio[on], torch.ones(int(on.sum())))
        assert torch.allclose(ratio[sampled & ~on], (now - batch.old_logprobs)[sampled & ~on].exp())
        # Version-0 behaviour logprobs are the old policy's: the step moved them.
        assert (now - batch.old_logprobs)[old_tokens].abs().max() > 1e-2
        drift = (now - batch.old_logprobs)[new_tokens].abs().max().item()
        if mode == "retract":  # re-prefilled under version 1: the engine's logprobs are the trainer's own
            assert drift < 1e-3, drift
        else:  # sampled over KV that version 0 computed: neither policy's, hence off-policy
            assert drift > 1e-3, drift

        # Step 2 on the mixed batch: finite loss, the weights move again, the off-policy fraction is logged.
        before = [p.detach().clone() for p in model.parameters()]
        stats = rollouts.step(model, optimizer, second, reward(second), 2, pad_id)  # its version and push mode
        assert torch.isfinite(torch.tensor(stats["loss"])) and stats["versions"] == [0, 1]
        assert stats["off_policy_tokens"] == int((sampled & ~on).sum())
        assert 0 < stats["off_policy_fraction"] <= 1 and stats["ratio_max_dev_on"] == 0.0
        assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
        assert rollouts.push_weights(model) == 2


def test_push_mode_is_checked(tiny_policy):
    with pytest.raises(ValueError, match="push_mode"):
        AsyncRollouts(tiny_policy, push_mode="abort")


def test_one_step_off_learns_the_demo_task(tmp_path):
    """The learning run (about 20-60 s on 2 shared cores): the sync demo's criterion, mean sample reward >= 0.8."""
    log = run_async_demo(tmp_path, steps=60, eval_every=60, progress=False)
    steps = log["steps"]
    last = sum(s["reward"] for s in steps[-5:]) / 5
    assert last >= 0.8, [round(s["reward"], 2) for s in steps]
    assert steps[0]["off_policy_fraction"] == 0.0  # batch 1 was sampled by the weights step 1 trains
    for s in steps[1:]:  # later batches: sampled while the previous step trained, one version behind (or current)
        assert set(s["versions"]) <= {s["trainer_version"] - 1, s["trainer_version"]}
        assert s["off_policy_fraction"] == pytest.approx(
            s["off_policy_tokens"] / s["tokens"]) and s["trainer_version"] == s["step"] - 1
    assert log["final_greedy_accuracy"] > 0.5
    assert (tmp_path / "async_reward_curve.png").stat().st_size > 0


def test_off_policy_step_never_steps_on_a_non_finite_gradient(tiny_policy):
    """A finite loss can still give a NaN gradient (an overflow inside the backward): off_policy_step refuses to
    step on it, as hybrid_step does (FloatingPointError naming the parameter), and leaves the weights as they were
    with no gradient; without the check the optimizer wrote NaN into the weights."""
    from transformers import AutoModelForCausalLM

    from rollout_engine import Engine

    engine = Engine(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    params = SamplingParams(n=2, max_tokens=3, seed=0, ignore_eos=True)
    outputs = engine.generate(["1+2=", "3+4="], params, use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    hook = model.model.norm.weight.register_hook(lambda grad: grad * math.nan)
    with pytest.raises(FloatingPointError, match="gradients in 1 parameters .*model.norm.weight"):
        off_policy_step(model, torch.optim.SGD(model.parameters(), lr=0.1), outputs, [1.0, 0.0, 0.0, 1.0], 2,
                        engine.tokenizer.pad_token_id, engine.weight_version, mode="retract", params=params)
    hook.remove()
    assert not model.training
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None, name


def test_a_closed_rollouts_refuses_at_once(tiny_policy):
    """After close() the client loop is stopped: push_weights raises EngineError at once and submit's future has
    failed with it (a coroutine sent to the stopped loop would never be answered); a second close() does nothing.
    The calls run on a daemon thread so that a hang fails the test instead of hanging it."""
    import threading

    from transformers import AutoModelForCausalLM

    from rollout_engine import EngineError

    rollouts = AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    rollouts.close()
    errors = []

    def calls():
        for call in (lambda: rollouts.push_weights(model),
                     lambda: rollouts.submit(["1+2="], SamplingParams(max_tokens=2)).result()):
            try:
                call()
            except Exception as error:  # each refusal is checked below
                errors.append(error)

    thread = threading.Thread(target=calls, daemon=True)
    thread.start()
    thread.join(30)
    assert not thread.is_alive(), "a call on a closed AsyncRollouts hangs"
    assert len(errors) == 2 and all(isinstance(e, EngineError) and "AsyncRollouts is closed" in str(e) for e in errors)
    rollouts.close()


def test_a_dropped_rollouts_is_collected_and_stops_its_threads(tiny_policy):
    """An AsyncRollouts dropped without close() frees its engine and stops its threads, as an AsyncEngine does (a
    notebook that builds a new one must not keep the old one's weights and KV pool)."""
    import gc
    import threading
    import weakref

    threads = set(threading.enumerate())
    rollouts = AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    assert len(rollouts.submit(["1+2="], SamplingParams(max_tokens=2)).result(timeout=60)) == 1
    dropped, engine = weakref.ref(rollouts), weakref.ref(rollouts.engine)
    del rollouts
    gc.collect()
    assert dropped() is None and engine() is None
    deadline = time.monotonic() + 30
    while set(threading.enumerate()) - threads and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not set(threading.enumerate()) - threads


def test_submit_takes_one_prompt_as_a_batch_of_one(tiny_policy):
    """A bare prompt (a str, a dict, a list of ids) is one request, as Engine.generate takes it: a str was split
    into a request per character and a dict into one per key, trained on as garbage."""
    params = SamplingParams(max_tokens=2, seed=0)
    with AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20) as rollouts:
        ids = rollouts.engine.engine.tokenizer("12+3=")["input_ids"]
        for prompt in ("12+3=", {"prompt_token_ids": ids}, ids):
            [out] = rollouts.submit(prompt, params).result(timeout=60)
            assert out.prompt_token_ids == ids
        [again] = rollouts.submit(out, params).result(timeout=60)  # a RequestOutput, as generate takes one
        assert again.outputs[0].token_ids == out.outputs[0].token_ids
        for batch in ((p for p in ["1+2=", "3+4="]), torch.tensor([ids, ids])):  # any iterable of prompts
            assert len(rollouts.submit(batch, params).result(timeout=60)) == 2
        for bad in (5, [], None, {"1+2="}, range(3), (i for i in range(3)), torch.tensor(3)):
            with pytest.raises(ValueError, match="prompts must be one prompt or a non-empty list of prompts"):
                rollouts.submit(bad, params)


def test_submit_runs_the_prompts_and_params_as_they_were_at_the_call(tiny_policy):
    """A one-step-off loop submits the next batch, then edits its objects for the one after (a new seed, a shorter
    max_tokens, a refilled prompt buffer) while the engine still holds this one. The requests were made later, on
    the client loop's thread, and most ran with the edits; now they are made, and copy their
    prompt and params, before submit returns."""
    with AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=16) as rollouts:
        for _ in range(10):
            params, prompt = SamplingParams(n=2, max_tokens=8, ignore_eos=True), [1, 2, 3, 4]
            pending = rollouts.submit([prompt], params)
            params.max_tokens, prompt[:] = 2, [5, 6]
            [out] = pending.result(timeout=60)
            assert out.prompt_token_ids == [1, 2, 3, 4] and [len(c.token_ids) for c in out.outputs] == [8, 8]


def test_closing_with_a_batch_in_flight_fails_it_and_logs_nothing(tiny_policy, caplog):
    """close() fails the batch's future with EngineError (its loop stopped before the engine's error reached the
    batch, which then ended cancelled), with no "Future exception was never retrieved" in the log. A submit after
    close makes no request at all (no "coroutine was never awaited" warning)."""
    import gc
    import warnings

    from rollout_engine import EngineError

    rollouts = AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=64)
    pending = rollouts.submit(["1+2=", "3+4=", "5+6=", "7+8="], SamplingParams(max_tokens=400, ignore_eos=True))
    with caplog.at_level("ERROR", logger="asyncio"):
        rollouts.close()
        with pytest.raises(EngineError):
            pending.result(timeout=60)
        del pending
        gc.collect()
    assert "never retrieved" not in caplog.text
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        refused = rollouts.submit(["1+2=", "3+4="], SamplingParams(max_tokens=2))
        gc.collect()
    assert isinstance(refused.exception(), EngineError)
    assert not [w for w in caught if "never awaited" in str(w.message)]


def test_close_does_not_wait_for_a_coroutine_that_never_ends(tiny_policy):
    """The stopped loop gives its tasks a few turns to end with the engine's error, not a timeout: a caller's
    coroutine that waits for ever (run(event.wait())) is cancelled at once."""
    import concurrent.futures

    rollouts = AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    forever = rollouts.run(asyncio.Event().wait())
    start = time.monotonic()
    rollouts.close()
    assert time.monotonic() - start < 2
    with pytest.raises(concurrent.futures.CancelledError):
        forever.result(timeout=10)


def test_the_rollout_side_is_still_found_under_async_grpo():
    import trainer_adapters.async_demo
    import trainer_adapters.async_grpo as async_grpo

    assert async_grpo.AsyncRollouts is AsyncRollouts
    assert async_grpo.run_async_demo is trainer_adapters.async_demo.run_async_demo
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        async_grpo.nothing


def test_a_failed_request_aborts_the_rest_of_its_batch(tiny_policy):
    """One bad prompt fails the batch's future; its other requests are aborted rather than left generating
    (holding KV and steps) for outputs nobody will read."""
    params = SamplingParams(n=2, max_tokens=400, ignore_eos=True)
    with AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=64) as rollouts:
        with pytest.raises(ValueError, match="prompt token ids"):
            rollouts.submit(["1+2=", "3+4="] * 4 + [[10 ** 6]], params).result(timeout=60)
        # the aborts are queued on the engine's loop before the future fails, so this read comes after them
        stats = rollouts.run(rollouts.engine.memory_stats()).result(timeout=60)
        assert stats["kv_blocks_used"] == 0, "the failed batch's other requests are still generating"


def test_push_weights_refuses_a_model_the_engine_cannot_take_before_pausing(tiny_policy, monkeypatch):
    """A model with a parameter the engine lacks (a value head, named last) is refused before the push pauses
    anything: found after the first copy groups (several in any model over GROUP_BYTES), it left the engine's
    weights partly updated and the batch in flight waiting, with no error, for a complete set."""
    import rollout_engine.weight_store
    from transformers import AutoModelForCausalLM

    monkeypatch.setattr(rollout_engine.weight_store, "GROUP_BYTES", 20_000)  # the tiny policy in several groups
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    model.v_head = torch.nn.Linear(model.config.hidden_size, 1)
    params = SamplingParams(n=2, max_tokens=120, ignore_eos=True)
    with AsyncRollouts(tiny_policy, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=64) as rollouts:
        pending = rollouts.submit(["1+2=", "3+4="] * 8, params)
        with pytest.raises(ValueError, match="v_head.weight"):
            rollouts.push_weights(model)
        assert rollouts.trainer_version == rollouts.engine.weight_version == 0
        outputs = pending.result(timeout=120)
        assert {c.finish_reason for o in outputs for c in o.outputs} == {"length"}


def test_off_policy_step_refuses_a_pad_id_outside_the_model_before_touching_it(tiny_policy):
    """pad_id must be one of the model's embedding rows: one outside failed inside the model's embedding (an
    IndexError) after the step had begun."""
    from transformers import AutoModelForCausalLM

    from rollout_engine import Engine

    engine = Engine(tiny_policy, device="cpu", kv_cache_memory=16 << 20)
    outputs = engine.generate(["1+2="], SamplingParams(n=2, max_tokens=3, seed=0), use_tqdm=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_policy, dtype=torch.float32).eval()
    for pad_id, allowed in ((10 ** 6, "below its 15 embedding rows"), (-1, "an int >= 0")):
        with pytest.raises(ValueError, match=f"pad_id={pad_id} is not allowed; .*{allowed}"):
            off_policy_step(model, Untouchable(), outputs, [1.0, 0.0], 2, pad_id, 0, mode="retract")
        assert not model.training and all(p.grad is None for p in model.parameters())


def test_tokens_over_a_prompt_older_weights_computed_are_off_policy_under_keep():
    """A request part-way through its prefill at a "keep" push samples every token under the new weights, over
    prompt KV the old ones made: all its tokens say version 1, and prompt_weight_version (0) is what tells the
    trainer that none of them is the new policy's. token_versions puts it at the prompt's last position."""
    from rollout_engine import CompletionOutput, RequestOutput

    def output(prompt_version, versions):
        sample = CompletionOutput(0, [5] * len(versions), [-1.0] * len(versions), None, "length", versions,
                                  prompt_weight_version=prompt_version)
        return RequestOutput(0, None, [1, 2, 3], [sample], 1)

    outputs = [output(0, [1, 1, 1]), output(1, [1, 1, 1]), output(0, [0, 1, 1]), output(None, [1, 1, 1])]
    batch = build_batch(outputs, [0.0, 1.0, 0.0, 1.0], 0)
    versions = token_versions(outputs, batch.input_ids.shape[1])
    assert versions[0].tolist() == [-1, -1, 0, 1, 1, 1]
    keep = on_policy_mask(versions, batch.completion_mask, 1, "keep")
    retract = on_policy_mask(versions, batch.completion_mask, 1, "retract")
    assert keep.sum(dim=1).tolist() == [0, 3, 0, 3]  # None: an output from before the field (nothing to say)
    assert retract.sum(dim=1).tolist() == [3, 3, 2, 3]  # retract re-prefills: the label alone is exact
