"""The HTTP server's cost: N concurrent streaming clients through `rollout-engine serve` against the same work
through AsyncEngine in the process.

Random weights of the Qwen3-1.7B shape (load_format="dummy", no download). That checkpoint has no tokenizer
(a real one would need a download), so the HTTP clients send their prompts as token ids to /v1/completions
(`prompt` as a list of ints; `ignore_eos`, temperature 1) and count tokens by the `token_ids` extension; texts
are empty on both paths, so neither pays detokenization and the difference is the HTTP layer: FastAPI, the
SSE JSON chunks, the socket, uvicorn. The clients run in `--client-procs` processes of their own (httpx,
asyncio), so their parsing does not share the server's CPU time.

Both paths: the same prompts (random ids, `--prompt-len`), every sample exactly `--max-tokens` tokens, all N
requests submitted at once, after a warm-up round. Measured per request: time to first token (submission to
the first token seen) and inter-token latency (the gap between two arrivals divided by the tokens the later
one brought: a coalesced chunk of k tokens counts k gaps of 1/k), and overall tokens/s (all tokens over the
wall time from the first submission to the last token). Target: HTTP tokens/s >= 0.9x in-process.

The server runs in two processes: the HTTP front (FastAPI, uvicorn, detokenization, the SSE chunks) and the
engine process (the Engine, stepped in a plain loop), which sends one ZeroMQ message per engine step with every
stream's new tokens. The front's CPU time no longer holds the engine's steps back (they share no interpreter
lock), so the HTTP path should match the in-process one unless the front falls so far behind that the last
token leaves late. One HTTP run per `--stream-intervals-ms` value (the server's --stream-interval-ms: at most one
chunk per stream per interval; 0 = a chunk per engine step). The HTTP rows also give tokens per chunk and each
process's CPU seconds over the measured round (front_cpu_s, engine_cpu_s): a front near wall_s is saturated.
`--switch-interval-ms` is set on both paths (in process, and in both server processes).

  python benchmarks/server.py             # H200: qwen3-1.7b shape, 256 clients
  python benchmarks/server.py --quick     # CPU smoke test, tiny shape, one torch thread per process, < 1 min
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (QUICK_SHAPES, SHAPES, free_port, machine, plot_bars, print_table, result_name,  # noqa: E402
                    save, shaped_checkpoint, wait_for_health)

ROOT = Path(__file__).resolve().parents[1]


class Record:
    """One request's timeline: submission, token arrival times and counts."""

    def __init__(self, start: float):
        self.start, self.arrivals = start, []  # [(time, new tokens)]

    def add(self, t: float, count: int) -> None:
        if count > 0:
            self.arrivals.append((t, count))

    def as_tuple(self):
        return self.start, self.arrivals


def summarise(path: str, records: list, clients: int, max_tokens: int) -> dict:
    starts = [s for s, _ in records]
    ends = [a[-1][0] for _, a in records if a]
    tokens = sum(c for _, a in records for _, c in a)
    ttft = [a[0][0] - s for s, a in records if a]
    itl = []
    for _, arrivals in records:
        for (t0, _), (t1, count) in zip(arrivals, arrivals[1:]):
            itl += [(t1 - t0) / count] * count
    wall = max(ends) - min(starts)
    q = lambda xs, p: float(np.percentile(xs, p) * 1e3) if xs else None  # noqa: E731
    return {"path": path, "clients": clients, "tokens": tokens, "complete": tokens == clients * max_tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall, "ttft_p50_ms": q(ttft, 50), "ttft_p99_ms": q(ttft, 99),
            "itl_p50_ms": q(itl, 50), "itl_p99_ms": q(itl, 99)}


# ---------------------------------------------------------------------------------------------- in process

async def _in_process_round(engine, prompts, max_tokens):
    from rollout_engine import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=1.0, ignore_eos=True)

    async def one(ids):
        record, seen = Record(time.perf_counter()), 0
        async for out in engine.stream(ids, params):
            n = len(out.outputs[0].token_ids)
            record.add(time.perf_counter(), n - seen)
            seen = n
        return record.as_tuple()

    return await asyncio.gather(*(one(ids) for ids in prompts))


def in_process(ckpt, engine_kwargs, prompts, args) -> dict:
    from rollout_engine import AsyncEngine

    engine = AsyncEngine(ckpt, **engine_kwargs)
    previous = sys.getswitchinterval()
    sys.setswitchinterval(args.switch_interval_ms / 1e3)  # the server's setting: the same footing for both paths
    try:
        asyncio.run(_in_process_round(engine, prompts, args.warmup_tokens))
        records = asyncio.run(_in_process_round(engine, prompts, args.max_tokens))
    finally:
        sys.setswitchinterval(previous)
        engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return summarise("in-process AsyncEngine", records, len(prompts), args.max_tokens)


# ---------------------------------------------------------------------------------------------- over HTTP

async def _http_round(url, prompts, max_tokens, start_at):
    import httpx

    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 1.0, "ignore_eos": True, "stream": True}

    async def one(http, ids):
        record = Record(time.time())
        async with http.stream("POST", f"{url}/v1/completions", json={**body, "prompt": ids}) as r:
            if r.status_code != 200:  # (an httpx error does not cross the process boundary: say it in words)
                raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    record.add(time.time(), sum(len(c["token_ids"]) for c in chunk["choices"]))
        return record.as_tuple()

    await asyncio.sleep(max(0.0, start_at - time.time()))
    limits = httpx.Limits(max_connections=len(prompts) + 8, max_keepalive_connections=len(prompts) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:
        return await asyncio.gather(*(one(http, ids) for ids in prompts))


def _client_process(url, prompts, max_tokens, start_at):
    return asyncio.run(_http_round(url, prompts, max_tokens, start_at))


def http_clients(url, prompts, max_tokens, procs) -> list:
    """All prompts at once, split across `procs` client processes that start together (wall clock)."""
    shares = [prompts[i::procs] for i in range(procs)]
    start_at = time.time() + 1.0 + 0.2 * procs
    with mp.get_context("spawn").Pool(procs) as pool:
        parts = pool.starmap(_client_process, [(url, share, max_tokens, start_at) for share in shares])
    return [r for part in parts for r in part]


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux): the server's engine process."""
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def over_http(ckpt, engine_kwargs, prompts, args, interval_ms: float) -> dict:
    port = free_port()
    flags = []
    for key, value in engine_kwargs.items():
        if value is not None and value is not False:
            flags += [f"--{key.replace('_', '-')}"] + ([] if value is True else [str(value)])
    cmd = [sys.executable, "-m", "rollout_engine.cli", "serve", str(ckpt), "--port", str(port),
           "--served-model-name", "bench", "--no-access-log", "--log-level", "warning",
           "--stream-interval-ms", str(interval_ms), "--switch-interval-ms", str(args.switch_interval_ms), *flags]
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(cmd, cwd=ROOT, env=os.environ.copy())
    try:
        wait_for_health(proc, url, args.server_start_s)
        http_clients(url, prompts, args.warmup_tokens, args.client_procs)
        pids = {"front": proc.pid, "engine": _children(proc.pid)[0]}
        before = {name: _cpu_seconds(pid) for name, pid in pids.items()}
        records = http_clients(url, prompts, args.max_tokens, args.client_procs)
        cpu = {name: _cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    row = summarise(f"HTTP, stream interval {interval_ms:g} ms", records, len(prompts), args.max_tokens)
    row["tokens_per_chunk"] = row["tokens"] / sum(len(a) for _, a in records)
    row["front_cpu_s"], row["engine_cpu_s"] = cpu["front"], cpu["engine"]
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3-1.7b", choices=list(SHAPES))
    parser.add_argument("--clients", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--warmup-tokens", type=int, default=16)
    parser.add_argument("--kv-cache-memory", type=float, default=0.5)
    parser.add_argument("--client-procs", type=int, default=4)
    parser.add_argument("--stream-intervals-ms", type=float, nargs="+", default=[0, 50],
                        help="one HTTP run per value of the server's --stream-interval-ms")
    parser.add_argument("--server-start-s", type=float, default=300)
    parser.add_argument("--switch-interval-ms", type=float, default=0.5,
                        help="sys.setswitchinterval for both paths (the server's --switch-interval-ms)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="CPU smoke test: tiny shape, 16 clients, 32 tokens")
    args = parser.parse_args()
    if args.quick:
        args.shape, args.device, args.clients, args.prompt_len, args.max_tokens = "tiny-qwen3", "cpu", 16, 16, 32
        args.warmup_tokens, args.kv_cache_memory, args.client_procs, args.server_start_s = 4, 64 << 20, 1, 90
        args.stream_intervals_ms = [0]
        # One torch thread in every process, on both paths: on a small shared CPU, OpenMP threads that outnumber
        # the free cores wait at their barriers for descheduled peers (a step ~50x slower), whichever path it is.
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
    kv = args.kv_cache_memory if args.kv_cache_memory < 1 else int(args.kv_cache_memory)
    ckpt = shaped_checkpoint(args.shape, Path(tempfile.mkdtemp()))
    vocab = (QUICK_SHAPES | SHAPES)[args.shape]["vocab_size"]
    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(1, vocab - 1, args.prompt_len).tolist() for _ in range(args.clients)]
    engine_kwargs = dict(load_format="dummy", device=args.device, kv_cache_memory=kv, max_num_seqs=args.clients,
                         max_model_len=args.prompt_len + args.max_tokens + 16, seed=args.seed)

    rows = [in_process(ckpt, engine_kwargs, prompts, args)]
    rows += [over_http(ckpt, engine_kwargs, prompts, args, ms) for ms in args.stream_intervals_ms]
    for row in rows:
        row["ratio_vs_in_process"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
    name = result_name("server", args, parser)
    save(name, rows, {"args": vars(args) | {"kv_cache_memory": kv}})
    metrics = ["tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    plot_bars(name, ["k tokens/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
              {r["path"]: [r[m] / (1e3 if m == "tokens_per_s" else 1) for m in metrics] for r in rows},
              "k tokens/s | ms")
    print_table(rows, f"{args.clients} concurrent streams, {args.shape} (random weights), prompt {args.prompt_len} "
                      f"+ {args.max_tokens} tokens each, {machine()}; target HTTP >= 0.9x in-process tokens/s")


if __name__ == "__main__":
    main()
