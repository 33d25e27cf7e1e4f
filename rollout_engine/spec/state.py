"""SpecState: where each batch row of a speculative step stands, on the device.

Every pass reads where its rows stand from here (lengths, last tokens, the draft's KV extent), and
each pass advances it: the draft's k passes feed each other's tokens, and the verify pass moves every
row past what it emitted. So a step needs nothing from the host but block tables, and with a draft
model the next step is launched before this one's tokens are read.
"""
from __future__ import annotations

import torch

from ..model import AttentionMetadata

NGRAM = "[ngram]"  # the draft_model that selects prompt lookup instead of a model (vLLM's spelling)
SPEC_MAX_BATCH = 32  # above this a decode step reads mostly KV, not weights: k+1 positions stop being free


DRAFT_STREAMS = 0x5D4AF7 << 32  # flips high bits of a sample's seed: below 2**63, as seeds are


def draft_seed(seed: int) -> int:
    """The draft's noise stream, apart from the target's acceptance and correction draws. Only high bits change,
    so the draft streams of a request's samples are as distinct as their seeds (sampling.noise_key)."""
    return seed ^ DRAFT_STREAMS


def max_batch(runner) -> int:
    return min(SPEC_MAX_BATCH, runner.buffers.max_rows)


def proposal_buffers(runner, k: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A proposer's `tokens` [rows, k] and their distributions `probs` [rows, k, vocab], which verify reads."""
    rows = max_batch(runner)
    return (torch.zeros(rows, k, dtype=torch.int64, device=runner.device),
            torch.zeros(rows, k, vocab, dtype=torch.float32, device=runner.device))


class SpecState:
    """Where each batch row stands in its sequence, on the device, so one speculative step can follow
    another without the host: `lens` (tokens the sequence has), `last2` (its last two), `draft_len` (tokens
    the draft's KV holds), `window` (the two tokens the next draft pass feeds), `j` (which draft pass),
    `valid` (a real row, not a graph bucket's padding) and the draft's and the target's noise seeds.
    `write` sets it from the sequences while no step is in flight; each draft pass advances `window`, `j`
    and `draft_len`, each verify pass `lens`, `last2` and `draft_len` (to what acceptance left valid)."""

    def __init__(self, runner):
        rows, device = max_batch(runner), runner.device
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
        # padding rows own no query (they follow the sequences): their attention reads nothing, and the rows that hold
        # tokens (AttentionMetadata.rows) leave them out of an fp8 activation's scale
        starts = torch.arange(0, (size + 1) * q, q, dtype=torch.int32, device=positions.device)
        starts = torch.minimum(starts, self.valid[:size].sum(dtype=torch.int32) * q)
        return AttentionMetadata(slots, tables, (positions[:, -1] + 1).int(), starts, q)
