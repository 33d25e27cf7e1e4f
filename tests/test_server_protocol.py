"""The server's request rules that need no engine: what `protocol.parse` accepts and refuses."""
import pytest

pytest.importorskip("fastapi")

from rollout_engine.server import protocol  # noqa: E402


def parse(**body):
    return protocol.parse(protocol.CompletionRequest, {"prompt": "hi", **body})


def test_stream_options_belong_to_a_stream():
    assert parse(stream=True, stream_options={"include_usage": True}).stream_options.include_usage
    with pytest.raises(ValueError, match="stream_options is only allowed with stream=true"):
        parse(stream_options={"include_usage": True})


def test_continuous_usage_stats_is_refused_not_ignored():
    with pytest.raises(ValueError, match="continuous_usage_stats"):
        parse(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
    assert parse(stream=True, stream_options={"continuous_usage_stats": False}).stream


def test_the_neutral_response_format_is_accepted():
    def chat(**body):
        return protocol.parse(protocol.ChatRequest, {"messages": [{"role": "user", "content": "hi"}], **body})

    assert chat(response_format={"type": "text"}).response_format == {"type": "text"}
    with pytest.raises(ValueError, match="response_format"):
        chat(response_format={"type": "json_object"})
