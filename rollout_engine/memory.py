"""Where the engine's two tenants live (tag "weights", tag "kv_cache"), and how they are paused.

On CUDA with torch_memory_saver (hook_mode "torch", no LD_PRELOAD), each tag's tensors are
allocated inside its region, and pause/resume return and re-map the physical memory
while virtual addresses stay: views and captured CUDA graphs stay valid. Elsewhere the
same calls report `keeps_addresses = False` and the engine frees and re-allocates.
"""
from __future__ import annotations

import atexit
from contextlib import contextmanager, nullcontext

import torch

TAGS = ("weights", "kv_cache")


def _load_saver(device: torch.device):
    if device.type != "cuda":
        return None
    try:
        from torch_memory_saver import torch_memory_saver
    except ImportError:
        return None
    if torch_memory_saver._impl is None:  # configurable once per process, before first use
        torch_memory_saver.hook_mode = "torch"
        with torch_memory_saver.region(tag="kv_cache"):
            pass  # initialise now
        # In "torch" hook mode the allocator's free hook insists on running inside a region()
        # (thread-local flag), but torch frees pool blocks whenever it likes: on empty_cache(), when
        # an engine is dropped, and while the interpreter shuts down, which then failed with "only
        # support interesting region" and a non-zero exit. Mallocs only reach the hook from inside
        # region() anyway, so marking every thread's default as "inside" changes nothing else.
        torch_memory_saver._impl._binary_wrapper.cdll.tms_set_interesting_region(True)
    return torch_memory_saver


class DeviceMemory:
    def __init__(self, device: torch.device):
        self.device = device
        self.saver = _load_saver(device)
        self.paused: set[str] = set()
        if self.saver is not None:
            atexit.register(self.close)

    @property
    def keeps_addresses(self) -> bool:
        return self.saver is not None

    def region(self, tag: str):
        return self.saver.region(tag=tag) if self.saver is not None else nullcontext()

    def pause(self, tag: str) -> None:
        if self.saver is not None:
            torch.cuda.synchronize(self.device)  # no kernel may still read what is unmapped
            self.saver.pause(tag)
            self.paused.add(tag)

    def resume(self, tag: str) -> None:
        if self.saver is not None and tag in self.paused:
            self.saver.resume(tag)
            self.paused.discard(tag)

    def forget(self, tag: str) -> None:
        """The paused tensors of `tag` were dropped: nothing of it is left to resume."""
        self.paused.discard(tag)

    def close(self) -> None:
        """Re-map paused memory so the allocator's frees at interpreter exit find it mapped."""
        for tag in list(self.paused):
            self.resume(tag)


class HostStash:
    """Host copies of device tensors, in one pinned buffer allocated once and reused by every sleep.

    Page-locking is slow: a fresh pinned allocation per tensor moved weights at under 2 GB/s,
    against about 55 GB/s for copies into memory that is already pinned. On the CPU the
    "host copy" is the tensor itself."""

    def __init__(self):
        self.buf: torch.Tensor | None = None

    def save(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not tensors or next(iter(tensors.values())).device.type == "cpu":
            return dict(tensors)
        sizes = {n: -(-t.numel() * t.element_size() // 64) * 64 for n, t in tensors.items()}
        if self.buf is None or self.buf.numel() < sum(sizes.values()):
            self.buf = torch.empty(sum(sizes.values()), dtype=torch.uint8, pin_memory=True)
        copies, offset = {}, 0
        for n, t in tensors.items():
            view = self.buf[offset : offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            copies[n] = view.copy_(t, non_blocking=True)  # the caller synchronises before reusing t
            offset += sizes[n]
        return copies


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
