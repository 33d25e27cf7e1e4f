"""/v1/chat/completions with a reasoning parser (`serve --reasoning-parser qwen3` or `deepseek_r1`): the official
openai client reads the reasoning (`reasoning` and `reasoning_content`) apart from the content, whole and
streamed; a tool call inside the reasoning is not a call; a prompt that opens the block starts the reply inside
it. In process, over a scripted engine whose reply is a given text."""
import json

import pytest

pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("openai")

from server_fixtures import CALL, ask, tokenizer  # noqa: E402, F401  (tokenizer: a fixture)

THOUGHT = "<think>\n1 and 2 make 3.\n</think>\n\n"


def test_reasoning_comes_apart_from_the_content(tokenizer):
    message = ask(tokenizer, THOUGHT + "It is 3.", reasoning="qwen3", tools=None).choices[0].message
    assert message.content == "It is 3."
    assert message.reasoning_content == message.reasoning == "\n1 and 2 make 3.\n"
    content, thought, calls, finish = ask(tokenizer, THOUGHT + "It is 3.", reasoning="qwen3", stream=True, tools=None)
    assert (content, thought, calls, finish) == ("It is 3.", "\n1 and 2 make 3.\n", [], "stop")


def test_a_reply_without_reasoning_is_all_content(tokenizer):
    message = ask(tokenizer, "It is 3.", reasoning="qwen3", tools=None).choices[0].message
    assert message.content == "It is 3." and message.reasoning_content is None
    plain = ask(tokenizer, THOUGHT + "It is 3.", tools=None).choices[0].message  # no parser: the text as written
    assert plain.content == THOUGHT + "It is 3." and not hasattr(plain, "reasoning_content")


def test_a_reply_cut_short_while_thinking_has_no_content(tokenizer):
    message = ask(tokenizer, "<think>\n1 and 2", reasoning="qwen3", tools=None).choices[0].message
    assert message.content is None and message.reasoning_content == "\n1 and 2"


def test_tool_calls_are_read_from_the_content_only(tokenizer):
    """A call after the reasoning is a call; one the model only thinks about is reasoning."""
    done = ask(tokenizer, THOUGHT + CALL, reasoning="qwen3").choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content is None
    assert json.loads(done.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    assert done.message.reasoning_content == "\n1 and 2 make 3.\n"
    content, thought, calls, finish = ask(tokenizer, THOUGHT + CALL, reasoning="qwen3", stream=True)
    assert (content, thought, finish) == ("", "\n1 and 2 make 3.\n", "tool_calls") and len(calls) == 1
    mused = ask(tokenizer, "<think>maybe " + CALL + "</think>no need.", reasoning="qwen3").choices[0]
    assert mused.finish_reason == "stop" and mused.message.tool_calls is None
    assert mused.message.content == "no need." and mused.message.reasoning_content == "maybe " + CALL


def test_a_prompt_that_opens_the_block_starts_the_reply_inside_it(tokenizer):
    """DeepSeek-R1's template ends the prompt with <think>: the reply holds only the end tag."""
    template = tokenizer.chat_template
    tokenizer.chat_template = template + "{% if add_generation_prompt %}<think>\n{% endif %}"
    try:
        message = ask(tokenizer, "1 and 2 make 3.\n</think>\n\nIt is 3.", reasoning="deepseek_r1",
                      tools=None).choices[0].message
        streamed = ask(tokenizer, "1 and 2 make 3.\n</think>\n\nIt is 3.", reasoning="deepseek_r1", stream=True,
                       tools=None)
    finally:
        tokenizer.chat_template = template
    assert (message.content, message.reasoning_content) == ("It is 3.", "1 and 2 make 3.\n")
    assert streamed == ("It is 3.", "1 and 2 make 3.\n", [], "stop")


def test_an_unknown_reasoning_parser_is_refused(tokenizer):
    from rollout_engine.server import create_app
    from server_fixtures import replying

    with pytest.raises(ValueError, match="reasoning_parser='r1' is not allowed; one of"):
        create_app(replying(tokenizer, "hi"), reasoning_parser="r1")


@pytest.mark.parametrize("parser", [{"reasoning_parser": "qwen3"}, {"tool_call_parser": "hermes"}])
def test_a_parser_on_a_checkpoint_without_a_tokenizer_is_refused_at_start(parser):
    """A checkpoint without a tokenizer serves token ids only: a parser would have no text to read (the
    reasoning parser's first request was a 500), so the server refuses to start with one, naming it."""
    from types import SimpleNamespace

    from rollout_engine.server import create_app

    engine = SimpleNamespace(tokenizer=None, vocab_size=512, model_path="tiny", max_seq_len=256)  # never asked
    [(arg, name)] = parser.items()
    with pytest.raises(ValueError, match=f"{arg}='{name}' needs the checkpoint's tokenizer"):
        create_app(engine, **parser)


@pytest.mark.parametrize("parser, tags", [({"tool_call_parser": "hermes"}, ["<tool_call>", "</tool_call>"]),
                                          ({"tool_call_parser": "qwen3_coder"}, ["<tool_call>", "</tool_call>"]),
                                          ({"reasoning_parser": "qwen3"}, ["<think>", "</think>"])])
def test_a_parser_whose_tags_the_tokenizer_marks_special_is_refused_at_start(tiny_checkpoint, parser, tags):
    """Replies are decoded without special tokens: where the tokenizer marks a parser's tags special, the parser
    never sees them and every call (or thought) would come back as plain content. Refused at start, naming the
    tag; the same tags as plain added tokens parse as usual."""
    from transformers import AutoTokenizer

    from rollout_engine.server import create_app
    from server_fixtures import replying

    [(arg, name)] = parser.items()
    plain = AutoTokenizer.from_pretrained(tiny_checkpoint)
    plain.add_tokens(tags)
    create_app(replying(plain, "hi"), **parser)
    special = AutoTokenizer.from_pretrained(tiny_checkpoint)
    special.add_special_tokens({"additional_special_tokens": tags})
    refusal = f"{arg}='{name}' reads the tag '{tags[0]}', and this tokenizer marks it special"
    with pytest.raises(ValueError, match=refusal):
        create_app(replying(special, "hi"), **parser)
