"""A step's inputs to the device and its results back, each in one kernel that reads or writes the pinned host
buffer directly, and a step launched ahead fed the tokens of the step before it on the way in.

With the copy engine a pipelined decode step is a host-to-device copy, an index_select and a copy_ that put
the previous step's tokens into its input ids, and a device-to-host copy: separate operations in the stream,
with gaps around each copy (on an H200 at batch 1 they leave the GPU idle about 26 us of a 1.3 ms step,
docs/benchmarks.md). Pinned host memory is mapped into the GPU's address space (unified addressing), so a
kernel reads or writes it over PCIe as it would device memory. Loads are uncached (`.cv`): the host rewrites
its buffer between steps. (`rollout_engine.step_buffers.KERNEL_COPIES = False` takes the copy engine instead.)

`copy_step` moves int64 words; `ids_at` and `feed_at` are word offsets of the input ids and the feed rows (int64
fields of the source). Word ids_at + i, for i < fed, becomes the token of row feed_rows[i] of `last_out` (a
float64 [rows, >= 1] block, the token in column 0) instead of the source's word."""
import torch
import triton
import triton.language as tl

_BLOCK = 1024  # words per program


def copy_step_ref(src: torch.Tensor, dst: torch.Tensor, words: int, ids_at: int = 0, feed_at: int = 0,
                  fed: int = 0, last_out: torch.Tensor | None = None) -> None:
    """Twin of copy_step_triton: dst[:words] = src[:words], then the fed input ids (src, dst: int64)."""
    dst[:words].copy_(src[:words], non_blocking=True)
    if fed:
        rows = dst[feed_at : feed_at + fed]
        dst[ids_at : ids_at + fed].copy_(last_out[:, 0].index_select(0, rows))


@triton.jit
def _copy_step_kernel(src, dst, words, ids_at, feed_at, fed, last_out, stride_out, BLOCK: tl.constexpr):
    w = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = w < words
    word = tl.load(src + w, mask=ok, other=0, cache_modifier=".cv")
    i = w - ids_at
    fed_here = ok & (i >= 0) & (i < fed)
    row = tl.load(src + feed_at + i, mask=fed_here, other=0, cache_modifier=".cv")
    token = tl.load(last_out + row * stride_out, mask=fed_here, other=0.0).to(tl.int64)
    tl.store(dst + w, tl.where(fed_here, token, word), mask=ok)


def copy_step_triton(src: torch.Tensor, dst: torch.Tensor, words: int, ids_at: int = 0, feed_at: int = 0,
                     fed: int = 0, last_out: torch.Tensor | None = None) -> None:
    """One launch: dst[:words] from src (either may be pinned host memory), the fed input ids from last_out.
    src, dst: contiguous int64."""
    if not words:
        return
    if fed and (last_out.dtype != torch.float64 or last_out.stride(1) != 1):
        raise ValueError(f"last_out must be float64 with unit column stride, got {last_out.dtype}, "
                         f"strides {last_out.stride()}")
    _copy_step_kernel[(triton.cdiv(words, _BLOCK),)](src, dst, words, ids_at, feed_at, fed,
                                                     last_out if fed else dst, last_out.stride(0) if fed else 0,
                                                     BLOCK=_BLOCK)
