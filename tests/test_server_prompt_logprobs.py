"""The server's prompt scoring (logprob_fields.py): vLLM's `prompt_logprobs` in completions and chat, and
completions' `echo` (with `max_tokens=0`, lm-eval-harness's loglikelihood request), against transformers'
float32 log-softmax over the same tokens.

Tolerance: as test_logprobs.py (float32 end to end; the logits of these random models differ from
transformers' by summation-order rounding, ~1e-6, so 1e-4 holds with a wide margin while a wrong position,
token or temperature moves a logprob by far more)."""
import pytest
import torch

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from server_fixtures import AUTH, checkpoint, client, server  # noqa: E402,F401 - fixtures

TOL = 1e-4
PROMPT = "the model is a model"


@pytest.fixture(scope="module")
def reference(checkpoint):
    """(tokenizer, the log-softmax rows of transformers' logits for a list of token ids)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(checkpoint).eval()  # float32, as saved

    def rows(ids, temperature=1.0):
        with torch.no_grad():
            return (model(torch.tensor([ids])).logits[0].float() / temperature).log_softmax(-1)
    return AutoTokenizer.from_pretrained(checkpoint), rows


def post(server, body, path="/v1/completions"):
    return httpx.post(f"{server}{path}", headers=AUTH, json=body, timeout=60)


def assert_vllm_prompt_logprobs(field, ids, rows, k, tokenizer):
    """vLLM's shape: None first, then per prompt token {str(id): {logprob, rank, decoded_token}}: the token itself
    first, then its position's k likeliest; ranks 1..k among those k, the token's null unless it is one of them."""
    assert len(field) == len(ids) and field[0] is None
    for t in range(1, len(ids)):
        entry, row = field[t], rows[t - 1]
        top = row.topk(k).indices.tolist()
        assert list(entry) == [str(ids[t])] + [str(i) for i in top if i != ids[t]]
        for key, value in entry.items():
            token = int(key)
            assert value["logprob"] == pytest.approx(row[token].item(), abs=TOL)
            assert value["rank"] == (top.index(token) + 1 if token in top else None)
            assert value["decoded_token"] == tokenizer.decode([token])


def test_prompt_logprobs_in_completions_and_chat(server, client, reference):
    tokenizer, rows = reference
    ids = tokenizer.encode(PROMPT)
    # the greedy continuation appended: there the prompt token is its position's likeliest (rank 1, in the top k)
    greedy = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True}).choices[0].token_ids
    ids = ids + greedy
    for k, temperature in ((0, 1.0), (3, 1.0), (2, 0.5)):
        r = post(server, {"prompt": ids, "max_tokens": 2, "temperature": temperature, "prompt_logprobs": k})
        assert r.status_code == 200, r.text
        field = r.json()["choices"][0]["prompt_logprobs"]
        assert_vllm_prompt_logprobs(field, ids, rows(ids, temperature), k, tokenizer)
        if k:  # each greedy token ranks first at its position
            assert [field[len(ids) - 4 + j][str(t)]["rank"] for j, t in enumerate(greedy)] == [1] * 4
    # per choice, each with its own prompt's; none without the field
    two = post(server, {"prompt": [ids[:5], ids[:7]], "n": 2, "max_tokens": 1, "prompt_logprobs": 1}).json()
    assert [len(c["prompt_logprobs"]) for c in two["choices"]] == [5, 5, 7, 7]
    assert "prompt_logprobs" not in post(server, {"prompt": ids, "max_tokens": 1}).json()["choices"][0]
    # echo scores the prompt for its logprobs: prompt_logprobs stays out unless asked for (it doubled the answer)
    echoed = post(server, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}).json()["choices"][0]
    assert "prompt_logprobs" not in echoed and len(echoed["logprobs"]["tokens"]) == len(ids)
    # chat: at the top level, for the rendered conversation
    r = post(server, {"messages": [{"role": "user", "content": "a model"}], "max_tokens": 2, "prompt_logprobs": 1},
             "/v1/chat/completions").json()
    assert_vllm_prompt_logprobs(r["prompt_logprobs"], r["prompt_token_ids"], rows(r["prompt_token_ids"]), 1,
                                tokenizer)


def test_echo_scores_the_prompt_as_lm_eval_asks(client, reference):
    """lm-eval-harness's loglikelihood: echo=True, max_tokens=0, logprobs=1; the continuation's logprob is the sum
    of token_logprobs past the context, and "is greedy" compares each token with its top alternative."""
    tokenizer, rows = reference
    context, continuation = "the model", " is a model"
    r = client.completions.create(model="tiny", prompt=context + continuation, max_tokens=0, echo=True, logprobs=1,
                                  temperature=0)
    c, ids = r.choices[0], tokenizer.encode(context + continuation)
    assert c.text == context + continuation and c.token_ids == [] and r.usage.completion_tokens == 0
    assert c.finish_reason == "length"
    lp = c.logprobs
    assert lp.tokens == [tokenizer.decode([t]) for t in ids] and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    expected = rows(ids)
    assert lp.token_logprobs[1:] == pytest.approx([expected[t - 1, ids[t]].item() for t in range(1, len(ids))],
                                                  abs=TOL)
    for t in range(1, len(ids)):  # the token, then the likeliest other (one entry when the token is the likeliest)
        best = int(expected[t - 1].argmax())
        assert set(lp.top_logprobs[t]) == {tokenizer.decode([ids[t]]), tokenizer.decode([best])}
    assert [c.text[a:b] for a, b in zip(lp.text_offset, lp.text_offset[1:] + [len(c.text)])] == lp.tokens
    # a token stop ends the one step an echo runs: still nothing generated, and no stop_reason
    next_token = int(rows(tokenizer.encode(context))[-1].argmax())
    stopped = client.completions.create(model="tiny", prompt=context, max_tokens=0, echo=True, temperature=0,
                                        extra_body={"stop_token_ids": [next_token]})
    assert (stopped.choices[0].finish_reason, stopped.choices[0].stop_reason) == ("length", None)
    assert stopped.choices[0].text == context
    # a one-token prompt has no position to score
    one = client.completions.create(model="tiny", prompt=ids[:1], max_tokens=0, echo=True, logprobs=1).choices[0]
    assert one.logprobs.token_logprobs == [None] and "prompt_logprobs" not in one.model_extra
    start = len(tokenizer.encode(context))
    assert sum(lp.token_logprobs[start:]) == pytest.approx(
        sum(expected[t - 1, ids[t]].item() for t in range(start, len(ids))), abs=len(ids) * TOL)


def test_a_prompt_that_fills_the_longest_sequence_is_scored(server, reference):
    """lm-eval-harness's loglikelihood_rolling sends windows of exactly max_length tokens with echo and
    max_tokens=0: such a prompt is scored (its prefill's token is the one a prompt that fills the sequence gets,
    dropped here); one token longer is refused, naming the limit."""
    from server_fixtures import MAX_MODEL_LEN

    tokenizer, rows = reference
    ids = (tokenizer.encode(PROMPT) * MAX_MODEL_LEN)[:MAX_MODEL_LEN]
    r = post(server, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    lp, expected = r.json()["choices"][0]["logprobs"], rows(ids)
    assert lp["token_logprobs"][1:] == pytest.approx([expected[t - 1, ids[t]].item() for t in range(1, len(ids))],
                                                     abs=TOL)
    assert post(server, {"prompt": ids, "max_tokens": 1}).json()["choices"][0]["finish_reason"] == "length"
    too_long = post(server, {"prompt": ids + ids[:1], "max_tokens": 0, "echo": True})
    assert too_long.status_code == 400 and f"at most {MAX_MODEL_LEN} tokens" in too_long.text
    assert post(server, {"prompt": ids, "max_tokens": 2}).status_code == 400  # one token is all it can get


def test_echo_offsets_count_a_special_token_written_in_the_prompt(client):
    """A text prompt that spells a special token (<|im_start|>): its echo is the prompt as sent, and each token's
    text_offset points at its own characters there, so the continuation is the tokens at or past the context's
    length (the echo recipe); counted over the text decoded without special tokens, every offset fell 12 short."""
    context, continuation = "<|im_start|>the model", " is a model"
    c = client.completions.create(model="tiny", prompt=context + continuation, max_tokens=0, echo=True,
                                  logprobs=1).choices[0]
    lp = c.logprobs
    assert c.text == context + continuation and lp.tokens[0] == "<|im_start|>"
    assert [c.text[a:b] for a, b in zip(lp.text_offset, lp.text_offset[1:] + [len(c.text)])] == lp.tokens
    assert "".join(t for t, at in zip(lp.tokens, lp.text_offset) if at >= len(context)) == continuation


def test_echo_with_a_completion_puts_the_prompt_first(server, client, reference):
    tokenizer, rows = reference
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True}).choices[0]
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0, logprobs=2,
                                       echo=True, extra_body={"ignore_eos": True}).choices[0]
    ids = tokenizer.encode(PROMPT)
    assert echoed.text == PROMPT + plain.text and echoed.token_ids == plain.token_ids
    lp, tail = echoed.logprobs, len(ids)
    assert lp.tokens[tail:] == plain.logprobs.tokens and len(lp.tokens) == len(ids) + 5
    assert lp.token_logprobs[tail:] == pytest.approx(plain.logprobs.token_logprobs, abs=TOL)
    assert lp.text_offset[tail:] == [len(PROMPT) + o for o in plain.logprobs.text_offset]
    assert lp.token_logprobs[1:tail] == pytest.approx([rows(ids)[t - 1, ids[t]].item() for t in range(1, tail)],
                                                      abs=TOL)
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])  # the token and its position's 2 likeliest
    # prompt_logprobs asked for more alternatives than logprobs: the echoed prompt shows as many as the completion
    wider = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                      echo=True, extra_body={"prompt_logprobs": 5}).choices[0]
    assert all(len(top) <= 2 for top in wider.logprobs.top_logprobs[1:])
    # a prompt of the model's own greedy tokens, each its position's likeliest: shown alone, however widely scored
    greedy = ids + plain.token_ids
    alone_at_1, scored_at_5 = (post(server, {"prompt": greedy, "max_tokens": 0, "echo": True, "logprobs": 1} | more)
                               .json()["choices"][0]["logprobs"]["top_logprobs"] for more in ({}, {"prompt_logprobs": 5}))
    assert scored_at_5 == alone_at_1 and all(len(top) == 1 for top in scored_at_5[len(ids):])
    assert all(len(entry) >= 5 for entry in wider.prompt_logprobs[1:])  # the field itself keeps its 5
    # prompt_logprobs asked for fewer: the echo keeps its 2 alternatives, the field shows what k=0 alone shows
    narrow = post(server, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2, "prompt_logprobs": 0})
    narrow = narrow.json()["choices"][0]
    echo_only = post(server, {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 2}).json()["choices"][0]
    for got, want in zip(narrow["logprobs"]["top_logprobs"][1:], echo_only["logprobs"]["top_logprobs"][1:]):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=TOL)
    alone = post(server, {"prompt": ids, "max_tokens": 0, "echo": True, "prompt_logprobs": 0}).json()["choices"][0]
    assert [sorted(e) if e else e for e in narrow["prompt_logprobs"]] == [sorted(e) if e else e
                                                                          for e in alone["prompt_logprobs"]]
    assert all(e[str(t)]["rank"] is None for t, e in zip(ids[1:], narrow["prompt_logprobs"][1:]))
    # echo without logprobs: the text only; a token-id prompt echoes its decoded text
    bare = client.completions.create(model="tiny", prompt=ids, max_tokens=3, echo=True, temperature=0).choices[0]
    assert bare.text == tokenizer.decode(ids) + tokenizer.decode(bare.token_ids) and bare.logprobs is None


def test_what_prompt_scoring_refuses(server):
    r = post(server, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 0}, "/v1/chat/completions")
    assert r.status_code == 400 and "echo" not in r.json()["error"]["message"]  # chat has no echo to offer
    for body, words in [({"prompt": "a", "max_tokens": 0}, "or 0 with echo=true"),
                        ({"prompt": "a", "echo": True, "stream": True}, "echo=true is not supported with stream"),
                        ({"prompt": "a", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs is not supported"),
                        ({"prompt": "a", "prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt": "a", "prompt_logprobs": True}, "prompt_logprobs"),
                        ({"prompt": "a", "echo": "yes"}, "echo")]:
        r = post(server, body)
        assert r.status_code == 400 and words in r.json()["error"]["message"], (body, r.text)
    r = post(server, {"messages": [{"role": "user", "content": "a"}], "echo": True}, "/v1/chat/completions")
    assert r.status_code == 400 and "echo" in r.json()["error"]["message"]


def test_echo_of_a_prompt_scored_part_way_marks_the_rest_unscored():
    """An output aborted while its prompt was scored (AsyncEngine in process) carries the positions scored so far:
    the echoed logprobs still cover every prompt token, null where not scored."""
    from rollout_engine.server.logprob_fields import prompt_logprobs_of_echo

    out = prompt_logprobs_of_echo(None, [5, 6, 7, 8], [None, {6: -1.0, 9: -0.5}], 1, 1, None)
    assert out["token_logprobs"] == [None, -1.0, None, None] and len(out["tokens"]) == 4
    assert out["top_logprobs"] == [None, {"token_id:6": -1.0, "token_id:9": -0.5}, None, None]
    assert prompt_logprobs_of_echo(None, [5, 6], None, 1, 1, None)["token_logprobs"] == [None, None]


@pytest.mark.parametrize("scored", [1, 3])
def test_an_echoed_prompt_shows_its_k_likeliest_however_widely_it_was_scored(scored):
    """With logprobs=1 the echo of a prompt token shows it and its position's likeliest: when it is the likeliest,
    itself alone, whether the prompt was scored at 1 or (prompt_logprobs=3 asked too) at 3."""
    from rollout_engine.server.logprob_fields import prompt_logprobs_of_echo

    entry = {6: -0.1, 9: -2.0, 4: -3.0}  # scored at 3, the prompt token 6 the likeliest: the 3 likeliest
    entries = [None, dict(list(entry.items())[:scored])]
    assert prompt_logprobs_of_echo(None, [5, 6], entries, scored, 1, None)["top_logprobs"] == [None, {"token_id:6": -0.1}]
    unlikely = {7: -4.0, 6: -0.1, 9: -2.0, 4: -3.0}  # the prompt token 7 not among the 3 likeliest
    entries = [None, dict(list(unlikely.items())[:scored + 1])]
    assert prompt_logprobs_of_echo(None, [5, 7], entries, scored, 1, None)["top_logprobs"] == [
        None, {"token_id:7": -4.0, "token_id:6": -0.1}]
