"""Weight sync after an optimizer step: payload GB/s of update_weights against the device copy bandwidth.

In process, on one GPU: the trainer's tensors (Hugging Face names, unfused, bf16, on the
same device) are copied into the engine's fused parameters in place. Payload bytes are
the bytes of the incoming tensors. A device copy of P payload bytes moves 2P (read +
write), so the reference payload rate is half the copy bandwidth measured in this run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import copy_bandwidth, machine, plot_bars, print_table, save, shaped_checkpoint  # noqa: E402

from rollout_engine import Engine  # noqa: E402


def run_shape(name: str, root: Path, copy_bw: float, reps: int) -> dict:
    engine = Engine(shaped_checkpoint(name, root), device="cuda", load_format="dummy", kv_cache_memory=1 << 30,
                    max_num_seqs=8, max_model_len=1024)
    trainer = {n: torch.randn_like(engine.weights.destination(n)) for n in engine.weights.names()}
    payload = sum(t.numel() * t.element_size() for t in trainer.values())
    engine.update_weights(trainer.items())  # warm-up
    times = []
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.update_weights(trainer.items())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    extra = torch.cuda.max_memory_allocated() - base
    seconds = statistics.median(times)
    ok = all(torch.equal(engine.weights.destination(n), t) for n, t in trainer.items())
    del engine, trainer
    torch.cuda.empty_cache()
    return {"model": name, "transport": "in-process", "payload_gb": payload / 1e9, "seconds": seconds,
            "payload_gb_per_s": payload / seconds / 1e9, "of_copy_payload_rate": payload / seconds / (copy_bw / 2),
            "extra_device_mb": extra / 1e6, "weights_equal": ok}


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    copy_bw = copy_bandwidth()
    root = Path(tempfile.mkdtemp())
    rows = [run_shape(m, root, copy_bw, args.reps) for m in args.models]
    print_table(rows, f"weight sync (device copy {copy_bw / 1e12:.2f} TB/s read+write = "
                      f"{copy_bw / 2e9:.0f} GB/s payload), {machine()}")
    save("weight_sync", rows, {"copy_bandwidth_bytes_per_s": copy_bw})
    plot_bars("weight_sync", [f"{r['model']} {r['transport']}" for r in rows],
              {"payload GB/s": [r["payload_gb_per_s"] for r in rows]}, "GB/s")


if __name__ == "__main__":
    main()
