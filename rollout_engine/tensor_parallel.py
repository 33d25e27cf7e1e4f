"""Tensor parallelism, two ways in.

(a) One process: `Engine(path, tensor_parallel_size=N)` drives N-1 worker processes (TPDriver, Worker).
(b) SPMD: every rank of the caller's torch.distributed job builds `Engine(path, process_group=pg)` and makes
the same calls (SPMD, at the end of this file).

Way (a):

The driver (rank 0, the caller's process) keeps the scheduler, the block manager, sampling and the outputs.
Each worker (rank r, a fresh interpreter running `main`, on `cuda:<first + r>` or the CPU) holds its
shard of the weights (model.py says which rows or columns) and a KV pool for its own KV heads, carved with
the driver's block count, so the driver's block ids index every rank's pool alike.

Two channels per worker. Commands: a socket pair made for it (no address anywhere), small JSON messages;
the worker waits on it while idle and exits when it closes (the driver's engine shut down, or its process
died). Tensors: the tensor-parallel group (gloo on the CPU, NCCL on CUDA, used directly: torch.distributed's
default group is neither needed nor touched), whose rendezvous is a file in a private directory; gloo binds
127.0.0.1 only. A step is ONE message: a command naming it (op, shapes, block copies), then the used prefix
of the step buffers broadcast over the group (after the upload and the on-device feed of the newest tokens,
so every rank reads the same inputs). Every rank then runs the same forward, whose all-reduces keep the
hidden states equal, and the same sampler with the same noise on the all-gathered logits; only the
driver's tokens are read.

A worker that dies makes the next call raise EngineDeadError (the driver checks each worker's exit status
before every message), and one that dies or stops answering inside a collective makes the collective raise
it (gloo: at once when the socket closes, else after COLLECTIVE_TIMEOUT_S). With NCCL a hang inside a
collective is the NCCL watchdog's, which ends the process after the same timeout.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from array import array
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from .errors import EngineDeadError, EngineError, NoRoomError, WeightUpdateAborted
from .kv_cache import available_bytes
from .model_runner import ModelRunner
from .weight_store import named_pairs
from .weights import GROUP_BYTES, ReusableGroup, buckets

COLLECTIVE_TIMEOUT_S = 60  # a collective waiting longer: a rank is gone or stuck
REPLY_TIMEOUT_S = 900      # a worker's answer to a command (its start loads a checkpoint shard)
EXIT_GRACE_S = 5           # after "shutdown", before a worker is killed
LOOPBACK = "127.0.0.1"
# A fresh interpreter, not multiprocessing's spawn: spawn re-runs the caller's __main__ module, which starts
# an engine again in a script without an `if __name__ == "__main__"` guard.
WORKER_MAIN = "import sys; from rollout_engine.tensor_parallel import main; sys.exit(main(int(sys.argv[1])))"


class TPGroup:
    """This rank's place in the tensor-parallel group and the model's collectives over it."""

    def __init__(self, backend, rank: int, size: int, device: torch.device):
        self.backend, self.rank, self.size, self.device = backend, rank, size, device
        self.failed = False

    @classmethod
    def of(cls, group, device: torch.device) -> "TPGroup":
        """The caller's process group (SPMD): its timeout is the one the caller gave it."""
        return cls(group, group.rank(), group.size(), device)

    @classmethod
    def join(cls, rendezvous: str, rank: int, size: int, device: torch.device) -> "TPGroup":
        """Every rank calls this; it returns once all have joined."""
        store = dist.FileStore(rendezvous, size)
        timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            return cls(dist.ProcessGroupNCCL(store, rank, size, options), rank, size, device)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
        return cls(dist.ProcessGroupGloo(store, rank, size, options), rank, size, device)

    def _wait(self, work) -> None:
        try:
            work.wait()
        except RuntimeError as err:
            self.failed = True
            raise EngineDeadError(f"a tensor-parallel collective failed (a rank exited or stopped answering "
                                  f"within {COLLECTIVE_TIMEOUT_S} s): {err}") from err

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


def _flat_bytes(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8).to(device)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


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
                           {"op": "update_disk", "path": os.fspath(path)}, relayed=False)

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
        return self.model(input_ids, positions, meta)

    def logits(self, hidden):
        hidden = hidden.contiguous()
        self.runner.driver.step(["logits", hidden.shape[0]], hidden)
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


# ---------------------------------------------------------------------- the worker process


class Worker:
    """Rank r: its shard of the model, its KV pool and step buffers; runs what the driver announces."""

    def __init__(self, spec: dict, conn: Connection):
        from kernels import get_ops

        from .config import ModelConfig
        from .kv_cache import KVCache
        from .memory import DeviceMemory, default_dtype
        from .model import CausalLM
        from .weight_store import WeightStore
        from .weights import iter_safetensors

        self.conn, self.spec = conn, spec
        self.device = torch.device(spec["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cfg = ModelConfig.from_dir(spec["model_path"], spec["load_format"] == "safetensors")
        self.reply({"ok": "joining"})
        self.group = TPGroup.join(spec["rendezvous"], spec["rank"], spec["size"], self.device)
        self.ops = get_ops(self.device)
        self.memory = DeviceMemory(self.device)
        with self.memory.region("weights"), default_dtype(_dtype(spec["dtype"])), torch.device(self.device):
            self.model = CausalLM(cfg, self.ops, spec["max_positions"], self.group)
        self.store = WeightStore({"target": self.model}, self.ops, self.memory, spec["check_finite"])
        self.store.load({"target": iter_safetensors(spec["model_path"]) if spec["load_format"] == "safetensors"
                         else self.store.random_weights("target", spec["seed"])})
        self.kv = KVCache({"target": self.model}, spec["block_size"], _dtype(spec["kv_dtype"]), self.device,
                          self.memory)
        self.runner = None
        self.reserved = False

    def reply(self, message: dict) -> None:
        self.conn.send_bytes(json.dumps(message).encode())

    def serve(self) -> None:
        """Run commands until "shutdown" or until the driver's end of the socket closes."""
        while True:
            try:
                message = json.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                return  # the driver is gone
            if isinstance(message, list):
                self.step(message)  # a failure here ends the process: the driver sees it exit
                continue
            if message["op"] == "shutdown":
                return
            try:
                getattr(self, "do_" + message["op"])(message)
            except Exception as err:  # reported to the driver, which raises it; the worker stays usable
                self.reply({"error": f"{type(err).__name__}: {err}"})
            else:
                self.reply({"ok": True})

    # ------------------------------------------------------------------ steps

    @torch.inference_mode()
    def step(self, message: list) -> None:
        op, *args = message
        if op == "capture":
            self.runner.capture()
            self._reserve_host_copy()
            return
        if op == "logits":
            hidden = torch.empty(args[0], self.model.cfg.hidden_size, dtype=self.store.tables["target"].dtype,
                                 device=self.device)
            self.group.broadcast(hidden)
            self.model.logits(hidden)
            return
        *shape, copies = args
        rows = shape[0]
        self.group.broadcast(self.runner.buffers.device_buf[: self.runner.buffers.used_bytes(rows)])
        if copies:
            src, dst = zip(*copies)
            self.kv.planner.copy_blocks(list(src), list(dst))
        if op == "decode":
            self.runner.decode(rows)
        else:  # "forward": rows, tokens, the longest query, block-table width
            self.model(*self.runner.metadata(*shape))

    # ------------------------------------------------------------------ commands

    def do_start(self, message: dict) -> None:
        from .step_buffers import StepBuffers

        self.kv.start(message["blocks"])
        buffers = StepBuffers(message["max_tokens"], message["max_rows"], message["max_blocks"], self.device)
        self.runner = ModelRunner(self.model, self.ops, self.spec["block_size"], self.device, buffers,
                                  self.spec["use_graphs"])
        if not self.spec["use_graphs"]:
            self._reserve_host_copy()

    def _reserve_host_copy(self) -> None:
        if not self.reserved:  # after the first capture: no allocation may overlap one
            self.store.reserve_host_copy()
            self.reserved = True

    def do_sleep(self, message: dict) -> None:
        if "kv_cache" in message["tags"]:
            self.kv.sleep()
        if "weights" in message["tags"]:
            self.store.sleep(message["level"])
        self._settle()

    def do_wake(self, message: dict) -> None:
        if "weights" in message["tags"]:
            self.store.wake(self.device)
        if "kv_cache" in message["tags"]:
            self.kv.wake(message["blocks"], allow_resize=False)
        self._settle()

    def _settle(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def do_update(self, message: dict) -> None:
        incoming = self.incoming()
        try:
            self.store.update_groups(incoming, message["version"], message["model"])
        finally:
            for _ in incoming:  # a failure before the driver's "end": take the rest of the stream
                pass

    def incoming(self):
        """The groups the driver relays, as lists of (name, tensor), until its "end"."""
        while True:
            message = json.loads(self.conn.recv_bytes())
            if message["op"] == "end":
                if message["abort"]:
                    raise WeightUpdateAborted("the driver ended the weight update early")
                return
            group = []
            for name, dtype, shape in message["tensors"]:
                dtype = _dtype(dtype)
                flat = torch.empty(dtype.itemsize * int(torch.Size(shape).numel()), dtype=torch.uint8,
                                   device=self.group.device)
                self.group.broadcast(flat)
                group.append((name, flat.view(dtype).view(shape)))
            yield group

    def do_update_disk(self, message: dict) -> None:
        self.store.update_from_disk(message["path"], message["version"], message["model"])

    def do_fill_kv_random(self, message: dict) -> None:
        gather_number(self.group, fill_kv_random(self.kv))

    def do_time_collectives(self, message: dict) -> None:
        args = {k: v for k, v in message.items() if k != "op"}
        gather_number(self.group, time_collectives(self.group, **args))


# ---------------------------------------------------------------------- benchmark-only ops, on every rank


def gather_number(group: TPGroup, value: float) -> list[float]:
    """Every rank's `value`, in rank order."""
    return group.gather(torch.tensor([value], dtype=torch.float64, device=group.device)).view(-1).tolist()


def fill_kv_random(kv) -> float:
    """Every value of `kv`'s pools to standard normal noise, so a benchmark's attention over contexts it never
    computed reads finite values; returns the mean square written (about 1)."""
    total, count = 0.0, 0
    for pool in kv.planner.pools.values():
        for row in range(pool.layers):
            for view in pool.kv_views(row):
                view.normal_()
                total += torch.linalg.vector_norm(view).item() ** 2
                count += view.numel()
    return total / count


def time_collectives(group: TPGroup, rows: int, hidden: int, layers: int, vocab_part: int, dtype: str,
                     reps: int = 20, inner: int = 5) -> float:
    """Median seconds of a decode step's collectives alone: 2 all-reduces of [rows, hidden] per layer (after
    o_proj and down_proj) and the all-gather of [rows, vocab_part] logits, in `dtype`; on CUDA replayed from a
    CUDA graph as the decode step runs them. Each timing covers `inner` steps after a barrier, so the ranks'
    start skew is a small part of it. Every rank calls it together."""
    zeros = dict(dtype=_dtype(dtype), device=group.device)  # zeros: the sums stay finite however often repeated
    hidden_states, logits = torch.zeros(rows, hidden, **zeros), torch.zeros(rows, vocab_part, **zeros)

    def step():
        for _ in range(2 * layers):
            group.all_reduce(hidden_states)
        group.gather(logits)

    def sync():
        if group.device.type == "cuda":
            torch.cuda.synchronize(group.device)

    step()  # warm-up, and on NCCL the communicator's start, outside any capture
    if group.device.type == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        step = graph.replay
    times, barrier = [], torch.zeros(1, **zeros)
    for _ in range(reps):
        group.all_reduce(barrier)
        sync()
        start = time.perf_counter()
        for _ in range(inner):
            step()
        sync()
        times.append((time.perf_counter() - start) / inner)
    return sorted(times)[reps // 2]


def main(fd: int) -> int:
    conn = Connection(fd)
    try:
        spec = json.loads(conn.recv_bytes())
        worker = Worker(spec, conn)
    except (EOFError, OSError):
        return 1
    except BaseException:
        try:
            conn.send_bytes(json.dumps({"error": traceback.format_exc(limit=-3)}).encode())
        except OSError:
            pass
        return 1
    worker.serve()
    return 0



# ---------------------------------------------------------------------- SPMD: every rank of the caller's job


def digest(*parts) -> int:
    """A signed 64-bit digest of `parts` (bytes as they are, anything else by its repr)."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(part if isinstance(part, bytes) else repr(part).encode())
    return int.from_bytes(h.digest(), "little", signed=True)


def ids_digest(sequences) -> int:
    """The digest of lists of token ids (as int64 bytes: a repr of every id costs more than the rest of a call)."""
    return digest(*(array("q", ids).tobytes() for ids in sequences))


class SPMD:
    """Way (b): every rank of the caller's process group runs an Engine of its own on the same calls.

    Each rank holds its shard and its KV pool, schedules the same requests over the same block count, and
    samples the same tokens from the same all-gathered logits with the same noise, so no step needs a message:
    the model's own collectives are the only traffic. What could differ between ranks is agreed: the block
    count (the least any rank has room for), the arguments of every call (a digest), each call's outcome
    (an error on any rank raises on every rank), a time budget's verdict (per step) and the tokens of every
    generate call (a digest at its end). Every agreement is one all-gather of [failed, value] per rank, and
    a rank that fails locally reports it at its next one, where every rank stops."""

    def __init__(self, group, device: torch.device):
        self.group = TPGroup.of(group, device)

    def check(self) -> None:
        if self.group.failed:
            raise EngineDeadError(f"a tensor-parallel collective failed on rank {self.group.rank}; this engine cannot "
                                  "run any more: shut it down and build a new one on every rank")

    def exchange(self, op: str, error: BaseException | None, value: int) -> list[int]:
        """Every rank's `value`, in rank order; raises on every rank if any rank passes an `error` (its own
        error on that rank, EngineError naming it elsewhere)."""
        rows = self.group.gather(torch.tensor([error is not None, value], dtype=torch.int64,
                                              device=self.group.device)).tolist()
        if error is not None:
            raise error
        failed = [rank for rank, (bad, _) in enumerate(rows) if bad]
        if failed:
            raise EngineError(f"{op} failed on tensor-parallel rank(s) {failed} (their error says why), so it "
                              f"ends on rank {self.group.rank} too")
        return [value for _, value in rows]

    def same(self, op: str, error: BaseException | None, value: int, what: str,
             advice: str = "every rank of the process_group must make the same call with the same arguments") -> None:
        """exchange, then EngineError on every rank unless every rank's `value` (a digest of `what`) is equal."""
        values = self.exchange(op, error, value)
        if len(set(values)) > 1:
            groups = {v: [r for r, w in enumerate(values) if w == v] for v in values}
            raise EngineError(f"{op}: the tensor-parallel ranks' {what} differ (ranks grouped by equal "
                              f"{what}: {sorted(groups.values())}); {advice}")

    def any(self, op: str, flag: bool) -> bool:
        return any(self.exchange(op, None, int(flag)))

    def together(self, op: str, args, run, undo=None):
        """`run()` on every rank, after checking that every rank passes the same `args`. Raises on every rank
        if it raises on any; then `undo(its result)` puts back what it changed where it succeeded."""
        self.check()
        self.same(op, None, digest(args), "arguments")
        try:
            result, error = run(), None
        except Exception as err:
            result, error = None, err
        try:
            self.exchange(op, error, 0)
        except EngineError:
            if error is None and undo is not None:
                undo(result)
            raise
        return result

    def wake_blocks(self, kv, blocks: int, allow_resize: bool) -> int:
        """The block count every rank's KV pool takes on wake: `blocks` where every rank has room for them,
        else with `allow_resize` the most every rank has room for. NoRoomError on every rank otherwise."""
        free = available_bytes(kv.device)
        fit = (blocks if kv.planner.total_bytes(blocks) <= free
               else kv.planner.blocks_for_budget(free) if free >= kv.planner.total_bytes(1) else 0)
        fits = self.exchange("wake", None, fit)
        agreed = min(min(fits), blocks)
        if agreed < 1 or (agreed < blocks and not allow_resize):
            short = {rank: f for rank, f in enumerate(fits) if f < blocks}
            raise NoRoomError(f"waking the KV pool needs {blocks} blocks on every tensor-parallel rank; ranks "
                              f"{sorted(short)} have room for {sorted(short.values())} (0: not one); free memory "
                              "there and wake again" + ("" if allow_resize else ", or wake(allow_resize=True)"))
        return agreed


class AgreedBudget:
    """A RolloutBudget with a time limit whose verdict every rank shares: each rank's clock is its own, so the
    ranks stop together at the first step after which any rank's budget is spent."""

    def __init__(self, budget, spmd: SPMD):
        self.budget, self.spmd = budget, spmd

    def start(self, seqs, num_samples: int) -> None:
        self.budget.start(seqs, num_samples)

    def spent(self, grown) -> bool:
        return self.spmd.any("generate", self.budget.spent(grown))
