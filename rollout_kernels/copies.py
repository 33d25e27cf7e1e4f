"""Many tensor copies in one launch: a weight update pays the host a launch per group, not per tensor.

copy_ of a contiguous tensor is a cudaMemcpyAsync, which costs the host microseconds per tensor: an update of
hundreds of tensors would be host-bound (docs/benchmarks.md has the measurement).
The Triton kernel reads a table of (destination, source, bytes) and copies every row, 16 bytes per
access; pairs it cannot take (a cast, a strided tensor, an address or size not a multiple of 16)
go through the reference.
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

SMALL_COPY_BYTES = 8 << 20  # below this the reference batches copies (one launch for all of them)
_ALIGN = 16  # bytes: one vector access
_TILE = 16384  # bytes per program and step
_PROGRAMS = 512  # at most: a few per SM fill an H200 (132 SMs) at about the copy rate


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
def _copy_many_kernel(base, table, count, TILE: tl.constexpr, ALIGN: tl.constexpr):
    # table row t: (destination, source, bytes), the addresses as byte offsets from `base` (the table's own
    # bytes, so a plan keeps no other tensor alive). Every program takes every num_programs-th tile of
    # each tensor in turn: one grid for any mix of sizes.
    step = tl.num_programs(0) * TILE
    for t in range(count):
        nbytes = tl.multiple_of(tl.load(table + t * 3 + 2), ALIGN)
        dst = tl.multiple_of(tl.load(table + t * 3), ALIGN)
        src = tl.multiple_of(tl.load(table + t * 3 + 1), ALIGN)
        for start in range(tl.program_id(0).to(tl.int64) * TILE, nbytes, step):
            idx = tl.multiple_of(start, TILE) + tl.arange(0, TILE)
            mask = idx < nbytes
            tl.store(base + dst + idx, tl.load(base + src + idx, mask=mask), mask=mask)


@dataclass
class CopyPlan:
    """Copies prepared once and run any number of times, each run copying what the sources hold then.
    The kernel's part holds only addresses, as offsets from its own table: it is valid while the
    tensors it was made from keep their memory. `rest` (the reference's part) holds the tensors."""

    launch: Callable[[], None] | None = None
    rest: Callable[[], None] | None = None

    def __call__(self) -> None:
        if self.launch is not None:
            self.launch()
        if self.rest is not None:
            self.rest()


def in_turn(*steps):
    """One callable running the given ones (None: absent) in order; None if there are none."""
    steps = [step for step in steps if step is not None]
    return None if not steps else steps[0] if len(steps) == 1 else functools.partial(_run_each, steps)


def _run_each(steps) -> None:
    for step in steps:
        step()


def copy_plan_ref(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> CopyPlan:
    """copy_many_ref's copies as a plan."""
    return CopyPlan(rest=functools.partial(copy_many_ref, destinations, sources))


def copy_plan_triton(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> CopyPlan:
    """Triton twin of copy_plan_ref: the pairs that allow it in one launch over a table built here, once;
    the rest by the reference."""
    rows, rest, device, tiles = [], [], None, 0
    for dst, src in zip(destinations, sources):
        d, s, n = dst.data_ptr(), src.data_ptr(), src.nbytes
        if ((d | s | n) % _ALIGN == 0 and n and dst.dtype == src.dtype and dst.get_device() == src.get_device()
                and dst.is_contiguous() and src.is_contiguous()):
            rows.append((d, s, n))
            tiles += -(-n // _TILE)
            device = src.device if device is None else device
        else:
            rest.append((dst, src))
    plan = copy_plan_ref([d for d, _ in rest], [s for _, s in rest]) if rest else CopyPlan()
    if rows:
        table = torch.empty(3 * len(rows), dtype=torch.int64, device=device)
        origin = table.data_ptr()
        offsets = torch.tensor([(d - origin, s - origin, n) for d, s, n in rows], dtype=torch.int64,
                               pin_memory=table.is_cuda)
        table.copy_(offsets.reshape(-1), non_blocking=True)
        plan.launch = functools.partial(_copy_many_kernel[(min(tiles, _PROGRAMS),)], table.view(torch.uint8), table,
                                        len(rows), TILE=_TILE, ALIGN=_ALIGN)
    return plan


def copy_many_triton(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Triton twin of copy_many_ref: the pairs that allow it in one launch, the rest by the reference."""
    copy_plan_triton(destinations, sources)()
