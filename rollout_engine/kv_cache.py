"""The engine's side of the single KV pool: declare it from the models, size it, carve it, bind it, and
release and bring it back around a sleep."""
from __future__ import annotations

import math
import os

import torch

from pool_layout import MhaKvPool, PoolPlanner, PoolRows, aligned_empty

from .errors import NoRoomError
from .capture_fence import CAPTURES
from .memory import DeviceMemory

CPU_KV_CAP = 4 << 30  # a fraction of host RAM, but never more than this on the CPU


def available_bytes(device: torch.device) -> int:
    """Free memory the KV fraction applies to: free device memory, or available RAM on the CPU."""
    if device.type == "cuda":
        CAPTURES.empty_cache()  # idle cached blocks (a dropped engine's among them) are free for the taking
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) * 1024 if "MemAvailable" in info else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def kv_budget(kv_cache_memory, device: torch.device) -> int:
    """Bytes for the pool: `kv_cache_memory` is a fraction in (0, 1] of free memory, or an int of bytes."""
    if isinstance(kv_cache_memory, bool) or not isinstance(kv_cache_memory, (int, float)):
        raise ValueError(f"kv_cache_memory must be a fraction in (0, 1] or an int of bytes, got {kv_cache_memory!r}")
    if isinstance(kv_cache_memory, int):
        if kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={kv_cache_memory} bytes must be > 0")
        return kv_cache_memory
    if not 0 < kv_cache_memory <= 1:
        raise ValueError(f"kv_cache_memory={kv_cache_memory} must be a fraction in (0, 1] or an int of bytes")
    budget = int(kv_cache_memory * available_bytes(device))
    return min(budget, CPU_KV_CAP) if device.type == "cpu" else budget


class KVCache:
    """Pools declared from the models' attention modules (one walk), carved from one buffer, bound by rows."""

    def __init__(self, models: dict, block_size: int, kv_dtype: torch.dtype, device: torch.device,
                 memory: DeviceMemory):
        self.models, self.device, self.memory = models, device, memory
        self.buf: torch.Tensor | None = None  # the one buffer; kept (paused) across a sleep where addresses stay
        self.asleep = False
        self.configured_blocks: int | None = None  # the first start's count: a resizing wake grows back to it
        self.rows = PoolRows().walk(self._pairs())
        counts = self.rows.row_counts()
        self.planner = PoolPlanner({
            # this rank's KV heads (all of them on one device): the same declaration, per-rank geometry
            kind: MhaKvPool(counts[kind], block_size, model.num_kv_heads, model.cfg.head_dim, kv_dtype)
            for kind, model in models.items()
        })

    @property
    def pools(self) -> dict:
        """Model kind -> its MhaKvPool: layer L's K of the target is `kv.pools["target"].kv_views(L)[0]`."""
        return self.planner.pools

    def _pairs(self):
        for kind, model in self.models.items():
            for module in model.attention_modules():
                yield kind, module

    def blocks_for(self, budget: int, max_num_seqs: int, max_model_len: int) -> int:
        """Blocks the budget buys, but no more than `max_num_seqs` sequences of `max_model_len` could use."""
        block_size = next(iter(self.planner.pools.values())).block_size
        useful = max_num_seqs * math.ceil(max_model_len / block_size)
        try:
            return min(self.planner.blocks_for_budget(budget), useful)
        except ValueError as err:
            raise ValueError(f"{err} (kv_cache_memory gives the budget; block_size={block_size} sets the block): "
                             "give kv_cache_memory more bytes or a larger fraction, or a smaller block_size") from None

    def start(self, blocks: int) -> None:
        """Carve `blocks` blocks (in a fresh buffer unless a paused one is being resumed) and bind them."""
        if self.configured_blocks is None:
            self.configured_blocks = blocks
        if self.buf is None:
            with self.memory.region("kv_cache"):
                self.buf = aligned_empty(self.planner.total_bytes(blocks), self.device)
        self.planner.allocate(blocks, self.device, self.buf)
        for pool in self.planner.pools.values():
            for row in range(pool.layers):
                scales = pool.scale_views(row)
                for scale in scales or ():
                    scale.fill_(1.0)  # finite where no token was written yet; each store writes its own
        self.bind()

    def bind(self) -> None:
        """Re-walk the modules and hand each its rows' views (the same path on first start and on wake)."""
        self.rows.invalidate()
        self.rows.walk(self._pairs())
        for kind, module in self._pairs():
            pool = self.planner.pools[kind]
            row = self.rows[kind][module]
            module.k_cache, module.v_cache = pool.kv_views(row)
            module.k_scale, module.v_scale = pool.scale_views(row) or (None, None)

    def sleep(self) -> None:
        """Release the pool: the memory is paused or freed; every module drops its views. The pause, the one step
        that can fail, goes first: where it fails the pool is as it was, bound and awake."""
        if self.memory.keeps_addresses:
            self.memory.pause("kv_cache")  # the buffer keeps its addresses for wake
        else:
            self.buf = None
        for _, module in self._pairs():
            module.k_cache = module.v_cache = module.k_scale = module.v_scale = None
        self.planner.release()
        self.asleep = True

    def blocks_fitting(self, blocks: int, free: int | None = None) -> int:
        """How many of `blocks` a wake could carve in `free` bytes (None: free now): all where they fit, else as many
        as do (0: not one)."""
        free = available_bytes(self.device) if free is None else free
        if self.planner.total_bytes(blocks) <= free:
            return blocks
        return min(blocks, self.planner.blocks_for_budget(free)) if free >= self.planner.total_bytes(1) else 0

    def wake(self, blocks: int, allow_resize: bool) -> tuple[int, bool]:
        """Re-carve and re-bind the pool of `blocks` blocks; returns (blocks, whether the pool moved).

        Without room for `blocks`, raise NoRoomError naming the bytes (the pool stays asleep), or with
        allow_resize carve as many as fit. More blocks than the kept buffer holds (a pool that a resizing wake
        shrank, growing back) take a new buffer."""
        need, free = self.planner.total_bytes(blocks), available_bytes(self.device)
        if self.buf is not None and self.buf.numel() < need <= free:
            self.buf = None
            self.memory.forget("kv_cache")
        elif need > free:
            if not allow_resize:
                raise NoRoomError(f"waking the KV pool needs {need} bytes for {blocks} blocks but only {free} bytes "
                                  "are free; free memory and wake again, or wake(allow_resize=True)")
            blocks = self.blocks_fitting(blocks, free)
            if not blocks:
                raise NoRoomError(f"even one KV block needs {self.planner.total_bytes(1)} bytes; {free} are free")
            self.buf = None  # a smaller buffer, at new addresses
            self.memory.forget("kv_cache")
        elif self.buf is not None:
            self.memory.resume("kv_cache")
        moved = self.buf is None
        self.start(blocks)
        self.asleep = False
        return blocks, moved

    @property
    def num_blocks(self) -> int:
        return self.planner.blocks

    @property
    def nbytes(self) -> int:
        return 0 if self.asleep or self.planner.buf is None else self.planner.buf.numel()
