"""A GRPO loop you can copy: the engine generates, sleeps while the policy trains, takes the new weights, wakes.

    python examples/grpo_loop.py                       # tiny random policy, CPU, a minute or so
    python examples/grpo_loop.py --model PATH --device cuda

The task (reward 1 when a sample's first token is the last digit of a+b) is only there so the
reward visibly rises; swap in your prompts and reward function.
"""
import argparse
import random
import tempfile

import torch
from transformers import AutoModelForCausalLM

from rollout_engine import Engine, SamplingParams
from rollout_engine.tiny_model import make_tiny_model
from trainer_adapters import sync_weights
from trainer_adapters.grpo import build_batch, group_advantages, policy_loss, token_logprobs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Hugging Face checkpoint (default: a tiny random one)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    args = parser.parse_args()

    path = args.model or make_tiny_model(tempfile.mkdtemp(), hidden_size=128, intermediate_size=512,
                                         alphabet="0123456789+=")
    engine = Engine(path, device=args.device, kv_cache_memory=0.3)
    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(engine.device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-3)
    tasks = [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=1)

    for step in range(1, args.steps + 1):
        batch_tasks = random.sample(tasks, 64)
        # 1. Rollouts, with the logprobs of the policy that sampled them.
        outputs = engine.generate([p for p, _ in batch_tasks], params, use_tqdm=False)
        rewards = [float(c.text == answer) for o, (_, answer) in zip(outputs, batch_tasks) for c in o.outputs]

        # 2. The trainer's turn: the engine gives back its memory (level 2: the weights come back in step 4).
        engine.sleep(level=2)

        # 3. One clipped policy-gradient step, the engine's logprobs as the behaviour policy.
        batch = build_batch(outputs, rewards, pad_id=engine.tokenizer.pad_token_id)
        batch = type(batch)(*(t.to(engine.device) for t in vars(batch).values()))
        advantages = group_advantages(batch.rewards, args.n)
        loss = policy_loss(token_logprobs(policy, batch), batch, advantages)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

        # 4. Staged wake: weights first, then push the new policy into them, then the KV cache.
        engine.wake(tags=["weights"])
        sync_weights(engine, policy)
        engine.wake(tags=["kv_cache"])
        if step % 10 == 0:
            print(f"step {step:3d}  mean reward {batch.rewards.mean().item():.2f}  "
                  f"loss {loss.item():+.3f}  weight version {engine.weight_version}")


if __name__ == "__main__":
    main()
