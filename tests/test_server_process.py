"""The server's two processes: the HTTP front and the engine process, and what happens when one of them fails.

The engine process killed mid-stream: the stream ends with an error event and a waiting request gets a 503,
within seconds; /health says unhealthy. Malformed messages on the engine's command socket are dropped and the
engine keeps serving the same tokens. A bad model path is refused at start-up with the engine's message. A
front that dies takes its engine process with it."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
zmq = pytest.importorskip("zmq")

from rollout_engine import Engine, SamplingParams  # noqa: E402
from rollout_engine.server import EngineClient, engine_link  # noqa: E402
from rollout_engine.server.wire import pack, unpack  # noqa: E402
from server_fixtures import AUTH, ENGINE, alive, checkpoint, children, metrics, running_server  # noqa: E402,F401

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
DEAD_WITHIN_S = 5.0  # the front checks on the engine process every 0.25 s; the rest is margin for a busy CPU


def wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def reference(checkpoint):
    engine = Engine(checkpoint, **ENGINE)
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def client(checkpoint):
    with EngineClient(checkpoint, **ENGINE) as client:
        yield client


def test_wire_refuses_malformed_messages():
    header, cols = unpack(pack({"kind": "tokens"}, {"token_ids": [1, 2], "logprobs": [-0.5, float("-inf")]}))
    assert header["kind"] == "tokens" and cols == {"token_ids": [1, 2], "logprobs": [-0.5, float("-inf")]}
    bad = [[], [b"\xff"], [b"[1]"], [b"{}"], [b'{"kind": 1}'], [b'{"kind": "x", "columns": ["token_ids"]}'],
           [b'{"kind": "x", "columns": ["pickle"]}', b"\0" * 8], [b'{"kind": "x", "columns": ["logprobs"]}', b"\0" * 7],
           [b'{"kind": "x", "columns": "token_ids"}', b""], [b'{"kind": "x", "columns": [["keys"]]}', b""]]
    for frames in bad:
        with pytest.raises(ValueError):
            unpack(frames)


@pytest.mark.parametrize("entries", [1, 7, 1 << 20])
def test_prompt_scores_travel_in_messages_of_bounded_size(checkpoint, monkeypatch, entries):
    """A long prompt's scores (k + 1 entries a position) would outgrow one message (the front's socket drops a
    message over MAX_MESSAGE_BYTES without a word): they go in "prompt_scores" messages of at most PROMPT_ENTRIES
    entries each, ahead of the tokens, and the front puts them back together in order, once."""
    from types import SimpleNamespace

    from rollout_engine.server import engine_process, request_records

    monkeypatch.setattr(engine_process, "PROMPT_ENTRIES", entries)
    engine = Engine(checkpoint, **ENGINE)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    want = engine.generate([list(range(3, 40))], params, use_tqdm=False)[0].prompt_logprobs
    sent = []
    loop = engine_process.EngineLoop(engine, None, SimpleNamespace(send_multipart=sent.append))
    request = engine_process.SentRequest(9, params, ids=list(range(3, 40)))
    for scores in (want, [None]):  # a long prompt; a one-token prompt, which has no position to score
        sent.clear()
        seq = SimpleNamespace(prompt_logprobs=scores, num_prompt_tokens=len(scores))
        request.prompt_sent = False
        loop.send_prompt_scores(request, seq)
        loop.send_prompt_scores(request, seq)  # once
        messages = [unpack(frames) for frames in sent]
        assert all(len(cols["prompt_ids"]) <= max(entries, 3) for _, cols in messages)
        assert len(messages) == max(1, -(-(len(scores) - 1) // max(1, entries // 3)))
        record = SimpleNamespace(prompt_logprobs=None)
        for header, cols in messages:
            assert header == {"kind": "prompt_scores", "key": 9, "positions": len(scores) - 1,
                              "columns": ["prompt_sizes", "prompt_ids", "prompt_logprobs"]}
            request_records.add_prompt_scores({9: record}, header, cols)
        assert record.prompt_logprobs == scores


def test_client_generates_what_the_engine_does(client, reference):
    async def main():
        outs = await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS))
        snapshots = [s async for s in client.stream(PROMPTS[0], GREEDY)]
        pair = await client.generate(PROMPTS[1], SamplingParams(n=2, max_tokens=5, seed=1, ignore_eos=True))
        return outs, snapshots, pair

    outs, snapshots, pair = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert all(o.outputs[0].finish_reason == "length" and o.outputs[0].weight_versions == [0] * 12 for o in outs)
    assert outs[0].prompt_token_ids == PROMPTS[0] and outs[0].outputs[0].text is not None
    ids = [s.outputs[0].token_ids for s in snapshots]
    assert ids[-1] == reference[0] and all(a == b[: len(a)] for a, b in zip(ids, ids[1:]))  # cumulative
    assert [len(c.token_ids) for c in pair.outputs] == [5, 5] and [c.index for c in pair.outputs] == [0, 1]


def test_malformed_commands_do_not_stop_the_engine(client, reference):
    """Anyone who can reach the command socket (this user only: a 0700 directory) sends garbage; the engine
    drops it and serves the same tokens."""
    context = zmq.Context()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 1000)
    sock.connect(client.command_endpoint)
    garbage = [[b""], [b"\xff\xfe"], [b"null"], [b"[1, 2]"], [b'{"kind": "rm -rf"}'], [b'{"kind": "submit"}'],
               [b'{"kind": "submit", "key": "x", "prompt_token_ids": [1], "params": {}}'],
               [json.dumps({"kind": "submit", "key": 10**9, "prompt_token_ids": [1, 10**9], "params": {}}).encode()],
               [json.dumps({"kind": "submit", "key": 10**9, "prompt_token_ids": [1], "params": {"bogus": 1}}).encode()],
               [json.dumps({"kind": "submit", "key": 10**9, "prompt_token_ids": [1], "params": []}).encode()],
               [json.dumps({"kind": "submit", "key": 2**70, "prompt_token_ids": [1], "params": {}}).encode()],
               [b'{"kind": "x", "columns": [["keys"]]}', b""], [b'{"kind": "abort", "key": [1]}'],
               [b'{"kind": "pause", "mode": "never", "id": 10}'],
               [b'{"kind": "pause", "mode": "wait"}'], [b'{"kind": "sleep", "level": 9, "id": 11}'],
               [b'{"kind": "stats", "columns": ["keys"]}', b"\0" * 3], [b'{"kind": "stats"}', b"extra"],
               [b"\x80\x04\x95" + b"\0" * 64]]  # a pickle's opening bytes
    for frames in garbage:
        sock.send_multipart(frames)
    sock.close()
    context.term()
    time.sleep(0.5)
    assert client.is_running

    async def main():
        return await asyncio.gather(*(client.generate(p, GREEDY) for p in PROMPTS)), await client.stats()

    outs, stats = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert stats["num_seqs_running"] == 0 and stats["kv_blocks_used"] == 0 and not stats["sleeping"]


def test_a_wait_pause_outlasts_a_retracting_sleep(client):
    """/sleep with mode "retract" pauses on its own account and puts the caller's pause back after the wake: a
    caller's "wait" pause still waiting then is answered when its requests finish, not refused as if a caller had
    held them."""
    async def main():
        long = SamplingParams(max_tokens=250, ignore_eos=True, temperature=0)
        running = [asyncio.create_task(client.generate([1, 2, 3 + i], long)) for i in range(4)]
        await asyncio.sleep(0.05)
        waiting = asyncio.create_task(client.pause_generation("wait"))
        await asyncio.sleep(0.05)
        await client.sleep(1, None, "retract")
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await client.wake()
        outs = await asyncio.wait_for(asyncio.gather(*running), 120)
        await asyncio.wait_for(waiting, 30)  # answered, without an error
        await client.continue_generation()
        return outs

    outs = asyncio.run(main())
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 250 for o in outs)


def test_client_status_is_a_copy_of_one_state_of_the_engine(client):
    """EngineClient.status: every field /health and the generation guard read, from one message; a copy the
    caller may change without changing the client's."""
    async def main():
        await client.sleep(1)
        asleep = client.status
        asleep["sleeping"] = False
        still = client.status
        await client.wake()
        return still, client.status

    still, awake = asyncio.run(main())
    assert {"sleeping", "weights_asleep", "kv_cache_asleep", "weight_version", "weights_ready"} <= set(awake)
    assert still["sleeping"] is True and still["kv_cache_asleep"] and still["weights_ready"]
    assert awake["sleeping"] is False and not awake["kv_cache_asleep"] and awake["weights_ready"]

def test_client_abort_pause_and_bad_input(client, monkeypatch):
    async def main():
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        await client.pause_generation("keep")
        task = asyncio.create_task(client.generate([3, 4, 5], long, request_id="held"))
        await asyncio.sleep(0.2)
        out = await client.abort("held")
        assert out.outputs[0].finish_reason == "abort" and (await task).outputs[0].finish_reason == "abort"
        assert await client.abort("held") is None
        with pytest.raises(ValueError, match="request_id="):
            await client.abort(["held"])
        await client.continue_generation()
        with pytest.raises(ValueError, match="mode='later'"):
            await client.pause_generation("later")
        with pytest.raises(ValueError, match="not ints in"):
            await client.generate([1, 10**9], GREEDY)
        # a message larger than the engine's socket takes (the limit lowered here: a request's fields are bounded
        # well below the real one): refused, nothing left behind
        monkeypatch.setattr(engine_link, "MAX_MESSAGE_BYTES", 4096)
        with pytest.raises(ValueError, match="byte message to the engine process"):
            await asyncio.wait_for(client.generate([3, 4], SamplingParams(max_tokens=2, stop=["\u00e9" * 1000] * 2),
                                                   request_id="huge"), 30)
        monkeypatch.undo()
        assert (await client.generate([3, 4], GREEDY, request_id="huge")).outputs[0].token_ids
        return await client.stats()

    stats = asyncio.run(main())
    assert stats["kv_blocks_used"] == 0 and stats["num_seqs_waiting"] == 0


def test_bad_model_path_is_a_clear_startup_error(tmp_path):
    start = time.monotonic()
    with pytest.raises(ValueError, match="nowhere"):
        EngineClient(tmp_path / "nowhere", device="cpu")
    assert time.monotonic() - start < 60
    cli = subprocess.run([sys.executable, "-m", "rollout_engine.cli", "serve", str(tmp_path / "nowhere"),
                          "--device", "cpu", "--port", "1"], capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "rollout-engine serve: error:" in cli.stderr and "nowhere" in cli.stderr


def test_a_shutdown_inside_the_event_loop_fails_what_waits_and_logs_nothing(checkpoint, caplog):
    """shutdown() on the loop the client reads on closes the socket under the reader's poll: the reader ends there
    (it raised ZMQError, logged as "Task exception was never retrieved"), and a request still in flight fails
    with EngineError (it waited for ever)."""
    import gc

    from rollout_engine import EngineError

    async def main():
        client = EngineClient(checkpoint, **ENGINE)
        await client.generate([7, 8, 9], SamplingParams(max_tokens=2))
        pending = asyncio.ensure_future(client.generate([7, 8, 9], SamplingParams(max_tokens=200, ignore_eos=True)))
        await asyncio.sleep(0.2)
        client.shutdown()
        with pytest.raises(EngineError, match="shut down"):
            await asyncio.wait_for(pending, 10)

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(main())
        gc.collect()
    assert "never retrieved" not in caplog.text


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), 1e9, True, "0.001"])
def test_a_bad_switch_interval_is_refused_before_the_engine_process_starts(tmp_path, interval):
    """sys.setswitchinterval in the engine process would refuse it (or keep 0, the opposite of what was asked):
    refused here, naming the argument, with no process started."""
    with pytest.raises(ValueError, match=r"switch_interval_s=.* is not allowed; a number of seconds in \[1e-06, "):
        EngineClient(tmp_path / "nowhere", device="cpu", switch_interval_s=interval)


def _stream_until_error(url, ready: threading.Event, result: dict) -> None:
    body = {"prompt": [7, 8, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http, http.stream("POST", f"{url}/v1/completions", json=body,
                                                        headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data: {") and '"choices"' in line:
                ready.set()
            elif line.startswith("data: {"):
                result["error"], result["at"] = json.loads(line[6:])["error"], time.monotonic()
    result["closed"] = time.monotonic()


def test_engine_process_killed_mid_stream(checkpoint, tmp_path):
    with running_server(checkpoint, tmp_path / "server.log") as (proc, url):
        engine_pid, = children(proc.pid)
        ready, streamed = threading.Event(), {}
        streamer = threading.Thread(target=_stream_until_error, args=(url, ready, streamed))
        streamer.start()
        assert ready.wait(30)
        # hold the stream mid-way with its KV, so the kill lands while it is in flight
        assert httpx.post(f"{url}/pause_generation", json={"mode": "keep"}, headers=AUTH, timeout=30).status_code == 200
        waiting = {}
        waiter = threading.Thread(target=lambda: waiting.update(r=httpx.post(
            f"{url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 8}, headers=AUTH, timeout=30),
            at=time.monotonic()))
        waiter.start()
        time.sleep(0.5)
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        streamer.join(30)
        waiter.join(30)
        assert streamed["error"]["type"] == "service_unavailable" and "engine" in streamed["error"]["message"]
        assert streamed["at"] - killed < DEAD_WITHIN_S and streamed["closed"] - killed < DEAD_WITHIN_S
        assert waiting["r"].status_code == 503 and waiting["at"] - killed < DEAD_WITHIN_S
        for path in ("/health", "/is_sleeping"):  # not the last status the engine sent, as if it still ran
            answer = httpx.get(f"{url}{path}", headers=AUTH, timeout=10)
            assert answer.status_code == 503 and "engine" in answer.json()["error"]["message"], path
        start = time.monotonic()
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [4, 5], "max_tokens": 8}, headers=AUTH, timeout=30)
        assert r.status_code == 503 and time.monotonic() - start < DEAD_WITHIN_S
        assert proc.poll() is None  # the front still answers, with errors


def test_engine_process_leaves_with_its_front(checkpoint, tmp_path):
    with running_server(checkpoint, tmp_path / "server.log") as (proc, _):
        engine_pid, = children(proc.pid)
        proc.kill()  # no shutdown: the engine process notices its parent is gone
        proc.wait(10)
        wait_until(lambda: not alive(engine_pid), 10, "the engine process to exit")


SLOW_START = """
import os, sys, time
if sys.argv[:1] == ["-c"] and os.environ.get("SLOW_ENGINE_START"):  # the engine process (the front is a file)
    import rollout_engine.engine as module
    build = module.Engine.__init__
    def slow(self, *args, **kwargs):
        time.sleep(float(os.environ["SLOW_ENGINE_START"]))
        build(self, *args, **kwargs)
    module.Engine.__init__ = slow
"""


def sitecustomize_env(tmp_path, code: str, variable: str, seconds: float) -> dict:
    """An environment whose processes run `code` as their sitecustomize, with $`variable` set to `seconds`."""
    (tmp_path / "sitecustomize.py").write_text(code)
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, variable: str(seconds)}


def slow_engine_env(tmp_path, seconds: float) -> dict:
    """An environment in which the engine process takes `seconds` more to build its Engine (a sitecustomize that
    only that process acts on): time to stop its front while the model "loads"."""
    return sitecustomize_env(tmp_path, SLOW_START, "SLOW_ENGINE_START", seconds)


def socket_dir_of(engine_pid: int) -> str:
    def config_arg() -> str | None:  # python -c MAIN CONFIG; until the child has exec'd, the front's command line
        with open(f"/proc/{engine_pid}/cmdline") as f:
            args = f.read().split("\0")
        return args[-2] if len(args) > 2 and args[-2].startswith("{") else None
    wait_until(config_arg, 30, "the engine process to exec")
    return os.path.dirname(json.loads(config_arg())["commands"][len("ipc://"):])


def test_an_engine_whose_front_dies_while_it_loads_leaves_too(checkpoint, tmp_path):
    """A front killed (SIGKILL: nothing runs) while its engine process still builds the model: the engine sees,
    once built, that the front that started it is gone, exits and removes the sockets' directory, instead of
    holding the model (and a GPU) for good."""
    (tmp_path / "front.py").write_text(f"from rollout_engine.server import EngineClient\n"
                                       f"EngineClient({str(checkpoint)!r}, **{ENGINE!r})\n")
    front = subprocess.Popen([sys.executable, str(tmp_path / "front.py")], env=slow_engine_env(tmp_path, 3),
                             cwd=tmp_path)
    try:
        wait_until(lambda: children(front.pid), 60, "the engine process to start")
        engine_pid, = children(front.pid)
        directory = socket_dir_of(engine_pid)
        front.kill()
        front.wait(10)
        wait_until(lambda: not alive(engine_pid), 60, "the orphaned engine process to exit")
        assert not os.path.exists(directory)
    finally:
        front.kill()


def test_sigterm_to_a_server_that_is_starting_stops_its_engine_at_once(checkpoint, tmp_path):
    """systemd or Kubernetes may stop a server while its model loads: SIGTERM then stops the engine process at
    once (the front's start-up stops it), not after the load."""
    from server_fixtures import serve_command

    front = subprocess.Popen(serve_command(checkpoint, 0), env=slow_engine_env(tmp_path, 60), cwd=tmp_path,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: children(front.pid), 60, "the engine process to start")
        engine_pid, = children(front.pid)
        front.send_signal(signal.SIGTERM)
        front.wait(30)
        wait_until(lambda: not alive(engine_pid), 25, "the engine process to stop")  # its load takes 60 s more
    finally:
        front.kill()


SLOW_STEPS = """
import os, time
if os.environ.get("SLOW_ENGINE_STEP"):  # each engine step takes this much longer: requests stay in flight
    import rollout_engine.loop as module
    step = module.GenerationLoop.step
    def slow(self):
        time.sleep(float(os.environ["SLOW_ENGINE_STEP"]))
        return step(self)
    module.GenerationLoop.step = slow
"""


def slow_steps_env(tmp_path, seconds: float) -> dict:
    """An environment in which each step of the served engine takes `seconds` longer."""
    return sitecustomize_env(tmp_path, SLOW_STEPS, "SLOW_ENGINE_STEP", seconds)


@pytest.mark.parametrize("shutdown_timeout, finish", [("1", "abort"), ("60", "length")])
def test_sigterm_lets_requests_finish_for_the_shutdown_timeout_then_ends_them_as_abort(checkpoint, tmp_path,
                                                                                       shutdown_timeout, finish):
    """A server stopped (SIGTERM) with requests in flight: they may finish for --shutdown-timeout seconds, and
    those still running then end as "abort" with what they have: a 200 with the partial completion, a stream
    closed with its finish_reason and [DONE]. uvicorn's grace period (5 s) used to end by cancelling them: a
    bare 500 and a stream cut mid-body, while the engine went on generating for them."""
    env = slow_steps_env(tmp_path, 0.05)  # 150 tokens: about 8 s, past uvicorn's 5 s
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 150, "ignore_eos": True}
    with running_server(checkpoint, tmp_path / "server.log", "--shutdown-timeout", shutdown_timeout,
                        env=env) as (proc, url):
        whole = {}
        waiting = threading.Thread(target=lambda: whole.update(r=httpx.post(f"{url}/v1/completions", json=body,
                                                                             headers=AUTH, timeout=120)))
        waiting.start()
        events = []
        with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True}, headers=AUTH,
                          timeout=120) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 3:  # both requests are running
                        proc.send_signal(signal.SIGTERM)
        waiting.join(120)
        assert proc.wait(90) == 0
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == finish
    assert whole["r"].status_code == 200, whole["r"].text
    choice = whole["r"].json()["choices"][0]
    assert choice["finish_reason"] == finish
    tokens = whole["r"].json()["usage"]["completion_tokens"]
    assert (tokens == 150) if finish == "length" else (0 < tokens < 150), tokens


def test_metrics_time_a_whole_answers_first_token_and_count_no_tokens_for_a_client_gone(checkpoint, tmp_path):
    """Time to first token ends at the first token, for a whole answer too (it ended with the answer: the
    request's latency); a whole answer whose client left counts its samples' ends, but no tokens "sent to
    clients", and is not built."""
    body = {"model": "tiny", "prompt": [5, 6, 7], "ignore_eos": True}
    with running_server(checkpoint, tmp_path / "server.log", env=slow_steps_env(tmp_path, 0.02)) as (_, url):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body | {"max_tokens": 200, "n": 2}, headers=AUTH, timeout=1.5)
        wait_until(lambda: metrics(url).get(("rollout_engine_finished_samples_total", (("finish_reason", "abort"),)))
                   == 2, 30, "the abandoned request's two samples to end")
        gone = metrics(url)
        assert gone[("rollout_engine_generation_tokens_total", ())] == 0
        assert gone[("rollout_engine_time_to_first_token_seconds_count", ())] == 0
        answer = httpx.post(f"{url}/v1/completions", json=body | {"max_tokens": 40}, headers=AUTH, timeout=60)
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 40
        after = metrics(url)
    assert after[("rollout_engine_generation_tokens_total", ())] == 40
    assert after[("rollout_engine_time_to_first_token_seconds_count", ())] == 1
    ttft = after[("rollout_engine_time_to_first_token_seconds_sum", ())]
    latency = after[("rollout_engine_request_latency_seconds_sum", ())] - gone[
        ("rollout_engine_request_latency_seconds_sum", ())]
    assert ttft < latency / 4, (ttft, latency)  # the first of 40 steps of at least 20 ms each


def test_a_client_that_cannot_start_its_engine_leaves_no_socket_directory(monkeypatch):
    """The private 0700 directory and the socket bound in it go when the engine process cannot be started."""
    import shutil
    import tempfile

    parent = tempfile.mkdtemp(prefix="t", dir="/tmp")  # short: a socket's directory goes under it, not under /tmp
    monkeypatch.setattr(tempfile, "tempdir", parent)

    def no_process(*args, **kwargs):
        raise OSError("no more processes")
    monkeypatch.setattr(engine_link.subprocess, "Popen", no_process)
    try:
        with pytest.raises(OSError, match="no more processes"):
            EngineClient("/nonexistent/model")
        assert os.listdir(parent) == []
    finally:
        shutil.rmtree(parent)
