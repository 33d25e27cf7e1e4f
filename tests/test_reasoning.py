"""rollout_engine.reasoning: a thinking model's reply split into reasoning and content, whole and streamed."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_engine.reasoning import PARSERS, ReasoningStream, ThinkReasoningParser

PARSER = ThinkReasoningParser()


@pytest.mark.parametrize("text, inside, want", [
    ("<think>\nadd them\n</think>\n\nIt is 3.", False, ("\nadd them\n", "It is 3.")),   # Qwen3
    ("  <think>a</think>b", False, ("a", "b")),
    ("It is 3.", False, (None, "It is 3.")),                 # no block: all content
    ("It is 3. <think>a</think>", False, (None, "It is 3. <think>a</think>")),  # a tag later is content
    ("<think>cut short", False, ("cut short", "")),          # never closed (max_tokens): all reasoning
    ("<think>a</think>b</think>c", False, ("a", "b</think>c")),  # the first end tag closes it
    ("add them\n</think>\n\nIt is 3.", True, ("add them\n", "It is 3.")),  # DeepSeek-R1: the prompt opened it
    ("<think>\nadd</think>3", True, ("\nadd", "3")),          # the model repeats the prompt's tag
    ("still thinking", True, ("still thinking", "")),
    ("", False, (None, "")),
    ("<thin", False, (None, "<thin")),                        # a reply that only begins like the tag
])
def test_parse(text, inside, want):
    assert PARSER.parse(text, inside) == want


def test_nothing_is_lost():
    """The reply is its reasoning, the tags, the white space after the end tag and its content, in order."""
    text = "<think> a </think> \n b "
    reasoning, content = PARSER.parse(text)
    assert "<think>" + reasoning + "</think> \n " + content == text


def test_a_prompt_opens_a_block_only_when_it_ends_in_the_start_tag():
    assert PARSER.prompt_opens("<|Assistant|><think>\n")
    assert not PARSER.prompt_opens("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3 without thinking
    assert not PARSER.prompt_opens("<|im_start|>assistant\n")


def test_the_parser_names_are_vllms():
    assert set(PARSERS) == {"qwen3", "deepseek_r1"}
    with pytest.raises(ValueError, match="distinct"):
        ThinkReasoningParser("<t>", "<t>")


TEXTS = ["<think>\nadd them\n</think>\n\nIt is 3.", "It is 3.", "<think>cut </thin short", "  <thinker> no",
         "<think>a</think></think>", "x</think>y", "</think>", "<think></think>   ", " \n ", "<th", "a</th"]


@settings(max_examples=300, deadline=None)
@given(text=st.sampled_from(TEXTS) | st.text(alphabet="<>/thinkab \n", max_size=30), inside=st.booleans(),
       cuts=st.lists(st.integers(0, 30), max_size=8))
def test_a_stream_sends_exactly_the_whole_parse(text, inside, cuts):
    """However a reply arrives in pieces, each delta extends what was sent, never takes it back, and the
    deltas add up to the whole reply's parse."""
    points = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0] + points, points + [len(text)])]
    stream, reasoning, content = ReasoningStream(PARSER, inside), "", ""
    for piece in pieces[:-1]:
        r, c = stream.push(piece)
        reasoning, content = reasoning + r, content + c
    r, c = stream.finish(pieces[-1])
    whole_reasoning, whole_content = PARSER.parse(text, inside)
    assert (reasoning + r, content + c) == (whole_reasoning or "", whole_content)


def test_a_stream_holds_what_may_still_become_a_tag():
    stream = ReasoningStream(PARSER)
    assert stream.push("  <thi") == ("", "")      # may begin a reasoning block
    assert stream.push("nk>abc</th") == ("abc", "")  # "</th" may begin the end tag
    assert stream.push("ink>\n") == ("", "")      # white space after the end tag waits for content
    assert stream.push("It") == ("", "It")
    plain = ReasoningStream(PARSER)
    assert plain.push("<x") == ("", "<x")          # cannot become the tag: content at once
