"""The one layout rule: align, place, advance (`place`).

Every byte offset in the pool comes from `place`; entry bytes, region offsets and
byte-range queries are all derived from it, never recomputed on the side.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The one 1-byte format is e4m3 with per-(token, kv head) scales: the KV store kernels write e4m3 bits, so an
# e5m2 cache would be read back as other numbers. "fp8" and "fp8_e4m3" are vLLM's names for it.
KV_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
}
SCALE_DTYPE = torch.float32


def resolve_dtype(dtype, arg: str = "dtype") -> torch.dtype:
    """A torch dtype from a dtype or its name; anything else is a ValueError naming `arg`."""
    if isinstance(dtype, str):
        dtype = KV_DTYPES.get(dtype.removeprefix("torch."), dtype)
    if dtype not in KV_DTYPES.values():
        raise ValueError(f"{arg}={dtype!r} is not supported; allowed: {sorted(KV_DTYPES)}")
    return dtype


def positive_int(value, arg: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{arg} must be a positive int, got {value!r}")
    return value


def align_up(n: int, align: int) -> int:
    return -(-n // align) * align


@dataclass(frozen=True)
class Placement:
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    total: int

    def span(self, i: int) -> tuple[int, int]:
        """Byte range [start, stop) of item i."""
        return self.offsets[i], self.offsets[i] + self.sizes[i]


def place(sizes, aligns) -> Placement:
    """Place items one after another, each at the next multiple of its alignment."""
    offsets, cursor = [], 0
    for size, align in zip(sizes, aligns, strict=True):
        if size < 0:
            raise ValueError(f"region size must be >= 0, got {size}")
        positive_int(align, "align")
        cursor = align_up(cursor, align)
        offsets.append(cursor)
        cursor += size
    return Placement(tuple(offsets), tuple(sizes), cursor)


def plan_regions(sizes, align: int = 256) -> tuple[list[int], int]:
    """Offsets of several regions packed into one buffer, and the buffer's total size."""
    sizes = list(sizes)
    placement = place(sizes, [align] * len(sizes))
    return list(placement.offsets), placement.total


def carve(buf: torch.Tensor, sizes, align: int = 256) -> list[torch.Tensor]:
    """Slice `buf` (uint8, aligned) into the regions `plan_regions` places."""
    sizes = list(sizes)
    offsets, total = plan_regions(sizes, align)
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"buf must be a 1-D uint8 tensor, got dtype={buf.dtype} shape={tuple(buf.shape)}")
    if buf.numel() < total:
        raise ValueError(f"buf holds {buf.numel()} bytes but regions {sizes} need {total} (align={align})")
    if buf.data_ptr() % align:
        raise ValueError(f"buf address {buf.data_ptr():#x} is not aligned to {align} bytes")
    return [buf[o : o + s] for o, s in zip(offsets, sizes)]


def aligned_empty(nbytes: int, device=None, align: int = 256) -> torch.Tensor:
    """A 1-D uint8 tensor of `nbytes` whose first byte sits on an `align` boundary.

    The CPU allocator only promises 64-byte alignment, so over-allocate and slice.
    """
    raw = torch.empty(nbytes + align, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % align
    return raw[skip : skip + nbytes]
