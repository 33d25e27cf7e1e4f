"""Tensor parallelism, two ways in.

(a) One process: `Engine(path, tensor_parallel_size=N)` drives N-1 worker processes (driver.py: TPDriver;
tp_runner.py: TPModelRunner; worker.py: Worker).
(b) SPMD: every rank of the caller's torch.distributed job builds `Engine(path, process_group=pg)` and makes
the same calls (spmd.py: SPMD, AgreedBudget).
Both run the model's collectives over a TPGroup (group.py). The Engine calls one mode object (modes.py: OneDevice,
WorkerProcesses, SPMDRanks) at the seams where a call reaches the other ranks; bench_ops.py holds the
benchmark-only operations.
"""
from .bench_ops import fill_kv_random
from .driver import TPDriver
from .group import COLLECTIVE_TIMEOUT_S, TPGroup
from .modes import OneDevice, SPMDRanks, WorkerProcesses, parallel_mode
from .spmd import SPMD, AgreedBudget, call_digest, digest, ids_digest, outputs_digest
from .tp_runner import TPModelRunner

__all__ = ["COLLECTIVE_TIMEOUT_S", "SPMD", "AgreedBudget", "OneDevice", "SPMDRanks", "TPDriver", "TPGroup",
           "TPModelRunner", "WorkerProcesses", "call_digest", "digest", "fill_kv_random", "ids_digest", "outputs_digest",
           "parallel_mode"]
