"""A layer-major arena: one field's `[layers, entries, *shape]` view over a byte region."""
from __future__ import annotations

import torch

from .fields import EntryField
from .layout import positive_int


class LayerArena:
    """Views `[layers, entries, *shape]`, each layer contiguous (what paged kernels read)."""

    def __init__(self, field: EntryField, entries: int, region: torch.Tensor | None = None, device=None):
        positive_int(entries, "entries")
        nbytes = field.region_bytes(entries)
        if region is None:
            region = torch.empty(nbytes, dtype=torch.uint8, device=device)
        if region.dtype != torch.uint8 or region.dim() != 1 or region.numel() != nbytes:
            raise ValueError(
                f"region for field {field.name!r} must be 1-D uint8 of {nbytes} bytes, "
                f"got dtype={region.dtype} shape={tuple(region.shape)}"
            )
        if region.data_ptr() % field.dtype.itemsize:
            raise ValueError(f"region for field {field.name!r} is not aligned to {field.dtype.itemsize} bytes")
        self.field, self.entries = field, entries
        self.data = region.view(field.dtype).view(field.layers, entries, *field.shape)

    def layer(self, row: int) -> torch.Tensor:
        if not 0 <= row < self.field.layers:
            raise IndexError(f"row {row} outside [0, {self.field.layers}) of field {self.field.name!r}")
        return self.data[row]

    def byte_range(self, row: int, entry: int) -> tuple[int, int]:
        """Byte range [start, stop) of one (layer, entry) pair within this arena's region."""
        start = (row * self.entries + entry) * self.field.nbytes
        return start, start + self.field.nbytes
