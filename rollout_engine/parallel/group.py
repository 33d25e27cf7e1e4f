"""The tensor-parallel group: this rank's place in it and the model's collectives over it.

gloo on the CPU, NCCL on CUDA, used directly: torch.distributed's default group is neither needed nor
touched. A collective that fails raises EngineDeadError and marks the group failed (gloo: at once when a
rank's socket closes, else after COLLECTIVE_TIMEOUT_S; with NCCL a hang is the NCCL watchdog's, which ends
the process after the same timeout).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import EngineDeadError

COLLECTIVE_TIMEOUT_S = 60  # a collective waiting longer: a rank is gone or stuck
LOOPBACK = "127.0.0.1"     # gloo binds this address only


class TPGroup:
    """This rank's place in the tensor-parallel group and the model's collectives over it."""

    def __init__(self, backend, rank: int, size: int, device: torch.device, timeout: str):
        self.backend, self.rank, self.size, self.device = backend, rank, size, device
        self.timeout = timeout  # how long a collective waits, in words, for the error that says so
        self.failed = False

    @classmethod
    def of(cls, group, device: torch.device) -> "TPGroup":
        """The caller's process group (SPMD): its timeout is the one the caller gave it."""
        return cls(group, group.rank(), group.size(), device, "the process group's timeout")

    @classmethod
    def join(cls, rendezvous: str, rank: int, size: int, device: torch.device) -> "TPGroup":
        """Every rank calls this; it returns once all have joined."""
        store = dist.FileStore(rendezvous, size)
        timeout, own = timedelta(seconds=COLLECTIVE_TIMEOUT_S), f"{COLLECTIVE_TIMEOUT_S} s"
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(dist.ProcessGroupNCCL(store, rank, size, options), rank, size, device, own)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        return cls(dist.ProcessGroupGloo(store, rank, size, options), rank, size, device, own)

    def close(self) -> None:
        """Release a gloo backend now, and with it its loopback listener, rather than when the garbage collector
        drops the last of the many references to this group (the model's layers hold it); no collective runs
        after. Only for a group this engine joined (the caller's, SPMD, is the caller's), and not NCCL's, whose
        teardown with its peers gone is not tested here (it stays with the garbage collector)."""
        if self.device.type != "cuda":
            self.backend = None
        self.failed = True

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            self.failed = True
            raise EngineDeadError(f"a tensor-parallel collective failed (a rank exited or stopped answering "
                                  f"within {self.timeout}): {err}") from err

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self._wait(self.backend.allreduce([x]))
        return x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (the same shape on each), stacked in rank order: [size, *x.shape]."""
        out = x.new_empty(self.size, *x.shape)
        self._wait(self.backend._allgather_base(out.view(-1), x.contiguous().view(-1)))
        return out

    def gather_vocab(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, V / size] logits of each rank's vocabulary slice -> [rows, V], in rank order."""
        rows, part = x.shape
        return self.gather(x).permute(1, 0, 2).reshape(rows, self.size * part)

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's `t` into every rank's `t` (same byte count on each)."""
        if t.numel():
            options = dist.BroadcastOptions()
            options.rootRank = 0
            self._wait(self.backend.broadcast([t], options))


def dtype_named(name: str) -> torch.dtype:
    """The torch dtype `str(dtype)` names, as the driver's messages carry it."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype
