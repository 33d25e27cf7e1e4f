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
from rollout_engine.server.chat_reply import StreamedReply, parser_for  # noqa: E402
from rollout_engine.tool_calls import HermesToolCallParser  # noqa: E402
from server_fixtures import CALL, TOOLS, ask, replying, tokenizer  # noqa: E402, F401  (tokenizer: a fixture)

def test_a_reply_with_a_call_comes_back_as_tool_calls(tokenizer):
    done = ask(tokenizer, "let me add.\n" + CALL)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "let me add."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "add"
    assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
    again = ask(tokenizer, CALL + CALL).choices[0].message
    assert again.content is None and len({c.id for c in again.tool_calls}) == 2  # ids differ


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(tokenizer):
    """OpenAI's `parallel_tool_calls`: false asks for one call a turn, which an agent loop that runs one tool at a
    time relies on; the server took it and returned every call. Now the first call alone comes back (vLLM's
    rule: the reply is not cut short, the later calls are dropped), whole and streamed; true or absent, all."""
    second = CALL.replace('"a": 1', '"a": 5')
    for parallel, firsts in ((False, [1]), (True, [1, 5]), (None, [1, 5])):
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        choice = ask(tokenizer, "adding.\n" + CALL + second, **extra).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "adding."
        assert [json.loads(c.function.arguments)["a"] for c in choice.message.tool_calls] == firsts
        content, _, calls, finish = ask(tokenizer, "adding.\n" + CALL + second, stream=True, **extra)
        assert content == "adding." and finish == "tool_calls"
        assert [json.loads(c.function.arguments)["a"] for c in calls] == firsts


def test_parallel_tool_calls_must_be_a_bool(tokenizer):
    with pytest.raises(openai.BadRequestError, match="parallel_tool_calls"):
        ask(tokenizer, CALL, parallel_tool_calls="no")


@pytest.mark.parametrize("keep", [False, True])
def test_a_reply_stopped_at_the_calls_end_tag_comes_back_as_a_call_that_says_which_stop_ended_it(tokenizer, keep):
    """Agent loops stop at "</tool_call>" (one call per turn): the engine cuts that stop string from the text, and
    the call, never closed there, came back as content with finish_reason "stop". Now the end tag that stopped it
    closes it: finish_reason "tool_calls" with the engine's stop_reason (vLLM's), whole and on a stream's last
    chunk; with include_stop_str_in_output the kept tag does the same."""
    import asyncio

    cut = CALL[: -len("</tool_call>")]
    app = create_app(replying(tokenizer, "let me add.\n" + cut, stop_reason="</tool_call>"), tool_call_parser="hermes")
    body = {"model": "tiny", "messages": [{"role": "user", "content": "1 + 2?"}], "tools": TOOLS,
            "stop": ["</tool_call>"], "include_stop_str_in_output": keep}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            whole = (await http.post("/v1/chat/completions", json=body)).json()
            streamed = (await http.post("/v1/chat/completions", json={**body, "stream": True})).text
            return whole, [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]

    whole, chunks = asyncio.run(main())
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["stop_reason"] == "</tool_call>"
    assert choice["message"]["content"] == "let me add."
    [call] = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["</tool_call>"]
    streamed_calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls") or []]
    assert [json.loads(t["function"]["arguments"]) for t in streamed_calls] == [{"a": 1, "b": 2}]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "let me add."


@pytest.mark.parametrize("arguments", [{"a": 1}, {"a": "1", "b": 2}, {"a": 1, "b": 2, "c": 3}])
def test_a_call_whose_arguments_miss_the_schema_comes_back_as_a_call(tokenizer, arguments):
    """A well-formed call to an offered tool is a call whatever its arguments (a required one missing, a string
    for an integer, one the schema does not declare), as vLLM returns it: the client's tool answers the bad
    argument, and the model reads that answer; also beside a good call."""
    bad = '<tool_call>{"name": "add", "arguments": %s}</tool_call>' % json.dumps(arguments)
    for stream in (False, True):
        got = ask(tokenizer, CALL + bad, stream=stream)
        content, calls, finish = (got[0], got[2], got[3]) if stream else (
            got.choices[0].message.content, got.choices[0].message.tool_calls, got.choices[0].finish_reason)
        assert finish == "tool_calls" and not content
        assert [json.loads(c.function.arguments) for c in calls] == [{"a": 1, "b": 2}, arguments]


@pytest.mark.parametrize("reply", [
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


@pytest.mark.parametrize("request_args", [dict(parser=None, tool_choice="none"), dict(tool_choice="none"),
                                          dict(tools=None), dict(parser=None, tools=None)])
def test_no_tools_or_tool_choice_none_leave_the_reply_as_text(tokenizer, request_args):
    done = ask(tokenizer, CALL, **request_args)
    assert done.choices[0].message.content == CALL and not done.choices[0].message.tool_calls
    assert done.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("request_args", [{}, dict(tool_choice="auto")])
def test_tools_on_a_server_without_a_parser_are_refused(tokenizer, request_args):
    """As vLLM refuses them ('"auto" tool choice requires --tool-call-parser'): served, the call would come back
    as text and an agent loop would take the reply for the episode's end."""
    import openai

    with pytest.raises(openai.BadRequestError, match="--tool-call-parser"):
        ask(tokenizer, CALL, parser=None, **request_args)


def test_a_stream_holds_the_call_back_and_sends_it_last(tokenizer):
    content, _, calls, finish = ask(tokenizer, "let me add.\n" + CALL + " done", stream=True)
    assert content == "let me add.\n done" and finish == "tool_calls"  # nothing of the call's text as content
    whole = ask(tokenizer, "let me add.\n" + CALL + " done").choices[0].message
    assert whole.content == content  # the stream's deltas add up to the whole reply's content
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
    # white space waits for what follows it: a reply with calls ends without it
    assert plain.push("x <tool") == {"content": "x"} and plain.push("box") == {"content": " <toolbox"}
    assert plain.finish("", "length") == ({"content": ""}, "length")


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json"])
def test_a_run_of_white_space_is_not_searched_again_at_each_push(parser_name):
    """Trailing white space is held (a reply with calls drops it), and each push of a long run searched the whole
    run again: quadratic on the event loop, for the runs of newlines RL rollouts degenerate into. Now a push of
    white space alone sends nothing and searches nothing; the text adds up as before."""
    parser, searched = parser_for(parser_name, TOOLS, "auto"), []
    hold_from = parser.hold_from
    parser.hold_from = lambda text, since=0: searched.append(len(text) - since) or hold_from(text, since)
    reply = StreamedReply(parser)
    sent = reply.push("hi")["content"] + "".join(reply.push("\n\n")["content"] for _ in range(500))
    sent += reply.push("there")["content"]
    assert sent == "hi" + "\n" * 1000 + "there" and reply.finish("", "stop") == ({"content": ""}, "stop")
    assert len(searched) == 2  # at "hi" and at "there", not at each of the 500 pushes between


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


STREAM_REPLIES = ["Sure, let me add." + CALL, "I will add.\n" + CALL, "ok " + CALL + " bye", "\n\n" + CALL,
                  "  Hi " + CALL + "\n", CALL + "\n" + CALL, "plain text, no call \n", "a < b\n" + CALL[:-3]]
QWEN3_CODER_CALL = "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n" \
                   "</function>\n</tool_call>"


@pytest.mark.parametrize("parser_name", ["hermes", "qwen3_coder", "llama3_json"])
def test_streamed_content_adds_up_to_the_whole_replys_at_every_split(parser_name):
    """However a reply's text arrives in deltas (every split in two, and character by character), the streamed
    content deltas add up to the whole reply's content and the calls are the same: white space next to a
    call was dropped from one and not the other, and a last delta of several tokens lost the space at its start
    ("Sure,let me add.")."""
    from rollout_engine.server.chat_reply import parser_for, whole_message
    from rollout_engine.tool_call_parsers import PARSERS
    from server_fixtures import TOOLS

    assert set(PARSERS) >= {"hermes", "qwen3_coder", "llama3_json"}
    call = QWEN3_CODER_CALL if parser_name == "qwen3_coder" else CALL
    replies = [r.replace(CALL, call) for r in STREAM_REPLIES]
    if parser_name == "llama3_json":
        replies += ['{"name": "add", "parameters": {"a": 1, "b": 2}}', ' {"name": "add"', "hello {"]
    for text in replies:
        message, finish = whole_message(parser_for(parser_name, TOOLS, "auto"), None, text, "stop")
        names = [c["function"]["name"] for c in message.get("tool_calls", [])]
        for cuts in [[i] for i in range(len(text) + 1)] + [list(range(1, len(text)))]:
            reply = StreamedReply(parser_for(parser_name, TOOLS, "auto"))
            pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            sent = [reply.push(p)["content"] for p in pieces[:-1]]
            last, streamed_finish = reply.finish(pieces[-1], "stop")
            streamed = "".join(sent) + last["content"]
            assert streamed == (message["content"] or ""), (parser_name, text, cuts)
            assert [c["function"]["name"] for c in last.get("tool_calls", [])] == names
            assert streamed_finish == finish


@pytest.mark.parametrize("shape", [{"enum": 5}, {"enum": None}, {"type": {"x": 1}}, {"type": [{"x": 1}]}])
def test_a_tool_schema_the_checker_cannot_read_is_refused_before_generation(tokenizer, shape):
    """A tool whose parameters' schema has a keyword of the wrong shape is the request's error (400 naming the
    tool and the keyword), found before generation: it was a TypeError after generation, a bare 500 or an
    error event in a stream."""
    import openai

    from rollout_engine.tool_calls import tool_names

    parameters = {"type": "object", "properties": {"a": {"type": "integer"} | shape}}
    tools = [{"type": "function", "function": {"name": "add", "parameters": parameters}}]
    word = next(iter(shape))
    with pytest.raises(ValueError, match=rf"tool 'add': parameters\.properties\.a\.{word} must be"):
        tool_names(tools)
    for bad in ({"properties": "a"}, {"properties": {"a": "integer"}}, {"required": 5}, {"required": [1]},
                {"additionalProperties": "yes"}):
        with pytest.raises(ValueError, match=rf"tool 'add': parameters\.{next(iter(bad))}"):
            tool_names([{"name": "add", "parameters": bad}])
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError, match=rf"parameters\.properties\.a\.{word}"):
            ask(tokenizer, CALL, stream=stream, tools=tools)
    assert ask(tokenizer, CALL).choices[0].finish_reason == "tool_calls"  # the app serves on


def test_a_lone_surrogate_escape_in_a_call_is_the_models_error_not_the_clients(tokenizer):
    """JSON's "\\ud83d" alone reads as a lone surrogate, which no UTF-8 reply can carry: the call is malformed
    (the reply comes back as written, content), where it was a 400 blaming the client, or a stream cut off."""
    reply = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "s": "\\ud83d oops"}}</tool_call>'
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    _, calls, errors = HermesToolCallParser(tools=tools).parse(reply)
    assert calls == [] and "surrogate" in errors[0].message
    assert HermesToolCallParser(tools=tools).parse(reply.replace("\\ud83d", "\\ud83d\\ude00"))[1]  # a pair is fine
    whole = ask(tokenizer, reply, tools=tools).choices[0]
    assert whole.message.content == reply and whole.finish_reason == "stop"
    assert ask(tokenizer, reply, stream=True, tools=tools) == (reply, "", [], "stop")


def test_additional_properties_given_as_a_schema_admit_arguments_that_meet_it():
    """JSON Schema: additionalProperties true, or a schema, admits undeclared arguments (that meet the schema);
    false, or absent beside declared properties, refuses them."""
    def check(extra, arguments):
        schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
        if extra != "absent":
            schema["additionalProperties"] = extra
        _, calls, errors = HermesToolCallParser(tools=[{"name": "f", "parameters": schema}]).parse(
            "<tool_call>" + json.dumps({"name": "f", "arguments": arguments}) + "</tool_call>")
        return errors[0].message if errors else None

    assert check(True, {"a": 1, "x": [1]}) is None
    assert check({}, {"a": 1, "x": [1]}) is None
    assert check({"type": "string"}, {"a": 1, "x": "s"}) is None
    assert "argument 'x' of f must be of type string" in check({"type": "string"}, {"a": 1, "x": 2})
    assert "f has no argument(s) ['x']" in check(False, {"a": 1, "x": 2})
    assert "f has no argument(s) ['x']" in check("absent", {"a": 1, "x": 2})
