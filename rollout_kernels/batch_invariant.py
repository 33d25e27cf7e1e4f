"""A matmul whose result for each row does not depend on the other rows: batch-invariant mode.

Audit of the forward and sampling path (rollout_engine/model.py, model_runner.py, rollout_kernels/): what
one token's result depends on besides its own inputs.

- Projections (`Linear.forward`: `F.linear` -> cuBLAS/cuBLASLt) and the LM head (`CausalLM.logits`):
  VARIANT. cuBLAS picks the kernel, its tiles and its split-K by M (the number of rows: tokens in a
  prefill, padded graph bucket in a decode), so one row's sum over K is ordered differently in
  different batches. The CPU BLAS also picks paths by M. -> `batch_invariant_linear_*` below.
- Attention (rollout_kernels/attention.py): VARIANT by default. `_num_splits` cuts the keys into a number of
  splits chosen from the batch, the number of kv heads and the block table width (decode only), and
  `_config` picks BLOCK_M/BLOCK_N/num_warps from the query length of the whole launch (64 keys per
  tile at decode, 32 in prefill): the order of one query's online softmax over its keys changes with
  the batch and between prefill and decode. The torch twin pads every sequence to the longest and
  reduces over that padded length. -> `paged_attention_*(..., fixed_split=True)`: keys in chunks of
  `FIXED_SPLIT_KEYS` at fixed positions, one tile shape, chunks folded in order.
- RMSNorm (norm.py), rotary and the q/k head norm (rotary.py `rope_store`), SiLU-and-mul
  (activation.py), the embedding gather: INVARIANT. One program per row (or per token) whose block
  size and warps depend only on the hidden size; the torch twins reduce over the last dim of
  [T, hidden] rows (hidden < 32768, so torch does not split one row's reduction across threads).
  Checked by tests/test_batch_invariant.py.
- Sampling (sampling.py): the drawn TOKEN is invariant (an argmax with lowest-index ties, and the
  noise is a hash of (seed, position, token)), but the LOGPROB is VARIANT on CUDA: `_split_rows`
  cuts an untruncated row's vocabulary into `cdiv(2 * SMs, batch)` splits, and the merge of the
  splits' (max, sum-exp) is a tree over that many partials. Rows with top-k/top-p/min-p run whole in
  one program (invariant). The torch twin's log_softmax is per row (invariant on this CPU, checked).
  With a fixed number of splits (a function of the vocabulary only) the Triton path is invariant too.
  `processed_probs` and `rejection_sample` (speculative decoding) split the same way.
- fp8 projections (`Fp8Linear` -> `torch._scaled_mm`): VARIANT, like cuBLAS.
- KV store, block tables, the prefix cache: copies, exact.

The matmul here: y = x @ w.T (+ bias), fp32 accumulation. The tile shape (BLOCK_M, BLOCK_N,
BLOCK_K, warps, stages) and a split of K into fixed chunks are functions of (N, K, dtype) only. Each
chunk's sum runs BLOCK_K at a time in increasing k from zero; the chunks' sums are added in order,
then the bias, then one rounding. Small-M launches compute the chunks in parallel programs and add
them in a second kernel; larger ones add them inside one program. Both do the same float operations,
so the launch choice (made from M) never changes a bit.
"""
import functools

import torch
import triton
import triton.language as tl

from .launch import sm_count

ROW_CHUNK = 16          # the torch twin's matmul shape: rows go through [ROW_CHUNK, REF_K_CHUNK] at a time
REF_K_CHUNK = 256       # and K in chunks of this many: a CPU BLAS splits a longer K over its threads (bits by thread count)
MIN_K_CHUNK = 512       # a K chunk keeps at least this many elements (8 BLOCK_K steps) for the pipeline
DECODE_PROGRAMS = 256   # chunks enough that one row tile of a projection fills about this many programs
GROUP_M = 8             # row tiles sharing one column tile's weights in L2 (prefill)


def batch_invariant_linear_ref(x, weight, bias=None):
    """x [M, K] @ weight[N, K].T (+ bias) as the kernel computes it: rows zero-padded to [ROW_CHUNK, K] blocks, each
    block's fp32 sums over K chunks of REF_K_CHUNK added in order, then the bias, then one rounding. The CPU BLAS
    sees the same shapes whatever M is, none long enough in K for it to split over threads."""
    rows, k = x.shape
    padded = torch.zeros((triton.cdiv(rows, ROW_CHUNK) * ROW_CHUNK, k), dtype=torch.float32, device=x.device)
    padded[:rows] = x
    w, b = weight.float(), None if bias is None else bias.float()
    out = []
    for block in padded.split(ROW_CHUNK):
        total = block[:, :REF_K_CHUNK] @ w[:, :REF_K_CHUNK].T
        for lo in range(REF_K_CHUNK, k, REF_K_CHUNK):
            total += block[:, lo:lo + REF_K_CHUNK] @ w[:, lo:lo + REF_K_CHUNK].T
        out.append(total if b is None else total + b)
    return torch.cat(out)[:rows].to(x.dtype)


@functools.lru_cache
def tile_config(n: int, k: int, itemsize: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, k_chunk, num_warps, num_stages) for weight [n, k]: never a function of M.

    BLOCK_M 64: a decode row tile wastes at most 63 rows of tensor-core work, and 64 x BLOCK_N x 64
    is still a full Hopper warpgroup MMA for prefill. BLOCK_N 128 for wide weights (MLP up, LM head),
    64 for narrow ones so a decode step has more column tiles. K is cut into chunks of at least
    MIN_K_CHUNK so that a single row tile still gives about DECODE_PROGRAMS programs."""
    block_m, block_k = 64, 64
    block_n = 128 if n >= 8192 else 64
    tiles = triton.cdiv(n, block_n)
    chunks = max(1, min(triton.next_power_of_2(triton.cdiv(DECODE_PROGRAMS, tiles)), k // MIN_K_CHUNK))
    k_chunk = triton.cdiv(triton.cdiv(k, chunks), block_k) * block_k
    return block_m, block_n, block_k, k_chunk, 4, (4 if itemsize <= 2 else 2)


@triton.jit
def _chunk_sum(x_ptr, w_ptr, rm, rn, M, N, lo, hi, stride_xm, stride_wn, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """fp32 sum over k in [lo, hi) of x[rm, k] * w[rn, k], from zero, BLOCK_K at a time in increasing k.
    EVEN_K: every step is whole, so the loads are masked by row only (and vectorise)."""
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    rk = tl.arange(0, BLOCK_K)
    for start in range(lo, hi, BLOCK_K):
        kk = start + rk
        x_at, w_at = x_ptr + rm[:, None] * stride_xm + kk[None, :], w_ptr + rn[:, None] * stride_wn + kk[None, :]
        if EVEN_K:
            a = tl.load(x_at, mask=rm[:, None] < M, other=0.0)
            b = tl.load(w_at, mask=rn[:, None] < N, other=0.0)
        else:
            a = tl.load(x_at, mask=(rm[:, None] < M) & (kk[None, :] < hi), other=0.0)
            b = tl.load(w_at, mask=(rn[:, None] < N) & (kk[None, :] < hi), other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _finish(total, b_ptr, y_ptrs, cols, mask, HAS_BIAS: tl.constexpr):
    """The chunks' sum (+ bias, in fp32), rounded once to y's dtype."""
    if HAS_BIAS:
        total = total + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, total.to(y_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, M, N, K, k_chunk, stride_xm, stride_wn, stride_ym,
                   HAS_BIAS: tl.constexpr, PARALLEL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, GROUP: tl.constexpr, PRECISION: tl.constexpr):
    """Program (output tile, K chunk). PARALLEL: this chunk's sum to part[chunk]; else every chunk's sum,
    added in order, to y. Output tiles go GROUP row tiles per column tile (the weights stay in L2)."""
    tile, chunk = tl.program_id(0), tl.program_id(1)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    first_m = (tile // (GROUP * tiles_n)) * GROUP
    size_m = tl.minimum(tiles_m - first_m, GROUP)
    pid_m = first_m + (tile % (GROUP * tiles_n)) % size_m
    pid_n = (tile % (GROUP * tiles_n)) // size_m
    rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if PARALLEL:
        lo = chunk * k_chunk
        acc = _chunk_sum(x_ptr, w_ptr, rm, rn, M, N, lo, tl.minimum(lo + k_chunk, K), stride_xm, stride_wn,
                         BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        tl.store(part_ptr + chunk.to(tl.int64) * M * N + rm[:, None] * N + rn[None, :], acc, mask=mask)
    else:
        total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for lo in range(0, K, k_chunk):
            total += _chunk_sum(x_ptr, w_ptr, rm, rn, M, N, lo, tl.minimum(lo + k_chunk, K), stride_xm, stride_wn,
                                BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
        _finish(total, b_ptr, y_ptr + rm[:, None] * stride_ym + rn[None, :], rn[None, :], mask, HAS_BIAS)


@triton.jit
def _add_chunks_kernel(part_ptr, b_ptr, y_ptr, M, N, chunks, stride_ym, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """y = the K chunks' sums added in chunk order (as the in-program path adds them), + bias."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < M * N
    total = tl.zeros([BLOCK], tl.float32)
    for c in range(0, chunks):
        total += tl.load(part_ptr + c * M * N + offs, mask=mask, other=0.0)
    _finish(total, b_ptr, y_ptr + (offs // N) * stride_ym + offs % N, offs % N, mask, HAS_BIAS)


def parallel_chunks(m: int, n: int, k: int, itemsize: int, device) -> bool:
    """Whether a launch computes the K chunks in programs of their own: only when the output tiles alone
    leave SMs idle. Either way the bits are the same; this is speed only."""
    block_m, block_n, _, k_chunk, _, _ = tile_config(n, k, itemsize)
    return k_chunk < k and triton.cdiv(m, block_m) * triton.cdiv(n, block_n) < sm_count(device)


def batch_invariant_linear_triton(x, weight, bias=None, parallel: bool | None = None):
    """Triton twin of batch_invariant_linear_ref: x [M, K] (unit-stride rows), weight [N, K] contiguous.
    `parallel` forces the launch shape (tests); None picks it from M."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x must be [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    assert x.stride(1) == 1 and weight.stride(1) == 1
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    block_m, block_n, block_k, k_chunk, warps, stages = tile_config(n, k, x.element_size())
    if parallel is None:
        parallel = parallel_chunks(m, n, k, x.element_size(), x.device)
    chunks = triton.cdiv(k, k_chunk) if parallel else 1
    part = torch.empty((chunks, m, n), dtype=torch.float32, device=x.device) if parallel else y
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    bias_ptr = bias if bias is not None else y
    _linear_kernel[(tiles, chunks)](
        x, weight, bias_ptr, y, part, m, n, k, k_chunk, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, PARALLEL=parallel, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, GROUP=GROUP_M, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps,
        num_stages=stages)
    if parallel:
        block = 1024
        _add_chunks_kernel[(triton.cdiv(m * n, block),)](part, bias_ptr, y, m, n, chunks, y.stride(0),
                                                         HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y
