"""MhaKvPool: the K/V cache of one attention geometry, declared as entry fields."""
from __future__ import annotations

import torch

from .arena import LayerArena
from .fields import EntryField
from .layout import Placement, aligned_empty, positive_int, resolve_dtype, place


class MhaKvPool:
    """K and V of `layers` attention layers; one entry is one block of `block_size` tokens.

    1-byte KV dtypes add a float32 scale per (token, kv head): max|x| / 448 of the head's values as written,
    so no value saturates and small ones keep their precision. The price of a block includes them. Every
    size comes from `placement`, the one placement of the fields.
    """

    def __init__(self, layers: int, block_size: int, num_kv_heads: int, head_dim: int, kv_dtype="bfloat16"):
        for arg, value in (("layers", layers), ("block_size", block_size),
                           ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            positive_int(value, arg)
        kv_dtype = resolve_dtype(kv_dtype, "kv_dtype")
        self.layers, self.block_size = layers, block_size
        self.num_kv_heads, self.head_dim, self.kv_dtype = num_kv_heads, head_dim, kv_dtype
        token_shape = (block_size, num_kv_heads, head_dim)
        fields = [EntryField("k", layers, token_shape, kv_dtype), EntryField("v", layers, token_shape, kv_dtype)]
        if kv_dtype.itemsize == 1:
            fields += [EntryField("k_scale", layers, (block_size, num_kv_heads), torch.float32),
                       EntryField("v_scale", layers, (block_size, num_kv_heads), torch.float32)]
        self.fields = tuple(fields)
        self.arenas: dict[str, LayerArena] | None = None
        self.blocks = 0

    @property
    def entry_bytes(self) -> int:
        """Bytes one block costs across every field and layer."""
        return sum(f.entry_bytes for f in self.fields)

    def placement(self, blocks: int) -> Placement:
        return place([f.region_bytes(blocks) for f in self.fields], [f.align for f in self.fields])

    def pool_bytes(self, blocks: int) -> int:
        return self.placement(positive_int(blocks, "blocks")).total

    def allocate(self, blocks: int, device=None, buf: torch.Tensor | None = None) -> None:
        """Lay the fields over `buf` (a uint8 region of at least `pool_bytes(blocks)`), or a new buffer."""
        placement = self.placement(positive_int(blocks, "blocks"))
        if buf is None:
            buf = aligned_empty(placement.total, device)
        if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() < placement.total:
            raise ValueError(f"buf must be 1-D uint8 of >= {placement.total} bytes for {blocks} blocks, "
                             f"got dtype={buf.dtype} shape={tuple(buf.shape)}")
        self.arenas = {f.name: LayerArena(f, blocks, buf[start:stop])
                       for i, f in enumerate(self.fields) for start, stop in [placement.span(i)]}
        self.blocks = blocks

    def _arena(self, name: str) -> LayerArena:
        if self.arenas is None:
            raise RuntimeError("the KV pool is not allocated (released, or asleep)")
        return self.arenas[name]

    def kv_views(self, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of layer `row`, each `[blocks, block_size, num_kv_heads, head_dim]`."""
        return self._arena("k").layer(row), self._arena("v").layer(row)

    def scale_views(self, row: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Per-(token, kv head) scales of layer `row` for 1-byte KV dtypes, each `[blocks, block_size,
        num_kv_heads]`, else None."""
        if self.kv_dtype.itemsize != 1:
            return None
        return self._arena("k_scale").layer(row), self._arena("v_scale").layer(row)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """Copy whole blocks (every field, every layer): copy-on-write of a shared block."""
        self._arena("k")  # raises when released
        for arena in self.arenas.values():
            arena.data[:, dst] = arena.data[:, src]

    def release(self) -> None:
        """Drop every view of the pool's memory."""
        self.arenas, self.blocks = None, 0

    @property
    def is_allocated(self) -> bool:
        return self.arenas is not None
