"""ModelRunner: turns a scheduled Batch into tensors, runs the forward pass, samples the next tokens.

With a draft model it also keeps the draft's KV in step (every forward of the target runs the
draft over the same positions) and runs speculative steps: the draft proposes k tokens, the
target scores all k+1 positions in one pass of the same paged-attention kernel, and exact
rejection sampling decides what is emitted (spec_decode.py).
"""
from __future__ import annotations

import torch

from .cuda_graphs import DecodeGraphs
from .model import AttentionMetadata, CausalLM
from .scheduler import Batch


class ModelRunner:
    def __init__(self, model: CausalLM, ops, block_size: int, device: torch.device,
                 graphs: DecodeGraphs | None = None, draft: CausalLM | None = None):
        self.model, self.ops, self.block_size, self.device = model, ops, block_size, device
        self.graphs, self.draft = graphs, draft

    def _tensor(self, data, dtype):
        return torch.tensor(data, dtype=dtype, device=self.device)

    def metadata(self, seqs, begins, tokens):
        """Inputs for `tokens[i]` placed at positions begins[i].. of seqs[i] (their KV goes to those slots)."""
        bs = self.block_size
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, begin, toks in zip(seqs, begins, tokens):
            end = begin + len(toks)
            input_ids += toks
            positions += range(begin, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + len(toks))
        width = max(len(seq.block_table) for seq in seqs)
        tables = [seq.block_table + [0] * (width - len(seq.block_table)) for seq in seqs]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots, torch.int64),
            block_tables=self._tensor(tables, torch.int32),
            seq_lens=self._tensor(seq_lens, torch.int32),
            query_start_loc=self._tensor(starts, torch.int32),
            max_query_len=max(len(t) for t in tokens),
        )
        return self._tensor(input_ids, torch.int64), self._tensor(positions, torch.int64), meta, starts

    def prepare(self, batch: Batch):
        begins = [seq.num_computed for seq in batch.seqs]
        tokens = [seq.token_ids[b : b + n] for seq, b, n in zip(batch.seqs, begins, batch.num_tokens)]
        input_ids, positions, meta, starts = self.metadata(batch.seqs, begins, tokens)
        logit_rows, sample_rows = [], []
        for i, (seq, begin, n) in enumerate(zip(batch.seqs, begins, batch.num_tokens)):
            if begin + n == len(seq):  # the last token is computed: draw the next one for it and its siblings
                logit_rows += [starts[i + 1] - 1] * seq.num_samples
                sample_rows.append(i)
        return input_ids, positions, meta, logit_rows, sample_rows

    def sampling_tensors(self, seqs):
        """Per-row sampling parameters: each sequence once per sample (itself and pending siblings)."""
        temperature, top_k, top_p, min_p, seeds, positions, raw_mode = [], [], [], [], [], [], []
        for seq in seqs:
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

    def _draft_catch_up(self, seqs, ends) -> None:
        """Run the draft over every position the target has and the draft has not (its KV only)."""
        begins = [seq.draft_computed for seq in seqs]
        todo = [(s, b, s.token_ids[b:e]) for s, b, e in zip(seqs, begins, ends) if e > b]
        if todo:
            input_ids, positions, meta, _ = self.metadata(*zip(*todo))
            self.draft(input_ids, positions, meta)
        for seq, end in zip(seqs, ends):
            seq.draft_computed = max(seq.draft_computed, end)

    @torch.inference_mode()
    def step(self, batch: Batch) -> dict[int, list[tuple[int, float]]]:
        """Run one forward pass; returns {batch index: [(token, logprob), ...]} for sequences that sample."""
        input_ids, positions, meta, logit_rows, sample_rows = self.prepare(batch)
        if self.draft is not None and meta.max_query_len > 1:
            # Prefill work: the draft follows cheaply (its KV makes the prompt's blocks cacheable). Plain
            # decode steps skip it (batches too large to speculate); a later proposal catches up.
            self._draft_catch_up(batch.seqs, [s.num_computed + n for s, n in zip(batch.seqs, batch.num_tokens)])
        rows = self._tensor(logit_rows, torch.int64)
        if self.graphs is not None and meta.max_query_len == 1 and self.graphs.fits(*meta.block_tables.shape):
            logits = self.graphs.run(input_ids, positions, meta)[rows]
        else:
            hidden = self.model(input_ids, positions, meta)
            if not sample_rows:
                return {}
            logits = self.model.logits(hidden[rows])
        seqs = [batch.seqs[i] for i in sample_rows]
        temperature, top_k, top_p, min_p, seeds, pos, raw_mode = self.sampling_tensors(seqs)
        tokens, processed, raw = self.ops.sample(logits, temperature, top_k, top_p, min_p, seeds, pos)
        logprobs = torch.where(raw_mode, raw, processed)
        tokens, logprobs = tokens.tolist(), logprobs.tolist()  # the step's one host synchronisation
        out, row = {}, 0
        for i in sample_rows:
            k = batch.seqs[i].num_samples
            out[i] = list(zip(tokens[row : row + k], logprobs[row : row + k]))
            row += k
        return out
