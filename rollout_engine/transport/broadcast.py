"""Weights across GPUs (or hosts): packed buckets broadcast over a process group of their own."""
from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..config_checks import flag
from ..sampling_params import is_int
from .protocol import check_seconds

LOOPBACK = "127.0.0.1"
DEFAULT_GROUP_TIMEOUT_S = 600  # covers the rendezvous (both processes loading their models) and each broadcast


@dataclass
class WeightUpdateGroup:
    """A process group of its own for weight broadcasts: rank 0 (the trainer) sends, every other rank receives."""

    backend: object        # torch's ProcessGroupNCCL or ProcessGroupGloo, used directly (no default group)
    device: torch.device   # where broadcast buffers live: the current CUDA device for nccl, the CPU for gloo
    rank: int

    def broadcast(self, flat: torch.Tensor) -> None:
        """Rank 0's `flat` into every other rank's `flat` (same byte count on each side)."""
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self.backend.broadcast([flat], options).wait()

    def close(self) -> None:
        """Shut the group down (NCCL otherwise warns at exit that it was never destroyed). With NCCL this
        returns once every rank has called it: a rank that waits for another before closing deadlocks."""
        self.backend.shutdown()


def init_weight_update_group(master_address: str, master_port: int, rank: int, world_size: int,
                             backend: str | None = None, timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                             allow_remote: bool = False) -> WeightUpdateGroup:
    """Join the weight-update group; every rank calls this, and it returns once all have joined.

    Rank 0 is the trainer: it hosts the rendezvous store and broadcasts; the engines are ranks
    1 .. world_size - 1. backend: "nccl" (CUDA buffers on the current device: call
    torch.cuda.set_device first) or "gloo" (CPU); default nccl when CUDA is available.
    torch.distributed's default group is neither needed nor touched.

    master_address is 127.0.0.1 (one host) unless allow_remote=True. Another address (rank 0's
    address on a network the other ranks reach) exposes, to every machine that can reach it: the
    rendezvous store (a TCPStore on master_port: anyone who connects can read and write its keys)
    and, with gloo, the group's own ports on that interface; NCCL listens on the interface it picks
    (NCCL_SOCKET_IFNAME chooses; NCCL_SOCKET_IFNAME=lo keeps one host on loopback). None of them
    authenticates or encrypts anything: use a network only the job's machines can reach."""
    flag(allow_remote, "allow_remote")
    if not isinstance(master_address, str) or not master_address:
        raise ValueError(f"master_address={master_address!r} is not allowed; an address string")
    if master_address != LOOPBACK and not allow_remote:
        raise ValueError(f"master_address={master_address!r} is not allowed without allow_remote=True (which "
                         f"exposes the group's store and ports to that network, unauthenticated); use {LOOPBACK}")
    if isinstance(master_port, bool) or not isinstance(master_port, int) or not 1 <= master_port <= 65535:
        raise ValueError(f"master_port={master_port!r} is not allowed; an int from 1 to 65535")
    if not (is_int(world_size) and world_size >= 2 and is_int(rank) and 0 <= rank < world_size):
        raise ValueError(f"rank={rank!r}, world_size={world_size!r}: need world_size >= 2 and 0 <= rank < world_size")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not allowed; 'nccl' or 'gloo'")
    check_seconds("timeout_s", timeout_s)
    timeout = timedelta(seconds=timeout_s)
    # Rank 0 binds the store's socket itself, on master_address only: TCPStore alone listens on every interface.
    listen_fd = _listen(master_address, master_port) if rank == 0 else None
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=listen_fd)
    store = dist.PrefixStore("weight_update/", store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=master_address)]
        return WeightUpdateGroup(dist.ProcessGroupGloo(store, rank, world_size, options), torch.device("cpu"), rank)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    device = torch.device("cuda", torch.cuda.current_device())
    return WeightUpdateGroup(dist.ProcessGroupNCCL(store, rank, world_size, options), device, rank)


def _listen(address: str, port: int) -> int:
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(address).version == 6 else socket.AF_INET
    except ValueError:
        family = socket.AF_INET  # a host name: its IPv4 address
    return socket.create_server((address, port), family=family).detach()
