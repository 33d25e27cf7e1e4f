"""Benchmark-only operations (decode_roofline.py), run on every rank of a tensor-parallel group together
(TPDriver.fill_kv_random / time_collectives start them on the workers); fill_kv_random also serves one device."""
from __future__ import annotations

import time

import torch

from ..capture_fence import CAPTURES
from .group import TPGroup, dtype_named


def gather_number(group: TPGroup, value: float) -> list[float]:
    """Every rank's `value`, in rank order."""
    return group.gather(torch.tensor([value], dtype=torch.float64, device=group.device)).view(-1).tolist()


def gathered_value(run) -> tuple[float, Exception | None]:
    """(run(), None), or (-1, its error): a rank whose part raised still joins the gather the others wait in."""
    try:
        return run(), None
    except Exception as err:
        return -1.0, err


def fill_kv_random(kv) -> float:
    """Every value of `kv`'s pools to standard normal noise, so a benchmark's attention over contexts it never
    computed reads finite values; returns the mean square written (about 1)."""
    total, count = 0.0, 0
    for pool in kv.planner.pools.values():
        for row in range(pool.layers):
            for view in pool.kv_views(row):
                squares = torch.zeros((), dtype=torch.float64, device=view.device)
                for part in view.split(max(1, (1 << 24) // view[0].numel())):  # fp8 has no normal_: drawn in fp32
                    noise = torch.randn(part.shape, device=part.device)
                    part.copy_(noise)
                    squares += noise.square().sum(dtype=torch.float64)
                total += squares.item()
                count += view.numel()
    return total / count


def time_collectives(group: TPGroup, rows: int, hidden: int, layers: int, vocab_part: int, dtype: str,
                     reps: int = 20, inner: int = 5) -> float:
    """Median seconds of a decode step's collectives alone: 2 all-reduces of [rows, hidden] per layer (after
    o_proj and down_proj) and the all-gather of [rows, vocab_part] logits, in `dtype`; on CUDA replayed from a
    CUDA graph as the decode step runs them. Each timing covers `inner` steps after a barrier, so the ranks'
    start skew is a small part of it. Every rank calls it together."""
    zeros = dict(dtype=dtype_named(dtype), device=group.device)  # zeros: the sums stay finite however often repeated
    hidden_states, logits = torch.zeros(rows, hidden, **zeros), torch.zeros(rows, vocab_part, **zeros)

    def step():
        for _ in range(2 * layers):
            group.all_reduce(hidden_states)
        group.gather(logits)

    def sync():
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)

    step()  # warm-up, and on NCCL the communicator's start, outside any capture
    if group.device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with CAPTURES.capturing(graph=True), torch.cuda.graph(graph):
            step()
        step = graph.replay
    times, barrier = [], torch.zeros(1, **zeros)
    for _ in range(reps):
        group.all_reduce(barrier)
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            step()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return sorted(times)[reps // 2]
