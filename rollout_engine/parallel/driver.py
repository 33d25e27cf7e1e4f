"""Tensor parallelism over worker processes: `Engine(path, tensor_parallel_size=N)` is rank 0 (TPDriver here,
TPModelRunner in tp_runner.py) and drives N-1 worker processes (worker.py).

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
from ..weight_store import named_pairs
from ..weights import GROUP_BYTES, ReusableGroup, buckets
from .bench_ops import fill_kv_random, gather_number, gathered_value, time_collectives
from .group import TPGroup
from .worker import WORKER_MAIN, worker_spec

REPLY_TIMEOUT_S = 900      # a worker's answer to a command (its start loads a checkpoint shard)
EXIT_GRACE_S = 5           # after "shutdown", before a worker is killed


def _flat_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).to(device)


def _import_path() -> list[str]:
    """The driver's sys.path for its workers, as strings (an entry may be a pathlib.Path; one of another type is
    skipped, as the import system skips it)."""
    return [os.fspath(entry) for entry in sys.path if isinstance(entry, (str, os.PathLike))]


def _check_sendable(name: str, t: torch.Tensor) -> None:
    """Refuse a tensor whose bytes _flat_bytes cannot take (a sparse or other non-dense layout, a meta tensor),
    naming it, before any of its update's group is copied or sent."""
    if t.layout is not torch.strided or t.is_meta:
        what = f"a {t.layout} tensor" if t.layout is not torch.strided else "a meta tensor (it holds no values)"
        raise ValueError(f"weight {name!r} is {what}: tensor parallelism sends each weight's bytes to the other "
                         "ranks, so weights must be dense tensors with values (e.g. .to_dense()). Nothing of its "
                         "group was copied or sent")


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
                self.procs.append(subprocess.Popen([sys.executable, "-c", WORKER_MAIN, str(theirs.fileno()),
                                                    json.dumps(_import_path())], pass_fds=(theirs.fileno(),)))
                theirs.close()
                self.conns.append(Connection(mine.detach()))
                device = f"cuda:{first + rank}" if config.device.type == "cuda" else "cpu"
                self._send_to(rank, json.dumps(worker_spec(config, rank, device,
                                                           os.path.join(self.dir, "rendezvous"))).encode())
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
        """Raise EngineDeadError if a worker has exited or a collective failed (then every later call does). A
        worker's exit is named first: it is why a collective with it fails."""
        for rank, proc in enumerate(self.procs, 1):
            code = proc.poll() if self.dead is None else None
            if code is not None:
                self.dead = (f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}"
                             + self._last_words(rank))
        if self.dead is None and self.group is not None and self.group.failed:
            self.dead = "a tensor-parallel collective failed"
        if self.dead is not None:
            raise EngineDeadError(f"{self.dead}; this engine cannot run any more: shut it down and start a new one")

    def _last_words(self, rank: int) -> str:
        """The error an exited worker sent before it went, if any."""
        try:
            conn = self.conns[rank - 1]
            return f": {json.loads(conn.recv_bytes()).get('error')}" if conn.poll(0) else ""
        except (EOFError, OSError, ValueError):
            return ""

    def _send_to(self, rank: int, data: bytes) -> None:
        try:
            self.conns[rank - 1].send_bytes(data)
        except OSError as err:
            self.dead = f"tensor-parallel worker rank {rank} is unreachable ({err})"
            self.check()

    def send(self, message, ranks=None) -> None:
        """`message` to every worker (or to `ranks`). Stopped part way (Ctrl-C), some worker may hold it and
        another not, so their answers would be out of step with the commands: the engine is dead."""
        self.check()
        data = json.dumps(message).encode()
        with self.stepping("rank 0 stopped part way through sending the workers a message"):
            for rank in range(1, self.size) if ranks is None else ranks:
                self._send_to(rank, data)

    def step(self, message: list, payload: torch.Tensor | None = None) -> None:
        """One step's message: the command, then its payload broadcast over the group."""
        self.send(message)
        if payload is not None:
            with self.stepping():
                self.group.broadcast(payload)

    @contextlib.contextmanager
    def stepping(self, why: str = "a step stopped half way on rank 0 (the workers wait in its collectives)"):
        """The driver's part of a step (or of any message) the workers run alongside: stopped half way (an
        exception, Ctrl-C), it leaves the workers waiting in its collectives, so the group is dead at once
        rather than at the next collective's timeout."""
        try:
            yield
        except EngineDeadError:  # the group or a worker failed: check() names which, not the driver's part
            raise
        except BaseException:
            self.dead = self.dead or why
            raise

    def replies(self, ranks=None) -> dict[int, str]:
        """Wait for one answer from each worker (or each of `ranks`); returns {rank: error} for those that failed.
        Stopped before every answer came (Ctrl-C), an answer left unread would answer a later command: dead."""
        errors = {}
        with self.stepping("rank 0 stopped waiting for the workers' answers (they would answer later commands)"):
            for rank in range(1, self.size) if ranks is None else ranks:
                conn = self.conns[rank - 1]
                deadline = time.monotonic() + REPLY_TIMEOUT_S
                while not conn.poll(0.1):
                    if time.monotonic() > deadline:
                        self.dead = self.dead or f"tensor-parallel worker rank {rank} did not answer"
                    if self.procs[rank - 1].poll() is not None or self.dead is not None:
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

    def command(self, message: dict, undo: dict | None = None) -> None:
        """Send a command every worker answers; raise EngineError naming any worker's failure. `undo`: the
        command that puts back what `message` does, sent first to the workers that did it (restore), so that
        where any worker fails, none has done it."""
        self.send(message)
        errors = self.replies()
        if errors:
            if undo is not None:
                self.restore(undo, [rank for rank in range(1, self.size) if rank not in errors])
            raise EngineError(_describe(errors, message["op"]))

    def restore(self, message: dict, ranks=None) -> None:
        """Put back what a command did on the workers (or on `ranks`): `message`, which each must carry out. One
        that cannot leaves the ranks unlike each other, so the engine is dead (the next call raises
        EngineDeadError). Never raises: the caller raises the error that made it put things back."""
        ranks = list(range(1, self.size) if ranks is None else ranks)
        if not ranks or self.dead is not None:
            return
        try:
            self.send(message, ranks)
            errors = self.replies(ranks)
        except BaseException as err:
            errors = {0: f"{type(err).__name__}: {err}"}
        if errors:
            self.dead = self.dead or ("the ranks are no longer alike: putting back a failed call failed ("
                                      + _describe(errors, message["op"]) + ")")

    # ------------------------------------------------------------------ lifecycle

    def start(self, blocks: int, buffers) -> None:
        """Each worker carves its KV pool of `blocks` blocks and step buffers like the driver's."""
        self.command({"op": "start", "blocks": blocks, "max_tokens": buffers.max_tokens,
                      "max_rows": buffers.max_rows, "max_blocks": buffers.max_blocks})

    def counts(self, message: dict, here) -> list[int]:
        """Each rank's count for `message` (kv_room, kv_blocks; the driver's count is `here()`), in rank order."""
        self.send(message)
        return [int(n) for n in self._together(message["op"], here)]

    def _together(self, op: str, run) -> list[float]:
        """`run()` here and each worker's number for the `op` just sent, in rank order: every rank joins the gather
        whatever its part raised (Worker.gathered), then the first error is raised."""
        value, error = gathered_value(run)
        with self.stepping("rank 0 stopped in a gather the workers joined"):
            values = gather_number(self.group, value)
        errors = self.replies()
        if error is not None:
            raise error
        if errors:
            raise EngineError(_describe(errors, op))
        return values

    def update(self, store, run, version, model: str, message: dict, relayed: bool):
        """The driver's own update `run()`, mirrored on every worker: `relayed` (its groups pass through
        `relay`, which sends each once the driver has copied it) ends the workers' stream with "end". Refusals
        come before any message. The driver's version is the engine's: the workers' stores count their own
        (None), so one that finished an update the driver did not never refuses the next one's version.

        The ranks never serve different weights silently (WeightStore.stale, the one mark generate checks): a worker
        that fails where the driver did not leaves the weights stale, and the driver's version and history entry for it
        are taken back; where the driver fails, its store marks them stale if it copied anything, and so does a worker
        that finished the update anyway (from disk, each rank reads the checkpoint itself). A relayed worker holds only
        groups the driver copied."""
        store.check_update(version, model)
        mark = store.mark()
        self.send(message | {"version": None, "model": model})
        try:
            result = run()
        except BaseException:
            if self.dead is None:  # else the workers are gone or out of step: every later call says so
                if relayed:
                    self.send({"op": "end", "abort": True})
                if len(self.replies()) < self.size - 1:  # a worker has the new weights, the driver has not
                    store.stale |= store.names([model])
            raise
        if relayed:
            self.send({"op": "end", "abort": False})
        errors = self.replies()
        if errors:  # the driver's copy is whole, its version never served: taken back, as an SPMD rank's
            store.roll_back(mark, model)
            raise EngineError(_describe(errors, "update") + "; the weights are marked incomplete: send a "
                              "complete update")
        return result

    def relay(self, groups, table):
        """Pass `groups` of (name, tensor) through to the driver's store, sending each to the workers once the
        store has taken it whole (checked and copied: it asks for the next group then, before the source is asked
        for it, so a transport's buffer still holds it). A worker never holds a group the driver refused or did
        not reach. Each group is checked first as the store checks it (names, shapes) and as sendable (dense), so
        a tensor the driver could not send is refused before anything of its group is copied or sent."""
        for group in groups:
            pairs = group.pairs if isinstance(group, ReusableGroup) else list(named_pairs(group))
            table.resolve(pairs)
            tensors = [(n, t) for n, t in pairs if isinstance(t, torch.Tensor)]
            for name, t in tensors:
                _check_sendable(name, t)
            yield group if isinstance(group, ReusableGroup) else pairs
            self._send_group(tensors)

    def _send_group(self, tensors) -> None:
        """One group to the workers: the list of its tensors, then each one's bytes over the group. Stopped part
        way (an exception, Ctrl-C), the workers wait for bytes that never come: the engine is dead at once, not
        after the collective's timeout."""
        self.send({"op": "group", "tensors": [[n, str(t.dtype), list(t.shape)] for n, t in tensors]})
        with self.stepping("a weight update stopped half way through a group on rank 0 (the workers wait for "
                           "its tensors)"):
            for _, t in tensors:
                self.group.broadcast(_flat_bytes(t, self.group.device))

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

    def close(self) -> None:
        """Stop every worker (asked first, killed after EXIT_GRACE_S; at once when the group is dead: a worker
        waiting in a broken step's collective reads no "shutdown") and remove the private directory."""
        for rank in range(1, len(self.conns) + 1):
            with contextlib.suppress(OSError):
                self.conns[rank - 1].send_bytes(json.dumps({"op": "shutdown"}).encode())
        for proc in self.procs:
            try:
                proc.wait(0 if self.dead is not None else EXIT_GRACE_S)
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
