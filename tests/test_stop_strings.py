"""Stop strings against the tokenizer's special tokens: the text they are matched against skips every special
token (`skip_special_tokens=True`), so a stop string that is a special token's whole text ("<|im_end|>", "</s>",
as clients and eval harnesses send them) also stops at that token; the window that reaches back past tokens that
decode to nothing: test_generation.py. The window over a Llama-2-style tokenizer's byte-fallback pieces, over
ids past the tokenizer's vocabulary, and after a tokenizer marks a piece special: StopStrings.check directly."""
import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

from rollout_engine import AsyncEngine, Engine, SamplingParams
from rollout_engine.sequence import Sequence
from rollout_engine.stop_strings import StopStrings, special_stop_ids, special_tokens
from rollout_engine.tiny_model import train_tokenizer

ENGINE = dict(device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8)
GREEDY = dict(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": [5, 6, 7]}


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    return Engine(tiny_checkpoint, **ENGINE)


def special_ids(tok) -> dict[str, int]:
    """The tiny tokenizer's three special tokens: <|endoftext|> (its EOS, in all_special_ids) and
    <|im_start|>/<|im_end|> (added tokens marked special, not in all_special_ids)."""
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>")}
    assert tok.convert_tokens_to_ids("<|im_end|>") not in tok.all_special_ids  # what makes the case interesting
    return ids


def test_a_stop_string_that_is_a_special_token_stops_at_that_token(engine):
    """Only a stop string equal to a special token's whole text names it; one that holds it among other text
    can only match text the model spells in ordinary pieces. special_tokens is built once per tokenizer."""
    tok = engine.tokenizer
    ids, specials = special_ids(tok), special_tokens(tok)
    assert special_tokens(tok) is specials
    assert special_stop_ids(["<|im_end|>"], specials) == [ids["<|im_end|>"]]
    assert special_stop_ids(["fine", "<|endoftext|>", "<|im_start|>"], specials) == sorted(
        [ids["<|endoftext|>"], ids["<|im_start|>"]])
    assert special_stop_ids(["done<|im_start|>", "<|im_end", "|>", "im_end"], specials) == []


def test_a_sample_stops_at_the_special_token_its_stop_string_names(tiny_checkpoint):
    """With the final norm's weight at zero every logit is equal and greedy decoding emits token 0, the EOS
    (<|endoftext|>); with ignore_eos it runs to max_tokens, unless stop="<|endoftext|>" stops it there."""
    engine = Engine(tiny_checkpoint, **ENGINE)
    norm = engine.model.model.norm.weight
    engine.update_weights([("model.norm.weight", torch.zeros_like(norm))])
    eos = special_ids(engine.tokenizer)["<|endoftext|>"]
    plain = engine.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == [eos] * GREEDY["max_tokens"] and plain.finish_reason == "length"
    out = engine.generate(PROMPT, SamplingParams(stop="<|endoftext|>", **GREEDY), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [eos] and out.finish_reason == "stop" and out.text == ""


@pytest.mark.parametrize("stop", ["<|im_end|>", ["fine", "<|endoftext|>"], "done<|im_start|>", "<|im_end"])
def test_stop_strings_around_special_tokens_are_accepted(engine, stop):
    """Such a request runs (it was refused once, which broke clients that send "</s>" as a stop), the caller's
    SamplingParams is left as it was, and the greedy tokens are those without the stop where none is reached."""
    params = SamplingParams(stop=stop, **GREEDY)
    before = (list(params.stop or []) if not isinstance(stop, str) else stop, params.stop_token_ids)
    out = engine.generate([PROMPT, PROMPT], params, use_tqdm=False)
    plain = engine.generate(PROMPT, SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    for o in out:
        n = len(o.outputs[0].token_ids)
        assert o.outputs[0].token_ids == plain.token_ids[:n]
    assert params.stop_token_ids == before[1]  # the engine stops on a copy


@pytest.fixture(scope="module")
def eos_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The tiny checkpoint with its final norm's weight at zero: every logit is equal, so greedy decoding emits
    token 0, the EOS (<|endoftext|>), at every step."""
    path = tmp_path_factory.mktemp("eos")
    for file in tiny_checkpoint.iterdir():
        shutil.copy(file, path)
    weights = load_file(path / "model.safetensors")
    weights["model.norm.weight"].zero_()
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # for the server's chat route
    tokenizer.save_pretrained(path)
    return path


def test_async_engine_stops_at_the_special_token_its_stop_string_names(eos_checkpoint):
    """AsyncEngine.generate and .stream stop where Engine.generate does (they dropped the params copy that
    carries the token's id, and ran to max_tokens)."""
    params = SamplingParams(stop="<|endoftext|>", **GREEDY)

    async def main(async_engine):
        out = await async_engine.generate([5, 6, 7], params)
        snapshots = [snap async for snap in async_engine.stream([5, 6, 7], params)]
        return out, snapshots[-1]

    with AsyncEngine(eos_checkpoint, **ENGINE) as async_engine:
        eos = special_ids(async_engine.engine.tokenizer)["<|endoftext|>"]
        for out in asyncio.run(main(async_engine)):
            assert out.outputs[0].token_ids == [eos] and out.outputs[0].finish_reason == "stop"
            assert out.outputs[0].stop_reason == "<|endoftext|>"  # the caller's stop string, not the token's id
    assert params.stop_token_ids == []  # the caller's params are left as they were


def test_the_server_stops_at_the_special_token_its_stop_string_names(eos_checkpoint, tmp_path):
    """/v1/completions and /v1/chat/completions, whole and streamed, stop at "<|endoftext|>"."""
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from server_fixtures import AUTH, running_server

    with running_server(eos_checkpoint, tmp_path / "server.log") as (_, url):
        for route, body in (("completions", {"prompt": [5, 6, 7]}),
                            ("chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            for stream in (False, True):
                answer = httpx.post(f"{url}/v1/{route}", headers=AUTH, timeout=60, json={
                    **body, "model": "tiny", "stop": ["<|endoftext|>"], "stream": stream, "ignore_eos": True,
                    "max_tokens": GREEDY["max_tokens"], "temperature": 0})
                assert answer.status_code == 200, answer.text
                assert '"finish_reason":"stop"' in answer.text.replace(" ", ""), (route, stream, answer.text)
                assert '"length"' not in answer.text, (route, stream)


def test_async_engine_accepts_a_special_stop(tiny_checkpoint):
    params = SamplingParams(stop=["<|im_end|>"], **GREEDY)

    async def main(async_engine):
        out = await async_engine.generate([5, 6, 7], params)
        async for _ in async_engine.stream([5, 6, 7], params):
            pass
        return out

    with AsyncEngine(tiny_checkpoint, **ENGINE) as async_engine:
        out = asyncio.run(main(async_engine))
    assert 1 <= len(out.outputs[0].token_ids) <= GREEDY["max_tokens"]


def byte_fallback_tokenizer():
    """Llama-2's layout (Metaspace, BPE with byte fallback, its decoder) over a tiny vocab: a character the vocab
    lacks is spelled as byte pieces <0xNN>, and the decoder turns a run of them into text as a whole (all
    U+FFFD when the run is not UTF-8)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    special = ["<unk>", "<s>", "</s>"]
    pieces = [*special, *(f"<0x{b:02X}>" for b in range(256)), "▁ok", "▁more", "▁yes"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(pieces)}, merges=[], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def pieces(tok, *parts) -> list[int]:
    """Token ids of `parts`: a piece's name ("▁ok"), or text spelled as byte pieces (bytes)."""
    names = []
    for part in parts:
        names += [f"<0x{b:02X}>" for b in part] if isinstance(part, bytes) else [part]
    return tok.convert_tokens_to_ids(names)


class Finished:
    def finish(self, seq, reason):
        seq.finish_reason = reason


def run_stop(tok, out, stop, steps=None) -> Sequence:
    """`out` delivered `steps` tokens at a time (one by default), each with a logprob and its top-1, checked after
    each step as the engine's loop does."""
    seq = Sequence(0, 0, [5], SamplingParams(stop=stop, max_tokens=1000, ignore_eos=True, logprobs=1), 0)
    checker, at = StopStrings(tok, Finished()), 0
    for k in steps or [1] * len(out):
        for t in out[at : at + k]:
            seq.token_ids.append(t)
            seq.logprobs.append(-0.5)
            seq.top_logprobs.append({t: -0.5})
            seq.weight_versions.append(0)
        at += k
        checker.check(seq)
        if seq.finish_reason:
            break
    return seq


def assert_stopped_at(seq, tok, tokens: list[int], text: str):
    assert (seq.finish_reason, seq.text) == ("stop", text)
    assert tok.convert_ids_to_tokens(seq.output_ids) == tok.convert_ids_to_tokens(tokens)
    assert len(seq.logprobs) == len(seq.weight_versions) == len(seq.top_logprobs) == len(tokens)


@pytest.mark.parametrize("tail", ["▁more ▁yes", "▁more", ""])
def test_a_stop_string_after_a_long_run_of_byte_pieces_ends_the_sample_there(tail):
    """Llama 2 spells "\n" and rare characters as byte pieces: with stop="\n" after four 3-byte characters, the
    tokens, logprobs and text end at the newline, also when the sample would end one token after it."""
    tok = byte_fallback_tokenizer()
    upto = pieces(tok, "▁ok", "中中中中\n".encode())
    seq = run_stop(tok, upto + pieces(tok, *tail.split()), ["\n"])
    assert_stopped_at(seq, tok, upto, "ok中中中中")


@pytest.mark.parametrize("steps", [[1] * 6, [1, 2, 2, 1], [1, 3, 2], [2, 4], [6]])
def test_the_stop_does_not_depend_on_how_many_tokens_a_step_brings(steps):
    """A speculative step brings several tokens: "\n" then the first byte of 中 in the same step (the run
    "\n" + a partial character decodes to U+FFFD throughout) still stops at the newline."""
    tok = byte_fallback_tokenizer()
    upto = pieces(tok, "▁ok", b"\n")
    seq = run_stop(tok, upto + pieces(tok, "中".encode(), "▁more"), ["\n"], steps)
    assert_stopped_at(seq, tok, upto, "ok")


def test_a_stop_string_split_by_ids_past_the_vocabulary_is_found():
    """A model head padded past the tokenizer (32000 pieces, 32064 rows) may emit an id the tokenizer lacks; it
    decodes to nothing, like a special token, so "A", 13 such ids, "B" stops at "AB"."""
    tok = byte_fallback_tokenizer()
    out = pieces(tok, b"A") + [len(tok) + 3] * 13 + pieces(tok, b"B")
    assert tok.decode(out, skip_special_tokens=True) == "AB"
    assert_stopped_at(run_stop(tok, out, ["AB"]), tok, out, "")


@pytest.mark.parametrize("mark", ["add_special_tokens", "add_tokens"])
def test_a_piece_marked_special_after_use_stops_as_a_special_token(mark):
    """A setup step marks an added piece special after the tokenizer was used (its length stays): a stop string
    naming it then stops at the token, and the window reaches back past it as past any special token."""
    tok = train_tokenizer()
    tok.add_tokens(["<|eot|>"])
    eot, x, y = tok.convert_tokens_to_ids("<|eot|>"), *tok.encode("xy", add_special_tokens=False)
    assert special_stop_ids(["<|eot|>"], special_tokens(tok)) == []
    assert run_stop(tok, [x, eot, y], ["xy"]).finish_reason is None
    if mark == "add_special_tokens":
        tok.add_special_tokens({"additional_special_tokens": ["<|eot|>"]})
    else:
        tok.add_tokens(["<|eot|>"], special_tokens=True)
    assert tok.decode([eot], skip_special_tokens=True) == ""
    assert special_stop_ids(["<|eot|>"], special_tokens(tok)) == [eot]
    out = [x] + [eot] * 40 + [y]
    assert_stopped_at(run_stop(tok, out, ["xy"]), tok, out, "")


def test_a_check_decodes_a_bounded_window_inside_a_long_run_of_byte_pieces(monkeypatch):
    """Korean in a Llama-2-style vocabulary is one unbroken run of byte pieces: each step's check decodes a window
    of a few characters, not the run so far (3,000 pieces: at most 20 tokens decoded a step; the whole run each
    step would be 4.5M tokens in all), and still stops at the newline after it."""
    tok = byte_fallback_tokenizer()
    out = pieces(tok, "▁ok", ("가" * 1000 + "\n").encode(), "▁more")
    decoded = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    seq = run_stop(tok, out, ["\n"])
    assert seq.finish_reason == "stop" and seq.output_ids == out[:-1]
    assert len(decoded) <= len(out) + 2 and sum(decoded) - len(out) <= 20 * len(out), (len(decoded), sum(decoded))


def test_a_resumed_sample_checks_a_bounded_window_of_its_old_tokens(monkeypatch):
    """A partial sample resumed with stop strings: its first check after the resume decodes a window at the
    boundary, not every prefix of its old tokens (1,500 old tokens with byte pieces among them: a check from the
    start would decode about 1.1M tokens), and a stop string across the boundary is still found."""
    from rollout_engine.outputs import CompletionOutput, RequestOutput
    from rollout_engine.partial import resumed_sequences

    tok = byte_fallback_tokenizer()
    old = pieces(tok, *(["▁ok", "▁more", b"\n"] * 500))
    params = SamplingParams(stop=["\nSTOP"], max_tokens=10_000, ignore_eos=True)
    out = RequestOutput(0, None, [5], [CompletionOutput(0, old, [-0.5] * len(old), None, "abort", [0] * len(old))],
                        0)
    decoded = []
    decode = tok.decode
    monkeypatch.setattr(tok, "decode", lambda ids, **kw: decoded.append(len(ids)) or decode(ids, **kw))
    [seq] = resumed_sequences(out, params, 0, [1])
    seq.token_ids.append(pieces(tok, "▁yes")[0])
    seq.logprobs.append(-0.5)
    seq.weight_versions.append(0)
    StopStrings(tok, Finished()).check(seq)
    assert seq.finish_reason is None and sum(decoded) <= 2_000, sum(decoded)

    [seq] = resumed_sequences(out, SamplingParams(stop=["\n ok"], max_tokens=10_000, ignore_eos=True), 0, [1])
    seq.token_ids.append(pieces(tok, "▁ok")[0])  # "...more\n" + " ok": the stop string spans the boundary
    seq.logprobs.append(-0.5)
    seq.weight_versions.append(0)
    StopStrings(tok, Finished()).check(seq)
    assert seq.finish_reason == "stop" and seq.output_ids == old + pieces(tok, "▁ok")


def first_stop(tok, out, stops):
    """The reference: decode the whole output after each token; the first stop's end token and the text before it."""
    for end in range(1, len(out) + 1):
        text = tok.decode(out[:end], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return end, text[: min(hits)]
    return None, None


@pytest.mark.parametrize("seed", range(3))
def test_stops_match_decoding_the_whole_output_after_each_token(seed):
    """Random texts of 1-4-byte characters spelled in byte pieces, with special tokens and ids past the vocabulary
    between them, delivered in random step sizes: a check ends the sample where decoding the whole output after
    each token first shows the stop string, with the text before it."""
    import random

    tok = byte_fallback_tokenizer()
    rng, size, checked = random.Random(seed), len(tok), 0
    for _ in range(60):
        out = pieces(tok, "▁ok")
        for ch in (rng.choice(["A", "é", "中", "😀", "\n"]) for _ in range(rng.randrange(2, 6))):
            out += pieces(tok, ch.encode()) + [rng.choice([2, size + 1])] * rng.choice([0, 0, rng.randrange(1, 40)])
        out += pieces(tok, "▁more")
        text = tok.decode(out, skip_special_tokens=True)
        at = rng.randrange(2, len(text) - 5)
        stop = text[at : at + rng.randrange(2, 5)]
        if not stop.strip():
            continue
        steps = [rng.choice([1, 1, 2, 3, 7]) for _ in out]
        seq = run_stop(tok, out, [stop], steps)
        got = (len(seq.output_ids), seq.text) if seq.finish_reason else (None, None)
        assert got == first_stop(tok, out, [stop]), (stop, text, steps[:8])
        checked += 1
    assert checked >= 40


def test_a_stop_token_s_text_is_not_the_sample_s_text(tiny_checkpoint):
    """A sample that stop_token_ids ends ends on that token (its id and logprob kept), but its text is the text
    before it, as a stop string's is and as vLLM gives it: a text reward must not see the stop token. The same
    in an AsyncEngine's result and its stream's last snapshot."""
    engine = Engine(tiny_checkpoint, **ENGINE)
    tok = engine.tokenizer
    seeded = dict(temperature=1.0, seed=3, max_tokens=12, ignore_eos=True)  # greedy repeats one token here
    free = engine.generate(PROMPT, SamplingParams(**seeded), use_tqdm=False)[0].outputs[0].token_ids
    at = next(i for i, t in enumerate(free) if i > 0 and tok.decode([t]).strip() and t not in free[:i])
    params = SamplingParams(stop_token_ids=[free[at]], **seeded)
    before = tok.decode(free[:at], skip_special_tokens=True)
    assert before != tok.decode(free[: at + 1], skip_special_tokens=True)  # the token has text of its own
    out = engine.generate(PROMPT, params, use_tqdm=False)[0].outputs[0]
    assert out.token_ids == free[: at + 1] and out.finish_reason == "stop" and out.stop_reason == free[at]
    assert out.text == before and len(out.logprobs) == at + 1
    del engine

    async def main(async_engine):
        out = await async_engine.generate([5, 6, 7], params)
        snapshots = [snap async for snap in async_engine.stream([5, 6, 7], params)]
        return out, snapshots[-1]

    with AsyncEngine(tiny_checkpoint, **ENGINE) as async_engine:
        for out in asyncio.run(main(async_engine)):
            assert out.outputs[0].token_ids == free[: at + 1] and out.outputs[0].text == before
