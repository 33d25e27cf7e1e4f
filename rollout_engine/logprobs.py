"""Logprobs beyond the sampler's one per row: top-k alternatives, "temperature" logprobs of a truncated
distribution, and prompt logprobs, for the rows that ask.

The sampler (its kernels, under CUDA graphs on the GPU) reports each drawn token's "processed" or "raw"
logprob and nothing else. A sequence that asks for more takes eager steps: each asking row's whole
log-probability vector is computed (rollout_kernels.sampling.mode_logprobs) to pick its top k, whose logprobs and its
token's come from the sampler's own op (ops.token_logprobs), and only those [rows, 1 + 2k] come back. A batch in
which nobody asks is untouched.
"""
from __future__ import annotations

import torch

from rollout_kernels.sampling import mode_logprobs

# Logits scored at once while a prompt is scored: a long prompt's positions go in pieces of about this many
# floats (x the log-softmax's few temporaries), never prompt_len x vocab.
PIECE_ELEMENTS = 1 << 24


def eager_logprobs(params) -> bool:
    """Whether a sequence's sampled-token logprobs need more than the sampler gives: top-k alternatives, or a
    "temperature" logprob where top-k/top-p/min-p truncate (the sampler reports the truncated distribution)."""
    if params.logprobs is None:
        return False
    return params.logprobs > 0 or (params.logprobs_mode == "temperature" and params.truncates)


def reduce_rows(logits, tokens, params, prompt: bool, k: int, token_logprobs) -> torch.Tensor:
    """[R, 1 + 2k] float64 on the device: per row of logits [R, V], the logprob of `tokens` [R], then the k
    largest logprobs and their token ids. `params`: each row's SamplingParams. `prompt`: score given prompt
    tokens (no truncation: "raw" or "temperature" only), else sampled ones. `token_logprobs`: the engine's op
    (ops.token_logprobs), which gives every value here, so each has the bits the sampler gives that token
    (on the GPU its vocabulary split, not torch's log-softmax); torch's logprobs only pick the top k."""
    modes = [p.logprobs_mode if not prompt or p.logprobs_mode == "raw" else "temperature" for p in params]
    out = torch.empty(len(params), 1 + 2 * k, dtype=torch.float64, device=logits.device)
    for mode in set(modes):
        at = [i for i, m in enumerate(modes) if m == mode]
        rows = torch.tensor(at, device=logits.device)

        def per_row(name, dtype, unfiltered=None):
            values = [getattr(params[i], name) if mode != "temperature" or unfiltered is None else unfiltered
                      for i in at]
            return torch.tensor(values, dtype=dtype, device=logits.device)

        some = logits[rows] if len(at) < len(modes) else logits  # one mode (the usual case): no copy
        # "temperature" is the untruncated distribution: the filters off. "raw" keeps them, which change no raw
        # logprob but are what the sampler scanned with (its truncated rows take another path: other bits).
        sampling = (per_row("temperature", torch.float32), per_row("top_k", torch.int64, -1),
                    per_row("top_p", torch.float32, 1.0), per_row("min_p", torch.float32, 0.0))
        ids = [tokens[rows]]
        if k:
            ids += list(mode_logprobs(some, *sampling, mode).topk(k, dim=1).indices.t().contiguous())
        values = []
        for column in ids:
            processed, raw = token_logprobs(some, column, *sampling)
            values.append(raw if mode == "raw" else processed)
        out[rows] = torch.stack([v.double() for v in values] + [i.double() for i in ids[1:]], dim=1)
    return out


def top_dict(row, k: int) -> dict[int, float]:
    """The first k of a reduce_rows row's top alternatives, as {token_id: logprob}, most likely first."""
    width = (len(row) - 1) // 2
    return {int(row[1 + width + j]): float(row[1 + j]) for j in range(k)}


def asked(params, token: int, sampler_logprob: float, row) -> tuple[float, dict[int, float]]:
    """(logprob, top-k) of a sampled `token` whose sequence asks for more, from its reduce_rows row: the sampler's
    own logprob where it reports the mode ("processed", "raw": asking for top-k never changes a token's
    logprob), the row's where it does not ("temperature"). The token's entry among its top k is that logprob:
    the sampler may have split the vocabulary otherwise for its larger batch (ulps apart)."""
    logprob = float(row[0]) if params.logprobs_mode == "temperature" else sampler_logprob
    top = top_dict(row, params.logprobs)
    if token in top:
        top[token] = logprob
    return logprob, top


def sampled_draws(logits, tokens, seqs, drawn, token_logprobs) -> list[tuple[int, float, dict | None]]:
    """(token, logprob, top-k) per sampled row: the sampler's `drawn` [R, 2] (host), completed for the rows whose
    sequence `seqs[r]` asks for more from logits [R, V] and tokens [R] (device); `token_logprobs`: as in
    reduce_rows."""
    draws = [(int(t), float(lp), None) for t, lp in drawn]
    asking = [r for r, seq in enumerate(seqs) if seq.eager_logprobs]
    if asking:
        rows = torch.tensor(asking, device=logits.device)
        params = [seqs[r].params for r in asking]
        block = reduce_rows(logits[rows], tokens[rows], params, False, max(p.logprobs for p in params),
                            token_logprobs).cpu()
        for r, p, row in zip(asking, params, block.numpy()):
            draws[r] = (draws[r][0], *asked(p, *draws[r][:2], row))
    return draws


def score_prompts(model, hidden, starts, seqs, begins, counts, token_logprobs) -> None:
    """Append to each asking sequence's `prompt_logprobs` the prompt tokens this step's positions predict:
    seqs[i] computed positions begins[i].. (counts[i] of them) at hidden rows starts[i]..; position t's logits
    score prompt token t + 1. `token_logprobs`: as in reduce_rows."""
    rows, targets, owners = [], [], []
    for seq, begin, count, start in zip(seqs, begins, counts, starts):
        if not seq.scores_prompt:
            continue
        first = len(seq.prompt_logprobs) - 1  # the next position to score
        # the prefix cache is off for these sequences, and a recomputed prefix is not scored twice
        assert begin <= first, "a prompt position was skipped while scoring the prompt"
        positions = range(first, min(begin + count, seq.num_prompt_tokens - 1))
        rows += [start + p - begin for p in positions]
        targets += [seq.token_ids[p + 1] for p in positions]
        owners += [seq] * len(positions)
    if not rows:
        return
    piece, k = max(1, PIECE_ELEMENTS // model.cfg.vocab_size), max(s.params.prompt_logprobs for s in owners)
    blocks = []
    for first in range(0, len(rows), piece):
        at = torch.tensor(rows[first : first + piece], device=hidden.device)
        tokens = torch.tensor(targets[first : first + piece], device=hidden.device)
        params = [s.params for s in owners[first : first + piece]]
        blocks.append(reduce_rows(model.logits(hidden[at]), tokens, params, True, k, token_logprobs))
    block = torch.cat(blocks).cpu().numpy()
    for seq, target, row in zip(owners, targets, block):
        seq.prompt_logprobs.append({target: float(row[0])} | top_dict(row, seq.params.prompt_logprobs))
