"""RequestControl alone (request_control.py), driven step by step on a tiny CPU engine: what AsyncEngine and
the server's engine process share: requests in flight and held, the pause modes, abort, sleep's refusal."""
import pytest

from rollout_engine import Engine, EngineAsleepError, EngineError, SamplingParams
from rollout_engine.request_control import PAUSE_MODES, ControlledRequest, RequestControl

KV = 16 << 20
PROMPTS = [[1, 5, 9, 13, 17], [2, 4, 6]]


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, n=n)


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3")[0]


class Owner:
    """Records every hook call, in order."""

    def __init__(self, engine: Engine):
        self.engine, self.events, self.grown = engine, [], {}

    def check(self, request):
        if not request.ids:
            raise ValueError("prompt is empty")

    def start(self, request):
        return self.engine.loop.submit(request.ids, request.params)

    def grew(self, pairs, done):
        for request, seq in pairs:
            self.grown.setdefault(request.key, []).append(seq.index)
        self.events.append(("grew", [request.key for request in done]))

    def ended(self, request, aborted):
        self.events.append(("ended", request.key, aborted))
        return ("answer", request.key)

    def refused(self, request, error):
        self.events.append(("refused", request.key, error))

    def idle(self, waiter, error=None):
        self.events.append(("idle", waiter) if error is None else ("idle", waiter, str(error)))

    def of(self, kind):
        return [e[1:] for e in self.events if e[0] == kind]


@pytest.fixture
def rig(ckpt):
    engine = Engine(ckpt, device="cpu", kv_cache_memory=KV)
    owner = Owner(engine)
    control = RequestControl(engine, check=owner.check, start=owner.start, grew=owner.grew, ended=owner.ended,
                             refused=owner.refused, idle=owner.idle)
    return engine, owner, control


def started(control: RequestControl, key: str, params: SamplingParams, steps: int, prompt=PROMPTS[0]):
    """A request submitted and run for `steps` steps."""
    request = ControlledRequest(key, params, ids=prompt)
    control.submit(request)
    for _ in range(steps):
        control.step()
    return request


def run_out(control: RequestControl, limit: int = 500) -> int:
    steps = 0
    while control.stepping():
        control.step()
        steps += 1
        assert steps < limit, "the control never ran out of work"
    return steps


def reference_tokens(engine: Engine, ids, params) -> list[list[int]]:
    out, = engine.generate([{"prompt_token_ids": ids}], params)
    return [c.token_ids for c in out.outputs]


def tokens(request) -> list[list[int]]:
    return [request.seqs[i].output_ids for i in range(request.params.n)]


def test_requests_run_to_their_end_once_each_and_are_forgotten(rig):
    engine, owner, control = rig
    a, b = ControlledRequest("a", greedy(6, n=2), ids=PROMPTS[0]), ControlledRequest("b", greedy(3), ids=PROMPTS[1])
    control.submit(a)
    control.submit(b)
    assert "a" in control and "b" in control and not control.held
    run_out(control)
    assert sorted(owner.of("ended")) == [("a", False), ("b", False)]
    assert "a" not in control and "b" not in control and not control.by_engine_id
    assert not engine.loop.has_work()
    # each request is reported done in exactly one collect, after every sample's growth
    done_lists = [keys for keys, in owner.of("grew") if keys]
    assert sorted(k for keys in done_lists for k in keys) == ["a", "b"]
    assert sorted(set(owner.grown["a"])) == [0, 1] and set(owner.grown["b"]) == {0}
    assert all(s.finish_reason == "length" for r in (a, b) for s in r.seqs.values())
    assert tokens(a) == reference_tokens(engine, PROMPTS[0], greedy(6, n=2))
    assert tokens(b) == reference_tokens(engine, PROMPTS[1], greedy(3))


def test_requests_submitted_while_paused_are_held_until_unpause(rig):
    engine, owner, control = rig
    assert control.pause("keep", "w") is True  # nothing in flight: answered now
    request = ControlledRequest("held", greedy(4), ids=PROMPTS[0])
    control.submit(request)
    assert "held" in control and control.held == [request] and request.first is None
    assert not engine.loop.has_work() and not control.stepping()
    control.unpause()
    assert control.mode is None and not control.held and request.first is not None
    run_out(control)
    assert owner.of("ended") == [("held", False)]
    assert tokens(request) == reference_tokens(engine, PROMPTS[0], greedy(4))


def test_bad_input_is_refused_at_submit_even_while_paused(rig):
    engine, owner, control = rig
    for mode in (None, "keep"):
        if mode is not None:
            control.pause(mode, None)
        with pytest.raises(ValueError, match="prompt is empty"):
            control.submit(ControlledRequest("bad", greedy(4), ids=[]))
        assert "bad" not in control and not control.held and not engine.loop.has_work()


def test_a_held_request_that_cannot_be_admitted_is_refused_at_unpause(rig):
    engine, owner, control = rig
    control.pause("abort", None)
    control.submit(ControlledRequest("late", greedy(4), ids=PROMPTS[0]))
    control.sleep(1, None)
    control.unpause()
    (key, error), = owner.of("refused")
    assert key == "late" and isinstance(error, EngineAsleepError)
    assert str(error) == "the engine is asleep; wake() before generating"
    assert "late" not in control and not control.held and not owner.of("ended")
    with pytest.raises(EngineAsleepError):  # not paused: refused at submit, and not kept
        control.submit(ControlledRequest("now", greedy(4), ids=PROMPTS[0]))
    assert "now" not in control
    engine.wake()
    control.submit(ControlledRequest("awake", greedy(2), ids=PROMPTS[0]))
    run_out(control)
    assert owner.of("ended") == [("awake", False)]


def test_abort_ends_a_running_request_with_its_samples_finished_abort(rig):
    engine, owner, control = rig
    request = started(control, "r", greedy(50, n=2), steps=4)
    assert control.abort("r") == ("answer", "r")
    assert owner.of("ended") == [("r", True)]
    assert sorted(request.seqs) == [0, 1] and all(s.finish_reason == "abort" for s in request.seqs.values())
    assert 0 < len(request.seqs[0].output_ids) < 50
    assert "r" not in control and not engine.loop.has_work() and not engine.scheduler.running
    assert control.abort("r") is None and control.abort("unknown") is None
    assert owner.of("ended") == [("r", True)]


def test_abort_of_a_request_that_the_step_in_flight_finishes_is_none(rig):
    engine, owner, control = rig
    request = ControlledRequest("r", greedy(12), ids=PROMPTS[0])
    control.submit(request)
    while not request.seqs or len(request.seqs[0].output_ids) < 11:
        control.step()
    assert engine.loop.launched is not None  # the step of the last token runs ahead: abort collects it first
    assert control.abort("r") is None
    assert owner.of("ended") == [("r", False)] and request.seqs[0].finish_reason == "length"
    assert len(request.seqs[0].output_ids) == 12


def test_pause_wait_is_answered_once_nothing_is_in_flight(rig):
    engine, owner, control = rig
    started(control, "r", greedy(6), steps=1)
    assert control.pause("wait", "w") is False and control.idle_waiters == ["w"]
    control.submit(ControlledRequest("later", greedy(2), ids=PROMPTS[1]))
    assert [r.key for r in control.held] == ["later"]
    run_out(control)  # "wait" lets the request in flight run out, and admits nothing new
    assert [e[0] for e in owner.events if e[0] != "grew"] == ["ended", "idle"]
    assert owner.of("idle") == [("w",)] and not control.idle_waiters
    assert "later" in control and not engine.loop.has_work()
    assert control.pause("wait", "w2") is True  # nothing in flight: answered now, no waiter kept
    control.answer_idle_waiters()
    assert owner.of("idle") == [("w",)]


def test_continue_answers_a_wait_pause_still_waiting_with_an_error(rig):
    """continue_generation lifts a "wait" pause whose requests are still in flight: its caller learns at once that
    the pause is over (it waited on under steady traffic, then returned as if the engine were paused)."""
    engine, owner, control = rig
    started(control, "r", greedy(6), steps=1)
    assert control.pause("wait", "w") is False
    control.unpause()
    assert owner.of("idle") == [("w", "continue_generation lifted this 'wait' pause before the requests in flight "
                                      "finished; generation goes on")]
    assert control.mode is None and not control.idle_waiters
    run_out(control)
    assert len(owner.of("idle")) == 1 and owner.of("ended") == [("r", False)]


def test_pause_abort_ends_every_request_held_ones_too(rig):
    engine, owner, control = rig
    started(control, "running", greedy(50), steps=2)
    control.pause("keep", None)
    control.submit(ControlledRequest("held", greedy(50), ids=PROMPTS[1]))
    assert control.pause("abort", None) is True
    assert sorted(owner.of("ended")) == [("held", True), ("running", True)]
    assert not control.requests and not control.held and not control.by_engine_id
    assert not engine.loop.has_work()


def test_sleep_is_refused_while_sequences_hold_kv_and_retract_frees_them(rig):
    engine, owner, control = rig
    request = started(control, "r", greedy(10, n=2), steps=3)
    control.pause("keep", None)
    assert not control.stepping() and engine.memory_stats()["kv_blocks_used"] >= 2
    with pytest.raises(EngineError, match=r"^2 sequences hold KV; pause_generation\('abort'\) or "
                                          r"pause_generation\('retract'\) before sleep$"):
        control.sleep(1, None)
    assert not engine.is_sleeping
    control.pause("retract", None)
    assert not engine.scheduler.running and engine.loop.has_work() and engine.memory_stats()["kv_blocks_used"] == 0
    control.sleep(1, None)
    assert engine.is_sleeping
    engine.wake()
    control.unpause()
    run_out(control)
    assert owner.of("ended") == [("r", False)]  # re-prefilled under the same weights: the same greedy tokens
    assert tokens(request) == reference_tokens(engine, PROMPTS[0], greedy(10, n=2))


def test_an_unknown_pause_mode_is_refused_and_changes_nothing(rig):
    engine, owner, control = rig
    with pytest.raises(ValueError, match=r"^mode='stop' is not allowed; one of \('abort', 'wait', 'keep', "
                                         r"'retract'\)$"):
        control.pause("stop", None)
    assert control.mode is None and PAUSE_MODES == ("abort", "wait", "keep", "retract")


def test_forget_all_hands_back_every_request_and_waiter_once(rig):
    engine, owner, control = rig
    started(control, "r", greedy(20), steps=1)
    control.pause("wait", "w")
    control.submit(ControlledRequest("held", greedy(20), ids=PROMPTS[1]))
    requests, waiters = control.forget_all()
    assert sorted(r.key for r in requests) == ["held", "r"] and waiters == ["w"]
    assert not control.requests and not control.held and not control.by_engine_id and not control.idle_waiters
    assert not owner.of("ended") and not owner.of("idle")


def test_a_retracted_prompt_is_scored_again_whole_under_the_new_weights(ckpt, hf_checkpoint):
    """prompt_logprobs of a prompt retracted half-prefilled (chunked) and updated before it runs again: every
    position is the new weights' (the prompt is re-prefilled whole), none left from the old ones."""
    new_path, new_model = hf_checkpoint("qwen3", seed=1)
    engine = Engine(ckpt, device="cpu", kv_cache_memory=KV, max_num_batched_tokens=8)
    owner = Owner(engine)
    control = RequestControl(engine, check=owner.check, start=owner.start, grew=owner.grew, ended=owner.ended,
                             refused=owner.refused, idle=owner.idle)
    prompt = list(range(3, 43))
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    request = started(control, "r", params, steps=2, prompt=prompt)  # 16 of 40 prompt tokens computed
    seq, = engine.scheduler.running
    assert 1 < len(seq.prompt_logprobs) < len(prompt)
    retract_update_and_check_scores(engine, control, new_path, new_model, seq, prompt, params)
    assert request.seqs[0] is seq


def retract_update_and_check_scores(engine, control, new_path, new_model, seq, prompt, params):
    """Pause with "retract", update to `new_model`, run out: seq's prompt_logprobs are all the new weights'."""
    control.pause("retract", None)
    engine.update_weights(new_model.state_dict().items())
    control.unpause()
    run_out(control)
    want, = Engine(new_path, device="cpu", kv_cache_memory=KV).generate([{"prompt_token_ids": prompt}], params)
    got = seq.prompt_logprobs
    assert len(got) == len(prompt) and got[0] is None
    for g, w in zip(got[1:], want.prompt_logprobs[1:]):
        assert g.keys() == w.keys() and all(abs(g[t] - w[t]) < 1e-5 for t in g)


def test_a_prompt_preempted_half_scored_and_then_retracted_is_scored_again_whole(ckpt, hf_checkpoint):
    """As above, but the scoring prompt was preempted part-way (a decoding request took its blocks) and waits
    when the pause comes: it is re-prefilled from position 0 under the new weights, so its positions scored
    before the preemption are the new weights' too (they kept the old ones' values)."""
    import random

    from rollout_engine.sequence import Status

    new_path, new_model = hf_checkpoint("qwen3", seed=1)
    rng = random.Random(0)
    long_prompt, scored = [rng.randrange(1, 250) for _ in range(100)], [rng.randrange(1, 250) for _ in range(80)]
    decode = SamplingParams(temperature=0, max_tokens=27, ignore_eos=True)
    score = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    for steps in range(7, 25):  # until the decoding request's next block preempts the half-scored prompt
        engine = Engine(ckpt, device="cpu", kv_cache_memory=8 * 16384, max_num_batched_tokens=16)
        owner = Owner(engine)
        control = RequestControl(engine, check=owner.check, start=owner.start, grew=owner.grew, ended=owner.ended,
                                 refused=owner.refused, idle=owner.idle)
        started(control, "a", decode, steps, prompt=long_prompt)
        request = started(control, "b", score, 0, prompt=scored)
        for _ in range(3):
            control.step()
            seq = request.first
            if seq.status is Status.WAITING and len(seq.prompt_logprobs) > 1:
                break
        else:
            continue
        break
    else:
        pytest.fail("no schedule preempted the prompt while it was being scored")
    retract_update_and_check_scores(engine, control, new_path, new_model, seq, scored, score)


@pytest.mark.parametrize("mode", ["keep", "retract"])
def test_prompt_weight_version_says_which_weights_computed_a_prompt_an_update_split(hf_checkpoint, mode):
    """An update lands while a 100-token prompt is part-way through its prefill (16 tokens a step). Under "keep"
    the rest of the prefill and every token run on the new weights over the old weights' first chunks: its tokens
    say version 1, its prompt_weight_version 0. Under "retract" it is re-prefilled: 1 and 1."""
    engine = Engine(hf_checkpoint("qwen3")[0], device="cpu", kv_cache_memory=KV, max_num_batched_tokens=16)
    owner = Owner(engine)
    control = RequestControl(engine, check=owner.check, start=owner.start, grew=owner.grew, ended=owner.ended,
                             refused=owner.refused, idle=owner.idle)
    request = started(control, "long", greedy(3), steps=2, prompt=list(range(1, 101)))
    assert not request.seqs and engine.memory_stats()["kv_blocks_used"] > 0  # the premise: inside its prefill
    control.pause(mode, None)
    engine.update_weights(hf_checkpoint("qwen3", seed=1)[1].state_dict().items())
    control.unpause()
    run_out(control)
    sample, = engine.loop.output(None, request.first, [request.seqs[0]], engine.weight_version).outputs
    assert sample.weight_versions == [1, 1, 1]
    assert sample.prompt_weight_version == (0 if mode == "keep" else 1)


def test_a_stream_snapshot_reports_the_prompt_weight_version_published_with_its_tokens():
    """A re-admitted sequence (after "retract" or a preemption) has no prompt_weight_version until its next step
    has run; a snapshot taken in between reports the one published with the tokens it holds, never None."""
    from rollout_engine.sequence import Sequence
    from rollout_engine.stream_snapshots import Snapshots, StreamFeed

    params = greedy(8)
    seq = Sequence(0, 0, [1, 2, 3, 4, 5], params, seed=0)
    seq.prompt_weight_version = 3
    seq.token_ids += [7, 8]
    seq.logprobs += [-1.0, -2.0]
    seq.weight_versions += [3, 3]
    feed, snapshots = StreamFeed(1), Snapshots(params, None)
    feed.publish(seq)
    seq.prompt_weight_version = None  # the loop thread re-admits it before the consumer takes the snapshot
    assert snapshots.take(feed)
    sample, = snapshots.output(0, None, seq, 3).outputs
    assert sample.token_ids == [7, 8] and sample.prompt_weight_version == 3
