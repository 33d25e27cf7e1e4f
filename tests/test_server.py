"""The OpenAI-compatible server, end to end: a real `rollout-engine serve` subprocess on the tiny checkpoint,
driven with the official openai client (and httpx where the test needs the raw HTTP)."""
import asyncio
import json
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from rollout_engine import SamplingParams  # noqa: E402
from rollout_engine.server.detokenize import IncrementalDetokenizer  # noqa: E402
from server_fixtures import AUTH, ENGINE, KEY, checkpoint, client, metrics, server  # noqa: E402,F401 - fixtures


def metric(url, name, **labels) -> float:
    return metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


def wait_for(predicate, timeout=15.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def post(url, path, body=None, **kwargs):
    return httpx.post(f"{url}{path}", json=body, headers=kwargs.pop("headers", AUTH), timeout=kwargs.pop("timeout", 30))


def test_incremental_detokenizer_holds_split_characters(checkpoint):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = "héllo 世界 🙂 the model"
    ids = tokenizer(text)["input_ids"]
    assert len(ids) > len(text.split()) + 6  # the byte-level BPE splits the multi-byte characters
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    assert all("\ufffd" not in p for p in pieces) and "".join(pieces) == text
    held = IncrementalDetokenizer(tokenizer, hold_back=3)  # a stop string of 4 characters
    sent = "".join(held.push([t]) for t in ids)
    assert text.startswith(sent) and len(sent) <= len(text) - 3 and sent + held.finish(text) == text


def test_text_offsets_after_bytes_that_never_form_a_character(checkpoint):
    """A byte piece no later piece completes stays U+FFFD in the text: the tokens after it start after it (their
    offsets pointed at it), and a character's own bytes still start where the character does."""
    from transformers import AutoTokenizer

    from rollout_engine.server.detokenize import text_offsets

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    lone = tokenizer.convert_tokens_to_ids("\u00e4")  # byte-level BPE spells byte 0xE4 (a 3-byte lead) as U+00E4
    assert tokenizer.decode([lone]) == "\ufffd"
    words, char = tokenizer(" been there")["input_ids"], tokenizer("世")["input_ids"]
    for ids, starts in [([lone, *words], [0, 1]), ([lone, lone, *words], [0, 1, 2]), ([*char, *words], [0] * len(char) + [1])]:
        text = tokenizer.decode(ids)
        offsets = text_offsets(tokenizer, ids)
        assert offsets[: len(starts)] == starts, (text, offsets)
        for i, t in enumerate(ids[len(starts) - 1 :], len(starts) - 1):
            assert text[offsets[i] :].startswith(tokenizer.decode([t])), (text, offsets, i)


def test_auth(server, checkpoint):
    for path in ("/health", "/metrics", "/v1/models"):
        assert httpx.get(f"{server}{path}", timeout=10).status_code == 401
        assert httpx.get(f"{server}{path}", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    for path in ("/sleep", "/wake", "/flush_cache", "/abort_request", "/v1/completions"):
        r = post(server, path, {}, headers={"Authorization": f"Bearer {KEY}x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong", max_retries=0).models.list()
    models = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0).models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_one_rule_says_which_bind_addresses_are_loopback():
    """serve's --host is loopback (no key needed without a warning; Host checked) by the rule the Host check
    uses: localhost or a loopback IP literal."""
    from rollout_engine.server.guards import is_loopback_address

    assert all(map(is_loopback_address, ("localhost", "127.0.0.1", "127.0.0.2", "::1", "0:0:0:0:0:0:0:1")))
    assert not any(map(is_loopback_address, ("0.0.0.0", "::", "10.0.0.1", "example.com", "[::1]", "")))


def test_web_pages_cannot_drive_the_server(server):
    """A browser page's cross-origin POST (a JSON body sent as text/plain: no pre-flight) names the page in
    Origin: refused, whatever the key, before anything runs. A Host that is not a loopback name (a page whose
    name a DNS rebinding points at 127.0.0.1) is refused by a loopback server; a loopback IP literal is served,
    as a client of a server bound to another loopback address (127.0.0.2) names it. Clients without Origin are
    served."""
    auth = {"Authorization": f"Bearer {KEY}"}
    forged = httpx.post(f"{server}/pause_generation", content=b'{"mode": "keep"}', timeout=10,
                        headers={**auth, "Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert forged.status_code == 403 and "web pages" in forged.json()["error"]["message"]
    for host in ("attacker.example", "attacker.example:80", "127.0.0.1.attacker.example", "localhost.example:80",
                 "10.0.0.1", "[::2]:80", ""):
        rebound = httpx.get(f"{server}/v1/models", headers={**auth, "Host": host}, timeout=10)
        assert rebound.status_code == 421, host
    # any loopback address (a server told to bind 127.0.0.2 is reached as 127.0.0.2), with or without a port, and
    # the unspecified address (the URL vLLM prints)
    for host in ("localhost", "127.0.0.1:1234", "[::1]:80", "[::1]", "127.0.0.2", "127.0.0.2:8000",
                 "127.255.255.254:1", "[0:0:0:0:0:0:0:1]:80", "0.0.0.0:8000", "[::]:80"):
        assert httpx.get(f"{server}/health", headers={**auth, "Host": host}, timeout=10).status_code == 200, host
    assert httpx.get(f"{server}/v1/models", headers=auth, timeout=10).status_code == 200
    r = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0).completions.create(
        model="tiny", prompt="the model", max_tokens=2)  # generation was not paused by the forged request
    assert r.choices[0].finish_reason in ("length", "stop")


def test_completion_matches_the_engine(client, checkpoint):
    from rollout_engine import Engine

    engine = Engine(checkpoint, **ENGINE)
    ref = engine.generate("the model", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
                          use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt="the model", max_tokens=12, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert c.token_ids == ref.outputs[0].token_ids and c.prompt_token_ids == ref.prompt_token_ids
    assert c.text == ref.outputs[0].text and c.finish_reason == "length" and c.weight_versions == [0] * 12
    assert c.logprobs.token_logprobs == pytest.approx(ref.outputs[0].logprobs, abs=1e-4)
    # the engine's top-3 alternatives, keyed by each token's text (OpenAI's completions shape)
    expected = [{engine.tokenizer.decode([i]): v for i, v in top.items()} for top in ref.outputs[0].top_logprobs]
    assert len(c.logprobs.tokens) == 12 and all(len(top) == 3 for top in c.logprobs.top_logprobs)
    for got, want in zip(c.logprobs.top_logprobs, expected):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-4)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), 12)
    # token-id prompts, several of them, n samples each
    r = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    chunks = list(client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], n=2, max_tokens=4, seed=3,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert all(len(ch.choices) == 1 for ch in chunks) and {ch.choices[0].index for ch in chunks} == {0, 1, 2, 3}
    assert [[t for ch in chunks if ch.choices[0].index == i for t in ch.choices[0].token_ids] for i in range(4)] == \
        [c.token_ids for c in r.choices]
    assert [c.prompt_token_ids for c in r.choices] == [[5, 6, 7]] * 2 + [[8, 9]] * 2
    assert all(len(c.token_ids) == 4 for c in r.choices) and r.usage.completion_tokens == 16
    r2 = httpx.post(f"{client.base_url}completions", headers=AUTH, timeout=30,  # the prompt_token_ids extension
                    json={"prompt_token_ids": [[5, 6, 7], [8, 9]], "n": 2, "max_tokens": 4, "seed": 3,
                          "ignore_eos": True}).json()
    assert [c["token_ids"] for c in r2["choices"]] == [c.token_ids for c in r.choices]  # same seed, same tokens


def test_a_prefilled_assistant_turn_is_continued(client, checkpoint):
    """vLLM's continue_final_message: the prompt ends inside the last message, as transformers renders it."""
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "The sum is"}]
    kept = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body={
        "add_generation_prompt": False, "continue_final_message": True})
    expected = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=False, continue_final_message=True)
    assert kept.prompt_token_ids == list(expected)
    with pytest.raises(openai.BadRequestError, match="continue_final_message=True is not allowed with"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=2,
                                       extra_body={"continue_final_message": True})


def test_chat_and_streams_agree(client):
    messages = [{"role": "system", "content": "answer"}, {"role": "user", "content": "2+2= héllo 🙂"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                           logprobs=True, top_logprobs=2)
    c = whole.choices[0]
    assert c.message.role == "assistant" and whole.prompt_token_ids and len(c.token_ids) == len(c.logprobs.content)
    for e in c.logprobs.content:  # greedy: the token is its own top alternative; two, most likely first
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob, abs=1e-6)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0,
                                                 logprobs=True, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].prompt_token_ids == whole.prompt_token_ids
    body = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == c.message.content
    assert [t for ch in body for t in (ch.choices[0].token_ids or [])] == c.token_ids
    assert [e.logprob for ch in body if ch.choices[0].logprobs for e in ch.choices[0].logprobs.content] == \
        pytest.approx([e.logprob for e in c.logprobs.content], abs=1e-4)
    assert body[-1].choices[0].finish_reason == c.finish_reason
    assert chunks[-1].usage.total_tokens == whole.usage.total_tokens
    # completions stream of the same prompt ids: the text streamed piecewise is the whole text
    ids = whole.prompt_token_ids
    full = client.completions.create(model="tiny", prompt=ids, max_tokens=40, temperature=0,
                                     extra_body={"ignore_eos": True})
    streamed = list(client.completions.create(model="tiny", prompt=ids, max_tokens=40, temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == full.choices[0].text
    assert all("\ufffd" not in ch.choices[0].text for ch in streamed[:-1]) or "\ufffd" in full.choices[0].text
    assert [t for ch in streamed for t in ch.choices[0].token_ids] == full.choices[0].token_ids
    # a conversation already rendered (prompt_token_ids), and n samples streamed side by side
    again = client.chat.completions.create(model="tiny", messages=[], max_tokens=24, temperature=0,
                                           extra_body={"prompt_token_ids": whole.prompt_token_ids})
    assert again.choices[0].token_ids == c.token_ids
    kwargs = dict(model="tiny", messages=messages, max_tokens=10, n=2, seed=5, extra_body={"ignore_eos": True})
    pair = client.chat.completions.create(**kwargs)
    text, ids, finish = {0: "", 1: ""}, {0: [], 1: []}, {}
    for ch in client.chat.completions.create(stream=True, **kwargs):
        assert len(ch.choices) == 1  # one choice a chunk, as vLLM and OpenAI send them (a client may read [0] only)
        for choice in ch.choices:
            text[choice.index] += choice.delta.content or ""
            ids[choice.index] += choice.token_ids
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert [ids[i] for i in (0, 1)] == [ch.token_ids for ch in pair.choices] and finish == {0: "length", 1: "length"}
    assert [text[i] for i in (0, 1)] == [ch.message.content for ch in pair.choices]


def test_stop_strings_in_streams(client):
    full = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0,
                                     extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[6:9] if len(text) >= 9 else None
    if not stop or "\ufffd" in stop:
        pytest.skip("the tiny model's greedy text has no clean stop string to test")
    whole = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0, stop=[stop],
                                      extra_body={"ignore_eos": True})
    streamed = list(client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0,
                                              stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert whole.choices[0].finish_reason == "stop" and stop not in whole.choices[0].text
    assert "".join(ch.choices[0].text for ch in streamed) == whole.choices[0].text
    # vLLM's stop_reason: the stop string that ended the choice (null on the chunks before its end)
    assert whole.choices[0].stop_reason == stop and streamed[-1].choices[0].stop_reason == stop
    assert all(ch.choices[0].stop_reason is None for ch in streamed[:-1])
    assert full.choices[0].stop_reason is None
    # include_stop_str_in_output (vLLM's): the text ends with the stop string, streamed or whole; the tokens are alike
    keep = dict(model="tiny", prompt=[5, 6, 7], max_tokens=30, temperature=0, stop=[stop],
                extra_body={"ignore_eos": True, "include_stop_str_in_output": True})
    kept = client.completions.create(**keep).choices[0]
    assert kept.text == whole.choices[0].text + stop and kept.token_ids == whole.choices[0].token_ids
    assert "".join(ch.choices[0].text for ch in client.completions.create(stream=True, **keep)) == kept.text


def test_a_choice_that_ends_first_ends_in_the_stream_at_once(client):
    """n=2: the choice that stops after a token gets its finish_reason while the other still streams (as vLLM
    sends each choice's end), not with the request's last token."""
    body = dict(model="tiny", prompt=[5, 6, 7], max_tokens=60, n=2, temperature=1.0, seed=7,
                extra_body={"stop_token_ids": [303, 74, 255]})
    whole = client.completions.create(**body)
    lengths = [len(c.token_ids) for c in sorted(whole.choices, key=lambda c: c.index)]
    assert lengths[0] <= 4 and lengths[1] == 60, f"the seed's premise (one short choice, one long) fails: {lengths}"
    events = []  # (choice index, tokens, finish_reason) in arrival order
    for chunk in client.completions.create(stream=True, **body):
        events += [(c.index, len(c.token_ids), c.finish_reason) for c in chunk.choices]
    first_end = next(i for i, (index, _, finish) in enumerate(events) if index == 0 and finish is not None)
    assert events[first_end][2] == "stop"
    later = sum(tokens for index, tokens, _ in events[first_end + 1 :] if index == 1)
    assert later >= 30, f"choice 0's end came with choice 1's last tokens: {later} of its 60 came after it"
    assert sum(tokens for index, tokens, _ in events if index == 0) == lengths[0]


def test_32_concurrent_streams(server):
    async def one(aclient, i):
        tokens, finish = [], None
        stream = await aclient.completions.create(model="tiny", prompt=[10 + i, 11, 12], max_tokens=16,
                                                  stream=True, seed=i, extra_body={"ignore_eos": True})
        async for chunk in stream:
            tokens += chunk.choices[0].token_ids
            finish = chunk.choices[0].finish_reason or finish
        return tokens, finish

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)
        return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(32))), 60)

    before = metric(server, "rollout_engine_generation_tokens_total")
    results = asyncio.run(main())
    assert all(len(t) == 16 and f == "length" for t, f in results)
    assert metric(server, "rollout_engine_generation_tokens_total") - before == 32 * 16


def test_disconnect_mid_stream_frees_blocks(server):
    aborted = metric(server, "rollout_engine_finished_samples_total", finish_reason="abort")
    body = {"model": "tiny", "prompt": list(range(3, 40)), "max_tokens": 210, "ignore_eos": True, "stream": True}
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
                lines, got = r.iter_lines(), 0  # (a dropped iterator closes the connection: keep it)
                while got < 3:
                    got += next(lines).startswith("data: {")
                # hold it mid-stream with its KV (the tiny model would finish 210 tokens in a blink)
                assert post(server, "/pause_generation", {"mode": "keep"}).status_code == 200
                assert metric(server, "rollout_engine_kv_blocks_used") > 0
                assert metric(server, "rollout_engine_num_seqs_running") == 1
        wait_for(lambda: metric(server, "rollout_engine_kv_blocks_used") == 0
                 and metric(server, "rollout_engine_num_seqs_running") == 0
                 and metric(server, "rollout_engine_http_requests_in_flight") == 0, what="the blocks to be freed")
    finally:
        assert post(server, "/continue_generation").status_code == 200
    assert metric(server, "rollout_engine_finished_samples_total", finish_reason="abort") == aborted + 1


def test_a_stream_retried_under_its_id_after_a_drop_is_served_or_refused_before_it_starts(server, client):
    """A client drops a stream with its request_id and retries at once under the same id (a timeout, a cancelled
    task): the retry is served, or refused with a 400 while the old request's abort is on its way; never a 200
    whose stream then fails with "already in flight", which retry logic keyed on the status cannot see."""
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 100, "ignore_eos": True, "stream": True,
            "request_id": "trajectory-42"}

    def start_and_drop():
        for _ in range(200):  # the last retry's refusal may leave its id in use for a moment
            with httpx.Client(timeout=30) as http, http.stream("POST", f"{server}/v1/completions", json=body,
                                                                headers=AUTH) as r:
                if r.status_code == 400:
                    time.sleep(0.02)
                    continue
                lines, got = r.iter_lines(), 0
                while got < 3:
                    got += next(lines).startswith("data: {")
                return
        pytest.fail("the id stayed in use")

    outcomes = []
    for _ in range(8):
        start_and_drop()
        try:
            for _ in client.completions.create(model="tiny", prompt="hello", max_tokens=3, stream=True,
                                               extra_body={"request_id": "trajectory-42"}):
                pass
            outcomes.append("served")
        except openai.BadRequestError:
            outcomes.append("400")
        except openai.APIError as err:
            outcomes.append(f"200, then: {err.message}")
    assert all(o in ("served", "400") for o in outcomes), outcomes
    wait_for(lambda: metric(server, "rollout_engine_http_requests_in_flight") == 0, what="the requests to end")


def test_refused_generation_requests_are_counted_by_status(server):
    """A generation request refused before it starts (a bad field, an id in use) is counted under its status, as
    the ones that ran are: a client stuck sending bad requests shows on the dashboards."""
    bad = metric(server, "rollout_engine_http_requests_total", endpoint="completions", status="400")
    for body in ({"prompt": "hi", "max_tokens": -1}, {"prompt": "hi", "bogus": 1}, [1]):
        assert post(server, "/v1/completions", body).status_code == 400
    assert metric(server, "rollout_engine_http_requests_total", endpoint="completions", status="400") == bad + 3
    chat = metric(server, "rollout_engine_http_requests_total", endpoint="chat", status="400")
    assert post(server, "/v1/chat/completions", {"messages": []}).status_code == 400
    assert metric(server, "rollout_engine_http_requests_total", endpoint="chat", status="400") == chat + 1
    ran = metric(server, "rollout_engine_http_requests_total", endpoint="completions", status="200")
    assert post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200
    assert metric(server, "rollout_engine_http_requests_total", endpoint="completions", status="200") == ran + 1


def test_disconnect_while_waiting_aborts(server):
    """A non-streaming request whose client gives up is aborted (here it is held by a pause, so no race)."""
    assert post(server, "/pause_generation", {"mode": "keep"}).status_code == 200
    try:
        with pytest.raises(httpx.ReadTimeout):
            post(server, "/v1/completions", {"prompt": [4, 5], "max_tokens": 8}, timeout=1.0)
        wait_for(lambda: metric(server, "rollout_engine_http_requests_total", endpoint="completions",
                                status="disconnected") >= 1, what="the disconnect")
    finally:
        assert post(server, "/continue_generation").status_code == 200
    assert metric(server, "rollout_engine_http_requests_in_flight") == 0


def test_abort_request(server):
    body = {"prompt": [7, 8, 9], "max_tokens": 200, "ignore_eos": True, "stream": True, "request_id": "abort-me"}
    with httpx.Client(timeout=30) as http, \
            http.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
        chunks = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 2:
                    assert post(server, "/abort_request", {"request_id": "abort-me"}).json() == {"aborted": True}
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) < 200
    assert post(server, "/abort_request", {"request_id": "abort-me"}).json() == {"aborted": False}


def test_admin_requests_in_sglangs_and_vllms_shapes(server, checkpoint):
    """What RL frameworks' SGLang and vLLM clients send: update_weights_from_disk's model_path, abort_request's rid
    and abort_all, pause_generation's in_place (held with their KV: our "keep"), POST /reset_prefix_cache."""
    assert post(server, "/update_weights_from_disk", {"model_path": str(checkpoint)}).status_code == 200
    both = post(server, "/update_weights_from_disk", {"model_path": str(checkpoint), "path": str(checkpoint)})
    assert both.status_code == 400 and "path" in both.json()["error"]["message"]
    assert post(server, "/update_weights_from_disk", {}).status_code == 400
    assert post(server, "/reset_prefix_cache").json() == {"flushed": True}
    for abort in ({"rid": "nobody"}, {"abort_all": True}):
        assert post(server, "/abort_request", abort).json() == {"aborted": False}
    for bad in ({}, {"rid": "a", "request_id": "a"}, {"rid": "a", "abort_all": True}, {"abort_all": 1}):
        assert post(server, "/abort_request", bad).status_code == 400, bad
    body = {"prompt": [7, 8, 9], "max_tokens": 200, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    if len(chunks) == 2:
                        assert post(server, "/abort_request", {"abort_all": True}).json() == {"aborted": True}
        assert chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert post(server, "/pause_generation", {"mode": "in_place"}).json() == {"paused": "in_place"}
    answers = []
    sender = threading.Thread(target=lambda: answers.append(post(server, "/v1/completions", {**body, "stream": False,
                                                                                          "max_tokens": 3})))
    try:
        sender.start()
        wait_for(lambda: answers or metric(server, "rollout_engine_num_seqs_waiting") == 1, what="the request")
        assert not answers  # held by the pause
    finally:
        assert post(server, "/continue_generation").status_code == 200
    sender.join(60)
    assert answers[0].status_code == 200 and len(answers[0].json()["choices"][0]["token_ids"]) == 3


def test_an_id_in_flight_is_refused_and_its_owner_untouched(server):
    """A request whose id (or one of its per-prompt ids, "{id}-{i}") is in flight is a 400, and the request
    that owns the id runs on to its end; of several twins sent at once exactly one runs."""
    def stream(request_id, results):
        body = {"prompt": [7, 8, 9], "max_tokens": 120, "ignore_eos": True, "stream": True, "request_id": request_id}
        with httpx.Client(timeout=60) as http, \
                http.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH) as r:
            if r.status_code != 200:
                results.append((r.status_code, r.read().decode()))
                return
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            results.append((200, [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]))

    # A pause holds each owner in flight (the tiny model would finish 120 tokens before a poll could see it).
    owner = []
    assert post(server, "/pause_generation", {"mode": "keep"}).status_code == 200
    try:
        first = threading.Thread(target=stream, args=("job-1", owner))
        first.start()
        wait_for(lambda: metric(server, "rollout_engine_http_requests_in_flight") == 1, what="the owner to start")
        clash = post(server, "/v1/completions", {"prompt": [[1, 2], [3, 4]], "max_tokens": 4, "request_id": "job"})
        assert clash.status_code == 400 and "job-1" in clash.json()["error"]["message"]
    finally:
        assert post(server, "/continue_generation").status_code == 200
    first.join(60)
    assert owner == [(200, "length")]
    twins = []
    assert post(server, "/pause_generation", {"mode": "keep"}).status_code == 200
    try:
        threads = [threading.Thread(target=stream, args=("twin", twins)) for _ in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: len(twins) == 3, what="three twins refused")
    finally:
        assert post(server, "/continue_generation").status_code == 200
    for t in threads:
        t.join(60)
    assert sorted(code for code, _ in twins) == [200, 400, 400, 400]
    assert [reason for code, reason in twins if code == 200] == ["length"]
    assert metric(server, "rollout_engine_http_requests_in_flight") == 0


def test_serve_refuses_an_empty_api_key_and_reads_the_key_from_the_environment(checkpoint, monkeypatch, capsys):
    """`--api-key ""` (an unset $KEY) would turn authentication off without a word: refused before any engine
    starts. Without --api-key the key comes from $ROLLOUT_ENGINE_API_KEY, out of the process list."""
    from rollout_engine.cli import API_KEY_ENV, build_parser, main as cli_main
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", str(checkpoint), "--api-key", ""])
    assert exit_.value.code == 2 and "--api-key (or $ROLLOUT_ENGINE_API_KEY) is ''" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, " ")  # set but empty: the variable is named
    with pytest.raises(SystemExit) as exit_:
        cli_main(["serve", str(checkpoint)])
    assert exit_.value.code == 2 and "$ROLLOUT_ENGINE_API_KEY) is ' '" in capsys.readouterr().err
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert build_parser().parse_args(["serve", str(checkpoint)]).api_key == "from-env"
    assert build_parser().parse_args(["serve", str(checkpoint), "--api-key", "given"]).api_key == "given"


def test_bad_requests_are_400_with_the_python_message(server):
    def message(**kwargs):
        with pytest.raises(ValueError) as err:
            SamplingParams(**kwargs)
        return str(err.value)

    base = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    cases = [
        ({**base, "temperature": -1}, message(temperature=-1)),
        ({**base, "top_p": 0}, message(top_p=0)),
        ({**base, "n": 0}, message(n=0)),
        ({**base, "max_tokens": 0}, message(max_tokens=0)),
        ({**base, "stop": [""]}, message(stop=[""])),
        ({**base, "prompt": [1, 999999]}, "prompt token ids [999999] are not ints in"),
        ({**base, "prompt": list(range(1, 300))}, "prompt has 299 tokens"),
        ({**base, "max_tokens": 1000}, "ask for max_tokens <= "),
        ({**base, "prompt": []}, "prompt"),
        ({"model": "tiny"}, "give exactly one of prompt"),
        ({**base, "stream": "yes"}, "stream: Input should be a valid boolean"),
        ({**base, "bogus": 1}, "unknown field 'bogus'"),
        ({**base, "frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
        ({**base, "skip_special_tokens": False}, "skip_special_tokens=False is not supported"),
        ({**base, "min_tokens": 2}, "min_tokens=2 is not supported"),
        ({**base, "n": 2, "best_of": 3}, "best_of=3 is not supported"),
        ({**base, "n": 3, "best_of": 1}, "best_of=1 is less than n=3"),  # OpenAI's rule: best_of >= n
        ({**base, "n": 50_000_000}, message(n=50_000_000)),  # refused before a record per sample is built
        ({**base, "n": 8, "prompt": [[1, 2]] * 3000}, "3000 prompts x n=8 is 24000 choices"),
        ({**base, "prompt": [[1]] * 20000}, "20000 prompts x n=1"),
        ([1, 2], "the request body must be a JSON object"),
    ]
    for body, expected in cases:
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error" and expected in r.json()["error"]["message"], body
    same = post(server, "/v1/completions", {**base, "n": 2, "best_of": 2})  # best_of = n: n drawn, n returned
    assert same.status_code == 200 and len(same.json()["choices"]) == 2
    r = httpx.post(f"{server}/v1/completions", content=b"{not json", headers=AUTH, timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    lone_surrogate = b'{"model": "tiny", "prompt": "hello \\ud800", "max_tokens": 4}'  # valid JSON, not Unicode text
    r = httpx.post(f"{server}/v1/completions", content=lone_surrogate, headers=AUTH, timeout=10)
    assert r.status_code == 400 and "prompt is not valid Unicode text" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", content=b"[" * 100_000 + b"]" * 100_000, headers=AUTH, timeout=10)
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    for extra in ({"messages": [{"role": "user", "content": "x"}]}, {"chat_template_kwargs": {"enable_thinking": 0}},
                  {"continue_final_message": True}, {"add_generation_prompt": False}):
        r = post(server, "/v1/chat/completions", {"model": "tiny", "prompt_token_ids": [5, 6], **extra})
        assert r.status_code == 400 and "would go unread" in r.json()["error"]["message"], extra
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                              "max_completion_tokens": 4, "top_p": 2})
    assert r.status_code == 400 and r.json()["error"]["message"] == message(top_p=2)
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                              "max_completion_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("max_completion_tokens=0 is not allowed")
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                              "max_completion_tokens": 1000})  # the field given is the one named
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
    assert "ask for max_completion_tokens <= " in r.json()["error"]["message"]
    assert post(server, "/v1/completions", {**base, "model": "other"}).status_code == 404
    assert post(server, "/sleep", {"level": 3}).status_code == 400
    for path, body, words in [("/v1/completions?n=2", base, "query parameters ['n'] are not taken here"),
                              ("/sleep?level=2", {"level": 1}, "'level' is given in the body too"),
                              ("/sleep?levle=2", {}, "'levle' is not a field of this endpoint"),
                              ("/sleep?level=3", {}, "level=3"),
                              ("/continue_generation", {"mode": "keep"}, "unknown field 'mode'; EmptyRequest takes no"),
                              ("/flush_cache?bogus=1", {}, "'bogus' is not a field of this endpoint"),
                              ("/reset_prefix_cache", {"reset_running_requests": True}, "is not supported"),
                              ("/reset_prefix_cache", {"device": "cpu"}, "device='cpu' is not allowed")]:
        r = post(server, path, body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (path, r.text)
    assert post(server, "/pause_generation", {"mode": "later"}).status_code == 400
    assert post(server, "/reset_prefix_cache", {"model": "other"}).status_code == 404
    # what vLLM's and Ray Serve's clients send to a flush, at what this flush does, is taken
    for path, body in [("/reset_prefix_cache?reset_running_requests=false&device=gpu", {}),
                       ("/reset_prefix_cache", {"model": "tiny", "reset_running_requests": False})]:
        assert post(server, path, body).json() == {"flushed": True}, path
    assert httpx.get(f"{server}/health", headers=AUTH, timeout=10).json()["status"] == "ok"  # still serving


def test_vllm_clients_fields_at_their_defaults_and_its_admin_routes_are_taken(server, client, checkpoint):
    """vLLM's clients send its extension fields at their defaults (this server's behaviour), its sleep level as a
    query parameter (POST /sleep?level=2, once read as level 1: the weights stayed) and wake at /wake_up."""
    defaults = {"skip_special_tokens": True, "include_stop_str_in_output": False, "repetition_penalty": 1.0,
                "min_tokens": 0, "return_tokens_as_token_ids": False, "spaces_between_special_tokens": True}
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=defaults).choices
    assert post(server, "/sleep?level=2").status_code == 200
    assert httpx.get(f"{server}/is_sleeping", headers=AUTH, timeout=10).json() == {"is_sleeping": True}
    assert post(server, "/wake_up?tags=weights&tags=kv_cache").json()["sleeping"] is False
    refused = post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert refused.status_code != 200 and "update_weights" in refused.json()["error"]["message"]  # discarded
    assert post(server, "/update_weights_from_disk", {"path": str(checkpoint)}).status_code == 200
    assert post(server, "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_discarded_weights_refuse_a_stream_before_it_starts_and_health_says_so(server, client, checkpoint):
    """After a level-2 sleep and a wake, before the weights come back: a stream is refused with a 503, as a whole
    answer is (not a 200 whose stream then fails, which a client cannot retry on its status), and /health says
    the weights are not ready; a complete update serves again."""
    assert post(server, "/sleep", {"level": 2}).status_code == 200 and post(server, "/wake").status_code == 200
    health = httpx.get(f"{server}/health", headers=AUTH, timeout=10).json()
    assert health["sleeping"] is False and health["weights_ready"] is False
    with pytest.raises(openai.APIStatusError) as err:
        for _ in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=4, stream=True):
            pass
    assert err.value.status_code == 503 and "update" in err.value.message
    assert post(server, "/update_weights_from_disk", {"path": str(checkpoint)}).status_code == 200
    assert httpx.get(f"{server}/health", headers=AUTH, timeout=10).json()["weights_ready"] is True
    # a chunk per step, or both tokens in one when the stream is read late (a loaded machine)
    chunks = list(client.completions.create(model="tiny", prompt="hi", max_tokens=2, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert len([t for c in chunks for t in getattr(c.choices[0], "token_ids", None) or []]) == 2
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sleep_refuses_generation_until_wake(server, client):
    assert post(server, "/sleep", {"level": 1}).json()["sleeping"] is True
    assert metric(server, "rollout_engine_sleeping") == 1
    assert httpx.get(f"{server}/health", headers=AUTH, timeout=10).json()["sleeping"] is True
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(model="tiny", prompt="hi", max_tokens=4)
    assert err.value.status_code == 503 and "asleep" in err.value.message and "/wake" in err.value.message
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                                              "stream": True})
    assert r.status_code == 503
    assert post(server, "/wake").json()["sleeping"] is False
    assert metric(server, "rollout_engine_sleeping") == 0
    assert len(client.completions.create(model="tiny", prompt="hi", max_tokens=4,
                                         extra_body={"ignore_eos": True}).choices[0].token_ids) == 4


@pytest.mark.parametrize("sleep_mode", ["abort", "retract"])
def test_sleep_and_wake_leave_a_pause_in_force(server, sleep_mode):
    """pause, sleep, wake: a request sent then is held until /continue_generation, so that a trainer that updates
    the weights before it continues gets no tokens from the old ones."""
    body = {"prompt": [5, 6, 7], "max_tokens": 4, "ignore_eos": True}
    answers = []
    sender = threading.Thread(target=lambda: answers.append(post(server, "/v1/completions", body, timeout=60)))
    assert post(server, "/pause_generation", {"mode": "keep"}).status_code == 200
    try:
        assert post(server, "/sleep", {"mode": sleep_mode}).json()["sleeping"] is True
        assert post(server, "/wake").json()["sleeping"] is False
        sender.start()
        wait_for(lambda: answers or metric(server, "rollout_engine_num_seqs_waiting") == 1, what="the request")
        time.sleep(0.5)  # time enough for the tiny model to generate it, were it not held
        assert not answers, "a request was generated after /wake although the pause was never lifted"
    finally:
        assert post(server, "/continue_generation").status_code == 200
    sender.join(60)
    assert answers[0].status_code == 200 and len(answers[0].json()["choices"][0]["token_ids"]) == 4


def test_a_server_takes_pushed_weights_only_when_asked(server):
    r = httpx.get(f"{server}/weight_receiver", headers=AUTH, timeout=10)
    assert r.status_code == 404 and "--weight-receiver" in r.json()["error"]["message"]


def test_weight_update_flush_and_versions(server, client, checkpoint):
    client.completions.create(model="tiny", prompt=list(range(3, 43)), max_tokens=2)
    assert metric(server, "rollout_engine_kv_blocks_cached") >= 2  # the 40-token prompt's full blocks
    assert post(server, "/flush_cache").json() == {"flushed": True}
    assert metric(server, "rollout_engine_kv_blocks_cached") == 0
    r = post(server, "/update_weights_from_disk", {"path": str(checkpoint), "version": 7})
    assert r.json() == {"weight_version": 7}
    assert metric(server, "rollout_engine_weight_version") == 7
    out = client.completions.create(model="tiny", prompt="hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.choices[0].weight_versions == [7, 7, 7] and out.weight_version == 7
    r = post(server, "/update_weights_from_disk", {"path": str(checkpoint), "version": 7})
    assert r.status_code == 400 and "version" in r.json()["error"]["message"]  # versions must increase


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "the model", "stop_token_ids": [10 ** 6]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10 ** 6]}),
    ("/v1/completions", {"prompt": "the model", "logprobs": 5, "n": 2, "seed": 10 ** 30}),
])
def test_a_stream_with_a_bad_field_is_a_400_as_without_stream(server, client, path, body):
    """The engine's own checks (a stop token outside the vocabulary, a seed out of range) run before a stream's
    200 goes out: a stream got 200 and an error event (the openai client: an APIError without a status)."""
    for stream in (False, True):
        r = httpx.post(f"{server}{path}", json={"model": "tiny", "max_tokens": 3, "stream": stream, **body},
                       headers=AUTH, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (stream, r.text)
    with pytest.raises(openai.BadRequestError, match="stop_token_ids"):
        for _ in client.completions.create(model="tiny", prompt="the model", max_tokens=3, stream=True,
                                           extra_body={"stop_token_ids": [10 ** 6]}):
            pass


def test_nulls_are_defaults_and_negative_seeds_are_seeds(server, client):
    """The openai client sends null for an argument given as None; OpenAI's API and vLLM read it as left out. A seed
    is any int64 there: a negative one is a seed too, the same one each time."""
    for body in ({"n": None}, {"temperature": None}, {"top_p": None}, {"stream": None}, {"logprobs": None},
                 {"top_k": None, "min_p": None, "ignore_eos": None, "return_token_ids": None},
                 {"reasoning_effort": None, "prediction": None, "modalities": None}):  # OpenAI's, not modelled
        r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=60,
                       json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
        assert r.status_code == 200 and len(r.json()["choices"]) == 1, (body, r.text)
        assert r.json()["choices"][0]["token_ids"], body  # return_token_ids kept its default
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       n=None, temperature=None, top_p=None, logprobs=None, stream=None)
    assert len(r.choices) == 1
    seeded = [client.completions.create(model="tiny", prompt="the model", max_tokens=6, seed=-7).choices[0].text
              for _ in range(2)]
    assert seeded[0] == seeded[1]
    for seed in (-(2 ** 63) - 1, 2 ** 63):
        with pytest.raises(openai.BadRequestError, match="seed"):
            client.completions.create(model="tiny", prompt="the model", max_tokens=2, seed=seed)
