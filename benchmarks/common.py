"""What every benchmark shares: timing on CUDA, the results folder, a table, a plot."""
from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import sys
import time
import uuid
from datetime import date
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
HISTORY = "history"  # under RESULTS (or $OUT): one .jsonl per benchmark name, a line per run

# Public configs of the models the GPU benchmarks are shaped like (random weights, no download).
SHAPES = {
    "qwen3-1.7b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
                       intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, torch_dtype="bfloat16", eos_token_id=151645),
    "llama-3.1-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=128001,
                         rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
}

# Tiny configs of the same two architectures, for the --quick CPU smoke tests of the benchmarks.
QUICK_SHAPES = {
    "tiny-qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, torch_dtype="bfloat16", eos_token_id=0),
    "tiny-llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
                       intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                       tie_word_embeddings=False, torch_dtype="bfloat16", eos_token_id=0),
}


def shaped_checkpoint(name: str, root: Path) -> Path:
    """A config-only checkpoint directory for Engine(..., load_format="dummy") (SHAPES or QUICK_SHAPES)."""
    path = root / name
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(SHAPES[name] if name in SHAPES else QUICK_SHAPES[name]))
    return path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_health(proc, url: str, timeout_s: float, headers: dict | None = None, log: Path | None = None) -> None:
    """Return once the server `proc` started answers GET {url}/health with 200; RuntimeError if it exits first
    (with the tail of its `log`, if given) or has not answered within `timeout_s`."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = f": {Path(log).read_text()[-2000:]}" if log is not None else ""
            raise RuntimeError(f"the server exited with {proc.returncode}{tail}")
        try:
            if httpx.get(f"{url}/health", headers=headers, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the server did not answer /health within {timeout_s:g} s")
        time.sleep(0.25)


def machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name()
    return f"{platform.processor() or platform.machine()} CPU x{os.cpu_count()}"


def cuda_time(fn, warmup: int = 3, reps: int = 10) -> float:
    """Median seconds of fn() by CUDA events, after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def wall_time(fn, warmup: int = 1, reps: int = 3) -> float:
    """Median wall seconds of fn() (synchronising CUDA), after warm-up."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 4 << 30, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth, bytes read + written per second (the HBM reference; on the CPU,
    of RAM, with a smaller copy)."""
    if device == "cpu":
        src = torch.empty(min(nbytes, 256 << 20) // 2, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        return 2 * src.numel() / wall_time(lambda: dst.copy_(src))
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    seconds = cuda_time(lambda: dst.copy_(src), warmup=3, reps=20)
    return 2 * src.numel() / seconds


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


# --quantization of the benchmarks that compare weight formats: the unquantized engine always runs first, then
# each of these (Engine's quantization values), so one run reports the rows side by side.
QUANTIZATIONS = ("fp8", "fp8_lm_head")


def weight_formats(extra) -> list[str | None]:
    """None (the engine's dtype) and then each --quantization value given."""
    return [None] + [q for q in extra if q is not None]


def format_label(quantization: str | None, dtype: torch.dtype) -> str:
    return quantization or str(dtype).removeprefix("torch.")


def print_table(rows: list[dict], title: str) -> None:
    cols = list(dict.fromkeys(c for r in rows for c in r))  # every row's columns, in order of appearance
    fmt = lambda v: f"{v:.4g}" if isinstance(v, float) else "" if v is None else str(v)
    widths = [max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in cols]
    print(f"\n{title}")
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(w) for c, w in zip(cols, widths)))


def result_name(base: str, args, parser, skip=("quick",)) -> str:
    """`base` plus every argument that differs from the parser's default (a flag by its name, a value after a
    "-", list items joined by "."), so runs of one script with other arguments write files of their own instead
    of overwriting the default run's; `--quick` runs end in "_quick". Letters, digits, '.', '_' and '-' only:
    the device runner returns no file named otherwise."""
    parts = [base]
    for name, value in vars(args).items():
        if name in skip or value == parser.get_default(name):
            continue
        tag = name.replace("_", "-")
        if value is True:
            parts.append(tag)
        else:
            parts.append(f"{tag}-{'.'.join(map(str, value)) if isinstance(value, (list, tuple)) else value}")
    return "_".join(parts) + ("_quick" if getattr(args, "quick", False) else "")


def save(name: str, rows: list[dict], meta: dict | None = None, out_dir: Path | None = None) -> Path:
    """Write rows (+ machine, date, UTC time, arguments and a run id) as JSON under benchmarks/results/ or $OUT, and
    append the same record as one line to history/<name>.jsonl there: a later run with the same arguments replaces
    <name>.json, and its history keeps every run a document may cite (by its "time" or "run")."""
    out_dir = Path(out_dir or os.environ.get("OUT") or RESULTS)
    (out_dir / HISTORY).mkdir(parents=True, exist_ok=True)
    record = {"benchmark": name, "date": str(date.today()), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "run": uuid.uuid4().hex[:12], "argv": sys.argv[1:], "machine": machine(), **(meta or {}), "rows": rows}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(record, indent=1))
    with open(out_dir / HISTORY / f"{name}.jsonl", "a") as history:
        history.write(json.dumps(record) + "\n")
    return path


def plot_bars(name: str, labels: list[str], series: dict[str, list[float]], ylabel: str,
              out_dir: Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir or os.environ.get("OUT") or RESULTS)
    fig, ax = plt.subplots(figsize=(max(6, len(labels) * 0.9), 4))
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        ax.bar([x + i * width for x in range(len(labels))], values, width, label=label)
    ax.set_xticks([x + width * (len(series) - 1) / 2 for x in range(len(labels))], labels, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(f"{name} ({machine()}, {date.today()})")
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
