"""/v1/chat/completions with a tool-call parser (`serve --tool-call-parser hermes`, `llama3_json`): the official
openai client reads `message.tool_calls` from whole replies and from streams, a malformed call comes back as the
text it was, and tool_choice "none", no tools or no parser leave replies as they are. In process, over a scripted engine
whose reply is a given text (a random tiny model writes no tool calls)."""
import json

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

from rollout_engine.server import create_app  # noqa: E402
from rollout_engine.server.chat_reply import StreamedReply  # noqa: E402
from rollout_engine.tool_calls import HermesToolCallParser  # noqa: E402
from server_fixtures import CALL, ask, replying, tokenizer  # noqa: E402, F401  (tokenizer: a fixture)

def test_a_reply_with_a_call_comes_back_as_tool_calls(tokenizer):
    done = ask(tokenizer, "let me add.\n" + CALL)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me add."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    again = ask(tokenizer, CALL + CALL).choices[0].message
    assert again.content is None and len({c.id for c in again.tool_calls}) == 2  # ids differ


@pytest.mark.parametrize("reply", [
    '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>',   # a required argument missing
    '<tool_call>{"name": "mul", "arguments": {"a": 1, "b": 2}}</tool_call>',  # a tool the request did not offer
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}',          # never closed
    "no call here, 1 < 2 and <tool is not a tag",
])
def test_a_reply_without_a_well_formed_call_comes_back_as_written(tokenizer, reply):
    for stream in (False, True):
        got = ask(tokenizer, reply, stream=stream)
        if stream:
            assert got == (reply, "", [], "stop")
        else:
            assert got.choices[0].message.content == reply and not got.choices[0].message.tool_calls
            assert got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("request_args", [dict(parser=None), dict(tool_choice="none"), dict(tools=None)])
def test_no_parser_no_tools_or_tool_choice_none_leave_the_reply_as_text(tokenizer, request_args):
    done = ask(tokenizer, CALL, **request_args)
    assert done.choices[0].message.content == CALL and not done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "stop"


def test_a_stream_holds_the_call_back_and_sends_it_last(tokenizer):
    content, _, calls, finish = ask(tokenizer, "let me add.\n" + CALL + " done", stream=True)
    assert content == "let me add.\ndone" and finish == "tool_calls"  # nothing of the call's text as content
    [call] = calls
    assert call.index == 0 and call.function.name == "add" and json.loads(call.function.arguments) == {"a": 1, "b": 2}


def test_streamed_reply_holds_a_tail_that_may_begin_the_tag():
    reply = StreamedReply(HermesToolCallParser())
    text = "a<tool_ca" + CALL[len("<tool_ca"):]
    sent = [reply.push(ch)["content"] for ch in "a<tool_ca"]
    assert "".join(sent) == "a"  # "<tool_ca" may begin a tag: held
    sent += [reply.push(ch)["content"] for ch in text[len("a<tool_ca"):]]
    assert "".join(sent) == "a"
    fields, finish = reply.finish("", "stop")
    assert finish == "tool_calls" and fields["content"] == "" and fields["tool_calls"][0]["function"]["name"] == "add"
    plain = StreamedReply(HermesToolCallParser())
    assert plain.push("x <tool") == {"content": "x "} and plain.push("box") == {"content": "<toolbox"}
    assert plain.finish("", "length") == ({"content": ""}, "length")


def test_llama3_json_replies_whole_and_streamed(tokenizer):
    """A Llama 3 reply that is a call comes back as tool_calls, whole and streamed (no content streamed); one that
    begins as text streams as content whatever follows."""
    call = '{"name": "add", "parameters": {"a": 1, "b": 2}}'
    message = ask(tokenizer, call, parser="llama3_json").choices[0]
    assert message.finish_reason == "tool_calls" and message.message.content is None
    assert json.loads(message.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    content, _, calls, finish = ask(tokenizer, call, parser="llama3_json", stream=True)
    assert content == "" and finish == "tool_calls" and calls[0].function.name == "add"
    content, _, calls, finish = ask(tokenizer, "it is " + call, parser="llama3_json", stream=True)
    assert content == "it is " + call and not calls and finish == "stop"


def test_an_unknown_parser_is_refused_by_name(tokenizer):
    with pytest.raises(ValueError, match="tool_call_parser='xml' is not allowed"):
        create_app(replying(tokenizer, "hi"), tool_call_parser="xml")


def test_qwen3_coder_replies_whole_and_streamed(tokenizer):
    """Qwen3-Coder's XML call comes back as tool_calls with its arguments read by the schema (integers as
    integers), whole and streamed; the text before it is content."""
    call = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
            "</function>\n</tool_call>")
    done = ask(tokenizer, "adding.\n" + call, parser="qwen3_coder").choices[0]
    assert done.finish_reason == "tool_calls" and done.message.content == "adding."
    assert json.loads(done.message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}
    content, _, calls, finish = ask(tokenizer, "adding.\n" + call, parser="qwen3_coder", stream=True)
    assert content.strip() == "adding." and finish == "tool_calls"
    assert [json.loads(c.function.arguments) for c in calls] == [{"a": 1, "b": 2}]
