"""Batch invariance of the kernels batch-invariant mode runs: a row (a token) gets the same bits alone, among
other rows of any number and content, in a prefill, a chunked prefill or a decode step.

CPU: the torch twins, and the Triton kernels in Triton's interpreter (float32). GPU (`gpu`): the same
properties in bfloat16, and the Triton matmul against its twin."""
import pytest
import torch
import triton

from rollout_kernels import activation, attention, batch_invariant as bi, norm, sampling

# Without CUDA, tests/conftest.py has set TRITON_INTERPRET=1 before anything imported triton.


@pytest.fixture(autouse=True)
def row_independent_interpreter_dot(monkeypatch):
    """Triton's interpreter computes tl.dot with numpy.matmul, and the host BLAS decides whether a row's bits
    depend on its place in the tile: OpenBLAS's FMA kernels on an AMD EPYC give a row different bits at row 8
    of 17 than alone at row 0. A GPU's MMA over a fixed tile shape does not (the `gpu` tests below check that
    in bfloat16). What these tests check is our tiling and reduction order, so in the interpreter each row
    of a dot is computed alone: its bits are then a function of that row and the tile's shape only."""
    if torch.cuda.is_available():
        return
    import numpy as np
    from triton.runtime import interpreter

    whole_tile_dot = interpreter.InterpreterBuilder.create_dot

    def row_by_row_dot(builder, a, b, acc, *precision):
        def row(i):
            a_row = interpreter.TensorHandle(a.data[..., i:i + 1, :], a.dtype)
            acc_row = interpreter.TensorHandle(acc.data[..., i:i + 1, :], acc.dtype)
            return whole_tile_dot(builder, a_row, b, acc_row, *precision)
        rows = [row(i) for i in range(a.data.shape[-2])]
        return interpreter.TensorHandle(np.concatenate([r.data for r in rows], axis=-2), rows[0].dtype)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", row_by_row_dot)


SIZES = (1, 3, 17, 64, 200)
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def placed(row, m, slot, seed):
    """A batch of m random rows with `row` at index `slot`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, row.shape[0], generator=g).to(row.device, row.dtype)
    x[slot] = row
    return x


def assert_row_invariant(fn, row, sizes=SIZES):
    """fn(batch)[slot] has the bits of fn(row alone)[0] for every batch size, slot and neighbour content."""
    alone = fn(row[None])[0]
    for i, m in enumerate(sizes):
        for slot in {0, m // 2, m - 1}:
            got = fn(placed(row, m, slot, seed=100 * i + slot))[slot]
            assert torch.equal(got, alone), f"row differs in a batch of {m} at {slot}"


def linear_bound(x, w, eps_acc, out_dtype):
    """|y - y_exact| bound: fp32 accumulation over K (K * eps_acc * sum |x||w|, the worst-case order
    error) plus one rounding of the output to out_dtype (half an ulp: 2**-mantissa_bits relative)."""
    mag = x.double().abs() @ w.double().abs().T
    out_eps = torch.finfo(out_dtype).eps / 2
    return x.shape[1] * eps_acc * mag + out_eps * mag


# ---------------------------------------------------------------- matmul

SHAPES = [(96, 80), (160, 1100), (70, 2048)]  # (N, K): one K chunk; several, the last partial; several, even


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_linear_rows_do_not_depend_on_the_batch(impl, n, k):
    g = torch.Generator().manual_seed(n)
    w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    fn = bi.batch_invariant_linear_ref if impl == "ref" else bi.batch_invariant_linear_triton
    assert_row_invariant(lambda x: fn(x, w, b), torch.randn(k, generator=g))


def test_linear_twin_bits_do_not_depend_on_torchs_thread_count():
    """A CPU engine's batch-invariant projections give the same bits in a process of 1 thread (a Ray actor of one
    CPU) as in one of many (the trainer beside it): a CPU BLAS splits a long K over its threads."""
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(20, 4100, generator=g), torch.randn(300, 4100, generator=g), torch.randn(300, generator=g)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 4):
            torch.set_num_threads(count)
            outs.append(bi.batch_invariant_linear_ref(x, w, b))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(out, outs[0]) for out in outs[1:])


@pytest.mark.parametrize("n,k", SHAPES)
def test_linear_parallel_and_in_program_chunks_give_the_same_bits(n, k):
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(70, k, generator=g), torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    together = bi.batch_invariant_linear_triton(x, w, b, parallel=False)
    assert torch.equal(bi.batch_invariant_linear_triton(x, w, b, parallel=True), together)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_linear_matches_float64(impl, bias):
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(33, 1100, generator=g), torch.randn(160, 1100, generator=g)
    b = torch.randn(160, generator=g) if bias else None
    fn = bi.batch_invariant_linear_ref if impl == "ref" else bi.batch_invariant_linear_triton
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    err = (fn(x, w, b).double() - exact).abs()
    assert (err <= linear_bound(x, w, 2.0 ** -24, torch.float32)).all()


def test_linear_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="x must be"):
        bi.batch_invariant_linear_triton(torch.zeros(2, 8), torch.zeros(4, 9))


def test_tile_config_depends_on_the_weight_only():
    """The tile shape and the K chunk come from (N, K, dtype); every K chunk is whole BLOCK_K steps."""
    for n, k in [(4096, 2048), (2048, 6144), (151936, 2048), (28672, 4096)]:
        block_m, block_n, block_k, k_chunk, *_ = bi.tile_config(n, k, 2)
        assert k_chunk % block_k == 0 and k_chunk >= min(k, bi.MIN_K_CHUNK)


# ---------------------------------------------------------------- per-row kernels (audit: invariant)

@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_norm_and_silu_rows_do_not_depend_on_the_batch(impl):
    g = torch.Generator().manual_seed(2)
    w = torch.rand(96, generator=g) + 0.5
    rms = norm.rms_norm_ref if impl == "ref" else norm.rms_norm_triton
    silu = activation.silu_and_mul_ref if impl == "ref" else activation.silu_and_mul_triton
    assert_row_invariant(lambda x: rms(x, w, 1e-6), torch.randn(96, generator=g))
    assert_row_invariant(lambda x: rms(x, w, 1e-6, x * 0.5)[0], torch.randn(96, generator=g))
    assert_row_invariant(silu, torch.randn(96, generator=g))


# ---------------------------------------------------------------- sampling


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_sampling_fixed_splits_rows_do_not_depend_on_the_batch(top_p):
    """With FIXED_VOCAB_SPLITS (batch-invariant mode), a row's drawn token and both logprobs have the same bits
    alone or among rows of other parameters (untruncated rows split the vocabulary, truncated ones run whole),
    and token_logprobs of the drawn token gives the sampler's bits (what the on-policy forward relies on)."""
    vocab, splits = 2000, sampling.FIXED_VOCAB_SPLITS  # four chunks of 512 a row
    g = torch.Generator().manual_seed(9)
    row = torch.randn(vocab, generator=g) * 3

    def draw(m, slot, seed):
        logits = placed(row, m, slot, seed) * 3
        temperature = torch.where(torch.arange(m) % 3 == 0, 0.0, 0.8)
        top_k = torch.where(torch.arange(m) % 4 == 1, 50, 0)
        p = torch.where(torch.arange(m) % 2 == 1, 0.95, 1.0)
        min_p = torch.zeros(m)
        temperature[slot], top_k[slot], p[slot] = 0.8, 0, top_p
        seeds, positions = torch.arange(m) + 10 * seed, torch.full((m,), 5)
        seeds[slot] = 99
        tokens, processed, raw = sampling.sample_triton(logits, temperature, top_k, p, min_p, seeds, positions,
                                                        splits=splits)
        given = sampling.token_logprobs_triton(logits, tokens, temperature, top_k, p, min_p, splits=splits)
        assert torch.equal(given[0], processed) and torch.equal(given[1], raw)
        return torch.stack([tokens[slot].float(), processed[slot], raw[slot]])

    alone = draw(1, 0, 0)
    for i, m in enumerate((2, 5, 9)):
        for slot in {0, m // 2, m - 1}:
            assert torch.equal(draw(m, slot, 100 * i + slot), alone), f"row differs in a batch of {m} at {slot}"


# ---------------------------------------------------------------- attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 16


class Pool:
    """One sequence's K/V (plus other sequences') in a shuffled block pool, for building any launch over it."""

    def __init__(self, lengths, dtype, device, seed=0, heads=HEADS, kv_heads=KV_HEADS):
        g = torch.Generator().manual_seed(seed)
        used = [triton.cdiv(n, BLOCK) for n in lengths]
        ids = torch.randperm(sum(used) + 5, generator=g)
        self.width = max(used) + 2
        self.tables = torch.full((len(lengths), self.width), -1, dtype=torch.int32)
        offset = 0
        for s, n in enumerate(used):
            self.tables[s, :n] = ids[offset:offset + n]
            offset += n
        shape = (sum(used) + 5, BLOCK, kv_heads, HEAD_DIM)
        self.k = torch.randn(shape, generator=g).to(device, dtype)
        self.v = torch.randn(shape, generator=g).to(device, dtype)
        self.q = [torch.randn(n, heads, HEAD_DIM, generator=g).to(device, dtype) for n in lengths]
        self.device = device

    def inputs(self, pieces):
        """The launch arguments for pieces [(sequence, first query position, number of queries)], packed."""
        lens = [n for _, _, n in pieces]
        return (torch.cat([self.q[s][p:p + n] for s, p, n in pieces]), self.k, self.v,
                self.tables[[s for s, _, _ in pieces]].to(self.device),
                torch.tensor([p + n for _, p, n in pieces], dtype=torch.int32, device=self.device),
                torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(self.device),
                max(lens), HEAD_DIM ** -0.5)

    def run(self, fn, pieces):
        """fn over the pieces in one launch, with the fixed split; each piece's output rows."""
        return fn(*self.inputs(pieces), fixed_split=True).split([n for _, _, n in pieces])


def attention_schedules(pool, fn, length, positions):
    """Sequence 0's rows at `positions` computed: as a whole prefill, in three chunks (cut across a key
    chunk's edge), token by token, and token by token among 7 other sequences (each at its own position)."""
    whole = pool.run(fn, [(0, 0, length)])[0]
    cuts = [0, attention.FIXED_SPLIT_KEYS - 50, attention.FIXED_SPLIT_KEYS + 50, length]
    chunked = torch.cat([pool.run(fn, [(0, a, b - a)])[0] for a, b in zip(cuts, cuts[1:])])
    alone = torch.cat([pool.run(fn, [(0, p, 1)])[0] for p in positions])
    others = [(s, 3 * s + 1, 1) for s in range(1, 8)]
    among = torch.cat([pool.run(fn, others[:i % 8] + [(0, p, 1)] + others[i % 8:])[i % 8]
                       for i, p in enumerate(positions)])
    return whole[positions], chunked[positions], alone, among


def key_edges(length):
    """Positions at and around every key chunk's edge, and the last."""
    edges = range(0, length, attention.FIXED_SPLIT_KEYS)
    return sorted({q for e in edges for q in (e - 1, e, e + 1) if 0 <= q < length} | {length - 1})


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_attention_fixed_split_gives_one_query_the_same_bits_in_every_schedule(impl):
    """Prefill, chunked prefill, decode alone (the Triton kernel: chunks in programs of their own, then folded)
    and decode among 7 others (folded in one program): identical bits, over more than two key chunks."""
    length = 2 * attention.FIXED_SPLIT_KEYS + 40
    pool = Pool([length] + [40 + 9 * s for s in range(1, 8)], torch.float32, "cpu")
    fn = attention.paged_attention_ref if impl == "ref" else attention.paged_attention_triton
    whole, *others = attention_schedules(pool, fn, length, key_edges(length))
    for name, got in zip(("chunked", "alone", "among"), others):
        assert torch.equal(got, whole), f"{impl}: {name} differs from the whole prefill"


@pytest.mark.parametrize("splits", [1, 2, 3])
def test_attention_fixed_split_bits_do_not_depend_on_the_grid(monkeypatch, splits):
    """The chunks computed in 1, 2 or 3 programs (strided), then folded: the bits of one program folding them all."""
    length = 3 * attention.FIXED_SPLIT_KEYS + 7
    pool = Pool([length, 100], torch.float32, "cpu", seed=3)
    pieces = [(0, length - 1, 1), (1, 99, 1)]
    folded = pool.run(attention.paged_attention_triton, [(0, length - 8, 8)])[0][-1]  # a prefill chunk's row
    monkeypatch.setattr(attention, "_fixed_splits", lambda *_: splits)
    assert torch.equal(pool.run(attention.paged_attention_triton, pieces)[0][0], folded)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_attention_fixed_split_matches_the_reference(impl):
    """The fixed split is still attention: against the default reference within fp32 order noise (2e-5
    for values of order 1, as tests/test_kernels.py derives), decode and prefill rows both."""
    pool = Pool([300, 37, 600], torch.float32, "cpu", seed=4)
    fn = attention.paged_attention_ref if impl == "ref" else attention.paged_attention_triton
    pieces = [(0, 299, 1), (1, 0, 37), (2, 500, 100)]
    got = torch.cat(pool.run(fn, pieces))
    expected = torch.cat(pool.run(lambda *a, fixed_split: attention.paged_attention_ref(*a), pieces))
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("group", [24])
def test_attention_fixed_split_runs_models_with_more_query_heads_per_kv_head_than_a_tile_has_rows(group):
    """A model with 24 query heads per kv head (as multi-query attention has) under batch_invariant: a tile
    widens to hold one token's heads, and a row's bits still do not depend on the schedule; the values are
    attention's (the reference's bound, as in test_attention_fixed_split_matches_the_reference)."""
    length = attention.FIXED_SPLIT_KEYS + 60  # two key chunks, past the last cut of attention_schedules
    pool = Pool([length] + [40 + 9 * s for s in range(1, 8)], torch.float32, "cpu", seed=group, heads=group,
                kv_heads=1)
    positions = key_edges(length)
    whole, *others = attention_schedules(pool, attention.paged_attention_triton, length, positions)
    for name, got in zip(("chunked", "alone", "among"), others):
        assert torch.equal(got, whole), f"{name} differs from the whole prefill"
    expected = pool.run(lambda *a, fixed_split: attention.paged_attention_ref(*a), [(0, 0, length)])[0]
    torch.testing.assert_close(whole, expected[positions], atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("impl", ["ref", "triton"])
def test_attention_fixed_split_carries_a_nan_query_to_its_row(impl):
    """A NaN in one query row (a NaN weight let in with check_finite=False) makes that row's output NaN, in
    prefill and decode, and leaves the other rows as they were: a NaN must reach the logits, not vanish."""
    pool = Pool([300, 37, 600], torch.float32, "cpu", seed=4)
    fn = attention.paged_attention_ref if impl == "ref" else attention.paged_attention_triton
    pieces = [(0, 299, 1), (1, 0, 37), (2, 500, 100)]
    clean = torch.cat(pool.run(fn, pieces))
    pool.q[0][299, 1, 3] = float("nan")  # the decode row's head 1
    pool.q[2][550, 0, 0] = float("nan")  # a prefill row's head 0
    got = torch.cat(pool.run(fn, pieces))
    broken = torch.zeros_like(got, dtype=torch.bool)
    broken[0, 1], broken[1 + 37 + 50, 0] = True, True
    assert torch.isnan(got[broken]).all() and torch.equal(got[~broken], clean[~broken])


# ---------------------------------------------------------------- GPU, bfloat16

GPU_SHAPES = [(4096, 2048), (2048, 6144), (12288, 2048)]  # 1.7B qkv, down, gate_up


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_linear_bf16_rows_do_not_depend_on_the_batch(n, k):
    g = torch.Generator().manual_seed(n)
    w = torch.randn(n, k, generator=g).to("cuda", torch.bfloat16) * k ** -0.5
    row = torch.randn(k, generator=g).to("cuda", torch.bfloat16)
    assert_row_invariant(lambda x: bi.batch_invariant_linear_triton(x, w), row, sizes=SIZES + (2048,))


@gpu
@needs_cuda
@pytest.mark.parametrize("n,k", GPU_SHAPES)
def test_gpu_linear_bf16_matches_its_twin_and_float64(n, k):
    """Triton (parallel and in-program chunks: identical bits) vs the torch twin on the GPU (cuBLAS, its own
    order): both within fp32 accumulation plus one bf16 rounding of exact, so within twice that of each other."""
    g = torch.Generator().manual_seed(k)
    x = torch.randn(200, k, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", torch.bfloat16)
    b = torch.randn(n, generator=g).to("cuda", torch.bfloat16)
    got = bi.batch_invariant_linear_triton(x, w, b, parallel=False)
    assert torch.equal(bi.batch_invariant_linear_triton(x, w, b, parallel=True), got)
    exact = x.double() @ w.double().T + b.double()
    bound = linear_bound(x, w, 2.0 ** -24, torch.bfloat16) + torch.finfo(torch.bfloat16).eps / 2 * exact.abs()
    assert ((got.double() - exact).abs() <= bound).all()
    twin = bi.batch_invariant_linear_ref(x, w, b)
    assert ((got.double() - twin.double()).abs() <= 2 * bound).all()


@gpu
@needs_cuda
def test_gpu_attention_bf16_fixed_split_same_bits_in_every_schedule():
    length = 9 * attention.FIXED_SPLIT_KEYS + 40
    pool = Pool([length] + [300 + 9 * s for s in range(1, 8)], torch.bfloat16, "cuda")
    whole, *others = attention_schedules(pool, attention.paged_attention_triton, length, range(length))
    for name, got in zip(("chunked", "alone", "among"), others):
        assert torch.equal(got, whole), f"{name} differs from the whole prefill"


@gpu
@needs_cuda
def test_gpu_attention_fixed_split_under_cuda_graph():
    """A decode batch captured in a graph (chunks in programs of their own) replays the prefill's bits."""
    length = 6 * attention.FIXED_SPLIT_KEYS + 3
    pool = Pool([length], torch.bfloat16, "cuda", seed=5)
    whole = pool.run(attention.paged_attention_triton, [(0, 0, length)])[0][-1]
    args = pool.inputs([(0, length - 1, 1)])
    attention.paged_attention_triton(*args, fixed_split=True)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention.paged_attention_triton(*args, fixed_split=True)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out[0], whole)
