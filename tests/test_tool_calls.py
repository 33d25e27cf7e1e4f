"""Hermes/Qwen and Llama 3 JSON tool calls out of model text: malformed calls are errors to answer, never
exceptions."""
import pytest

from rollout_engine.tool_calls import MAX_NESTING
from trainer_adapters.tool_calls import (HermesToolCallParser, Llama3JsonToolCallParser, Qwen3CoderToolCallParser,
                                         ToolCall, ToolCallError, ToolCallParser, tool_names)

TOOLS = [
    {"type": "function", "function": {
        "name": "calculator", "description": "evaluate + - * / on integers",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}},
    {"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "required": ["a", "b"],
                                      "properties": {"a": {"type": "integer"}, "b": {"type": "number"},
                                                     "mode": {"type": "string", "enum": ["exact", "round"]}}}}},
    {"name": "clock"},  # no schema: any arguments
]
CALC = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'

# (model output, expected content, expected calls [(name, arguments)], expected error fragments)
CASES = [
    # well-formed
    ("the answer is 5", "the answer is 5", [], []),
    ("", "", [], []),
    (CALC, "", [("calculator", {"expression": "2+3"})], []),
    ("let me compute.\n" + CALC, "let me compute.", [("calculator", {"expression": "2+3"})], []),
    ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>\n'
     '<tool_call>{"name": "add", "arguments": {"a": 3, "b": 4}}</tool_call>',
     "", [("add", {"a": 1, "b": 2.5}), ("add", {"a": 3, "b": 4})], []),
    ('<tool_call>{"name": "add", "parameters": {"a": 1, "b": 2}}</tool_call>', "", [("add", {"a": 1, "b": 2})], []),
    ('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1*2\\"}"}</tool_call>', "",
     [("calculator", {"expression": "1*2"})], []),  # double-encoded arguments
    ('<tool_call>{"name": "clock"}</tool_call> done', "done", [("clock", {})], []),  # no arguments: {}
    ('<tool_call>{"name": "clock", "arguments": {"tz": "UTC"}}</tool_call>', "", [("clock", {"tz": "UTC"})], []),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "<b>"}}</tool_call>', "",
     [("calculator", {"expression": "<b>"})], []),
    # malformed: returned as errors
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+</tool_call>', "", [], ["not valid JSON"]),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}', "", [], ["never closed"]),
    ("<tool_call>", "", [], ["never closed"]),
    ("<tool_call></tool_call>", "", [], ["empty tool call"]),
    ("<tool_call>   \n </tool_call>", "", [], ["empty tool call"]),
    ('<tool_call>["calculator", {"expression": "1"}]</tool_call>', "", [], ["JSON object, got a JSON list"]),
    ('<tool_call>"calculator"</tool_call>', "", [], ["JSON object, got a JSON str"]),
    ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', "", [], ['"name" must be a non-empty string']),
    ('<tool_call>{"name": 7, "arguments": {}}</tool_call>', "", [], ['"name" must be a non-empty string']),
    ('<tool_call>{"name": "", "arguments": {}}</tool_call>', "", [], ['"name" must be a non-empty string']),
    ('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>', "", [], ["unknown tool 'search'"]),
    ('<tool_call>{"name": "calculator", "arguments": ["2+3"]}</tool_call>', "", [], ['"arguments" must be a JSON object']),
    ('<tool_call>{"name": "calculator", "arguments": 5}</tool_call>', "", [], ['"arguments" must be a JSON object']),
    ('<tool_call>{"name": "calculator", "arguments": "2+3"}</tool_call>', "", [], ["string that is not a JSON object"]),
    ('<tool_call>{"name": "calculator", "arguments": {}}</tool_call>', "", [], ["needs the argument(s) ['expression']"]),
    ('<tool_call>{"name": "calculator", "arguments": {"expression": 5}}</tool_call>', "", [],
     ["'expression' of calculator must be of type string"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1.5, "b": 2}}</tool_call>', "", [], ["'a' of add must be of type integer"]),
    ('<tool_call>{"name": "add", "arguments": {"a": true, "b": 2}}</tool_call>', "", [], ["'a' of add must be of type integer"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "c": 3}}</tool_call>', "", [], ["add has no argument(s) ['c']"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2, "mode": "up"}}</tool_call>', "", [],
     ["must be one of ['exact', 'round']"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": NaN}}</tool_call>', "", [], ["NaN is not valid JSON"]),
    ('<tool_call>{"name": "add", "name": "calculator", "arguments": {}}</tool_call>', "", [], ["duplicate key(s) ['name']"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}, "id": 3}</tool_call>', "", [], ["unexpected key(s) ['id']"]),
    ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}, "parameters": {}}</tool_call>', "", [],
     ['"arguments" or "parameters", not both']),
    ("<tool_call><tool_call>" + CALC[len("<tool_call>"):] + "</tool_call>", "", [], ["cannot nest", "without an opening"]),
    ("done</tool_call>", "done", [], ["without an opening"]),
    ("<tool_call>{'name': 'calculator', 'arguments': {}}</tool_call>", "", [], ["not valid JSON"]),  # python, not JSON
    ("<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1\"}}} extra</tool_call>", "", [],
     ["not valid JSON"]),
    ("<tool_call>" + "[" * 100_000 + "</tool_call>", "", [], ["characters; at most"]),
    ("<tool_call>" + "[" * 5000 + "</tool_call>", "", [], ["not valid JSON"]),  # deep nesting: no RecursionError
    # one good call, one bad: both reported, the good one kept
    (CALC + ' and <tool_call>{"name": "add"}</tool_call>', "and", [("calculator", {"expression": "2+3"})],
     ["add needs the argument(s) ['a', 'b']"]),
]


@pytest.mark.parametrize("text, content, calls, errors", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_hermes_tool_calls(text, content, calls, errors):
    parser = HermesToolCallParser(tools=TOOLS)
    got_content, got_calls, got_errors = parser.parse(text)
    if len(text) < 100_000:
        assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert all(isinstance(c, ToolCall) for c in got_calls) and all(isinstance(e, ToolCallError) for e in got_errors)
    assert len(got_errors) == len(errors), [e.message for e in got_errors]
    for error, fragment in zip(got_errors, errors):
        assert fragment in error.message, error.message
    indices = sorted([c.index for c in got_calls] + [e.index for e in got_errors])
    assert indices == list(range(len(indices)))  # every block accounted for, in order


def test_without_a_tool_list_any_name_is_a_call():
    parser = HermesToolCallParser()
    _, calls, errors = parser.parse('<tool_call>{"name": "search", "arguments": {"q": 1}}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("search", {"q": 1})] and not errors
    message = calls[0].to_message()
    assert message == {"type": "function", "id": message["id"], "function": {"name": "search", "arguments": {"q": 1}}}


def test_unchecked_schemas_keep_a_call_to_an_offered_tool_whatever_its_arguments():
    """check_schemas=False (the server's, as vLLM's parsers): arguments the schema refuses still make a call;
    a tool the list does not offer is still an error."""
    missing = [('<tool_call>{"name": "add", "arguments": {"a": "1"}}</tool_call>', HermesToolCallParser),
               ('{"name": "add", "parameters": {"a": "1"}}', Llama3JsonToolCallParser),
               ("<tool_call><function=add><parameter=a>x</parameter></function></tool_call>", Qwen3CoderToolCallParser)]
    for text, parser in missing:
        assert parser(tools=TOOLS).parse(text)[2], parser  # checked: an error (b missing, a not an integer)
        _, calls, errors = parser(tools=TOOLS, check_schemas=False).parse(text)
        assert [c.name for c in calls] == ["add"] and not errors, parser
        _, calls, errors = parser(tools=TOOLS, check_schemas=False).parse(text.replace("add", "mul"))
        assert not calls and "unknown tool" in errors[0].message, parser


def test_call_ids_differ_across_turns_and_repeat_across_runs():
    """A multi-turn episode's calls each at position 0 of their turn: different calls get different ids (a
    tool reply's tool_call_id names one call), the same call text gets the same id in every run (prompt
    tokens do not change between runs), 9 alphanumerics (Mistral's templates check it); or the caller's."""
    parser = HermesToolCallParser()
    turns = ['<tool_call>{"name": "search", "arguments": {"q": "a"}}</tool_call>',
             '<tool_call>{"name": "search", "arguments": {"q": "b"}}</tool_call>',
             '<tool_call>{"name": "open", "arguments": {"q": "a"}}</tool_call>']
    ids = [parser.parse(text)[1][0].to_message()["id"] for text in turns]
    assert len(set(ids)) == 3 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert [parser.parse(text)[1][0].to_message()["id"] for text in turns] == ids
    call = parser.parse(turns[0])[1][0]
    assert call.to_message("call_7")["id"] == "call_7"
    with pytest.raises(ValueError, match="call_id"):
        call.to_message("")


def test_limits_and_odd_inputs_never_raise():
    parser = HermesToolCallParser(tools=["clock"], max_calls=2)
    _, calls, errors = parser.parse('<tool_call>{"name": "clock"}</tool_call>' * 3)
    assert len(calls) == 2 and len(errors) == 1 and "more than 2" in errors[0].message
    for odd in (None, 5, b"<tool_call>", ["x"]):
        content, calls, errors = parser.parse(odd)
        assert content == "" and calls == [] and "expected text" in errors[0].message
    assert isinstance(parser, ToolCallParser)


def test_arguments_nested_near_pythons_recursion_limit_are_an_error_never_raised():
    """Arguments the decoder reads but that nest near Python's recursion limit made encoding them raise
    RecursionError, at a depth that moves with the caller's stack: every depth past MAX_NESTING is an error."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "object"}}}}}]
    forms = [(HermesToolCallParser(tools=tools), '<tool_call>{{"name": "f", "arguments": {{"x": {{"a": {}}}}}}}</tool_call>'),
             (Llama3JsonToolCallParser(tools=tools), '{{"name": "f", "parameters": {{"x": {{"a": {}}}}}}}'),
             (Qwen3CoderToolCallParser(tools=tools), '<tool_call><function=f><parameter=x>{{"a": {}}}</parameter>'
                                                      '</function></tool_call>')]
    for parser, form in forms:
        _, [call], errors = parser.parse(form.format("[" * (MAX_NESTING - 2) + "]" * (MAX_NESTING - 2)))
        assert errors == [] and call.name == "f"  # the arguments, "x"'s object and the lists: MAX_NESTING deep
        _, calls, [error] = parser.parse(form.format("[" * (MAX_NESTING - 1) + "]" * (MAX_NESTING - 1)))
        assert calls == [] and f"nest {MAX_NESTING + 1} arrays and objects deep; at most {MAX_NESTING}" in error.message
        for depth in range(700, 1000):  # past the limit, or past what the decoder reads: an error either way
            _, calls, [_] = parser.parse(form.format("[" * depth + "]" * depth))
            assert calls == []


def test_other_tags_and_bad_configuration():
    parser = HermesToolCallParser(start="[TOOL_CALLS]", end="[/TOOL_CALLS]")
    content, calls, errors = parser.parse('hi [TOOL_CALLS]{"name": "f", "arguments": {}}[/TOOL_CALLS]')
    assert content == "hi" and calls[0].name == "f" and not errors
    with pytest.raises(ValueError):
        HermesToolCallParser(start="x", end="x")
    with pytest.raises(ValueError, match="no name"):
        tool_names([{"type": "function", "function": {}}])
    assert tool_names(TOOLS) == {"calculator": TOOLS[0]["function"]["parameters"],
                                 "add": TOOLS[1]["function"]["parameters"], "clock": None}



@pytest.mark.parametrize("cls", [HermesToolCallParser, Llama3JsonToolCallParser, Qwen3CoderToolCallParser])
@pytest.mark.parametrize("bad, name", [(dict(tools="add"), "tools"), (dict(tools=TOOLS[1]), "tools"),
                                       (dict(max_chars=None), "max_chars"), (dict(max_calls=0), "max_calls"),
                                       (dict(max_calls=1.5), "max_calls")])
def test_a_parser_refuses_bad_settings_by_name(cls, bad, name):
    """Before: tools="add" made the tools 'a' and 'd', one schema dict the tools 'type' and 'function', and
    max_chars=None a TypeError inside parse (which never raises on a reply)."""
    with pytest.raises(ValueError, match=f"^{name}"):
        cls(**bad)


def test_a_call_whose_string_argument_holds_the_start_tag_is_a_call():
    """Code that prints "<tool_call>" is an argument like any other (it was reported as nesting, and the whole
    reply came back as content); a call never closed before the next one still is nesting."""
    parser = HermesToolCallParser()
    body = '{"name": "run", "arguments": {"code": "print(\'<tool_call>\')"}}'
    content, [call], errors = parser.parse(f"ok <tool_call>{body}</tool_call>")
    assert content == "ok" and not errors and call.arguments == {"code": "print('<tool_call>')"}
    _, calls, [error] = parser.parse('<tool_call>{"name": "a", "arguments": {}}' + f"<tool_call>{body}</tool_call>")
    assert not calls and "cannot nest" in error.message


def test_two_tools_of_one_name_are_refused():
    with pytest.raises(ValueError, match="tools holds two tools named 'add'; tool names must differ"):
        tool_names(["add", {"type": "function", "function": {"name": "add"}}])
    with pytest.raises(ValueError, match="two tools named 'calculator'"):
        HermesToolCallParser(tools=TOOLS + TOOLS[:1])

def test_duplicate_keys_are_found_in_any_position():
    parser = HermesToolCallParser()
    for body in ('{"name": "f", "name": "g", "arguments": {}}', '{"name": "f", "arguments": {"a": 1, "b": 2, "a": 3}}'):
        _, calls, [error] = parser.parse(f"<tool_call>{body}</tool_call>")
        assert not calls and "duplicate key(s)" in error.message
    _, [call], errors = parser.parse('<tool_call>{"name": "f", "arguments": {"a": {"a": 1}, "b": [{"a": 2}]}}'
                                     '</tool_call>')
    assert not errors and call.arguments == {"a": {"a": 1}, "b": [{"a": 2}]}  # one key per object, not per reply

PICK = [{"name": "pick", "parameters": {"type": "object", "properties": {
    "x": {"type": "number"}, "n": {"type": "integer"},
    "mode": {"enum": [1, 2, "a", [1, 2], {"k": 0}]}, "flag": {"enum": [True, None]}}}}]


@pytest.mark.parametrize("arguments, ok, error", [
    ('{"x": 1e400}', False, "the number 1e400 is out of range"),  # json.loads gives inf
    ('{"x": -1e400}', False, "the number -1e400 is out of range"),
    ('"{\\"x\\": 1e999}"', False, '"arguments" is a string that is not a JSON object'),  # double-encoded
    ('{"x": 1e308, "n": -3}', True, None),
    ('{"n": 2.0}', True, None),  # JSON Schema draft 6+: an integer is a number with no fractional part
    ('{"n": 2.5}', False, "must be of type integer, got float"),
    ('{"n": true}', False, "must be of type integer, got bool"),
    ('{"mode": 1.0}', True, None),  # numbers compare by value
    ('{"mode": "a"}', True, None),
    ('{"mode": [1.0, 2]}', True, None),
    ('{"mode": true}', False, "must be one of"),  # True == 1 in Python, not in JSON
    ('{"mode": [true, 2]}', False, "must be one of"),
    ('{"mode": {"k": false}}', False, "must be one of"),
    ('{"mode": "1"}', False, "must be one of"),
    ('{"flag": true}', True, None),
    ('{"flag": null}', True, None),
    ('{"flag": 1}', False, "must be one of"),
    ('{"flag": 0}', False, "must be one of"),
])
def test_numbers_and_enums_follow_json_schema(arguments, ok, error):
    """A number that overflows a double is an error (it became inf and reached the tool), enum members compare by
    JSON type and value (true was accepted for 1, 1 for true), and an integer may be written 2.0 (it was refused)."""
    content, calls, errors = HermesToolCallParser(tools=PICK).parse(
        f'<tool_call>{{"name": "pick", "arguments": {arguments}}}</tool_call>')
    if ok:
        assert not errors and len(calls) == 1, errors
    else:
        assert not calls and len(errors) == 1 and error in errors[0].message, (calls, errors)


LLAMA_CASES = [
    # (model output, expected content, expected calls, expected error fragments)
    ("the answer is 5", "the answer is 5", [], []),
    ('the call would be {"name": "clock"}', 'the call would be {"name": "clock"}', [], []),  # content first: text
    ('{"name": "add", "parameters": {"a": 1, "b": 2}}', "", [("add", {"a": 1, "b": 2})], []),
    ('<|python_tag|>{"name": "clock", "arguments": {}}', "", [("clock", {})], []),
    ('\n {"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "clock", "parameters": {}};',
     "", [("add", {"a": 1, "b": 2}), ("clock", {})], []),
    ('{"name": "add", "parameters": {"a": 1}}', "", [], ["add needs the argument(s) ['b']"]),
    ('{"name": "nope", "parameters": {}}', "", [], ["unknown tool 'nope'"]),
    ('{"name": "clock", "parameters": {}} and then', "", [("clock", {})], ['joined by ";"']),
    ('{"name": "clock", "parameters": {', "", [], ["not valid JSON"]),
    ('{"name": "clock", "parameters": {}, "name": "add"}', "", [], ["duplicate key(s) ['name']"]),
]


@pytest.mark.parametrize("text, content, calls, errors", LLAMA_CASES,
                         ids=[f"case{i}" for i in range(len(LLAMA_CASES))])
def test_llama3_json_tool_calls(text, content, calls, errors):
    parser = Llama3JsonToolCallParser(tools=TOOLS)
    got_content, got_calls, got_errors = parser.parse(text)
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    assert [fragment in e.message for e, fragment in zip(got_errors, errors)] == [True] * len(errors)
    assert len(got_errors) == len(errors), [e.message for e in got_errors]
    indices = sorted([c.index for c in got_calls] + [e.index for e in got_errors])
    assert indices == list(range(len(indices)))


def test_llama3_json_holds_only_what_may_become_a_call():
    """A stream holds a Llama reply from its start while it may still be a call (blank, "{", the python tag or a
    part of it), and none of a reply that began as text; Hermes holds from its tag or a tail that may begin one."""
    llama = Llama3JsonToolCallParser()
    for held in ("", "  ", " {", '{"name"', "<|pyth", "<|python_tag|>", '<|python_tag|>{"na'):
        assert llama.hold_from(held) == 0, held
    for text in ("Sure", "Sure {", "x <|python_tag|>{"):
        assert llama.hold_from(text) == len(text), text
    hermes = HermesToolCallParser()
    assert hermes.hold_from("ab <tool_call>{") == 3 and hermes.hold_from("ab <tool") == 3 and hermes.hold_from("ab") == 2
    assert isinstance(llama, ToolCallParser) and llama.parse(None)[2][0].message.startswith("expected text")
