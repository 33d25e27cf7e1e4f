"""The server's text for a Llama-2/Mistral-style tokenizer (SentencePiece pieces: "▁" for a space, byte-fallback
pieces <0xNN>, a decoder that strips the text's first space): streamed text, logprob tokens, bytes and offsets,
and tool-call arguments in a conversation.

The checkpoint is a scripted bigram model: attention and MLP write nothing, embeddings are one-hot, and the
head maps each token to the one that follows it in SCRIPT, so greedy decoding emits known tokens. A real
`rollout-engine serve` subprocess runs it, driven with the official openai client and httpx."""
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from rollout_engine.server.detokenize import IncrementalDetokenizer  # noqa: E402
from server_fixtures import AUTH, KEY, running_server  # noqa: E402

SPECIAL = ["<unk>", "<s>", "</s>"]
PIECES = ["▁", "▁Hello", "▁world", "▁STOP", "▁more", "▁ok", "▁yes"]
# after each single-token prompt (a byte piece), the tokens the model emits; then </s>
SCRIPT = {
    "<0x41>": ["▁Hello", "▁world", "▁STOP", "▁more"],        # "Hello world STOP more"
    "<0x42>": ["▁ok", "▁", "<0xE4>", "<0xB8>", "<0xAD>", "▁more"],  # "ok 中 more": 中 is three byte pieces
    "<0xE4>": ["<0xB8>", "<0xAD>", "▁more"],                  # a prompt that ends inside 中
    "<0x45>": ["▁yes", "<0x0A>", "<0xE7>", "▁more"],           # "\n" then a byte that is no character
    "<0x44>": ["<0xE5>"],                                     # and <0xE6> a close second (ALTERNATIVES)
}
ALTERNATIVES = {"<0x44>": ("<0xE6>", 0.97)}  # token -> (its runner-up, that one's head weight; the first has 1)
# A compact template (the server holds 256 tokens, and this tokenizer spells most text byte by byte) that
# renders tool-call arguments with `| tojson`, as Qwen2.5's and Llama 3.1's templates do.
TEMPLATE = ("{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
            "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
            "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def spm_tokenizer():
    """Llama-2's tokenizer.json layout (Metaspace, BPE with byte fallback, the same decoder) over a tiny vocab."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate([*SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *PIECES])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(SPECIAL)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def scripted_checkpoint(path, tokenizer):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    hidden = (vocab + 63) // 64 * 64
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                         max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=eos,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=eos)
    model = Qwen3ForCausalLM(config).float()
    ids = tokenizer.convert_tokens_to_ids
    following = {}
    for first, rest in SCRIPT.items():
        chain = ids([first, *rest]) + [eos]
        for a, b in zip(chain, chain[1:]):
            assert following.setdefault(a, b) == b, "a token follows another with two different successors"
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.zero_()
        model.model.embed_tokens.weight[torch.arange(vocab), torch.arange(vocab)] = 1.0
        for a in range(vocab):
            model.lm_head.weight[following.get(a, eos), a] = 1.0
        for a, (b, weight) in ALTERNATIVES.items():
            model.lm_head.weight[ids(b), ids(a)] = weight
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tokenizer():
    return spm_tokenizer()


@pytest.fixture(scope="module")
def server(tokenizer, tmp_path_factory):
    path = scripted_checkpoint(tmp_path_factory.mktemp("scripted"), tokenizer)
    with running_server(path, tmp_path_factory.mktemp("log") / "server.log") as (_, url):
        yield url


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0, timeout=60)


def prompt(tokenizer, piece: str) -> list[int]:
    return [tokenizer.convert_tokens_to_ids(piece)]


def test_streamed_text_is_the_final_text(client, tokenizer):
    """Stream deltas add up to the non-streamed text, which is the output ids decoded alone (the prompt's
    tokens do not turn the first token's space into text), with and without a stop string held back; also
    when the prompt ends inside a character (the output's first bytes are then not a character), and when a
    byte that is no character turns the newline byte before it into U+FFFD too."""
    cases = [("<0x41>", None, "Hello world STOP more"), ("<0x41>", "STOP", "Hello world "),
             ("<0x41>", "XYZ", "Hello world STOP more"), ("<0x42>", "中 m", "ok "),
             ("<0xE4>", None, "\ufffd\ufffd more"), ("<0xE4>", "XYZ", "\ufffd\ufffd more"),
             ("<0x45>", None, "yes\ufffd\ufffd more")]
    for piece, stop, text in cases:
        kwargs = dict(model="tiny", max_tokens=20, temperature=0, stop=stop)
        ids = prompt(tokenizer, piece)
        whole = client.completions.create(prompt=ids, **kwargs).choices[0]
        streamed = list(client.completions.create(prompt=ids, stream=True, **kwargs))
        assert whole.text == text == "".join(ch.choices[0].text for ch in streamed), (piece, stop)
        assert [t for ch in streamed for t in ch.choices[0].token_ids] == whole.token_ids
        extra = {"extra_body": {"prompt_token_ids": ids}}
        whole = client.chat.completions.create(messages=[], **kwargs, **extra).choices[0]
        streamed = list(client.chat.completions.create(messages=[], stream=True, **kwargs, **extra))
        assert whole.message.content == text == "".join(ch.choices[0].delta.content or "" for ch in streamed
                                                        if ch.choices), (piece, stop)


@pytest.mark.parametrize(("piece", "stop", "kept", "text"), [
    ("<0x41>", "▁STOP", False, "Hello world"), ("<0x41>", "▁STOP", True, "Hello world STOP"),
    ("<0x42>", "<0xAD>", False, "ok "), ("<0x42>", "<0xAD>", True, "ok 中")])
def test_a_stop_token_s_text_is_left_out_unless_kept(client, tokenizer, piece, stop, kept, text):
    """stop_token_ids ends the choice on "▁STOP": its text is the text before it, whole and streamed, as with the
    stop string " STOP" (vLLM's rule); include_stop_str_in_output keeps the token's text, spaced as in context.
    A stop token that is the last byte of a character ("中" is three byte pieces) leaves that character out
    whole: the text before it ended in U+FFFD, which no stream sent, and a kept stop then added nothing (the
    whole text did not begin with the cut one)."""
    stop_id = tokenizer.convert_tokens_to_ids(stop)
    kwargs = dict(model="tiny", prompt=prompt(tokenizer, piece), max_tokens=20, temperature=0,
                  extra_body={"stop_token_ids": [stop_id], "include_stop_str_in_output": kept})
    whole = client.completions.create(**kwargs).choices[0]
    streamed = list(client.completions.create(stream=True, **kwargs))
    assert whole.finish_reason == "stop" and whole.stop_reason == stop_id and whole.token_ids[-1] == stop_id
    assert whole.text == text == "".join(ch.choices[0].text for ch in streamed), whole.text


def test_detokenizer_finish_sends_all_it_held_back(tokenizer):
    """finish() sends whatever was held back for stop strings; a final text that does not begin with what was
    sent is an error, never a silent loss."""
    ids = tokenizer.convert_tokens_to_ids(SCRIPT["<0x42>"])
    text = tokenizer.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer, hold_back=4)
    sent = "".join(detok.push([t]) for t in ids)
    assert text.startswith(sent) and len(sent) == len(text) - 4
    assert sent + detok.finish(text) == text and detok.text == text
    detok = IncrementalDetokenizer(tokenizer, hold_back=1)
    sent = "".join(detok.push([t]) for t in ids)
    with pytest.raises(RuntimeError, match="does not begin with"):
        detok.finish("no " + text)
    # a run of byte pieces decodes as a whole: "\n" reads as U+FFFD once a byte follows that makes no character
    ids = tokenizer.convert_tokens_to_ids(SCRIPT["<0x45>"])
    text = tokenizer.decode(ids, skip_special_tokens=True)
    detok = IncrementalDetokenizer(tokenizer)
    assert text == "yes\ufffd\ufffd more" and "".join(detok.push([t]) for t in ids) + detok.finish(text) == text


def test_chat_logprob_tokens_and_bytes(client, tokenizer):
    """Each token's text is its piece, "▁" a space; a byte piece's bytes are that byte (its text U+FFFD, as
    OpenAI's for part of a character); the tokens' bytes joined are the output's UTF-8."""
    r = client.chat.completions.create(model="tiny", messages=[], max_tokens=20, temperature=0, logprobs=True,
                                       top_logprobs=1, extra_body={"prompt_token_ids": prompt(tokenizer, "<0x42>")})
    content = r.choices[0].logprobs.content
    assert [e.token for e in content] == [" ok", " ", "\ufffd", "\ufffd", "\ufffd", " more", "</s>"]
    assert [e.bytes for e in content] == [[32, 111, 107], [32], [0xE4], [0xB8], [0xAD], list(b" more"),
                                          list(b"</s>")]
    assert bytes(b for e in content[:-1] for b in e.bytes).decode() == " " + r.choices[0].message.content
    assert [(e.top_logprobs[0].token, e.top_logprobs[0].bytes) for e in content] == [(e.token, e.bytes)
                                                                                       for e in content]
    r = client.completions.create(model="tiny", prompt=prompt(tokenizer, "<0x42>"), max_tokens=20, temperature=0,
                                  logprobs=1)
    assert r.choices[0].logprobs.tokens == [e.token for e in content]
    assert [list(top) for top in r.choices[0].logprobs.top_logprobs] == [[e.token] for e in content]


def test_completion_top_logprobs_keep_the_best_of_equal_texts(client, tokenizer):
    """<0xE5> and <0xE6> are both U+FFFD as text: completions' top_logprobs (keyed by text) keep the better."""
    r = client.completions.create(model="tiny", prompt=prompt(tokenizer, "<0x44>"), max_tokens=1, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert r.choices[0].token_ids == prompt(tokenizer, "<0xE5>")
    assert lp.top_logprobs == [{"\ufffd": pytest.approx(lp.token_logprobs[0], abs=1e-6)}]


@pytest.mark.parametrize("k", [0, 1])
def test_completion_top_logprobs_hold_the_sampled_token_and_k_alternatives(client, tokenizer, k):
    """vLLM's shape: each position's top_logprobs holds the sampled token (also when it is not among the k
    likeliest: temperature 2 draws such tokens, about 3% of them here, so 8 samples of 16 miss none with
    probability 0.97**120, 3%) and the k likeliest; logprobs=0 gives the sampled one alone. (A likelier
    alternative that reads as the same text, e.g. U+FFFD, keeps its logprob under that key.)"""
    r = client.completions.create(model="tiny", prompt=prompt(tokenizer, "<0x44>"), max_tokens=16, temperature=2.0,
                                  seed=5, n=8, logprobs=k, extra_body={"ignore_eos": True})
    tops = []
    for choice in r.choices:
        lp = choice.logprobs
        assert len(lp.top_logprobs) == len(lp.tokens) == 16
        for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert top[token] >= logprob - 1e-6 and 1 <= len(top) <= k + 1
        tops += lp.top_logprobs
    if k:
        assert any(len(top) == 2 for top in tops)  # a sampled token outside the top 1


def test_text_offsets_are_where_each_token_starts_in_the_text(client, tokenizer):
    """text_offset[i] is the length of the text decoded from the tokens before token i (a character's bytes
    start where the character does), the same streamed or not, a stop string held back or not."""
    for stop, offsets in [(None, [0, 2, 3, 3, 3, 4, 9]), ("more", [0, 2, 3, 3, 3, 4])]:
        kwargs = dict(model="tiny", prompt=prompt(tokenizer, "<0x42>"), max_tokens=20, temperature=0, stop=stop,
                      logprobs=0)
        whole = client.completions.create(**kwargs).choices[0]
        streamed = list(client.completions.create(stream=True, **kwargs))
        assert whole.logprobs.text_offset == offsets, stop
        assert [o for ch in streamed if ch.choices[0].logprobs for o in ch.choices[0].logprobs.text_offset] == offsets


def test_tool_call_arguments_render_once(server, tokenizer):
    """OpenAI sends an assistant's tool-call arguments as a JSON string; the template gets the value (its
    `| tojson` then writes the JSON once). As in vLLM, "" and "null" are {} and an array passes through;
    arguments that are not JSON are a 400 naming the field."""
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "2"}]
    r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30,
                   json={"model": "tiny", "messages": messages, "max_tokens": 1})
    assert r.status_code == 200, r.text
    rendered = tokenizer.decode(r.json()["prompt_token_ids"])
    assert rendered == 'user:hi\nassistant:f{"x": 1}\ntool:2\nassistant:'
    for arguments, shown in [("", "{}"), ("null", "{}"), ("[1, 2]", "[1, 2]")]:
        other_call = {**call, "function": {"name": "f", "arguments": arguments}}
        other = [messages[0], {**messages[1], "tool_calls": [other_call]}, messages[2]]
        r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30,
                       json={"model": "tiny", "messages": other, "max_tokens": 1})
        assert r.status_code == 200, r.text
        assert tokenizer.decode(r.json()["prompt_token_ids"]) == f"user:hi\nassistant:f{shown}\ntool:2\nassistant:"
    for arguments, words in [('{"x": ', "is not valid JSON"), ("nope", "is not valid JSON")]:
        bad_call = {**call, "function": {"name": "f", "arguments": arguments}}
        bad = [messages[0], {**messages[1], "tool_calls": [bad_call]}]
        r = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30,
                       json={"model": "tiny", "messages": bad, "max_tokens": 1})
        message = r.json()["error"]["message"]
        assert r.status_code == 400 and "messages[1].tool_calls[0].function.arguments" in message, r.text
        assert words in message, message


# ---------------------------------------------------------------------------------------------- no server

def padded_ids(tokenizer):
    """A byte run split by an id the tokenizer does not have (a model head padded past the tokenizer's
    vocabulary, e.g. 32000 pieces in a 32064-row head): the decoder skips that id, so the run goes on."""
    ids = tokenizer.convert_tokens_to_ids
    return [*ids(["▁yes", "<0x0A>"]), len(tokenizer), *ids(["<0xE7>", "▁more"])]


def test_detokenizer_skips_ids_the_tokenizer_does_not_have(tokenizer):
    """An id past the tokenizer's vocabulary decodes to nothing, as a special token does: it does not end a run
    of byte pieces, so the bytes before it stay pending (sending them early made finish() raise)."""
    for extra in (len(tokenizer), len(tokenizer) + 63):
        ids = padded_ids(tokenizer)
        ids[2] = extra
        text = tokenizer.decode(ids, skip_special_tokens=True)
        assert text == "yes\ufffd\ufffd more"
        for offsets in (False, True):
            detok = IncrementalDetokenizer(tokenizer, offsets=offsets)
            sent = "".join(detok.push([t]) for t in ids[:-1])
            assert sent + detok.finish(text, ids[-1:]) == text, (extra, offsets)


class _CountingTokenizer:
    """The tokenizer, counting the ids each decode call is given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.decoded = tokenizer, 0

    def decode(self, ids, **kwargs):
        self.decoded += len(ids)
        return self.tokenizer.decode(ids, **kwargs)

    def __len__(self):
        return len(self.tokenizer)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_long_byte_run_streams_in_linear_decoding_work(tokenizer):
    """A run of byte pieces (here 1,500 of them: 500 Hangul syllables, three bytes each) waits for the piece
    that ends it without decoding the growing run at every token: the decoder sees each id a bounded number
    of times (decoding the run at every token made it quadratic: 1.1 million ids here, seconds at 4,000)."""
    han = tokenizer.convert_tokens_to_ids(["<0xED>", "<0x95>", "<0x9C>"])
    ids = [*tokenizer.convert_tokens_to_ids(["▁ok", "▁"]), *han * 500, *tokenizer.convert_tokens_to_ids(["▁more"])]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "ok " + "\ud55c" * 500 + " more"
    counting = _CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) + detok.finish(text) == text
    assert pieces[-1].startswith("\ud55c" * 500)  # the run's text arrives when "▁more" ends it
    assert counting.decoded <= 6 * len(ids), counting.decoded


def test_a_special_token_added_after_first_use_does_not_end_a_byte_run():
    """The facts kept per tokenizer follow tokens added after their first use (a chat setup adds its special
    tokens after loading): a special token added later decodes to nothing, so it does not end a run of byte
    pieces, and the stream still adds up to the final text (with the facts of the first use, the run's bytes
    went out early and finish() raised)."""
    tokenizer = spm_tokenizer()
    ids = tokenizer.convert_tokens_to_ids(["▁yes", "<0x0A>", "<0xE7>", "▁more"])
    IncrementalDetokenizer(tokenizer).push(ids)  # the tokenizer's facts, built before the addition
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>"]})
    ids.insert(2, tokenizer.convert_tokens_to_ids("<|tool|>"))
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert text == "yes\ufffd\ufffd more"
    for offsets in (False, True):
        detok = IncrementalDetokenizer(tokenizer, offsets=offsets)
        sent = "".join(detok.push([t]) for t in ids[:-1])
        assert sent + detok.finish(text, ids[-1:]) == text, offsets


class _Engine:
    """engine.stream as AsyncEngine gives it: one snapshot per token, the last one finished with `final`."""

    def __init__(self, ids, final):
        self.ids, self.final = ids, final

    async def stream(self, prompt, params, request_id):
        import asyncio

        from rollout_engine.outputs import CompletionOutput, RequestOutput

        for k in range(1, len(self.ids) + 1):
            last = k == len(self.ids)
            out = CompletionOutput(0, self.ids[:k], None, self.final if last else None, "stop" if last else None,
                                   [0] * k)
            yield RequestOutput(request_id, None, prompt, [out], 0)
            for _ in range(0 if last else 5):  # the writer sends each snapshot before the next one comes; the
                await asyncio.sleep(0)          # last one ends the stream at once, as in AsyncEngine.stream

    async def abort(self, request_id):
        return None


def stream_events(tokenizer, ids, final) -> list[str]:
    """The SSE lines of a /v1/completions stream over `_Engine(ids, final)`, without a server."""
    import asyncio
    from unittest import mock

    from rollout_engine import SamplingParams
    from rollout_engine.server.generate import Generation, Plan

    plan = Plan(chat=False, http_id="cmpl-1", model="tiny", prompts=[(None, [5])], params=[SamplingParams()],
                return_ids=False, logprobs=None)
    generation = Generation(_Engine(ids, final), plan, tokenizer, mock.MagicMock(), {})

    async def receive():
        await asyncio.sleep(3600)

    async def run():
        return [e async for e in generation.events(receive)]

    events = asyncio.run(run())
    assert len(events) > 2, events  # text went out before the end
    return events


def test_stream_of_a_padded_vocab_byte_run_ends_with_done(tokenizer):
    ids = padded_ids(tokenizer)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    events = stream_events(tokenizer, ids, text)
    assert events[-1] == "data: [DONE]\n\n"
    import json
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == text


def test_a_detokenizer_error_ends_the_stream_with_an_error_event_and_done(tokenizer):
    """A final text that does not begin with the text already streamed (the detokenizer's RuntimeError) ends the
    stream with an error event and [DONE], as an engine error does, not with a broken connection."""
    import json

    ids = tokenizer.convert_tokens_to_ids(["▁Hello", "▁world", "▁more"])
    events = stream_events(tokenizer, ids, "Goodbye world more")
    assert events[-1] == "data: [DONE]\n\n"
    error = json.loads(events[-2][len("data: "):])["error"]
    assert "does not begin with" in error["message"] and error["type"] == "server_error", error


class _PacedEngine:
    """engine.stream for two prompts: prompt [5] ends after one token; any other streams `tokens` tokens, one every
    `gap` seconds."""

    def __init__(self, ids, gap):
        self.ids, self.gap = ids, gap

    async def stream(self, prompt, params, request_id):
        import asyncio

        from rollout_engine.outputs import CompletionOutput, RequestOutput

        ids = self.ids[:1] if prompt == [5] else self.ids
        for k in range(1, len(ids) + 1):
            last = k == len(ids)
            await asyncio.sleep(0 if prompt == [5] else self.gap)
            out = CompletionOutput(0, ids[:k], None, None, "length" if last else None, [0] * k)
            yield RequestOutput(request_id, None, prompt, [out], 0)

    async def abort(self, request_id):
        return None


def test_stream_interval_still_paces_a_stream_after_one_of_its_prompts_ended(tokenizer):
    """`stream_interval`: at most one chunk per interval, the end of a run sent at once. After the first of two
    prompts ends, the other's tokens still come together: 30 tokens 10 ms apart under a 100 ms interval make about
    4 chunks, not one a token."""
    import asyncio
    import json
    from unittest import mock

    from rollout_engine import SamplingParams
    from rollout_engine.server.generate import Generation, Plan

    ids = tokenizer.encode("one two three four five six seven eight nine ten " * 3)[:30]
    plan = Plan(chat=False, http_id="cmpl-2", model="tiny", prompts=[(None, [5]), (None, [6])],
                params=[SamplingParams(max_tokens=30)] * 2, return_ids=True, logprobs=None)
    generation = Generation(_PacedEngine(ids, 0.01), plan, tokenizer, mock.MagicMock(), {})

    async def receive():
        await asyncio.sleep(3600)

    async def run():
        return [e async for e in generation.events(receive, interval=0.1)]

    began = time.monotonic()
    chunks = [json.loads(e[len("data: "):]) for e in asyncio.run(run())[:-1]]
    elapsed = time.monotonic() - began  # a loaded machine sleeps longer: the bound follows the time it took
    second = [c for c in chunks if any(choice["index"] == 1 for choice in c["choices"])]
    assert sum(len(choice["token_ids"]) for c in second for choice in c["choices"] if choice["index"] == 1) == 30
    assert elapsed < 2.5, "too slow to tell paced chunks from one a token"
    assert len(second) <= elapsed / 0.1 + 3, ([len(c["choices"][0]["token_ids"]) for c in second], elapsed)
