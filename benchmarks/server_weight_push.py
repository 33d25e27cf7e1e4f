"""Weights pushed into a running server (`rollout-engine serve --weight-receiver`) from a trainer process on the
same GPU, against the same update in process and into a WeightReceiver of the trainer's own making (CUDA IPC).

A trainer process holding no engine (a subprocess of this one) sends bf16 tensors (Hugging Face names, unfused, on
the GPU) to the server's engine process through the address GET /weight_receiver gives, as CUDA IPC handles of
their storages (shared once, then only named). Each send is timed from the call to the engine's acknowledgement,
after the first (which shares every storage and is reported apart). "served_equal": the server's greedy tokens
after the pushes equal those of an engine in this process given the same tensors; "served_changed": they differ
from the server's before the pushes (its dummy weights'). The weight_sync.py rows of the same model run first, in
the same process, as the reference: in process (the ceiling of a copy) and a WeightReceiver in this process fed
by a trainer process.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (copy_bandwidth, format_label, free_port, machine, print_table, result_name, save,  # noqa: E402
                    shaped_checkpoint, wait_for_health)
from weight_sync import engine_shapes, in_process_row, remote_row, synchronize, trainer_tensors  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402
from rollout_engine.transport import WeightSender  # noqa: E402
from rollout_engine.transport.sender import DEFAULT_BUCKET_BYTES  # noqa: E402

ENGINE = dict(kv_cache_memory=1 << 30, max_num_seqs=8, max_model_len=1024)
PROMPT, NEW_TOKENS = list(range(100, 116)), 8
KEY = "sk-bench"
SCALE = 0.02  # the trainer's tensors: randn times this, weights of a plausible size


def serve(checkpoint: Path, device: str, log: Path) -> tuple[subprocess.Popen, str]:
    """A `rollout-engine serve --weight-receiver` on `device` with dummy weights, once /health answers."""
    port = free_port()
    command = [sys.executable, "-m", "rollout_engine.cli", "serve", str(checkpoint), "--port", str(port),
               "--device", device, "--dtype", "bfloat16", "--load-format", "dummy", "--weight-receiver",
               "--api-key", KEY, "--served-model-name", "m", "--kv-cache-memory", str(ENGINE["kv_cache_memory"]),
               "--max-num-seqs", str(ENGINE["max_num_seqs"]), "--max-model-len", str(ENGINE["max_model_len"]),
               "--no-access-log"]
    proc = subprocess.Popen(command, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, 600, headers=auth(), log=log)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def greedy_over_http(url: str) -> list[int]:
    body = {"model": "m", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}
    reply = httpx.post(f"{url}/v1/completions", headers=auth(), json=body, timeout=120).json()
    return reply["choices"][0]["token_ids"]


def sent_tensors(shapes: dict, device: str) -> dict[str, torch.Tensor]:
    """The trainer's tensors (randn times SCALE): the sender's, and the same regenerated for the check."""
    return {n: t.mul_(SCALE) for n, t in trainer_tensors(shapes, device).items()}


def push(shapes_path: str, endpoint: str, reps: int, device: str) -> None:
    """The trainer process: a process of its own holding no engine, as a trainer beside a server is. Sends
    reps + 1 updates and prints each send's seconds (pack, hand over, the engine's copies, its acknowledgement)."""
    trainer = sent_tensors(json.loads(Path(shapes_path).read_text()), device)
    times = []
    with WeightSender(endpoint) as sender:
        for _ in range(reps + 1):
            synchronize()
            t = time.perf_counter()
            sender.send(trainer.items())
            times.append(time.perf_counter() - t)
    print(json.dumps(times))


def server_row(name: str, checkpoint: Path, engine: Engine, copy_bw: float, reps: int, work: Path) -> dict:
    device = engine.weights.destination("model.embed_tokens.weight").device.type
    shapes = engine_shapes(engine)
    (work / "shapes.json").write_text(json.dumps(shapes))
    proc, url = serve(checkpoint, device, work / f"{name}.log")
    try:
        endpoint = httpx.get(f"{url}/weight_receiver", headers=auth(), timeout=10).json()["endpoint"]
        before = greedy_over_http(url)  # the dummy weights': the pushed ones must change the reply
        sender = subprocess.run([sys.executable, __file__, "--sender", str(work / "shapes.json"), endpoint, str(reps),
                                 device], capture_output=True, text=True, timeout=600)
        if sender.returncode != 0:
            raise RuntimeError(f"the sender failed (exit {sender.returncode}): {sender.stderr[-2000:]}")
        times = json.loads(sender.stdout.strip().splitlines()[-1])
        got = greedy_over_http(url)
    finally:
        proc.terminate()
        proc.wait(60)
    trainer = sent_tensors(shapes, device)  # what was sent, regenerated
    payload = sum(t.nbytes for t in trainer.values())
    engine.update_weights(trainer.items())
    want = engine.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=NEW_TOKENS,
                                                                        ignore_eos=True), use_tqdm=False)
    seconds = statistics.median(times[1:])
    return {"model": name, "weights": format_label(engine.cfg.quantization, engine.dtype),
            "transport": f"server ({'cuda-ipc' if device == 'cuda' else 'shm'})", "payload_gb": payload / 1e9,
            "seconds": seconds, "payload_gb_per_s": payload / seconds / 1e9, "first_update_s": times[0],
            "of_copy_payload_rate": payload / seconds / (copy_bw / 2),
            "served_equal": got == want[0].outputs[0].token_ids, "served_changed": got != before}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny shapes on the CPU, through shared memory: a smoke "
                        "test of the script, not a measurement")
    parser.add_argument("--sender", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        shapes, endpoint, reps, device = args.sender
        return push(shapes, endpoint, int(reps), device)
    out = result_name("server_weight_push", args, parser)
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.models, args.reps = ["tiny-qwen3"], 2
    copy_bw = copy_bandwidth(device=device)
    root, rows = Path(tempfile.mkdtemp()), []
    for name in args.models:
        checkpoint = shaped_checkpoint(name, root)
        engine = Engine(checkpoint, device=device, dtype="bfloat16", load_format="dummy", **ENGINE)
        rows.append(in_process_row(name, engine, copy_bw, args.reps))
        if not args.quick:
            rows.append(remote_row(name, engine, copy_bw, args.reps, DEFAULT_BUCKET_BYTES, "cuda-ipc"))
        rows.append(server_row(name, checkpoint, engine, copy_bw, args.reps, root))
        del engine
        if not args.quick:
            torch.cuda.empty_cache()
        save(out, rows, {"copy_bandwidth_bytes_per_s": copy_bw})
    print_table(rows, f"weights pushed into a server vs in process and CUDA IPC (device copy "
                      f"{copy_bw / 1e12:.2f} TB/s read+write), {machine()}")


if __name__ == "__main__":
    sys.exit(main())
