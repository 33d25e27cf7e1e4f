"""Speculative decoding with a draft model: propose k, verify k+1 in one target pass, accept exactly.

The draft's KV is its own region of the single pool, indexed by the target's block table, so
proposing needs no allocation. Acceptance is exact rejection sampling (kernels: accept with
min(1, p/q), else draw from norm(max(0, p - q)); all accepted: a bonus draw from p), so the
emitted tokens follow the target's distribution, and their logprobs are the target's.

A proposer is one class with `propose(runner, seqs, k, params) -> (tokens [B, k], probs [B, k, V])`;
an n-gram or EAGLE-style proposer would be another such class.
"""
from __future__ import annotations

import torch

from kernels.sampling import processed_probs

SPEC_MAX_BATCH = 32  # above this a decode step reads mostly KV, not weights: k+1 positions stop being free


def draft_seed(seed: int) -> int:
    """The draft's noise stream, independent of the target's acceptance and correction draws."""
    return hash((seed, 0xD4AF7)) & 0x7FFFFFFF  # ints only: str hashes change from process to process


class DraftModelProposer:
    def propose(self, runner, seqs, k: int, params):
        """k tokens per sequence from the draft, each drawn from the draft's processed distribution."""
        temperature, top_k, top_p, min_p = params
        seeds = runner._tensor([draft_seed(s.seed) for s in seqs], torch.int64)
        lengths = [len(s) for s in seqs]
        # First pass: whatever the draft has not seen yet (the last token, or two after a full acceptance).
        input_ids, positions, meta, starts = runner.metadata(
            seqs, [s.draft_computed for s in seqs], [s.token_ids[s.draft_computed :] for s in seqs])
        rows = runner._tensor([e - 1 for e in starts[1:]], torch.int64)
        tokens, probs = [], []
        for j in range(k):
            logits = runner.draft.logits(runner.draft(input_ids, positions, meta)[rows])
            probs.append(processed_probs(logits, temperature, top_k, top_p, min_p))
            drawn, _, _ = runner.ops.sample(logits, temperature, top_k, top_p, min_p, seeds,
                                            runner._tensor([n + j for n in lengths], torch.int64))
            tokens.append(drawn)
            if j + 1 < k:  # feed the proposal back: one token per sequence at position len + j
                input_ids, positions, meta, _ = runner.metadata(
                    seqs, [n + j for n in lengths], [[t] for t in drawn.tolist()])
                rows = torch.arange(len(seqs), device=runner.device)
        return torch.stack(tokens, 1), torch.stack(probs, 1)


@torch.inference_mode()
def speculative_step(runner, proposer, seqs, k: int):
    """One speculative step for decode sequences; returns per sequence (tokens, logprobs, accepted)."""
    temperature, top_k, top_p, min_p, seeds, positions, raw_mode = runner.sampling_tensors(seqs)
    draft_tokens, draft_probs = proposer.propose(runner, seqs, k, (temperature, top_k, top_p, min_p))
    lengths = [len(s) for s in seqs]
    proposals = draft_tokens.tolist()
    # The target scores its last token and the k proposals: k+1 query positions per sequence.
    verify = [[s.token_ids[-1]] + p for s, p in zip(seqs, proposals)]
    input_ids, pos, meta, _ = runner.metadata(seqs, [n - 1 for n in lengths], verify)
    logits = runner.model.logits(runner.model(input_ids, pos, meta))             # [B * (k+1), V]
    per_row = [t.repeat_interleave(k + 1) for t in (temperature, top_k, top_p, min_p)]
    target_probs = processed_probs(logits, *per_row).view(len(seqs), k + 1, -1)
    emitted, counts = runner.ops.rejection_sample(draft_tokens, draft_probs, target_probs, seeds, positions)
    emitted, counts = emitted.tolist(), counts.tolist()
    rows = [i * (k + 1) + j for i, c in enumerate(counts) for j in range(c)]
    tokens = [t for row, c in zip(emitted, counts) for t in row[:c]]
    picked = runner._tensor(rows, torch.int64)
    processed, raw = runner.ops.token_logprobs(logits[picked], runner._tensor(tokens, torch.int64),
                                              *(t[picked] for t in per_row))
    logprobs = torch.where(raw_mode.repeat_interleave(k + 1)[picked], raw, processed).tolist()
    out, at = [], 0
    for c in counts:
        out.append((tokens[at : at + c], logprobs[at : at + c], c - 1))
        at += c
    return out
