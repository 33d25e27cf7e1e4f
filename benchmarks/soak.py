"""Soak: many cycles of generate -> sleep -> update -> wake, with faults injected, on one engine.

Each cycle generates greedily from fixed prompts and compares every output with the reference for the
weights it was served with (three weight sets, each a perturbation of a tiny checkpoint's, cycled;
references come from a second engine that loads each set once). Then the engine sleeps (levels 1 and 2
alternate), wakes its weights, receives the next set through the weight transport (WeightSender on a
thread -> WeightReceiver; shared memory from host tensors), and wakes its KV pool. Faults:
- every `--fail-every`-th cycle the sender's iterator raises part way: the update is aborted, the engine
  must refuse to generate (its weights are mixed), and a complete update follows;
- every `--malformed-every`-th cycle a raw ZeroMQ peer sends a malformed message first: it must get an
  error reply and leave the receiver usable.
Printed: device-memory and RSS growth after the first 100 cycles, files left in /dev/shm and in the ipc
directory, wrong outputs, refusals that did not happen. JSON + PNG (memory against cycle).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, result_name, save  # noqa: E402

from rollout_engine import Engine, SamplingParams, WeightsNotReadyError  # noqa: E402
from rollout_engine.tiny_model import make_tiny_model  # noqa: E402
from rollout_engine.transport import WeightReceiver, WeightSender  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [9, 9, 101, 7, 64, 3], [200, 1]]


class InjectedFault(RuntimeError):
    """The sender's source failing part way (a trainer crash mid-update)."""


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def device_mb(device: torch.device) -> float:
    """Device memory in use as the driver sees it (what another process could not have)."""
    if device.type != "cuda":
        return 0.0
    torch.cuda.synchronize(device)
    free, total = torch.cuda.mem_get_info(device)
    return (total - free) / 2**20


def allocated_mb(device: torch.device) -> float:
    """Tensor bytes the caching allocator has handed out: a leak smaller than its cached slack shows here, not
    in device_mb."""
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("psm_*")} if Path("/dev/shm").is_dir() else set()


def weight_sets(path: Path, count: int) -> list[dict[str, torch.Tensor]]:
    """The checkpoint's tensors and `count - 1` perturbations of them, on the host."""
    from safetensors.torch import load_file

    base = {}
    for f in sorted(path.glob("*.safetensors")):
        base |= load_file(str(f))
    sets = [base]
    for k in range(1, count):
        g = torch.Generator().manual_seed(k)
        sets.append({n: t + 0.05 * torch.randn(t.shape, generator=g, dtype=torch.float32).to(t.dtype)
                     for n, t in base.items()})
    return sets


def tokens(engine: Engine) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def send(endpoint: str, named, fail: bool, result: dict) -> None:
    def source():
        for i, pair in enumerate(named):
            if fail and i == len(named) // 2:
                raise InjectedFault("the trainer failed part way")
            yield pair

    sender = WeightSender(endpoint, bucket_bytes=16 << 10)  # small buckets: many round trips
    try:
        result["version"] = sender.send(source())
    except BaseException as err:  # noqa: BLE001 - reported to the main thread
        result["error"] = err
    finally:
        sender.close()


def update(receiver: WeightReceiver, named: list, fail: bool) -> Exception | None:
    """One update through the transport; returns the receiver's error, if any."""
    result: dict = {}
    thread = threading.Thread(target=send, args=(receiver.endpoint, named, fail, result))
    thread.start()
    err = None
    try:
        receiver.receive(begin_timeout_s=30)
    except Exception as e:  # noqa: BLE001 - the caller checks what was expected
        err = e
    thread.join(60)
    if not fail and "error" in result:
        raise result["error"]
    return err


def malformed(receiver: WeightReceiver) -> bool:
    """A raw peer's garbage first message: True if it got an error reply and receive() raised ValueError."""
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(receiver.endpoint)
    sock.send(b"{oops")
    try:
        receiver.receive(begin_timeout_s=10)
        raised = False
    except ValueError:
        raised = True
    got_reply = sock.poll(5000) and not json.loads(sock.recv()).get("ok", True)
    sock.close()
    return raised and bool(got_reply)


def run(cycles: int, fail_every: int, malformed_every: int, device: str | None, root: Path) -> tuple[dict, list]:
    path = make_tiny_model(root / "tiny")
    kw = dict(device=device, kv_cache_memory=1 << 24, max_num_seqs=8)
    sets = weight_sets(path, 3)
    reference_engine = Engine(path, **kw)
    refs = []
    for named in sets:
        reference_engine.update_weights(named.items())
        refs.append(tokens(reference_engine))
    del reference_engine
    engine = Engine(path, **kw)
    engine.update_weights(sets[0].items())
    receiver = WeightReceiver(engine)
    ipc_dir = Path(receiver.endpoint[len("ipc://"):]).parent
    shm_before = shm_files()
    counts = {"wrong_outputs": 0, "missed_refusals": 0, "bad_malformed_replies": 0, "failed_updates": 0}
    trace = []
    current = 0
    start = time.perf_counter()
    for cycle in range(1, cycles + 1):
        if tokens(engine) != refs[current]:
            counts["wrong_outputs"] += 1
        engine.sleep(level=1 if cycle % 2 else 2)
        engine.wake(tags=["weights"])
        if cycle % malformed_every == 0 and not malformed(receiver):
            counts["bad_malformed_replies"] += 1
        nxt = (current + 1) % len(sets)
        named = list(sets[nxt].items())
        if cycle % fail_every == 0:
            counts["failed_updates"] += 1
            if update(receiver, named, fail=True) is None:
                counts["missed_refusals"] += 1  # the receiver took an update whose source failed
        level2_pending = cycle % 2 == 0
        engine.wake(tags=["kv_cache"])
        if cycle % fail_every == 0 or level2_pending:
            try:  # mixed (aborted) or discarded (level 2) weights: generate must refuse
                engine.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
                counts["missed_refusals"] += 1
            except WeightsNotReadyError:
                pass
        update(receiver, named, fail=False)
        current = nxt
        if cycle == 1 or cycle % 10 == 0:
            trace.append({"cycle": cycle, "rss_mb": rss_mb(), "device_mb": device_mb(engine.device),
                          "allocated_mb": allocated_mb(engine.device), "seconds": time.perf_counter() - start})
    at_100 = next((t for t in trace if t["cycle"] >= min(100, cycles)), trace[0])
    receiver.close()
    leaked_shm = sorted(shm_files() - shm_before)
    leaked_ipc = sorted(p.name for p in ipc_dir.glob("*")) if ipc_dir.exists() else []
    summary = {"device": str(engine.device), "cycles": cycles, "seconds": trace[-1]["seconds"],
               "device_growth_mb": trace[-1]["device_mb"] - at_100["device_mb"],
               "allocated_growth_mb": trace[-1]["allocated_mb"] - at_100["allocated_mb"],
               "rss_growth_mb": trace[-1]["rss_mb"] - at_100["rss_mb"],
               "leaked_files": len(leaked_shm) + len(leaked_ipc)} | counts
    if leaked_shm or leaked_ipc:
        print("left behind:", leaked_shm, [str(ipc_dir / n) for n in leaked_ipc])
    return summary, trace


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=1000)
    parser.add_argument("--fail-every", type=int, default=10)
    parser.add_argument("--malformed-every", type=int, default=7)
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        summary, trace = run(args.cycles, args.fail_every, args.malformed_every, args.device, Path(tmp))
    name = result_name(f"soak_{summary['device'].split(':')[0]}", args, parser, skip=("device",))
    save(name, [summary], {"trace": trace})
    plot(name, trace)
    print_table([summary], f"soak: generate -> sleep -> update -> wake with faults, {machine()}")
    ok = (summary["wrong_outputs"] == summary["missed_refusals"] == summary["bad_malformed_replies"] == 0
          and summary["leaked_files"] == 0 and summary["device_growth_mb"] <= 0
          and summary["allocated_growth_mb"] <= 0 and summary["rss_growth_mb"] < 20)
    print("targets (0 MB device and allocated growth, < 20 MB RSS growth after cycle 100, 0 leaks, 0 wrong outputs):",
          "met" if ok else "NOT met")


def plot(name: str, trace: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
    fig, ax = plt.subplots(figsize=(7, 4))
    cycles = [t["cycle"] for t in trace]
    ax.plot(cycles, [t["rss_mb"] for t in trace], label="host RSS (MB)")
    if any(t["device_mb"] for t in trace):
        ax.plot(cycles, [t["device_mb"] for t in trace], label="device used (MB)")
    ax.set_xlabel("cycle")
    ax.set_ylabel("MB")
    ax.legend()
    ax.set_title("soak: memory against cycle")
    fig.tight_layout()
    fig.savefig(out_dir / f"{name}.png", dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
