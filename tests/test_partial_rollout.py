"""Partial rollouts: generate() stops when its budget is spent (tokens, seconds, or a fraction of samples
finished), returns the unfinished samples as "abort" with what they have, and continues them when their
RequestOutput comes back as a prompt: same tokens as an uninterrupted run under the same weights, the new
weights' tokens after an update, max_tokens and stop strings over the whole sample."""
import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers import hf_greedy, make_prompts

from rollout_engine import Engine, SamplingParams

KW = dict(device="cpu", kv_cache_memory=64 << 20)
PARAMS = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=True)


def consistent(outs, params):
    """Every completion's tokens, logprobs and weight versions are equally long, within max_tokens."""
    for out in outs:
        assert sorted(c.index for c in out.outputs) == list(range(params.n))
        for c in out.outputs:
            assert len(c.token_ids) == len(c.logprobs) == len(c.weight_versions) <= params.max_tokens
            assert c.finish_reason == "abort" or len(c.token_ids) == params.max_tokens


def aborted(outs) -> int:
    return sum(c.finish_reason == "abort" for o in outs for c in o.outputs)


def tokens(outs) -> int:
    return sum(len(c.token_ids) for o in outs for c in o.outputs)


def until_done(engine, outs, params, **budget) -> tuple[list, int]:
    """Resume the outputs' "abort" samples, call after call, until none is left; (final outputs, calls)."""
    calls = 0
    while aborted(outs):
        outs = engine.generate(outs, params, use_tqdm=False, **budget)
        consistent(outs, params)
        calls += 1
    return outs, calls


@pytest.fixture(scope="module")
def ckpt(hf_checkpoint):
    return hf_checkpoint("qwen3")


def test_token_budget_stops_with_consistent_partials(ckpt):
    """3 prompts x 3 samples, 4 running at most (the others wait, some never start): the call stops once 30
    tokens are generated, collecting the step in flight (so at most two steps of 4 tokens past the budget)."""
    engine = Engine(ckpt[0], max_num_seqs=4, **KW)
    outs = engine.generate(make_prompts(), PARAMS, use_tqdm=False, token_budget=30)
    consistent(outs, PARAMS)
    assert 30 <= tokens(outs) <= 30 + 2 * 4
    assert aborted(outs) == 9  # none reached 24 tokens; the third prompt's samples never started
    assert [len(c.token_ids) for c in outs[2].outputs] == [0, 0, 0]
    assert not engine.scheduler.has_work() and engine.memory_stats()["kv_blocks_used"] == 0
    assert engine.generate(make_prompts(), PARAMS, use_tqdm=False)[2].outputs[2].finish_reason == "length"


def test_a_prompt_cut_part_way_through_its_scoring_has_no_prompt_logprobs_yet(ckpt):
    """prompt_logprobs holds one entry per prompt token or is None: a budget that ends the call while a long
    prompt is still being prefilled (16 tokens a step, beside a short one) returns None for it, and resuming
    scores it whole."""
    engine = Engine(ckpt[0], max_num_seqs=2, max_num_batched_tokens=16, **KW)
    prompts, params = make_prompts((10, 60)), SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=0)
    outs = engine.generate(prompts, params, use_tqdm=False, token_budget=1)
    assert len(outs[0].prompt_logprobs) == 10 and outs[1].prompt_logprobs is None
    assert outs[1].outputs[0].token_ids == []  # the premise: cut inside its prompt
    done, _ = until_done(engine, outs, params)
    assert [o.prompt_logprobs for o in done] == [o.prompt_logprobs for o in engine.generate(prompts, params)]


def test_finish_fraction_carries_the_longest_over(ckpt):
    """Five samples of lengths 4..40: with finish_fraction=0.8 the call stops when the fourth finishes (step
    16), so the longest comes back with 16 tokens plus at most the step launched ahead."""
    engine = Engine(ckpt[0], **KW)
    lengths = [4, 8, 12, 16, 40]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    outs = engine.generate(make_prompts((5, 6, 7, 8, 9)), params, use_tqdm=False, finish_fraction=0.8)
    got = [(len(o.outputs[0].token_ids), o.outputs[0].finish_reason) for o in outs]
    assert got[:4] == [(n, "length") for n in lengths[:4]]
    assert got[4][1] == "abort" and 16 <= got[4][0] <= 17


def test_the_smallest_finish_fraction_still_waits_for_one_sample(ckpt):
    """finish_fraction is in (0, 1]: however small, the call runs until one sample has finished."""
    engine = Engine(ckpt[0], **KW)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 30)]
    outs = engine.generate(make_prompts((5, 6)), params, use_tqdm=False, finish_fraction=1e-12)
    assert [o.outputs[0].finish_reason for o in outs] == ["length", "abort"]
    assert 3 <= len(outs[1].outputs[0].token_ids) <= 4


def test_time_budget(ckpt):
    engine = Engine(ckpt[0], **KW)
    params = SamplingParams(max_tokens=480, ignore_eos=True, seed=7)
    full = engine.generate(make_prompts((5,)), params, use_tqdm=False)
    # A budget spent by the first step: the call stops after it, however fast the machine runs that day (a
    # fraction of a timed run failed when a loaded machine slowed the timed run more than the budgeted one).
    out = engine.generate(make_prompts((5,)), params, use_tqdm=False, time_budget=1e-9)[0].outputs[0]
    assert out.finish_reason == "abort" and 1 <= len(out.token_ids) < 480
    assert out.token_ids == full[0].outputs[0].token_ids[: len(out.token_ids)]  # seeded: the same draws


def test_a_time_budget_gives_each_sample_being_prefilled_its_token_so_a_resuming_loop_advances(ckpt):
    """A trainer's loop: generate under a time budget, update the weights (which empties the prefix cache), resume.
    Each resume re-prefills the sample whole, here in 7 chunks of 16 tokens; a budget spent meanwhile stopped the
    call before its token, call after call, and the sample never advanced."""
    path, model = ckpt
    engine = Engine(path, max_num_batched_tokens=16, **KW)
    params = SamplingParams(max_tokens=5, ignore_eos=True, seed=1)
    out = engine.generate(make_prompts((100,)), params, use_tqdm=False, time_budget=1e-9)
    for call in range(1, 5):
        assert len(out[0].outputs[0].token_ids) == call  # a token a call: the budget is spent at once
        engine.update_weights((n, p.detach()) for n, p in model.named_parameters())
        out = engine.generate(out, params, use_tqdm=False, time_budget=1e-9)
    assert out[0].outputs[0].finish_reason == "length" and len(out[0].outputs[0].token_ids) == 5


def test_a_sample_that_does_not_run_in_the_resuming_call_keeps_its_prompt_weight_version(ckpt):
    """One seat: the resumed call's budget is spent before the second sample runs again; it comes back as it went,
    its prompt_weight_version (which weights computed its prompt's KV) too, not None ("never ran")."""
    engine = Engine(ckpt[0], max_num_seqs=1, **KW)
    params = SamplingParams(max_tokens=20, ignore_eos=True, seed=1)
    a, b = engine.generate(make_prompts((5, 6)), params, use_tqdm=False, token_budget=1)
    assert a.outputs[0].token_ids and a.outputs[0].prompt_weight_version == 0
    b2, a2 = engine.generate([b, a], params, use_tqdm=False, token_budget=1)
    assert a2.outputs[0].token_ids == a.outputs[0].token_ids and a2.outputs[0].prompt_weight_version == 0


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_resume_continues_exactly_as_an_uninterrupted_run(ckpt, prefix_caching):
    """Cut every few tokens (sampled at temperature 1, seeds from the engine's seed and the request id), resumed
    call after call: the tokens are bitwise an uninterrupted run's, the logprobs within fp32 rounding (the
    resumed prefix's last tokens go through a prefill instead of a decode), the request ids kept; with the prefix
    cache on, the resumed prefix is served from it."""
    prompts = make_prompts((5, 17, 40, 33))
    whole = Engine(ckpt[0], max_num_seqs=8, enable_prefix_caching=prefix_caching, **KW)
    ref = whole.generate(prompts, PARAMS, use_tqdm=False)
    engine = Engine(ckpt[0], max_num_seqs=8, enable_prefix_caching=prefix_caching, **KW)
    cut = engine.generate(prompts, PARAMS, use_tqdm=False, token_budget=60)
    assert aborted(cut) == 12
    outs = engine.generate(cut, PARAMS, use_tqdm=False, token_budget=20)
    hits = [16 * ((len(p) + len(before.outputs[0].token_ids) - 1) // 16) if prefix_caching else 0
            for p, before in zip(prompts, cut) if all(c.token_ids for c in before.outputs)]
    assert hits == [after.metrics["num_cached_tokens"] for before, after in zip(cut, outs)
                    if all(c.token_ids for c in before.outputs)]
    assert max(hits) > 0 or not prefix_caching
    outs, calls = until_done(engine, outs, PARAMS, token_budget=20)
    assert calls >= 3
    assert [o.request_id for o in outs] == [o.request_id for o in ref] == [0, 1, 2, 3]
    for got, want in zip(outs, ref):
        for g, w in zip(got.outputs, want.outputs):
            assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason == "length"
            torch.testing.assert_close(torch.tensor(g.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)
            assert g.weight_versions == w.weight_versions == [0] * 24


def test_resume_after_a_weight_update(hf_checkpoint):
    """Cut under version 0, update the weights, resume (greedy): the old tokens keep their logprobs and version
    0, the new ones are transformers' greedy continuation under the new weights (the prefix cache was flushed,
    so the old tokens' KV is the new weights'), with version 1."""
    path, _ = hf_checkpoint("qwen3")
    _, model_b = hf_checkpoint("qwen3", seed=1)
    engine = Engine(path, **KW)
    params = SamplingParams(n=2, temperature=0, max_tokens=20, ignore_eos=True, logprobs=True)
    prompts = make_prompts((5, 23))
    cut = engine.generate(prompts, params, use_tqdm=False, token_budget=24)
    consistent(cut, params)
    assert engine.update_weights((n, p.detach()) for n, p in model_b.named_parameters()) == 1
    outs = engine.generate(cut, params, use_tqdm=False)
    consistent(outs, params)
    for prompt, before, after in zip(prompts, cut, outs):
        assert after.metrics["num_cached_tokens"] == 0 and after.weight_version == 1
        for old, new in zip(before.outputs, after.outputs):
            k = len(old.token_ids)
            assert 0 < k < 20 and new.finish_reason == "length"
            assert new.token_ids[:k] == old.token_ids and new.logprobs[:k] == old.logprobs
            assert new.weight_versions == [0] * k + [1] * (20 - k)
            hf_tokens, hf_logprobs = hf_greedy(model_b, prompt + old.token_ids, 20 - k)
            assert new.token_ids[k:] == hf_tokens
            torch.testing.assert_close(torch.tensor(new.logprobs[k:]), hf_logprobs, atol=1e-4, rtol=0)


def test_new_prompts_join_the_resumed_ones(ckpt):
    """A trainer's next call: carried-over partials plus new prompts, in one batch; outputs in prompt order,
    the new requests with new ids, max_tokens over each whole sample (a resumed sample stops at 24 in all)."""
    engine = Engine(ckpt[0], max_num_seqs=8, **KW)
    cut = engine.generate(make_prompts((5, 17)), PARAMS, use_tqdm=False, token_budget=30)
    fresh = make_prompts((9, 11), seed=1)
    outs = engine.generate([fresh[0], cut[1], fresh[1], cut[0]], PARAMS, use_tqdm=False)
    consistent(outs, PARAMS)
    assert [o.request_id for o in outs] == [2, 1, 3, 0]
    assert [o.prompt_token_ids for o in outs] == [fresh[0], cut[1].prompt_token_ids, fresh[1], cut[0].prompt_token_ids]
    assert all(len(c.token_ids) == 24 and c.finish_reason == "length" for o in outs for c in o.outputs)
    again = engine.generate(outs[1], PARAMS, use_tqdm=False)[0]  # nothing to resume: returned as it was
    assert again.outputs == outs[1].outputs


def test_resume_keeps_finished_samples_and_counts_max_tokens_over_the_whole_sample(ckpt):
    engine = Engine(ckpt[0], **KW)
    params = [SamplingParams(n=2, max_tokens=n, ignore_eos=True, seed=3) for n in (6, 30)]
    cut = engine.generate(make_prompts((5, 6)), params, use_tqdm=False, finish_fraction=0.5)
    assert [c.finish_reason for o in cut for c in o.outputs] == ["length", "length", "abort", "abort"]
    outs = engine.generate(cut, params, use_tqdm=False)
    assert outs[0].outputs == cut[0].outputs
    assert [len(c.token_ids) for c in outs[1].outputs] == [30, 30]


def test_a_sample_that_stopped_before_the_cut_keeps_its_stop_reason(ckpt):
    """A finished sample comes back from a resume as it was, stop_reason (the stop token) included."""
    engine = Engine(ckpt[0], **KW)
    params = SamplingParams(n=8, temperature=1.0, max_tokens=40, stop_token_ids=list(range(40)), seed=1)
    cut = engine.generate(make_prompts((5,)), params, use_tqdm=False, finish_fraction=0.25)[0]
    stopped = [c for c in cut.outputs if c.finish_reason == "stop"]
    assert stopped and all(c.stop_reason == c.token_ids[-1] for c in stopped)
    out = engine.generate([cut], params, use_tqdm=False)[0]
    assert [out.outputs[c.index] for c in stopped] == stopped


def test_stop_string_across_the_resume_boundary(tiny_checkpoint):
    """A stop string whose first characters came before the cut and the rest after it ends the resumed sample
    there, text and tokens, as it ends an uninterrupted one (sampled with a seed: the tiny model's greedy text
    repeats one character)."""
    engine = Engine(tiny_checkpoint, device="cpu")
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=True, seed=5)
    base = engine.generate("12+34=", params, use_tqdm=False)[0].outputs[0]
    cut = engine.generate("12+34=", params, use_tqdm=False, token_budget=12)[0]
    k = len(cut.outputs[0].token_ids)
    boundary = len(tok.decode(base.token_ids[:k], skip_special_tokens=True))
    stop = base.text[boundary - 2 : boundary + 2]
    assert base.text.find(stop) == boundary - 2, "pick a cut whose stop string occurs first there"
    stopping = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=True, seed=5, stop=[stop])
    cut = engine.generate("12+34=", stopping, use_tqdm=False, token_budget=12)[0]
    assert cut.outputs[0].finish_reason == "abort" and len(cut.outputs[0].token_ids) == k
    out = engine.generate(cut, stopping, use_tqdm=False)[0].outputs[0]
    whole = engine.generate("12+34=", stopping, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == whole.finish_reason == "stop" and out.text == whole.text == base.text[: boundary - 2]
    assert out.stop_reason == whole.stop_reason == stop
    assert out.token_ids == whole.token_ids and len(out.logprobs) == len(out.weight_versions) == len(out.token_ids)


def test_a_resume_whose_stop_string_its_old_text_holds_is_refused(tiny_checkpoint):
    """Resumed with a stop string its tokens already hold (params other than its call's), a sample would be cut
    before its resume, tokens a trainer already saw: refused, and the engine serves on."""
    engine = Engine(tiny_checkpoint, device="cpu")
    params = SamplingParams(max_tokens=60, ignore_eos=True, logprobs=True, seed=5)
    cut = engine.generate("12+34=", params, use_tqdm=False, token_budget=12)[0]
    text = cut.outputs[0].text
    assert cut.outputs[0].finish_reason == "abort" and len(text) >= 3
    with pytest.raises(ValueError, match="holds the stop string"):
        engine.generate(cut, dataclasses.replace(params, stop=[text[1:3]]), use_tqdm=False)
    # its text dropped (a trainer that keeps ids only): the stop string would go unseen, so refused too
    textless = dataclasses.replace(cut, outputs=[dataclasses.replace(cut.outputs[0], text=None)])
    with pytest.raises(ValueError, match="completion 0 has no text and sampling_params.stop is set"):
        engine.generate(textless, dataclasses.replace(params, stop=[text[1:3]]), use_tqdm=False)
    assert engine.generate(textless, params, use_tqdm=False)[0].outputs[0].finish_reason == "length"  # no stop: fine
    out = engine.generate(cut, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and out.token_ids[: len(cut.outputs[0].token_ids)] == cut.outputs[0].token_ids


def test_resume_under_speculation(ckpt):
    """With a draft (the target itself), greedy: cut and resumed call after call, the tokens are an
    uninterrupted run's, and speculative steps ran."""
    engine = Engine(ckpt[0], draft_model=ckpt[0], num_speculative_tokens=3, **KW)
    params = SamplingParams(n=1, temperature=0, max_tokens=30, ignore_eos=True, logprobs=True)
    prompts = make_prompts((5, 17))
    ref = engine.generate(prompts, params, use_tqdm=False)
    outs, calls = until_done(engine, engine.generate(prompts, params, use_tqdm=False, token_budget=8), params,
                             token_budget=8)
    assert calls >= 3 and engine.stats()["spec_accepted"] > 0
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        torch.testing.assert_close(torch.tensor(got.outputs[0].logprobs), torch.tensor(want.outputs[0].logprobs),
                                   atol=1e-4, rtol=0)


@pytest.mark.parametrize("kwargs, arg", [
    (dict(token_budget=0), "token_budget"), (dict(token_budget=2.5), "token_budget"),
    (dict(token_budget=True), "token_budget"), (dict(time_budget=0), "time_budget"),
    (dict(time_budget=-1.0), "time_budget"), (dict(time_budget=math.inf), "time_budget"),
    (dict(time_budget="1"), "time_budget"), (dict(finish_fraction=0), "finish_fraction"),
    (dict(finish_fraction=1.5), "finish_fraction"), (dict(finish_fraction=math.nan), "finish_fraction"),
])
def test_bad_budgets_are_refused_and_the_engine_stays_usable(ckpt, kwargs, arg):
    engine = bad_engine(ckpt)
    with pytest.raises(ValueError, match=arg):
        engine.generate(make_prompts(), PARAMS, use_tqdm=False, **kwargs)
    assert not engine.scheduler.has_work()
    assert aborted(engine.generate(make_prompts(), PARAMS, use_tqdm=False)) == 0


def test_bad_resumes_are_refused_and_the_engine_stays_usable(ckpt):
    engine = bad_engine(ckpt)
    cut = engine.generate(make_prompts((5, 6)), PARAMS, use_tqdm=False, token_budget=12)

    def broken(change):
        out = engine.generate(make_prompts((5, 6)), PARAMS, use_tqdm=False, token_budget=12)[0]
        change(out)
        return out

    cases = [
        (broken(lambda o: o.outputs.pop()), PARAMS, "indices must be 0..2"),
        (broken(lambda o: o.outputs[1].logprobs.pop()), PARAMS, "equally long"),
        (broken(lambda o: o.outputs[1].token_ids.__setitem__(0, 10**6)), PARAMS, "token_ids must be"),
        (broken(lambda o: setattr(o.outputs[0], "finish_reason", "done")), PARAMS, "finish_reason"),
        (broken(lambda o: setattr(o.outputs[0], "logprobs", None)), PARAMS, "no logprobs"),
        # a finished sample is returned as it came: without logprobs, its output would hold NaN for them
        (broken(lambda o: (setattr(o.outputs[0], "finish_reason", "length"), setattr(o.outputs[0], "logprobs", None))),
         PARAMS, "no logprobs"),
        (cut[0], SamplingParams(n=3, max_tokens=2, ignore_eos=True), "max_tokens=2"),
        (cut[0], SamplingParams(n=2), "indices must be 0..1"),
        # what a trainer reads from the resumed output must be what the engine writes
        (broken(lambda o: setattr(o.outputs[1], "weight_versions", ["x"] * len(o.outputs[1].token_ids))), PARAMS,
         "weight_versions must be"),
        (broken(lambda o: setattr(o.outputs[1], "weight_versions", None)), PARAMS, "weight_versions must be"),
        (broken(lambda o: setattr(o.outputs[1], "logprobs", [3.0] * len(o.outputs[1].token_ids))), PARAMS,
         "logprobs must be"),
        (broken(lambda o: setattr(o.outputs[1], "logprobs", ["x"] * len(o.outputs[1].token_ids))), PARAMS,
         "logprobs must be"),
        (broken(lambda o: setattr(o, "outputs", None)), PARAMS, "list of CompletionOutput"),
        (broken(lambda o: [setattr(c, "index", c.index == 1) for c in o.outputs[:2]]), PARAMS, "indices must be"),
        (broken(lambda o: setattr(o.outputs[0], "prompt_weight_version", -1)), PARAMS, "prompt_weight_version"),
        # an unfinished sample cannot hold a token its sample stops at
        (broken(lambda o: o.outputs[0].token_ids.__setitem__(0, engine.cfg.eos_token_ids[0])),
         SamplingParams(n=3, temperature=1.0, max_tokens=24, logprobs=True), "would have stopped"),
        (cut[0], SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=True,
                                stop_token_ids=[cut[0].outputs[0].token_ids[0]]), "would have stopped"),
    ]
    for out, params, match in cases:
        with pytest.raises(ValueError, match=match):
            engine.generate([make_prompts((7,))[0], out], params, use_tqdm=False)
        assert not engine.scheduler.has_work()
    with pytest.raises(ValueError, match="more than once"):
        engine.generate([cut[0], cut[1], cut[0]], PARAMS, use_tqdm=False)
    twin = broken(lambda o: setattr(o, "request_id", np.int64(cut[0].request_id)))  # the same id, numpy's
    with pytest.raises(ValueError, match="more than once"):
        engine.generate([cut[0], twin], PARAMS, use_tqdm=False)
    outs, _ = until_done(engine, cut, PARAMS)
    assert tokens(outs) == 2 * 3 * 24


def test_an_unstarted_prompt_of_the_longest_length_resumes(ckpt):
    """A prompt of exactly max_seq_len tokens gets one token; cut before its prefill ran (no tokens), it resumes
    like a fresh prompt. It was refused as too long, and with it the whole call's other resumes. A sample that
    has tokens and reached that length is still refused: it ended by length."""
    engine = Engine(ckpt[0], max_num_seqs=1, max_model_len=32, **KW)
    prompts = make_prompts((5, 32))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=True)
    whole = engine.generate(prompts, params, use_tqdm=False)
    cut = engine.generate(prompts, params, use_tqdm=False, token_budget=1)
    assert [c.finish_reason for o in cut for c in o.outputs] == ["abort", "abort"] and cut[1].outputs[0].token_ids == []
    resumed = engine.generate(cut, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in resumed] == [o.outputs[0].token_ids for o in whole]
    assert len(resumed[1].outputs[0].token_ids) == 1 and resumed[1].outputs[0].finish_reason == "length"
    longer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    [full] = engine.generate(prompts[:1], longer, use_tqdm=False, token_budget=1)
    grown = 32 - 5 - len(full.outputs[0].token_ids)
    full.outputs[0].token_ids += [7] * grown
    full.outputs[0].weight_versions += full.outputs[0].weight_versions[-1:] * grown
    full.outputs[0].logprobs += [-1.0] * grown
    with pytest.raises(ValueError, match="hold 32 tokens; sequences hold at most 32"):
        engine.generate([full], longer, use_tqdm=False)


def test_a_bool_request_id_is_not_taken_for_an_engine_id(ckpt):
    """request_id True is 1 as a dict key: kept as an Engine's id, it would merge with request 1's samples."""
    engine = bad_engine(ckpt)
    params = SamplingParams(n=1, max_tokens=20, ignore_eos=True, seed=1)
    cut = engine.generate(make_prompts((5, 9)), params, use_tqdm=False, token_budget=4)
    flagged, numbered = copy.deepcopy(cut[1]), copy.deepcopy(cut[0])
    flagged.request_id, numbered.request_id = True, 1
    outs = engine.generate([flagged, numbered], params, use_tqdm=False)
    assert [len(o.outputs) for o in outs] == [1, 1]
    assert [len(o.prompt_token_ids) for o in outs] == [len(cut[1].prompt_token_ids), len(cut[0].prompt_token_ids)]
    assert all(len(o.outputs[0].token_ids) == 20 for o in outs)


@pytest.mark.parametrize("other_id", ["rollout-a", -1, True, 10**30])
@pytest.mark.parametrize("kept_id", [0, np.int64(0)])
def test_resumed_ids_kept_and_new_never_collide(ckpt, other_id, kept_id):
    """An output whose id an Engine keeps (an int >= 0, numpy's too) and one it renumbers (a string, a negative
    or a bool id, one past any Engine's count), resumed together on a fresh Engine: the renumbered one takes an id past the kept one, in
    whichever order they come, so neither collects the other's samples."""
    params = SamplingParams(n=2, temperature=1.0, max_tokens=10, ignore_eos=True)
    cut = bad_engine(ckpt).generate(make_prompts((3, 4)), params, use_tqdm=False, token_budget=4)
    renumbered, kept = copy.deepcopy(cut)
    renumbered.request_id, kept.request_id = other_id, kept_id
    engine = Engine(ckpt[0], **KW)
    outs = engine.generate([renumbered, kept], params, use_tqdm=False)
    assert [sorted(c.index for c in o.outputs) for o in outs] == [[0, 1], [0, 1]]
    assert [o.prompt_token_ids for o in outs] == [cut[0].prompt_token_ids, cut[1].prompt_token_ids]
    assert all(len(c.token_ids) == 10 for o in outs for c in o.outputs)
    later = engine.generate(make_prompts((3,)), params, use_tqdm=False)[0].request_id
    assert later == 2  # 0 kept, 1 the renumbered one's: the engine's count goes on from there


_engines = {}


def bad_engine(ckpt):
    if "bad" not in _engines:
        _engines["bad"] = Engine(ckpt[0], **KW)
    return _engines["bad"]


def test_async_engine_resumes_an_aborted_request(ckpt):
    """AsyncEngine: a request aborted mid-stream, passed back as the prompt, continues from its tokens; with
    params.seed set it draws what the uninterrupted request draws. A resumed request with nothing left to run
    is answered at once."""
    import asyncio

    from rollout_engine import AsyncEngine

    params = SamplingParams(n=2, max_tokens=40, ignore_eos=True, logprobs=True, seed=11)
    prompt = make_prompts((9,))[0]

    async def scenario(engine):
        whole = await engine.generate(prompt, params)
        stream = engine.stream(prompt, params, request_id="cut")
        async for snapshot in stream:
            if min(len(c.token_ids) for c in snapshot.outputs) >= 5:
                break
        cut = await engine.abort("cut")
        await stream.aclose()
        resumed = await engine.generate(cut, params, request_id="again")
        return whole, cut, resumed, await engine.generate(resumed, params)

    with AsyncEngine(ckpt[0], **KW) as engine:
        whole, cut, resumed, again = asyncio.run(asyncio.wait_for(scenario(engine), 60))
    assert aborted([cut]) == 2 and aborted([resumed]) == 0
    consistent([cut, resumed], params)
    assert resumed.request_id == "again" and again.outputs == resumed.outputs
    for w, r in zip(whole.outputs, resumed.outputs):
        assert r.token_ids == w.token_ids
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(w.logprobs), atol=1e-5, rtol=0)


def test_chat_takes_the_budget_and_generate_resumes_it(tiny_checkpoint):
    engine = Engine(tiny_checkpoint, device="cpu")
    engine.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    params = SamplingParams(max_tokens=30, ignore_eos=True, seed=2)
    conv = [{"role": "user", "content": "12+34="}]
    whole = engine.chat(conv, params, use_tqdm=False)[0].outputs[0]
    cut = engine.chat(conv, params, use_tqdm=False, token_budget=5)[0]
    assert cut.outputs[0].finish_reason == "abort" and 5 <= len(cut.outputs[0].token_ids) <= 6
    out = engine.generate(cut, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == whole.token_ids and out.text == whole.text and out.finish_reason == "length"


def test_a_resume_whose_prompt_its_carried_prompt_logprobs_do_not_score_is_refused(ckpt):
    """prompt_logprobs are carried over, never scored again: a prompt changed after the cut would be served with
    the old prompt's scores."""
    engine = Engine(ckpt[0], **KW)
    params = SamplingParams(n=2, max_tokens=8, ignore_eos=True, logprobs=1, prompt_logprobs=1, seed=1)
    cut = engine.generate(make_prompts((6,)), params, use_tqdm=False, token_budget=2)[0]
    edited = copy.deepcopy(cut)
    edited.prompt_token_ids = [(t + 1) % engine.cfg.vocab_size for t in cut.prompt_token_ids]
    with pytest.raises(ValueError, match=r"prompt_logprobs\[1\] does not score prompt_token_ids\[1\]"):
        engine.generate(edited, params, use_tqdm=False)
    out = engine.generate(cut, params, use_tqdm=False)[0]
    assert out.prompt_logprobs == cut.prompt_logprobs and all(c.finish_reason == "length" for c in out.outputs)


def test_resume_keeps_top_logprobs_and_prompt_logprobs(ckpt):
    """logprobs=k and prompt_logprobs=k: the resumed output's top alternatives cover every token (the old ones'
    as they were) and equal an uninterrupted run's; the prompt logprobs come back as the first call gave them."""
    params = SamplingParams(n=2, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=1, seed=4)
    prompts = make_prompts((7, 20))
    engine = Engine(ckpt[0], **KW)
    whole = engine.generate(prompts, params, use_tqdm=False)
    cut = engine.generate(prompts, params, use_tqdm=False, token_budget=10)
    outs = engine.generate(cut, params, use_tqdm=False)
    for before, after, want in zip(cut, outs, whole):
        assert after.prompt_logprobs == before.prompt_logprobs and len(after.prompt_logprobs) == len(after.prompt_token_ids)
        for old, new, w in zip(before.outputs, after.outputs, want.outputs):
            k = len(old.token_ids)
            assert new.token_ids == w.token_ids and len(new.top_logprobs) == 16 and new.top_logprobs[:k] == old.top_logprobs
            for got, ref in zip(new.top_logprobs, w.top_logprobs):
                assert list(got) == list(ref)
                torch.testing.assert_close(torch.tensor(list(got.values())), torch.tensor(list(ref.values())),
                                           atol=1e-5, rtol=0)
    seated = Engine(ckpt[0], max_num_seqs=2, **KW)  # the second request never starts before the budget is spent
    cut = seated.generate(prompts, params, use_tqdm=False, token_budget=2)
    assert [len(c.token_ids) for c in cut[1].outputs] == [0, 0] and len(cut[1].prompt_logprobs or []) < 20
    outs = seated.generate(cut, params, use_tqdm=False)
    assert outs[1].prompt_logprobs == whole[1].prompt_logprobs or all(
        list(g or {}) == list(w or {}) for g, w in zip(outs[1].prompt_logprobs, whole[1].prompt_logprobs))
    assert [c.token_ids for c in outs[1].outputs] == [c.token_ids for c in whole[1].outputs]
    broken = engine.generate(prompts[:1], params, use_tqdm=False, token_budget=4)[0]
    broken.prompt_logprobs = None
    with pytest.raises(ValueError, match="prompt_logprobs"):
        engine.generate(broken, params, use_tqdm=False)
    broken.prompt_logprobs, broken.outputs[0].top_logprobs = cut[0].prompt_logprobs, None
    with pytest.raises(ValueError, match="top_logprobs"):
        engine.generate(broken, params, use_tqdm=False)
