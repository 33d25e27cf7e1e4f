"""Errors the server answers in OpenAI's shape, {"error": {...}}, whatever raised them. In process, over a scripted
engine (server_fixtures.TokenEngine)."""
import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from rollout_engine.server import create_app  # noqa: E402
from server_fixtures import TokenEngine  # noqa: E402


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
