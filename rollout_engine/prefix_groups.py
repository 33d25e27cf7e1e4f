"""PrefixGroups: which sequences of a decode step share a prompt, so attention reads it once per group.

The n samples of a prompt (SamplingParams.n, or copies sent as separate requests) hold its KV in the same
blocks. rollout_kernels/shared_prefix.py attends a group's shared blocks in one program for all its members;
here the model runner's host side finds the groups in the step's block tables and writes them beside the
other step inputs (StepBuffers: prefix_members, prefix_keys, prefix_first_key).

A step takes the shared path only when the keys it saves are worth the merge of more partials. On an H200
(1.7B shape, 8 samples a prompt, kernel replays, docs/benchmarks.md) its attention is this many times as fast as
plain decode attention:
- at 128-256 rows, 1.06-1.47x (bf16 cache 1.06-1.33x, fp8 1.16-1.47x) with a quarter or more of the keys a
  group's repeats; about 0.9x with nothing shared;
- at 16-64 rows, 1.3-2.8x with prompts of 1k-4k keys and 256 of each sample's own (70-82% of the keys
  repeats), the prefix cut into several key splits (shared_prefix.prefix_splits); 1.06-1.78x at 48-96 rows
  with prompts of 512 (58%); but 0.8-1.0x at 16-64 rows with prompts of 256 (44%), where the merge of the
  partials costs about what the repeats save.
Steps under 16 rows stay plain (unmeasured; their graphs are the plain ones).
"""
from __future__ import annotations

from rollout_kernels.shared_prefix import members_per_group, plan_shared_prefixes

# Whether decode steps may take the shared path; False runs plain decode attention, for comparisons. Read at
# each step.
ENABLED = True
# The share of a step's keys that groups' repeats must make up, by the step's graph size: from 16 rows (also the
# smallest of ModelRunner.shared_graphs) and from 128 rows on (see above).
MIN_SAVED = {16: 0.5, 128: 0.25}


class PrefixGroups:
    def __init__(self, query_heads_per_kv: int | None, block_size: int, buffers):
        """`query_heads_per_kv` None: never (batch-invariant mode, whose attention splits keys at fixed places
        for every row alike; tensor-parallel workers); members_per_group says whether the heads leave room."""
        self.members = members_per_group(query_heads_per_kv) if query_heads_per_kv else 0
        self.block_size, self.buffers = block_size, buffers
        self.min_rows = min(MIN_SAVED)  # the smallest step, and the smallest of ModelRunner.shared_graphs

    def write(self, rows: int, size: int) -> bool:
        """Host twin: the groups among the step's first `rows` sequences (their block tables and lengths are
        written), padded to a step of `size` rows. False, writing nothing, when the step is to read every
        sequence's keys itself."""
        if not (ENABLED and self.members and size >= self.min_rows):
            return False
        h = self.buffers.host
        lens = h["seq_lens"][:rows]
        groups, keys, first_key = plan_shared_prefixes(h["block_tables"][:rows], lens, self.block_size, self.members)
        saved = int(((groups >= 0).sum(1) - 1) @ keys) if keys.size else 0
        if saved < MIN_SAVED[max(r for r in MIN_SAVED if r <= size)] * int(lens.sum()):
            return False
        h["prefix_members"][: keys.size, : self.members] = groups
        h["prefix_keys"][: size // 2] = 0
        h["prefix_keys"][: keys.size] = keys
        h["prefix_first_key"][:size] = 0
        h["prefix_first_key"][:rows] = first_key
        return True

    def clear(self) -> None:
        """No group (a capture's warm-up reads whatever the host twin holds)."""
        self.buffers.host["prefix_keys"][:] = 0
        self.buffers.host["prefix_first_key"][:] = 0
