"""The GRPO loop of grpo_loop.py with the engine behind `rollout-engine serve` (as slime or an agent framework
keeps it): samples over HTTP, new weights pushed in with a WeightSender, no checkpoint written.

    python examples/server_grpo.py                     # tiny random policy, CPU, about a minute
    python examples/server_grpo.py --model PATH --device cuda

Each step: POST /v1/completions (n samples a prompt, each token's id and logprob) -> POST /sleep (level 2: the
trainer gets the memory) -> one clipped policy-gradient step -> POST /wake the weights -> WeightSender.send the
new policy to GET /weight_receiver's address -> POST /wake the KV cache. Exit status 1 if the mean reward of the
last 5 steps is below 0.5 (the task is the one `rollout-engine demo` learns: the last digit of a+b).
"""
import argparse
import random
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from rollout_engine import CompletionOutput, RequestOutput
from rollout_engine.tiny_model import make_tiny_model
from rollout_engine.transport import WeightSender
from trainer_adapters.grpo import build_batch, group_advantages, policy_loss, token_logprobs
from trainer_adapters.sync import hf_named_parameters


def start_server(path, device) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    flags = ["--weight-receiver", "--port", str(port), "--served-model-name", "policy", "--log-level", "warning",
             "--no-access-log", "--kv-cache-memory", "0.3" if device == "cuda" else "64000000"]
    flags += ["--device", device] if device else []
    server = subprocess.Popen([sys.executable, "-m", "rollout_engine.cli", "serve", str(path), *flags])
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return server, url
        except httpx.TransportError:
            pass
        if server.poll() is not None:
            sys.exit(f"the server exited with code {server.returncode}")
        time.sleep(0.2)
    server.kill()
    sys.exit("the server did not answer /health in 120 s")


def rollouts(http, prompts, n) -> list[RequestOutput]:
    """One /v1/completions call, as the engine's RequestOutputs (prompt-major choices, n each)."""
    body = {"model": "policy", "prompt": prompts, "n": n, "max_tokens": 1, "temperature": 1.0, "logprobs": 0}
    choices = http.post("/v1/completions", json=body).raise_for_status().json()["choices"]
    outs = []
    for i in range(len(prompts)):
        mine = choices[i * n:(i + 1) * n]
        outs.append(RequestOutput(i, prompts[i], mine[0]["prompt_token_ids"], [
            CompletionOutput(j, c["token_ids"], c["logprobs"]["token_logprobs"], c["text"], c["finish_reason"],
                             c["weight_versions"]) for j, c in enumerate(mine)], mine[0]["weight_versions"][0]))
    return outs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", help="a Hugging Face checkpoint (default: a tiny random one)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt (the GRPO group)")
    parser.add_argument("--seed", type=int, default=0, help="the task draws' and the policy's (the engine's: 0)")
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    path = args.model or make_tiny_model(tempfile.mkdtemp(), hidden_size=128, intermediate_size=512,
                                         alphabet="0123456789+=")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    server, url = start_server(path, args.device)
    try:
        http = httpx.Client(base_url=url, timeout=300)
        endpoint = http.get("/weight_receiver").json()["endpoint"]
        policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=2e-3)
        pad_id = AutoTokenizer.from_pretrained(path).pad_token_id
        tasks = [(f"{a}+{b}=", str((a + b) % 10)) for a in range(10) for b in range(10)]
        rewards_seen = []
        with WeightSender(endpoint) as sender:
            for step in range(1, args.steps + 1):
                batch_tasks = random.sample(tasks, 64)
                outputs = rollouts(http, [p for p, _ in batch_tasks], args.n)
                rewards = [float(c.text == a) for o, (_, a) in zip(outputs, batch_tasks) for c in o.outputs]
                http.post("/sleep", json={"level": 2}).raise_for_status()

                batch = build_batch(outputs, rewards, pad_id=pad_id)
                batch = type(batch)(*(t.to(device) for t in vars(batch).values()))
                loss = policy_loss(token_logprobs(policy, batch), batch, group_advantages(batch.rewards, args.n))
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

                http.post("/wake", json={"tags": ["weights"]}).raise_for_status()
                with torch.no_grad():
                    version = sender.send(hf_named_parameters(policy))
                http.post("/wake", json={"tags": ["kv_cache"]}).raise_for_status()
                rewards_seen.append(batch.rewards.mean().item())
                if step % 10 == 0:
                    print(f"step {step:3d}  mean reward {rewards_seen[-1]:.2f}  loss {loss.item():+.3f}  "
                          f"weight version {version}", flush=True)
    finally:
        server.terminate()
        server.wait(30)
    last = sum(rewards_seen[-5:]) / len(rewards_seen[-5:])
    print(f"mean reward {rewards_seen[0]:.2f} (step 1) -> {last:.2f} (last 5 steps)")
    return 0 if last >= 0.5 else 1


if __name__ == "__main__":
    sys.exit(main())
