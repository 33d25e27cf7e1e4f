"""PoolPlanner: several pools sharing block ids, priced and carved from one buffer."""
from __future__ import annotations

import torch

from .layout import aligned_empty, carve, plan_regions, positive_int
from .mha import MhaKvPool


class PoolPlanner:
    """Pools (e.g. "target" and "draft") indexed by the same block ids.

    A block costs the sum of the pools' entry bytes; the buffer holds one region
    per pool, placed by `plan_regions`. Sizing and carving read the same plan.
    """

    def __init__(self, pools: dict[str, MhaKvPool], align: int = 256):
        if not pools:
            raise ValueError("pools must name at least one MhaKvPool")
        self.pools, self.align = dict(pools), positive_int(align, "align")
        self.buf: torch.Tensor | None = None
        self.blocks = 0

    @property
    def block_bytes(self) -> int:
        return sum(pool.entry_bytes for pool in self.pools.values())

    def region_sizes(self, blocks: int) -> list[int]:
        return [pool.pool_bytes(blocks) for pool in self.pools.values()]

    def total_bytes(self, blocks: int) -> int:
        return plan_regions(self.region_sizes(blocks), self.align)[1]

    def blocks_for_budget(self, budget: int) -> int:
        """The most blocks whose carved buffer fits in `budget` bytes."""
        blocks = budget // self.block_bytes
        while blocks > 0 and self.total_bytes(blocks) > budget:
            blocks -= 1  # alignment padding: a few steps at most
        if blocks == 0:
            raise ValueError(f"a KV budget of {budget} bytes holds no block; one block needs {self.total_bytes(1)} bytes")
        return blocks

    def allocate(self, blocks: int, device=None, buf: torch.Tensor | None = None) -> torch.Tensor:
        """Carve `buf` (or a new aligned buffer) into every pool's region."""
        sizes = self.region_sizes(positive_int(blocks, "blocks"))
        if buf is None:
            buf = aligned_empty(plan_regions(sizes, self.align)[1], device, self.align)
        for pool, region in zip(self.pools.values(), carve(buf, sizes, self.align)):
            pool.allocate(blocks, buf=region)
        self.buf, self.blocks = buf, blocks
        return buf

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        for pool in self.pools.values():
            pool.copy_blocks(src, dst)

    def release(self) -> None:
        for pool in self.pools.values():
            pool.release()
        self.buf, self.blocks = None, 0
