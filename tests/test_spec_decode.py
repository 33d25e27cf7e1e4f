"""Speculative decoding on the CPU: same greedy tokens and logprobs, exact sampling distribution."""
import copy

import numpy as np
import pytest
import torch
from conftest import VOCAB
from helpers import make_prompts
from rollout_kernels.sampling import processed_probs_ref
from scipy.stats import chisquare

from rollout_engine import Engine, SamplingParams, WeightsNotReadyError
from rollout_engine.spec import NGRAM, SPEC_MAX_BATCH, NgramIndex

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(hf_checkpoint, tmp_path_factory):
    """A target, a badly matched draft (another random model) and a well matched one (target + noise)."""
    target_path, target = hf_checkpoint("qwen3", seed=0)
    bad_path, _ = hf_checkpoint("qwen3", seed=7)
    near = copy.deepcopy(target)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in near.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02 * p.std())
    near_path = tmp_path_factory.mktemp("near")
    near.save_pretrained(near_path)
    return target_path, target, bad_path, near_path


def spec_engine(target_path, draft_path, k=3, **kw):
    return Engine(target_path, device="cpu", kv_cache_memory=32 << 20, draft_model=draft_path,
                  num_speculative_tokens=k, **kw)


def test_greedy_tokens_and_logprobs_equal_plain_decoding(checkpoints):
    target_path, _, bad_path, _ = checkpoints
    plain = [o.outputs[0] for o in Engine(target_path, device="cpu", kv_cache_memory=32 << 20)
             .generate(make_prompts(), GREEDY)]
    for draft, k in [(bad_path, 3), (target_path, 2), (NGRAM, 3)]:
        engine = spec_engine(target_path, draft, k)
        may_launch_ahead, ahead = engine.spec_policy.launch_ahead, []
        engine.spec_policy.launch_ahead = lambda batch: ahead.append(may_launch_ahead(batch)) or ahead[-1]
        outs = engine.generate(make_prompts(), GREEDY)
        # a draft model's steps go before the last one is read, except near the end and at the end of a probe
        # (whose verdict decides the next step; both drafts here are too large to pay, so they probe only)
        assert any(ahead) if draft != NGRAM else not any(ahead)
        for out, ref in zip(outs, plain):
            assert out.outputs[0].token_ids == ref.token_ids
            # the target's logprobs, scored over k+1 positions instead of one: float32 rounding only
            np.testing.assert_allclose(out.outputs[0].logprobs, ref.logprobs, atol=1e-5)
        stats = engine.stats()
        assert stats["spec_steps"] > 0
        if draft == target_path:  # the draft is the target: every greedy proposal is accepted
            assert stats["spec_accepted"] == stats["spec_proposed"] and stats["mean_acceptance_length"] == k + 1
            assert sum(o.metrics["spec_accepted"] for o in outs) == stats["spec_accepted"]


@pytest.mark.parametrize("draft", ["target", NGRAM])
def test_one_token_prompts_decode_as_without_speculation(checkpoints, draft):
    """A one-token prompt's first step computes that token alone: a speculative step (which feeds the draft a
    sequence's two newest tokens) waits until it has two, alone or beside longer prompts."""
    target_path = checkpoints[0]
    prompts = [[7], [11, 12, 13, 14, 15], [9]]
    plain = Engine(target_path, device="cpu", kv_cache_memory=32 << 20).generate(prompts, GREEDY)
    engine = spec_engine(target_path, target_path if draft == "target" else NGRAM, 2)
    for batch in ([prompts[0]], prompts):
        outs = engine.generate(batch, GREEDY)
        assert [o.outputs[0].token_ids for o in outs] == [p.outputs[0].token_ids for p in plain[:len(batch)]]
    assert engine.stats()["spec_steps"] > 0


@pytest.mark.parametrize("draft", ["target", NGRAM])
@pytest.mark.parametrize("budget, lens, k", [(1, (5, 17, 40), 3), (4, (3, 6, 6, 9), 2)])
def test_one_token_prompt_chunks_are_prefill_not_a_speculative_step(checkpoints, draft, budget, lens, k):
    """A small max_num_batched_tokens (alone, or what the decodes leave) cuts a prompt into one-token chunks:
    every row of such a step computes one token, yet the chunk's prompt is not all in the KV pool. Speculating
    there gave other greedy tokens, or an index error; chunking alone changes no token."""
    target_path = checkpoints[0]
    prompts = make_prompts(lens)
    plain = Engine(target_path, device="cpu", kv_cache_memory=32 << 20).generate(prompts, GREEDY)
    engine = spec_engine(target_path, target_path if draft == "target" else NGRAM, k, max_num_batched_tokens=budget)
    outs = engine.generate(prompts, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [p.outputs[0].token_ids for p in plain]
    assert engine.stats()["spec_steps"] > 0


def test_a_sequence_that_stops_while_the_next_step_runs_ahead_loses_only_that_step(checkpoints):
    """Request 0 stops on a token mid-way; the step already launched for it is dropped, the others go on.
    Tokens, logprobs and finish reasons equal plain decoding's."""
    target_path, _, bad_path, _ = checkpoints
    prompts = make_prompts()
    plain_engine = Engine(target_path, device="cpu", kv_cache_memory=32 << 20)
    stop = plain_engine.generate(prompts[:1], GREEDY)[0].outputs[0].token_ids[9]
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop])] + [GREEDY] * 2
    plain = plain_engine.generate(prompts, params)
    outs = spec_engine(target_path, target_path, k=3).generate(prompts, params)
    assert plain[0].outputs[0].finish_reason == "stop" and len(plain[0].outputs[0].token_ids) <= 10
    for out, ref in zip(outs, plain):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert out.outputs[0].finish_reason == ref.outputs[0].finish_reason
        np.testing.assert_allclose(out.outputs[0].logprobs, ref.outputs[0].logprobs, atol=1e-5)


def test_steps_launched_ahead_stay_inside_max_model_len(checkpoints):
    """Full acceptance up to the model's length limit: no step, launched ahead or not, reaches a position
    past max_model_len, and the outputs equal plain decoding's."""
    target_path = checkpoints[0]
    prompts = make_prompts([5, 9, 13], seed=2)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    plain = Engine(target_path, device="cpu", kv_cache_memory=32 << 20, max_model_len=40).generate(prompts, long)
    outs = spec_engine(target_path, target_path, k=4, max_model_len=40).generate(prompts, long)
    for out, ref, prompt in zip(outs, plain, prompts):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        assert len(prompt) + len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_a_batch_too_large_to_speculate_decodes_plainly_then_speculates(checkpoints):
    """Above SPEC_MAX_BATCH sequences the engine decodes as without a draft (each step launched ahead);
    once enough of them finish, speculation resumes with the draft catching up. Same greedy tokens."""
    target_path, _, bad_path, _ = checkpoints
    prompts = make_prompts([4 + i % 7 for i in range(SPEC_MAX_BATCH + 8)], seed=5)
    params = [SamplingParams(temperature=0, max_tokens=3 if i < SPEC_MAX_BATCH else 20, ignore_eos=True)
              for i in range(len(prompts))]
    plain = Engine(target_path, device="cpu", kv_cache_memory=32 << 20, max_num_seqs=64).generate(prompts, params)
    engine = spec_engine(target_path, bad_path, k=3, max_num_seqs=64)
    schedule_ahead, ahead = engine.scheduler.schedule_ahead, []
    off = lambda: engine.spec_policy.stats()["spec_sequences_turned_off"]  # noqa: E731
    engine.scheduler.schedule_ahead = lambda batch: ahead.append((len(batch.seqs), off())) or schedule_ahead(batch)
    outs = engine.generate(prompts, params, use_tqdm=False)
    # plain steps launched ahead while the batch is too large, and again once the bad draft's probe turned all off
    assert ahead and all(n > SPEC_MAX_BATCH or turned_off == n for n, turned_off in ahead)
    for out, ref in zip(outs, plain):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        np.testing.assert_allclose(out.outputs[0].logprobs, ref.outputs[0].logprobs, atol=1e-5)
    assert engine.stats()["spec_steps"] > 0
    assert all(o.metrics["spec_proposed"] == 0 for o in outs[:SPEC_MAX_BATCH])  # they ended before it resumed


def second_token_distribution(model, ids, top_k=-1, top_p=1.0):
    """Exact marginal of the second sampled token at temperature 1: sum over t1 of p(t1) p(t2 | t1), each p
    the filtered distribution the engine samples from (rollout_kernels.sampling.processed_probs_ref)."""
    def probs(logits):
        rows = len(logits)
        return processed_probs_ref(logits.float(), torch.ones(rows), torch.full((rows,), top_k),
                               torch.full((rows,), top_p), torch.zeros(rows)).double()
    with torch.no_grad():
        first = probs(model(torch.tensor([ids])).logits[:, -1])[0]
        second = probs(model(torch.tensor([ids + [t] for t in range(VOCAB)])).logits[:, -1])
    return (first[:, None] * second).sum(0).numpy()


@pytest.mark.parametrize("draft", ["near", "bad", "ngram"])
def test_sampled_tokens_follow_the_target_distribution(checkpoints, draft):
    """Also for prompt lookup, whose proposals are certain (one-hot): kept with probability p(x)."""
    target_path, target, bad_path, near_path = checkpoints
    # prompt lookup proposes only after a token the prompt holds: a long prompt makes that likely
    ids = make_prompts([64 if draft == "ngram" else 6], seed=4)[0]
    expected = second_token_distribution(target, ids)
    engine = spec_engine(target_path, {"near": near_path, "bad": bad_path, "ngram": NGRAM}[draft], k=3, max_num_seqs=32)
    assert_second_tokens_follow(engine, ids, expected, SamplingParams(n=30, temperature=1.0, max_tokens=2,
                                                                      ignore_eos=True))
    if draft == "near":
        assert engine.stats()["spec_accepted"] > engine.stats()["spec_proposed"] / 3  # the draft does help


@pytest.mark.parametrize("filters", [dict(top_k=12), dict(top_p=0.7)])
def test_filtered_samples_follow_the_filtered_target_distribution(checkpoints, filters):
    """top-k / top-p under speculation (the eager path of the same passes): the draft and the target both
    draw from their filtered distributions, and the tokens follow the target's."""
    target_path, target, _, near_path = checkpoints
    ids = make_prompts([6], seed=4)[0]
    engine = spec_engine(target_path, near_path, k=3, max_num_seqs=32)
    assert_second_tokens_follow(engine, ids, second_token_distribution(target, ids, **filters),
                                SamplingParams(n=30, temperature=1.0, max_tokens=2, ignore_eos=True, **filters))


def assert_second_tokens_follow(engine, ids, expected, params):
    # 100 requests of 30 samples: each request's samples decode together, so every second token is
    # emitted by a speculative step (the first comes from the prompt's logits).
    requests, n = 100, params.n
    draws = requests * n
    outs = engine.generate([ids] * requests, params, use_tqdm=False)
    assert engine.stats()["spec_proposed"] == engine.num_speculative_tokens * draws
    obs = np.bincount([c.token_ids[1] for o in outs for c in o.outputs], minlength=VOCAB)
    exp = np.asarray(expected, dtype=np.float64)
    exp = exp / exp.sum() * draws  # scipy wants equal sums to 1.5e-8; a float32 distribution sums to 1 +- 1e-7
    small = exp < 5  # pool sparse bins so the chi-square approximation holds; fixed seed, alpha = 1e-3
    exp, obs = np.append(exp[~small], exp[small].sum()), np.append(obs[~small], obs[small].sum())
    assert chisquare(obs, exp).pvalue > 1e-3


def test_ngram_index_proposes_what_followed_the_longest_latest_match():
    index = NgramIndex(max_n=3)
    tokens = [5, 6, 7, 1, 5, 6, 9, 2, 6]
    assert index.continuation(tokens, 2) == [9, 2]  # (6,) occurred twice; the latest was followed by 9, 2
    tokens += [0, 2, 3, 9, 4, 3, 5, 2, 3]  # indexed incrementally from where the last call stopped
    assert index.continuation(tokens, 2) == [9, 4]  # (2, 3) was followed by 9, 4; the later (3,) by 5: longest wins
    assert index.continuation([4, 4, 4], 5) == [4, 4, 4, 4, 4]  # the list was cut: indexed again; period 1
    assert NgramIndex(2).continuation([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # a match into the end repeats
    assert NgramIndex(2).continuation([1, 2, 3], 2) == [3, 3]  # nothing matches: the last token k times


def test_prompt_lookup_speculates_only_when_a_suffix_occurred_before(checkpoints):
    """After the prompt's token t, a sequence speculates iff t occurs in the prompt (1-gram lookup; the
    prompts' tokens are distinct): with nothing to look up a plain step costs less than verifying guesses."""
    engine = spec_engine(checkpoints[0], NGRAM, k=3)
    one, two = (SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (1, 2))
    seen = set()
    for seed in range(40):
        prompt = torch.randperm(VOCAB - 1, generator=torch.Generator().manual_seed(seed))[:32].tolist()
        first = engine.generate([prompt], one, use_tqdm=False)[0].outputs[0].token_ids[0]  # prefill only
        before = engine.stats()["spec_steps"]
        engine.generate([prompt], two, use_tqdm=False)
        assert engine.stats()["spec_steps"] - before == int(first in prompt)
        seen.add(first in prompt)
    assert seen == {True, False}


def test_draft_sleeps_wakes_and_syncs_with_the_target(checkpoints):
    target_path, target, bad_path, _ = checkpoints
    engine = spec_engine(target_path, bad_path)
    before = engine.generate(make_prompts()[:1], GREEDY)[0].outputs[0].token_ids
    assert engine.memory_stats()["weights_bytes"] == 2 * sum(p.numel() * 4 for p in target.parameters())
    engine.sleep(level=2)
    engine.wake()
    engine.update_weights_from_disk(target_path)
    with pytest.raises(WeightsNotReadyError, match="with model='draft'$"):  # level 2 discarded the draft too
        engine.generate(make_prompts()[:1], GREEDY)
    engine.update_weights_from_disk(target_path, model="draft")  # a different draft: still exact
    assert engine.weight_history[-1]["model"] == "draft" and engine.weight_version == 1
    assert engine.generate(make_prompts()[:1], GREEDY)[0].outputs[0].token_ids == before
    assert engine.stats()["spec_accepted"] > 0


def test_bad_draft_arguments(checkpoints, hf_checkpoint):
    target_path, _, bad_path, _ = checkpoints
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        Engine(target_path, device="cpu", draft_model=bad_path, num_speculative_tokens=0)
    for k in (2, 0.0, False, None, "0"):  # without a draft only the int 0 means "no speculation"
        with pytest.raises(ValueError, match=f"num_speculative_tokens={k!r} needs a draft_model"):
            Engine(target_path, device="cpu", num_speculative_tokens=k)
    other_vocab, _ = hf_checkpoint("llama3")
    import json
    raw = json.loads((other_vocab / "config.json").read_text())
    assert raw["vocab_size"] == VOCAB  # same vocab: accepted (a Llama draft for a Qwen target is fine)
    spec_engine(target_path, other_vocab)
