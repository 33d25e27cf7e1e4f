"""The `rollout-engine` command's flags are checked before any work (a model built, the demo run, an engine
started): a bad one is refused at once by the argument parser, naming the flag and what is allowed, with no
traceback and no model loaded."""
import math
import socket

import pytest

pytest.importorskip("fastapi")  # `serve` builds the server's app (the [server] extra)

import rollout_engine
import rollout_engine.server
import rollout_engine.tiny_model
import trainer_adapters.demo
from rollout_engine.cli import build_parser, main

# Each command's work, which the tests replace: it is reached only once every flag has been accepted.
WORK = [(rollout_engine.server, "EngineClient"), (rollout_engine, "Engine"),
        (rollout_engine.tiny_model, "make_tiny_model"), (trainer_adapters.demo, "run_demo")]


class EngineStarted(Exception):
    """Raised in place of a command's work (WORK): the flags have all been accepted by then."""


@pytest.fixture
def no_engine(monkeypatch):
    """Every command's work raises EngineStarted; the dict it returns holds the arguments the work was given."""
    given = {}

    def refuse(*args, **kwargs):
        given.update(kwargs, args=args)
        raise EngineStarted("a command started its work")

    for module, name in WORK:
        monkeypatch.setattr(module, name, refuse)
    return given


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
    (["--switch-interval-ms", "0.0001"], "--switch-interval-ms", ["[0.001, 1e+06]"]),  # Python would keep 0
    (["--switch-interval-ms", "1e17"], "--switch-interval-ms", ["[0.001, 1e+06]"]),
    (["--stream-interval-ms", "-5"], "--stream-interval-ms", ["milliseconds >= 0"]),
    (["--stream-interval-ms", "nan"], "--stream-interval-ms", ["milliseconds >= 0"]),
    (["--stream-interval-ms", "inf"], "--stream-interval-ms", ["milliseconds >= 0"]),
    (["--shutdown-timeout", "-1"], "--shutdown-timeout", ["seconds >= 0"]),
    (["--shutdown-timeout", "inf"], "--shutdown-timeout", ["seconds >= 0"]),
    (["--kv-cache-memory", "abc"], "--kv-cache-memory", ["fraction", "0.3", "bytes"]),
    (["--kv-cache-memory", "1.5"], "--kv-cache-memory", ["fraction", "0.3", "bytes"]),
    *((["--kv-cache-memory", amount], "--kv-cache-memory", ["fraction", "(0, 1]", "bytes"])
      for amount in ("0", "-0.5", "-3", "nan", "1e400")),
    *(([flag, "0"], flag, ["an int >= 1"]) for flag in ("--max-model-len", "--block-size", "--tensor-parallel-size")),
    *(([flag, "0"], flag, ["an int in [1, "]) for flag in ("--max-num-seqs", "--max-num-batched-tokens")),
    (["--block-size", "x"], "--block-size", ["an int >= 1"]),
    (["--num-speculative-tokens", "-1"], "--num-speculative-tokens", ["an int >= 0"]),
    (["--seed", "-1"], "--seed", ["an int in [0, 2**63)"]),
    (["--seed", str(2 ** 63)], "--seed", ["an int in [0, 2**63)"]),
    (["--quantization", "FP8"], "--quantization", ["'none', 'fp8', 'fp8_lm_head'"]),
    (["--quantization", "auto"], "--quantization", ["'none', 'fp8', 'fp8_lm_head'"]),
    (["--draft-quantization", "fp4"], "--draft-quantization", ["'none', 'auto', 'fp8'"]),
    (["--dtype", "half"], "--dtype", ["'auto'", "'bfloat16'"]),
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


def _refused(capsys, argv) -> str:
    """`main(argv)`'s error output, once it has exited with status 2 and no traceback."""
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, err
    assert "Traceback" not in err
    return err


TINY = ["make-tiny-model", "OUT"]
DEMO = ["demo", "--out", "OUT"]
GENERATE = ["generate", "--model", "OUT", "--prompt", "hi"]
HIDDEN = ["a positive multiple of 8", "4 heads of an even head_dim"]  # tiny_model's 4 heads: head_dim even
SEED = ["an int in [0, 2**63)"]


@pytest.mark.parametrize("argv, named, allowed", [
    *((TINY + ["--hidden-size", size], "--hidden-size", HIDDEN) for size in ("0", "-8", "30", "36", "4", "abc")),
    *((TINY + ["--num-layers", layers], "--num-layers", ["an int >= 1"]) for layers in ("0", "-1", "2.5")),
    (TINY + ["--seed", "-1"], "--seed", SEED),
    (["make-tiny-model", "FILE"], "dir", ["a directory to write into", "is not a directory"]),
    (["make-tiny-model", "FILE/sub"], "dir", ["a directory to write into", "is not a directory"]),
    *((DEMO + ["--steps", steps], "--steps", ["an int >= 1"]) for steps in ("0", "-3", "ten")),
    (["demo", "--out", "FILE"], "--out", ["a directory to write into", "is not a directory"]),
    (["demo", "--out", "FILE/sub"], "--out", ["a directory to write into", "is not a directory"]),
    *((DEMO + ["--tis-cap", cap], "--tis-cap", ["a number > 0 (or inf)"]) for cap in ("-1", "0", "nan", "x")),
    *((DEMO + ["--quantization", q], "--quantization", ["'none', 'fp8', 'fp8_lm_head'"]) for q in ("FP8", "fp4")),
    (DEMO + ["--dtype", "half"], "--dtype", ["'auto'", "'bfloat16'"]),
    (DEMO + ["--seed", "-1"], "--seed", SEED),
    *((GENERATE + ["--n", n], "--n", ["an int in [1, 16384]"]) for n in ("0", "16385", "two")),
    (GENERATE + ["--max-tokens", "0"], "--max-tokens", ["an int >= 1"]),
    *((GENERATE + ["--temperature", t], "--temperature", ["a finite number >= 0"]) for t in ("-1", "nan", "inf")),
    (GENERATE + ["--seed", "-1"], "--seed", SEED),
])
def test_a_bad_flag_is_refused_before_any_work(no_engine, tmp_path, capsys, argv, named, allowed):
    """OUT stands for a directory yet to be made, FILE for a file (where a directory is needed)."""
    (tmp_path / "file").write_text("")
    argv = [a.replace("OUT", str(tmp_path / "out")).replace("FILE", str(tmp_path / "file")) for a in argv]
    err = _refused(capsys, argv)
    assert f"argument {named}:" in err and all(a in err for a in allowed), err


@pytest.mark.parametrize("argv, given", [
    (TINY + ["--hidden-size", "8"], dict(hidden_size=8, num_heads=4)),
    (TINY + ["--hidden-size", "40", "--num-layers", "1"], dict(hidden_size=40, num_heads=4, num_layers=1)),
    (DEMO + ["--steps", "1", "--tis-cap", "inf"], dict(steps=1, tis_cap=math.inf)),
    (DEMO + ["--tis-cap", "2", "--quantization", "fp8"], dict(tis_cap=2.0, quantization="fp8")),
    (DEMO + ["--quantization", "none"], dict(quantization=None)),
    (DEMO + ["--quantization", "None", "--dtype", "bfloat16"], dict(quantization=None, engine_dtype="bfloat16")),
])
def test_good_flags_reach_the_work(no_engine, tmp_path, argv, given):
    """A directory yet to be made is an output directory: the command makes it."""
    with pytest.raises(EngineStarted):
        main([a.replace("OUT", str(tmp_path / "new" / "out")) for a in argv])
    assert {k: no_engine[k] for k in given} == given


@pytest.mark.parametrize("value, parsed", [("none", None), ("NONE", None), ("fp8", "fp8"),
                                           ("fp8_lm_head", "fp8_lm_head")])
def test_demo_and_serve_take_the_same_weight_formats(tmp_path, value, parsed):
    parser = build_parser()
    assert parser.parse_args(["demo", "--quantization", value]).quantization == parsed
    assert parser.parse_args(["serve", str(tmp_path), "--quantization", value]).quantization == parsed


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied", "/ckpt/config.json"),
                                   NotADirectoryError(20, "Not a directory", "/ckpt/policy")])
@pytest.mark.parametrize("argv", [TINY, DEMO])
def test_an_os_error_is_one_line_not_a_traceback(monkeypatch, tmp_path, capsys, argv, error):
    """A path the work cannot use (no permission, not a directory) fails as a bad flag does, exit status 2."""
    def fail(*args, **kwargs):
        raise error

    for module, name in WORK:
        monkeypatch.setattr(module, name, fail)
    err = _refused(capsys, [a.replace("OUT", str(tmp_path)) for a in argv])
    assert err == f"rollout-engine {argv[0]}: error: {error}\n"


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


@pytest.mark.parametrize("name", ["", " ", 5])
def test_create_app_refuses_a_served_model_name_that_is_no_name(name):
    with pytest.raises(ValueError, match="served_model_name=.* is not allowed; a name, or None"):
        rollout_engine.server.create_app(None, served_model_name=name)


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


@pytest.mark.parametrize("port", ["0", "8123"])
def test_a_host_that_is_no_address_is_refused_before_the_engine_starts(no_engine, tmp_path, capsys, port):
    """--port 0 (the system picks one) skipped the host's check with the port's: the engine loaded, then uvicorn
    failed on the name in a message that does not name the flag."""
    with pytest.raises(SystemExit) as info:
        main(["serve", str(tmp_path / "no-model"), "--host", "999.1.1.1", "--port", port])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "--host 999.1.1.1 is not an address to listen on" in err, err


@pytest.mark.parametrize(("flag", "bound"), [("--max-num-seqs", 65536), ("--max-num-batched-tokens", 4194304)])
def test_serve_refuses_a_running_set_no_engine_allocates(tmp_path, capsys, flag, bound):
    """The engine's own bounds, at parse time: a huge value failed in the engine process after the weights loaded,
    with a traceback that did not name the flag."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", str(tmp_path / "no-model"), flag, str(bound + 1)])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"is not allowed; an int in [1, {bound}]" in err, err
    assert getattr(build_parser().parse_args(["serve", "m", flag, str(bound)]), flag[2:].replace("-", "_")) == bound


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
    (["--stream-interval", "10"], "--stream-interval-ms"),  # an abbreviation of it, were abbreviations taken
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


@pytest.mark.parametrize("name", ["", "  "])
def test_an_empty_served_model_name_is_refused(no_engine, tmp_path, capsys, name):
    """It was served as the model path instead, silently; clients send the name given."""
    with pytest.raises(SystemExit):
        main(["serve", str(tmp_path / "no-model"), "--port", "0", "--served-model-name", name])
    assert f"--served-model-name is {name!r}; give a name, or leave it out" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["serve", "m", "--max-model", "64"],
                                  ["generate", "--model", "m", "--prompt", "p", "--max-tok", "3"],
                                  ["demo", "--step", "2"]])
def test_an_abbreviated_flag_is_refused(capsys, argv):
    """argparse takes a unique prefix of a flag by default: another server's flag that happens to be a prefix of
    one here (vLLM's --stream-interval, in tokens, of --stream-interval-ms) would silently mean ours."""
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 2 and "unrecognized arguments" in capsys.readouterr().err


@pytest.mark.parametrize("flags, refusal", [
    (["--tool-call-parser", "hermes"], "reads the tag '<tool_call>', and this tokenizer marks it special"),
    (["--reasoning-parser", "qwen3"], "needs the checkpoint's tokenizer"),
])
def test_a_parser_the_tokenizer_cannot_serve_is_refused_before_the_model_loads(no_engine, tiny_checkpoint, tmp_path,
                                                                              capsys, flags, refusal):
    """The tokenizer's check (create_app's) runs on the checkpoint's files before the engine starts, so a bad
    parser costs no model load: a tokenizer that marks the tool-call tags special, and a checkpoint without one."""
    import shutil

    from transformers import AutoTokenizer

    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_checkpoint, checkpoint)
    if "--tool-call-parser" in flags:
        tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
        tokenizer.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
        tokenizer.save_pretrained(checkpoint)
    else:
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (checkpoint / name).unlink(missing_ok=True)
    with pytest.raises(SystemExit) as info:
        main(["serve", str(checkpoint), "--port", "0", *flags])
    assert info.value.code == 2 and refusal in capsys.readouterr().err and not no_engine
