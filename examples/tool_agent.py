"""A tool-using agent trained with GRPO over whole multi-turn episodes, on the CPU in about a minute.

    python examples/tool_agent.py                  # tiny random Qwen3 policy, CPU
    python examples/tool_agent.py --steps 20 --group 8

Each episode: the user asks for an arithmetic result; the model has up to 3 turns. A reply with a
<tool_call>{"name": "calculator", "arguments": {"expression": ...}}</tool_call> gets the result back
as a tool message; a malformed call gets the parser's error back as a tool message; a reply without a
call is the final answer (a wrong one gets a user nudge while turns remain). The episode is kept as
token ids (trainer_adapters.episode.Episode): the model's sampled ids exactly, the environment's turns
as the chat template renders them, and a loss mask over the sampled tokens only. GRPO (the clipped
policy gradient of trainer_adapters.grpo) then trains on the whole episode under that mask, one reward
per episode, advantages normalised within each question's group.

The policy is random, so a short supervised warm-up on a few demonstration episodes (built with the
same Episode class) first puts the tool-call format in its distribution; it learns little beyond that.
"""
import argparse
import ast
import operator
import random
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from rollout_engine import Engine, SamplingParams
from rollout_engine.tiny_model import make_tiny_model
from trainer_adapters import sync_weights
from trainer_adapters.episode import Episode, build_episode_batch
from trainer_adapters.grpo import group_advantages, policy_loss, token_logprobs
from trainer_adapters.tool_calls import HermesToolCallParser

# Qwen 2.5's ChatML layout: tools listed in the system turn (one line each here, where Qwen writes their
# JSON schemas: the tiny tokenizer spells JSON out a byte at a time), tool results in a user turn.
CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n' }}{% endif %}"
    "{% for t in tools %}{{ '- ' + t['function']['name'] + '(' + t['function']['parameters']['properties'] | list "
    "| join(', ') + '): ' + t['function']['description'] + '\\n' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "integer + - * ( )",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}]
SYSTEM = "Use the calculator, then answer."
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The calculator tool: integers, + - *, parentheses; anything else is an error message (never raises)."""
    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**6:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            value = OPS[type(node.op)](ev(node.left), ev(node.right))
            if abs(value) > 10**12:
                raise ValueError("result too large")
            return value
        raise ValueError(f"unsupported expression element {type(node).__name__}")

    try:
        if len(expression) > 64:
            raise ValueError("expression longer than 64 characters")
        return str(ev(ast.parse(expression, mode="eval")))
    except (SyntaxError, ValueError, RecursionError) as err:
        return f"error: {err}"


def make_question(rng: random.Random):
    a, b, c = rng.randrange(2, 20), rng.randrange(2, 20), rng.randrange(1, 50)
    return f"What is {a}*{b}+{c}?", f"{a}*{b}+{c}", a * b + c


class CalculatorEnv:
    """Answers one episode's model turns; `reward` when it is over."""

    def __init__(self, answer: int, parser: HermesToolCallParser):
        self.answer, self.parser = answer, parser
        self.done, self.correct, self.calls, self.malformed = False, False, 0, 0

    def step(self, text: str) -> list[dict]:
        content, calls, errors = self.parser.parse(text)
        self.calls += len(calls)
        self.malformed += len(errors)
        replies = [{"role": "tool", "content": calculate(str(c.arguments["expression"]))} for c in calls]
        replies += [{"role": "tool", "content": f"error: {e.message}"} for e in errors]
        if not replies:  # no call: this is the final answer
            self.correct = str(self.answer) in content.replace(",", "").split()  # e.g. "The answer is 17."
            self.correct = self.correct or content.rstrip(".").endswith(str(self.answer))
            if self.correct:
                self.done = True
                return []
            replies = [{"role": "user", "content": "That is not the answer. Use the calculator."}]
        return replies

    def reward(self) -> float:
        return float(self.correct) + 0.1 * min(self.calls, 2) - 0.1 * min(self.malformed, 2)


def demonstration(tokenizer, rng: random.Random, im_end: int) -> Episode:
    """An ideal episode, as the tokenizer would tokenize it: a tool call, the result, the answer."""
    question, expression, answer = make_question(rng)
    ep = Episode(tokenizer, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], tools=TOOLS)
    for reply in (f'<tool_call>{{"name": "calculator", "arguments": {{"expression": "{expression}"}}}}</tool_call>',
                  f"The answer is {answer}."):
        ids = tokenizer(reply, add_special_tokens=False)["input_ids"] + [im_end]
        ep.add_model_turn(ids, logprobs=[0.0] * len(ids))
        if reply.startswith("<tool_call>"):
            ep.add_messages([{"role": "tool", "content": calculate(expression)}])
    return ep


def warm_up(policy, optimizer, tokenizer, rng, steps: int, batch: int, im_end: int) -> float:
    """Supervised steps on demonstration episodes: cross-entropy on the loss mask (the model's turns)."""
    loss = torch.tensor(0.0)
    for _ in range(steps):
        eps = [demonstration(tokenizer, rng, im_end) for _ in range(batch)]
        data = build_episode_batch(eps, [0.0] * batch, tokenizer.pad_token_id)
        logprobs = token_logprobs(policy, data)
        loss = -(logprobs * data.completion_mask).sum() / data.completion_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return loss.item()


def run_episodes(engine, tokenizer, questions, group: int, turns: int, params, parser):
    """`group` episodes per question, all advanced together: one generate() call per turn."""
    episodes, envs = [], []
    for question, _, answer in questions:
        for _ in range(group):
            episodes.append(Episode(tokenizer, [{"role": "system", "content": SYSTEM},
                                                {"role": "user", "content": question}], tools=TOOLS))
            envs.append(CalculatorEnv(answer, parser))
    for turn in range(turns):
        active = [i for i, env in enumerate(envs) if not env.done]
        if not active:
            break
        outs = engine.generate([{"prompt_token_ids": episodes[i].prompt_ids()} for i in active], params,
                               use_tqdm=False)
        for i, out in zip(active, outs):
            completion = out.outputs[0]
            episodes[i].add_model_turn(completion)  # exactly the sampled ids, their logprobs and weight versions
            replies = envs[i].step(completion.text)
            if turn == turns - 1:
                envs[i].done = True  # out of turns: the episode ends on the model's turn
            elif replies:
                episodes[i].add_messages(replies)
    return episodes, envs


# Pieces of the tool-call format as tokens of their own, as real tokenizers have them (Qwen's has
# <tool_call> and </tool_call>; its BPE writes the JSON keys in a few tokens each). The tiny tokenizer
# would spell them out a byte at a time: 70 tokens for one call instead of 15.
EXTRA_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", '{"name": ', '"calculator"',
                ', "arguments": ', '{"expression": "', '"}}', "assistant", "user", "system", "The answer is",
                "What is", "calculator", "expression", "answer", "error"]


def tiny_tool_model(path: Path, seed: int) -> Path:
    """make_tiny_model's random Qwen3 checkpoint, with the tool-call tokens added and a chat template."""
    from transformers import AutoTokenizer

    make_tiny_model(path, hidden_size=96, intermediate_size=256, num_layers=2, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(EXTRA_TOKENS)
    tokenizer.chat_template = CHAT_TEMPLATE  # the tiny checkpoint ships none: give it one
    tokenizer.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(path, safe_serialization=True)
    return path


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="GRPO steps")
    parser.add_argument("--questions", type=int, default=4, help="questions per step")
    parser.add_argument("--group", type=int, default=4, help="episodes per question (the GRPO group)")
    parser.add_argument("--turns", type=int, default=3, help="model turns per episode at most")
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per model turn at most")
    parser.add_argument("--warmup-steps", type=int, default=40)
    parser.add_argument("--warmup-lr", type=float, default=3e-3)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start, rng = time.perf_counter(), random.Random(args.seed)
    torch.manual_seed(args.seed)

    path = tiny_tool_model(Path(tempfile.mkdtemp()) / "policy", args.seed)
    engine = Engine(path, device="cpu", kv_cache_memory=64 << 20, max_num_seqs=64, seed=args.seed)
    tokenizer = engine.tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.warmup_lr)
    warm_loss = warm_up(policy, optimizer, tokenizer, rng, args.warmup_steps, 8, im_end)
    sync_weights(engine, policy)
    for group in optimizer.param_groups:
        group["lr"] = args.lr
    print(f"warm-up: {args.warmup_steps} supervised steps on demonstration episodes, loss {warm_loss:.2f} "
          f"({time.perf_counter() - start:.0f}s)")

    tool_parser = HermesToolCallParser(tools=TOOLS)
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens, stop_token_ids=[im_end], logprobs=True)
    totals = {"episodes": 0, "turns": 0, "calls": 0, "malformed": 0, "sampled": 0, "tokens": 0, "correct": 0}
    for step in range(1, args.steps + 1):
        t = time.perf_counter()
        questions = [make_question(rng) for _ in range(args.questions)]
        episodes, envs = run_episodes(engine, tokenizer, questions, args.group, args.turns, params, tool_parser)
        rewards = [env.reward() for env in envs]
        gen_s = time.perf_counter() - t

        batch = build_episode_batch(episodes, rewards, tokenizer.pad_token_id)  # loss mask = sampled tokens
        advantages = group_advantages(batch.rewards, args.group)
        policy.train()
        loss = policy_loss(token_logprobs(policy, batch), batch, advantages)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        policy.eval()
        version = sync_weights(engine, policy)

        turns = sum(len(ep.model_turns()) for ep in episodes)
        for key, value in (("episodes", len(episodes)), ("turns", turns), ("calls", sum(e.calls for e in envs)),
                           ("malformed", sum(e.malformed for e in envs)), ("correct", sum(e.correct for e in envs)),
                           ("sampled", sum(ep.num_model_tokens for ep in episodes)),
                           ("tokens", sum(len(ep) for ep in episodes))):
            totals[key] += value
        print(f"step {step}: reward {batch.rewards.mean():.2f}  turns/episode {turns / len(episodes):.1f}  "
              f"tool calls {sum(e.calls for e in envs)} ok / {sum(e.malformed for e in envs)} malformed  "
              f"loss {loss.item():+.3f}  weights v{version}  ({gen_s:.1f}s rollout, "
              f"{time.perf_counter() - t - gen_s:.1f}s train+sync)")

    example = episodes[0]
    print(f"\n{totals['episodes']} episodes, {totals['turns']} model turns, {totals['calls']} tool calls answered, "
          f"{totals['malformed']} malformed calls answered with errors, {totals['correct']} correct answers")
    print(f"{totals['sampled']} of {totals['tokens']} episode tokens were sampled by the model and trained on "
          f"(loss mask {totals['sampled'] / totals['tokens']:.0%}); total {time.perf_counter() - start:.0f}s")
    print(f"last episode's messages: {[m['role'] for m in example.messages]}, {len(example)} tokens, "
          f"weight versions of its sampled tokens {sorted({v for v in example.weight_versions if v is not None})}")


if __name__ == "__main__":
    main()
