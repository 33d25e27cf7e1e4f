"""Where the engine's two tenants live (tag "weights", tag "kv_cache"), and how they are paused.

On CUDA with torch_memory_saver (hook_mode "torch", no LD_PRELOAD), each tag's tensors are
allocated inside its region, and pause/resume return and re-map the physical memory
while virtual addresses stay: views and captured CUDA graphs stay valid. Elsewhere the
same calls report `keeps_addresses = False` and the engine frees and re-allocates.
"""
from __future__ import annotations

import functools
import itertools
import threading
import weakref
from contextlib import contextmanager

import torch

from pool_layout import place

from .capture_fence import CAPTURES

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
    """One engine's torch_memory_saver regions. Each engine tags its memory with its own prefix, so
    each (engine, tag) has its own pool: pausing one engine never unmaps another's memory, and a
    dropped engine's pools can be let go (`close`), so empty_cache() returns their memory."""

    _engines = itertools.count()

    def __init__(self, device: torch.device):
        self.device = device
        self.saver = _load_saver(device)
        self.paused: set[str] = set()
        self.prefix = f"engine{next(self._engines)}/"
        self.generation = dict.fromkeys(TAGS, 0)

    @property
    def keeps_addresses(self) -> bool:
        return self.saver is not None

    def _name(self, tag: str) -> str:
        """The saver's tag (and so its pool) for `tag` now: a forgotten tag's memory goes to a new pool."""
        return f"{self.prefix}{tag}#{self.generation[tag]}"

    @contextmanager
    def region(self, tag: str):
        """Allocations inside go to `tag`'s pool. torch's allocator counts an allocation into a pool as a capture
        underway, as it does a CUDA graph capture, so a region is fenced as captures are (CAPTURES)."""
        if self.saver is None:
            yield
            return
        with CAPTURES.capturing(), self.saver.region(tag=self._name(tag)):
            yield

    def pause(self, tag: str) -> None:
        if self.saver is not None:
            torch.cuda.synchronize(self.device)  # no kernel may still read what is unmapped
            self.saver.pause(self._name(tag))
            self.paused.add(tag)

    def resume(self, tag: str) -> None:
        if self.saver is not None and tag in self.paused:
            self.saver.resume(self._name(tag))
            self.paused.discard(tag)

    def forget(self, tag: str) -> None:
        """The paused tensors of `tag` were dropped: nothing of it is left to resume. Their memory stays
        unmapped in the tag's pool, whose cache would hand it out again to the next allocation (a tensor
        on unmapped addresses), so the pool goes and the tag allocates from a fresh one; empty_cache()
        then gives back the old pool's address range."""
        self.paused.discard(tag)
        if self.saver is not None:
            name = self._name(tag)
            self._drop_pools(lambda key: key == name)
            self.generation[tag] += 1
            CAPTURES.empty_cache()

    def _drop_pools(self, match) -> None:
        """Let go of the saver's pools whose tag `match`es (at once, or once no CUDA graph capture is underway)."""
        pools = self.saver._impl._mem_pools  # keyed by (tag, backup options..., device)
        CAPTURES.release([pools.pop(key) for key in [k for k in list(pools) if match(k[0])]])

    def close(self) -> None:
        """The engine is going away (or the interpreter is): re-map paused memory, so the frees of its
        tensors find it mapped, and drop its pools, so empty_cache() releases them once the tensors die."""
        for tag in list(self.paused):
            self.resume(tag)
        if self.saver is not None:
            self._drop_pools(lambda key: key.startswith(self.prefix))


class HostStash:
    """Host copies of device tensors, in one page-locked buffer allocated once and reused by every sleep.

    Page-locking is slow (about 2 GB/s, against about 55 GB/s for copies into memory already
    locked), so on CUDA `reserve` does it on a background thread when the engine starts and the
    first sleep copies at full speed. The buffer is pageable memory registered with CUDA rather
    than torch's pinned allocator, which rounds every request up to a power of two. It is registered
    in pieces of at least PIN_CHUNK bytes, cut between tensors (a copy that spans two registrations
    fails). A registration holds off graph captures (CAPTURES.between_captures()) and stalls every
    other CUDA call of the process while it runs: one call for an 8B model's 16 GB stalls them for
    about 6 s, a 256 MiB piece for about 0.1 s. On the CPU the "host copy" is the tensor itself."""

    PIN_CHUNK = 256 << 20
    PAGE = 4096  # pieces begin on a page of their own: two registrations may not share one

    def __init__(self):
        self.buf: torch.Tensor | None = None
        self._pinning: threading.Thread | None = None
        self._unpin = lambda: None  # unregisters `buf`; a buffer is unregistered before it is freed

    @staticmethod
    def _offsets(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, int], int]:
        sizes = [t.numel() * t.element_size() for t in tensors.values()]
        placement = place(sizes, [HostStash.PAGE] * len(sizes))
        return dict(zip(tensors, placement.offsets)), placement.total

    @classmethod
    def pieces(cls, starts, total: int) -> list[tuple[int, int]]:
        """(begin, end) byte ranges that cover [0, total), each cut at a tensor's start once PIN_CHUNK long."""
        ranges, begin = [], 0
        for start in sorted(starts):
            if start - begin >= cls.PIN_CHUNK:
                ranges.append((begin, start))
                begin = start
        return ranges + [(begin, total)] if total > begin else ranges

    def reserve(self, tensors: dict[str, torch.Tensor]) -> None:
        """Start page-locking a buffer that holds `tensors` (CUDA only), without waiting for it."""
        device = _device_of(tensors)
        if device is not None and device.type == "cuda":
            offsets, total = self._offsets(tensors)
            self._pinning = threading.Thread(target=self._lock, args=(offsets.values(), total, device), daemon=True)
            self._pinning.start()

    def wait(self) -> None:
        """Until the page-locking `reserve` started has ended."""
        if self._pinning is not None:
            self._pinning.join()
            self._pinning = None

    def _lock(self, starts, nbytes: int, device: torch.device) -> None:
        self._unpin()  # a registration outliving its memory would cover whatever the process puts there next
        self.buf = None
        raw = torch.empty(nbytes + self.PAGE, dtype=torch.uint8)
        buf = raw[-raw.data_ptr() % self.PAGE:][:nbytes]
        cudart, registered = torch.cuda.cudart(), []
        # The finalizer holds the buffer: memory freed while still registered (its unregistration deferred
        # past a capture) could be handed to a new buffer whose registration then fails.
        self._unpin = weakref.finalize(self, CAPTURES.after_captures,
                                       functools.partial(_unregister, cudart, registered, buf))
        for begin, end in self.pieces(starts, nbytes):
            # The first piece starts at the storage's own start, so that is_pinned() holds for the copies.
            low = raw.data_ptr() if begin == 0 else buf.data_ptr() + begin
            # A registration belongs to the calling thread's current device (0 in a new thread), not the engine's.
            with CAPTURES.between_captures(), torch.cuda.device(device):
                rc = int(cudart.cudaHostRegister(low, buf.data_ptr() + end - low, 0))
            if rc != 0:
                self._unpin()
                raise RuntimeError(f"cudaHostRegister of {end - begin} bytes (of {nbytes}) failed: error {rc}")
            registered.append(low)
        self.buf = buf

    def save(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        device = _device_of(tensors)
        if device is None or device.type == "cpu":
            return dict(tensors)
        self.wait()
        offsets, total = self._offsets(tensors)
        if self.buf is None or self.buf.numel() < total:
            self._lock(offsets.values(), total, device)
        copies = {}
        for n, t in tensors.items():
            view = self.buf[offsets[n] : offsets[n] + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            copies[n] = view.copy_(t, non_blocking=True)  # the caller synchronises before reusing t
        return copies


def _device_of(tensors: dict[str, torch.Tensor]) -> torch.device | None:
    return next(iter(tensors.values())).device if tensors else None


def _unregister(cudart, pointers: list[int], buf: torch.Tensor) -> None:
    """Unregister `buf`'s pieces; the caller's reference to `buf` kept it allocated until now."""
    while pointers:
        cudart.cudaHostUnregister(pointers.pop())


@contextmanager
def default_dtype(dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def parse_tags(tags) -> set[str]:
    """sleep/wake's `tags`: None (all), one tag, or a non-empty collection of them."""
    allowed = f"tags={tags!r} is not allowed; tags are None (all) or a non-empty subset of {list(TAGS)}"
    try:
        chosen = set(TAGS if tags is None else [tags] if isinstance(tags, str) else tags)
    except TypeError:
        raise ValueError(allowed) from None
    if not chosen or not chosen <= set(TAGS):
        raise ValueError(allowed)
    return chosen


def tags_key(tags):
    """`tags` as SPMD ranks compare a call's arguments: sorted, since a set's order is each process's own."""
    try:
        return sorted(parse_tags(tags))
    except ValueError:
        return tags  # refused by the call itself, on every rank alike
