"""Decode attention that reads a prompt shared by a group of sequences once for the whole group.

The n samples of a GRPO prompt hold the prompt's KV in the same blocks (the prefix cache shares them). Plain
decode attention reads those blocks once per sample: eight times for n = 8, and each time through the e4m3 ->
fp16 conversion of an fp8 cache. Here a group of up to MEMBERS sequences whose block tables start with the same
blocks is attended in two parts:
- the shared prefix, once for the group: one program per (group, kv head, key split of the prefix) holds all
  its members' query rows (MEMBERS x query heads per kv head = one 16-row tile, which plain decode fills with
  only 2 or 4 rows);
- each sequence's own keys after it (its keys from `first_key` on);
both in one launch of attention._attention_kernel with SUFFIX (the prefixes first, so that the suffixes' shorter
programs fill the SMs around them), and the parts are merged as the split-K partials are
(attention._merge_kernel).

plan_shared_prefixes finds the groups on the host from the block tables a step uploads."""
from typing import NamedTuple

import numpy as np
import torch
import triton

from . import attention

TILE_ROWS = 16  # query rows of the prefix program: the decode tile's (attention._config)
MAX_MEMBERS = 8


class SharedPrefix(NamedTuple):
    """A decode step's groups: `members` [G, MAX_MEMBERS] int32 (batch rows, -1 = none), `keys` [G] int32 (the
    keys every member shares, 0 = an unused group), `first_key` [S] int32 (a row's group's keys, else 0)."""

    members: torch.Tensor
    keys: torch.Tensor
    first_key: torch.Tensor


def members_per_group(query_heads_per_kv: int) -> int:
    """Sequences a group holds: as many as fill the 16-row tile, at most MAX_MEMBERS; 0 when one sequence's
    heads fill it alone (nothing to share a tile with)."""
    members = min(MAX_MEMBERS, TILE_ROWS // query_heads_per_kv)
    return members if members >= 2 else 0


def plan_shared_prefixes(tables: np.ndarray, seq_lens: np.ndarray, block_size: int, members: int):
    """Groups of rows whose tables start with the same blocks, `members` at most a group, in row order within
    equal first blocks. Returns (groups [G, members] rows, keys [G], first_key [rows]) as numpy int32: a group's
    keys are the whole blocks all its tables share, below each member's newest key (which is its own)."""
    rows = tables.shape[0]
    first_key = np.zeros(rows, np.int32)
    if rows < 2 or members < 2:
        return np.zeros((0, members), np.int32), np.zeros(0, np.int32), first_key
    order = np.argsort(tables[:, 0], kind="stable")
    ordered = tables[order]
    run_starts = np.flatnonzero(np.r_[True, ordered[1:, 0] != ordered[:-1, 0]])
    run_of = np.repeat(np.arange(run_starts.size), np.diff(np.r_[run_starts, rows]))
    slot = np.arange(rows) - run_starts[run_of]  # place within its run
    chunk_starts = np.flatnonzero((slot % members) == 0)  # runs cut into chunks of `members`, in order
    chunk_of = np.repeat(np.arange(chunk_starts.size), np.diff(np.r_[chunk_starts, rows]))
    leader = ordered[chunk_starts[chunk_of]]
    same = ordered == leader
    common = np.where(same.all(1), tables.shape[1], same.argmin(1))  # leading blocks equal to the leader's
    shared_blocks = np.minimum.reduceat(common, chunk_starts)
    newest = np.minimum.reduceat(seq_lens[order].astype(np.int64) - 1, chunk_starts)
    keys = np.minimum(shared_blocks * block_size, newest // block_size * block_size)
    size = np.diff(np.r_[chunk_starts, rows])
    used = np.flatnonzero((size >= 2) & (keys > 0))
    groups = np.full((used.size, members), -1, np.int32)
    for g, c in enumerate(used):
        rows_of = order[chunk_starts[c]:chunk_starts[c] + size[c]]
        groups[g, :rows_of.size] = rows_of
        first_key[rows_of] = keys[c]
    return groups, keys[used].astype(np.int32), first_key


def prefix_splits(num_seqs: int, members: int, kv_heads: int, max_context: int, device) -> int:
    """Key splits of a group's prefix: about one program an SM counting full groups, at most 8, each at least 256
    keys of the longest context (host values only: the grid is fixed for CUDA graphs, and a split's programs
    cost time even where the prefix leaves them no keys). On an H200 (1.7B shape, 8 samples a prompt,
    docs/benchmarks.md) it is within 20% of the fastest of 1/2/4/8 splits at 16-256 rows with prompts of 1k keys
    (512 keys: at 48-256 rows), and 17-43% slower than the fastest (more splits) with 4k."""
    if device.type != "cuda" or members < 2:
        return 1
    programs = max(1, num_seqs // members * kv_heads)
    return max(1, min(8, attention.sm_count(device) // programs, max_context // 256))


def shared_prefix_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scale, v_scale,
                            shared: SharedPrefix, splits_of_prefix: int | None = None):
    """paged_attention_triton for a decode step (one query a sequence) with `shared` groups: each sequence's
    own keys split as plain decode splits them, its group's prefix in `splits_of_prefix` more partials
    (prefix_splits by default), all merged."""
    tokens, heads, head_dim = q.shape
    num_seqs, block_size, kv_heads = seq_lens.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = heads // kv_heads
    block_m, block_n, warps, stages = attention._config(group, head_dim, q.element_size(), k_scale is not None)
    assert group * shared.members.shape[1] <= block_m, "a group's query rows must fit one tile"
    max_context = block_tables.shape[1] * block_size
    splits = attention._num_splits(num_seqs * kv_heads, 1, max_context, q.device)
    prefix = splits_of_prefix or prefix_splits(num_seqs, shared.members.shape[1], kv_heads, max_context, q.device)
    part = torch.empty((splits + prefix, tokens, heads, head_dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((splits + prefix, tokens, heads), dtype=torch.float32, device=q.device)
    attention._attention_launch((1, num_seqs * kv_heads, splits + prefix), q, k_cache, v_cache, part, lse, k_scale,
                                v_scale, block_tables, seq_lens, query_start_loc, scale, shared=shared,
                                BLOCK_M=block_m, BLOCK_N=block_n, NUM_SPLITS=splits, PREFIX_SPLITS=prefix, CHUNK=0,
                                FOLD=False, num_warps=warps, num_stages=stages)
    out = torch.empty_like(q)
    attention._merge_kernel[(tokens * heads,)](part, lse, out, tokens * heads * head_dim, tokens * heads,
                                               NUM_SPLITS=splits + prefix,
                                               SPLITS_POW2=triton.next_power_of_2(splits + prefix), HEAD_DIM=head_dim,
                                               PDL=False)
    return out
