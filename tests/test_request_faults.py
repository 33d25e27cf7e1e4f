"""What one request's bad arguments, one failed step or one Ctrl-C may touch: only themselves. Found by an audit
of the scheduling layer; each test fails on the tree before its fix (ValueError / EngineError / correct outputs
there were a mid-step RuntimeError, a dead AsyncEngine, a KeyError in the next call, a metric larger than the
prompt, and a silent switch-off of top-k)."""
import asyncio
import itertools

import pytest
import torch
import transformers

from helpers import make_prompts
from rollout_engine import Engine, EngineError, SamplingParams
from rollout_engine.async_engine import AsyncEngine

KV = 16 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3")[0]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    """A Llama of 12 tokens: fewer than the 20 alternatives `logprobs` may ask for (a digits-only tiny model
    has 13)."""
    path = tmp_path_factory.mktemp("vocab12")
    config = transformers.LlamaConfig(vocab_size=12, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      eos_token_id=11, bos_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(path, safe_serialization=True)
    return path


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_more_alternatives_than_the_vocabulary_are_refused_before_any_step(small_vocab, name):
    engine = Engine(small_vocab, device="cpu", kv_cache_memory=KV)
    prompts = [[1, 2, 3], [4, 5]]
    want = tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
    with pytest.raises(ValueError, match=f"sampling_params.{name}=15 .* 12 tokens"):
        engine.generate(prompts, SamplingParams(temperature=0, max_tokens=4, **{name: 15}), use_tqdm=False)
    ok = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, **{name: 12})  # the whole vocabulary
    assert tokens(engine.generate(prompts, ok, use_tqdm=False)) == want
    assert engine.block_manager.num_used == 0


def test_one_callers_bad_logprobs_leave_the_async_engine_serving_the_others(small_vocab):
    reference = Engine(small_vocab, device="cpu", kv_cache_memory=KV).generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    with AsyncEngine(small_vocab, device="cpu", kv_cache_memory=KV) as engine:
        async def main():
            good = asyncio.ensure_future(engine.generate([1, 2, 3], GREEDY))
            with pytest.raises(ValueError, match="sampling_params.logprobs=15"):
                await engine.generate([4, 5], SamplingParams(max_tokens=4, logprobs=15))
            return await good, await engine.generate([1, 2, 3], GREEDY)

        first, later = run(main())
    assert tokens([first]) == tokens([later]) == tokens(reference)


def test_a_failed_step_ends_its_requests_and_the_async_engine_takes_new_ones(ckpt):
    """An exception inside a step (a bug, a device error) ends the requests in flight with an EngineError that
    names it, frees their KV, and the engine serves the next request as a fresh one would."""
    prompts = make_prompts([7, 11])
    reference = Engine(ckpt, device="cpu", kv_cache_memory=KV).generate(prompts, GREEDY, use_tqdm=False)
    with AsyncEngine(ckpt, device="cpu", kv_cache_memory=KV) as engine:
        loop, calls = engine.engine.loop, itertools.count()
        real_step = loop.step

        def step():
            if next(calls) == 3:
                raise RuntimeError("an injected step failure")
            return real_step()

        loop.step = step

        async def main():
            in_flight = [engine.generate(p, GREEDY) for p in prompts]
            results = await asyncio.gather(*in_flight, return_exceptions=True)
            return results, await asyncio.gather(*[engine.generate(p, GREEDY) for p in prompts])

        failed, later = run(main())
        assert engine.engine.block_manager.num_used == 0
    for err in failed:
        assert isinstance(err, EngineError) and "an injected step failure" in str(err)
        assert isinstance(err.__cause__, RuntimeError)
    assert tokens(later) == tokens(reference)


def test_ctrl_c_while_queueing_leaves_nothing_for_the_next_call(ckpt):
    engine = Engine(ckpt, device="cpu", kv_cache_memory=KV)
    prompts = make_prompts([5, 9, 13])
    want = tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
    real_submit, calls = engine.loop.submit, itertools.count()

    def submit(*args, **kwargs):
        if next(calls) == 1:
            raise KeyboardInterrupt
        return real_submit(*args, **kwargs)

    engine.loop.submit = submit
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, GREEDY, use_tqdm=False)
    engine.loop.submit = real_submit
    assert tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want
    assert engine.block_manager.num_used == 0


def test_ctrl_c_mid_generation_leaves_nothing_for_the_next_call(ckpt):
    engine = Engine(ckpt, device="cpu", kv_cache_memory=KV)
    prompts = make_prompts([5, 9, 13])
    want = tokens(engine.generate(prompts, GREEDY, use_tqdm=False))
    real_step, calls = engine.loop.step, itertools.count()

    def step():
        if next(calls) == 3:
            raise KeyboardInterrupt
        return real_step()

    engine.loop.step = step
    with pytest.raises(KeyboardInterrupt):
        engine.generate(prompts, GREEDY, use_tqdm=False)
    engine.loop.step = real_step
    assert engine.block_manager.num_used == 0 and not engine.loop.has_work()
    assert tokens(engine.generate(prompts, GREEDY, use_tqdm=False)) == want


def test_cached_prompt_tokens_are_counted_at_first_admission_only(ckpt):
    """metrics["num_cached_tokens"] is how much of the prompt the prefix cache served when the request was
    admitted: a sequence preempted and admitted again finds its own blocks, which it must not count."""
    prompts = make_prompts([5, 6, 7, 5], seed=12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    roomy = Engine(ckpt, device="cpu", kv_cache_memory=KV, block_size=4)
    stats = roomy.memory_stats()
    tight = Engine(ckpt, device="cpu", kv_cache_memory=9 * stats["kv_cache_bytes"] // stats["kv_blocks"],
                   block_size=4)  # 9 blocks of 4 tokens: 4 prompts of 5-7 growing to 29-31 tokens preempt
    want = roomy.generate(prompts, params, use_tqdm=False)
    got = tight.generate(prompts, params, use_tqdm=False)
    assert tight.stats()["preemptions"] > 0
    assert tokens(got) == tokens(want)
    assert [o.metrics["num_cached_tokens"] for o in got] == [o.metrics["num_cached_tokens"] for o in want]


@pytest.mark.parametrize("temperature", [1e7, 1e39])
def test_a_temperature_float32_cannot_use_is_refused(temperature):
    """Past float32's largest number a temperature becomes inf and every logit 0, so top-k would silently keep
    every token; far below that a draw is already uniform over what the filters keep."""
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=temperature, top_k=3)
    SamplingParams(temperature=1e6, top_k=3)


def test_the_engine_an_async_engine_owns_refuses_calls_from_other_threads(ckpt):
    """AsyncEngine.engine is readable (tokenizer, device, weight_version), but a call that steps or changes it
    from another thread is refused while the loop thread owns it (one stepped the loop under the AsyncEngine's
    requests: a KeyError, and their callers waited forever); stats() come through the AsyncEngine."""
    from rollout_engine import EngineBusyError

    prompts = make_prompts([7, 11])
    reference = Engine(ckpt, device="cpu", kv_cache_memory=KV).generate(prompts, GREEDY, use_tqdm=False)
    with AsyncEngine(ckpt, device="cpu", kv_cache_memory=KV) as engine:
        async def main():
            running = [asyncio.ensure_future(engine.generate(p, GREEDY)) for p in prompts]
            await asyncio.sleep(0)
            for call in (lambda: engine.engine.generate(prompts, GREEDY, use_tqdm=False), engine.engine.flush_cache,
                         lambda: engine.engine.sleep(1)):
                with pytest.raises(EngineBusyError, match="the AsyncEngine that owns this Engine"):
                    await asyncio.to_thread(call)
            return await asyncio.gather(*running), await engine.stats()

        outs, stats = run(main())
        assert engine.engine.device.type == "cpu" and engine.weight_version == 0  # reads need no lock
    assert tokens(outs) == tokens(reference)
    assert stats["preemptions"] == 0


def test_more_samples_than_max_n_are_refused():
    """n is bounded (one request made the server's front build 50 million records and stop answering)."""
    from rollout_engine.sampling_params import MAX_N

    SamplingParams(n=MAX_N)
    with pytest.raises(ValueError, match=f"n={MAX_N + 1} is not allowed; n must be an int in \\[1, {MAX_N}\\]"):
        SamplingParams(n=MAX_N + 1)


@pytest.mark.parametrize("name", ["enable_prefix_caching", "check_finite", "enforce_eager", "batch_invariant"])
@pytest.mark.parametrize("value", ["false", 0, None])
def test_engine_flags_take_a_bool_only(ckpt, name, value):
    """bool("false") is True: a flag given as a string (from a config file, an environment variable) turned the
    prefix cache or the NaN/inf check on when it meant off."""
    with pytest.raises(ValueError, match=f"{name}={value!r} is not allowed; True or False"):
        Engine(ckpt, device="cpu", kv_cache_memory=KV, **{name: value})


def test_a_public_call_from_inside_another_is_refused(hf_checkpoint):
    """One public call at a time holds within a thread too: the tensors update_weights consumes lazily may not
    call back into the engine (the lock is reentrant for an AsyncEngine's loop thread, which let them in)."""
    from rollout_engine import EngineBusyError

    path, model = hf_checkpoint("qwen3")
    engine = Engine(path, device="cpu", kv_cache_memory=KV)
    refused = []

    def tensors():
        for name, tensor in model.state_dict().items():
            for call in (lambda: engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False), lambda: engine.sleep(1)):
                try:
                    call()
                except EngineBusyError as err:
                    refused.append(str(err))
            yield name, tensor.detach().clone()

    assert engine.update_weights(tensors()) == 1
    assert refused and all("from inside Engine.update_weights()" in r for r in refused)
    assert not engine.is_sleeping and len(engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs) == 1
