"""Qwen3CoderToolCallParser: Qwen3-Coder's XML tool calls, each parameter's text read by the tool's schema (the server's
`--tool-call-parser qwen3_coder`: tests/test_server_tool_calls.py)."""
import random
import re

import pytest

from rollout_engine.xml_tool_calls import Qwen3CoderToolCallParser

TOOLS = [{"type": "function", "function": {"name": "edit", "parameters": {"type": "object", "properties": {
    "path": {"type": "string"}, "line": {"type": "integer"}, "dry_run": {"type": "boolean"},
    "options": {"type": "object"}, "text": {"type": "string"}}, "required": ["path"]}}}]
PARSER = Qwen3CoderToolCallParser(tools=TOOLS)


def call(*parameters, name="edit"):
    body = "".join(f"<parameter={key}>\n{value}\n</parameter>\n" for key, value in parameters)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def test_each_parameter_is_read_by_its_declared_type():
    text = "I will edit it.\n" + call(("path", "src/a.py"), ("line", "12"), ("dry_run", "false"),
                                      ("options", '{"indent": 4}'), ("text", "def f():\n    return 1\n"))
    content, [edit], errors = PARSER.parse(text)
    assert content == "I will edit it." and errors == []
    assert edit.name == "edit" and edit.arguments == {"path": "src/a.py", "line": 12, "dry_run": False,
                                                      "options": {"indent": 4}, "text": "def f():\n    return 1\n"}


NUMBERS = [{"type": "function", "function": {"name": "set", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer"}, "x": {"type": "number"}, "flag": {"type": "boolean"}, "opts": {"type": "object"},
    "maybe": {"type": ["integer", "null"]}}}}}]


@pytest.mark.parametrize("key, written, value", [
    ("flag", "True", True), ("flag", "FALSE", False), ("n", "007", 7), ("x", ".5", 0.5), ("x", "+3", 3.0),
    ("opts", "{'k': 'v'}", {"k": "v"}), ("maybe", "None", None), ("maybe", "12", 12)])
def test_a_value_written_as_python_reads_as_vllm_reads_it(key, written, value):
    """Qwen3-Coder models write Python-looking values; vLLM's parser for them takes these (not JSON) values."""
    _, [edit], errors = Qwen3CoderToolCallParser(tools=NUMBERS).parse(call((key, written), name="set"))
    assert errors == [] and edit.arguments == {key: value} and type(edit.arguments[key]) is type(value)


@pytest.mark.parametrize("key, written", [("flag", "yes"), ("n", "1.5"), ("x", "1e999"), ("opts", "[1, 2]"),
                                          ("opts", "__import__('os')"), ("opts", "{'k': {1, 2}}"),
                                          ("opts", "{'k': 1e999}"), ("opts", "{(1, 2): 'v'}"), ("opts", "{'k': b'x'}"),
                                          ("x", "00" + "1" * 400)])
def test_a_value_that_reads_as_no_declared_type_is_refused_not_guessed(key, written):
    """vLLM would make "yes" False; the schema check refuses it instead (the reply stays text, the error says why)."""
    _, calls, [error] = Qwen3CoderToolCallParser(tools=NUMBERS).parse(call((key, written), name="set"))
    assert calls == [] and f"argument {key!r} of set must be of type" in error.message


def test_a_string_keeps_its_text_however_it_looks():
    [edit] = PARSER.parse(call(("path", "12"), ("text", '{"not": "an object"}')))[1]
    assert edit.arguments == {"path": "12", "text": '{"not": "an object"}'}


def test_without_schemas_every_value_is_text():
    [edit] = Qwen3CoderToolCallParser().parse(call(("line", "12"), name="anything"))[1]
    assert edit.name == "anything" and edit.arguments == {"line": "12"}


@pytest.mark.parametrize("text, message", [
    (call(("path", "a"), ("line", "twelve")), "argument 'line' of edit must be of type integer, got str"),
    (call(("line", "1")), "edit needs the argument(s) ['path']"),
    (call(("path", "a"), ("path", "b")), "parameter 'path' is given twice"),
    (call(("path", "a"), name="run"), "unknown tool 'run'"),
    ("<tool_call>\n<function=edit>\n<parameter=path>\na\n</parameter>\n</tool_call>", "a tool call is <function=NAME>"),
    ("<tool_call>\n<function=edit>\nhello <parameter=path>\na\n</parameter>\n</function>\n</tool_call>",
     "text outside a parameter: 'hello'"),
    ("<tool_call>\n<function=edit>\n<parameter=path>\na\n</parameter>", "is never closed"),
])
def test_a_malformed_call_is_an_error_never_raised(text, message):
    content, calls, [error] = PARSER.parse(text)
    assert calls == [] and message in error.message
    assert error.name in ("edit", "run")  # the tool's name, read from <function=...>, for the reply to the model


def test_several_calls_in_one_reply():
    text = call(("path", "a")) + "\n" + call(("path", "b"), ("line", "3"))
    _, calls, errors = PARSER.parse(text)
    assert errors == [] and [c.arguments for c in calls] == [{"path": "a"}, {"path": "b", "line": 3}]
    assert [c.index for c in calls] == [0, 1]


REGEX = re.compile(r"<parameter=([^>\n]*)>(.*?)</parameter>", re.S)  # the format's rule, slow on unclosed tags


def arguments_by_regex(body: str):
    """The arguments of a <function=...> block with this body as REGEX reads them, or how its error begins."""
    arguments, pos = {}, 0
    for found in REGEX.finditer(body):
        if body[pos:found.start()].strip():
            return "text outside a parameter"
        key, pos = found[1].strip(), found.end()
        if not key or key in arguments:
            return "parameter "
        value = found[2][1:] if found[2].startswith("\n") else found[2]
        arguments[key] = value[:-1] if value.endswith("\n") else value
    return "text outside a parameter" if body[pos:].strip() else arguments


@pytest.mark.parametrize("seed", range(4))
def test_parameters_are_found_as_the_formats_regex_finds_them(seed):
    """The parser finds parameters in one pass (a regex search from each opening tag took quadratic time on a reply
    of unclosed tags); on random bodies of tags, keys, newlines and text it reads what the regex reads."""
    rng, parser = random.Random(seed), Qwen3CoderToolCallParser()
    pieces = ["<parameter=", "</parameter>", ">", "\n", "a", "b", " ", "<", "/", "parameter"]
    for _ in range(500):
        body = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 16)))
        _, calls, errors = parser.parse(f"<tool_call><function=f>{body}</function></tool_call>")
        want = arguments_by_regex(body)
        if isinstance(want, dict):
            assert errors == [] and calls[0].arguments == want, body
        else:
            assert calls == [] and errors[0].message.startswith(want), (body, errors[0].message)


def test_a_reply_of_unclosed_parameter_tags_is_one_error():
    text = "<tool_call><function=f>" + "<parameter=a>" * 7_000 + "</function></tool_call>"  # the parser's max_chars
    _, calls, [error] = Qwen3CoderToolCallParser().parse(text)
    assert calls == [] and error.message.startswith("text outside a parameter")
