"""EntryField: what one (layer, entry) pair of a pool holds."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .layout import positive_int, resolve_dtype

DEFAULT_ALIGN = 256


@dataclass(frozen=True)
class EntryField:
    """A frozen declaration: `layers` arrays of `[entries, *shape]` elements of `dtype`.

    `nbytes` is the price of one (layer, entry) pair; `align` is where the field's
    region may start in the pool buffer.
    """

    name: str
    layers: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    align: int = DEFAULT_ALIGN

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty str, got {self.name!r}")
        positive_int(self.layers, "layers")
        if not isinstance(self.shape, tuple) or not self.shape:
            raise ValueError(f"shape must be a non-empty tuple of positive ints, got {self.shape!r}")
        for i, dim in enumerate(self.shape):
            positive_int(dim, f"shape[{i}]")
        object.__setattr__(self, "dtype", resolve_dtype(self.dtype))
        positive_int(self.align, "align")
        if self.align % self.dtype.itemsize:
            raise ValueError(f"align={self.align} must be a multiple of the {self.dtype} item size {self.dtype.itemsize}")

    @property
    def nbytes(self) -> int:
        """Bytes of one (layer, entry) pair."""
        return math.prod(self.shape) * self.dtype.itemsize

    @property
    def entry_bytes(self) -> int:
        """Bytes one entry costs across all layers."""
        return self.layers * self.nbytes

    def region_bytes(self, entries: int) -> int:
        return entries * self.entry_bytes
