"""The `rollout-engine` command: make a tiny checkpoint, generate from a checkpoint."""
from __future__ import annotations

import argparse
import importlib
import json

from rollout_engine import EngineError, __version__


def cmd_make_tiny_model(args) -> int:
    from rollout_engine.tiny_model import make_tiny_model

    path = make_tiny_model(args.dir, hidden_size=args.hidden_size, num_layers=args.num_layers, seed=args.seed)
    print(f"wrote a random Qwen3-architecture checkpoint with its tokenizer to {path}")
    return 0


def cmd_generate(args) -> int:
    from rollout_engine import Engine, SamplingParams

    engine = Engine(args.model, device=args.device)
    params = SamplingParams(n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    for out in engine.generate(args.prompt, params):
        for c in out.outputs:
            print(json.dumps({"prompt": out.prompt, "sample": c.index, "text": c.text, "token_ids": c.token_ids,
                              "logprobs": [round(x, 4) for x in c.logprobs], "finish_reason": c.finish_reason}))
    return 0


def cmd_demo(args) -> int:
    # The demo is an application of the engine: it lives with the trainer glue, found by name, so the
    # engine's package imports nothing of it.
    run_demo = importlib.import_module("trainer_adapters.demo").run_demo
    log = run_demo(args.out, steps=args.steps, device=args.device, seed=args.seed)
    steps = log["steps"]
    first = sum(s["reward"] for s in steps[:5]) / min(5, len(steps))
    last = sum(s["reward"] for s in steps[-5:]) / min(5, len(steps))
    print(f"mean sample reward {first:.2f} -> {last:.2f}; greedy accuracy {log['eval'][0][1]:.2f} -> "
          f"{log['final_greedy_accuracy']:.2f} (chance {log['chance']:.2f})")
    print(f"wrote {args.out}/reward_curve.png and {args.out}/demo_log.json")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout-engine", description=__doc__)
    parser.add_argument("--version", action="version", version=f"rollout-engine {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tiny = sub.add_parser("make-tiny-model", help="write a small random Qwen3 checkpoint with a real tokenizer")
    tiny.add_argument("dir")
    tiny.add_argument("--hidden-size", type=int, default=64)
    tiny.add_argument("--num-layers", type=int, default=2)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=cmd_make_tiny_model)

    demo = sub.add_parser("demo", help="train a tiny policy with GRPO (sleep/wake + weight sync every step)")
    demo.add_argument("--out", default="demo_out", help="where the checkpoint, JSON log and plot go")
    demo.add_argument("--steps", type=int, default=150)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--device", default=None)
    demo.set_defaults(run=cmd_demo)

    gen = sub.add_parser("generate", help="sample completions of prompts from a checkpoint")
    gen.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
    gen.add_argument("--prompt", required=True, action="append", help="a prompt (repeat for several)")
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--device", default=None)
    gen.set_defaults(run=cmd_generate)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (ValueError, EngineError) as err:  # bad input or a refusal: say what was wrong, no traceback
        parser.exit(2, f"rollout-engine {args.command}: error: {err}\n")
