"""Errors the server answers in OpenAI's shape, {"error": {...}}, whatever raised them. In process, over a scripted
engine (server_fixtures.TokenEngine)."""
import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from rollout_engine.server import create_app  # noqa: E402
from server_fixtures import TokenEngine, tokenizer  # noqa: E402, F401  (tokenizer: a fixture)


class FailingEngine(TokenEngine):
    """An engine whose step fails with an error the server has no rule for (the engine process's torch error
    arrives as a RuntimeError)."""

    async def generate(self, prompt, params=None, request_id=None):
        raise RuntimeError("CUDA error: the step failed")


def test_an_unexpected_engine_error_is_a_json_500_with_its_message(tiny_checkpoint):
    from transformers import AutoTokenizer

    app = create_app(FailingEngine(AutoTokenizer.from_pretrained(tiny_checkpoint), [5, 6]))

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})

    r = asyncio.run(asyncio.wait_for(main(), 30))
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"] == {"message": "RuntimeError: CUDA error: the step failed",
                                 "type": "internal_server_error", "param": None, "code": None}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": [5, 6], "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": [5, 6], "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": [5, 6], "top_p": 10 ** 400}, "top_p"),  # was an OverflowError, a 500
    ("/v1/completions", {"prompt": [5, 6], "n": 2, "best_of": 1}, "best_of"),
    ("/v1/completions", {"prompt": "", "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"prompt": [5, 6], "stop_token_ids": [10 ** 6]}, "stop_token_ids"),  # the engine's check
    ("/v1/completions", {"prompt": [5, 6], "bogus": 1}, None),  # OpenAI names no param for an unknown one
    ("/v1/completions", [1, 2], None),
])
def test_a_refusal_names_the_field_at_fault_in_error_param(tokenizer, path, body, param):
    """OpenAI's error.param: clients show it beside the message (it was always null here)."""
    app = create_app(TokenEngine(tokenizer, [5, 6]))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.post(path, json={"model": "tiny", **body} if isinstance(body, dict) else body)

    r = asyncio.run(asyncio.wait_for(main(), 30))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    assert not r.json()["error"]["message"].startswith("sampling_params."), "a name the request does not have"
