"""Stop strings against the tokenizer's special tokens: the text they are matched against skips every special
token (`skip_special_tokens=True`), so a stop string that spells one is refused (the window that reaches back
past tokens that decode to nothing: test_generation.py)."""
import asyncio

import pytest

from rollout_engine import AsyncEngine, Engine, SamplingParams

ENGINE = dict(device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8)
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine(tiny_checkpoint, **ENGINE)


def special_ids(tok) -> dict[str, int]:
    """The tiny tokenizer's three special tokens: <|endoftext|> (its EOS, in all_special_ids) and
    <|im_start|>/<|im_end|> (added tokens marked special, not in all_special_ids)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert tok.convert_tokens_to_ids("<|im_end|>") not in tok.all_special_ids  # what makes the case interesting
    return ids


@pytest.mark.parametrize("stop, token", [
    ("<|im_end|>", "<|im_end|>"),                     # an added special token, not in all_special_ids
    (["fine", "<|endoftext|>"], "<|endoftext|>"),     # the EOS; the whole call is refused for one bad stop
    ("done<|im_start|>", "<|im_start|>"),             # a stop that only contains one
])
def test_a_stop_string_spelling_a_special_token_is_refused(engine, stop, token):
    tok = engine.tokenizer
    token_id = special_ids(tok)[token]
    prompt = {"prompt_token_ids": [5, 6, 7]}
    expected = engine.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids
    good, bad = SamplingParams(**GREEDY), SamplingParams(stop=stop, **GREEDY)
    for params in (bad, [good, bad]):  # alone, or the second of two prompts: nothing of the call runs
        with pytest.raises(ValueError) as err:
            engine.generate([prompt] * (2 if isinstance(params, list) else 1), params, use_tqdm=False)
        message = str(err.value)
        assert "stop" in message and token in message and f"stop_token_ids=[{token_id}]" in message, message
        assert not engine.loop.has_work()  # no request half added
    out = engine.generate(prompt, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == expected  # the engine is unaffected
    # the way that works: the token's id
    out = engine.generate(prompt, SamplingParams(stop_token_ids=[token_id], **GREEDY), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_stop_strings_around_special_tokens_are_allowed(engine):
    """Text that is not a special token's whole text (a part of one, plain text) can match, so it is kept."""
    prompt = {"prompt_token_ids": [5, 6, 7]}
    for stop in ("<|im_end", "|>", "im_end", "<|", "endoftext"):
        engine.generate(prompt, SamplingParams(stop=stop, **GREEDY), use_tqdm=False)


def test_async_engine_refuses_a_special_stop_and_stays_usable(tiny_checkpoint):
    bad = SamplingParams(stop=["<|im_end|>"], **GREEDY)

    async def main(async_engine):
        with pytest.raises(ValueError, match=r"stop.*<\|im_end\|>.*stop_token_ids"):
            await async_engine.generate([5, 6, 7], bad)
        with pytest.raises(ValueError, match=r"stop.*<\|im_end\|>.*stop_token_ids"):
            async for _ in async_engine.stream([5, 6, 7], bad):
                pass
        return await async_engine.generate([5, 6, 7], SamplingParams(**GREEDY))

    with AsyncEngine(tiny_checkpoint, **ENGINE) as async_engine:
        out = asyncio.run(main(async_engine))
    assert len(out.outputs[0].token_ids) == GREEDY["max_tokens"]

