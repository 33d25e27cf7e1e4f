"""Which of many tensors hold a NaN or an inf, or a value that becomes inf in the dtype it is copied into, in
one launch: a weight update checks every group it copies.

An IEEE float's magnitude bits (all but the sign) order its magnitudes, and the non-finite values are those
from the exponent-all-ones pattern up; a value that rounds to inf in a narrower type (float32's 3.3961e38 and
above into bfloat16) is one from some lower pattern up. So the kernel reads each tensor as 32-bit words and
compares the magnitude bits of each value in a word (two for 16-bit types, one for float32) with the first
pattern that is non-finite where the tensor goes (`limit_bits`): one pass over the bytes, no conversion.
Tensors it cannot read that way (other dtypes, strided, or a size or address not a multiple of 4 bytes) go
through the reference, and so do host tensors (a checkpoint read from disk into a GPU engine).
"""

import functools

import torch
import triton
import triton.language as tl

from .launch import interpreted

_TILE = 2048  # 32-bit words per program and step
_PROGRAMS = 1056  # 8 per SM of an H200
# the bit pattern of a value's +inf, and whether a 32-bit word holds two values
_INF_BITS = {torch.bfloat16: (0x7F80, True), torch.float16: (0x7C00, True), torch.float32: (0x7F800000, False)}
_BITS = {2: torch.int16, 4: torch.int32}


def _rounds_to_inf(pattern: int, dtype: torch.dtype, into: torch.dtype) -> bool:
    value = torch.tensor([pattern], dtype=_BITS[dtype.itemsize]).view(dtype)
    return bool(torch.isinf(value.to(into)).item())


@functools.lru_cache
def limit_bits(dtype: torch.dtype, into: torch.dtype | None) -> int:
    """The least magnitude bit pattern of `dtype` that is not finite once cast into `into` (None: as itself):
    found by bisection over the patterns below +inf's, with torch's own cast deciding each."""
    inf = _INF_BITS[dtype][0]
    if into is None or not _rounds_to_inf(inf - 1, dtype, into):
        return inf
    low, high = 0, inf - 1  # low: finite in `into`; high: not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if _rounds_to_inf(mid, dtype, into) else (mid, high)
    return high


def nonfinite_ref(tensors: list[torch.Tensor], into: list | None = None) -> list[bool]:
    """For each tensor, whether any of its values is NaN or +-inf, or becomes inf when cast into into[i] (a
    floating dtype, or None)."""
    into = into or [None] * len(tensors)
    return [bool(t.is_floating_point() and _nonfinite(t, d)) for t, d in zip(tensors, into)]


def _nonfinite(t: torch.Tensor, into: torch.dtype | None) -> bool:
    """One pass over t: against the first magnitude that is not finite where it goes (NaN compares False)."""
    if t.dtype not in _INF_BITS:  # float64 and the like: rare, so a cast is fine
        return not torch.isfinite(t).all() or (into is not None and not torch.isfinite(t.to(into)).all())
    limit = limit_bits(t.dtype, into)
    if limit == _INF_BITS[t.dtype][0]:
        return not torch.isfinite(t).all()
    bound = torch.tensor([limit], dtype=_BITS[t.dtype.itemsize]).view(t.dtype).to(t.device)
    return not (t.abs() < bound).all()


@triton.jit
def _nonfinite_kernel(base, table, flags, count, LIMIT: tl.constexpr, HALVES: tl.constexpr, TILE: tl.constexpr):
    # table row t: (first word, words), as 32-bit word offsets from `base` (the table's own memory).
    # Hits accumulate in registers and are reduced once per tensor: the loop body is loads and bit tests only.
    step = tl.num_programs(0) * TILE
    for t in range(count):
        first = tl.load(table + t * 2)
        words = tl.load(table + t * 2 + 1)
        acc = tl.zeros([TILE], dtype=tl.int32)
        for start in range(tl.program_id(0).to(tl.int64) * TILE, words, step):
            idx = start + tl.arange(0, TILE)
            x = tl.load(base + first + idx, mask=idx < words, other=0)
            if HALVES:
                acc |= (((x & 0x7FFF) >= LIMIT) | (((x >> 16) & 0x7FFF) >= LIMIT)).to(tl.int32)
            else:
                acc |= ((x & 0x7FFFFFFF) >= LIMIT).to(tl.int32)
        hit = tl.max(acc, axis=0)
        if hit > 0:
            tl.atomic_max(flags + t, hit)


def nonfinite_triton(tensors: list[torch.Tensor], into: list | None = None) -> list[bool]:
    """Triton twin of nonfinite_ref: one launch per dtype, limit and device over a table of the tensors; one
    host sync."""
    into = into or [None] * len(tensors)
    by_kind: dict[tuple[torch.dtype, int, torch.device], list[int]] = {}
    rest = []
    for i, (t, d) in enumerate(zip(tensors, into)):
        if ((t.is_cuda or interpreted()) and t.dtype in _INF_BITS and t.is_contiguous() and t.numel()
                and (t.data_ptr() | t.nbytes) % 4 == 0):
            by_kind.setdefault((t.dtype, limit_bits(t.dtype, d), t.device), []).append(i)
        else:
            rest.append(i)
    result = [False] * len(tensors)
    pending = []
    for (dtype, limit, device), members in by_kind.items():
        table = torch.empty(2 * len(members), dtype=torch.int64, device=device)
        origin = table.data_ptr()
        rows = [((tensors[i].data_ptr() - origin) // 4, tensors[i].nbytes // 4) for i in members]
        table.copy_(torch.tensor(rows, dtype=torch.int64).reshape(-1), non_blocking=False)
        flags = torch.zeros(len(members), dtype=torch.int32, device=device)
        tiles = sum(-(-words // _TILE) for _, words in rows)
        _nonfinite_kernel[(max(1, min(tiles, _PROGRAMS)),)](table.view(torch.int32), table, flags, len(members),
                                                            LIMIT=limit, HALVES=_INF_BITS[dtype][1], TILE=_TILE,
                                                            num_warps=8)
        pending.append((members, flags))
    for members, flags in pending:
        for i, flag in zip(members, flags.tolist()):
            result[i] = bool(flag)
    for i, flag in zip(rest, nonfinite_ref([tensors[i] for i in rest], [into[i] for i in rest])):
        result[i] = flag
    return result
