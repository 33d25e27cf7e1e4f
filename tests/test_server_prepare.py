"""The server's front prepares a generation request (parse, chat rendering, tokenization) off its event loop: a
long prompt being tokenized must not hold other requests. In process, over a stand-in for EngineClient (the app
reads only these attributes before it reaches the engine)."""
import asyncio
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from rollout_engine.server import create_app  # noqa: E402


class SleepingEngine:
    """What create_app reads of an EngineClient, for an engine that sleeps: generation ends with 503."""

    def __init__(self, tokenizer):
        self.tokenizer, self.vocab_size, self.model_path, self.max_seq_len = tokenizer, 512, "tiny", 256
        self.is_sleeping, self.sleep_state, self.weights_ready = True, {"is_sleeping": True}, True
        self.status = {"sleeping": True, "weights_asleep": ["weights"], "kv_cache_asleep": True, "weight_version": 0,
                       "weights_ready": True}
        self.weight_endpoint = None


def test_a_prompt_being_tokenized_does_not_hold_other_requests(tiny_checkpoint, monkeypatch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    encode, calls, inside = type(tokenizer).__call__, [], threading.Event()

    def slow(self, *args, **kwargs):  # a tokenization that takes a second
        calls.append(threading.current_thread().name)
        inside.set()
        time.sleep(1.0)
        inside.clear()
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", slow)
    app = create_app(SleepingEngine(tokenizer))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            completion = asyncio.create_task(client.post("/v1/completions", json={"prompt": "hello there"}))
            while not calls:
                await asyncio.sleep(0.005)
            models = await client.get("/v1/models")
            answered_while_tokenizing = inside.is_set()
            return await completion, models, answered_while_tokenizing

    completion, models, answered_while_tokenizing = asyncio.run(asyncio.wait_for(main(), 30))
    assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny"
    assert answered_while_tokenizing, "/v1/models waited for another request's tokenization"
    assert calls and calls[0] != threading.main_thread().name
    assert completion.status_code == 503 and "asleep" in completion.json()["error"]["message"]


def test_a_chat_too_long_to_fit_is_refused_before_rendering(tiny_checkpoint, monkeypatch):
    """/v1/chat/completions refuses messages whose text no sequence can hold without rendering them (as
    /v1/completions refuses such a prompt without tokenizing it): a 10 MB chat body took 18 s to refuse, and
    every other request waited behind its rendering."""
    from transformers import AutoTokenizer

    from rollout_engine.inputs import NORMALIZER_SLACK, longest_piece

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}"
    engine = SleepingEngine(tokenizer)
    rendered, apply = [], type(tokenizer).apply_chat_template
    monkeypatch.setattr(type(tokenizer), "apply_chat_template",
                        lambda self, *args, **kwargs: rendered.append(1) or apply(self, *args, **kwargs))
    app = create_app(engine)
    bound = NORMALIZER_SLACK * engine.max_seq_len * longest_piece(tokenizer)

    async def post(content):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            return await client.post("/v1/chat/completions",
                                     json={"messages": [{"role": "user", "content": content}], "max_tokens": 1})

    too_long = asyncio.run(post("1" * (bound + 1 - len("user"))))
    assert too_long.status_code == 400, too_long.text
    assert f"messages has {bound + 1} characters" in too_long.json()["error"]["message"]
    assert rendered == []
    asleep = asyncio.run(post("hello"))  # a chat within the bound renders and reaches the (sleeping) engine
    assert rendered and asleep.status_code == 503


def test_an_allowed_origin_gets_what_a_browser_needs_and_others_are_refused(tiny_checkpoint):
    """--allowed-origin: a page of that origin may call the server from a browser, which first asks (a CORS
    preflight, without the key) and then reads the answer only with Access-Control-Allow-Origin; any other
    origin is refused, preflight or not; a key is still needed for the request itself."""
    from server_fixtures import TokenEngine
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    page = "http://localhost:3000"
    app = create_app(TokenEngine(tokenizer, tokenizer.encode("hi there")), api_key="k", allowed_origins=[page])
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type,authorization"}
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            return (await http.options("/v1/completions", headers={"Origin": page, **ask}),
                    await http.post("/v1/completions", json=body, headers={"Origin": page, "Authorization": "Bearer k"}),
                    await http.post("/v1/completions", json=body, headers={"Origin": page}),
                    await http.options("/v1/completions", headers={"Origin": "http://evil.example", **ask}))

    preflight, served, keyless, other = asyncio.run(main())
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] == page
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert served.status_code == 200 and served.headers["access-control-allow-origin"] == page
    assert keyless.status_code == 401
    assert other.status_code == 403 and "access-control-allow-origin" not in other.headers


def test_a_key_read_with_a_trailing_newline_is_the_key_clients_send(tiny_checkpoint):
    """A key from a secret file often ends in a newline, which no HTTP header can carry: the key is taken without
    its surrounding white space (as the client's token is), so the server is not locked to every client; a key
    of white space only is refused, as an empty one is."""
    from server_fixtures import TokenEngine
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    app = create_app(TokenEngine(tokenizer, tokenizer.encode("hi")), api_key="s3cret\n")
    body = {"model": "tiny", "prompt": "a", "max_tokens": 1}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            return [await http.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})
                    for key in ("s3cret", "s3cre")]

    right, wrong = asyncio.run(main())
    assert right.status_code == 200 and wrong.status_code == 401
    with pytest.raises(ValueError, match="api_key must be None"):
        create_app(TokenEngine(tokenizer, [5]), api_key=" \n")
