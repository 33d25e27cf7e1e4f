"""CUDA graphs per batch-size bucket: one captured step per bucket, replayed over static buffers.

A step whose shapes depend only on the number of sequences (decode: one token each; a
speculative verify: k+1 each) is captured once per bucket, largest first, all buckets sharing
one memory pool. `step(size)` reads only the StepBuffers' device views, so a replay needs the
inputs uploaded and nothing else. The graphs hold the addresses of the weights and of the KV
pool: when those move (a wake without torch_memory_saver, a resized pool) they are captured again.
"""
from __future__ import annotations

import gc
from typing import Callable

import torch

from .capture_fence import CAPTURES


def buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class StepGraphs:
    def __init__(self, step: Callable[[int], torch.Tensor], max_num_seqs: int, pool=None, smallest: int = 1):
        self.step, self.sizes = step, [s for s in buckets(max_num_seqs) if s >= smallest]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool  # shared with other graph sets, so their workspaces overlap

    def bucket(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs, or None."""
        return next((s for s in self.sizes if s >= num_seqs), None)

    @torch.inference_mode()
    def capture(self) -> None:
        # The old graphs live until the new ones hold the pool: torch refuses to capture into a pool whose
        # graphs are all gone (an internal assert), and a recapture keeps the pool the other sets share.
        old = list(self.graphs.values())
        self.graphs.clear()
        self.outputs.clear()
        # A dropped engine's memory pools must not be freed while a capture is underway (torch asserts,
        # then aborts): collect what is garbage now, let no collection run until the captures end, and hold
        # back the pools an engine dropped meanwhile lets go of (CAPTURES: the last reference may go on
        # another thread).
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with CAPTURES.capturing(graph=True):
                for size in reversed(self.sizes):
                    self.step(size)  # warm-up: Triton compiles and autotunes outside the capture
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.outputs[size] = self.step(size)
                    self.pool = graph.pool()
                    self.graphs[size] = graph
        finally:
            del old
            if collecting:
                gc.enable()
        torch.cuda.synchronize()

    def run(self, size: int) -> torch.Tensor:
        self.graphs[size].replay()
        return self.outputs[size]
