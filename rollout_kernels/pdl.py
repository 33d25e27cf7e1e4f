"""Programmatic dependent launch (compute capability 9.0 and later): a kernel launched with it is put on
the GPU while the previous kernel in the stream still runs, and waits (`wait_previous`) before it reads what
that kernel writes, so each kernel's launch overlaps its predecessor's last wave instead of following its
end. Loads of what it does not write (weights, the step's uploads, older KV) may go out before the wait. At
batch 1 a decode step is about ten short kernels per layer (norm, projections, rotary + KV store,
attention, SiLU-mul), so their launches are a large share of the step. Launches over the rows whose
projections are GEMV kernels (1 to gemv.GEMV_ROWS, two by default) take it, which made a decode step at batch 2 on an
H200 3.6-6.6% faster in generate. From more rows on the projections are cuBLAS kernels, which do not wait or
signal, and there it measured about 2% slower at batch 8 (neutral at 64).

`ENABLED` is read at each launch: set it before an engine captures its CUDA graphs."""
import contextlib
import contextvars
import functools

import torch
import triton
import triton.language as tl

from .launch import interpreted

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control
    gdc_launch_dependents = gdc_wait = None

ENABLED = gdc_wait is not None
# Whether the launches under way belong to a step whose projections of more than gemv.GEMV_ROWS rows, up to
# skinny.SKINNY_ROWS, are Triton kernels too (over_few_rows): only there do those launches take PDL.
_FEW_ROWS = contextvars.ContextVar("pdl_over_few_rows", default=False)


@triton.jit
def wait_previous(PDL: tl.constexpr):
    """Before a kernel's first read of what the previous kernel writes: that kernel's writes are visible after
    it; then the next kernel may launch (it waits in turn, so at most one kernel runs ahead)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.lru_cache
def _capable(index) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


@contextlib.contextmanager
def over_few_rows(on: bool):
    """Within: launches over up to skinny.SKINNY_ROWS rows take PDL too (`on`: every projection of such a step
    is a Triton kernel). A bf16 decode step of 4-16 rows on the H200 gains 2-7% with it, while the same PDL
    between cuBLAS(Lt) projections (an fp8 engine's) costs 3-7%."""
    token = _FEW_ROWS.set(on)
    try:
        yield
    finally:
        _FEW_ROWS.reset(token)


def over_few_rows_now() -> bool:
    """Whether the launches under way are inside over_few_rows(True): the few-row kernel runs only there, as it
    wins over cuBLAS only with PDL over its rows."""
    return _FEW_ROWS.get()


def options(device: torch.device, rows: int) -> dict:
    """A launch's keyword arguments: the kernel's PDL constexpr and Triton's launch_pdl, both on for a launch
    over the GEMV's rows (1 to gemv.GEMV_ROWS; inside over_few_rows(True) up to skinny.SKINNY_ROWS) when ENABLED
    on a CUDA device that has it (never in the interpreter, which has no grid dependency control)."""
    from . import gemv, skinny  # they import this module; their bounds are read at each launch, as they read them
    most = max(gemv.GEMV_ROWS, skinny.SKINNY_ROWS) if over_few_rows_now() else gemv.GEMV_ROWS
    on = (ENABLED and 1 <= rows <= most and device.type == "cuda" and not interpreted()
          and _capable(device.index if device.index is not None else torch.cuda.current_device()))
    return {"PDL": on, "launch_pdl": on}
