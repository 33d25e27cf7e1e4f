"""Packed buckets in POSIX shared memory (CPU tensors): the sender packs a bucket into one flat segment,
the receiver maps that segment and copies out of it.

Only the creator (the sender) registers the segment with multiprocessing's resource tracker and unlinks
it: the tracker then unlinks it should the sender die without close(). The receiver attaches with
shm_open and mmap directly, never touching the tracker: Python 3.11's SharedMemory registers every
attach, and unregistering again would drop the sender's registration when both live in one process.
"""
from __future__ import annotations

import mmap
import os
import re
from multiprocessing import shared_memory

import _posixshmem
import torch

_NAME = re.compile(r"psm_[0-9a-f]{4,64}")  # what multiprocessing.shared_memory names its segments


class SharedBuffer:
    """The sender's flat byte buffer in shared memory: reused for every bucket until a larger one is needed."""

    def __init__(self, nbytes: int):
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)  # registered: unlinked if we die
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.handle = {"shm": self.shm.name}

    def close(self) -> None:
        del self.tensor  # the view first: the segment cannot close under it
        self.shm.close()
        self.shm.unlink()


class Mapping:
    """The receiver's view of a sender's segment, mapped for one update at most."""

    def __init__(self, name: str):
        if not _NAME.fullmatch(name):
            raise ValueError(f"field 'handle' names shared-memory segment {name[:80]!r}; allowed: psm_<hex>, "
                             "a segment made by WeightSender")
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except OSError as err:
            raise ValueError(f"field 'handle': shared-memory segment {name!r} cannot be opened "
                             f"({err.strerror}); the sender closed it, or it is not ours") from None
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                raise ValueError(f"field 'handle': shared-memory segment {name!r} is empty")
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping stays valid without the descriptor
        self.name = name
        self.tensor = torch.frombuffer(self.mmap, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap now, or, while a view of it lives on (say in a traceback), once the last view dies."""
        self.tensor = None
        try:
            self.mmap.close()
        except BufferError:
            pass  # exported views keep the map object, and with it the mapping, until they go
        self.mmap = None
