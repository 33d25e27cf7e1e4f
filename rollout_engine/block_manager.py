"""Reference-counted KV blocks with prefix caching by hashed full blocks.

A block's hash covers its tokens and every token before it, so equal hashes mean
equal KV. A block is published in the cache only after its KV is computed, so a
later step's hit never reads a block still being filled; within the step that fills
it, a block is offered only to prompts in that step (`announce`), whose attention
runs after the step's KV stores. Freed blocks keep their contents and
hash until reused (least recently freed first), so later requests can hit them.

New weights flush the cache (`flush`) and start a new epoch. A sequence publishes only in the epoch it was
admitted in: KV computed across a flush mixes old weights into every later token of the sequence (through
attention), so none of its blocks may serve a request that expects the new weights.

A sequence's `block_table` list is only ever appended to, or replaced by a new list (free,
fork): the model runner rewrites just the new tail of a row that still holds the same list.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from .sequence import Sequence

ROOT = b""  # the hash before a sequence's first block


def block_hash(prev: bytes, tokens) -> bytes:
    """A digest of the block's tokens and (through `prev`) every token before it. Cryptographic, since a hit is
    taken on the hash alone: Python's hash of a tuple of ints is unsalted and invertible, so a client could craft a
    prompt whose block collides with another's cached one and have its KV served in that one's place."""
    return hashlib.blake2b(prev + array("q", tokens).tobytes(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size, self.enable_prefix_caching = block_size, enable_prefix_caching
        self.epoch = 0  # flushes so far: the cache's contents all come from this epoch's weights
        self.reset(num_blocks)

    def reset(self, num_blocks: int) -> None:
        """Every block free and uncached, `num_blocks` of them (a pool re-sized by a wake)."""
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}    # block id -> hash, for published blocks
        self.block_of: dict[bytes, int] = {}   # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    @property
    def num_cached(self) -> int:
        """Blocks whose contents the prefix cache can serve again (held by sequences, or free until taken)."""
        return len(self.hash_of)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        if block in self.hash_of:  # evict its cached contents
            del self.block_of[self.hash_of.pop(block)]
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None

    def match_prefix(self, seq: Sequence, filling: dict[bytes, int] | None = None) -> None:
        """Attach the cached blocks that cover a new sequence's leading full blocks (its KV starts in this epoch),
        and those that the step being scheduled fills (`filling`, from `announce`)."""
        seq.cache_epoch = self.epoch
        if not self.enable_prefix_caching or seq.scores_prompt:  # a cached position has no logits to score
            return
        prev = ROOT
        # Keep at least the last token uncomputed: its logits are what admission is for.
        for start in range(0, len(seq) - 1 - self.block_size + 1, self.block_size):
            h = block_hash(prev, seq.token_ids[start : start + self.block_size])
            block = self.block_of.get(h)
            if block is None and filling:  # empty with a draft model: announce offers nothing then
                block = filling.get(h)
            if block is None:
                break
            if self.ref_counts[block] == 0:
                del self.free[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
            seq.block_hashes.append(h)
            prev = h
        seq.num_computed = seq.draft_computed = len(seq.block_table) * self.block_size
        if not seq.admitted:  # after a preemption a sequence finds its own blocks again: not what the metric counts
            seq.num_cached = min(seq.num_computed, seq.num_prompt_tokens)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold `num_tokens` more computed tokens."""
        total = -(-(seq.num_computed + num_tokens) // self.block_size)
        return max(0, total - len(seq.block_table))

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` room for `num_tokens` more tokens; False (and nothing taken) if blocks run out."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free:
            return False
        if need:
            seq.block_table += [self._take() for _ in range(need)]
        return True

    def announce(self, seq: Sequence, num_tokens: int, filling: dict[bytes, int]) -> None:
        """Offer the blocks that `num_tokens` more computed tokens of `seq` fill, in the step being scheduled, to
        the sequences admitted after it in that step (`filling`: hash -> block). A forward stores every token's
        KV of a layer before that layer's attention reads any, so a request that repeats a prompt prefilled in
        the same step shares its blocks instead of computing them again. Not with a draft model: its KV of
        the prompt comes only when the draft follows the prefill."""
        if not self.enable_prefix_caching or seq.uses_draft or seq.cache_epoch != self.epoch:
            return
        for i, h in self._unhashed(seq, (seq.num_computed + num_tokens) // self.block_size):
            filling.setdefault(h, seq.block_table[i])

    def _unhashed(self, seq: Sequence, full: int):
        """(index, hash) of `seq`'s blocks past those in `seq.block_hashes`, up to `full` blocks: the hash chain
        continued."""
        bs = self.block_size
        prev = seq.block_hashes[-1] if seq.block_hashes else ROOT
        for i in range(len(seq.block_hashes), full):
            prev = block_hash(prev, seq.token_ids[i * bs : (i + 1) * bs])
            yield i, prev

    def publish(self, seq: Sequence) -> None:
        """Hash the blocks that `seq`'s computed tokens have filled and offer them to later requests, unless a
        flush came after its admission."""
        current = seq.cache_epoch == self.epoch
        for i, h in list(self._unhashed(seq, seq.kv_ready // self.block_size)):
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if self.enable_prefix_caching and current and h not in self.block_of and block not in self.hash_of:
                self.block_of[h], self.hash_of[block] = block, h

    def fork_cost(self, parent: Sequence) -> int:
        """Free blocks a fork of `parent` takes: one copy of a partly filled last block."""
        return int(parent.num_computed % self.block_size != 0)

    def fork(self, parent: Sequence, child: Sequence) -> tuple[int, int] | None:
        """Share the parent's full blocks with `child` and copy its partial last block.

        The caller checks `fork_cost` against `num_free` first. Returns the (src, dst)
        block copy the pool must make before the child's next step, or None."""
        partial = self.fork_cost(parent) == 1
        shared = parent.block_table[:-1] if partial else parent.block_table
        for block in shared:
            self.ref_counts[block] += 1
        child.block_table = list(shared)
        if not partial:
            return None
        dst = self._take()
        child.block_table.append(dst)
        return parent.block_table[-1], dst

    def free_seq(self, seq: Sequence) -> None:
        for block in reversed(seq.block_table):  # tail blocks go first in the reuse order
            self._release(block)
        seq.block_table, seq.num_computed, seq.draft_computed, seq.block_hashes = [], 0, 0, []

    def flush(self) -> None:
        """Forget every cached hash (after new weights the old KV is wrong); sequences admitted before stop
        publishing."""
        self.epoch += 1
        self.hash_of.clear()
        self.block_of.clear()
