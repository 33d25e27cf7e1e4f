"""`rollout-engine serve`'s flags are checked before any engine starts: a bad one is refused at once by the
argument parser, naming the flag and what is allowed, with no traceback and no model loaded."""
import math
import socket

import pytest

pytest.importorskip("fastapi")  # `serve` builds the server's app (the [server] extra)

import rollout_engine.server
from rollout_engine.cli import build_parser, main


class EngineStarted(Exception):
    """Raised in place of starting the engine process: the flags have all been accepted by then."""


@pytest.fixture
def no_engine(monkeypatch):
    def refuse(*args, **kwargs):
        raise EngineStarted("serve started an engine")

    monkeypatch.setattr(rollout_engine.server, "EngineClient", refuse)


LEVELS = ["critical", "error", "warning", "info", "debug", "trace"]  # uvicorn's, which the server runs


@pytest.mark.parametrize("flags, named, allowed", [
    (["--port", "70000"], "--port", ["0-65535"]),
    (["--port", "-1"], "--port", ["0-65535"]),
    (["--port", "http"], "--port", ["0-65535"]),
    (["--log-level", "bogus"], "--log-level", LEVELS),
    (["--log-level", "INFO"], "--log-level", LEVELS),
    (["--switch-interval-ms", "0"], "--switch-interval-ms", ["> 0"]),
    (["--switch-interval-ms", "-1"], "--switch-interval-ms", ["> 0"]),
    (["--switch-interval-ms", "nan"], "--switch-interval-ms", ["> 0"]),
    (["--switch-interval-ms", "inf"], "--switch-interval-ms", ["> 0"]),
    (["--stream-interval-ms", "-5"], "--stream-interval-ms", ["milliseconds >= 0"]),
    (["--stream-interval-ms", "nan"], "--stream-interval-ms", ["milliseconds >= 0"]),
    (["--stream-interval-ms", "inf"], "--stream-interval-ms", ["milliseconds >= 0"]),
    (["--kv-cache-memory", "abc"], "--kv-cache-memory", ["fraction", "0.3", "bytes"]),
    (["--kv-cache-memory", "1.5"], "--kv-cache-memory", ["fraction", "0.3", "bytes"]),
    *((["--allowed-origin", origin], "--allowed-origin", ["scheme://host[:port]", "no path"])
      for origin in ("*", "localhost:3000", "http://localhost:3000/app", "ftp://localhost", "http://", "null",
                     "http://localhost:99999", "http://user@localhost", "http://localhost:")),
])
def test_a_bad_serve_flag_is_refused_before_the_engine_starts(no_engine, tmp_path, capsys, flags, named, allowed):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path / "no-model"), *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert f"argument {named}:" in err and all(a in err for a in allowed), err
    assert "Traceback" not in err


@pytest.mark.parametrize("flags", [["--port", "0"], ["--port", "65535"], ["--switch-interval-ms", "0.05"],
                                   ["--stream-interval-ms", "0"], ["--stream-interval-ms", "2.5"],
                                   ["--kv-cache-memory", "2000000000"], ["--kv-cache-memory", "0.3"],
                                   *(["--log-level", level] for level in LEVELS)])
def test_good_serve_flags_reach_the_engine(no_engine, tmp_path, flags):
    args = build_parser().parse_args(["serve", str(tmp_path / "no-model"), "--port", "0", *flags])
    with pytest.raises(EngineStarted):
        args.run(args)


@pytest.mark.parametrize("flags, served", [([], "./ckpt/"), (["--served-model-name", "policy"], "policy")])
def test_the_served_model_name_is_the_model_argument_as_typed(monkeypatch, flags, served):
    """vLLM serves `serve ./ckpt/` as "./ckpt/", and clients send that string back as `model`."""
    seen = {}

    def create_app(engine, **kwargs):
        seen.update(kwargs)
        raise EngineStarted("create_app")

    class Started:  # the engine process, started
        def __init__(self, *args, **kwargs):
            pass

        def shutdown(self):
            pass

    monkeypatch.setattr(rollout_engine.server, "EngineClient", Started)
    monkeypatch.setattr(rollout_engine.server, "create_app", create_app)
    args = build_parser().parse_args(["serve", "./ckpt/", "--port", "0", *flags])
    with pytest.raises(EngineStarted):
        args.run(args)
    assert seen["served_model_name"] == served


def test_an_allowed_origin_is_taken_as_browsers_send_it(tmp_path):
    """The server compares Origin exactly; browsers send scheme and host in lower case and no path."""
    given = ["HTTP://LocalHost:3000/", "https://app.example", "http://localhost:80", "https://app.example:443",
             "http://bücher.example", "http://127.0.0.1:03000", "http://[::1]:8080"]
    args = build_parser().parse_args(["serve", str(tmp_path), *(f"--allowed-origin={o}" for o in given)])
    assert args.allowed_origin == ["http://localhost:3000", "https://app.example", "http://localhost",
                                   "https://app.example", "http://xn--bcher-kva.example", "http://127.0.0.1:3000",
                                   "http://[::1]:8080"]


@pytest.mark.parametrize("value, parsed", [("2e9", 2_000_000_000), ("2000000000", 2_000_000_000), ("0.3", 0.3),
                                           ("1", 1), ("1.0", 1.0)])
def test_kv_cache_memory_is_bytes_whenever_it_is_a_whole_number_above_one(tmp_path, value, parsed):
    """Bytes in scientific notation are bytes (a float there was refused by the engine after it started)."""
    got = build_parser().parse_args(["serve", str(tmp_path), "--kv-cache-memory", value]).kv_cache_memory
    assert got == parsed and type(got) is type(parsed)


@pytest.mark.parametrize("seconds", [-0.005, math.nan, math.inf])
def test_create_app_refuses_the_stream_intervals_the_flag_refuses(seconds):
    """create_app called from Python has no flag to check its interval first: NaN or inf is no interval a stream
    can keep, and a negative one none at all."""
    with pytest.raises(ValueError, match="stream_interval=.* is not allowed; a finite number of seconds >= 0"):
        rollout_engine.server.create_app(None, stream_interval=seconds)


def test_a_port_in_use_is_refused_before_the_engine_starts(no_engine, tmp_path, capsys):
    """uvicorn would find it only after the engine has loaded (minutes for a real model), in a message that
    does not name the flag."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as info:
            main(["serve", str(tmp_path / "no-model"), "--host", "127.0.0.1", "--port", str(port)])
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert f"--port {port} is in use on 127.0.0.1" in err and "Traceback" not in err, err
    args = build_parser().parse_args(["serve", str(tmp_path / "no-model"), "--port", str(port)])
    with pytest.raises(EngineStarted):  # the same port, once closed, is served
        args.run(args)


def test_a_port_just_served_is_served_again(no_engine, tmp_path):
    """A server restarted at once finds its port's closed connections in TIME_WAIT: uvicorn binds it anyway
    (SO_REUSEADDR), and so does the check."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn's listener
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = listener.accept()
            accepted.close()  # the server's side closes first: its end waits in TIME_WAIT
            client.recv(1)
    args = build_parser().parse_args(["serve", str(tmp_path / "no-model"), "--host", "127.0.0.1", "--port", str(port)])
    with pytest.raises(EngineStarted):
        args.run(args)


def test_the_reply_parsers_reach_the_app(monkeypatch, tmp_path):
    """`--reasoning-parser` and `--tool-call-parser` are the app's (create_app's arguments of the same names)."""
    import signal
    import sys

    seen = {}

    class Engine:
        def shutdown(self):
            seen["shut down"] = True

    def app(engine, **kwargs):
        seen.update(kwargs)
        raise EngineStarted("the app was built")

    monkeypatch.setattr(rollout_engine.server, "EngineClient", lambda *args, **kwargs: Engine())
    monkeypatch.setattr(rollout_engine.server, "create_app", app)
    interval, on_term = sys.getswitchinterval(), signal.getsignal(signal.SIGTERM)
    try:
        with pytest.raises(EngineStarted):
            main(["serve", str(tmp_path / "no-model"), "--port", "0", "--reasoning-parser", "deepseek_r1",
                  "--tool-call-parser", "hermes"])
    finally:
        sys.setswitchinterval(interval)
        signal.signal(signal.SIGTERM, on_term)
    assert seen["reasoning_parser"] == "deepseek_r1" and seen["tool_call_parser"] == "hermes" and seen["shut down"]


@pytest.mark.parametrize("flags, instead", [
    (["--gpu-memory-utilization", "0.5"], "--kv-cache-memory"),
    (["--speculative-config", '{"model": "d", "num_speculative_tokens": 2}'], "--draft-model"),
    (["--chat-template", "x.jinja"], "checkpoint's own chat template"),
    (["--no-enable-prefix-caching"], "--no-prefix-caching"),
    (["-tp", "2"], "--tensor-parallel-size"),
])
def test_a_vllm_flag_with_another_name_here_says_which(no_engine, tmp_path, capsys, flags, instead):
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path / "no-model"), *flags])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"{flags[0]} is vLLM's" in err and instead in err, err


@pytest.mark.parametrize("flags", [["--enable-prefix-caching"], ["--enable-sleep-mode"], ["--disable-log-requests"],
                                   ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]])
def test_a_vllm_flag_asking_for_what_the_server_does_is_taken(no_engine, tmp_path, flags):
    args = build_parser().parse_args(["serve", str(tmp_path / "no-model"), "--port", "0", *flags])
    with pytest.raises(EngineStarted):
        args.run(args)


def test_auto_tool_choice_without_a_parser_is_refused(no_engine, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "no-model"), "--port", "0", "--enable-auto-tool-choice"])
    err = capsys.readouterr().err
    assert "--enable-auto-tool-choice needs --tool-call-parser" in err and "hermes" in err, err


def test_prefix_caching_on_and_off_at_once_is_refused(no_engine, tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "no-model"), "--port", "0", "--enable-prefix-caching", "--no-prefix-caching"])
    assert "contradict each other" in capsys.readouterr().err
