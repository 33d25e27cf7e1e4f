"""Which of many tensors hold a NaN or an inf, in one launch: a weight update checks every group it copies.

A float is non-finite exactly when its exponent bits are all ones, so the kernel reads each tensor as
32-bit words and tests the exponent field of each value in a word (two for 16-bit types, one for float32):
one pass over the bytes, no conversion. Tensors it cannot read that way (other dtypes, strided, or a size
or address not a multiple of 4 bytes) go through the reference, and so do host tensors (a checkpoint read from disk into a GPU engine).
"""

import torch
import triton
import triton.language as tl

from .launch import interpreted

_TILE = 2048  # 32-bit words per program and step
_PROGRAMS = 1056  # 8 per SM of an H200
# exponent field of one value, and whether a 32-bit word holds two values
_EXPONENT = {torch.bfloat16: (0x7F80, True), torch.float16: (0x7C00, True), torch.float32: (0x7F800000, False)}


def nonfinite_ref(tensors: list[torch.Tensor]) -> list[bool]:
    """For each tensor, whether any of its values is NaN or +-inf."""
    return [bool(t.is_floating_point() and not torch.isfinite(t).all()) for t in tensors]


@triton.jit
def _nonfinite_kernel(base, table, flags, count, EXP: tl.constexpr, HALVES: tl.constexpr, TILE: tl.constexpr):
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
                acc |= (((x & EXP) == EXP) | (((x >> 16) & EXP) == EXP)).to(tl.int32)
            else:
                acc |= ((x & EXP) == EXP).to(tl.int32)
        hit = tl.max(acc, axis=0)
        if hit > 0:
            tl.atomic_max(flags + t, hit)


def nonfinite_triton(tensors: list[torch.Tensor]) -> list[bool]:
    """Triton twin of nonfinite_ref: one launch per dtype and device over a table of the tensors; one host sync."""
    by_kind: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    rest = []
    for i, t in enumerate(tensors):
        if ((t.is_cuda or interpreted()) and t.dtype in _EXPONENT and t.is_contiguous() and t.numel()
                and (t.data_ptr() | t.nbytes) % 4 == 0):
            by_kind.setdefault((t.dtype, t.device), []).append(i)
        else:
            rest.append(i)
    result = [False] * len(tensors)
    pending = []
    for (dtype, device), members in by_kind.items():
        table = torch.empty(2 * len(members), dtype=torch.int64, device=device)
        origin = table.data_ptr()
        rows = [((tensors[i].data_ptr() - origin) // 4, tensors[i].nbytes // 4) for i in members]
        table.copy_(torch.tensor(rows, dtype=torch.int64).reshape(-1), non_blocking=False)
        flags = torch.zeros(len(members), dtype=torch.int32, device=device)
        tiles = sum(-(-words // _TILE) for _, words in rows)
        exponent, halves = _EXPONENT[dtype]
        _nonfinite_kernel[(max(1, min(tiles, _PROGRAMS)),)](table.view(torch.int32), table, flags, len(members),
                                                            EXP=exponent, HALVES=halves, TILE=_TILE, num_warps=8)
        pending.append((members, flags))
    for members, flags in pending:
        for i, flag in zip(members, flags.tolist()):
            result[i] = bool(flag)
    for i, flag in zip(rest, nonfinite_ref([tensors[i] for i in rest])):
        result[i] = flag
    return result
