"""Speculative decoding with a draft model: propose k, verify k+1 in one target pass, accept exactly.

The draft's KV is its own region of the single pool, indexed by the target's block table, so
proposing needs no allocation. Acceptance is exact rejection sampling (kernels: accept with
min(1, p/q), else draw from norm(max(0, p - q)); all accepted: a bonus draw from p), so the
emitted tokens follow the target's distribution, and their logprobs are the target's.

On CUDA both halves replay graphs per batch bucket: the draft's k passes (each feeds the
previous pass's tokens on the device, so proposing never waits for the host) and the target's
verify pass, which scores, accepts and computes logprobs in one graph. The only host
synchronisation of a step is reading what was emitted. Graphs are captured for the
temperature-only case (what RL rollouts use); a batch with top-k/top-p/min-p runs the same
functions eagerly.

A proposer is one class with `propose(seqs, use_graphs) -> (tokens [B, k], probs [B, k, V])` on
the device, `wants(seqs)` (whether proposing can pay; the engine decodes plainly when not),
`tokens`/`probs` buffers and `graphs` (None when it has nothing to capture): the draft
model's (`DraftModelProposer`) and prompt lookup (`NgramProposer`, `draft_model=NGRAM`) are two; an
EAGLE-style head would be a third.
"""
from __future__ import annotations

import weakref

import torch

from kernels.sampling import processed_probs

from .cuda_graphs import StepGraphs

NGRAM = "[ngram]"  # the draft_model that selects prompt lookup instead of a model (vLLM's spelling)
SPEC_MAX_BATCH = 32  # above this a decode step reads mostly KV, not weights: k+1 positions stop being free


def draft_seed(seed: int) -> int:
    """The draft's noise stream, independent of the target's acceptance and correction draws."""
    return hash((seed, 0xD4AF7)) & 0x7FFFFFFF  # ints only: str hashes change from process to process


def _max_batch(runner) -> int:
    return min(SPEC_MAX_BATCH, runner.buffers.max_rows)


def _each(values: torch.Tensor, times: int) -> torch.Tensor:
    """Each value `times` times in a row (repeat_interleave without its host synchronisation)."""
    return values[:, None].expand(-1, times).reshape(-1)


def graphable(seqs) -> bool:
    """The captured graphs scale by temperature only (no top-k, top-p or min-p filtering)."""
    return all(s.params.top_k <= 0 and s.params.top_p >= 1 and s.params.min_p <= 0 for s in seqs)


class DraftModelProposer:
    def __init__(self, runner, k: int, vocab: int, use_graphs: bool):
        self.runner, self.k = runner, k
        rows = _max_batch(runner)
        self.tokens = torch.zeros(rows, k, dtype=torch.int64, device=runner.device)
        self.probs = torch.zeros(rows, k, vocab, dtype=torch.float32, device=runner.device)
        self.graphs = StepGraphs(self._graph_pass, rows) if use_graphs else None

    def _pass(self, size: int, num_tokens: int, max_query_len: int, width: int, filters):
        """One draft forward; (token, processed probs) drawn at each sequence's last row."""
        r = self.runner
        hidden = r.draft(*r.metadata(size, num_tokens, max_query_len, width))
        logits = r.draft.logits(hidden[r.buffers.dev["logit_rows"][:size]])
        temperature, top_k, top_p, min_p, seeds, positions, _ = r.sampling(size)
        tokens = r.ops.sample(logits, temperature, top_k, top_p, min_p, seeds, positions)[0]
        return tokens, processed_probs(logits, temperature, top_k, top_p, min_p, filters)

    def _graph_pass(self, size: int):
        # up to two new tokens per sequence: after a full acceptance the draft has not seen two of them
        return self._pass(size, 2 * size, 2, self.runner.buffers.max_blocks, filters=False)

    def wants(self, seqs) -> bool:
        return True  # a draft model always has proposals

    def propose(self, seqs, use_graphs: bool):
        """k tokens per sequence from the draft, each drawn from the draft's processed distribution."""
        r, n, k = self.runner, len(seqs), self.k
        if any(len(s) - s.draft_computed > 2 for s in seqs):  # plain decode steps ran without the draft
            r._draft_catch_up(seqs, [len(s) - 1 for s in seqs])
        size = self.graphs.bucket(n) if use_graphs and self.graphs is not None else None
        seeds = [draft_seed(s.seed) for s in seqs]
        for j in range(k):
            r.buffers.begin()
            if j == 0:
                begins = [s.draft_computed for s in seqs]
                toks = [s.token_ids[b:] for s, b in zip(seqs, begins)]
            else:  # the previous pass's tokens, fed on the device below
                begins, toks = [len(s) + j - 1 for s in seqs], [[0]] * n
            num_tokens, starts = r.write_tokens(seqs, begins, toks)
            r.buffers.host["logit_rows"][:n] = [e - 1 for e in starts[1:]]
            r.write_sampling(seqs, positions=[len(s) + j for s in seqs], seeds=seeds)
            if size is not None:
                r.write_padding(n, num_tokens, size, 2)
            r.buffers.upload(size or n)
            if j > 0:
                r.buffers.dev["input_ids"][:n].copy_(self.tokens[:n, j - 1])
            if size is not None:
                tokens, probs = self.graphs.run(size)
            else:
                width = max(len(s.block_table) for s in seqs)
                tokens, probs = self._pass(n, num_tokens, max(map(len, toks)), width, filters=None)
            self.tokens[:n, j] = tokens[:n]
            self.probs[:n, j] = probs[:n]
        return self.tokens[:n], self.probs[:n]


class SpeculativeDecoder:
    """Target-side verification: score k+1 positions, accept exactly, report the target's logprobs."""

    def __init__(self, runner, proposer, k: int, use_graphs: bool):
        self.runner, self.proposer, self.k = runner, proposer, k
        self.graphs = StepGraphs(self._graph_verify, _max_batch(runner)) if use_graphs else None

    @property
    def nbytes(self) -> int:
        """The proposals' static buffers (draft tokens and their distributions)."""
        return self.proposer.tokens.nbytes + self.proposer.probs.nbytes

    def capture(self) -> None:
        for graphs in (self.proposer.graphs, self.graphs):
            if graphs is not None:
                self.runner.capture_padded(graphs, 2 if graphs is self.proposer.graphs else self.k + 1)

    def _verify(self, size: int, width: int, filters) -> torch.Tensor:
        """[size, k+2, 2] float64: (token, logprob) of each emitted position, then (count, 0)."""
        r, q = self.runner, self.k + 1
        input_ids, positions, meta = r.metadata(size, size * q, q, width)
        logits = r.model.logits(r.model(input_ids, positions, meta))                    # [size * q, V]
        temperature, top_k, top_p, min_p, seeds, noise_at, raw_mode = r.sampling(size)
        per_row = [_each(t, q) for t in (temperature, top_k, top_p, min_p)]
        target_probs = processed_probs(logits, *per_row, filters).view(size, q, -1)
        emitted, counts = r.ops.rejection_sample(self.proposer.tokens[:size], self.proposer.probs[:size],
                                                 target_probs, seeds, noise_at)
        processed, raw = r.ops.token_logprobs(logits, emitted.flatten().clamp(min=0), *per_row)
        logprobs = torch.where(_each(raw_mode, q), raw, processed).view(size, q)
        pairs = torch.stack([emitted.double(), logprobs.double()], dim=2)
        count = torch.stack([counts.double(), torch.zeros_like(counts, dtype=torch.float64)], dim=1)
        return torch.cat([pairs, count[:, None]], dim=1)

    def _graph_verify(self, size: int) -> torch.Tensor:
        return self._verify(size, self.runner.buffers.max_blocks, filters=False)

    @torch.inference_mode()
    def step(self, seqs):
        """One speculative step for decode sequences; returns per sequence (tokens, logprobs, accepted)."""
        r, n, q = self.runner, len(seqs), self.k + 1
        use_graphs = graphable(seqs)
        self.proposer.propose(seqs, use_graphs)
        size = self.graphs.bucket(n) if use_graphs and self.graphs is not None else None
        r.buffers.begin()
        # The target scores its last token and the k proposals (fed on the device): k+1 positions each.
        r.write_tokens(seqs, [len(s) - 1 for s in seqs], [[s.token_ids[-1]] + [0] * self.k for s in seqs])
        r.write_sampling(seqs)
        if size is not None:
            r.write_padding(n, n * q, size, q)
        r.buffers.upload(size or n)
        r.buffers.dev["input_ids"][: n * q].view(n, q)[:, 1:].copy_(self.proposer.tokens[:n])
        if size is not None:
            out = self.graphs.run(size)[:n]
        else:
            out = self._verify(n, max(len(s.block_table) for s in seqs), filters=None)
        values = r.buffers.download(out)
        results = []
        for row in values:
            count = int(row[q, 0])
            results.append(([int(t) for t in row[:count, 0]], [float(x) for x in row[:count, 1]], count - 1))
        return results


class NgramIndex:
    """Where each n-gram (n = 1..max_n) of a growing token list last occurred, updated as tokens arrive."""

    def __init__(self, max_n: int):
        self.max_n, self.follows, self.indexed = max_n, {}, 0  # follows[ngram]: the position after it

    def match(self, tokens: list[int]) -> int | None:
        """Where the latest earlier occurrence of the longest suffix (n <= max_n) that occurred before ended."""
        end = len(tokens)
        if end < self.indexed:  # the list was cut (a stop string): index it again
            self.follows, self.indexed = {}, 0
        for after in range(max(self.indexed, 1), end):  # every n-gram with a token after it: not the suffix
            for n in range(1, min(self.max_n, after) + 1):
                self.follows[tuple(tokens[after - n : after])] = after
        self.indexed = end
        return next((self.follows[key] for n in range(min(self.max_n, end), 0, -1)
                     if (key := tuple(tokens[end - n :])) in self.follows), None)

    def continuation(self, tokens: list[int], k: int) -> list[int]:
        """The k tokens that followed the match (one running into the end repeats with its period); the
        last token k times when nothing matches."""
        start, end = self.match(tokens), len(tokens)
        if start is None:
            return [tokens[-1]] * k
        out: list[int] = []
        for i in range(start, start + k):
            out.append(tokens[i] if i < end else out[i - end])
        return out


class NgramProposer:
    """Prompt lookup: propose what followed the sequence's last tokens the last time they occurred.

    A proposal is certain (its distribution is one-hot), which exact rejection sampling takes like any
    draft's: the target keeps proposal x with probability p(x) and otherwise draws from p without x.
    Proposing costs a few dict lookups per sequence and no device memory beyond the proposal buffers."""

    MAX_N = 4
    graphs = None  # nothing to capture: the proposals are uploaded

    def __init__(self, runner, k: int, vocab: int):
        self.k, rows, device = k, _max_batch(runner), runner.device
        self.tokens = torch.zeros(rows, k, dtype=torch.int64, device=device)
        self.probs = torch.zeros(rows, k, vocab, dtype=torch.float32, device=device)
        self.host = torch.zeros(rows, k, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> NgramIndex

    def _index(self, seq) -> NgramIndex:
        return self.indexes.setdefault(seq, NgramIndex(self.MAX_N))

    def wants(self, seqs) -> bool:
        """Whether any sequence's suffix occurred before; if none did, a plain step costs less than
        verifying guesses (a speculative step with nothing accepted ran at 0.74-0.87x of plain decoding)."""
        return any(self._index(s).match(s.token_ids) is not None for s in seqs)

    def propose(self, seqs, use_graphs: bool):
        n = len(seqs)
        # The last upload from `host` has been read: the step that used it was waited for.
        self.host[:n] = torch.tensor([self._index(s).continuation(s.token_ids, self.k) for s in seqs])
        tokens, probs = self.tokens[:n], self.probs[:n]
        tokens.copy_(self.host[:n], non_blocking=True)
        probs.zero_()
        probs.scatter_(2, tokens[:, :, None], 1.0)
        return tokens, probs
