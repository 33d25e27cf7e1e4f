"""The logprob contract (DESIGN.md "Logprobs"): top-k alternatives, prompt logprobs and the three logprobs
modes, against transformers' float32 log-softmax on the same tokens.

Tolerance: float32 end to end; logits of size ~5 differ from transformers' by summation-order rounding
(~1e-6), so logprobs agree to 1e-4 with a wide margin, while a wrong position, token, temperature or
normalisation moves them by far more (the random models' logits spread over several units)."""
import asyncio

import numpy as np
import pytest
import torch
from conftest import FAMILIES, VOCAB
from helpers import make_prompts

from rollout_engine import Engine, SamplingParams
from rollout_engine.async_engine import AsyncEngine
from rollout_engine.sampling_params import MAX_LOGPROBS

TOL = 1e-4
KV = 32 << 20


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def completion_logprobs(model, ids, tokens, temperature=1.0) -> torch.Tensor:
    """[len(tokens), V]: transformers' log_softmax(logits / temperature) at each sampled position."""
    logits = hf_logits(model, ids + tokens)[len(ids) - 1 : -1]
    return (logits / (temperature or 1.0)).log_softmax(-1)


def assert_top(top: dict, expected: torch.Tensor, k: int):
    """`top` is the k largest of `expected` [V]: the same ids in the same order, values within TOL."""
    values, ids = expected.topk(k)
    assert list(top) == ids.tolist()
    np.testing.assert_allclose(list(top.values()), values.tolist(), atol=TOL, rtol=0)


def assert_prompt_logprobs(got, model, ids, k, temperature=1.0):
    """vLLM's format: None at position 0, then {prompt token t: logprob} plus the top k at position t - 1."""
    expected = (hf_logits(model, ids) / (temperature or 1.0)).log_softmax(-1)
    assert len(got) == len(ids) and got[0] is None
    for t in range(1, len(ids)):
        entry, row = got[t], expected[t - 1]
        assert next(iter(entry)) == ids[t]  # the prompt token first
        top = row.topk(k).indices.tolist()
        assert [i for i in entry if i != ids[t]] == [i for i in top if i != ids[t]]
        np.testing.assert_allclose(list(entry.values()), row[list(entry)].tolist(), atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def engines(hf_checkpoint):
    made = {}

    def get(family, **kw):
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            path, model = hf_checkpoint(family)
            made[key] = (Engine(path, device="cpu", kv_cache_memory=KV, max_num_seqs=16, **kw), model)
        return made[key]

    return get


# ---------------------------------------------------------------------------------------------- sampled tokens

@pytest.mark.parametrize("family", FAMILIES)
def test_top_logprobs_are_transformers_top_k(engines, family):
    """Greedy and sampled: each position's top-k is transformers' top-k, the sampled token's logprob is its
    log-softmax, and equals its own entry whenever it is among the top k."""
    engine, model = engines(family)
    batch = make_prompts()
    for temperature in (0.0, 0.8):
        params = SamplingParams(temperature=temperature, max_tokens=8, ignore_eos=True, seed=1, logprobs=5)
        for ids, out in zip(batch, engine.generate(batch, params, use_tqdm=False)):
            c = out.outputs[0]
            expected = completion_logprobs(model, ids, c.token_ids, temperature)
            assert len(c.top_logprobs) == len(c.logprobs) == len(c.token_ids) == 8
            for t, (token, top) in enumerate(zip(c.token_ids, c.top_logprobs)):
                assert_top(top, expected[t], 5)
                assert c.logprobs[t] == pytest.approx(expected[t, token].item(), abs=TOL)
                if token in top:
                    assert top[token] == c.logprobs[t]
            if temperature == 0:
                assert all(next(iter(top)) == token for token, top in zip(c.token_ids, c.top_logprobs))


def test_requests_asking_for_top_k_leave_their_batch_mates_unchanged(engines):
    """Two requests ask for top-k (different k, different modes; their steps run eagerly), one does not: its
    output carries no top_logprobs, and every request's tokens are what they are without the others."""
    engine, model = engines("qwen3")
    batch = make_prompts()
    plain = dict(temperature=0.8, max_tokens=6, seed=4, ignore_eos=True)
    alone = engine.generate(batch, SamplingParams(**plain), use_tqdm=False)
    params = [SamplingParams(**plain), SamplingParams(logprobs=MAX_LOGPROBS, **plain),
              SamplingParams(logprobs=1, logprobs_mode="raw", **plain)]
    mixed = engine.generate(batch, params, use_tqdm=False)
    np.testing.assert_allclose(mixed[0].outputs[0].logprobs, alone[0].outputs[0].logprobs, atol=1e-5)
    assert mixed[0].outputs[0].top_logprobs is None
    for ids, a, m, p in zip(batch, alone, mixed, params):
        c = m.outputs[0]
        assert c.token_ids == a.outputs[0].token_ids
        expected = completion_logprobs(model, ids, c.token_ids, 0.8 if p.logprobs_mode == "processed" else 1.0)
        np.testing.assert_allclose(c.logprobs, expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                   atol=TOL, rtol=0)
        for t, top in enumerate(c.top_logprobs or []):
            assert_top(top, expected[t], p.logprobs)


def test_logprobs_modes_under_truncation(engines):
    """With top-k and top-p: "processed" is the truncated distribution renormalised (dropped tokens -inf),
    "temperature" is log_softmax(logits / T) over every token, "raw" is log_softmax(logits); the tokens are
    the same in every mode (the mode changes what is reported, never what is drawn)."""
    engine, model = engines("qwen3")
    ids = make_prompts()[1]
    common = dict(temperature=0.7, top_k=4, top_p=0.95, max_tokens=6, seed=2, ignore_eos=True)
    outs = {(mode, k): engine.generate([ids], SamplingParams(logprobs_mode=mode, logprobs=k, **common),
                                       use_tqdm=False)[0].outputs[0]
            for mode in ("processed", "temperature", "raw") for k in (0, 6)}
    tokens = outs["processed", 0].token_ids
    assert all(c.token_ids == tokens for c in outs.values())
    logits = hf_logits(model, ids + tokens)[len(ids) - 1 : -1]
    scaled = logits / 0.7
    for t, token in enumerate(tokens):
        kept = scaled[t].topk(4).indices  # most likely first
        probs = scaled[t, kept].softmax(0)
        kept = kept[probs.cumsum(0) - probs < 0.95]  # top-p: the mass above a kept token is below 0.95
        processed = torch.full_like(scaled[t], float("-inf"))
        processed[kept] = scaled[t, kept].log_softmax(0)
        for mode, expected in (("processed", processed), ("temperature", scaled[t].log_softmax(0)),
                               ("raw", logits[t].log_softmax(0))):
            for k in (0, 6):
                assert outs[mode, k].logprobs[t] == pytest.approx(expected[token].item(), abs=TOL), (mode, k, t)
            top = outs[mode, 6].top_logprobs[t]
            finite = int(expected.isfinite().sum())
            assert_top(dict(list(top.items())[: min(6, finite)]), expected, min(6, finite))
            assert all(v == float("-inf") for v in list(top.values())[finite:])  # dropped tokens, "processed"


def test_temperature_mode_untruncated_is_log_softmax_over_temperature(engines):
    """No truncation: "temperature" equals "processed" (the sampler's own logprob, what a decode graph gives)."""
    engine, model = engines("llama3")
    batch = make_prompts()
    params = SamplingParams(temperature=1.3, max_tokens=6, seed=5, ignore_eos=True, logprobs_mode="temperature")
    for ids, out in zip(batch, engine.generate(batch, params, use_tqdm=False)):
        c = out.outputs[0]
        expected = completion_logprobs(model, ids, c.token_ids, 1.3)
        np.testing.assert_allclose(c.logprobs, expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                   atol=TOL, rtol=0)


def test_logprobs_none_zero_true_false(engines):
    engine, _ = engines("qwen3")
    ids = make_prompts()[0]
    base = dict(temperature=0, max_tokens=4, ignore_eos=True)
    assert SamplingParams(logprobs=True).logprobs == 0 and SamplingParams(logprobs=False).logprobs is None
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs is None
    assert SamplingParams(logprobs=np.int64(3)).logprobs == 3 and SamplingParams().logprobs == 0
    # keyed by name: False == 0 and True == 1 as dict keys
    got = {repr(lp): engine.generate([ids], SamplingParams(logprobs=lp, **base), use_tqdm=False)[0]
           for lp in (None, False, 0, True, 2)}
    for lp in ("None", "False"):
        assert got[lp].outputs[0].logprobs is None and got[lp].outputs[0].top_logprobs is None
    for lp in ("0", "True"):
        assert len(got[lp].outputs[0].logprobs) == 4 and got[lp].outputs[0].top_logprobs is None
    assert got["2"].outputs[0].logprobs == got["0"].outputs[0].logprobs  # asking for top-k changes no logprob
    assert [len(t) for t in got["2"].outputs[0].top_logprobs] == [2] * 4
    assert all(o.prompt_logprobs is None for o in got.values())


@pytest.mark.parametrize("name, value", [
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 1.5), ("logprobs", "all"),
    ("prompt_logprobs", -1), ("prompt_logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", 2.0),
    ("logprobs_mode", "processed_logprobs"),
])
def test_bad_logprob_arguments_are_refused(engines, name, value):
    with pytest.raises(ValueError, match=rf"{name}={value!r} is not allowed"):
        SamplingParams(**{name: value})
    engine, _ = engines("qwen3")
    params = SamplingParams(temperature=0, max_tokens=2)
    setattr(params, name, value)  # set after construction: generate() checks again, before anything runs
    with pytest.raises(ValueError, match=name):
        engine.generate([make_prompts()[0]], params, use_tqdm=False)
    assert len(engine.generate([make_prompts()[0]], SamplingParams(max_tokens=2), use_tqdm=False)[0]
               .outputs[0].token_ids) == 2


def test_stop_strings_trim_top_logprobs_with_the_tokens(tiny_checkpoint):
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=KV)
    params = dict(temperature=0, max_tokens=30, ignore_eos=True, logprobs=2)
    base = engine.generate("12+34=", SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    out = engine.generate("12+34=", SamplingParams(stop=base.text[8:11], **params), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) < 30
    assert len(out.top_logprobs) == len(out.logprobs) == len(out.token_ids)
    assert out.top_logprobs == base.top_logprobs[: len(out.token_ids)]


# ---------------------------------------------------------------------------------------------- prompt logprobs

@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_are_transformers(engines, family):
    """Scoring given sequences (max_tokens=1): every prompt position, k alternatives or none."""
    engine, model = engines(family)
    batch = make_prompts()
    for k in (0, 3):
        outs = engine.generate(batch, SamplingParams(max_tokens=1, prompt_logprobs=k), use_tqdm=False)
        for ids, out in zip(batch, outs):
            assert_prompt_logprobs(out.prompt_logprobs, model, ids, k)
            assert all(len(e) <= k + 1 for e in out.prompt_logprobs[1:])


def test_prompt_logprobs_follow_the_mode_without_truncation(engines):
    """"processed" and "temperature": log_softmax(logits / T) (T = 0 divides by 1); "raw": log_softmax(logits);
    top-k/top-p never drop a given prompt token."""
    engine, model = engines("qwen3")
    ids = make_prompts()[2]
    for mode, temperature, scale in [("processed", 0.5, 0.5), ("temperature", 0.5, 0.5), ("raw", 0.5, 1.0),
                                     ("processed", 0.0, 1.0)]:
        params = SamplingParams(max_tokens=1, temperature=temperature, top_k=2, top_p=0.5, prompt_logprobs=2,
                                logprobs_mode=mode)
        out = engine.generate([ids], params, use_tqdm=False)[0]
        assert_prompt_logprobs(out.prompt_logprobs, model, ids, 2, scale)


def test_prompt_logprobs_with_chunked_prefill_and_n(engines):
    """Prefill chunks of 16 tokens (prompts up to 70), mixed with decodes of other requests, and n = 3: one
    prompt_logprobs per request, every position once."""
    engine, model = engines("mistral", max_num_batched_tokens=16)
    batch = make_prompts((5, 17, 40, 70), seed=3)
    params = [SamplingParams(max_tokens=4, n=3, seed=1, prompt_logprobs=2), SamplingParams(max_tokens=20),
              SamplingParams(max_tokens=3, prompt_logprobs=0), SamplingParams(max_tokens=2, n=2, prompt_logprobs=4)]
    outs = engine.generate(batch, params, use_tqdm=False)
    for ids, p, out in zip(batch, params, outs):
        assert len(out.outputs) == p.n and all(len(c.token_ids) == p.max_tokens or c.finish_reason == "stop"
                                               for c in out.outputs)
        if p.prompt_logprobs is None:
            assert out.prompt_logprobs is None
        else:
            assert_prompt_logprobs(out.prompt_logprobs, model, ids, p.prompt_logprobs)


def test_prompt_logprobs_scored_in_pieces(engines, monkeypatch):
    """A long prompt's logits are scored a few positions at a time (here 7 rows per piece, pieces spanning two
    requests of different k), never prompt_len x vocab at once: the same logprobs."""
    import rollout_engine.logprobs

    engine, model = engines("llama-linear-bias")
    monkeypatch.setattr(rollout_engine.logprobs, "PIECE_ELEMENTS", 7 * VOCAB)
    batch = make_prompts((30, 23), seed=5)
    params = [SamplingParams(max_tokens=1, prompt_logprobs=k) for k in (1, 5)]
    for ids, p, out in zip(batch, params, engine.generate(batch, params, use_tqdm=False)):
        assert_prompt_logprobs(out.prompt_logprobs, model, ids, p.prompt_logprobs)


def test_prompt_logprobs_after_a_prefix_cache_hit(engines):
    """The prompt's blocks are cached: a request for prompt logprobs computes every position anyway (a cached
    position has no logits), and the cache keeps serving requests that do not ask."""
    engine, model = engines("qwen2")
    ids = make_prompts((50,), seed=9)[0]
    first = engine.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    hit = engine.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert hit.metrics["num_cached_tokens"] == 48 and first.prompt_logprobs is None
    scored = engine.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1, n=2), use_tqdm=False)[0]
    assert scored.metrics["num_cached_tokens"] == 0
    assert_prompt_logprobs(scored.prompt_logprobs, model, ids, 1)
    again = engine.generate([ids], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    assert again.metrics["num_cached_tokens"] == 48


def test_scoring_a_completion_gives_its_sampling_logprobs(engines):
    """What an RL user does for old-policy logprobs: score prompt + completion with max_tokens=1; the prompt
    logprobs over the completion are the logprobs it was sampled with (temperature 1, no truncation)."""
    engine, _ = engines("qwen3")
    ids = make_prompts()[1]
    c = engine.generate([ids], SamplingParams(max_tokens=10, seed=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    scored = engine.generate([ids + c.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    again = [e[t] for e, t in zip(scored.prompt_logprobs[len(ids):], c.token_ids)]
    np.testing.assert_allclose(again, c.logprobs, atol=1e-5)


# ---------------------------------------------------------------------------------------------- other paths

def test_top_logprobs_under_speculative_decoding(engines, hf_checkpoint):
    """A draft proposes, the target verifies: the logprobs and top-k are the target's at every emitted position
    (the draft is the target, so every greedy proposal is accepted and steps emit several tokens)."""
    path, model = hf_checkpoint("qwen3")
    engine = Engine(path, device="cpu", kv_cache_memory=KV, draft_model=path, num_speculative_tokens=3)
    batch = make_prompts()
    for params in (SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=4),
                   SamplingParams(temperature=0.8, top_p=0.9, max_tokens=10, ignore_eos=True, seed=2,
                                  logprobs_mode="temperature")):
        steps = engine.stats()["spec_steps"]
        for ids, out in zip(batch, engine.generate(batch, params, use_tqdm=False)):
            c = out.outputs[0]
            expected = completion_logprobs(model, ids, c.token_ids, params.temperature)
            np.testing.assert_allclose(c.logprobs, expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                       atol=TOL, rtol=0)
            assert (c.top_logprobs is None) == (params.logprobs == 0)
            for t, top in enumerate(c.top_logprobs or []):
                assert_top(top, expected[t], 4)
        assert engine.stats()["spec_steps"] > steps
    assert engine.stats()["spec_accepted"] > 0


def test_async_engine_snapshots_and_outputs_carry_the_fields(hf_checkpoint):
    path, model = hf_checkpoint("qwen3")
    ids = make_prompts()[1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=1)

    async def main(engine):
        snapshots = [out async for out in engine.stream(ids, params)]
        return snapshots, await engine.generate(ids, params)

    engine = AsyncEngine(path, device="cpu", kv_cache_memory=KV)
    try:
        snapshots, final = asyncio.run(asyncio.wait_for(main(engine), 60))
    finally:
        engine.shutdown()
    for out in snapshots + [final]:
        for c in out.outputs:
            assert len(c.top_logprobs) == len(c.logprobs) == len(c.token_ids)
    for out in (snapshots[-1], final):
        assert_prompt_logprobs(out.prompt_logprobs, model, ids, 1)
        expected = completion_logprobs(model, ids, out.outputs[0].token_ids)
        for t, top in enumerate(out.outputs[0].top_logprobs):
            assert_top(top, expected[t], 2)


def test_only_batches_that_ask_leave_the_decode_graph_path(engines):
    """The default (logprobs=0) keeps decode steps on the captured-graph path; a sequence asking for top-k or
    for "temperature" logprobs under truncation makes its batch eager."""
    from rollout_engine.model_runner import pure_decode
    from rollout_engine.scheduler import Batch
    from rollout_engine.sequence import Sequence

    def decode_batch(**kw):
        seq = Sequence(0, 0, [1, 2, 3], SamplingParams(**kw), seed=0)
        seq.num_computed = 2
        batch = Batch()
        batch.add(seq, 1)
        return batch

    assert pure_decode(decode_batch())
    assert pure_decode(decode_batch(logprobs=None, logprobs_mode="raw", top_p=0.5))
    assert pure_decode(decode_batch(logprobs_mode="temperature"))
    assert pure_decode(decode_batch(prompt_logprobs=3))  # the prompt is scored during prefill
    assert not pure_decode(decode_batch(logprobs=1))
    assert not pure_decode(decode_batch(logprobs_mode="temperature", top_k=5))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_top_and_prompt_logprobs_on_the_gpu(hf_checkpoint):
    """On CUDA (Triton sampler, decode graphs for the batch-mates that do not ask), float32: the same contract."""
    path, model = hf_checkpoint("qwen3")
    engine = Engine(path, device="cuda", dtype="float32", kv_cache_memory=256 << 20)
    batch = make_prompts()
    asking = SamplingParams(temperature=0.8, max_tokens=8, seed=1, ignore_eos=True, logprobs=5, prompt_logprobs=2)
    plain = SamplingParams(temperature=0.8, max_tokens=8, seed=1, ignore_eos=True)
    outs = engine.generate(batch, [asking, plain, asking], use_tqdm=False)
    for i, (ids, out) in enumerate(zip(batch, outs)):
        c = out.outputs[0]
        expected = completion_logprobs(model, ids, c.token_ids, 0.8)
        np.testing.assert_allclose(c.logprobs, expected.gather(1, torch.tensor(c.token_ids)[:, None])[:, 0],
                                   atol=1e-3, rtol=0)
        if i != 1:
            assert_prompt_logprobs(out.prompt_logprobs, model, ids, 2, temperature=0.8)
            for t, top in enumerate(c.top_logprobs):
                assert_top(top, expected[t], 5)


def test_reported_logprobs_have_the_samplers_bits_on_the_triton_path():
    """Every logprob the engine reports beyond the sampler's (top-k alternatives, "temperature" logprobs, prompt
    logprobs) comes from its token_logprobs op, so on the Triton path (the kernels run here by the interpreter)
    it has the bits the sampler gives the same token, not torch's log-softmax's (a different summation order:
    ulps apart), truncated rows (top-k, top-p, min-p) included. So a sampled token's entry in its top-k equals
    its logprob, and scoring an untruncated completion as a prompt reproduces its sampling logprobs bit for bit."""
    from rollout_kernels import get_ops
    from rollout_engine.logprobs import reduce_rows

    ops = get_ops("cuda")  # the Triton set; the interpreter runs it on host tensors
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 1000, generator=g) * 3  # 6 rows: the vocabulary in 2 splits here
    temperature = torch.tensor([0.0, 1.0, 0.7, 1.3, 1.0, 0.5])  # rows 0 and 3 untruncated
    top_k, top_p = torch.tensor([-1, 5, 50, -1, 3, 10]), torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0, 0.95])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0, 0.0])
    tokens, processed, raw = ops.sample(logits, temperature, top_k, top_p, min_p, torch.arange(6), torch.full((6,), 3))
    rows = [dict(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m))
            for t, k, p, m in zip(temperature, top_k, top_p, min_p)]
    for mode, sampled in (("processed", processed), ("raw", raw)):
        params = [SamplingParams(**row, logprobs=3, logprobs_mode=mode) for row in rows]
        block = reduce_rows(logits, tokens, params, False, 3, ops.token_logprobs)
        assert torch.equal(block[:, 0], sampled.double())
        for row, token, lp in zip(block, tokens.tolist(), sampled.tolist()):
            top = dict(zip(row[4:].long().tolist(), row[1:4].tolist()))
            assert top.get(token, lp) == lp  # where the sampled token is among the top 3, the same bits
        assert sum(token in row[4:].long().tolist() for row, token in zip(block, tokens.tolist())) >= 3
    # scored as a prompt (untruncated: for rows 0 and 3 the distribution they were sampled from), over the same
    # rows (outside batch_invariant the vocabulary split follows the number of rows): the sampler's bits
    params = [SamplingParams(temperature=float(t), prompt_logprobs=0) for t in temperature]
    scored = reduce_rows(logits, tokens, params, True, 0, ops.token_logprobs)[:, 0]
    assert torch.equal(scored[[0, 3]], processed[[0, 3]].double())


def test_a_sampled_tokens_top_k_entry_is_its_logprob():
    """The sampler may split the vocabulary otherwise for its whole batch than the asking rows' reduction does (the
    default mode, on the GPU): the sampled token's top-k entry is still exactly its reported logprob."""
    from rollout_engine.logprobs import asked

    row = np.array([-1.0, -0.5, -1.0000001, -2.0, 7, 3, 9])  # the token's logprob, top 3 values, their ids
    logprob, top = asked(SamplingParams(logprobs=3), 3, -1.0, row)
    assert logprob == -1.0 and top == {7: -0.5, 3: -1.0, 9: -2.0}
    assert list(top) == [7, 3, 9]  # most likely first, as before
