"""A completions stream's logprobs.text_offset equals the whole reply's, however the tokens fall into chunks: a
byte that later tokens show never forms a character moves the offsets of the tokens after it, so a stream sends
a token's entry once its text is stable. In process, the official openai client over a scripted engine that
emits a given list of tokens, one per snapshot (each its own chunk)."""
import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from rollout_engine.server import create_app  # noqa: E402
from rollout_engine.server.detokenize import text_offsets  # noqa: E402
from server_fixtures import TokenEngine  # noqa: E402


def complete(tokenizer, ids):
    """(whole reply's choice, the stream's chunks' choices) of a completions request with logprobs."""
    app = create_app(TokenEngine(tokenizer, ids, pause=0.01))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(api_key="none", base_url="http://127.0.0.1/v1", http_client=http)
            request = dict(model="tiny", prompt="hi", max_tokens=len(ids), logprobs=0)
            whole = (await client.completions.create(**request)).choices[0]
            chunks = [c.choices[0] async for c in await client.completions.create(stream=True, **request)]
            return whole, chunks

    return asyncio.run(asyncio.wait_for(main(), 60))


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_checkpoint)


def test_streamed_offsets_equal_the_whole_replys(tokenizer):
    lone = tokenizer.convert_tokens_to_ids("\u00e4")  # byte 0xE4 (a 3-byte lead) in the byte-level alphabet
    assert tokenizer.decode([lone]) == "\ufffd"
    words = tokenizer(" been there", add_special_tokens=False).input_ids
    char = tokenizer("世", add_special_tokens=False).input_ids
    for ids in ([lone, lone, *words], [lone, *words], [*char, *words], [*words, lone, lone]):
        whole, chunks = complete(tokenizer, ids)
        entries = [c.logprobs for c in chunks if c.logprobs is not None]
        streamed = [o for lp in entries for o in lp.text_offset]
        assert whole.logprobs.text_offset == text_offsets(tokenizer, ids), ids
        assert streamed == whole.logprobs.text_offset, ids
        assert [t for lp in entries for t in lp.tokens] == whole.logprobs.tokens
        assert "".join(c.text for c in chunks) == whole.text == tokenizer.decode(ids)
        assert len(chunks) >= 2  # the tokens did come in several chunks
