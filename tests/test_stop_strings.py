"""Stop strings against the tokenizer's special tokens: the text they are matched against skips every special
token (`skip_special_tokens=True`), so a stop string that is a special token's whole text ("<|im_end|>", "</s>",
as clients and eval harnesses send them) also stops at that token; the window that reaches back past tokens that
decode to nothing: test_generation.py."""
import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rollout_engine import AsyncEngine, Engine, SamplingParams
from rollout_engine.stop_strings import special_stop_ids, special_tokens

ENGINE = dict(device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8)
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7]}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine(tiny_checkpoint, **ENGINE)


def special_ids(tok) -> dict[str, int]:
    """The tiny tokenizer's three special tokens: <|endoftext|> (its EOS, in all_special_ids) and
    <|im_start|>/<|im_end|> (added tokens marked special, not in all_special_ids)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert tok.convert_tokens_to_ids("<|im_end|>") not in tok.all_special_ids  # what makes the case interesting
    return ids


def test_a_stop_string_that_is_a_special_token_stops_at_that_token(engine):
    """Only a stop string equal to a special token's whole text names it; one that holds it among other text
    can only match text the model spells in ordinary pieces. special_tokens is built once per tokenizer."""
    tok = engine.tokenizer
    ids, specials = special_ids(tok), special_tokens(tok)
    assert special_tokens(tok) is specials
    assert special_stop_ids(["<|im_end|>"], specials) == [ids["<|im_end|>"]]
    assert special_stop_ids(["fine", "<|endoftext|>", "<|im_start|>"], specials) == sorted(
        [ids["<|endoftext|>"], ids["<|im_start|>"]])
    assert special_stop_ids(["done<|im_start|>", "<|im_end", "|>", "im_end"], specials) == []


def test_a_sample_stops_at_the_special_token_its_stop_string_names(tiny_checkpoint):
    """With the final norm's weight at zero every logit is equal and greedy decoding emits token 0, the EOS
    (<|endoftext|>); with ignore_eos it runs to max_tokens, unless stop="<|endoftext|>" stops it there."""
    engine = Engine(tiny_checkpoint, **ENGINE)
    norm = engine.model.model.norm.weight
    engine.update_weights([("model.norm.weight", torch.zeros_like(norm))])
    eos = special_ids(engine.tokenizer)["<|endoftext|>"]
    plain = engine.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == [eos] * GREEDY["max_tokens"] and plain.finish_reason == "length"
    out = engine.generate(PROMPT, SamplingParams(stop="<|endoftext|>", **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""


@pytest.mark.parametrize("stop", ["<|im_end|>", ["fine", "<|endoftext|>"], "done<|im_start|>", "<|im_end"])
def test_stop_strings_around_special_tokens_are_accepted(engine, stop):
    """Such a request runs (it was refused once, which broke clients that send "</s>" as a stop), the caller's
    SamplingParams is left as it was, and the greedy tokens are those without the stop where none is reached."""
    params = SamplingParams(stop=stop, **GREEDY)
    before = (list(params.stop or []) if not isinstance(stop, str) else stop, params.stop_token_ids)
    out = engine.generate([PROMPT, PROMPT], params, use_tqdm=False)
    plain = engine.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    for o in out:
        n = len(o.outputs[0].token_ids)
        assert o.outputs[0].token_ids == plain.token_ids[:n]
    assert params.stop_token_ids == before[1]  # the engine stops on a copy


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with its final norm's weight at zero: every logit is equal, so greedy decoding emits
    token 0, the EOS (<|endoftext|>), at every step."""
    path = tmp_path_factory.mktemp("eos")
    for file in tiny_checkpoint.iterdir():
        shutil.copy(file, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"].zero_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # for the server's chat route
    tokenizer.save_pretrained(path)
    return path


def test_async_engine_stops_at_the_special_token_its_stop_string_names(eos_checkpoint):
    """AsyncEngine.generate and .stream stop where Engine.generate does (they dropped the params copy that
    carries the token's id, and ran to max_tokens)."""
    params = SamplingParams(stop="<|endoftext|>", **GREEDY)

    async def main(async_engine):
        out = await async_engine.generate([5, 6, 7], params)
        snapshots = [snap async for snap in async_engine.stream([5, 6, 7], params)]
        return out, snapshots[-1]

    with AsyncEngine(eos_checkpoint, **ENGINE) as async_engine:
        eos = special_ids(async_engine.engine.tokenizer)["<|endoftext|>"]
        for out in asyncio.run(main(async_engine)):
            assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
    assert params.stop_token_ids == []  # the caller's params are left as they were


def test_the_server_stops_at_the_special_token_its_stop_string_names(eos_checkpoint, tmp_path):
    """/v1/completions and /v1/chat/completions, whole and streamed, stop at "<|endoftext|>"."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from server_fixtures import AUTH, running_server

    with running_server(eos_checkpoint, tmp_path / "server.log") as (_, url):
        for route, body in (("completions", {"prompt": [5, 6, 7]}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                answer = httpx.post(f"{url}/v1/{route}", headers=AUTH, timeout=60, json={
                    **body, "model": "tiny", "stop": ["<|endoftext|>"], "stream": stream, "ignore_eos": True,
                    "max_tokens": GREEDY["max_tokens"], "temperature": 0})
                assert answer.status_code == 200, answer.text
                assert '"finish_reason":"stop"' in answer.text.replace(" ", ""), (route, stream, answer.text)
                assert '"length"' not in answer.text, (route, stream)


def test_async_engine_accepts_a_special_stop(tiny_checkpoint):
    params = SamplingParams(stop=["<|im_end|>"], **GREEDY)

    async def main(async_engine):
        out = await async_engine.generate([5, 6, 7], params)
        async for _ in async_engine.stream([5, 6, 7], params):
            pass
        return out

    with AsyncEngine(tiny_checkpoint, **ENGINE) as async_engine:
        out = asyncio.run(main(async_engine))
    assert 1 <= len(out.outputs[0].token_ids) <= GREEDY["max_tokens"]
