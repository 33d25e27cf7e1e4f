"""Speculative decoding's target side: verify k+1 positions in one pass, accept exactly.

The draft's KV is its own region of the single pool, indexed by the target's block table, so
proposing needs no allocation. Acceptance is exact rejection sampling (kernels: accept with
min(1, p/q), else draw from norm(max(0, p - q)); all accepted: a bonus draw from p), so the
emitted tokens follow the target's distribution, and their logprobs are the target's. On CUDA the
passes replay graphs per batch bucket, captured for the temperature-only case (what RL rollouts
use); a batch with top-k/top-p/min-p, or with a sequence that asks for top-k logprobs (logprobs.py), runs
the same functions eagerly.
"""
from __future__ import annotations

import torch

from ..cuda_graphs import StepGraphs
from ..logprobs import asked, reduce_rows
from .proposers import DraftModelProposer, NgramProposer
from .state import SpecState, max_batch


def _each(values: torch.Tensor, times: int) -> torch.Tensor:
    """Each value `times` times in a row, contiguous (kernels index rows without strides; for one row,
    reshape would return a stride-0 view whose rows past the first are the buffer's next rows)."""
    return values[:, None].expand(-1, times).contiguous().view(-1)


def graphable(seqs) -> bool:
    """The captured graphs scale by temperature only (no top-k, top-p or min-p filtering) and report the
    sampler's logprobs only."""
    return not any(s.params.truncates or s.eager_logprobs for s in seqs)


def speculative_decoder(runner, speculation: str | None, k: int, vocab_size: int, use_graphs: bool):
    """The engine's SpeculativeDecoder with its proposer ("ngram": prompt lookup, "draft": the runner's draft
    model), or None without speculation."""
    if speculation is None:
        return None
    state = SpecState(runner)
    proposer = (NgramProposer(runner, state, k, vocab_size) if speculation == "ngram"
                else DraftModelProposer(runner, state, k, vocab_size, use_graphs))
    return SpeculativeDecoder(runner, state, proposer, k, use_graphs)


class SpeculativeDecoder:
    """Target-side verification: score k+1 positions, accept exactly, report the target's logprobs.

    A step is `launch` (proposals and the verify pass, on the device; graphs on CUDA) and `collect`
    (read what was emitted). `start` writes the SpecState first; from then on each verify pass advances
    it, so with a proposer that works on the device the next step can be launched before this one is
    collected."""

    def __init__(self, runner, state: SpecState, proposer, k: int, use_graphs: bool):
        self.runner, self.state, self.proposer, self.k = runner, state, proposer, k
        self.span = torch.arange(k + 1, device=runner.device)  # the verified positions, from L - 1
        self.every = torch.ones(k + 1, dtype=torch.bool, device=runner.device)  # ... all new to the target's KV
        self.graphs = StepGraphs(self.graph_step, max_batch(runner)) if use_graphs else None

    @property
    def nbytes(self) -> int:
        """The proposals' static buffers (draft tokens and their distributions)."""
        return self.proposer.tokens.nbytes + self.proposer.probs.nbytes

    def capture(self) -> None:
        self.state.write([], max_batch(self.runner))  # every row padding: nothing is written to the pool
        for graphs in (self.proposer.graphs, self.graphs):
            if graphs is not None:
                self.runner.capture_padded(graphs, 2 if graphs is self.proposer.graphs else self.k + 1)

    def _verify(self, size: int, width: int, filters, asking=()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[size, k+2, 2] float64: (token, logprob) of each emitted position, then (count, 0); and for the rows
        `asking` [(row, params)] that want more logprobs, reduce_rows' block over their k+1 positions (the
        target's logprobs of the emitted tokens and their top-k), else None."""
        r, st, q = self.runner, self.state, self.k + 1
        # The target scores the sequence's last token and the k proposals: positions L-1 .. L+k-1.
        ids = torch.cat([st.last2[:size, 1:], self.proposer.tokens[:size]], dim=1)
        positions = st.lens[:size, None] - 1 + self.span
        meta = st.metadata(r, size, positions, self.every, width)
        logits = r.model.logits(r.model(ids.flatten(), positions.flatten(), meta), meta.rows)      # [size * q, V]
        temperature, top_k, top_p, min_p, _, _, raw_mode = r.sampling(size)
        per_row = [_each(t, q) for t in (temperature, top_k, top_p, min_p)]
        target_probs = r.ops.processed_probs(logits, *per_row, filters).view(size, q, -1)
        emitted, counts = r.ops.rejection_sample(self.proposer.tokens[:size], self.proposer.probs[:size],
                                                 target_probs, st.target_seeds[:size], st.lens[:size])
        processed, raw = r.ops.token_logprobs(logits, emitted.flatten().clamp(min=0), *per_row)
        logprobs = torch.where(_each(raw_mode, q), raw, processed).view(size, q)
        extra = None
        if asking:
            rows = torch.tensor([r * q + j for r, _ in asking for j in range(q)], device=logits.device)
            params = [p for _, p in asking for _ in range(q)]
            extra = reduce_rows(logits[rows], emitted.flatten().clamp(min=0)[rows], params, False,
                                max(p.logprobs for p in params), r.ops.token_logprobs)
        # The step's tokens are last2 then the emitted ones: the new last two end at index count + 1.
        last2 = torch.cat([st.last2[:size], emitted], dim=1).gather(1, counts[:, None].long() + st.two)
        valid = st.valid[:size]
        st.last2[:size] = st.window[:size] = torch.where(valid[:, None], last2, st.last2[:size])
        # the draft's KV stays valid over the accepted proposals it was fed: L + min(accepted, k - 1)
        st.draft_len[:size] = torch.minimum(st.draft_len[:size], st.lens[:size] + counts.long() - 1)
        st.lens[:size] += torch.where(valid, counts.long(), 0)
        st.j.zero_()
        pairs = torch.stack([emitted.double(), logprobs.double()], dim=2)
        count = torch.stack([counts.double(), torch.zeros_like(counts, dtype=torch.float64)], dim=1)
        return torch.cat([pairs, count[:, None]], dim=1), extra

    def graph_step(self, size: int) -> torch.Tensor:
        """What a verify graph captures: `size` rows (the sequences, then padding), each scoring k + 1 positions."""
        return self._verify(size, self.runner.buffers.max_blocks, filters=False)[0]

    def _size(self, seqs) -> int | None:
        """The graph bucket these sequences run in, or None to run eagerly."""
        return self.graphs.bucket(len(seqs)) if graphable(seqs) and self.graphs is not None else None

    def start(self, seqs) -> None:
        """Bring the draft's KV and the SpecState to the sequences (no step may be in flight)."""
        self.proposer.catch_up(seqs)
        self.state.write(seqs, self._size(seqs) or len(seqs))

    @torch.inference_mode()
    def launch(self, seqs):
        """One speculative step on its way: propose, verify, start copying the results back."""
        r, n, size = self.runner, len(seqs), self._size(seqs)
        r.buffers.begin()
        r.write_block_tables(seqs)
        r.write_sampling(seqs)  # temperature and filters; seeds and noise positions come from the SpecState
        if size is not None:
            r.write_padding(n, n, size, 1)
        r.buffers.upload(size or n)
        self.proposer.propose(seqs, size)
        asking = [(i, s.params) for i, s in enumerate(seqs) if s.eager_logprobs]
        extra = None
        if size is not None:
            out = self.graphs.run(size)[:n]
        else:
            out, extra = self._verify(n, max(len(s.block_table) for s in seqs), None, asking)
        return r.buffers.send_back(out), asking, extra

    def collect(self, launched) -> list[tuple[list[int], list[tuple[float, dict | None]], int]]:
        """Per sequence of a launched step: (tokens, [(logprob, top-k or None)], drafts accepted)."""
        sent, asking, extra = launched
        results, q = [], self.k + 1
        block = extra.cpu().numpy() if extra is not None else None
        more = {i: (params, block[a * q : (a + 1) * q]) for a, (i, params) in enumerate(asking)}
        for i, row in enumerate(self.runner.buffers.receive(sent)):
            count = int(row[q, 0])
            if i in more:
                params, rows = more[i]
                scores = [asked(params, int(t), float(lp), x)
                          for t, lp, x in zip(row[:count, 0], row[:count, 1], rows)]
            else:
                scores = [(float(x), None) for x in row[:count, 1]]
            results.append(([int(t) for t in row[:count, 0]], scores, count - 1))
        return results
