"""Decode under CUDA graphs: one graph per batch-size bucket, replayed over static input buffers.

A decode step's shapes depend only on the batch size, so each bucket is captured once
(largest first, sharing one memory pool) and later steps copy their inputs into the static
buffers and replay. Padding rows own no query (query_start_loc stops growing) and write
no KV (slot -1). The graphs hold the addresses of the weights and of the KV pool: when
those move (a wake without torch_memory_saver, a resized pool) they are captured again.
"""
from __future__ import annotations

import torch

from .model import AttentionMetadata, CausalLM


def buckets(max_num_seqs: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_num_seqs + 1, 16))
    return sorted({s for s in sizes if s <= max_num_seqs} | {max_num_seqs})


class DecodeGraphs:
    def __init__(self, model: CausalLM, max_num_seqs: int, max_blocks: int, device: torch.device):
        self.model, self.device = model, device
        self.sizes = buckets(max_num_seqs)
        n = self.sizes[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = None

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(self.slot_mapping[:size], self.block_tables[:size], self.seq_lens[:size],
                                 self.query_start_loc[: size + 1], max_query_len=1)
        return self.model.logits(self.model(self.input_ids[:size], self.positions[:size], meta))

    @torch.inference_mode()
    def capture(self) -> None:
        self.graphs.clear()
        self.logits.clear()
        self.seq_lens.fill_(1)  # capture on valid (if meaningless) rows
        self.query_start_loc.copy_(torch.arange(len(self.query_start_loc), device=self.device))
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles and autotunes outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.logits[size] = self._forward(size)
            self.pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)

    def fits(self, num_seqs: int, width: int) -> bool:
        return num_seqs <= self.sizes[-1] and width <= self.block_tables.shape[1]

    def run(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        """Logits [num_seqs, vocab] of one decode token per sequence."""
        real = input_ids.shape[0]
        size = next(s for s in self.sizes if s >= real)
        self.input_ids[:real] = input_ids
        self.positions[:real] = positions
        self.slot_mapping[:size].fill_(-1)
        self.slot_mapping[:real] = meta.slot_mapping
        width = meta.block_tables.shape[1]
        self.block_tables[:real, :width] = meta.block_tables
        self.seq_lens[:size].fill_(1)
        self.seq_lens[:real] = meta.seq_lens
        self.query_start_loc[: real + 1] = meta.query_start_loc
        self.query_start_loc[real + 1 : size + 1] = real  # padding rows own no query
        self.graphs[size].replay()
        return self.logits[size][:real]
