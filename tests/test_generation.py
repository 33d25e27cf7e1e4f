"""The generation core against transformers: logits, greedy tokens, logprobs, sampling, batching."""
import dataclasses

import numpy as np
import pytest
import torch
from conftest import FAMILIES, VOCAB
from helpers import hf_logprobs, make_prompts as prompts
from scipy.stats import chisquare

from rollout_engine import Engine, SamplingParams
from rollout_engine.sequence import Sequence

def engine_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Logits of every position of `ids`, through the engine's own paged prefill."""
    seq = Sequence(-1, 0, ids, SamplingParams(), seed=0)
    assert engine.block_manager.grow(seq, len(ids))
    with torch.inference_mode():
        hidden, _ = engine.runner.forward(engine.model, [seq], [0], [ids])
        logits = engine.model.logits(hidden)
    engine.block_manager.free_seq(seq)
    return logits


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    made = {}

    def get(family):
        if family not in made:
            path, model = hf_checkpoint(family)
            made[family] = (Engine(path, device="cpu", kv_cache_memory=64 << 20, max_num_seqs=32), model)
        return made[family]

    return get


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_logits_match_transformers(engines, family):
    engine, model = engines(family)
    for ids in prompts():
        # float32 end to end: differences are summation-order rounding, ~1e-6 on logits of size ~5.
        torch.testing.assert_close(engine_logits(engine, ids), hf_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(engines, family):
    engine, model = engines(family)
    batch = prompts()
    outs = engine.generate(batch, SamplingParams(temperature=0, max_tokens=32))
    for ids, out in zip(batch, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=32,
                                attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, len(ids):].tolist()
        got = out.outputs[0]
        assert out.prompt_token_ids == ids
        assert len(hf) == 32, "these fixtures never hit EOS in 32 greedy steps"
        assert got.token_ids == hf
        assert got.finish_reason == "length"
        # Each logprob is log_softmax of the HF logits at the step that chose the token.
        torch.testing.assert_close(torch.tensor(got.logprobs), hf_logprobs(model, ids, hf), atol=1e-4, rtol=0)


def test_raw_and_processed_logprobs(engines):
    engine, model = engines("qwen3")
    ids = prompts()[1]
    logits = hf_logits(model, ids)[-1]
    for mode, expected in [("raw", logits.log_softmax(-1)), ("processed", (logits / 0.5).log_softmax(-1))]:
        out = engine.generate([ids], SamplingParams(temperature=0.5, max_tokens=1, seed=3, logprobs_mode=mode))
        token = out[0].outputs[0].token_ids[0]
        assert out[0].outputs[0].logprobs[0] == pytest.approx(expected[token].item(), abs=1e-4)


def test_n_samples_share_prompt_blocks_and_differ(hf_checkpoint):
    path, _ = hf_checkpoint("qwen3")
    engine = Engine(path, device="cpu", kv_cache_memory=16 << 20, block_size=16)
    ids = prompts([40])[0]  # two full blocks and 8 tokens of a third
    computed, peak = [], []

    def spy(run):  # prefill runs through step(); decode steps are launched
        def counted(batch, **kw):
            computed.append(sum(batch.num_tokens))
            peak.append(engine.block_manager.num_used)
            return run(batch, **kw)
        return counted

    engine.runner.step, engine.runner.launch = spy(engine.runner.step), spy(engine.runner.launch)
    out = engine.generate([ids], SamplingParams(n=8, max_tokens=4, ignore_eos=True, temperature=1.0))[0]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(samples) == 8 and len(set(samples)) == 8
    assert computed[0] == 40  # the prompt is prefilled once, not 8 times
    assert sum(computed) == 40 + 8 * 3
    # 2 shared full blocks + one copy of the partial block per sample (4 new tokens still fit in it),
    # against 8 * 3 = 24 without sharing.
    assert max(peak) == 2 + 8


def test_fixed_seed_reproduces_alone_or_in_a_batch(engines):
    engine, _ = engines("llama3")
    ids = prompts()[2]
    params = SamplingParams(n=2, temperature=1.0, top_p=0.9, max_tokens=16, seed=1234, ignore_eos=True)
    alone = engine.generate([ids], params)[0].outputs
    others = prompts([3, 9, 11, 21, 30, 7, 12, 25, 33, 4, 16, 19, 28, 8, 14], seed=5)
    batch = others[:7] + [ids] + others[7:]
    together = engine.generate(batch, [SamplingParams(temperature=1.0, max_tokens=20)] * 7 + [params]
                               + [SamplingParams(temperature=0.8, max_tokens=12)] * 8)[7].outputs
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    assert alone[0].token_ids != alone[1].token_ids


def test_seeds_far_apart_draw_different_samples(engines):
    """Python's hash() of an int is taken modulo 2**61 - 1: a seed and that seed plus 2**61 - 1 drew the same
    samples. Every seed below 2**63 draws its own; 2**63 is refused by name."""
    engine, _ = engines("llama3")
    ids = prompts()[2]

    def sample(seed):
        params = SamplingParams(temperature=1.0, max_tokens=16, seed=seed, ignore_eos=True)
        return engine.generate([ids], params)[0].outputs[0].token_ids

    assert sample(5) != sample(5 + 2 ** 61 - 1)
    assert sample(5) == sample(5)
    with pytest.raises(ValueError, match=r"seed.*2\*\*63"):
        SamplingParams(seed=2 ** 63).validate()


def test_more_samples_than_max_num_seqs_match_a_roomy_engine(hf_checkpoint):
    """n = 10 with room for 4 sequences: the prompt's 10 draws are sampled in pieces and the samples
    decode in turns, yet each sample is a function of its seed only."""
    path, _ = hf_checkpoint("qwen2")
    params = SamplingParams(n=10, temperature=1.0, max_tokens=6, seed=3, ignore_eos=True)
    runs = [Engine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=m).generate([prompts()[1]], params)
            for m in (4, 64)]
    tight, roomy = (run[0].outputs for run in runs)
    assert len(tight) == 10 and len({tuple(c.token_ids) for c in tight}) == 10
    for a, b in zip(tight, roomy):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_prompt_that_fills_the_longest_sequence_is_scored_and_gets_one_token(hf_checkpoint):
    """A prompt of exactly max_model_len tokens (a trajectory that ended by length, scored again for reference
    logprobs): its prompt logprobs are a roomier engine's, and each sample gets the one token its prefill draws,
    finish_reason "length" (its KV is never needed), also from the prefix cache; one token longer is refused
    naming the limit; nothing is left in the pool."""
    path, _ = hf_checkpoint("qwen3")
    ids = (prompts()[2] * 64)[:64]
    tight = Engine(path, device="cpu", kv_cache_memory=16 << 20, max_model_len=64)
    roomy = Engine(path, device="cpu", kv_cache_memory=16 << 20, max_model_len=128)
    for scored in (0, None):  # the second run's prompt hits the prefix cache (scoring computes it whole)
        params = SamplingParams(n=3, max_tokens=8, prompt_logprobs=scored, seed=7)
        full, more = tight.generate([ids], params)[0], roomy.generate([ids], params)[0]
        assert [c.finish_reason for c in full.outputs] == ["length"] * 3
        assert [c.token_ids for c in full.outputs] == [c.token_ids[:1] for c in more.outputs]
        assert [c.logprobs[0] for c in full.outputs] == pytest.approx([c.logprobs[0] for c in more.outputs], abs=1e-5)
        if scored is not None:
            np.testing.assert_allclose([lp[t] for lp, t in zip(full.prompt_logprobs[1:], ids[1:])],
                                       [lp[t] for lp, t in zip(more.prompt_logprobs[1:], ids[1:])], atol=1e-5)
    with pytest.raises(ValueError, match="at most 64 prompt tokens"):
        tight.generate([ids + [1]], SamplingParams(max_tokens=1))
    assert not tight.scheduler.has_work() and tight.block_manager.num_used == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_decode_launched_ahead_drops_what_finished_sequences_did_not_need(hf_checkpoint, device):
    """Decode steps are launched before the previous tokens are read (on CUDA: graph replays fed on the
    device), so a sequence that stops (a stop token, or max_tokens) has one more step computed for it.
    Those tokens are dropped, and every other sequence's output equals its output alone."""
    engine = Engine(hf_checkpoint("qwen2")[0], device=device, dtype="float32", kv_cache_memory=64 << 20,
                    max_num_seqs=32)
    batch = prompts([3, 9, 14, 21, 30, 6, 11, 25], seed=7)
    runs = [engine.generate([ids], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].outputs[0]
            for ids in batch]
    stop = max(set(t for r in runs for t in r.token_ids[2:12]), key=lambda t: sum(t in r.token_ids for r in runs))
    params = [SamplingParams(temperature=0, max_tokens=8 + 2 * i, ignore_eos=True, stop_token_ids=[stop])
              for i in range(len(batch))]
    together = [o.outputs[0] for o in engine.generate(batch, params)]
    alone = [engine.generate([ids], p)[0].outputs[0] for ids, p in zip(batch, params)]
    for a, b, run, p in zip(alone, together, runs, params):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        # greedy: the prefix of the longer run, up to the stop token or max_tokens
        end = run.token_ids.index(stop) + 1 if stop in run.token_ids else len(run.token_ids)
        assert b.token_ids == run.token_ids[: min(end, p.max_tokens)] and len(b.logprobs) == len(b.token_ids)
    assert {o.finish_reason for o in together} == {"stop", "length"}
    assert len({len(o.token_ids) for o in together}) > 2  # sequences leave the batch at different steps


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_a_full_running_set_launches_ahead_while_requests_wait_for_a_seat(hf_checkpoint, device):
    """More requests than max_num_seqs: those queued cannot run until a seat frees, so the running set keeps
    launching each decode step before the last one's tokens are read (a rollout spends most of its steps
    this way). Every output equals its output alone, and every request is admitted."""
    engine = Engine(hf_checkpoint("qwen2")[0], device=device, dtype="float32", kv_cache_memory=64 << 20,
                    max_num_seqs=3)
    batch = prompts([5, 12, 9, 17, 4, 20, 8, 11], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * (i % 4), ignore_eos=True) for i in range(len(batch))]
    launch, waiting_launches = engine.runner.launch, []

    def spy(batch, after=None):
        if after is not None:
            waiting_launches.append(len(engine.scheduler.waiting))
        return launch(batch, after)

    engine.runner.launch = spy
    together = [o.outputs[0] for o in engine.generate(batch, params)]
    engine.runner.launch = launch
    assert sum(n > 0 for n in waiting_launches) >= 10  # steps launched ahead while requests waited
    for ids, p, b in zip(batch, params, together):
        a = engine.generate([ids], p)[0].outputs[0]
        assert a.token_ids == b.token_ids and len(b.token_ids) == p.max_tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def filtered_distribution(logits: torch.Tensor, temperature, top_k, top_p, min_p) -> np.ndarray:
    """The truncated, renormalised distribution, written independently of the engine (float64, sorted)."""
    p = torch.softmax(logits.double() / temperature, -1).numpy()
    order = np.argsort(-p, kind="stable")
    keep = np.zeros_like(p, dtype=bool)
    keep[order[: top_k if top_k > 0 else len(p)]] = True
    q = np.where(keep, p, 0) / p[keep].sum()
    mass_before = np.cumsum(q[order]) - q[order]
    keep[order[mass_before >= top_p]] = False
    q = np.where(keep, p, 0) / p[keep].sum()
    keep &= q >= min_p * q.max()
    q = np.where(keep, p, 0)
    return q / q.sum()


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 5, 1.0, 0.0), (0.7, -1, 0.8, 0.0), (1.3, -1, 1.0, 0.1), (0.9, 20, 0.9, 0.05),
])
def test_truncated_sampling_matches_its_distribution(engines, temperature, top_k, top_p, min_p):
    engine, model = engines("qwen2")
    ids = prompts()[0]
    expected = filtered_distribution(hf_logits(model, ids)[-1], temperature, top_k, top_p, min_p)
    draws = 4000
    out = engine.generate([ids], SamplingParams(n=draws, max_tokens=1, temperature=temperature, top_k=top_k,
                                                top_p=top_p, min_p=min_p, seed=7), use_tqdm=False)[0]
    counts = np.bincount([c.token_ids[0] for c in out.outputs], minlength=VOCAB)
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a filtered-out token was sampled"
    assert 2 <= kept.sum() < VOCAB / 2, "the filter should leave a non-trivial set"
    # Pool the bins expected below 5 draws so the chi-square approximation holds; fixed seed, alpha = 1e-3.
    kept_probs = np.asarray(expected[kept], dtype=np.float64)
    exp, obs = kept_probs / kept_probs.sum() * draws, counts[kept]  # scipy wants equal sums to 1.5e-8
    small = exp < 5
    exp = np.append(exp[~small], exp[small].sum()) if small.any() else exp
    obs = np.append(obs[~small], obs[small].sum()) if small.any() else obs
    assert chisquare(obs, exp).pvalue > 1e-3


def test_preemption_gives_the_same_greedy_outputs(hf_checkpoint):
    path, _ = hf_checkpoint("llama3")
    batch = prompts([5, 17, 40, 9, 23, 31, 12, 3], seed=11)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    big = Engine(path, device="cpu", kv_cache_memory=64 << 20)
    small_pool = big.kv.planner.total_bytes(10)  # 10 blocks of 16: far fewer than 8 sequences need
    small = Engine(path, device="cpu", kv_cache_memory=small_pool)
    assert small.kv.num_blocks == 10
    expected = [o.outputs[0].token_ids for o in big.generate(batch, params)]
    got = [o.outputs[0].token_ids for o in small.generate(batch, params)]
    assert small.scheduler.num_preemptions > 0
    assert got == expected


def test_a_fork_that_stops_at_once_leaves_no_copy_into_its_freed_block(hf_checkpoint, monkeypatch):
    """Two n=2 prompts whose last blocks are partial finish their prefill in one step, in a pool of 5 blocks of
    4: P's second sample stops on its first token and frees the block its fork was to be copied into; P2's
    fork takes that block. Only the live fork's copy may run: two copies into one block in one launch race (on
    CUDA either may land), so the pool here applies each call's copies first-wins, and P2's samples must
    still equal P2's alone."""
    import pool_layout.mha as mha

    path, _ = hf_checkpoint("llama3")
    p, p2 = prompts([6, 7], seed=11)
    probe = Engine(path, device="cpu", kv_cache_memory=1 << 22, block_size=4)
    for seed in range(1, 40):  # the first seed whose two samples of P begin with different tokens
        params_p = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=seed, n=2)
        first = [c.token_ids[0] for c in probe.generate([p], params_p)[0].outputs]
        if first[0] != first[1]:
            break
    assert first[0] != first[1]
    params_p = dataclasses.replace(params_p, stop_token_ids=[first[1]])
    params_p2 = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=2, n=2)
    alone = [c.token_ids for c in probe.generate([p2], params_p2)[0].outputs]
    copies, plain = [], mha.MhaKvPool.copy_blocks

    def first_wins(pool, src, dst):
        copies.append(list(dst))
        for s, d in reversed(list(zip(src, dst))):
            plain(pool, [s], [d])

    monkeypatch.setattr(mha.MhaKvPool, "copy_blocks", first_wins)
    small = Engine(path, device="cpu", kv_cache_memory=probe.kv.planner.total_bytes(5), block_size=4)
    assert small.kv.num_blocks == 5
    outs = small.generate([p, p2], [params_p, params_p2])
    assert outs[0].outputs[1].token_ids == [first[1]] and outs[0].outputs[1].finish_reason == "stop"
    assert all(len(set(dst)) == len(dst) for dst in copies), copies
    assert [c.token_ids for c in outs[1].outputs] == alone


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
@pytest.mark.parametrize("step_tokens", [4096, 40])
def test_requests_that_repeat_a_prompt_in_one_step_share_its_blocks(hf_checkpoint, device, step_tokens):
    """A GRPO group sent as separate requests (the prompt repeated, as AsyncEngine callers do): the copies
    admitted in the step that prefills the prompt read its blocks, written earlier in that same forward, instead
    of computing them again. With 40 tokens a step the prompt's prefill is chunked: a copy shares the blocks
    published after the first chunk and those the second fills. Every output equals the engine's without a
    prefix cache."""
    path = hf_checkpoint("qwen3")[0]
    group = prompts([50, 37], seed=11)  # 3 and 2 full blocks of 16 before each prompt's last token
    reqs = [ids for ids in group for _ in range(4)]
    params = [SamplingParams(temperature=1.0, max_tokens=6, seed=i, ignore_eos=True) for i in range(len(reqs))]
    outs = {}
    for caching in (True, False):
        engine = Engine(path, device=device, dtype="float32", kv_cache_memory=64 << 20, max_num_seqs=16,
                        max_num_batched_tokens=step_tokens, enable_prefix_caching=caching)
        outs[caching] = engine.generate(reqs, params)
    assert [o.metrics["num_cached_tokens"] for o in outs[True]] == [0, 48, 48, 48, 0, 32, 32, 32]
    assert all(o.metrics["num_cached_tokens"] == 0 for o in outs[False])
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        np.testing.assert_allclose(a.outputs[0].logprobs, b.outputs[0].logprobs, atol=1e-5)


def test_prefix_cache_serves_a_repeated_prompt(engines):
    engine, _ = engines("mistral")
    ids = prompts([50], seed=3)[0]
    params = SamplingParams(temperature=0, max_tokens=4)
    engine.flush_cache()  # the module's engine: earlier tests' blocks go
    first = engine.generate([ids], params)[0]
    stats = engine.memory_stats()  # the 54 tokens' three full blocks stay cached, held by no sequence
    assert (stats["kv_blocks_cached"], stats["kv_blocks_used"]) == (3, 0)
    second = engine.generate([ids], params)[0]
    assert second.metrics["num_cached_tokens"] == 48  # three full blocks of 16
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    engine.flush_cache()
    assert engine.memory_stats()["kv_blocks_cached"] == 0
    assert engine.generate([ids], params)[0].metrics["num_cached_tokens"] == 0


def test_stop_conditions(tiny_checkpoint):
    engine = Engine(tiny_checkpoint, device="cpu")
    base = engine.generate("12+34=", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop_token = base.token_ids[5]
    out = engine.generate("12+34=", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_token]))
    first = base.token_ids.index(stop_token)
    assert out[0].outputs[0].token_ids == base.token_ids[: first + 1]
    assert out[0].outputs[0].finish_reason == "stop" and out[0].outputs[0].stop_reason == stop_token  # vLLM's field
    stop_text = base.text[3:6]
    out = engine.generate("12+34=", SamplingParams(temperature=0, max_tokens=12, stop=["zzzz", stop_text]))
    out = out[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == base.text[: base.text.find(stop_text)]
    assert out.stop_reason == stop_text  # which of the stop strings it was
    assert isinstance(base.text, str) and base.finish_reason == "length" and len(base.token_ids) == 12
    assert base.stop_reason is None


@pytest.mark.parametrize("speculate", [False, True])
def test_stop_strings_late_in_long_outputs(tiny_checkpoint, speculate):
    """Stop strings far into an output (the engine decodes only a window of new text each step), and under
    speculation, where one step emits several tokens: the text ends before the first match, the tokens
    (and logprobs) at the one that completed it."""
    kw = dict(draft_model=tiny_checkpoint, num_speculative_tokens=4) if speculate else {}
    engine = Engine(tiny_checkpoint, device="cpu", **kw)
    tok = engine.tokenizer
    params = dict(temperature=0, max_tokens=80, ignore_eos=True, logprobs=True)
    base = engine.generate("12+34=", SamplingParams(**params))[0].outputs[0]
    assert len(base.text) > 60
    for at in (5, 30, len(base.text) - 4):
        stop = base.text[at : at + 3]
        out = engine.generate("12+34=", SamplingParams(stop=[stop, "never seen"], **params))[0].outputs[0]
        assert out.finish_reason == "stop" and out.text == base.text[: base.text.find(stop)]
        assert out.token_ids == base.token_ids[: len(out.token_ids)] and len(out.logprobs) == len(out.token_ids)
        assert stop in tok.decode(out.token_ids) and stop not in tok.decode(out.token_ids[:-1])
    if speculate:
        assert engine.stats()["spec_accepted"] > 0  # the draft is the target: steps emit several tokens


@pytest.mark.parametrize("silent", ["eos", "<|im_end|>"])
def test_a_stop_string_split_by_tokens_that_decode_to_nothing_is_found(tiny_checkpoint, silent):
    """Under ignore_eos, EOS tokens (skipped in the text) may fall between a stop string's characters: the
    window of text checked each step reaches back past them, so "x", 20 x EOS, "y" stops at "xy". The same
    for added tokens marked special that all_special_ids does not list (the tiny tokenizer's <|im_end|>,
    Llama 3's reserved tokens): they decode to nothing too."""
    from rollout_engine.sequence import Sequence, Status
    engine = Engine(tiny_checkpoint, device="cpu")
    tok = engine.tokenizer
    x, y = tok.encode("x", add_special_tokens=False), tok.encode("y", add_special_tokens=False)
    silent_id = sorted(engine.cfg.eos_token_ids)[0] if silent == "eos" else tok.convert_tokens_to_ids(silent)
    assert tok.decode([silent_id], skip_special_tokens=True) == ""
    assert silent == "eos" or silent_id not in tok.all_special_ids  # what the case is about
    seq = Sequence(0, 0, [5, 6, 7], SamplingParams(max_tokens=100, stop=["xy"], ignore_eos=True), 1)
    seq.status = Status.RUNNING
    engine.scheduler.running.append(seq)
    for token in x + [silent_id] * 20 + y:  # one token per step, as decode steps deliver them
        seq.token_ids.append(token)
        seq.logprobs.append(0.0)
        seq.weight_versions.append(0)
        engine.loop.stop_strings.check(seq)
    assert seq.finish_reason == "stop" and seq.text == ""


@pytest.mark.parametrize("kwargs, arg", [
    (dict(max_tokens=0), "max_tokens"), (dict(n=0), "n"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.1), "min_p"), (dict(logprobs_mode="soft"), "logprobs_mode"),
    # an int too large for a float (a JSON body's 400 digits) raised OverflowError, a 500 at the server
    (dict(temperature=10 ** 400), "temperature"), (dict(top_p=10 ** 400), "top_p"), (dict(min_p=10 ** 400), "min_p"),
])
def test_bad_sampling_params(kwargs, arg):
    with pytest.raises(ValueError, match=arg):
        SamplingParams(**kwargs)


def test_top_k_zero_is_off_as_in_vllm(engines):
    """vLLM's default top_k is 0, its "off" as TRL's is: taken as -1, so a seeded sample draws the same tokens."""
    engine, _ = engines("qwen3")
    assert SamplingParams(top_k=0).top_k == -1
    runs = [engine.generate(prompts()[:2], SamplingParams(top_k=top_k, seed=3, max_tokens=8))
            for top_k in (0, -1)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def test_bad_prompts_leave_the_engine_usable(engines):
    engine, _ = engines("qwen3")
    good = prompts()[0]
    params = SamplingParams(temperature=0, max_tokens=5)
    expected = engine.generate([good], params)[0].outputs[0].token_ids
    bad_prompts = {
        "empty": [[]],
        "too large": [good, [1, 2, VOCAB]],
        "negative": [[3, -1]],
        "too long": [list(range(10)) * 52],
        "text without tokenizer": ["hello"],
    }
    for why, bad in bad_prompts.items():
        with pytest.raises(ValueError, match="prompt|tokenizer"):
            engine.generate(bad, params)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        engine.generate([good], SamplingParams(max_tokens=5, stop="x"))
    assert engine.generate([good], params)[0].outputs[0].token_ids == expected
    assert not engine.scheduler.has_work() and engine.block_manager.num_used == 0


def test_a_list_of_0_d_tensors_is_a_prompt_of_token_ids(engines):
    """list(tensor) gives 0-d tensors: their integer values are the prompt (a float or bool one is refused)."""
    engine, _ = engines("qwen3")
    good, params = prompts()[0], SamplingParams(temperature=0, max_tokens=5)
    expected = engine.generate([good], params)[0].outputs[0].token_ids
    as_tensors = list(torch.tensor(good))
    assert engine.generate(as_tensors, params)[0].outputs[0].token_ids == expected
    assert engine.generate([as_tensors], params)[0].outputs[0].token_ids == expected
    for bad in (torch.tensor(1.0), torch.tensor(True)):
        with pytest.raises(ValueError, match="are not ints"):
            engine.generate([[*as_tensors[:2], bad]], params)


def test_bad_checkpoints(tmp_path, hf_checkpoint):
    with pytest.raises(ValueError, match="config.json"):
        Engine(tmp_path)
    for empty in ("", "  "):  # not the working directory
        with pytest.raises(ValueError, match=f"model_path={empty!r} is not allowed"):
            Engine(empty)
    path, model = hf_checkpoint("qwen3")
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        Engine(tmp_path)
    import json, shutil
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    shutil.copy(path / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        Engine(tmp_path)


def test_configs_read_as_transformers_builds_them(hf_checkpoint):
    """Per architecture, what transformers does with a config: Mistral's window is its default (4096) when the
    key is absent and use_sliding_window does not turn it off; Llama has no window; Mistral builds no biases
    whatever attention_bias says, Qwen2 no MLP bias. Sequences are capped at a window, so attention stays exact."""
    import json

    from rollout_engine.config import ModelConfig

    raw = {name: json.loads((hf_checkpoint(name)[0] / "config.json").read_text()) for name in ("mistral", "llama3", "qwen2")}
    mistral = {k: v for k, v in raw["mistral"].items() if k != "sliding_window"}
    assert ModelConfig.from_dict(mistral).sliding_window == 4096
    assert ModelConfig.from_dict({**mistral, "sliding_window": 8, "use_sliding_window": False}).sliding_window == 8
    assert ModelConfig.from_dict({**raw["llama3"], "sliding_window": 8, "use_sliding_window": True}).sliding_window is None
    biased = ModelConfig.from_dict({**raw["mistral"], "attention_bias": True, "mlp_bias": True})
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias) == (False, False, False)
    qwen2 = ModelConfig.from_dict({**raw["qwen2"], "mlp_bias": True})
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.mlp_bias) == (True, False, False)


def test_a_mistral_config_with_attention_bias_loads_as_transformers_builds_it(tmp_path):
    """transformers' Mistral has no biases whatever attention_bias says: its checkpoint holds none, and the engine
    loads it and gives its logits."""
    import transformers

    config = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                        attention_bias=True, initializer_range=0.2)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).float().eval()
    model.save_pretrained(tmp_path, safe_serialization=True)
    engine = Engine(tmp_path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=4)
    assert engine.config.max_model_len == 512  # its window (4096) is longer than its positions
    for ids in prompts()[:2]:
        torch.testing.assert_close(engine_logits(engine, ids), hf_logits(model, ids), atol=1e-4, rtol=0)


def test_a_head_dim_the_attention_kernels_cannot_take_is_refused_on_cuda(tmp_path, monkeypatch):
    """The CUDA attention kernels range over the head dimension with tl.arange, which takes powers of two: a
    checkpoint with head_dim 24 is refused on CUDA by name before anything is built (checked here with CUDA
    reported present), and runs on the CPU, whose attention is torch's."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=24,
                                      max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    assert Engine(tmp_path, device="cpu", kv_cache_memory=4 << 20, max_num_seqs=2).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="head_dim=24 is not supported on CUDA"):
        Engine(tmp_path, device="cuda")
