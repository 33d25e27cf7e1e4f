"""Speculative decoding: propose k, verify k+1 in one target pass, accept exactly.

The draft's KV is its own region of the single pool, indexed by the target's block table, so
proposing needs no allocation. Acceptance is exact rejection sampling (kernels: accept with
min(1, p/q), else draw from norm(max(0, p - q)); all accepted: a bonus draw from p), so the
emitted tokens follow the target's distribution, and their logprobs are the target's.

Every pass reads where its rows stand from SpecState on the device (lengths, last tokens, the
draft's KV extent), and each pass advances it: the draft's k passes feed each other's tokens, and
the verify pass, which scores, accepts and computes logprobs, moves every row past what it
emitted. So a step needs nothing from the host but block tables, and with a draft model the next
step is launched before this one's tokens are read (Engine._speculate). On CUDA the passes replay
graphs per batch bucket, captured for the temperature-only case (what RL rollouts use); a batch
with top-k/top-p/min-p runs the same functions eagerly.

A proposer is one class with `propose(seqs, size)` (k tokens per row into its `tokens` [B, k]
and their distributions into `probs` [B, k, V]), `catch_up(seqs)`, `wants(seqs)` (whether
proposing can pay; the engine decodes plainly when not), `on_device` (it proposes from SpecState,
so steps may be launched ahead) and `graphs` (None when it has nothing to capture): the draft
model's (`DraftModelProposer`) and prompt lookup (`NgramProposer`, `draft_model=NGRAM`) are two;
an EAGLE-style head would be a third.
"""
from __future__ import annotations

import weakref

import torch

from .cuda_graphs import StepGraphs
from .model import AttentionMetadata

NGRAM = "[ngram]"  # the draft_model that selects prompt lookup instead of a model (vLLM's spelling)
SPEC_MAX_BATCH = 32  # above this a decode step reads mostly KV, not weights: k+1 positions stop being free


def draft_seed(seed: int) -> int:
    """The draft's noise stream, independent of the target's acceptance and correction draws."""
    return hash((seed, 0xD4AF7)) & 0x7FFFFFFF  # ints only: str hashes change from process to process


def _max_batch(runner) -> int:
    return min(SPEC_MAX_BATCH, runner.buffers.max_rows)


def _each(values: torch.Tensor, times: int) -> torch.Tensor:
    """Each value `times` times in a row, contiguous (kernels index rows without strides; for one row,
    reshape would return a stride-0 view whose rows past the first are the buffer's next rows)."""
    return values[:, None].expand(-1, times).contiguous().view(-1)


def _proposal_buffers(runner, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A proposer's `tokens` [rows, k] and their distributions `probs` [rows, k, vocab], which verify reads."""
    rows = _max_batch(runner)
    return (torch.zeros(rows, k, dtype=torch.int64, device=runner.device),
            torch.zeros(rows, k, vocab, dtype=torch.float32, device=runner.device))


def graphable(seqs) -> bool:
    """The captured graphs scale by temperature only (no top-k, top-p or min-p filtering)."""
    return all(s.params.top_k <= 0 and s.params.top_p >= 1 and s.params.min_p <= 0 for s in seqs)


class SpecState:
    """Where each batch row stands in its sequence, on the device, so one speculative step can follow
    another without the host: `lens` (tokens the sequence has), `last2` (its last two), `draft_len` (tokens
    the draft's KV holds), `window` (the two tokens the next draft pass feeds), `j` (which draft pass),
    `valid` (a real row, not a graph bucket's padding) and the draft's and the target's noise seeds.
    `write` sets it from the sequences while no step is in flight; each draft pass advances `window`, `j`
    and `draft_len`, each verify pass `lens`, `last2` and `draft_len` (to what acceptance left valid)."""

    def __init__(self, runner):
        rows, device = _max_batch(runner), runner.device
        self.lens, self.draft_len, self.last2, self.window = (
            torch.zeros(shape, dtype=torch.int64, device=device) for shape in (rows, rows, (rows, 2), (rows, 2)))
        self.draft_seeds, self.target_seeds = (torch.zeros(rows, dtype=torch.int64, device=device) for _ in "dt")
        self.j = torch.zeros((), dtype=torch.int64, device=device)
        self.valid = torch.zeros(rows, dtype=torch.bool, device=device)
        self.two = torch.arange(2, device=device)
        # what `write` uploads per row: lens, last two tokens, draft seed, target seed, valid, draft_len
        self.host = torch.zeros(rows, 7, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.staged = self.host.to(device)

    def write(self, seqs, rows: int) -> None:
        """Rows past the sequences are padding: positions 0 and 1, no KV written. The last upload from `host`
        has been read: the steps that followed it were waited for."""
        n, host = len(seqs), self.host[:rows]
        host.zero_()
        host[:, 0] = 2
        if seqs:
            host[:n] = torch.tensor([[len(s), *s.token_ids[-2:], draft_seed(s.seed), s.seed, 1, s.draft_computed]
                                     for s in seqs])
        dev = self.staged[:rows]
        dev.copy_(host, non_blocking=True)
        self.lens[:rows], self.last2[:rows], self.window[:rows] = dev[:, 0], dev[:, 1:3], dev[:, 1:3]
        self.draft_seeds[:rows], self.target_seeds[:rows], self.valid[:rows] = dev[:, 3], dev[:, 4], dev[:, 5] > 0
        self.draft_len[:rows] = dev[:, 6]
        self.j.zero_()

    def metadata(self, runner, size: int, positions, writes, width: int) -> AttentionMetadata:
        """Attention metadata for `size` rows of q tokens at `positions` [size, q], read from the device only;
        `writes` [size, q]: the tokens whose KV goes to the pool (a padding row's never does)."""
        bs, q = runner.block_size, positions.shape[1]
        tables = runner.buffers.dev["block_tables"][:size, :width]
        slots = tables.gather(1, positions // bs).long() * bs + positions % bs
        slots = torch.where(writes & self.valid[:size, None], slots, -1).flatten()
        starts = torch.arange(0, (size + 1) * q, q, dtype=torch.int32, device=positions.device)
        return AttentionMetadata(slots, tables, (positions[:, -1] + 1).int(), starts, q)


class DraftModelProposer:
    """k autoregressive draft passes, each over the two newest tokens of every sequence (the first pass
    after a full acceptance needs both; otherwise the older one's KV is there and is not written again),
    so every pass has one shape and reads its inputs from SpecState on the device."""

    on_device = True  # proposes from device state: a step can be launched before the last one is read

    def __init__(self, runner, state: SpecState, k: int, vocab: int, use_graphs: bool):
        self.runner, self.state, self.k = runner, state, k
        self.tokens, self.probs = _proposal_buffers(runner, k, vocab)
        self.graphs = StepGraphs(self._graph_pass, _max_batch(runner)) if use_graphs else None

    def _pass(self, size: int, width: int, filters) -> None:
        """One draft forward; the token drawn after each sequence's newest one becomes proposal j."""
        r, st = self.runner, self.state
        positions = st.lens[:size, None] - 2 + st.j + st.two  # the window's positions
        meta = st.metadata(r, size, positions, positions >= st.draft_len[:size, None], width)
        hidden = r.draft(st.window[:size].flatten(), positions.flatten(), meta)
        logits = r.draft.logits(hidden.view(size, 2, -1)[:, 1])
        temperature, top_k, top_p, min_p, _, _, _ = r.sampling(size)
        noise_at = positions[:, 1] + 1  # the position of the token drawn
        tokens = r.ops.sample(logits, temperature, top_k, top_p, min_p, st.draft_seeds[:size], noise_at)[0]
        at = st.j.clamp(max=self.k - 1).view(1)  # graph capture warms up more passes than k
        self.tokens[:size].index_copy_(1, at, tokens[:, None])
        probs = r.ops.processed_probs(logits, temperature, top_k, top_p, min_p, filters)
        self.probs[:size].index_copy_(1, at, probs[:, None])
        st.window[:size] = torch.stack([st.window[:size, 1], tokens], dim=1)
        st.draft_len[:size] = torch.maximum(st.draft_len[:size], positions[:, 1] + 1)
        st.j += 1

    def _graph_pass(self, size: int) -> None:
        self._pass(size, self.runner.buffers.max_blocks, filters=False)

    def wants(self, seqs) -> bool:
        return True  # a draft model always has proposals

    def catch_up(self, seqs) -> None:
        """After plain decode steps (which do not run the draft) the draft's KV must reach the first pass."""
        if any(len(s) - s.draft_computed > 2 for s in seqs):
            self.runner._draft_catch_up(seqs, [len(s) - 1 for s in seqs])

    def propose(self, seqs, size: int | None) -> None:
        """k tokens per sequence into `tokens`, each drawn from the draft's processed distribution `probs`."""
        for _ in range(self.k):
            if size is not None:
                self.graphs.run(size)
            else:
                self._pass(len(seqs), max(len(s.block_table) for s in seqs), filters=None)


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
        self.graphs = StepGraphs(self._graph_verify, _max_batch(runner)) if use_graphs else None

    @property
    def nbytes(self) -> int:
        """The proposals' static buffers (draft tokens and their distributions)."""
        return self.proposer.tokens.nbytes + self.proposer.probs.nbytes

    def capture(self) -> None:
        self.state.write([], _max_batch(self.runner))  # every row padding: nothing is written to the pool
        for graphs in (self.proposer.graphs, self.graphs):
            if graphs is not None:
                self.runner.capture_padded(graphs, 2 if graphs is self.proposer.graphs else self.k + 1)

    def _verify(self, size: int, width: int, filters) -> torch.Tensor:
        """[size, k+2, 2] float64: (token, logprob) of each emitted position, then (count, 0)."""
        r, st, q = self.runner, self.state, self.k + 1
        # The target scores the sequence's last token and the k proposals: positions L-1 .. L+k-1.
        ids = torch.cat([st.last2[:size, 1:], self.proposer.tokens[:size]], dim=1)
        positions = st.lens[:size, None] - 1 + self.span
        meta = st.metadata(r, size, positions, self.every, width)
        logits = r.model.logits(r.model(ids.flatten(), positions.flatten(), meta))      # [size * q, V]
        temperature, top_k, top_p, min_p, _, _, raw_mode = r.sampling(size)
        per_row = [_each(t, q) for t in (temperature, top_k, top_p, min_p)]
        target_probs = r.ops.processed_probs(logits, *per_row, filters).view(size, q, -1)
        emitted, counts = r.ops.rejection_sample(self.proposer.tokens[:size], self.proposer.probs[:size],
                                                 target_probs, st.target_seeds[:size], st.lens[:size])
        processed, raw = r.ops.token_logprobs(logits, emitted.flatten().clamp(min=0), *per_row)
        logprobs = torch.where(_each(raw_mode, q), raw, processed).view(size, q)
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
        return torch.cat([pairs, count[:, None]], dim=1)

    def _graph_verify(self, size: int) -> torch.Tensor:
        return self._verify(size, self.runner.buffers.max_blocks, filters=False)

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
        if size is not None:
            out = self.graphs.run(size)[:n]
        else:
            out = self._verify(n, max(len(s.block_table) for s in seqs), filters=None)
        return r.buffers.send_back(out)

    def collect(self, sent) -> list[tuple[list[int], list[float], int]]:
        """Per sequence of a launched step: (tokens, logprobs, drafts accepted)."""
        results, q = [], self.k + 1
        for row in self.runner.buffers.receive(sent):
            count = int(row[q, 0])
            results.append(([int(t) for t in row[:count, 0]], [float(x) for x in row[:count, 1]], count - 1))
        return results


class NgramIndex:
    """Where each n-gram (n = 1..max_n) of a growing token list last occurred, updated as tokens arrive."""

    def __init__(self, max_n: int):
        self.max_n, self.follows, self.indexed = max_n, {}, 0  # follows[ngram]: the position after it
        self.matched: tuple[int, int | None] | None = None  # (length, match) of the last call: a step asks twice

    def match(self, tokens: list[int]) -> int | None:
        """Where the latest earlier occurrence of the longest suffix (n <= max_n) that occurred before ended."""
        end = len(tokens)
        if end < self.indexed:  # the list was cut (a stop string): index it again
            self.follows, self.indexed, self.matched = {}, 0, None
        if self.matched is not None and self.matched[0] == end:
            return self.matched[1]
        for after in range(max(self.indexed, 1), end):  # every n-gram with a token after it: not the suffix
            for n in range(1, min(self.max_n, after) + 1):
                self.follows[tuple(tokens[after - n : after])] = after
        self.indexed = end
        found = next((self.follows[key] for n in range(min(self.max_n, end), 0, -1)
                      if (key := tuple(tokens[end - n :])) in self.follows), None)
        self.matched = (end, found)
        return found

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
    on_device = False  # proposes from the host's tokens: each step waits for the last one

    def __init__(self, runner, state: SpecState, k: int, vocab: int):
        self.k = k
        self.tokens, self.probs = _proposal_buffers(runner, k, vocab)
        self.host = torch.zeros(self.tokens.shape, dtype=torch.int64, pin_memory=runner.device.type == "cuda")
        self.indexes: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> NgramIndex

    def _index(self, seq) -> NgramIndex:
        return self.indexes.setdefault(seq, NgramIndex(self.MAX_N))

    def wants(self, seqs) -> bool:
        """Whether any sequence's suffix occurred before; if none did, a plain step costs less than
        verifying guesses (a speculative step with nothing accepted ran at 0.74-0.87x of plain decoding)."""
        return any(self._index(s).match(s.token_ids) is not None for s in seqs)

    def catch_up(self, seqs) -> None:
        pass  # no model, no KV

    def propose(self, seqs, size: int | None) -> None:
        n = len(seqs)
        # The last upload from `host` has been read: the step that used it was waited for.
        self.host[:n] = torch.tensor([self._index(s).continuation(s.token_ids, self.k) for s in seqs])
        tokens, probs = self.tokens[:n], self.probs[:n]
        tokens.copy_(self.host[:n], non_blocking=True)
        probs.zero_()
        probs.scatter_(2, tokens[:, :, None], 1.0)
