"""Where a speculative step's time goes: each CUDA-graph replay of a generate() (draft passes, verify
pass, plain decode step), its kernels by kind (GEMM, attention, the rest) and the idle time between
them, from a torch.profiler trace. Same models as spec_decode.py (8B target, 1.7B-shaped draft, aligned
so every proposal is accepted), batch 1 by default."""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cuda_time, machine, print_table, result_name, save  # noqa: E402
from spec_decode import align, checkpoints, tokens_per_s  # noqa: E402

from rollout_engine import Engine, SamplingParams  # noqa: E402

GEMM_NAMES = ("gemm", "gemv", "cutlass", "nvjet", "xmma", "splitk")


def kind(event: dict) -> str:
    name, low = event["name"], event["name"].lower()
    if event["cat"] != "kernel":
        return "copy"  # memcpy / memset nodes of the graph
    if any(s in low for s in GEMM_NAMES):
        return "gemm"
    return "attention" if name in ("_attention_kernel", "_merge_kernel") else "other"


def replays(trace: dict) -> list[list[dict]]:
    """The kernels, copies and memsets of each cudaGraphLaunch, in launch order (matched by correlation id)."""
    launches = sorted((e for e in trace["traceEvents"] if e.get("name") == "cudaGraphLaunch"), key=lambda e: e["ts"])
    kernels = defaultdict(list)
    for e in trace["traceEvents"]:
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            kernels[e["args"]["correlation"]].append(e)
    return [sorted(kernels[e["args"]["correlation"]], key=lambda k: k["ts"]) for e in launches
            if kernels[e["args"]["correlation"]]]


def composition(groups: list[list[dict]], label_of) -> None:
    """Per replay kind: each kernel name's launches per replay and median microseconds per replay."""
    per_name = defaultdict(lambda: defaultdict(list))
    for ks in groups:
        totals = defaultdict(lambda: [0, 0.0])
        for k in ks:
            totals[k["name"][:60]][0] += 1
            totals[k["name"][:60]][1] += k["dur"]
        for name, total in totals.items():
            per_name[label_of(len(ks))][name].append(total)
    for label, names in per_name.items():
        print(f"\n{label}: launches and median us per replay")
        for name, totals in sorted(names.items(), key=lambda kv: -statistics.median(t[1] for t in kv[1])):
            print(f"  {statistics.median(t[1] for t in totals):8.1f} us  {totals[0][0]:4d}x  {name}")


def gaps(groups: list[list[dict]], label_of) -> None:
    """Per replay kind: the idle time before each kernel name (median per replay), largest first."""
    per_name = defaultdict(lambda: defaultdict(list))
    for ks in groups:
        idle = defaultdict(float)
        for before, after in zip(ks, ks[1:]):
            idle[f"{before['name'][:40]} -> {after['name'][:40]}"] += after["ts"] - before["ts"] - before["dur"]
        for name, total in idle.items():
            per_name[label_of(len(ks))][name].append(total)
    for label, names in per_name.items():
        print(f"\n{label}: idle before a kernel, median us per replay")
        for name, totals in sorted(names.items(), key=lambda kv: -statistics.median(kv[1]))[:12]:
            print(f"  {statistics.median(totals):8.1f} us  {name}")


def summarize(groups: list[list[dict]], label_of) -> list[dict]:
    """Median per replay kind: span (first kernel start to last end), busy (sum of kernel times), by kind."""
    by_label = defaultdict(list)
    for ks in groups:
        span = ks[-1]["ts"] + ks[-1]["dur"] - ks[0]["ts"]
        busy = defaultdict(float)
        for k in ks:
            busy[kind(k)] += k["dur"]
        by_label[label_of(len(ks))].append({"kernels": len(ks), "span_us": span, "busy_us": sum(busy.values()),
                                            **{f"{c}_us": busy[c] for c in ("gemm", "attention", "other", "copy")}})
    rows = []
    for label, items in by_label.items():
        row = {"replay": label, "count": len(items)}
        for key in items[0]:
            row[key] = statistics.median(i[key] for i in items)
        row["idle_us"] = row["span_us"] - row["busy_us"]
        rows.append(row)
    return rows


def bounds(rows: list[dict], k: int, target_layers: int, draft_layers: int, goal: float = 1.8) -> dict:
    """The speed-up of a fully accepted step, (k+1) plain steps / (k draft passes + 1 verify), from the
    replays' spans, and its ceilings: with only the cuBLAS GEMMs left (every other kernel and gap free), and
    with the GEMMs plus attention. `layer_budget_us`: the non-GEMM time per layer, the same in both
    models, at which the speed-up is `goal` (its ceiling falls as that cost grows)."""
    def replay(label: str) -> dict:
        row = next(r for r in rows if r["replay"].startswith(label))  # "draft (343)": its kernel count
        return {key: row[f"{key}_us"] for key in ("span", "gemm", "attention")}

    plain, draft, verify = replay("decode"), replay("draft"), replay("verify")

    def speedup(key_sum):
        return (k + 1) * key_sum(plain) / (k * key_sum(draft) + key_sum(verify))

    gemm = (k + 1) * plain["gemm"] - goal * (k * draft["gemm"] + verify["gemm"])
    per_layer = goal * (k * draft_layers + target_layers) - (k + 1) * target_layers
    return {"k": k, "from_spans": speedup(lambda r: r["span"]), "gemm_only": speedup(lambda r: r["gemm"]),
            "gemm_and_attention": speedup(lambda r: r["gemm"] + r["attention"]),
            "layer_budget_us": gemm / per_layer,
            "plain_layer_non_gemm_us": (plain["span"] - plain["gemm"]) / target_layers,
            "draft_layer_non_gemm_us": (draft["span"] - draft["gemm"]) / draft_layers}


def profile(engine, batch: int, tokens: int, name: str) -> dict:
    prompts = [list(range(100 + 64 * i, 164 + 64 * i)) for i in range(batch)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    engine.generate(prompts, params, use_tqdm=False)
    engine.flush_cache()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    path = Path(tempfile.mkdtemp()) / f"trace_{name}.json"  # tens of MB: not kept
    prof.export_chrome_trace(str(path))
    return json.loads(path.read_text())


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--k", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=61)
    parser.add_argument("--draft-quantization", choices=["fp8"], default=None,
                        help="the draft's weight format (Engine(draft_quantization=...)); default: the target's")
    args = parser.parse_args()
    target, draft = checkpoints(Path(tempfile.mkdtemp()), "llama-3.1-8b", "qwen3-1.7b")
    common = dict(device="cuda", load_format="dummy", max_num_seqs=max(4, args.batch), kv_cache_memory=0.2,
                  max_model_len=512)
    rows, layers = [], {}
    for name, draft_path, k in (("plain", None, 0), (f"spec_k{args.k}", draft, args.k)):
        quantized = {"draft_quantization": args.draft_quantization} if draft_path and args.draft_quantization else {}
        engine = Engine(target, draft_model=draft_path, num_speculative_tokens=k, **common, **quantized)
        align(engine)
        layers[name] = engine.model.cfg.num_layers
        if draft_path is not None:
            align(engine, model="draft")
            layers["draft"] = engine.models["draft"].cfg.num_layers
        rate = tokens_per_s(engine, args.batch, 64, 210)
        groups = replays(profile(engine, args.batch, args.tokens, name))
        largest = max(len(g) for g in groups)
        # a step replays the draft's graph k times and the verify graph once; the verify has the larger graph
        label = (lambda n: "decode") if k == 0 else (lambda n: "verify" if n == largest else f"draft ({n})")
        composition(groups, label)
        gaps(groups, label)
        # each graph replayed alone, back to back (state advances; the pool has no other sequences)
        graphs = {"decode": engine.runner.graphs} if k == 0 else {"verify": engine.speculator.graphs,
                                                                 "draft": engine.speculator.proposer.graphs}
        alone = {replay: cuda_time(g.graphs[1].replay, reps=20) * 1e6 for replay, g in graphs.items()}
        for row in summarize(groups, label):
            rows.append({"engine": name, "tok_per_s": rate, **row,
                         "alone_us": alone[row["replay"].split(" ")[0]]})
        del engine
        gc.collect()
        torch.cuda.empty_cache()
    print_table(rows, f"graph replays at batch {args.batch} (median us; idle = span - busy), {machine()}")
    ceiling = bounds(rows, args.k, layers["plain"], layers["draft"])
    print_table([ceiling], f"speed-up of a fully accepted step and its ceilings (k={args.k}, batch {args.batch})")
    save(result_name("profile_spec", args, parser), rows + [ceiling], vars(args))


if __name__ == "__main__":
    main()
