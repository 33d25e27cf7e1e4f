"""ModelRunner: turns a scheduled Batch into tensors, runs the forward pass, samples the next tokens.

Every step writes its inputs into the StepBuffers' host twin and moves them in one copy. A
decode step (one token per sequence, one sample each) on CUDA replays a graph that runs the
model AND the sampler, so the step is: fill, one upload, one replay, one download.

A sequence that asks for more logprobs than the sampler's one per row (top-k alternatives, prompt
logprobs) runs in eager steps, where logprobs.py computes them for its rows only.

With a draft model it also keeps the draft's KV in step when asked (a prefill runs the draft over
the same positions) and serves speculative steps (spec/).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .cuda_graphs import StepGraphs
from .logprobs import sampled_draws, score_prompts
from rollout_kernels.shared_prefix import SharedPrefix

from .model import AttentionMetadata, CausalLM
from .prefix_groups import PrefixGroups
from .scheduler import Batch
from .step_buffers import StepBuffers


@dataclass
class Launched:
    """A decode step on its way: its batch, its (token, logprob) rows on the device, and their host copy."""

    batch: Batch
    out: torch.Tensor
    host: object  # what StepBuffers.send_back returned


def pure_decode(batch: Batch) -> bool:
    """One new token per sequence, one sample each, and no logprobs beyond the sampler's: what a decode graph
    computes."""
    return bool(batch.seqs) and all(n == 1 and s.num_uncomputed == 1 and s.num_samples == 1 and not s.eager_logprobs
                                    for s, n in zip(batch.seqs, batch.num_tokens))


class ModelRunner:
    def __init__(self, model: CausalLM, ops, block_size: int, device: torch.device, buffers: StepBuffers,
                 use_graphs: bool, draft: CausalLM | None = None, share_prefixes: bool = False):
        self.model, self.ops, self.block_size, self.device = model, ops, block_size, device
        self.buffers, self.draft = buffers, draft
        self.graphs = StepGraphs(self.graph_step, buffers.max_rows) if use_graphs else None
        heads_per_kv = model.cfg.num_heads // model.cfg.num_kv_heads if share_prefixes else None
        self.prefix_groups = PrefixGroups(heads_per_kv, block_size, buffers)
        # decode steps whose sequences share prompts (prefix_groups.py): graphs of their own, from min_rows rows
        self.shared_graphs = (StepGraphs(lambda size: self.graph_step(size, shared=True), buffers.max_rows,
                                         smallest=self.prefix_groups.min_rows)
                              if use_graphs and self.prefix_groups.members else None)
        # What each block-table row of the host twin holds: (the sequence's block_table list, entries written).
        # The block manager only appends to a table or replaces the list, so an unchanged list needs only
        # its new tail written (the rows of a large decode batch were most of the host's time per step).
        self._rows: list[tuple[list | None, int]] = [(None, 0)] * buffers.max_rows

    # ------------------------------------------------------------------ inputs

    def write_tokens(self, seqs, begins, tokens) -> tuple[int, list[int]]:
        """Host twin: tokens[i] placed at positions begins[i].. of seqs[i] (their KV goes to those slots).
        Returns the number of tokens and each sequence's first row."""
        bs, h = self.block_size, self.buffers.host
        input_ids, positions, slots, seq_lens, starts = [], [], [], [], [0]
        for seq, begin, toks in zip(seqs, begins, tokens):
            end = begin + len(toks)
            input_ids += toks
            positions += range(begin, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(begin, end)]
            seq_lens.append(end)
            starts.append(starts[-1] + len(toks))
        n, rows = len(input_ids), len(seqs)
        h["input_ids"][:n], h["positions"][:n], h["slot_mapping"][:n] = input_ids, positions, slots
        h["seq_lens"][:rows], h["query_start_loc"][: rows + 1] = seq_lens, starts
        self.write_block_tables(seqs)
        return n, starts

    def write_block_tables(self, seqs) -> None:
        """Host twin: row i of the block tables is seqs[i]'s table."""
        h = self.buffers.host
        for i, seq in enumerate(seqs):
            table, (known, written) = seq.block_table, self._rows[i]
            if known is not table or written > len(table):
                written = 0  # another list: the row is written whole
            if written < len(table):
                h["block_tables"][i, written : len(table)] = table[written:]
                self._rows[i] = (table, len(table))

    def write_padding(self, num_seqs: int, num_tokens: int, size: int, query_len: int) -> None:
        """Fill a graph bucket of `size` sequences x `query_len` tokens: the rows past the real ones own
        no query and write no KV."""
        h = self.buffers.host
        last = size * query_len
        h["input_ids"][num_tokens:last] = h["positions"][num_tokens:last] = 0
        h["slot_mapping"][num_tokens:last] = -1
        h["seq_lens"][num_seqs:size] = 1
        h["query_start_loc"][num_seqs + 1 : size + 1] = num_tokens
        h["block_tables"][num_seqs:size, 0] = 0
        self._rows[num_seqs:size] = [(None, 0)] * (size - num_seqs)
        h["logit_rows"][num_seqs:size] = 0
        # Padding rows are sampled too (and dropped). Left stale, or zero as at capture, their top-k/top-p/
        # min-p would send each down the sampling kernels' whole-row filtered scan, the step's slowest row.
        h["top_k"][num_seqs:size], h["top_p"][num_seqs:size], h["min_p"][num_seqs:size] = 0, 1, 0

    def write_sampling(self, seqs, positions=None, seeds=None, first: int = 0, count: int | None = None) -> int:
        """Host twin: per-row sampling parameters, each sequence once per sample (itself and pending
        siblings), rows first..first+count of them. `positions` (default len(seq)) and `seeds` (default
        the samples' own; one per sequence) key each row's noise. Returns the number of rows written."""
        rows = [(seq, seed, i) for i, seq in enumerate(seqs)
                for seed in ((seq.seed, *seq.sibling_seeds) if seeds is None else (seeds[i],))]
        count = len(rows) - first if count is None else count
        rows = rows[first : first + count]
        h = self.buffers.host
        h["temperature"][:count] = [s.params.temperature for s, _, _ in rows]
        h["top_k"][:count] = [s.params.top_k for s, _, _ in rows]
        h["top_p"][:count] = [s.params.top_p for s, _, _ in rows]
        h["min_p"][:count] = [s.params.min_p for s, _, _ in rows]
        h["raw_mode"][:count] = [s.params.logprobs_mode == "raw" for s, _, _ in rows]
        h["seeds"][:count] = [seed for _, seed, _ in rows]
        h["sample_positions"][:count] = [len(s) if positions is None else positions[i] for s, _, i in rows]
        return count

    def metadata(self, num_seqs: int, num_tokens: int, max_query_len: int, width: int, shared: bool = False):
        """Device views of what write_tokens wrote: input ids, positions, AttentionMetadata (`shared`: with the
        groups PrefixGroups.write wrote, for a decode step)."""
        d = self.buffers.dev
        groups = (SharedPrefix(d["prefix_members"][: num_seqs // 2, : self.prefix_groups.members],
                               d["prefix_keys"][: num_seqs // 2], d["prefix_first_key"][:num_seqs]) if shared else None)
        meta = AttentionMetadata(d["slot_mapping"][:num_tokens], d["block_tables"][:num_seqs, :width],
                                 d["seq_lens"][:num_seqs], d["query_start_loc"][: num_seqs + 1], max_query_len, groups)
        return d["input_ids"][:num_tokens], d["positions"][:num_tokens], meta

    def sampling(self, rows: int):
        """Device views of what write_sampling wrote (temperature, top_k, top_p, min_p, seeds, positions, raw)."""
        d = self.buffers.dev
        names = ("temperature", "top_k", "top_p", "min_p", "seeds", "sample_positions", "raw_mode")
        return tuple(d[n][:rows] for n in names)

    # ------------------------------------------------------------------ forward

    def forward(self, model: CausalLM, seqs, begins, tokens) -> tuple[torch.Tensor, list[int]]:
        """Eager forward of `tokens` (write, upload, run): hidden states and each sequence's first row."""
        self.buffers.begin()
        n, starts = self.write_tokens(seqs, begins, tokens)
        self.buffers.upload(len(seqs))
        width = max(len(seq.block_table) for seq in seqs)
        hidden = model(*self.metadata(len(seqs), n, max(len(t) for t in tokens), width))
        return hidden, starts

    def sample(self, logits: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, 2] float64 (token, logprob) drawn from logits [rows, V] with the uploaded parameters."""
        temperature, top_k, top_p, min_p, seeds, positions, raw_mode = self.sampling(rows)
        tokens, processed, raw = self.ops.sample(logits, temperature, top_k, top_p, min_p, seeds, positions)
        return torch.stack([tokens.double(), torch.where(raw_mode, raw, processed).double()], dim=1)

    def graph_step(self, size: int, shared: bool = False) -> torch.Tensor:
        """What a decode graph captures: `size` sequences, one token and one sample each (`shared`: attending
        the prompts groups of them share once a group)."""
        input_ids, positions, meta = self.metadata(size, size, 1, self.buffers.max_blocks, shared)
        return self.sample(self.model.logits(self.model(input_ids, positions, meta), meta.rows), size)

    def capture(self) -> None:
        if self.graphs is not None:
            self.capture_padded(self.graphs, 1)
        if self.shared_graphs is not None:
            self.prefix_groups.clear()
            self.capture_padded(self.shared_graphs, 1)

    def capture_padded(self, graphs: StepGraphs, query_len: int) -> None:
        """Capture `graphs` over rows that own no query (valid inputs, harmless), sharing one memory
        pool with the decode graphs: graph steps never overlap, and each one's output is read at once."""
        self.buffers.begin()
        size = self.buffers.max_rows
        self.write_padding(0, 0, size, query_len)
        self.buffers.upload(size)
        if graphs is not self.graphs and self.graphs is not None:
            graphs.pool = self.graphs.pool
        graphs.capture()

    def draft_catch_up(self, seqs, ends) -> None:
        """Run the draft over every position the target has and the draft has not (its KV only),
        in pieces that fit the step buffers."""
        todo = [(s, s.draft_computed, e) for s, e in zip(seqs, ends) if e > s.draft_computed]
        cap = self.buffers.max_tokens
        while todo:
            piece, budget = [], cap
            for seq, begin, end in todo:
                if budget:
                    take = min(end - begin, budget)
                    piece.append((seq, begin, seq.token_ids[begin : begin + take]))
                    budget -= take
            self.forward(self.draft, *zip(*piece))
            for seq, begin, toks in piece:
                seq.draft_computed = begin + len(toks)
            todo = [(s, s.draft_computed, e) for s, _, e in todo if e > s.draft_computed]

    @torch.inference_mode()
    def step(self, batch: Batch, draft_follows: bool = False) -> dict[int, list[tuple]]:
        """Run one forward pass; returns {batch index: [(token, logprob, top-k or None), ...]} for sequences that
        sample. Sequences that ask for prompt logprobs get this step's positions' in `prompt_logprobs`.

        `draft_follows`: a prefill also runs the draft over the same tokens (its KV makes the prompt's
        blocks cacheable). Decode steps never do; a later proposal catches up."""
        seqs = batch.seqs
        begins = [seq.num_computed for seq in seqs]
        tokens = [seq.token_ids[b : b + n] for seq, b, n in zip(seqs, begins, batch.num_tokens)]
        if draft_follows and max(batch.num_tokens) > 1:
            self.draft_catch_up(seqs, [b + len(t) for b, t in zip(begins, tokens)])
        sampling = [i for i, (seq, b, t) in enumerate(zip(seqs, begins, tokens)) if b + len(t) == len(seq)]
        if pure_decode(batch):
            return self.collect(self.launch(batch))
        draws = self._eager_step(seqs, begins, tokens, sampling)
        out, row = {}, 0
        for i in sampling:
            k = seqs[i].num_samples
            out[i] = draws[row : row + k]
            row += k
        return out

    @torch.inference_mode()
    def launch(self, batch: Batch, after: Launched | None = None) -> Launched:
        """Start a decode step (model and sampler: a graph replay on CUDA) without waiting for it.

        With `after`, the step is launched before `after`'s tokens are read: each sequence's newest token
        is still being computed there, so its inputs sit one position further and the token is copied
        from `after`'s output on the device. The host's bookkeeping then overlaps the GPU's step."""
        seqs, n, ahead = batch.seqs, len(batch.seqs), int(after is not None)
        self.buffers.begin()
        self.write_tokens(seqs, [len(s) - 1 + ahead for s in seqs], [[0 if ahead else s.token_ids[-1]] for s in seqs])
        self.write_sampling(seqs, positions=[len(s) + ahead for s in seqs])
        size = self.graphs.bucket(n) if self.graphs is not None else n
        self.write_padding(n, n, size, 1)
        shared = self.prefix_groups.write(n, size)
        if after is not None:
            rows = {id(s): i for i, s in enumerate(after.batch.seqs)}
            self.buffers.host["feed_rows"][:n] = [rows[id(s)] for s in seqs]
        self.buffers.upload(size, after.out if after is not None else None, n if after is not None else 0)
        out = self.decode(size, shared)[:n]
        return Launched(batch, out, self.buffers.send_back(out))

    def decode(self, size: int, shared: bool = False) -> torch.Tensor:
        """Run the uploaded decode step of `size` rows: the graph of that bucket, or eagerly."""
        graphs = self.shared_graphs if shared else self.graphs
        return graphs.run(size) if graphs is not None else self.graph_step(size, shared)

    def collect(self, launched: Launched) -> dict[int, list[tuple]]:
        """Wait for a launched step; {batch index: [(token, logprob, None)]} like step()."""
        drawn = self.buffers.receive(launched.host).tolist()  # Python floats: 4x faster than numpy scalars a row
        return {i: [(int(t), lp, None)] for i, (t, lp) in enumerate(drawn)}

    def _eager_step(self, seqs, begins, tokens, sampling) -> list[tuple]:
        """Forward (scoring prompt positions where asked), then draw for sequences `sampling` (by batch index)
        from their last rows: (token, logprob, top-k or None) per sample."""
        hidden, starts = self.forward(self.model, seqs, begins, tokens)
        score_prompts(self.model, hidden, starts, seqs, begins, [len(t) for t in tokens], self.ops.token_logprobs)
        samplers = [seqs[i] for i in sampling]
        row_seqs = [seqs[i] for i in sampling for _ in range(seqs[i].num_samples)]
        logit_rows = [starts[i + 1] - 1 for i in sampling for _ in range(seqs[i].num_samples)]
        draws = []
        cap = self.buffers.max_rows
        for first in range(0, len(logit_rows), cap):  # a request with n > max_num_seqs samples in pieces
            self.buffers.begin()
            part = logit_rows[first : first + cap]
            self.buffers.host["logit_rows"][: len(part)] = part
            self.write_sampling(samplers, first=first, count=len(part))
            self.buffers.upload(0)
            logits = self.model.logits(hidden[self.buffers.dev["logit_rows"][: len(part)]])
            drawn = self.sample(logits, len(part))
            draws += sampled_draws(logits, drawn[:, 0].long(), row_seqs[first : first + len(part)],
                                   self.buffers.download(drawn), self.ops.token_logprobs)
        return draws


def capture_graphs(runner: ModelRunner, speculator, device: torch.device) -> int:
    """(Re-)capture the decode graphs (and the speculative ones); returns the bytes their memory pool took."""
    if runner.graphs is None:
        return 0
    before = torch.cuda.memory_reserved(device)
    runner.capture()
    if speculator is not None:
        speculator.capture()
    return torch.cuda.memory_reserved(device) - before
