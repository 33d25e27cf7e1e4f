"""Many tensor copies in one launch: a weight update pays the host a launch per group, not per tensor.

copy_ of a contiguous tensor is a cudaMemcpyAsync, which costs the host about 10 us (measured on an
H200, 2026-11-29): a 1.7B-shaped update of 310 tensors was host-bound at about half the copy rate.
The Triton kernel reads a table of (destination, source, bytes) and copies every row, 16 bytes per
access; pairs it cannot take (a cast, a strided tensor, an address or size not a multiple of 16)
go through the reference.
"""
import torch
import triton
import triton.language as tl

SMALL_COPY_BYTES = 8 << 20  # below this the reference batches copies (one launch for all of them)
_ALIGN = 16  # bytes: one vector access
_TILE = 16384  # bytes per program


def copy_many_ref(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """dst.copy_(src) for every pair (casting where dtypes differ). Small tensors go in one batched call,
    which spares the host a launch each; large ones one by one, since copy_ moves them faster."""
    small_destinations, small_sources = [], []
    for dst, src in zip(destinations, sources):
        if src.nbytes < SMALL_COPY_BYTES:
            small_destinations.append(dst)
            small_sources.append(src)
        else:
            dst.copy_(src)
    if small_sources:
        torch._foreach_copy_(small_destinations, small_sources)  # casts; mixed lists take a per-tensor path


@triton.jit
def _copy_many_kernel(base, table, TILE: tl.constexpr, ALIGN: tl.constexpr):
    # table row t: (destination, source, bytes), the addresses as byte offsets from `base`
    t = tl.program_id(1)
    nbytes = tl.multiple_of(tl.load(table + t * 3 + 2), ALIGN)
    start = tl.program_id(0).to(tl.int64) * TILE
    if start < nbytes:
        dst = tl.multiple_of(tl.load(table + t * 3), ALIGN)
        src = tl.multiple_of(tl.load(table + t * 3 + 1), ALIGN)
        idx = start + tl.arange(0, TILE)
        mask = idx < nbytes
        tl.store(base + dst + idx, tl.load(base + src + idx, mask=mask), mask=mask)


def _one_launch(dst: torch.Tensor, src: torch.Tensor) -> bool:
    return (dst.dtype == src.dtype and dst.device == src.device and dst.is_contiguous() and src.is_contiguous()
            and (dst.data_ptr() | src.data_ptr() | src.nbytes) % _ALIGN == 0 and src.nbytes > 0)


def copy_many_triton(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Triton twin of copy_many_ref: the pairs that allow it in one launch, the rest by the reference."""
    rows, rest = [], []
    for dst, src in zip(destinations, sources):
        if _one_launch(dst, src):
            rows.append((dst, src))
        else:
            rest.append((dst, src))
    if rows:
        base = rows[0][1].view(torch.uint8).reshape(-1)  # any of the tensors: offsets are relative to it
        origin = base.data_ptr()
        table = torch.tensor([[d.data_ptr() - origin, s.data_ptr() - origin, s.nbytes] for d, s in rows],
                             dtype=torch.int64, pin_memory=base.is_cuda)
        largest = max(s.nbytes for _, s in rows)
        for first in range(0, len(rows), 65535):  # the grid's second dimension is at most 65535
            part = table[first : first + 65535].to(base.device, non_blocking=True)
            _copy_many_kernel[(triton.cdiv(largest, _TILE), len(part))](base, part, TILE=_TILE, ALIGN=_ALIGN)
    if rest:
        copy_many_ref([d for d, _ in rest], [s for _, s in rest])
