"""The level-1 host copy's page-locked buffer (`memory.HostStash`).

It is registered with CUDA in pieces cut between tensors, so that no copy spans two registrations and no single
page-locking call holds the driver for seconds. A save larger than the buffer replaces it, and the outgrown
buffer is unregistered before it is freed: a registration outliving its memory would cover whatever the process
allocates there next, and the stash's finalizer would unregister that later."""
import ctypes

import pytest
import torch

from rollout_engine.memory import HostStash

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
MB = 1 << 20


def registered(address: int) -> bool:
    """Whether CUDA counts this byte as page-locked host memory. Tensor.is_pinned() asks about its storage's start
    only, so the byte gets a one-byte tensor of its own."""
    return torch.frombuffer((ctypes.c_ubyte * 1).from_address(address), dtype=torch.uint8).is_pinned()


@pytest.mark.parametrize("sizes_mb", [[1] * 10, [5, 1, 1, 1, 7, 1], [20], [1, 20, 1], [2, 2, 0, 2]])
def test_pieces_cover_the_buffer_and_cut_only_between_tensors(monkeypatch, sizes_mb):
    monkeypatch.setattr(HostStash, "PIN_CHUNK", 3 * MB)
    starts = [sum(sizes_mb[:i]) * MB for i in range(len(sizes_mb))]
    total = sum(sizes_mb) * MB
    pieces = HostStash.pieces(starts, total)
    assert pieces[0][0] == 0 and pieces[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:])), "pieces are contiguous"
    assert {b for b, _ in pieces} <= set(starts), "a piece begins where a tensor does"
    assert all(e - b >= 3 * MB for b, e in pieces[:-1]), "every piece but the last is at least PIN_CHUNK"
    largest = max(sizes_mb) * MB
    assert all(e - b < 3 * MB + largest for b, e in pieces), "a piece ends at the first tensor start past PIN_CHUNK"


def test_a_buffer_under_one_chunk_is_one_piece():
    assert HostStash.pieces([0, 64, 4096], 8192) == [(0, 8192)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("chunk", [HostStash.PIN_CHUNK, 1 * MB], ids=["one piece", "pieces"])
def test_an_outgrown_buffer_is_unregistered_and_the_larger_save_lands_whole(monkeypatch, chunk):
    monkeypatch.setattr(HostStash, "PIN_CHUNK", chunk)
    stash = HostStash()
    small = {"w": torch.arange(1024, dtype=torch.float32, device="cuda")}
    copy = stash.save(small)
    torch.cuda.synchronize()
    assert torch.equal(copy["w"], small["w"].cpu())
    outgrown = stash.buf
    assert outgrown.is_pinned() and registered(outgrown.data_ptr())  # registered memory: cudaMemoryTypeHost

    large = {f"w{i}": torch.arange(i, i + 400_000, dtype=torch.float32, device="cuda") for i in range(5)}
    large["b"] = torch.full((3,), 7.0, dtype=torch.bfloat16, device="cuda")
    copy = stash.save(large)
    torch.cuda.synchronize()
    assert stash.buf.data_ptr() != outgrown.data_ptr()
    assert not registered(outgrown.data_ptr()), "the outgrown buffer is still registered with CUDA"
    assert all(torch.equal(copy[n], t.cpu()) for n, t in large.items())
    for n, t in copy.items():  # every tensor's host copy, first and last byte, lies in registered memory
        first, last = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size() - 1
        assert registered(first) and registered(last), n
    assert stash.buf.is_pinned()  # the storage's start is registered too


@pytest.mark.gpu
@needs_cuda
def test_a_save_that_fits_reuses_the_registered_buffer():
    stash = HostStash()
    stash.save({"w": torch.ones(4096, device="cuda")})
    buf = stash.buf
    copy = stash.save({"w": torch.full((1024,), 3.0, device="cuda")})
    torch.cuda.synchronize()
    assert stash.buf.data_ptr() == buf.data_ptr() and registered(buf.data_ptr())
    assert torch.equal(copy["w"], torch.full((1024,), 3.0))
