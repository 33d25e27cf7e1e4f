"""StepBuffers: every tensor a forward step reads, as views of one device buffer with a pinned host twin.

A step writes its token ids, positions, slots, block tables and sampling parameters into the
host twin (numpy views, cheap to fill from Python lists) and moves them with ONE kernel that reads
the pinned twin (rollout_kernels/step_copy.py; it also feeds a step launched ahead its input tokens from the
last output); captured CUDA graphs read the same device views, so a replay needs no further copies.
The step's results come back the same way: one kernel writes a float64 block of (token, logprob) pairs
into a pinned slot.
On the CPU the twin is the buffer itself and nothing is copied.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from rollout_kernels.shared_prefix import MAX_MEMBERS
from rollout_kernels.step_copy import copy_step_ref, copy_step_triton
from pool_layout import place

_ALIGN = 64
# Whether a CUDA step's inputs and results move by copy_step's kernel; False: by the copy engine (copy_step_ref,
# a cudaMemcpyAsync each way and the feed as index_select + copy_), for comparisons. Read at each call.
KERNEL_COPIES = True


def _whole_words(nbytes: int) -> int:
    """`nbytes` rounded up to whole int64 words, the unit copy_step moves."""
    return -(-nbytes // 8) * 8


def _fields(max_tokens: int, max_rows: int, max_blocks: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    tok, row, groups = (max_tokens,), (max_rows,), max(1, max_rows // 2)  # a group has two members or more
    return {
        "input_ids": (torch.int64, tok), "positions": (torch.int64, tok), "slot_mapping": (torch.int64, tok),
        # per sampled row: which logits row it reads, and its sampling parameters
        "logit_rows": (torch.int64, row), "seeds": (torch.int64, row), "sample_positions": (torch.int64, row),
        "feed_rows": (torch.int64, row),  # a step launched ahead: where each row's newest token is in the last output
        "temperature": (torch.float32, row), "top_p": (torch.float32, row), "min_p": (torch.float32, row),
        "top_k": (torch.int32, row), "raw_mode": (torch.bool, row),
        "seq_lens": (torch.int32, row), "query_start_loc": (torch.int32, (max_rows + 1,)),
        # a decode step's groups of sequences sharing a prompt (rollout_kernels/shared_prefix.SharedPrefix)
        "prefix_members": (torch.int32, (groups, MAX_MEMBERS)), "prefix_keys": (torch.int32, (groups,)),
        "prefix_first_key": (torch.int32, row),
        "block_tables": (torch.int32, (max_rows, max_blocks)),  # last: a step copies a prefix of whole rows
    }


class StepBuffers:
    def __init__(self, max_tokens: int, max_rows: int, max_blocks: int, device: torch.device):
        self.max_tokens, self.max_rows, self.max_blocks = max_tokens, max_rows, max_blocks
        self.specs = _fields(max_tokens, max_rows, max_blocks)
        sizes = [dtype.itemsize * math.prod(shape) for dtype, shape in self.specs.values()]
        self.placement = place(sizes, [_ALIGN] * len(sizes))
        on_cuda = device.type == "cuda"
        total = _whole_words(self.placement.total)
        self.host_buf = torch.zeros(total, dtype=torch.uint8, pin_memory=on_cuda)
        self.device_buf = self.host_buf.to(device) if on_cuda else self.host_buf
        self.host = {n: t.numpy() for n, t in self._views(self.host_buf).items()}
        self.dev = self._views(self.device_buf)
        self.host_words, self.words = self.host_buf.view(torch.int64), self.device_buf.view(torch.int64)
        # word offsets of the two int64 fields copy_step reads as it copies (fields start 64-byte aligned)
        names = list(self.specs)
        self.ids_at, self.feed_at = (self.placement.span(names.index(n))[0] // 8 for n in ("input_ids", "feed_rows"))
        # Two result slots: a step launched ahead copies its results back while the previous one's are read.
        self.host_out = torch.zeros(2, 2 * (max_tokens + max_rows), dtype=torch.float64, pin_memory=on_cuda)
        self.slot = 0
        self.uploaded = torch.cuda.Event() if on_cuda else None

    def _views(self, buf: torch.Tensor) -> dict[str, torch.Tensor]:
        return {name: buf[start:stop].view(dtype).view(shape)
                for i, (name, (dtype, shape)) in enumerate(self.specs.items())
                for start, stop in [self.placement.span(i)]}

    @property
    def nbytes(self) -> int:
        return self.device_buf.numel() if self.uploaded is not None else 0  # device bytes

    def begin(self) -> None:
        """Call before writing the host twin: the previous upload must have read it."""
        if self.uploaded is not None:
            self.uploaded.synchronize()

    def upload(self, rows: int, last_out: torch.Tensor | None = None, fed: int = 0) -> None:
        """Move every field, block tables up to row `rows`, to the device in one kernel (rollout_kernels/step_copy.py).
        With `last_out` (a launched step's float64 output), input ids 0..fed-1 are instead the tokens of its
        rows feed_rows[:fed]: a step launched ahead of the one that computes them."""
        if self.uploaded is None:  # the CPU: the twin is the buffer; only the fed ids move
            if fed:
                copy_step_ref(self.words, self.words, 0, self.ids_at, self.feed_at, fed, last_out)
            return
        (copy_step_triton if KERNEL_COPIES else copy_step_ref)(self.host_words, self.words, self.used_bytes(rows) // 8,
                                                               self.ids_at, self.feed_at, fed, last_out)
        self.uploaded.record()

    def used_bytes(self, rows: int) -> int:
        """The prefix of the buffer a step of `rows` block-table rows reads: every field, then those rows,
        in whole 8-byte words."""
        start, _ = self.placement.span(len(self.specs) - 1)
        return _whole_words(start + rows * self.max_blocks * 4)

    def send_back(self, out: torch.Tensor):
        """Start copying a float64 result block to the host (alternating slots); `receive` waits for it."""
        if out.device.type != "cuda":
            return out, None
        self.slot ^= 1
        host = self.host_out[self.slot, : out.numel()].view(out.shape)
        if KERNEL_COPIES and out.dtype == torch.float64 and out.is_contiguous():
            copy_step_triton(out.view(torch.int64).reshape(-1), host.view(torch.int64).reshape(-1), out.numel())
        else:
            host.copy_(out, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return host, done

    def receive(self, sent) -> np.ndarray:
        """The result block `send_back` started copying, once it is on the host."""
        host, done = sent
        if done is not None:
            done.synchronize()  # this step only: a step launched after it may still be running
        return host.numpy().copy()

    def download(self, out: torch.Tensor) -> np.ndarray:
        """A float64 result block on the host: a synchronous step's one host synchronisation."""
        return self.receive(self.send_back(out))
