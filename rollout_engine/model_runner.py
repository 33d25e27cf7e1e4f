"""ModelRunner: turns a scheduled Batch into tensors, runs the forward pass, samples the next tokens."""
from __future__ import annotations

import torch

from .cuda_graphs import DecodeGraphs
from .model import AttentionMetadata, CausalLM
from .scheduler import Batch


class ModelRunner:
    def __init__(self, model: CausalLM, ops, block_size: int, device: torch.device,
                 graphs: DecodeGraphs | None = None):
        self.model, self.ops, self.block_size, self.device = model, ops, block_size, device
        self.graphs = graphs

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype, device=self.device)

    def prepare(self, batch: Batch):
        bs = self.block_size
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        logit_rows, sample_rows = [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            begin, end = seq.num_computed, seq.num_computed + n
            input_ids += seq.token_ids[begin:end]
            positions += range(begin, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + n)
            if end == len(seq):  # the last token is computed: draw the next one for it and its siblings
                logit_rows += [starts[-1] - 1] * seq.num_samples
                sample_rows.append(i)
        width = max(len(seq.block_table) for seq in batch.seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in batch.seqs]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(starts, torch.int32),
            max_query_len=max(batch.num_tokens),
        )
        return (self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta,
                logit_rows, sample_rows)

    def sampling_tensors(self, batch: Batch, sample_rows: list[int]):
        temperature, top_k, top_p, min_p, seeds, positions, raw_mode = [], [], [], [], [], [], []
        for i in sample_rows:
            seq = batch.seqs[i]
            p = seq.params
            for seed in (seq.seed, *seq.sibling_seeds):
                temperature.append(p.temperature)
                top_k.append(p.top_k)
                top_p.append(p.top_p)
                min_p.append(p.min_p)
                seeds.append(seed)
                positions.append(len(seq))
                raw_mode.append(p.logprobs_mode == "raw")
        t = self._tensor
        return (t(temperature, torch.float32), t(top_k, torch.int32), t(top_p, torch.float32),
                t(min_p, torch.float32), t(seeds, torch.int64), t(positions, torch.int64),
                t(raw_mode, torch.bool))

    @torch.inference_mode()
    def step(self, batch: Batch) -> dict[int, list[tuple[int, float]]]:
        """Run one forward pass; returns {batch index: [(token, logprob), ...]} for sequences that sample."""
        input_ids, positions, meta, logit_rows, sample_rows = self.prepare(batch)
        rows = self._tensor(logit_rows, torch.int64)
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.fits(*meta.block_tables.shape):
            logits = self.graphs.run(input_ids, positions, meta)[rows]
        else:
            hidden = self.model(input_ids, positions, meta)
            if not sample_rows:
                return {}
            logits = self.model.logits(hidden[rows])
        temperature, top_k, top_p, min_p, seeds, pos, raw_mode = self.sampling_tensors(batch, sample_rows)
        tokens, processed, raw = self.ops.sample(logits, temperature, top_k, top_p, min_p, seeds, pos)
        logprobs = torch.where(raw_mode, raw, processed)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()  # the step's one host synchronisation
        out, row = {}, 0
        for i in sample_rows:
            k = batch.seqs[i].num_samples
            out[i] = list(zip(tokens[row : row + k], logprobs[row : row + k]))
            row += k
        return out
