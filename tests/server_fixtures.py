"""What the server test files share: the tiny checkpoint with a chat template, a `rollout-engine serve`
subprocess on a free port (killed at the end whatever happened), and a scripted engine for in-process apps."""
import asyncio
import contextlib
import os
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 256
ENGINE = dict(device="cpu", kv_cache_memory=16_000_000, max_model_len=MAX_MODEL_LEN, max_num_seqs=64)
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import AutoTokenizer

    from rollout_engine.tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("served"))
    tokenizer = AutoTokenizer.from_pretrained(path)
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHAT_TEMPLATE
        tokenizer.save_pretrained(path)
    return path


def metrics(url) -> dict:
    """The server's /metrics: (sample name, its labels sorted) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def serve_command(checkpoint, port: int, *flags: str) -> list[str]:
    return [sys.executable, "-m", "rollout_engine.cli", "serve", str(checkpoint), "--port", str(port),
            "--api-key", KEY, "--device", "cpu", "--kv-cache-memory", str(ENGINE["kv_cache_memory"]),
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(ENGINE["max_num_seqs"]),
            "--served-model-name", "tiny", "--no-access-log", "--log-level", "warning", *flags]


@contextlib.contextmanager
def running_server(checkpoint, log_path, *flags: str, env: dict | None = None):
    """(the server's Popen, its base URL) once /health answers 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(log_path, "w+")
    proc = subprocess.Popen(serve_command(checkpoint, port, *flags), stdout=log, stderr=subprocess.STDOUT,
                            env=os.environ.copy() if env is None else env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", headers=AUTH, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail("the server did not answer /health within 90 s")
            time.sleep(0.2)
        yield proc, url
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    """The base URL of a server subprocess of the tiny checkpoint; killed at the end whatever happened."""
    with running_server(checkpoint, tmp_path_factory.mktemp("log") / "server.log") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    """The official openai client of `server`."""
    import openai

    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux): the server's engine process."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


class TokenEngine:
    """What create_app reads of an EngineClient, replying the tokens `ids` to every request: a stream's snapshots
    add one token each, `pause` seconds apart (0.01: the server sends each before the next arrives)."""

    def __init__(self, tokenizer, ids, finish_reason: str = "length", pause: float = 0.0, stop_reason=None):
        self.tokenizer, self.vocab_size, self.model_path, self.max_seq_len = tokenizer, len(tokenizer), "tiny", 256
        self.is_sleeping, self.sleep_state, self.weights_ready = False, {"is_sleeping": False}, True
        self.status = {"sleeping": False, "weights_asleep": [], "kv_cache_asleep": False, "weight_version": 0,
                       "weights_ready": True}
        self.weight_endpoint, self.is_running = None, True
        self.ids, self.finish_reason, self.pause, self.stop_reason = ids, finish_reason, pause, stop_reason

    def _output(self, count: int, done: bool):
        ids = self.ids[:count]
        sample = SimpleNamespace(index=0, token_ids=ids, text=self.tokenizer.decode(ids), logprobs=[-0.5] * count,
                                 finish_reason=self.finish_reason if done else None, weight_versions=[0] * count,
                                 stop_reason=self.stop_reason if done else None)
        return SimpleNamespace(outputs=[sample], weight_version=0, finished=done, metrics={})

    async def generate(self, prompt, params=None, request_id=None):
        return self._output(len(self.ids), True)

    async def stream(self, prompt, params=None, request_id=None):
        for count in range(1, len(self.ids) + 1):
            await asyncio.sleep(self.pause)
            yield self._output(count, count == len(self.ids))

    async def abort(self, request_id):
        return None


def replying(tokenizer, reply: str, stop_reason=None) -> TokenEngine:
    """A TokenEngine whose reply is the text `reply`, a token per snapshot, stopped ("stop", `stop_reason`)."""
    ids = tokenizer(reply, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == reply, "the tiny tokenizer must spell the reply exactly"
    return TokenEngine(tokenizer, ids, finish_reason="stop", stop_reason=stop_reason)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    """The tiny checkpoint's tokenizer, with a plain chat template when it has none."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    if not tok.chat_template:
        tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                             "{% if add_generation_prompt %}assistant: {% endif %}")
    return tok


TOOLS = [{"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                                  "required": ["a", "b"]}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
MESSAGES = [{"role": "user", "content": "what is 1 + 2?"}]


def ask(tokenizer, reply, parser="hermes", stream=False, reasoning=None, **request):
    """The official openai client's answer from an app (tool-call parser `parser`, reasoning parser `reasoning`)
    over an engine that replies `reply`, to a request offering TOOLS unless `request` says otherwise: the
    completion, or (content streamed, reasoning streamed, tool calls streamed, finish_reason) of a stream."""
    import openai

    from rollout_engine.server import create_app

    app = create_app(replying(tokenizer, reply), tool_call_parser=parser, reasoning_parser=reasoning)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            client = openai.AsyncOpenAI(api_key="none", base_url="http://127.0.0.1/v1", http_client=http)
            request.setdefault("tools", TOOLS)
            if not stream:
                return await client.chat.completions.create(model="tiny", messages=MESSAGES, **request)
            content, thought, calls, finish = [], [], [], None
            async for chunk in await client.chat.completions.create(model="tiny", messages=MESSAGES, stream=True,
                                                                     **request):
                delta = chunk.choices[0].delta
                content.append(delta.content or "")
                thought.append(getattr(delta, "reasoning_content", None) or "")
                calls += delta.tool_calls or []
                finish = chunk.choices[0].finish_reason or finish
            return "".join(content), "".join(thought), calls, finish

    return asyncio.run(asyncio.wait_for(main(), 60))
