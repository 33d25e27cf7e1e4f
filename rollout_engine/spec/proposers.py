"""Proposers: where a speculative step's k draft tokens come from.

A proposer fills `tokens` [B, k] and their distributions `probs` [B, k, V], which verification reads.
The draft model's (`DraftModelProposer`) and prompt lookup (`NgramProposer`, `draft_model=NGRAM`) are
two; an EAGLE-style head would be a third, written to the `Proposer` protocol.
"""
from __future__ import annotations

import weakref
from typing import Protocol

import torch

from ..cuda_graphs import StepGraphs
from .state import SpecState, max_batch, proposal_buffers


class Proposer(Protocol):
    tokens: torch.Tensor  # [rows, k] proposed tokens
    probs: torch.Tensor   # [rows, k, vocab] the distribution each was drawn from
    on_device: bool       # proposes from SpecState on the device: a step may be launched before the last is read
    graphs: StepGraphs | None  # what it captures, if anything

    def wants(self, seqs) -> bool:
        """Whether proposing can pay for these sequences; the engine decodes plainly when not."""

    def catch_up(self, seqs) -> None:
        """Bring whatever state the proposer keeps (a draft's KV) up to the sequences."""

    def propose(self, seqs, size: int | None) -> None:
        """k tokens per sequence into `tokens` and `probs` (`size`: the graph bucket, or None: eager)."""


class DraftModelProposer:
    """k autoregressive draft passes, each over the two newest tokens of every sequence (the first pass
    after a full acceptance needs both; otherwise the older one's KV is there and is not written again),
    so every pass has one shape and reads its inputs from SpecState on the device."""

    on_device = True  # proposes from device state: a step can be launched before the last one is read

    def __init__(self, runner, state: SpecState, k: int, vocab: int, use_graphs: bool):
        self.runner, self.state, self.k = runner, state, k
        self.tokens, self.probs = proposal_buffers(runner, k, vocab)
        self.graphs = StepGraphs(self.graph_step, max_batch(runner)) if use_graphs else None

    def _pass(self, size: int, width: int, filters) -> None:
        """One draft forward; the token drawn after each sequence's newest one becomes proposal j."""
        r, st = self.runner, self.state
        positions = st.lens[:size, None] - 2 + st.j + st.two  # the window's positions
        meta = st.metadata(r, size, positions, positions >= st.draft_len[:size, None], width)
        hidden = r.draft(st.window[:size].flatten(), positions.flatten(), meta)
        logits = r.draft.logits(hidden.view(size, 2, -1)[:, 1], meta.rows // 2)  # one row a sequence
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

    def graph_step(self, size: int) -> None:
        """What a draft graph captures: one pass over `size` rows (the sequences, then padding)."""
        self._pass(size, self.runner.buffers.max_blocks, filters=False)

    def wants(self, seqs) -> bool:
        return True  # a draft model always has proposals

    def catch_up(self, seqs) -> None:
        """After plain decode steps (which do not run the draft) the draft's KV must reach the first pass."""
        if any(len(s) - s.draft_computed > 2 for s in seqs):
            self.runner.draft_catch_up(seqs, [len(s) - 1 for s in seqs])

    def propose(self, seqs, size: int | None) -> None:
        """k tokens per sequence into `tokens`, each drawn from the draft's processed distribution `probs`."""
        for _ in range(self.k):
            if size is not None:
                self.graphs.run(size)
            else:
                self._pass(len(seqs), max(len(s.block_table) for s in seqs), filters=None)


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
        self.tokens, self.probs = proposal_buffers(runner, k, vocab)
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
