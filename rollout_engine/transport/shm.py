"""Packed buckets in POSIX shared memory (CPU tensors): the sender packs a bucket into one flat segment,
the receiver reads each bucket's bytes out of it (never maps it: see Segment).

Only the creator (the sender) registers the segment with multiprocessing's resource tracker and unlinks
it: the tracker then unlinks it should the sender die without close(). The receiver opens it with
shm_open directly, never touching the tracker: Python 3.11's SharedMemory registers every
attach, and unregistering again would drop the sender's registration when both live in one process.
"""
from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import weakref
from multiprocessing import shared_memory

import _posixshmem
import torch

from ..weights import padded
from .protocol import check_fits, tensor_nbytes

_NAME = re.compile(r"psm_[0-9a-f]{4,64}")  # what multiprocessing.shared_memory names its segments


class SharedBuffer:
    """The sender's flat byte buffer in shared memory: reused for every bucket until a larger one is needed."""

    def __init__(self, nbytes: int):
        self.shm = shared_memory.SharedMemory(create=True, size=nbytes)  # registered: unlinked if we die
        self.tensor = torch.frombuffer(self.shm.buf, dtype=torch.uint8)
        self.handle = {"shm": self.shm.name}
        self.reserved = 0  # the bytes from the segment's start whose pages it holds
        # A sender dropped without close() takes its segment (tmpfs: memory) with it, not at the process's exit.
        self._unlink = weakref.finalize(self, _unlink, self.shm, os.getpid())

    def reserve(self, nbytes: int) -> None:
        """Take the pages of the segment's first `nbytes` bytes before they are written: tmpfs gives a page at its
        first write, and a write that finds /dev/shm full kills the process (SIGBUS). An OSError instead."""
        if nbytes > self.reserved:
            try:
                os.posix_fallocate(self.shm._fd, self.reserved, nbytes - self.reserved)
            except OSError as err:
                if err.errno not in (errno.ENOSPC, errno.EFBIG):  # no fallocate here: the pages come as written
                    return
                raise OSError(err.errno, f"/dev/shm has no room for a {nbytes}-byte bucket ({err.strerror}): give "
                                         "/dev/shm more room (Docker: --shm-size), or WeightSender a smaller "
                                         "bucket_bytes (no smaller than the largest tensor)") from None
            self.reserved = nbytes

    def close(self) -> None:
        del self.tensor  # the view first: the segment cannot close under it
        self.shm.close()
        self._unlink()


def _unlink(shm: shared_memory.SharedMemory, pid: int) -> None:
    """Remove the segment's name (its memory goes once the last mapping of it does); not from a forked child,
    whose exit runs the finalizers too: the segment is its parent's."""
    if os.getpid() == pid:
        with contextlib.suppress(FileNotFoundError):
            shm.unlink()


class Segment:
    """A sender's shared-memory segment, open for one update and read, never mapped: each bucket's bytes are
    copied (os.preadv) into a buffer the receiver owns. A segment that its sender shrinks (ftruncate) is
    then a size check that fails, or a short read, both a refused bucket; a mapping read past the segment's
    new end would kill the engine's process with SIGBUS. The descriptor is read-only."""

    def __init__(self, name: str):
        if not _NAME.fullmatch(name):
            raise ValueError(f"field 'handle' names shared-memory segment {name[:80]!r}; allowed: psm_<hex>, "
                             "a segment made by WeightSender")
        try:  # non-blocking: a FIFO planted under the name would block the open until someone writes to it
            self.fd = _posixshmem.shm_open("/" + name, os.O_RDONLY | os.O_NONBLOCK, mode=0o600)
        except OSError as err:
            raise ValueError(f"field 'handle': shared-memory segment {name!r} cannot be opened "
                             f"({err.strerror}); the sender closed it, or it is not ours") from None
        info = os.fstat(self.fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            os.close(self.fd)
            raise ValueError(f"field 'handle': {name!r} is not a shared-memory segment of this user's (a "
                             f"{'regular file' if stat.S_ISREG(info.st_mode) else 'special file'} of uid "
                             f"{info.st_uid}); WeightSender makes its own")
        os.set_blocking(self.fd, True)
        self.name = name

    def read(self, items: list[dict], buffer) -> tuple[torch.Tensor, list[dict]]:
        """The bucket's tensors copied out of the segment: (flat bytes, items with offsets into them). Items
        lie in the flat bytes as a sender packs them (each at a multiple of ALIGN; `buffer(nbytes)` gives
        the bytes), and runs of items the segment holds in that layout are read with one call each."""
        what = f"shared-memory segment {self.name!r}"
        check_fits(items, os.fstat(self.fd).st_size, what)  # now, not when first opened
        placed, runs, end = [], [], 0  # runs: [segment offset, flat offset, bytes]
        for item in items:
            nbytes = tensor_nbytes(item)
            placed.append(item | {"offset": end})
            if nbytes and runs and item["offset"] - runs[-1][0] == end - runs[-1][1]:
                runs[-1][2] = end + nbytes - runs[-1][1]
            elif nbytes:
                runs.append([item["offset"], end, nbytes])
            end += padded(nbytes)
        flat = buffer(end)
        # A writable view of the flat bytes (a uint8 tensor's bytes as they are); os.preadv copies in the kernel
        # and releases the GIL. It stops short at the segment's end: a truncation since the check above.
        out = memoryview(flat.numpy()) if end else memoryview(b"")
        for start, at, nbytes in runs:
            done = 0
            while done < nbytes:  # a read returns at most about 2 GiB
                got = os.preadv(self.fd, [out[at + done : at + nbytes]], start + done)
                if got == 0:
                    raise ValueError(f"{what} ended at byte {start + done} while its bucket's bytes up to "
                                     f"{start + nbytes} were read: the sender shrank it during the update")
                done += got
        return flat, placed

    def close(self) -> None:
        os.close(self.fd)
