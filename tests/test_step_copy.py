"""rollout_kernels/step_copy.py: a step's buffer and its fed input ids in one kernel, against the twin; and results
written straight into pinned host memory."""
import pytest
import torch

from compile_check import assert_compiles

from rollout_kernels.step_copy import copy_step_ref, copy_step_triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def operands(words, ids_at, feed_at, fed, rows_out, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(-2**62, 2**62, (words + 5,), generator=g, dtype=torch.int64)
    src[feed_at : feed_at + fed] = torch.randint(0, rows_out, (fed,), generator=g)
    last_out = torch.zeros(rows_out, 2, dtype=torch.float64)
    last_out[:, 0] = torch.randperm(151936, generator=g)[:rows_out].double()  # token ids, exact in float64
    last_out[:, 1] = -torch.rand(rows_out, generator=g, dtype=torch.float64)
    if DEV == "cuda":
        src = src.pin_memory()  # the engine's host twin: read by the kernel through unified addressing
    return src, torch.full((words + 5,), -1, dtype=torch.int64, device=DEV), last_out.to(DEV)


@pytest.mark.parametrize("words,ids_at,feed_at,fed,rows_out", [
    (40, 0, 24, 3, 4),        # the input ids first, as in StepBuffers
    (3000, 8, 2700, 256, 256),  # several programs; fed rows past the first program's words
    (17, 0, 10, 0, 1),        # nothing fed: a plain upload
])
def test_one_kernel_gives_the_twins_words(words, ids_at, feed_at, fed, rows_out):
    """The buffer's words as the host wrote them, except fed input id i: the token of last_out's row
    feed_rows[i]; nothing past `words` is written."""
    src, dst, last_out = operands(words, ids_at, feed_at, fed, rows_out)
    want = dst.clone()
    copy_step_ref(src.to(DEV), want, words, ids_at, feed_at, fed, last_out)
    copy_step_triton(src, dst, words, ids_at, feed_at, fed, last_out)
    assert torch.equal(dst.cpu(), want.cpu())
    assert (dst[words:] == -1).all()
    rows = src[feed_at : feed_at + fed].to(DEV)
    assert torch.equal(dst[ids_at : ids_at + fed], last_out[rows, 0].long())


def test_a_strided_output_is_refused():
    src, dst, last_out = operands(8, 0, 4, 1, 2)
    with pytest.raises(ValueError, match="last_out"):
        copy_step_triton(src, dst, 8, 0, 4, 1, last_out.t().contiguous().t())


def test_results_land_in_pinned_host_memory():
    """The way back: a float64 result block written by the kernel into the host's (pinned) slot."""
    out = torch.randn(37, 2, dtype=torch.float64, device=DEV)
    host = torch.zeros(37, 2, dtype=torch.float64, pin_memory=DEV == "cuda")
    copy_step_triton(out.view(torch.int64).reshape(-1), host.view(torch.int64).reshape(-1), out.numel())
    if DEV == "cuda":
        torch.cuda.synchronize()
    assert torch.equal(host, out.cpu())


COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rollout_kernels import step_copy
signature = dict(src="*i64", dst="*i64", words="i32", ids_at="i32", feed_at="i32", fed="i32", last_out="*fp64",
                 stride_out="i32", BLOCK="constexpr")
triton.compile(ASTSource(step_copy._copy_step_kernel, signature, dict(BLOCK=1024)), target=GPUTarget("cuda", 90, 32))
"""


def test_kernel_compiles_for_the_gpu():
    """Built by the compiler, not the interpreter (compile_check), with this Triton and the GPU machine's."""
    assert_compiles(COMPILE)
