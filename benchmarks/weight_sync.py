"""Weight sync after an optimizer step: payload GB/s of update_weights against the device copy bandwidth.

In process, on one GPU: the trainer's tensors (Hugging Face names, unfused, bf16, on the
same device) are copied into the engine's fused parameters in place; "copy_loop" is the same
copies as one copy_ per tensor, what a loader that does not batch them would take. Through
CUDA IPC: a trainer process on the same GPU sends the same tensors with WeightSender (each
storage shared once, then only named); the engine process's WeightReceiver copies straight
out of them. Payload bytes are the bytes of the incoming tensors. A device copy of P payload
bytes moves 2P (read + write), so the reference payload rate (the ceiling of both paths, which
copy each byte once) is half the copy bandwidth measured in this run. With two GPUs, also through NCCL
from a trainer process on GPU 1: packed buckets broadcast over a weight-update group, against the same
group's broadcast of one bucket-sized buffer.

`--quantization fp8` runs every model again on an fp8 engine (Engine(quantization="fp8")) after the bf16 one:
the same bf16 tensors arrive and each projection is quantized on the way in (its scale, then the cast), so the
payload is still the bf16 bytes; "vs_bf16_seconds" is each row's time over the bf16 engine's row of the same
model and transport (issue #23's bound: <= 2 for the 8B shape in process). "weights_equal" there means every
unquantized tensor equal and every fp8 one within e4m3's rounding of the bf16 it came from. `--quick`: the
in-process rows on tiny shapes on the CPU (a smoke test of the script, not a measurement).

Host cost (`--host`, runs on the CPU too): the same number and order of tensors as the
Qwen3-1.7B shape, but tiny, so copies are negligible and what is left is the host's time
per tensor (name lookup, checks, views, launches).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUANTIZATIONS, SHAPES, copy_bandwidth, format_label, free_port, machine,  # noqa: E402
                    plot_bars, print_table, result_name, save, shaped_checkpoint, weight_formats)

from rollout_engine import Engine  # noqa: E402
from rollout_engine.transport import WeightReceiver, WeightSender, init_weight_update_group  # noqa: E402
from rollout_engine.transport.sender import DEFAULT_BUCKET_BYTES, SHARED_BUCKET_BYTES  # noqa: E402

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, eos_token_id=0)


# e4m3 keeps 3 mantissa bits: rounding a normal value v / scale errs by at most 2^-4 of it, a subnormal one
# (below 2^-6) by at most half their spacing 2^-9; the float32 division adds its own rounding (the slack).
E4M3_RELATIVE, E4M3_SUBNORMAL_HALF_STEP, SLACK = 2.0 ** -4, 2.0 ** -10, 1e-6


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def median_seconds(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        synchronize()
        t = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def trainer_tensors(shapes: dict[str, list[int]], device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 tensors, the same in every process that asks with the same seed."""
    g = torch.Generator(device).manual_seed(seed)
    return {n: torch.randn(s, generator=g, device=device, dtype=torch.bfloat16) for n, s in shapes.items()}


def engine_shapes(engine: Engine) -> dict[str, list[int]]:
    return {n: list(engine.weights.destination(n).shape) for n in sorted(engine.weights.names())}


def host_row(device: str, reps: int) -> dict:
    """Host microseconds per tensor of update_weights on tiny tensors in the 1.7B layout."""
    root = Path(tempfile.mkdtemp())
    (root / "config.json").write_text(json.dumps(SHAPES["qwen3-1.7b"] | TINY))
    engine = Engine(root, device=device, load_format="dummy", kv_cache_memory=1 << 20, max_num_seqs=2,
                    max_model_len=64, enforce_eager=True)
    trainer = {n: torch.randn_like(engine.weights.destination(n)) for n in engine_shapes(engine)}
    seconds = median_seconds(lambda: engine.update_weights(trainer.items()), reps)
    return {"model": "qwen3-1.7b layout, tiny tensors", "device": device, "tensors": len(trainer),
            "update_ms": seconds * 1e3, "us_per_tensor": seconds / len(trainer) * 1e6}


def weights_match(engine: Engine, trainer: dict[str, torch.Tensor]) -> bool:
    """Every weight is the trainer's tensor: equal, or for an fp8 one (weight * its layer's scale) within e4m3's
    rounding of it."""
    for name, source in trainer.items():
        stored = engine.weights.destination(name)
        if name not in engine.weights.fp8:
            if not torch.equal(stored, source):
                return False
            continue
        scale = engine.weights.fp8[name][0].weight_scale
        source = source.float()
        bound = source.abs() * (E4M3_RELATIVE + SLACK) + scale * E4M3_SUBNORMAL_HALF_STEP
        if not ((stored.float() * scale - source).abs() <= bound).all():
            return False
    return True


def in_process_row(name: str, engine: Engine, copy_bw: float, reps: int) -> dict:
    device = engine.weights.destination("model.embed_tokens.weight").device
    cuda = device.type == "cuda"
    trainer = trainer_tensors(engine_shapes(engine), device.type)
    payload = sum(t.nbytes for t in trainer.values())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    seconds = median_seconds(lambda: engine.update_weights(trainer.items()), reps)
    extra = torch.cuda.max_memory_allocated() - base if cuda else None
    row = {"model": name, "weights": format_label(engine.cfg.quantization, engine.dtype), "transport": "in-process",
           "payload_gb": payload / 1e9, "seconds": seconds, "payload_gb_per_s": payload / seconds / 1e9,
           "of_copy_payload_rate": payload / seconds / (copy_bw / 2)}
    if not engine.weights.fp8:  # copying bf16 into fp8 storage is a cast, not the update it would stand for
        _, destinations, sources = engine.weights.resolve(trainer.items())
        loop = median_seconds(lambda: [d.copy_(s) for d, s in zip(destinations, sources)], reps)
        row["copy_loop_gb_per_s"] = payload / loop / 1e9
    return row | {"extra_device_mb": extra / 1e6 if cuda else None, "weights_equal": weights_match(engine, trainer)}


def remote_row(name: str, engine: Engine, copy_bw: float, reps: int, bucket_bytes: int, transport: str) -> dict:
    """A trainer process pushes reps + 1 updates: through CUDA IPC from the same GPU (the first update shares
    every storage and is reported apart; from the third on the same bytes go again, what every later RL step
    sees), or through NCCL from GPU 1 (packed buckets, broadcast), measured against the same group's broadcast
    of one bucket-sized buffer: the link's rate as NCCL drives it."""
    work = Path(tempfile.mkdtemp())
    shapes = engine_shapes(engine)
    (work / "shapes.json").write_text(json.dumps(shapes))
    endpoint, port = f"ipc://{work}/weights", free_port()
    sender = subprocess.Popen([sys.executable, __file__, "--sender", str(work / "shapes.json"), endpoint,
                               str(reps), str(bucket_bytes), transport, str(port)], stdout=subprocess.PIPE, text=True)
    group = init_weight_update_group("127.0.0.1", port, rank=1, world_size=2) if transport == "nccl" else None
    receiver = WeightReceiver(engine, endpoint, group=group)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(reps + 1):
        receiver.receive()
    receiver_extra = torch.cuda.max_memory_allocated() - base
    receiver.close()  # unmaps the sender's buffer before the sender exits and frees it
    if group is not None:
        link = torch.empty(bucket_bytes, dtype=torch.uint8, device="cuda")
        for _ in range(reps + 1):
            group.broadcast(link)
        group.close()  # returns once the sender closes too
    out, _ = sender.communicate(timeout=300)
    if sender.returncode != 0:
        raise RuntimeError(f"the {transport} sender failed (exit {sender.returncode}): {out}")
    sent = json.loads(out.strip().splitlines()[-1])
    expected = trainer_tensors(shapes, "cuda")  # what the sender sent, regenerated
    ok = weights_match(engine, expected)
    payload = sum(t.nbytes for t in expected.values())
    seconds = statistics.median(sent["seconds"])
    row = {"model": name, "weights": format_label(engine.cfg.quantization, engine.dtype), "transport": transport,
           "payload_gb": payload / 1e9, "seconds": seconds,
           "payload_gb_per_s": payload / seconds / 1e9, "first_update_s": sent["first_seconds"],
           "extra_device_mb": (receiver_extra + sent["extra_device_bytes"] * (transport == "cuda-ipc")) / 1e6,
           "weights_equal": ok}  # on the engine's GPU: an NCCL sender's buffer is on its own
    if transport == "nccl":
        link_rate = bucket_bytes / statistics.median(sent["broadcast_seconds"])
        return row | {"broadcast_gb_per_s": link_rate / 1e9, "of_broadcast_rate": payload / seconds / link_rate,
                      "bucket_mb": bucket_bytes / 1e6}
    return row | {"of_copy_payload_rate": payload / seconds / (copy_bw / 2),
                  "bucket_mb": max(bucket_bytes, SHARED_BUCKET_BYTES) / 1e6}  # shared buckets


def remote_sender(shapes_path: str, endpoint: str, reps: int, bucket_bytes: int, transport: str, port: int) -> None:
    """The trainer process of remote_row: times each send (pack, hand over, engine copies, acknowledgement)."""
    group = None
    if transport == "nccl":
        torch.cuda.set_device(1)
        group = init_weight_update_group("127.0.0.1", port, rank=0, world_size=2)
    trainer = trainer_tensors(json.loads(Path(shapes_path).read_text()), "cuda")
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    sender = WeightSender(endpoint, bucket_bytes=bucket_bytes, group=group)
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        sender.send(trainer.items())
        times.append(time.perf_counter() - t)
    extra = torch.cuda.max_memory_allocated() - base
    sender.close()
    result = {"first_seconds": times[0], "seconds": times[1:], "extra_device_bytes": extra}
    if group is not None:
        link, seconds = torch.empty(bucket_bytes, dtype=torch.uint8, device="cuda"), []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            t = time.perf_counter()
            group.broadcast(link)
            torch.cuda.synchronize()
            seconds.append(time.perf_counter() - t)
        group.close()
        result["broadcast_seconds"] = seconds[1:]
    print(json.dumps(result))


def versus_bf16(rows: list[dict]) -> None:
    """Each row's seconds over the unquantized engine's row of the same model and transport (the first such)."""
    plain = {}
    for r in rows:
        plain.setdefault((r["model"], r["transport"]), r["seconds"])
        r["vs_bf16_seconds"] = r["seconds"] / plain[r["model"], r["transport"]]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--models", nargs="+", default=["qwen3-1.7b", "llama-3.1-8b"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_BYTES >> 20)
    parser.add_argument("--host", action="store_true", help="only the host time per tensor (CPU, or CUDA if present)")
    parser.add_argument("--quantization", nargs="*", default=[], choices=QUANTIZATIONS,
                        help="also sync into engines with these weight formats (bf16 in), after the unquantized one")
    parser.add_argument("--no-check-finite", action="store_true",
                        help="engines with check_finite=False: the copy alone, without the NaN/inf check")
    parser.add_argument("--quick", action="store_true", help="in process, tiny shapes on the CPU: a smoke test")
    parser.add_argument("--sender", nargs=6, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sender:
        shapes, endpoint, reps, bucket_bytes, transport, port = args.sender
        return remote_sender(shapes, endpoint, int(reps), int(bucket_bytes), transport, int(port))
    host = [host_row("cuda" if torch.cuda.is_available() else "cpu", reps=50)]
    print_table(host, f"update_weights host time per tensor, {machine()}")
    if args.host:
        return
    out = result_name("weight_sync", args, parser)
    device = "cpu" if args.quick else "cuda"
    if args.quick:
        args.models, args.reps = ["tiny-qwen3", "tiny-llama"], 2
    copy_bw = copy_bandwidth(device=device)
    root = Path(tempfile.mkdtemp())
    rows = []
    transports = [] if args.quick else ["cuda-ipc"] + ["nccl"] * (torch.cuda.device_count() > 1)
    for name in args.models:
        for quantization in weight_formats(args.quantization):
            engine = Engine(shaped_checkpoint(name, root), device=device, dtype="bfloat16", load_format="dummy",
                            kv_cache_memory=1 << 30, max_num_seqs=8, max_model_len=1024, quantization=quantization,
                            check_finite=not args.no_check_finite)
            rows.append(in_process_row(name, engine, copy_bw, args.reps))
            empty_cache()
            for transport in transports:
                rows.append(remote_row(name, engine, copy_bw, args.reps, args.bucket_mb << 20, transport))
                empty_cache()
            del engine
            empty_cache()
            versus_bf16(rows)
            save(out, rows, {"copy_bandwidth_bytes_per_s": copy_bw, "host": host,  # a run cut short keeps these
                             "check_finite": not args.no_check_finite})
    print_table(rows, f"weight sync (device copy {copy_bw / 1e12:.2f} TB/s read+write = "
                      f"{copy_bw / 2e9:.0f} GB/s payload), {machine()}")
    plot_bars(out, [f"{r['model']} {r['weights']} {r['transport']}" for r in rows],
              {"payload GB/s": [r["payload_gb_per_s"] for r in rows]}, "GB/s")


if __name__ == "__main__":
    sys.exit(main())
