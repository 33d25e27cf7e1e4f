"""The `rollout-engine` command: make a tiny checkpoint, generate from a checkpoint, serve one over HTTP."""
from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import signal
import socket
import sys

from rollout_engine import EngineError, __version__
from rollout_engine.cli_args import (ENGINE_DTYPES, MAX_NUM_BATCHED_TOKENS_ARG, MAX_NUM_SEQS_ARG, NON_NEGATIVE_INT, PORT,
                                     POSITIVE_INT, SAMPLES_PER_PROMPT, SEED, TINY_MODEL_HEADS, kv_cache_memory,
                                     milliseconds, number, origin, output_dir, switch_interval_ms, tiny_hidden_size,
                                     weight_format)
from rollout_engine.reasoning import PARSERS as REASONING_PARSERS
from rollout_engine.tool_call_parsers import PARSERS


def cmd_make_tiny_model(args) -> int:
    from rollout_engine.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, hidden_size=args.hidden_size, num_layers=args.num_layers,
                           num_heads=TINY_MODEL_HEADS, seed=args.seed)  # the heads --hidden-size was checked for
    print(f"wrote a random Qwen3-architecture checkpoint with its tokenizer to {path}")
    return 0


def cmd_generate(args) -> int:
    from rollout_engine import Engine, SamplingParams

    # the parameters first: they check themselves (e.g. temperature's range) before the model loads
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    engine = Engine(args.model, device=args.device)
    for out in engine.generate(args.prompt, params):
        for c in out.outputs:
            print(json.dumps({"prompt": out.prompt, "sample": c.index, "text": c.text, "token_ids": c.token_ids,
                              "logprobs": [round(x, 4) for x in c.logprobs], "finish_reason": c.finish_reason}))
    return 0


def cmd_demo(args) -> int:
    # The demo is an application of the engine: it lives with the trainer glue, found by name, so the
    # engine's package imports nothing of it.
    run_demo = importlib.import_module("trainer_adapters.demo").run_demo
    log = run_demo(args.out, steps=args.steps, device=args.device, seed=args.seed, quantization=args.quantization,
                   tis_cap=args.tis_cap, engine_dtype=args.dtype)
    steps = log["steps"]
    first = sum(s["reward"] for s in steps[:5]) / min(5, len(steps))
    last = sum(s["reward"] for s in steps[-5:]) / min(5, len(steps))
    print(f"mean sample reward {first:.2f} -> {last:.2f}; greedy accuracy {log['eval'][0][1]:.2f} -> "
          f"{log['final_greedy_accuracy']:.2f} (chance {log['chance']:.2f})")
    print(f"wrote {args.out}/reward_curve.png and {args.out}/demo_log.json")
    return 0


API_KEY_ENV = "ROLLOUT_ENGINE_API_KEY"  # serve's key, read from the environment unless --api-key gives one
# uvicorn's log levels (uvicorn.config.LOG_LEVELS, matched case-sensitively); named here because uvicorn is an
# optional extra that the parser must not need
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def check_port_free(host: str, port: int) -> None:
    """Binds and closes every address of `host` at `port` as uvicorn (asyncio's create_server) will, so that a
    port in use is refused before the engine loads rather than by uvicorn after it has (minutes for a real
    model). SO_REUSEADDR, as uvicorn sets it, lets a port in TIME_WAIT pass. An address this machine lacks is
    left for uvicorn to report: the check refuses only what uvicorn would."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise ValueError(f"--host {host} is not an address to listen on: {err.strerror}") from None
    if port == 0:  # the system picks a free one
        return
    for family, type_, proto, _, address in infos:
        try:
            sock = socket.socket(family, type_, proto)
        except OSError:  # a family this machine lacks
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:  # as asyncio: an IPv6 socket does not also take IPv4
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    raise ValueError(f"--port {port} is in use on {address[0]} (--host {host}): stop what listens "
                                     "there or pick another port (--port 0: any free one)") from None
                if err.errno != errno.EADDRNOTAVAIL:
                    raise ValueError(f"cannot listen on --host {host} --port {port}: {err.strerror}") from None


def check_parsers_tokenizer(args) -> None:
    """A reply parser the checkpoint's tokenizer cannot serve is refused before the model loads (create_app checks
    the loaded engine's tokenizer again); a path that is no directory is the Engine's to refuse."""
    if (args.tool_call_parser or args.reasoning_parser) and os.path.isdir(args.model):
        from pathlib import Path

        from rollout_engine.inputs import load_tokenizer
        from rollout_engine.server.chat_reply import check_parsers

        check_parsers(args.tool_call_parser, args.reasoning_parser, load_tokenizer(Path(args.model)))


def serve_engine_kwargs(args) -> dict:
    """The Engine arguments `serve`'s flags give (every value is checked by the Engine itself)."""
    kwargs = dict(device=args.device, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                  max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, block_size=args.block_size,
                  enable_prefix_caching=not args.no_prefix_caching, seed=args.seed,
                  tensor_parallel_size=args.tensor_parallel_size, enforce_eager=args.enforce_eager,
                  load_format=args.load_format, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
                  batch_invariant=args.batch_invariant)
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.draft_model is not None or args.num_speculative_tokens:
        kwargs |= dict(draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens)
    if args.draft_quantization != "auto":  # without a draft, the Engine says it needs one
        kwargs["draft_quantization"] = args.draft_quantization
    return kwargs


def cmd_serve(args) -> int:
    try:
        from rollout_engine.server import create_app
        from rollout_engine.server.guards import check_api_key, is_loopback_address
        from rollout_engine.server.shutdown import draining_server
    except ImportError as err:
        raise ValueError(f"serve needs the server extra ({err.name} is missing): pip install 'rollout-engine[server]'")
    from rollout_engine.server import EngineClient

    try:
        check_api_key(args.api_key)  # before the engine process starts
    except ValueError:
        raise ValueError(f"--api-key (or ${API_KEY_ENV}) is {args.api_key!r}: an empty key would turn authentication "
                         f"off; give a key, or neither (no authentication)") from None
    check_port_free(args.host, args.port)
    if args.served_model_name is not None and not args.served_model_name.strip():  # the model id clients must send
        raise ValueError(f"--served-model-name is {args.served_model_name!r}; give a name, or leave it out (MODEL)")
    if args.enable_prefix_caching and args.no_prefix_caching:
        raise ValueError("--enable-prefix-caching and --no-prefix-caching contradict each other: give one")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (as vLLM's does), which says how to "
                         f"read the calls: one of {sorted(PARSERS)}")
    check_parsers_tokenizer(args)

    local = is_loopback_address(args.host)
    if not local and not args.api_key:
        print(f"warning: serving on {args.host} without --api-key: anyone who can reach it may generate and use "
              "the admin endpoints", file=sys.stderr)
    engine_kwargs = serve_engine_kwargs(args)
    # The engine runs in a process of its own (started here, ready when this returns); this one serves HTTP.
    switch_interval_s = args.switch_interval_ms / 1e3
    # SIGTERM as SystemExit, from before the engine process starts: during its start-up EngineClient stops it;
    # later uvicorn shuts down on SIGTERM and raises the signal again, and the engine is stopped below (its model
    # freed) rather than left to notice that its parent is gone.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    engine = EngineClient(args.model, switch_interval_s=switch_interval_s, weight_receiver=args.weight_receiver,
                          **engine_kwargs)
    sys.setswitchinterval(switch_interval_s)
    server = None
    try:
        served = args.model if args.served_model_name is None else args.served_model_name
        app = create_app(engine, served_model_name=served, api_key=args.api_key,
                         stream_interval=args.stream_interval_ms / 1e3, loopback=local,
                         allowed_origins=args.allowed_origin, tool_call_parser=args.tool_call_parser,
                         reasoning_parser=args.reasoning_parser)
        server = draining_server(app, engine, args.shutdown_timeout, host=args.host, port=args.port,
                                 log_level=args.log_level, access_log=args.access_log)
        server.run()
    except KeyboardInterrupt:  # Ctrl-C: the same, after uvicorn's own shutdown
        pass
    finally:
        engine.shutdown()
    # not started: uvicorn has logged why (the port taken since it was checked)
    return 1 if server is not None and not server.started else 0


# vLLM's serve flags whose job another flag does here, or none: refused with what to use instead.
VLLM_FLAGS = {"--gpu-memory-utilization": "use --kv-cache-memory: the KV pool's fraction of free device memory (or "
                                          "its bytes), not the whole GPU's",
              "--speculative-config": "use --draft-model PATH (or '[ngram]') and --num-speculative-tokens K",
              "--chat-template": "not supported: chats render with the checkpoint's own chat template",
              "--no-enable-prefix-caching": "use --no-prefix-caching",
              "-tp": "use --tensor-parallel-size",
              "--stream-interval": "use --stream-interval-ms: at most one chunk per that many milliseconds (vLLM's "
                                   "counts tokens)"}
# vLLM's serve flags that ask for what this server does anyway: taken.
VLLM_DEFAULTS = {"--enable-prefix-caching": "on unless --no-prefix-caching", "--enable-sleep-mode": "always on",
                 "--enable-auto-tool-choice": "with --tool-call-parser, tool calls are parsed whenever a request "
                                              "has tools",
                 "--disable-log-requests": "no request's body is logged (uvicorn's access log: --no-access-log)"}


class _VLLMFlag(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is vLLM's; {VLLM_FLAGS[option_string]}")


def _vllm_flags(serve) -> None:
    for flag in VLLM_FLAGS:
        serve.add_argument(flag, nargs="?", action=_VLLMFlag, help=argparse.SUPPRESS)
    for flag, why in VLLM_DEFAULTS.items():
        serve.add_argument(flag, action="store_true", help=f"taken, as vLLM's: {why}")


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: a prefix of ours may be another server's flag with another meaning
    parser = argparse.ArgumentParser(prog="rollout-engine", description=__doc__, allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"rollout-engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tiny = sub.add_parser("make-tiny-model", allow_abbrev=False,
                          help="write a small random Qwen3 checkpoint with a real tokenizer")
    tiny.add_argument("dir", type=output_dir, help="the checkpoint's directory (made if missing)")
    tiny.add_argument("--hidden-size", type=tiny_hidden_size, default=64,
                      help=f"a multiple of {2 * TINY_MODEL_HEADS} ({TINY_MODEL_HEADS} heads of an even head_dim)")
    tiny.add_argument("--num-layers", type=POSITIVE_INT, default=2)
    tiny.add_argument("--seed", type=SEED, default=0)
    tiny.set_defaults(run=cmd_make_tiny_model)

    demo = sub.add_parser("demo", allow_abbrev=False,
                          help="train a tiny policy with GRPO (sleep/wake + weight sync every step)")
    demo.add_argument("--out", type=output_dir, default="demo_out",
                      help="where the checkpoint, JSON log and plot go (made if missing)")
    demo.add_argument("--steps", type=POSITIVE_INT, default=150)
    demo.add_argument("--seed", type=SEED, default=0)
    demo.add_argument("--device", default=None)
    demo.add_argument("--dtype", default="auto", choices=ENGINE_DTYPES,
                      help="the engine's dtype (the trainer stays float32)")
    demo.add_argument("--quantization", default=None, type=weight_format("quantization"),
                      help="the engine's weight format, e.g. 'fp8' (default, 'none': --dtype)")
    demo.add_argument("--tis-cap", type=number(zero_allowed=False, inf_allowed=True), default=None,
                      help="truncated importance sampling against the rollout's logprobs, weights capped at this "
                           "value, e.g. 2.0 (inf: no cap; default: off)")
    demo.set_defaults(run=cmd_demo)

    gen = sub.add_parser("generate", allow_abbrev=False, help="sample completions of prompts from a checkpoint")
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    gen.add_argument("--prompt", required=True, action="append", help="a prompt (repeat for several)")
    gen.add_argument("--n", type=SAMPLES_PER_PROMPT, default=1)
    gen.add_argument("--max-tokens", type=POSITIVE_INT, default=32)
    gen.add_argument("--temperature", type=number(zero_allowed=True), default=1.0, help="0: greedy")
    gen.add_argument("--seed", type=SEED, default=None)
    gen.add_argument("--device", default=None)
    gen.set_defaults(run=cmd_generate)

    serve = sub.add_parser("serve", allow_abbrev=False,
                           help="an OpenAI-compatible HTTP server (completions, chat, admin, metrics)")
    serve.add_argument("model", help="Hugging Face checkpoint directory")
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless you say otherwise)")
    serve.add_argument("--port", type=PORT, default=8000, help="TCP port, 0-65535 (0: any free one)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                       help=f"require 'Authorization: Bearer KEY' on every endpoint (default: ${API_KEY_ENV}, which "
                            "keeps the key out of the process list)")
    serve.add_argument("--served-model-name", default=None, help="the model id clients send (default: MODEL)")
    serve.add_argument("--allowed-origin", action="append", default=[], metavar="ORIGIN", type=origin,
                       help="a web page origin (e.g. http://localhost:3000) whose requests are served; repeatable "
                            "(default: none: requests from web pages are refused)")
    serve.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                       help="parse the tool calls of chat replies to requests with 'tools' into message.tool_calls "
                            "(hermes: <tool_call>{...}</tool_call>, as Hermes and Qwen 2.5/3 write them; llama3_json: "
                            "a reply that is {\"name\": ..., \"parameters\": {...}}, as Llama 3.1-3.3 write them; "
                            "qwen3_coder: <tool_call><function=NAME><parameter=KEY>...</parameter></function>"
                            "</tool_call>, as Qwen3-Coder writes them)")
    serve.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="return what chat replies write between <think> and </think> as message.reasoning (and "
                            "reasoning_content), apart from the content; a prompt that ends in an open <think> "
                            "(DeepSeek-R1's template) starts its reply inside the block")
    serve.add_argument("--stream-interval-ms", type=milliseconds(zero_allowed=True), default=0.0,
                       help="at most one chunk per stream per interval (0: one per engine step)")
    serve.add_argument("--shutdown-timeout", type=number(zero_allowed=True, unit="number of seconds"), default=5.0,
                       help="on SIGTERM or Ctrl-C, how long requests in flight may finish (as vLLM's); those still "
                            "running then end as 'abort', with what they have (0: at once)")
    serve.add_argument("--weight-receiver", action="store_true",
                       help="take weight updates from a trainer's transport.WeightSender on this host (its address: "
                            "GET /weight_receiver; an ipc socket only this user can reach)")
    serve.add_argument("--device", default=None)
    serve.add_argument("--dtype", default="auto", choices=ENGINE_DTYPES)
    serve.add_argument("--kv-cache-memory", type=kv_cache_memory, default=0.3,
                       help="fraction of free device memory (0.3) or bytes (2000000000)")
    serve.add_argument("--max-num-seqs", type=MAX_NUM_SEQS_ARG, default=256)
    serve.add_argument("--max-model-len", type=POSITIVE_INT, default=None)
    serve.add_argument("--max-num-batched-tokens", type=MAX_NUM_BATCHED_TOKENS_ARG, default=None)
    serve.add_argument("--block-size", type=POSITIVE_INT, default=16)
    serve.add_argument("--no-prefix-caching", action="store_true")
    serve.add_argument("--tensor-parallel-size", type=POSITIVE_INT, default=1)
    serve.add_argument("--draft-model", default=None)
    serve.add_argument("--num-speculative-tokens", type=NON_NEGATIVE_INT, default=0)
    serve.add_argument("--quantization", default=None, type=weight_format("quantization"),
                       help="'fp8': fp8 projections, re-quantized on every update ('none': the dtype's)")
    serve.add_argument("--kv-cache-dtype", default="auto",
                       help="'auto' (the model's dtype) or 'fp8' (e4m3 with scales)")
    serve.add_argument("--draft-quantization", default="auto",
                       type=weight_format("draft_quantization", auto_allowed=True),
                       help="the draft's weight format ('auto': --quantization; 'none': the draft's dtype)")
    serve.add_argument("--batch-invariant", action="store_true", help="outputs independent of the batch (slower)")
    serve.add_argument("--enforce-eager", action="store_true")
    serve.add_argument("--load-format", default="safetensors", help="'dummy': random weights (benchmarks)")
    serve.add_argument("--seed", type=SEED, default=0)
    serve.add_argument("--switch-interval-ms", type=switch_interval_ms, default=0.5,
                       help="sys.setswitchinterval in the front and engine processes (Python: 5 ms); each runs one "
                            "Python thread of its own, so it matters little")
    serve.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    serve.add_argument("--no-access-log", dest="access_log", action="store_false")
    _vllm_flags(serve)
    serve.set_defaults(run=cmd_serve)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (ValueError, EngineError, OSError) as err:  # bad input, a refusal, a path it cannot use: no traceback
        parser.exit(2, f"rollout-engine {args.command}: error: {err}\n")


if __name__ == "__main__":
    sys.exit(main())
