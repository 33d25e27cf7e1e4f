"""The server reads the engine's status once per answer. EngineClient's properties each read the latest status,
which a status message arriving between two reads changes (a pushed update, a sleep by another caller): an answer
built from several reads could mix two states. In process, over a scripted engine whose state moves on at every
read, as EngineClient's does when messages are waiting."""
import asyncio

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from rollout_engine.server import create_app  # noqa: E402
from server_fixtures import TokenEngine, tokenizer  # noqa: E402, F401  (tokenizer: a fixture)

STATES = [  # what the engine goes through: awake at version 0, asleep (level 2), updated to version 1 and woken
    {"sleeping": False, "weights_ready": True, "weight_version": 0},
    {"sleeping": True, "weights_ready": False, "weight_version": 0},
    {"sleeping": True, "weights_ready": True, "weight_version": 1},
    {"sleeping": False, "weights_ready": True, "weight_version": 1},
]


class MovingEngine(TokenEngine):
    """A TokenEngine whose every read of its status (whole or a field) first takes in the next state."""

    def __init__(self, tokenizer, first: int):
        super().__init__(tokenizer, [5, 6])
        self.reads = first

    def _next(self) -> dict:
        state = STATES[self.reads % len(STATES)]
        self.reads += 1
        return {**state, "weights_asleep": [], "kv_cache_asleep": False}

    status = property(lambda self: self._next(), lambda self, value: None)  # TokenEngine's __init__ sets them
    is_sleeping = property(lambda self: self._next()["sleeping"], lambda self, value: None)
    weights_ready = property(lambda self: self._next()["weights_ready"], lambda self, value: None)
    weight_version = property(lambda self: self._next()["weight_version"])


def answers(engine, requests):
    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(engine)),
                                     base_url="http://127.0.0.1") as client:
            return [await client.request(method, path, json=body) for method, path, body in requests]

    return asyncio.run(asyncio.wait_for(main(), 30))


@pytest.mark.parametrize("first", range(len(STATES)))
def test_health_reports_one_state_of_the_engine(tokenizer, first):
    health = answers(MovingEngine(tokenizer, first), [("GET", "/health", None)])[0].json()
    assert {k: health[k] for k in STATES[0]} in STATES, health


@pytest.mark.parametrize("first", range(len(STATES)))
def test_generation_is_refused_or_served_on_one_state(tokenizer, first):
    """A request is served only from an awake state with its weights ready; refused (503) otherwise, with the
    reason of the state it was refused on."""
    r = answers(MovingEngine(tokenizer, first), [("POST", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2})])[0]
    state = STATES[first]
    if not state["sleeping"] and state["weights_ready"]:
        assert r.status_code == 200, r.text
    else:
        assert r.status_code == 503 and ("asleep" in r.text) == state["sleeping"], r.text
