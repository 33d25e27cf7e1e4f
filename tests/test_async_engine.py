"""AsyncEngine: many callers, one running batch, request-level control (DESIGN.md "Async and request control").

Every test drives the engine from `asyncio.run` under `asyncio.wait_for`, so a hang fails the test instead of
the suite. Steps on the CPU take about a millisecond; a test that needs something to happen "mid-generation"
wraps the loop's `step` (StepGate) to hold the loop thread after a given step while the test queues a command,
so the command runs at a known step boundary rather than at whatever moment a sleep happens to end.
"""
import asyncio
import collections
import dataclasses
import gc
import random
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from helpers import make_prompts
from rollout_engine import Engine, EngineError, SamplingParams
from rollout_engine.errors import EngineDeadError
from rollout_engine.async_engine import AsyncEngine

KV = 16 << 20
GREEDY_LONG = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """These models are tiny: torch's intra-op threads only contend (with the loop thread, and with other
    work on a shared machine: 2 threads made a step up to 100x slower under load)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3")[0]


@pytest.fixture(scope="module")
def new_ckpt(hf_checkpoint):
    """A second checkpoint of the same shape: (path, HF state_dict) of the weights an update brings."""
    path, model = hf_checkpoint("qwen3", seed=1)
    return path, {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_engine(path, **kw):
    return AsyncEngine(path, device="cpu", kv_cache_memory=KV, **kw)


class StepGate:
    """Wraps the loop's `step` (on the loop thread): counts steps, and after step `hold_at` holds the loop
    thread until `at_boundary` has queued its commands, so a command queued meanwhile runs exactly at that step boundary."""

    def __init__(self, engine: AsyncEngine, hold_at: int):
        self.loop, self.hold_at = engine.engine.loop, hold_at
        self.inner, self.count = self.loop.step, 0
        self.reached, self.released = threading.Event(), threading.Event()
        self.loop.step = self.step

    def step(self):
        out = self.inner()
        self.count += 1
        if self.count == self.hold_at:
            self.reached.set()
            self.released.wait(30)
        return out

    async def wait(self):
        for _ in range(30_000):
            if self.reached.is_set():
                return
            await asyncio.sleep(0.001)
        raise AssertionError(f"the loop never reached step {self.hold_at}")

    async def at_boundary(self, *coros):
        """Once the loop is held after step `hold_at`: queue `coros` (in order) and release the loop."""
        await self.wait()
        tasks = []
        for coro in coros:
            tasks.append(asyncio.ensure_future(coro))
            await asyncio.sleep(0)  # the task runs up to its first await: its command is in the inbox
        self.released.set()
        return tasks


async def admitted_together(engine: AsyncEngine, *coros):
    """Start `coros` (generate calls) so their requests join the same step: submitted one after the other, the
    loop thread could step between them. A "keep" pause holds them, and the continue, queued after them, admits
    them together."""
    await engine.pause_generation("keep")
    tasks = []
    for coro in coros:
        tasks.append(asyncio.ensure_future(coro))
        await asyncio.sleep(0)  # the task runs up to its first await: its request is in the inbox
    await engine.continue_generation()
    return tasks


EPS32 = float(torch.finfo(torch.float32).eps)  # 2**-23


def assert_logprobs_close(x, y):
    """float32 logprobs of the same tokens computed in different batches. The CPU picks its matmul blocking
    by the batch's shape, so a row's dot products (64..128 terms here) are summed in another order: each may
    move by up to ~K ulps of the magnitudes summed. Allow 64 ulps of max(1, |logprob|) (~7.6e-6 near 0);
    measured: at most 10. A wrong token, position or weight version moves a logprob by far more."""
    assert len(x) == len(y)
    x, y = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    bound = 64 * EPS32 * torch.clamp(x.abs(), min=1)
    assert bool(((x - y).abs() <= bound).all()), ((x - y).abs().max().item(), x, y)


def assert_same_output(a, b, exact=True):
    """Same samples: same tokens, finish reasons and weight versions; logprobs bit-equal when both ran in
    the same batch shapes (`exact`), else within float32 reordering error."""
    assert len(a.outputs) == len(b.outputs)
    for x, y in zip(a.outputs, b.outputs):
        assert x.index == y.index and x.finish_reason == y.finish_reason
        assert x.token_ids == y.token_ids
        assert x.weight_versions == y.weight_versions
        if exact:
            assert x.logprobs == y.logprobs
        else:
            assert_logprobs_close(x.logprobs, y.logprobs)


def switch_index(versions, v):
    """The one index where `versions` goes from v to v + 1 (asserting there is exactly one)."""
    assert set(versions) == {v, v + 1}, versions
    s = versions.index(v + 1)
    assert versions == [v] * s + [v + 1] * (len(versions) - s), versions
    return s


def assert_no_leak(engine: AsyncEngine):
    """Nothing left to run and every KV block free. A decode step launched ahead of a sample that then hit
    a stop is still collected (and dropped) by the loop thread just after the caller got its output."""
    for _ in range(5000):
        if not engine.engine.loop.has_work():
            break
        time.sleep(0.001)
    assert not engine.engine.loop.has_work()
    assert engine.engine.block_manager.num_used == 0


# ---------------------------------------------------------------------------------------------- 1


def mixed_requests(count=64, seed=0):
    rng = random.Random(seed)
    prompts = make_prompts([rng.randrange(2, 40) for _ in range(count)], seed=seed + 1)
    params = [SamplingParams(n=rng.randint(1, 3), temperature=rng.choice([0, 0.6, 1.0, 1.4]),
                             top_k=rng.choice([-1, 1, 8, 60]), top_p=rng.choice([1.0, 0.9, 0.4]),
                             max_tokens=rng.randint(1, 14), seed=rng.randrange(1 << 30),
                             ignore_eos=rng.random() < 0.5)
              for _ in range(count)]
    return prompts, params


def test_concurrent_generates_equal_one_batched_generate(ckpt):
    """64 callers (half of them joining a batch that already runs) get what one batched Engine.generate
    gives: the same tokens, finish reasons and weight versions, and logprobs equal up to float32 summation
    order (all submitted at once they are bit-identical; joining later changes the batch shapes)."""
    prompts, params = mixed_requests()
    reference = Engine(ckpt, device="cpu", kv_cache_memory=KV).generate(prompts, params, use_tqdm=False)
    assert sum(len(o.outputs) for o in reference) == sum(p.n for p in params)

    async def caller(engine, i):
        if i % 2:
            await asyncio.sleep(0.0005 * i)  # joins the running batch at some later step
        return await engine.generate(prompts[i], params[i], request_id=f"caller-{i}")

    with make_engine(ckpt) as engine:
        async def main():
            return await asyncio.gather(*[caller(engine, i) for i in range(64)])

        got = run(main())
        assert_no_leak(engine)
    for i, (ref, out) in enumerate(zip(reference, got)):
        assert out.request_id == f"caller-{i}"
        assert out.prompt_token_ids == prompts[i]
        assert_same_output(ref, out, exact=False)
    # not a degenerate comparison: sampling differs across requests and samples
    assert len({tuple(c.token_ids) for o in got for c in o.outputs if len(c.token_ids) > 4}) > 20


# ---------------------------------------------------------------------------------------------- 2


def test_params_edited_after_submit_leave_the_request_as_submitted(ckpt):
    """A caller reusing one SamplingParams for its next request edits it while this one runs: this one keeps
    its max_tokens and its n (an n grown under it would wait forever for a sample never started)."""
    prompt = make_prompts([9], seed=13)[0]
    params = SamplingParams(temperature=1.0, max_tokens=40, seed=4, ignore_eos=True)

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        running = asyncio.ensure_future(engine.generate(prompt, params))
        await gate.wait()
        params.max_tokens, params.n = 3, 2
        gate.released.set()
        return await running

    with make_engine(ckpt) as engine:
        out = run(main(engine), timeout=30)
        assert_no_leak(engine)
    assert len(out.outputs) == 1
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


def test_a_prompt_edited_after_submit_leaves_the_request_as_submitted(ckpt):
    """A caller reusing its token list (or dict) for the next prompt edits it while this request is held by a
    "keep" pause: the request runs the prompt it was submitted with (the loop reads it again at continue)."""
    ids = make_prompts([9], seed=13)[0]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main(engine):
        await engine.pause_generation("keep")
        as_list, as_dict = list(ids), {"prompt_token_ids": list(ids)}
        held = [asyncio.ensure_future(engine.generate(p, greedy)) for p in (as_list, as_dict)]
        await asyncio.sleep(0.2)  # submitted, checked and held
        as_list[:] = [7] * 20
        as_dict["prompt_token_ids"][:] = [7] * 20
        await engine.continue_generation()
        return await asyncio.gather(*held), await engine.generate(list(ids), greedy)

    with make_engine(ckpt) as engine:
        held, plain = run(main(engine), timeout=30)
        assert_no_leak(engine)
    for out in held:
        assert out.prompt_token_ids == ids and out.outputs[0].token_ids == plain.outputs[0].token_ids


def test_tasks_made_in_a_loop_over_one_params_and_prompt_run_as_called(ckpt):
    """A GRPO group built as `create_task(engine.generate(prompt, params))` in a loop that sets params.seed and
    edits the prompt between calls: each request runs with the seed and prompt of its own call (and a stream with
    the params of its call). The copies were taken when each task first ran, after the loop had finished: every
    task ran the last seed and prompt."""
    ids = make_prompts([9], seed=13)[0]
    params = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)

    async def main(engine):
        prompt, tasks = list(ids), []
        for i in range(3):
            params.seed, prompt[0] = i, 10 + i
            tasks.append(asyncio.create_task(engine.generate(prompt, params)))
        params.max_tokens = 2
        stream = engine.stream(prompt, params)  # params.max_tokens is 2 at this call
        params.max_tokens = 7
        short = [out async for out in stream][-1]
        singles = [await engine.generate([10 + i] + ids[1:], SamplingParams(temperature=1.0, max_tokens=12,
                                                                               ignore_eos=True, seed=i))
                   for i in range(3)]
        return await asyncio.gather(*tasks), singles, short

    with make_engine(ckpt) as engine:
        grouped, singles, short = run(main(engine), timeout=60)
        assert_no_leak(engine)
    for i, (out, single) in enumerate(zip(grouped, singles)):
        assert out.prompt_token_ids == [10 + i] + ids[1:]
        assert out.outputs[0].token_ids == single.outputs[0].token_ids
    assert len({tuple(out.outputs[0].token_ids) for out in grouped}) == 3  # three seeds, three samples
    assert len(short.outputs[0].token_ids) == 2


def check_stream(snapshots, final, tokenizer=None, min_snapshots=3):
    assert len(snapshots) >= min_snapshots, "stream should deliver intermediate snapshots"
    last = snapshots[-1]
    assert_same_output(last, final)
    for before, after in zip(snapshots, snapshots[1:]):
        for x, y in zip(before.outputs, after.outputs):
            assert len(x.token_ids) <= len(y.token_ids)
            assert y.token_ids[: len(x.token_ids)] == x.token_ids
            assert y.logprobs[: len(x.logprobs)] == x.logprobs
            assert y.weight_versions[: len(x.weight_versions)] == x.weight_versions
            if x.finish_reason is not None:
                assert y.finish_reason == x.finish_reason and y.token_ids == x.token_ids
    if tokenizer is not None:
        for snap in snapshots:
            for x, y in zip(snap.outputs, final.outputs):
                assert y.text.startswith(x.text), (x.text, y.text)
                assert x.finish_reason is not None or not x.text.endswith("\ufffd")


def test_stream_snapshots_grow_to_what_generate_returns(ckpt):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, max_tokens=24, seed=11)
    prompt = make_prompts([9], seed=3)[0]

    async def main(engine):
        snapshots = [snap async for snap in engine.stream(prompt, params)]
        final = await engine.generate(prompt, params)
        return snapshots, final

    with make_engine(ckpt) as engine:
        snapshots, final = run(main(engine))
        assert_no_leak(engine)
    check_stream(snapshots, final)
    assert all(c.finish_reason is None for c in snapshots[0].outputs if len(c.token_ids) < 24)


def test_a_stream_and_generate_say_which_stop_token_ended_a_sample(ckpt):
    """CompletionOutput.stop_reason (vLLM's field) reaches AsyncEngine's outputs: the stop_token_ids token."""
    prompt = make_prompts([9], seed=3)[0]

    async def main(engine):
        base = await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[base.outputs[0].token_ids[3]])
        snapshots = [snap async for snap in engine.stream(prompt, params)]
        return base, snapshots, await engine.generate(prompt, params)

    with make_engine(ckpt) as engine:
        base, snapshots, final = run(main(engine))
    stop = base.outputs[0].token_ids[3]
    assert base.outputs[0].stop_reason is None and final.outputs[0].finish_reason == "stop"
    assert final.outputs[0].stop_reason == stop == snapshots[-1].outputs[0].stop_reason


@pytest.mark.parametrize("logprobs", [True, False])
def test_a_stream_reads_logprobs_set_after_construction_as_generate_does(ckpt, logprobs):
    """SamplingParams takes True / False for logprobs as 0 / None, set in the constructor or later: a stream's
    snapshots carry what generate returns (the sampled token's logprob, no alternatives; or none)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    params.logprobs = logprobs
    prompt = make_prompts([9], seed=3)[0]

    async def main(engine):
        return [snap async for snap in engine.stream(prompt, params)], await engine.generate(prompt, params)

    with make_engine(ckpt) as engine:
        snapshots, final = run(main(engine))
        assert_no_leak(engine)
    sample = final.outputs[0]
    assert (sample.logprobs is not None) == logprobs and sample.top_logprobs is None
    for snap in snapshots:
        assert (snap.outputs[0].logprobs is not None) == logprobs and snap.outputs[0].top_logprobs is None
    assert_same_output(snapshots[-1], final)


LIST_OF_PROMPTS = "one prompt per call|one per call"
NOT_A_PROMPT = "prompt must be one prompt"  # Engine.generate refuses a bare int; AsyncEngine ran it as the prompt [5]


@pytest.mark.parametrize("prompt, words", [(["hello", "world"], LIST_OF_PROMPTS), ([[1, 2], [3, 4]], LIST_OF_PROMPTS),
                                           ([{"prompt_token_ids": [1, 2]}], LIST_OF_PROMPTS), (5, NOT_A_PROMPT),
                                           (np.int64(5), NOT_A_PROMPT), (torch.tensor(5), NOT_A_PROMPT),
                                           (2.0, NOT_A_PROMPT), (None, NOT_A_PROMPT)])
def test_a_list_of_prompts_or_a_bare_token_id_is_refused_and_the_engine_serves_on(ckpt, prompt, words):
    async def main(engine):
        for call in (engine.generate, lambda p: engine.stream(p).__anext__()):
            with pytest.raises(ValueError, match=words):
                await call(prompt)
        return await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))

    with make_engine(ckpt) as engine:
        assert len(run(main(engine)).outputs[0].token_ids) == 2
        assert_no_leak(engine)


def straddling_stop(tokenizer, ids):
    """A two-character stop string whose first occurrence straddles a token boundary (its first character
    ends one token, its second begins the next), or None."""
    for k in range(2, len(ids) - 1):
        a, b = (tokenizer.decode(ids[:j], skip_special_tokens=True) for j in (k, k + 1))
        if a and "\ufffd" not in b and len(b) > len(a) and b.startswith(a) and b.find(a[-1] + b[len(a)]) == len(a) - 1:
            return a[-1] + b[len(a)]
    return None


def test_stream_text_never_splits_a_character(tiny_checkpoint):
    """With a real (byte-level BPE) tokenizer a random model emits single bytes of multi-byte characters:
    the partial text of each snapshot is a prefix of the final text and never ends in U+FFFD. With stop
    strings, a snapshot never shows text that the stop string later cuts off (neither the text of a sample
    that already stopped nor the start of a stop string still arriving)."""
    cases = [("the model 12+3=", SamplingParams(n=3, temperature=1.5, max_tokens=40, seed=s)) for s in range(3)]
    cases += [("a block of", SamplingParams(n=3, temperature=1.2, max_tokens=60, seed=s, stop=stop))
              for s, stop in ((5, "e"), (6, [" t", "ck"]), (7, "\ufffd"))]

    async def main(engine):
        for seed in range(9, 41):  # the first seed whose sample holds a two-character string across a token boundary
            straddling = SamplingParams(temperature=1.0, max_tokens=40, seed=seed, ignore_eos=True)
            free = (await engine.generate("the cache", straddling)).outputs[0]
            stop = straddling_stop(engine.engine.tokenizer, free.token_ids)
            if stop is not None:
                break
        assert stop is not None
        cases.append(("the cache", dataclasses.replace(straddling, stop=stop)))
        results = []
        for prompt, params in cases:
            snapshots = [snap async for snap in engine.stream(prompt, params)]
            results.append((snapshots, await engine.generate(prompt, params)))
        return results

    with make_engine(tiny_checkpoint) as engine:
        results = run(main(engine))
        tokenizer = engine.engine.tokenizer
        assert_no_leak(engine)
    split = 0
    for (snapshots, final), (_, params) in zip(results, cases):
        # a stream that falls behind gets several steps in one snapshot (on a loaded machine, a 3-token sample
        # may come in two): this test is about the text of the snapshots it gets, not how many
        check_stream(snapshots, final, tokenizer, min_snapshots=1)
        for c in final.outputs:
            split += sum(tokenizer.decode(c.token_ids[:k], skip_special_tokens=True).endswith("\ufffd")
                         for k in range(1, len(c.token_ids)))
        if params.stop:
            assert any(c.finish_reason == "stop" for c in final.outputs)
    assert split > 10, "the outputs should contain characters split across tokens"


# ---------------------------------------------------------------------------------------------- 3


def test_abort_returns_the_tokens_so_far_and_frees_every_block(ckpt):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=60, seed=5, ignore_eos=True)
    prompt = make_prompts([20], seed=4)[0]

    async def main(engine):
        gate = StepGate(engine, hold_at=6)
        caller = asyncio.ensure_future(engine.generate(prompt, params, request_id="victim"))
        other = asyncio.ensure_future(engine.generate(prompt, GREEDY_LONG, request_id="bystander"))
        abort, = await gate.at_boundary(engine.abort("victim"))
        partial = await abort
        answered = await caller
        bystander = await other
        await engine.pause_generation("keep")  # a request queued while paused: aborted before it ran
        waiting = asyncio.ensure_future(engine.generate(prompt, SamplingParams(n=3), request_id="held"))
        await asyncio.sleep(0.01)
        held = await engine.abort("held")
        assert (await waiting) == held
        await engine.continue_generation()
        full = await engine.generate(prompt, params, request_id="full")
        late = [await engine.abort("victim"), await engine.abort("full"), await engine.abort("nobody")]
        return partial, answered, bystander, held, full, late

    with make_engine(ckpt) as engine:
        partial, answered, bystander, held, full, late = run(main(engine))
        assert_no_leak(engine)
    assert partial == answered and partial is not answered  # each caller its own: one's edits are not the other's
    assert all(p is not a for p, a in zip(partial.outputs, answered.outputs))
    assert partial.request_id == "victim"
    for p, f in zip(partial.outputs, full.outputs):
        assert p.finish_reason == "abort" and f.finish_reason == "length"
        # six steps gave one token each; a decode step launched ahead of the abort is collected, not dropped
        assert 6 <= len(p.token_ids) <= 7
        assert len(p.logprobs) == len(p.weight_versions) == len(p.token_ids)
        assert f.token_ids[: len(p.token_ids)] == p.token_ids
        assert_logprobs_close(f.logprobs[: len(p.logprobs)], p.logprobs)  # "full" ran without the bystander
    assert bystander.outputs[0].finish_reason == "length" and len(bystander.outputs[0].token_ids) == 40
    assert [c.finish_reason for c in held.outputs] == ["abort"] * 3
    assert all(c.token_ids == [] and c.logprobs == [] and c.weight_versions == [] for c in held.outputs)
    assert held.prompt_token_ids == prompt  # it never ran, but its prompt is known
    assert late == [None, None, None]


def test_a_resume_aborted_before_it_ran_returns_what_it_was_given(ckpt):
    """An aborted output given back to continue, held by a pause and aborted again before it ran, comes back
    as it went in (tokens, finish reasons, prompt), under its new id, and can be resumed once more."""
    prompt = make_prompts([9], seed=15)[0]
    params = SamplingParams(n=2, temperature=1.0, max_tokens=40, seed=3, ignore_eos=True)

    async def main(engine):
        gate = StepGate(engine, hold_at=5)
        caller = asyncio.ensure_future(engine.generate(prompt, params, request_id="a"))
        abort, = await gate.at_boundary(engine.abort("a"))
        cut = await abort
        await caller
        await engine.pause_generation("keep")
        resumed = asyncio.ensure_future(engine.generate(cut, params, request_id="b"))
        await asyncio.sleep(0.01)
        again = await engine.abort("b")
        assert (await resumed) == again
        await engine.continue_generation()
        return cut, again, await engine.generate(again, params, request_id="c")

    with make_engine(ckpt) as engine:
        cut, again, final = run(main(engine))
        assert_no_leak(engine)
    assert again.request_id == "b" and again.prompt_token_ids == cut.prompt_token_ids == prompt
    assert all(a is not c for a, c in zip(again.outputs, cut.outputs))  # not the caller's own objects
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in cut.outputs]
    assert [c.finish_reason for c in again.outputs] == [c.finish_reason for c in cut.outputs]
    assert all(c.token_ids for c in cut.outputs)
    for c, f in zip(cut.outputs, final.outputs):
        assert f.finish_reason == "length" and len(f.token_ids) == 40 and f.token_ids[: len(c.token_ids)] == c.token_ids


# ---------------------------------------------------------------------------------------------- 4


@pytest.fixture(scope="module")
def fresh(new_ckpt):
    """greedy(ids, max_tokens): what a synchronous Engine loaded with the new weights produces."""
    engine = Engine(new_ckpt[0], device="cpu", kv_cache_memory=KV)

    def greedy(ids, max_tokens):
        out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
                              use_tqdm=False)
        return out[0].outputs[0]

    return greedy


@pytest.mark.parametrize("stop", [asyncio.CancelledError, SystemExit])
def test_a_weight_generator_that_raises_no_exception_answers_its_caller_only(ckpt, new_ckpt, stop):
    """A weight source that raises CancelledError (an asyncio.run inside it, cancelled) or SystemExit mid-update:
    its caller gets an EngineError caused by it (not a hang, nor a loop thread gone), a generate running beside it is
    not told it was cancelled, and the engine serves on with its weights (nothing was copied)."""
    pairs = list(new_ckpt[1].items())

    def source():
        yield from pairs[:3]
        raise stop("the weight source stopped")

    async def main(engine):
        v = engine.weight_version
        beside = asyncio.ensure_future(engine.generate([3, 4, 5], GREEDY_LONG))
        with pytest.raises(EngineError, match="stopped by") as caught:
            await engine.update_weights(source())
        assert isinstance(caught.value.__cause__, stop)
        out = await beside
        assert engine.weight_version == v and await engine.update_weights(new_ckpt[1]) == v + 1
        return out

    with make_engine(ckpt) as engine:
        out = run(main(engine))
        assert_no_leak(engine)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


@pytest.mark.parametrize("hold", [None, "keep", "retract", "keep, then a whole update"])
def test_requests_in_flight_end_when_an_update_fails_part_way_unless_a_pause_holds_them(ckpt, new_ckpt, monkeypatch,
                                                                                         hold):
    """An update that fails after its first copy leaves the weights incomplete: no step runs until a whole update.
    A request no pause holds ends at once with WeightsNotReadyError; one a "keep" or "retract" pause holds waits
    for the update, and ends so at continue_generation if none came (it waited forever), or resumes if one did."""
    from rollout_engine import WeightsNotReadyError, weight_store

    monkeypatch.setattr(weight_store, "GROUP_BYTES", 40_000)  # several groups: the failure comes after copies
    pairs = list(new_ckpt[1].items())

    def failing():
        yield from pairs[:-2]
        raise ValueError("the trainer's gather failed")

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        inflight = asyncio.ensure_future(engine.generate([3, 4, 5], GREEDY_LONG))
        pause = [engine.pause_generation(hold.split(",")[0])] if hold else []
        *paused, update = await gate.at_boundary(*pause, engine.update_weights(failing()))
        await asyncio.gather(*paused)
        with pytest.raises(ValueError, match="gather failed"):
            await update
        if hold:
            await asyncio.sleep(0.05)
            assert not inflight.done()  # held for the update
            if hold.endswith("update"):
                assert await engine.update_weights(new_ckpt[1]) == 1
            await engine.continue_generation()
        if hold and hold.endswith("update"):
            return await asyncio.wait_for(inflight, 30)
        with pytest.raises(WeightsNotReadyError, match="requests in flight cannot go on"):
            await asyncio.wait_for(inflight, 10)
        assert await engine.update_weights(new_ckpt[1]) == 1
        return await engine.generate([3, 4, 5], GREEDY_LONG)

    with make_engine(ckpt) as engine:
        out = run(main(engine))
        assert_no_leak(engine)
    assert out.outputs[0].finish_reason == "length" and out.outputs[0].weight_versions[-1] == 1


@pytest.mark.parametrize("failed_before", [False, True])
def test_requests_a_level_2_sleep_retracted_wait_for_the_update_that_brings_the_weights_back(ckpt, new_ckpt,
                                                                                          monkeypatch, failed_before):
    """Discarded weights are not a failed update: requests retracted for a level-2 sleep wait through the wake and
    the continue for the update, then finish under it (what the server's /sleep with mode "retract" and /wake do).
    `failed_before`: an earlier update failed part-way and a whole one repaired it, which leaves nothing to end."""
    from rollout_engine import weight_store

    monkeypatch.setattr(weight_store, "GROUP_BYTES", 40_000)
    pairs = list(new_ckpt[1].items())

    def failing():
        yield from pairs[:-2]
        raise ValueError("the trainer's gather failed")

    async def main(engine):
        if failed_before:
            with pytest.raises(ValueError, match="gather failed"):
                await engine.update_weights(failing())
            assert await engine.update_weights(new_ckpt[1]) == 1
        gate = StepGate(engine, hold_at=3)
        inflight = asyncio.ensure_future(engine.generate([3, 4, 5], GREEDY_LONG))
        pause, = await gate.at_boundary(engine.pause_generation("retract"))
        await pause
        await engine.sleep(2)
        await engine.wake()
        await engine.continue_generation()
        await asyncio.sleep(0.05)
        assert not inflight.done()  # waiting for the weights
        await engine.update_weights(new_ckpt[1])
        return await asyncio.wait_for(inflight, 30)

    with make_engine(ckpt) as engine:
        out = run(main(engine))
        assert_no_leak(engine)
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


def test_pause_abort_returns_partials_and_later_requests_use_the_new_weights(ckpt, new_ckpt, fresh):
    prompts = make_prompts([7, 19, 4], seed=8)

    async def main(engine):
        v = engine.weight_version
        gate = StepGate(engine, hold_at=5)
        callers = await admitted_together(engine, *(engine.generate(p, GREEDY_LONG) for p in prompts[:2]))
        pause, = await gate.at_boundary(engine.pause_generation("abort"))
        await pause
        partials = await asyncio.gather(*callers)
        later = asyncio.ensure_future(engine.generate(prompts[2], GREEDY_LONG))
        assert await engine.update_weights(new_ckpt[1]) == v + 1
        await asyncio.sleep(0.02)
        assert not later.done()
        await engine.continue_generation()
        return v, partials, await later

    with make_engine(ckpt) as engine:
        v, partials, later = run(main(engine))
        assert_no_leak(engine)
    assert len({len(out.outputs[0].token_ids) for out in partials}) == 1  # cut at the same step
    for out in partials:
        c = out.outputs[0]
        assert c.finish_reason == "abort" and 0 < len(c.token_ids) < 40
        assert c.weight_versions == [v] * len(c.token_ids)
    assert later.outputs[0].weight_versions == [v + 1] * 40
    assert later.outputs[0].token_ids == fresh(prompts[2], 40).token_ids


def test_pause_wait_finishes_in_flight_under_the_old_weights(ckpt, new_ckpt, fresh):
    prompts = make_prompts([7, 19, 4], seed=9)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=2, ignore_eos=True)

    async def main(engine):
        v = engine.weight_version
        gate = StepGate(engine, hold_at=3)
        callers = [asyncio.ensure_future(engine.generate(prompts[0], GREEDY_LONG)),
                   asyncio.ensure_future(engine.generate(prompts[1], sampled))]
        pause, later = await gate.at_boundary(engine.pause_generation("wait"),
                                              engine.generate(prompts[2], GREEDY_LONG))
        await pause
        assert all(c.done() for c in callers), "pause('wait') returned before the requests in flight finished"
        assert not later.done() and not engine.engine.loop.has_work()
        assert await engine.update_weights(new_ckpt[1]) == v + 1
        await asyncio.sleep(0.02)
        assert not later.done() and not engine.engine.loop.has_work(), "admitted before continue_generation"
        await engine.continue_generation()
        return v, [c.result() for c in callers], await later

    with make_engine(ckpt) as engine:
        v, finished, later = run(main(engine))
        assert_no_leak(engine)
    for out, n in zip(finished, (40, 30)):
        for c in out.outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == n
            assert c.weight_versions == [v] * n
    assert len(finished[1].outputs) == 2
    assert later.outputs[0].weight_versions == [v + 1] * 40
    assert later.outputs[0].token_ids == fresh(prompts[2], 40).token_ids


def test_pause_keep_switches_versions_once_and_refuses_sleep(ckpt, new_ckpt):
    prompts = make_prompts([7, 19], seed=10)
    sampled = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=3, ignore_eos=True)

    async def main(engine):
        v = engine.weight_version
        gate = StepGate(engine, hold_at=6)
        callers = await admitted_together(engine, engine.generate(prompts[0], GREEDY_LONG),
                                          engine.generate(prompts[1], sampled))
        pause, = await gate.at_boundary(engine.pause_generation("keep"))
        await pause
        assert engine.engine.block_manager.num_used > 0  # their KV is kept
        with pytest.raises(EngineError, match="hold KV"):
            await engine.sleep(1)
        assert await engine.update_weights(new_ckpt[1]) == v + 1
        assert not any(c.done() for c in callers)
        await engine.continue_generation()
        return v, await asyncio.gather(*callers)

    with make_engine(ckpt) as engine:
        v, outs = run(main(engine))
        assert_no_leak(engine)
    switches = set()
    for out, n in zip(outs, (40, 30)):
        for c in out.outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == n
            switches.add(switch_index(c.weight_versions, v))
    s, = switches  # all ran in the same steps: the same step boundary for each sample
    assert 0 < s < 30


def test_weights_received_from_a_trainers_sender_apply_between_two_steps(ckpt, new_ckpt, fresh):
    """A trainer process's WeightSender (a thread here: the transport's shared memory all the same): the update
    lands at one step boundary of a request in flight, and a later request is what an engine loaded with those
    weights generates."""
    from rollout_engine.transport import WeightReceiver, WeightSender

    prompts = make_prompts([7, 19], seed=12)

    def send(endpoint):
        with WeightSender(endpoint) as sender:
            sender.send(new_ckpt[1])

    async def main(engine):
        v = engine.weight_version
        with pytest.raises(ValueError, match="WeightReceiver"):
            await engine.receive_weights(WeightReceiver(Engine(ckpt, device="cpu", kv_cache_memory=KV)))
        receiver = WeightReceiver(engine.engine)
        trainer = threading.Thread(target=send, args=(receiver.endpoint,))
        try:
            gate = StepGate(engine, hold_at=5)
            caller, = await admitted_together(engine, engine.generate(prompts[0], GREEDY_LONG))
            trainer.start()
            received, = await gate.at_boundary(engine.receive_weights(receiver, begin_timeout_s=30))
            assert await received == v + 1
            return v, await caller, await engine.generate(prompts[1], GREEDY_LONG)
        finally:
            trainer.join(30)
            receiver.close()

    with make_engine(ckpt) as engine:
        v, across, later = run(main(engine))
        assert_no_leak(engine)
    assert 0 < switch_index(across.outputs[0].weight_versions, v) < 40
    assert later.outputs[0].weight_versions == [v + 1] * 40
    assert later.outputs[0].token_ids == fresh(prompts[1], 40).token_ids


def test_a_receive_weights_cancelled_while_it_waits_for_the_sender_ends_and_the_engine_serves_on(ckpt):
    """wait_for(receive_weights(r), 0.5) with no sender: TimeoutError after about 0.5 s and the engine generates,
    rather than both waiting until someone closes the receiver (10 s here, the test's own way out)."""
    from rollout_engine.transport import WeightReceiver

    async def main(engine):
        start = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(engine.receive_weights(receiver), 0.5)
        return time.monotonic() - start, await engine.generate([1, 2, 3], GREEDY_LONG)

    with make_engine(ckpt) as engine:
        receiver = WeightReceiver(engine.engine)
        rescue = threading.Timer(10, receiver.close)
        rescue.start()
        try:
            waited, out = run(main(engine))
        finally:
            rescue.cancel()
            receiver.close()
    assert waited < 5 and len(out.outputs[0].token_ids) == 40


@pytest.mark.parametrize("pause", [None, "keep"])
def test_kv_computed_across_an_update_never_serves_a_later_request(ckpt, new_ckpt, fresh, pause):
    """A request running while the weights change (with no pause, or held by "keep") keeps KV that the old
    weights computed, and every block it fills later is computed over that KV. None of it may reach the
    prefix cache: the next turn of the same trajectory (its prompt + its tokens + a new message) is served as
    an engine loaded with the new weights serves it, none of its tokens from the cache."""
    prompt = make_prompts([9], seed=12)[0]  # 9 tokens: the first 16-token block is part-filled at the update

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        first = asyncio.ensure_future(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=30,
                                                                             ignore_eos=True)))
        if pause is None:
            update, = await gate.at_boundary(engine.update_weights(new_ckpt[1]))
            await update
        else:
            held, = await gate.at_boundary(engine.pause_generation(pause))
            await held
            await engine.update_weights(new_ckpt[1])
            await engine.continue_generation()
        first = await first
        turn = prompt + first.outputs[0].token_ids + [3, 4, 5]
        return first, turn, await engine.generate(turn, SamplingParams(temperature=0, max_tokens=8,
                                                                      ignore_eos=True))

    with make_engine(ckpt) as engine:
        first, turn, second = run(main(engine))
        assert_no_leak(engine)
    assert len(set(first.outputs[0].weight_versions)) == 2  # it did span the update
    assert second.metrics["num_cached_tokens"] == 0
    assert second.outputs[0].token_ids == fresh(turn, 8).token_ids


def test_pause_retract_recomputes_under_the_new_weights_and_may_sleep(ckpt, new_ckpt, fresh):
    prompts = make_prompts([7, 19, 33], seed=11)
    greedy2 = SamplingParams(n=2, temperature=0, max_tokens=40, ignore_eos=True)

    async def main(engine):
        v = engine.weight_version
        gate = StepGate(engine, hold_at=7)
        callers = await admitted_together(engine, engine.generate(prompts[0], GREEDY_LONG),
                                          engine.generate(prompts[1], greedy2), engine.generate(prompts[2], GREEDY_LONG))
        pause, = await gate.at_boundary(engine.pause_generation("retract"))
        await pause
        assert engine.engine.block_manager.num_used == 0  # KV freed, tokens kept
        assert engine.engine.loop.has_work()
        assert await engine.update_weights(new_ckpt[1]) == v + 1
        await engine.sleep(1)
        assert engine.engine.is_sleeping
        await engine.wake()
        await asyncio.sleep(0.02)
        assert not any(c.done() for c in callers)  # still paused
        await engine.continue_generation()
        return v, await asyncio.gather(*callers)

    with make_engine(ckpt) as engine:
        v, outs = run(main(engine))
        assert_no_leak(engine)
    switches = set()
    for out, prompt in zip(outs, prompts):
        for c in out.outputs:
            assert c.finish_reason == "length" and len(c.token_ids) == 40
            s = switch_index(c.weight_versions, v)
            switches.add(s)
            assert 0 < s < 40
            expected = fresh(prompt + c.token_ids[:s], 40 - s)
            assert c.token_ids[s:] == expected.token_ids
            assert_logprobs_close(c.logprobs[s:], expected.logprobs)
    assert len(switches) == 1


async def retract_into_a_pool_of(engine, gate, blocks: int, monkeypatch):
    """At the gate's step boundary: pause("retract"), sleep, wake(allow_resize=True) into a pool of `blocks`
    blocks (the device's free memory made to be just that), continue."""
    import rollout_engine.kv_cache as kv_cache_module
    pause, = await gate.at_boundary(engine.pause_generation("retract"))
    await pause
    await engine.sleep(1)
    room = engine.engine.kv.planner.total_bytes(blocks)
    monkeypatch.setattr(kv_cache_module, "available_bytes", lambda device: room)
    await engine.wake(allow_resize=True)
    monkeypatch.undo()
    await engine.continue_generation()


def test_a_retracted_request_longer_than_a_shrunk_pool_ends_by_length(ckpt, monkeypatch):
    """pause("retract"), sleep, then wake(allow_resize=True) into a pool of 4 blocks (64 tokens): the retracted
    request, already longer than that, ends with "length" and its tokens (Engine.wake's contract), and the
    engine serves on (no step is run for a sequence no pool of this size can hold)."""
    prompt = make_prompts([9], seed=16)[0]

    async def main(engine):
        gate = StepGate(engine, hold_at=80)
        caller = asyncio.ensure_future(engine.generate(prompt, SamplingParams(temperature=0, max_tokens=200,
                                                                              ignore_eos=True)))
        await retract_into_a_pool_of(engine, gate, 4, monkeypatch)
        long = await caller
        return long, await engine.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    with make_engine(ckpt) as engine:
        long, short = run(main(engine), timeout=60)
        assert engine.engine.scheduler.max_seq_len == 64
        assert_no_leak(engine)
    c = long.outputs[0]
    assert c.finish_reason == "length" and 64 <= len(prompt) + len(c.token_ids) < 9 + 200
    assert short.outputs[0].finish_reason == "length" and len(short.outputs[0].token_ids) == 8


def test_a_queued_n2_request_longer_than_a_shrunk_pool_ends_with_both_samples(ckpt, monkeypatch):
    """A request of n=2 still queued (one seat, taken) when a wake re-sizes the pool below its prompt: it ends
    with "length" and both samples (the second never split off), and its caller is answered."""
    short, long = make_prompts([9], seed=16)[0], make_prompts([70], seed=17)[0]

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        first = asyncio.ensure_future(engine.generate(short, SamplingParams(temperature=0, max_tokens=20,
                                                                            ignore_eos=True)))
        second = asyncio.ensure_future(engine.generate(long, SamplingParams(n=2, max_tokens=5, ignore_eos=True)))
        await retract_into_a_pool_of(engine, gate, 4, monkeypatch)
        return await first, await second

    with make_engine(ckpt, max_num_seqs=1) as engine:
        first, second = run(main(engine), timeout=60)
        assert_no_leak(engine)
    assert first.outputs[0].finish_reason == "length" and len(first.outputs[0].token_ids) == 20
    assert [(c.index, c.token_ids, c.finish_reason) for c in second.outputs] == [(0, [], "length"),
                                                                                 (1, [], "length")]


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_request_longer_than_a_shrunk_pool_behind_one_that_fits_ends_by_length(ckpt, monkeypatch, prefix_caching):
    """Two requests retracted into a pool of 4 blocks (64 tokens): the first fits, the second (a 70-token prompt)
    does not and waits behind it. Prefill chunks of 12 tokens would admit the second beside the first: it must
    end with "length", not run (it could never fit: preempted and re-admitted at every step, or, with the prefix
    cache holding its own blocks, a step of no sequences that fails every request)."""
    short, long = make_prompts([9], seed=16)[0], make_prompts([70], seed=17)[0]

    async def main(engine):
        gate = StepGate(engine, hold_at=1)
        first = asyncio.ensure_future(engine.generate(short, SamplingParams(temperature=0, max_tokens=20,
                                                                            ignore_eos=True)))
        second = asyncio.ensure_future(engine.generate(long, SamplingParams(temperature=0, max_tokens=5,
                                                                            ignore_eos=True)))
        await retract_into_a_pool_of(engine, gate, 4, monkeypatch)
        return await first, await second

    with make_engine(ckpt, max_num_batched_tokens=12, enable_prefix_caching=prefix_caching) as engine:
        first, second = run(main(engine), timeout=60)
        assert_no_leak(engine)
    assert first.outputs[0].finish_reason == "length" and len(first.outputs[0].token_ids) == 20
    assert second.outputs[0].finish_reason == "length" and len(long) + len(second.outputs[0].token_ids) >= 64


def test_pause_wait_returns_when_its_requests_end_by_abort(ckpt):
    """pause('wait') waits for the requests in flight; when an abort (of the last one, or a pause('abort'))
    ends them instead of a step, it returns too."""
    prompts = make_prompts([5, 11], seed=15)

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        caller = asyncio.ensure_future(engine.generate(prompts[0], GREEDY_LONG, request_id="last"))
        pause, abort = await gate.at_boundary(engine.pause_generation("wait"), engine.abort("last"))
        partial = await abort
        await asyncio.wait_for(pause, 5)
        assert await caller == partial
        await engine.continue_generation()

        gate = StepGate(engine, hold_at=3)
        caller = asyncio.ensure_future(engine.generate(prompts[1], GREEDY_LONG))
        waiting, aborting = await gate.at_boundary(engine.pause_generation("wait"), engine.pause_generation("abort"))
        await asyncio.wait_for(asyncio.gather(waiting, aborting), 5)
        second = await caller
        await engine.continue_generation()
        return partial, second, await engine.generate(prompts[1], GREEDY_LONG)

    with make_engine(ckpt) as engine:
        partial, second, after = run(main(engine), timeout=20)
        assert_no_leak(engine)
    for out in (partial, second):
        assert out.outputs[0].finish_reason == "abort" and 0 < len(out.outputs[0].token_ids) < 40
    assert after.outputs[0].token_ids[: len(second.outputs[0].token_ids)] == second.outputs[0].token_ids


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_a_wait_pause_whose_requests_a_later_pause_holds_says_so(ckpt, mode):
    """pause('wait') waits for the requests in flight to finish; a second caller's 'keep' or 'retract' pause
    holds them instead, so the first caller is told (EngineError) rather than left waiting until a continue.
    The engine stays paused in the later mode, and the held request finishes after continue_generation."""
    prompt = make_prompts([7], seed=17)[0]

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        caller = asyncio.ensure_future(engine.generate(prompt, GREEDY_LONG))
        waiting, holding = await gate.at_boundary(engine.pause_generation("wait"), engine.pause_generation(mode))
        await asyncio.wait_for(holding, 5)
        with pytest.raises(EngineError, match=f"pause_generation\\('{mode}'\\) holds"):
            await asyncio.wait_for(waiting, 5)
        await asyncio.sleep(0.05)
        assert not caller.done()  # still held
        await engine.continue_generation()
        return await caller, await engine.generate(prompt, GREEDY_LONG)

    with make_engine(ckpt) as engine:
        held, plain = run(main(engine), timeout=20)
        assert_no_leak(engine)
    assert held.outputs[0].token_ids == plain.outputs[0].token_ids and len(plain.outputs[0].token_ids) == 40


def test_requests_held_while_asleep_fail_clearly_at_continue(ckpt):
    """Requests submitted while paused and asleep are refused at continue_generation (stream consumers
    too: they raise instead of waiting forever); after wake the engine serves again."""
    prompt = make_prompts([6], seed=16)[0]

    async def consume(engine):
        return [snap async for snap in engine.stream(prompt, GREEDY_LONG)]

    async def main(engine):
        await engine.pause_generation("retract")
        await engine.sleep(1)
        held = [asyncio.ensure_future(engine.generate(prompt, GREEDY_LONG)), asyncio.ensure_future(consume(engine))]
        await asyncio.sleep(0.01)
        await engine.continue_generation()
        results = await asyncio.wait_for(asyncio.gather(*held, return_exceptions=True), 5)
        await engine.wake()
        return results, await engine.generate(prompt, GREEDY_LONG)

    with make_engine(ckpt) as engine:
        results, after = run(main(engine), timeout=20)
        assert_no_leak(engine)
    assert all(isinstance(r, EngineError) and "asleep" in str(r) for r in results), results
    assert len(after.outputs[0].token_ids) == 40


def test_sleep_with_queued_requests_waits_for_wake(ckpt, hf_checkpoint):
    """A request queued (not paused) when sleep comes holds no KV yet, so sleep is allowed: the request waits
    for wake and then runs, instead of stepping an engine whose pool and weights are released."""
    prompt = make_prompts([6], seed=12)[0]
    weights = hf_checkpoint("qwen3")[1].state_dict()  # the same values: only the version moves
    entered, release = threading.Event(), threading.Event()

    def blocking_update():  # holds the loop thread inside a command while the next commands queue up
        entered.set()
        release.wait(30)
        yield from weights.items()

    async def main(engine):
        expected = await engine.generate(prompt, GREEDY_LONG)
        update = asyncio.ensure_future(engine.update_weights(blocking_update()))
        while not entered.is_set():
            await asyncio.sleep(0.001)
        caller = asyncio.ensure_future(engine.generate(prompt, GREEDY_LONG))
        await asyncio.sleep(0)
        sleep = asyncio.ensure_future(engine.sleep(1))
        await asyncio.sleep(0)
        release.set()  # the loop runs: update, submit, sleep, with no step between them
        await update
        await sleep
        await asyncio.sleep(0.02)
        assert engine.engine.is_sleeping and not caller.done()
        await engine.wake()
        return expected, await caller

    with make_engine(ckpt) as engine:
        expected, got = run(main(engine))
        assert_no_leak(engine)
    v = expected.outputs[0].weight_versions[0]
    assert got.outputs[0].weight_versions == [v + 1] * 40
    assert got.outputs[0].token_ids == expected.outputs[0].token_ids
    assert got.outputs[0].logprobs == expected.outputs[0].logprobs


# ---------------------------------------------------------------------------------------------- 5


@pytest.mark.parametrize("entry", ["generate", "stream"])
def test_a_caller_cancelled_before_its_submit_ran_leaves_nothing_running(ckpt, hf_checkpoint, entry):
    """The loop thread is busy (a slow update) when a caller gives up: its submit still runs later, and is then
    aborted, so nothing runs for nobody and its request id is free again. A second caller whose submit is
    refused (its id already in flight) and who is cancelled aborts nothing of the first's."""
    prompt = make_prompts([6], seed=14)[0]
    weights = hf_checkpoint("qwen3")[1].state_dict()
    entered, release = threading.Event(), threading.Event()

    def blocking_update():
        entered.set()
        release.wait(30)
        yield from weights.items()

    async def consume(request_id):
        if entry == "generate":
            return await engine.generate(prompt, GREEDY_LONG, request_id=request_id)
        async for out in engine.stream(prompt, GREEDY_LONG, request_id=request_id):
            last = out
        return last

    async def main():
        update = asyncio.ensure_future(engine.update_weights(blocking_update()))
        while not entered.is_set():
            await asyncio.sleep(0.001)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(consume("x"), 0.05)
        release.set()
        await update
        # queued after the submit and its abort, so both have run: nothing is left to abort
        assert await engine.abort("x") is None
        first = asyncio.ensure_future(consume("y"))
        await asyncio.sleep(0.01)
        duplicate = asyncio.ensure_future(consume("y"))
        with pytest.raises(ValueError, match="already in flight"):
            await duplicate
        return await first, await consume("x")

    with make_engine(ckpt) as engine:
        first, again = run(main())
        assert_no_leak(engine)
    for out in (first, again):
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


class Boom(RuntimeError):
    pass


class Fatal(BaseException):  # what the loop thread cannot go on after (as KeyboardInterrupt, SystemExit)
    pass


@pytest.mark.parametrize("error", [Boom, Fatal, EngineDeadError])
def test_a_failed_step_fails_its_callers_and_only_a_fatal_one_stops_the_loop(ckpt, error):
    """A step that raises an Exception ends the requests in flight (an EngineError whose cause it is) and answers
    the "wait" pause that waited on them; the engine then serves new requests as a fresh one would. A
    BaseException, or EngineDeadError (a tensor-parallel worker gone: nothing can run any more, and a server
    must report itself down), stops the loop: every pending caller gets it (a BaseException as the cause of an
    EngineError), and every later call an EngineError (an EngineDeadError after one)."""
    prompts = make_prompts([5, 9, 12], seed=13)

    async def consume(engine):
        return [snap async for snap in engine.stream(prompts[2], GREEDY_LONG)]

    async def main(engine):
        gate = StepGate(engine, hold_at=3)
        inner, calls = engine.engine.loop.step, []

        def failing_step():  # the 4th step raises, after the loop was held at the 3rd
            calls.append(1)
            if len(calls) == 4:
                raise error("the step broke")
            return inner()

        engine.engine.loop.step = failing_step
        pending = [asyncio.ensure_future(engine.generate(p, GREEDY_LONG)) for p in prompts[:2]]
        pending += await gate.at_boundary(consume(engine), engine.pause_generation("wait"))
        results = await asyncio.gather(*pending, return_exceptions=True)
        later = []
        for call in (lambda: engine.continue_generation(), lambda: engine.generate(prompts[0], GREEDY_LONG),
                     lambda: engine.pause_generation("keep"), lambda: engine.continue_generation(),
                     lambda: consume(engine)):
            try:
                later.append(await call())
            except Exception as err:  # noqa: BLE001
                later.append(err)
        return results, later

    with make_engine(ckpt) as engine:
        results, later = run(main(engine), timeout=20)
        running = engine.is_running
        if error is Boom:
            assert_no_leak(engine)
    assert len(results) == 4
    if error is EngineDeadError:
        assert all(isinstance(r, error) and str(r) == "the step broke" for r in results), results
    if error is Fatal:  # an EngineError caused by it: raised as it is, it would end the callers' event loops
        assert all(isinstance(r, EngineError) and isinstance(r.__cause__, Fatal) and "the step broke" in str(r)
                   for r in results), results
    if error is not Boom:
        assert all(isinstance(err, EngineError) and isinstance(err.__cause__, error) for err in later), later
        # a dead engine's later calls say so, as its in-flight ones did: a trainer catches one error to rebuild it
        assert all(isinstance(err, EngineDeadError) == (error is EngineDeadError) for err in later), later
        assert not running
        return
    assert running
    *failed, paused = results
    assert all(isinstance(r, EngineError) and isinstance(r.__cause__, Boom) for r in failed), results
    assert paused is None  # the "wait" pause is answered: nothing is in flight any more
    reference = Engine(ckpt, device="cpu", kv_cache_memory=KV).generate(prompts[0], GREEDY_LONG, use_tqdm=False)[0]
    assert later[1].outputs[0].token_ids == reference.outputs[0].token_ids
    assert later[0] is later[2] is later[3] is None and later[4][-1].outputs[0].finish_reason == "length"


def test_shutdown_fails_requests_held_by_a_pause(ckpt):
    async def main(engine):
        await engine.pause_generation("keep")
        held = asyncio.ensure_future(engine.generate([1, 2, 3], GREEDY_LONG))
        await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown)
        with pytest.raises(EngineError):
            await held
        with pytest.raises(EngineError):
            await engine.generate([1, 2, 3], GREEDY_LONG)

    engine = make_engine(ckpt)
    try:
        run(main(engine), timeout=20)
    finally:
        engine.shutdown()



def test_a_stream_left_and_then_shut_down_logs_no_unread_error(ckpt, caplog):
    """A consumer that breaks out of a stream and then shuts the engine down: the request's error (the shutdown
    came before its abort ran) was logged as "Future exception was never retrieved"; nobody can read it."""
    async def main(engine):
        async for out in engine.stream([1, 2, 3], GREEDY_LONG):
            if len(out.outputs[0].token_ids) >= 2:
                break
        engine.shutdown()
        for _ in range(3):
            await asyncio.sleep(0.05)
            gc.collect()

    engine = make_engine(ckpt)
    try:
        with caplog.at_level("ERROR", logger="asyncio"):
            run(main(engine), timeout=20)
            gc.collect()
    finally:
        engine.shutdown()
    assert "never retrieved" not in caplog.text


# ---------------------------------------------------------------------------------------------- 6

FUZZ_RUNS, FUZZ_OPS = 50, 20


async def fuzz_run(engine, rng, weights, prompts, greedy_refs, version_weights):
    """FUZZ_OPS random operations, each in its own task, fired at random moments while the engine runs;
    then wake + continue_generation, and every task must resolve. A greedy sample produced by one weight
    version only must be a prefix of what those weights produce alone (`greedy_refs`)."""
    tasks, kinds, max_tokens, requests, updates = [], [], {}, {}, {}
    seen = collections.Counter()

    async def early_stop(prompt, params, stop_after, close):
        agen = engine.stream(prompt, params)
        got = 0
        async for _ in agen:
            got += 1
            if got >= stop_after:
                break
        if close:
            await agen.aclose()
        return got

    for i in range(FUZZ_OPS):
        op = rng.choices(["generate", "stream", "abort", "pause", "continue", "update", "sleep", "wake"],
                         [8, 3, 3, 2, 2, 1, 0.5, 0.5])[0]
        params = SamplingParams(n=rng.randint(1, 3), temperature=rng.choice([0, 1.0]), max_tokens=rng.randint(1, 8),
                                seed=rng.randrange(1000), ignore_eos=rng.random() < 0.7)
        prompt = rng.choice(prompts)
        if op == "generate":
            rid = f"g{i}-{rng.random()}"
            max_tokens[rid], requests[rid] = params.max_tokens, (tuple(prompt), params)
            coro = engine.generate(prompt, params, request_id=rid)
        elif op == "stream":
            coro = early_stop(prompt, params, rng.randint(1, 3), rng.random() < 0.5)
        elif op == "abort":
            coro = engine.abort(rng.choice(list(max_tokens) or ["none"]))
        elif op == "pause":
            coro = engine.pause_generation(rng.choice(["abort", "wait", "keep", "retract"]))
        elif op == "continue":
            coro = engine.continue_generation()
        elif op == "update":
            updates[i] = rng.randrange(2)
            coro = engine.update_weights(weights[updates[i]])
        elif op == "sleep":
            coro = engine.sleep(1)
        else:
            coro = engine.wake()
        tasks.append(asyncio.ensure_future(coro))
        kinds.append(op)
        await asyncio.sleep(rng.choice([0, 0, 0.0005, 0.002]))
    await asyncio.sleep(0)  # every task has queued its command
    await engine.wake()
    await engine.continue_generation()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    for i, result in enumerate(results):
        if i in updates and not isinstance(result, BaseException):
            version_weights[result] = updates[i]
    for op, result in zip(kinds, results):
        seen[op] += 1
        if isinstance(result, BaseException):
            # what may be refused: sleep while requests hold KV, anything while asleep, a "wait" pause that a
            # continue lifted, or a later "keep" / "retract" pause held, before its requests finished
            lifted = op == "pause" and ("lifted this 'wait' pause" in str(result)
                                        or "holds the requests this 'wait' pause waited for" in str(result))
            assert isinstance(result, EngineError) and (op in ("generate", "stream", "sleep", "update") or lifted), \
                (op, result)
            seen[f"{op} refused"] += 1
        elif op == "generate":
            assert len(result.outputs) == len({c.index for c in result.outputs})
            for c in result.outputs:
                assert c.finish_reason in ("stop", "length", "abort")
                assert len(c.token_ids) == len(c.logprobs) == len(c.weight_versions) <= max_tokens[result.request_id]
                assert c.finish_reason != "length" or len(c.token_ids) == max_tokens[result.request_id]
                assert c.weight_versions == sorted(c.weight_versions)
                seen[f"finish {c.finish_reason}"] += 1
                seen["spans an update"] += len(set(c.weight_versions)) > 1
                seen["partial"] += c.finish_reason == "abort" and 0 < len(c.token_ids)
                prompt, params = requests[result.request_id]
                if params.temperature == 0 and len(set(c.weight_versions)) == 1:
                    reference = greedy_refs[version_weights[c.weight_versions[0]], prompt]
                    assert c.token_ids == reference[: len(c.token_ids)], (c, reference)
                    seen["greedy checked"] += bool(c.token_ids)
    for _ in range(5000):  # a stream dropped without aclose is aborted by its finalizer, a little later
        if not engine.engine.loop.has_work():
            break
        await asyncio.sleep(0.001)
    await engine.flush_cache()  # a command: runs on the loop thread with nothing in flight
    assert_no_leak(engine)
    return seen


def test_fuzzed_interleavings_resolve_and_leak_nothing(hf_checkpoint, ckpt, new_ckpt):
    prompts = make_prompts([3, 8, 15, 31, 17], seed=14)
    weights = [dict(hf_checkpoint("qwen3")[1].state_dict()), new_ckpt[1]]
    greedy_refs = {}  # (weights index, prompt) -> greedy tokens of those weights alone, EOS ignored
    for w, path in enumerate((ckpt, new_ckpt[0])):
        outs = Engine(path, device="cpu", kv_cache_memory=KV).generate(
            prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        greedy_refs |= {(w, tuple(p)): o.outputs[0].token_ids for p, o in zip(prompts, outs)}
    seen = collections.Counter()
    with make_engine(ckpt, max_num_seqs=8) as engine:
        version_weights = {engine.weight_version: 0}
        for run_id in range(FUZZ_RUNS):
            rng = random.Random(1000 + run_id)
            try:
                seen += run(fuzz_run(engine, rng, weights, prompts, greedy_refs, version_weights), timeout=30)
            except BaseException as err:
                raise AssertionError(f"fuzz run {run_id} (seed {1000 + run_id}) failed: {err!r}") from err
    print(dict(seen))
    # not degenerate: requests completed, were cut short with tokens, and spanned weight updates
    assert seen["finish length"] >= 100 and seen["partial"] >= 10 and seen["spans an update"] >= 10, seen
    assert seen["greedy checked"] >= 100, seen
    assert sum(seen[op] for op in ("generate", "stream", "abort", "pause", "continue", "update", "sleep", "wake")) \
        == FUZZ_RUNS * FUZZ_OPS >= 1000


async def consume(stream):
    async for _ in stream:
        pass


@pytest.mark.parametrize("call", ["generate", "stream"])
def test_a_cancelled_caller_aborts_its_request(ckpt, call):
    """A generate() whose caller is cancelled (a client gone), or a stream whose consumer is cancelled while it
    waits for the next snapshot, is aborted within a step or two, instead of running to its max_tokens."""
    async def main(engine):
        loop, steps = engine.engine.loop, []
        step = loop.step
        loop.step = lambda: steps.append(1) or step()
        args = make_prompts([9], seed=21)[0], SamplingParams(max_tokens=400, ignore_eos=True)
        task = asyncio.ensure_future(engine.generate(*args) if call == "generate" else consume(engine.stream(*args)))
        while len(steps) < 5:
            await asyncio.sleep(0.001)
        task.cancel()
        at_cancel = len(steps)
        with pytest.raises(asyncio.CancelledError):
            await task
        while loop.has_work():
            await asyncio.sleep(0.001)
        return len(steps) - at_cancel

    with make_engine(ckpt) as engine:
        after = run(main(engine))
        assert after <= 3, f"the cancelled request ran {after} more steps"
        assert_no_leak(engine)


def blocked_source(pairs, started: threading.Event, release: threading.Event):
    """A weight source that holds the loop thread inside update_weights until `release` is set."""
    started.set()
    assert release.wait(30)
    yield from pairs


def test_an_update_cancelled_before_it_starts_never_runs(ckpt, new_ckpt, fresh):
    """An update_weights whose caller times out while it waits behind another command is withdrawn: the trainer
    that edits its tensors next (its optimizer step) finds the engine never read them, and no version lands late."""
    pairs = list(new_ckpt[1].items())
    started, release = threading.Event(), threading.Event()

    async def main(engine):
        v = engine.weight_version
        first = asyncio.ensure_future(engine.update_weights(blocked_source(pairs, started, release)))
        while not started.is_set():
            await asyncio.sleep(0.001)
        edited = {name: tensor.clone() for name, tensor in new_ckpt[1].items()}
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.update_weights(edited), 0.05)
        for tensor in edited.values():  # the trainer moves on
            tensor.mul_(-3.0)
        release.set()
        assert await first == v + 1
        await engine.stats()  # a command behind the withdrawn one: had it run, it would have run before this
        assert engine.weight_version == v + 1
        return await engine.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))

    with make_engine(ckpt) as engine:
        out = run(main(engine))
    assert out.outputs[0].token_ids == fresh([3, 4, 5], 8).token_ids


def test_an_update_cancelled_while_it_runs_returns_once_it_has_run(ckpt, new_ckpt, fresh):
    """Cancelled (a timeout) while the engine reads its tensors, update_weights raises only after the copy: until
    then the caller keeps waiting, so nothing edits a tensor the engine has yet to read; the version lands."""
    pairs = list(new_ckpt[1].items())
    started, release = threading.Event(), threading.Event()

    async def main(engine):
        v = engine.weight_version
        call = asyncio.ensure_future(asyncio.wait_for(
            engine.update_weights(blocked_source(pairs, started, release)), 0.05))
        while not started.is_set():
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.3)  # the timeout is long past
        waiting = not call.done()
        release.set()
        with pytest.raises(TimeoutError):
            await call
        assert engine.weight_version == v + 1
        out = await engine.generate([3, 4, 5], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        return waiting, out

    with make_engine(ckpt) as engine:
        waiting, out = run(main(engine))
    assert waiting, "the cancelled update returned while the engine was still reading its tensors"
    assert out.outputs[0].token_ids == fresh([3, 4, 5], 8).token_ids


def test_a_stream_cancelled_twice_while_it_closes_still_aborts_its_request(ckpt, new_ckpt):
    """A stream's consumer cancelled (a timeout), then cancelled again (its task group) while the stream's abort
    waits behind another command: the abort still runs, so the request stops and its id is free."""
    started, release = threading.Event(), threading.Event()

    async def main(engine):
        first = asyncio.Event()

        async def consume():
            async for _ in engine.stream([3, 4, 5], SamplingParams(max_tokens=1500, ignore_eos=True), request_id="job"):
                first.set()

        task = asyncio.ensure_future(consume())
        await first.wait()
        update = asyncio.ensure_future(engine.update_weights(blocked_source(list(new_ckpt[1].items()), started,
                                                                            release)))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        for _ in range(3):  # the stream's cleanup queues its abort behind the update
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.01)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        await update
        return await engine.generate([3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True), request_id="job")

    with make_engine(ckpt) as engine:
        out = run(main(engine))
        assert_no_leak(engine)
    assert len(out.outputs[0].token_ids) == 2


def test_a_pause_whose_caller_timed_out_while_it_was_queued_still_pauses(ckpt, new_ckpt):
    """pause_generation("wait") timed out while its command waited behind another: the engine pauses all the same
    (new requests are held until continue_generation), and the pause's end answers nobody, quietly."""
    started, release = threading.Event(), threading.Event()
    unretrieved = []

    async def main(engine):
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: unretrieved.append(context))
        running = asyncio.ensure_future(engine.generate([3, 4, 5], SamplingParams(max_tokens=300, ignore_eos=True)))
        await asyncio.sleep(0.05)
        update = asyncio.ensure_future(engine.update_weights(blocked_source(list(new_ckpt[1].items()), started,
                                                                            release)))
        while not started.is_set():
            await asyncio.sleep(0.001)
        asyncio.get_running_loop().call_later(0.2, release.set)  # the timed-out pause waits until it has run
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(engine.pause_generation("wait"), 0.05)
        await update
        held = asyncio.ensure_future(engine.generate([1, 2], SamplingParams(max_tokens=1)))
        await asyncio.sleep(0.3)
        was_held = not held.done()
        await engine.continue_generation()
        await held, await running
        gc.collect()
        await asyncio.sleep(0)
        return was_held

    with make_engine(ckpt) as engine:
        assert run(main(engine)), "the timed-out pause did not pause the engine"
    assert not unretrieved, unretrieved


def test_breaking_out_of_a_stream_frees_its_request_id_at_once(ckpt):
    """A `break` out of `async for ... in engine.stream(...)` aborts the request there and then: the next call may
    use the same request_id (the stream's generator alone would be closed a loop turn later, after that submit)."""
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def main(engine):
        async for _ in engine.stream([3, 4, 5], params, request_id="job-1"):
            break
        return await engine.generate([3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True), request_id="job-1")

    with make_engine(ckpt) as engine:
        out = run(main(engine))
        assert_no_leak(engine)
    assert out.request_id == "job-1" and len(out.outputs[0].token_ids) == 4


# ---------------------------------------------------------------------------------------------- 7: stream cost


def test_stream_snapshots_keep_their_fields_aligned_and_text_from_their_tokens(tiny_checkpoint):
    """n samples with top logprobs and stop strings: in every snapshot each sample's tokens, logprobs, top
    logprobs and weight versions have one entry per token; its text is what its own tokens decode to (a prefix
    of it: a split character or a possible stop string's start may be held back), and never ends in the
    start of a stop string while the sample runs; a finished sample shows its final text."""
    params = SamplingParams(n=3, temperature=1.2, max_tokens=50, seed=21, logprobs=2, stop=["e", " t"])

    async def main(engine):
        snapshots = [snap async for snap in engine.stream("a block of", params)]
        return snapshots, await engine.generate("a block of", params)

    with make_engine(tiny_checkpoint) as engine:
        snapshots, final = run(main(engine))
        tokenizer = engine.engine.tokenizer
        assert_no_leak(engine)
    check_stream(snapshots, final, tokenizer)
    assert any(c.finish_reason == "stop" for c in final.outputs)
    for snap in snapshots:
        assert snap.prompt_token_ids == final.prompt_token_ids and snap.prompt == final.prompt == "a block of"
        for c, f in zip(snap.outputs, final.outputs):
            assert len(c.token_ids) == len(c.logprobs) == len(c.top_logprobs) == len(c.weight_versions)
            if c.finish_reason is None:
                assert tokenizer.decode(c.token_ids, skip_special_tokens=True).startswith(c.text)
                assert not c.text.endswith(("e", " ")), c.text
            else:
                assert c.text == f.text


def count_decodes(tokenizer):
    """Wrap `tokenizer.decode`: returns {thread name: [tokens per call]}."""
    calls, decode = collections.defaultdict(list), tokenizer.decode

    def counted(ids, *args, **kwargs):
        calls[threading.current_thread().name].append(len(ids))
        return decode(ids, *args, **kwargs)

    tokenizer.decode = counted
    return calls


def test_a_stream_is_detokenized_incrementally_by_its_consumer(tiny_checkpoint):
    """The loop thread decodes nothing for a stream's snapshots (only each sample's final text, once), and its
    consumer decodes a short window per step: tokens decoded in all grow linearly with the output, where one
    whole decode per snapshot would be quadratic (~n * 100^2 / 2 here)."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=100, seed=4, ignore_eos=True)

    async def main(engine):
        calls = count_decodes(engine.engine.tokenizer)
        snapshots = [snap async for snap in engine.stream("the model 12+3=", params)]
        return calls, snapshots

    with make_engine(tiny_checkpoint) as engine:
        calls, snapshots = run(main(engine))
        del engine.engine.tokenizer.decode
        assert_no_leak(engine)
    final = snapshots[-1]
    check_stream(snapshots, final, engine.engine.tokenizer)
    tokens = sum(len(c.token_ids) for c in final.outputs)
    assert tokens == 200 and len(snapshots) > 50
    assert calls["rollout-engine-loop"] == [100, 100]  # the final output's text, once per sample
    consumer = calls[threading.current_thread().name]
    assert len(consumer) >= len(snapshots) and sum(consumer) <= 6 * tokens, (len(consumer), sum(consumer))


def test_a_slow_consumer_gets_one_wake_up_and_every_token_in_its_next_snapshot(ckpt):
    """While a stream's consumer does not read, the loop thread sends it at most one wake-up whatever the
    number of steps (a slow consumer costs the loop nothing per step); the snapshot it takes next carries
    every token generated meanwhile, and the stream still ends with generate()'s output."""
    params = SamplingParams(temperature=1.0, max_tokens=200, seed=3, ignore_eos=True)
    prompt = make_prompts([7], seed=22)[0]

    async def main(engine):
        event_loop, steps = asyncio.get_running_loop(), []
        step = engine.engine.loop.step
        engine.engine.loop.step = lambda: steps.append(1) or step()
        calls, call_soon_threadsafe = [], event_loop.call_soon_threadsafe
        event_loop.call_soon_threadsafe = lambda *a: calls.append(a) or call_soon_threadsafe(*a)
        stream = engine.stream(prompt, params)
        first = await stream.__anext__()
        calls.clear()
        at = len(steps)
        while len(steps) < at + 20:  # the consumer reads nothing for 20 steps
            await asyncio.sleep(0.001)
        wakes = len(calls)
        second = await stream.__anext__()
        rest = [snap async for snap in stream]
        del event_loop.call_soon_threadsafe
        return first, second, rest, wakes, await engine.generate(prompt, params)

    with make_engine(ckpt) as engine:
        first, second, rest, wakes, final = run(main(engine))
        assert_no_leak(engine)
    assert wakes <= 1
    assert len(second.outputs[0].token_ids) >= len(first.outputs[0].token_ids) + 19
    check_stream([first, second] + rest, final)


def test_streaming_a_resumed_request_starts_from_its_tokens(ckpt):
    """stream() of an aborted output: every snapshot's samples begin with the tokens the output had (also the
    sample that had finished), and the stream ends with what an uninterrupted request gives (params.seed)."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=30, seed=8, logprobs=0)
    prompt = make_prompts([11], seed=23)[0]

    async def main(engine):
        whole = await engine.generate(prompt, params)
        gate = StepGate(engine, hold_at=6)
        caller = asyncio.ensure_future(engine.generate(prompt, params, request_id="cut"))
        abort, = await gate.at_boundary(engine.abort("cut"))
        cut = await abort
        await caller
        return whole, cut, [snap async for snap in engine.stream(cut, params)]

    with make_engine(ckpt) as engine:
        whole, cut, snapshots = run(main(engine))
        assert_no_leak(engine)
    assert [c.finish_reason for c in cut.outputs] == ["abort", "abort"] and len(cut.outputs[0].token_ids) >= 5
    check_stream(snapshots, snapshots[-1])
    for snap in snapshots:
        for c, before in zip(snap.outputs, cut.outputs):
            assert c.token_ids[: len(before.token_ids)] == before.token_ids
            assert c.logprobs[: len(before.logprobs)] == before.logprobs
    for c, w in zip(snapshots[-1].outputs, whole.outputs):
        assert c.token_ids == w.token_ids and c.finish_reason == w.finish_reason


def test_an_spmd_process_group_is_refused_before_any_engine_is_built(ckpt):
    """Requests reach an AsyncEngine at each caller's pace, so SPMD ranks (which must make the same calls in the
    same order) would drift: the argument is refused by name, before the collective Engine construction."""
    with pytest.raises(ValueError, match="process_group is not allowed for AsyncEngine"):
        AsyncEngine(ckpt, device="cpu", process_group=object())


class SeemsOpenLoop(asyncio.SelectorEventLoop):
    """An event loop that says it is open, after it closed, while `seems_open`: a thread that checks is_closed()
    before call_soon_threadsafe finds it open, as when the loop closes between the check and the call."""
    seems_open = True

    def is_closed(self):
        return super().is_closed() and not self.seems_open


def test_a_caller_whose_event_loop_closed_loses_only_its_own_answer(ckpt):
    """A caller thread's event loop may close (its asyncio.run ended on a timeout) while the loop thread answers
    it, after any check that it is open: that answer is dropped, and the engine goes on serving the others. Here
    the loop thread is held after a step while the caller is cancelled (its abort queued) and its loop closed."""
    prompt = make_prompts([6], seed=24)[0]

    async def cut_short(engine, gate):
        caller = asyncio.ensure_future(engine.generate(prompt, GREEDY_LONG))
        await gate.wait()  # its request is in flight
        caller.cancel()    # the caller is gone: its abort answers on this loop once it has closed
        with pytest.raises(asyncio.CancelledError):
            await caller

    with make_engine(ckpt) as engine:
        gate = StepGate(engine, hold_at=1)
        with asyncio.Runner(loop_factory=SeemsOpenLoop) as runner:
            event_loop = runner.get_loop()
            runner.run(asyncio.wait_for(cut_short(engine, gate), 60))
        try:
            gate.released.set()
            out = run(engine.generate(prompt, GREEDY_LONG))
            running = engine.is_running
        finally:
            event_loop.seems_open = False
        assert_no_leak(engine)
    assert running
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


def test_an_async_engine_dropped_without_shutdown_is_freed_with_its_loop_thread(ckpt):
    """Its loop thread holds nothing of the AsyncEngine: dropped without shutdown() after serving a request, the
    AsyncEngine and its Engine (weights, KV pool) are freed and the thread exits."""
    before = set(threading.enumerate())
    engine = make_engine(ckpt)
    thread, = [t for t in threading.enumerate() if t not in before and t.name == "rollout-engine-loop"]
    out = run(engine.generate(make_prompts([5], seed=25)[0], SamplingParams(max_tokens=4, ignore_eos=True)))
    assert len(out.outputs[0].token_ids) == 4
    refs = weakref.ref(engine), weakref.ref(engine.engine)
    del engine
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        gc.collect()  # the Engine goes with its loop thread's state, in which RequestControl's hooks make cycles
        if all(ref() is None for ref in refs) and not thread.is_alive():
            break
        time.sleep(0.05)
    assert [ref() is None for ref in refs] == [True, True]
    assert not thread.is_alive()


def test_automatic_ids_never_collide_and_abort_checks_its_id(ckpt):
    """request_id=None draws an id that no id a caller chose collides with (callers' "request-0".. in flight made
    the next automatic ids duplicates, refused though their callers did nothing wrong); abort() of something that
    is not an id is a ValueError, not a TypeError or a silent None."""
    async def main(engine):
        await engine.pause_generation("keep")  # every request stays in flight until continue
        chosen = [asyncio.ensure_future(engine.generate([3, 4], GREEDY_LONG, request_id=f"request-{i}"))
                  for i in range(3)]
        await asyncio.sleep(0.01)
        auto = [asyncio.ensure_future(engine.generate([3, 4], GREEDY_LONG)) for _ in range(3)]
        await asyncio.sleep(0.01)
        for bad in (["x"], {"a": 1}, 5, None, ""):
            with pytest.raises(ValueError, match="request_id="):
                await engine.abort(bad)
        await engine.continue_generation()
        return await asyncio.gather(*chosen), await asyncio.gather(*auto)

    with make_engine(ckpt) as engine:
        chosen, auto = run(main(engine))
        assert_no_leak(engine)
    assert [o.request_id for o in chosen] == ["request-0", "request-1", "request-2"]
    assert len({o.request_id for o in chosen + auto}) == 6
    assert all(o.outputs[0].token_ids == chosen[0].outputs[0].token_ids for o in chosen + auto)
