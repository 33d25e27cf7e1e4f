"""Tensor parallelism over worker processes: `Engine(path, tensor_parallel_size=N)` is rank 0 (TPDriver,
TPModelRunner) and drives N-1 worker processes (worker.py).

The driver (rank 0, the caller's process) keeps the scheduler, the block manager, sampling and the outputs.
Each worker (rank r, a fresh interpreter running `main`, on `cuda:<first + r>` or the CPU) holds its
shard of the weights (model.py says which rows or columns) and a KV pool for its own KV heads, carved with
the driver's block count, so the driver's block ids index every rank's pool alike.

Two channels per worker. Commands: a socket pair made for it (no address anywhere), small JSON messages;
the worker waits on it while idle and exits when it closes (the driver's engine shut down, or its process
died). Tensors: the tensor-parallel group (group.py), whose rendezvous is a file in a private directory.
A step is ONE message: a command naming it (op, shapes, block copies), then the used prefix
of the step buffers broadcast over the group (after the upload and the on-device feed of the newest tokens,
so every rank reads the same inputs). Every rank then runs the same forward, whose all-reduces keep the
hidden states equal, and the same sampler with the same noise on the all-gathered logits; only the
driver's tokens are read.

A worker that dies makes the next call raise EngineDeadError (the driver checks each worker's exit status
before every message), and one that dies or stops answering inside a collective makes the collective raise
it (group.py).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection

import torch

from ..errors import EngineDeadError, EngineError
from ..model_runner import ModelRunner
from ..weight_store import named_pairs
from ..weights import GROUP_BYTES, ReusableGroup, buckets
from .bench_ops import fill_kv_random, gather_number, time_collectives
from .group import TPGroup

REPLY_TIMEOUT_S = 900      # a worker's answer to a command (its start loads a checkpoint shard)
EXIT_GRACE_S = 5           # after "shutdown", before a worker is killed
# A fresh interpreter, not multiprocessing's spawn: spawn re-runs the caller's __main__ module, which starts
# an engine again in a script without an `if __name__ == "__main__"` guard.
WORKER_MAIN = "import sys; from rollout_engine.parallel.worker import main; sys.exit(main(int(sys.argv[1])))"


def _flat_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).to(device)


class TPDriver:
    """Rank 0's side: starts the workers, sends them commands and each step's inputs, watches them."""

    def __init__(self, config):
        self.size, self.device = config.tensor_parallel_size, config.device
        self.dir = tempfile.mkdtemp(prefix="rollout-tp-")  # mode 0700: the rendezvous file is ours alone
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        self.dead: str | None = None  # why the group can no longer run
        self.group = None
        try:
            first = config.device.index or 0
            for rank in range(1, self.size):
                mine, theirs = socket.socketpair()
                self.procs.append(subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(theirs.fileno())],
                                                   pass_fds=(theirs.fileno(),)))
                theirs.close()
                self.conns.append(Connection(mine.detach()))
                device = f"cuda:{first + rank}" if config.device.type == "cuda" else "cpu"
                self._send_to(rank, _worker_spec(config, rank, device, os.path.join(self.dir, "rendezvous")))
            errors = self.replies()  # each worker has imported everything and is joining the group
            if errors:
                raise EngineError(_describe(errors, "start"))
            if config.device.type == "cuda":
                torch.cuda.set_device(config.device)
            self.group = TPGroup.join(os.path.join(self.dir, "rendezvous"), 0, self.size, config.device)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ messages

    def check(self) -> None:
        """Raise EngineDeadError if a worker has exited or a collective failed (then every later call does)."""
        if self.dead is None and self.group is not None and self.group.failed:
            self.dead = "a tensor-parallel collective failed"
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll() if self.dead is None else None
            if code is not None:
                self.dead = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                             + self._last_words(rank))
        if self.dead is not None:
            raise EngineDeadError(f"{self.dead}; this engine cannot run any more: shut it down and start a new one")

    def _last_words(self, rank: int) -> str:
        """The error an exited worker sent before it went, if any."""
        try:
            conn = self.conns[rank - 1]
            return f": {json.loads(conn.recv_bytes()).get('error')}" if conn.poll(0) else ""
        except (EOFError, OSError, ValueError):
            return ""

    def _send_to(self, rank: int, message) -> None:
        try:
            self.conns[rank - 1].send_bytes(json.dumps(message).encode())
        except OSError as err:
            self.dead = f"tensor-parallel worker rank {rank} is unreachable ({err})"
            self.check()

    def send(self, message) -> None:
        self.check()
        for rank in range(1, self.size):
            self._send_to(rank, message)

    def step(self, message: list, payload: torch.Tensor | None = None) -> None:
        """One step's message: the command, then its payload broadcast over the group."""
        self.send(message)
        if payload is not None:
            self.group.broadcast(payload)

    @contextlib.contextmanager
    def stepping(self):
        """The driver's part of a step the workers run alongside: stopped half way (an exception, Ctrl-C), it
        leaves the workers waiting in its collectives, so the group is dead at once rather than at the next
        collective's timeout."""
        try:
            yield
        except BaseException:
            self.dead = self.dead or "a step stopped half way on rank 0 (the workers wait in its collectives)"
            raise

    def replies(self) -> dict[int, str]:
        """Wait for one answer from each worker; returns {rank: error} for those that failed."""
        errors = {}
        for rank, conn in enumerate(self.conns, 1):
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while not conn.poll(0.1):
                if self.procs[rank - 1].poll() is not None or time.monotonic() > deadline:
                    self.dead = self.dead or f"tensor-parallel worker rank {rank} did not answer"
                    self.check()
            try:
                reply = json.loads(conn.recv_bytes())
            except (EOFError, OSError):
                self.procs[rank - 1].wait(EXIT_GRACE_S)
                self.check()
                raise
            if "error" in reply:
                errors[rank] = reply["error"]
        return errors

    def command(self, message: dict) -> None:
        """Send a command every worker answers; raise EngineError naming any worker's failure."""
        self.send(message)
        errors = self.replies()
        if errors:
            raise EngineError(_describe(errors, message["op"]))

    # ------------------------------------------------------------------ lifecycle

    def start(self, blocks: int, buffers) -> None:
        """Each worker carves its KV pool of `blocks` blocks and step buffers like the driver's."""
        self.command({"op": "start", "blocks": blocks, "max_tokens": buffers.max_tokens,
                      "max_rows": buffers.max_rows, "max_blocks": buffers.max_blocks})

    def update(self, store, run, version, model: str, message: dict, relayed: bool):
        """The driver's own update `run()`, mirrored on every worker: `relayed` (its groups pass through
        `relay`, which sends them as they are taken) ends the workers' stream with "end". Refusals come before
        any message. A worker that fails where the driver did not leaves the weights stale everywhere."""
        store._check_update(version, model)
        self.send(message | {"version": version, "model": model})
        try:
            result = run()
        except BaseException:
            if relayed:
                self.send({"op": "end", "abort": True})
            self.replies()  # the workers' outcome does not matter: the driver's error is raised
            raise
        if relayed:
            self.send({"op": "end", "abort": False})
        errors = self.replies()
        if errors:
            store.stale |= store.names([model])
            raise EngineError(_describe(errors, "update") + "; the weights are marked incomplete: send a "
                              "complete update")
        return result

    def relay(self, groups, table):
        """Pass `groups` of (name, tensor) through to the driver's store, sending each to the workers first
        (checked first, as the store checks it, so nothing malformed is sent)."""
        for group in groups:
            pairs = group.pairs if isinstance(group, ReusableGroup) else list(named_pairs(group))
            table.resolve(pairs)
            tensors = [(n, t) for n, t in pairs if isinstance(t, torch.Tensor)]
            self.send({"op": "group", "tensors": [[n, str(t.dtype), list(t.shape)] for n, t in tensors]})
            for _, t in tensors:
                self.group.broadcast(_flat_bytes(t, self.group.device))
            yield group if isinstance(group, ReusableGroup) else pairs

    def update_weights(self, store, named_tensors, version, model: str) -> int:
        """Engine.update_weights: the driver's groups (as WeightStore.update makes them) relayed as taken."""
        def run():
            groups = self.relay(buckets(named_pairs(named_tensors), GROUP_BYTES), store.tables[model])
            return store.update_groups(store.steady.groups(groups, model), version, model)

        return self.update(store, run, version, model, {"op": "update"}, relayed=True)

    def update_groups(self, store, groups, version, model: str) -> int:
        """Engine.update_weights_from_buckets: the transport's groups relayed as taken, boundaries kept."""
        def run():
            return store.update_groups(self.relay(groups, store.tables[model]), version, model)

        return self.update(store, run, version, model, {"op": "update"}, relayed=True)

    def update_from_disk(self, store, path, version, model: str) -> int:
        if not isinstance(path, (str, os.PathLike)):
            raise ValueError(f"path must be a checkpoint directory (str or os.PathLike), got {type(path).__name__}")
        return self.update(store, lambda: store.update_from_disk(path, version, model), version, model,
                           {"op": "update_disk", "path": os.path.abspath(path)}, relayed=False)  # the caller's cwd

    # ------------------------------------------------------------------ benchmark-only (decode_roofline.py)

    def fill_kv_random(self, kv) -> list[float]:
        """fill_kv_random on every rank's pool (the driver's is `kv`); each rank's mean square, in rank order."""
        self.send({"op": "fill_kv_random"})
        return self._together("fill_kv_random", lambda: fill_kv_random(kv))

    def time_collectives(self, rows: int, cfg, dtype: torch.dtype) -> float:
        """time_collectives on every rank for a decode step of `rows` sequences of `cfg`; rank 0's seconds."""
        args = {"rows": rows, "hidden": cfg.hidden_size, "layers": cfg.num_layers,
                "vocab_part": cfg.vocab_size // self.size, "dtype": str(dtype)}
        self.send({"op": "time_collectives"} | args)
        return self._together("time_collectives", lambda: time_collectives(self.group, **args))[0]

    def _together(self, op: str, run) -> list[float]:
        """The driver's `run()` and each worker's answer to the `op` just sent (each gathers its number), in rank
        order."""
        values = gather_number(self.group, run())
        errors = self.replies()
        if errors:
            raise EngineError(_describe(errors, op))
        return values

    def close(self) -> None:
        """Stop every worker (asked first, killed after EXIT_GRACE_S) and remove the private directory."""
        for rank in range(1, len(self.conns) + 1):
            try:
                self.conns[rank - 1].send_bytes(json.dumps({"op": "shutdown"}).encode())
            except OSError:
                pass
        for proc in self.procs:
            try:
                proc.wait(EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for conn in self.conns:
            conn.close()
        if self.group is not None:
            self.group.close()  # the workers are gone: its listener goes now
        self.conns, self.procs = [], []
        self.dead = self.dead or "the engine was shut down"
        shutil.rmtree(self.dir, ignore_errors=True)


def _describe(errors: dict[int, str], op: str) -> str:
    return "; ".join(f"tensor-parallel worker rank {rank} failed to {op}: {err}" for rank, err in errors.items())


def _worker_spec(config, rank: int, device: str, rendezvous: str) -> dict:
    return {"rank": rank, "size": config.tensor_parallel_size, "device": device, "rendezvous": rendezvous,
            "model_path": str(config.model_path), "dtype": str(config.dtype), "kv_dtype": str(config.kv_dtype),
            "max_positions": config.max_model_len, "block_size": config.block_size,
            "load_format": config.load_format, "seed": config.seed, "check_finite": config.check_finite,
            "use_graphs": config.use_graphs}


class AnnouncedModel:
    """The driver's model as its eager steps see it: each forward and each LM-head call is announced to the
    workers first, so they run the same collectives (the decode step announces itself: TPModelRunner.decode)."""

    def __init__(self, model, runner: "TPModelRunner"):
        self.model, self.runner = model, runner

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, input_ids, positions, meta):
        rows = meta.seq_lens.shape[0]
        self.runner.announce(["forward", rows, input_ids.shape[0], meta.max_query_len, meta.block_tables.shape[1]],
                             rows)
        with self.runner.driver.stepping():
            return self.model(input_ids, positions, meta)

    def logits(self, hidden):
        hidden = hidden.contiguous()
        self.runner.driver.step(["logits", hidden.shape[0]], hidden)
        with self.runner.driver.stepping():
            return self.model.logits(hidden)


class TPModelRunner(ModelRunner):
    """The driver's ModelRunner: the same steps, each announced to the workers with its inputs."""

    def __init__(self, model, ops, block_size: int, device: torch.device, buffers, use_graphs: bool,
                 driver: TPDriver):
        self.driver, self.copies, self.plain = driver, [], model
        super().__init__(AnnouncedModel(model, self), ops, block_size, device, buffers, use_graphs)

    def announce(self, message: list, rows: int) -> None:
        """Send a step: `message` plus the block copies the scheduler asked for before it, then the inputs."""
        copies, self.copies = self.copies, []
        self.driver.step(message + [copies], self.buffers.device_buf[: self.buffers.used_bytes(rows)])

    def _decode_and_sample(self, size: int) -> torch.Tensor:
        # the unannounced model: this also runs inside graph captures, which the workers make alongside
        input_ids, positions, meta = self.metadata(size, size, 1, self.buffers.max_blocks)
        return self.sample(self.plain.logits(self.plain(input_ids, positions, meta)), size)

    def decode(self, size: int) -> torch.Tensor:
        self.announce(["decode", size], size)
        with self.driver.stepping():
            return super().decode(size)

    def capture(self) -> None:
        if self.graphs is not None:
            self.driver.step(["capture"])
        super().capture()

    def step(self, batch, draft_follows: bool = False):
        self._copies_of(batch)
        return super().step(batch, draft_follows)

    def launch(self, batch, after=None):
        self._copies_of(batch)
        return super().launch(batch, after)

    def _copies_of(self, batch) -> None:
        if batch.block_copies:  # the loop copied these blocks of the driver's pool before this step
            self.copies = [list(pair) for pair in batch.block_copies]
