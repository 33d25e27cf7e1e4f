"""A tensor-parallel worker process (rank r of `Engine(path, tensor_parallel_size=N)`): a fresh interpreter
running `main`, holding its shard of the weights, its KV pool and step buffers, and running what the driver
(driver.py, which describes the two channels and the step message) announces."""
from __future__ import annotations

import json
import os
import shutil
import traceback
from multiprocessing.connection import Connection

import torch

from rollout_kernels import get_ops

from ..config import ModelConfig
from ..errors import WeightUpdateAborted
from ..kv_cache import KVCache, kv_budget
from ..capture_fence import CAPTURES
from ..memory import DeviceMemory, default_dtype
from ..model import CausalLM
from ..model_runner import ModelRunner
from ..step_buffers import StepBuffers
from ..weight_store import WeightStore
from ..checkpoint_files import iter_safetensors
from .bench_ops import fill_kv_random, gather_number, gathered_value, time_collectives
from .group import TPGroup, dtype_named


class Worker:
    """Rank r: its shard of the model, its KV pool and step buffers; runs what the driver announces."""

    def __init__(self, spec: dict, conn: Connection):
        self.conn, self.spec = conn, spec
        self.device = torch.device(spec["device"])
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        cfg = ModelConfig.from_dir(spec["model_path"], spec["load_format"] == "safetensors")
        self.reply({"ok": "joining"})
        self.group = TPGroup.join(spec["rendezvous"], spec["rank"], spec["size"], self.device)
        self.ops = get_ops(self.device)
        self.memory = DeviceMemory(self.device)
        with self.memory.region("weights"), default_dtype(dtype_named(spec["dtype"])), torch.device(self.device):
            self.model = CausalLM(cfg, self.ops, spec["max_positions"], self.group)
        self.store = WeightStore({"target": self.model}, self.ops, self.memory, spec["check_finite"])
        self.store.load({"target": iter_safetensors(spec["model_path"]) if spec["load_format"] == "safetensors"
                         else self.store.random_weights("target", spec["seed"])})
        self.kv = KVCache({"target": self.model}, spec["block_size"], dtype_named(spec["kv_dtype"]), self.device,
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
            except (EOFError, OSError):  # the driver is gone (killed: it removed nothing), and so is the group
                shutil.rmtree(os.path.dirname(self.spec["rendezvous"]), ignore_errors=True)
                return
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
            CAPTURES.empty_cache()

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
                dtype = dtype_named(dtype)
                flat = torch.empty(dtype.itemsize * int(torch.Size(shape).numel()), dtype=torch.uint8,
                                   device=self.group.device)
                self.group.broadcast(flat)
                group.append((name, flat.view(dtype).view(shape)))
            yield group

    def do_update_disk(self, message: dict) -> None:
        self.store.update_from_disk(message["path"], message["version"], message["model"])

    def do_kv_room(self, message: dict) -> None:
        self.gathered(lambda: self.kv.blocks_fitting(message["blocks"]))

    def do_kv_blocks(self, message: dict) -> None:
        spec = self.spec
        self.gathered(lambda: self.kv.blocks_for(kv_budget(spec["kv_cache_memory"], self.device),
                                                 spec["max_num_seqs"], spec["max_positions"]))

    def do_fill_kv_random(self, message: dict) -> None:
        self.gathered(lambda: fill_kv_random(self.kv))

    def do_time_collectives(self, message: dict) -> None:
        args = {k: v for k, v in message.items() if k != "op"}
        self.gathered(lambda: time_collectives(self.group, **args))

    def gathered(self, run) -> None:
        """run()'s number to the driver's gather, which it joins whatever run() raised; then the error, if any."""
        value, error = gathered_value(run)
        gather_number(self.group, value)
        if error is not None:
            raise error


def worker_spec(config, rank: int, device: str, rendezvous: str) -> dict:
    """What a worker builds its rank from (the first message the driver sends it), out of the driver's config."""
    return {"rank": rank, "size": config.tensor_parallel_size, "device": device, "rendezvous": rendezvous,
            "model_path": str(config.model_path), "dtype": str(config.dtype), "kv_dtype": str(config.kv_dtype),
            "max_positions": config.max_model_len, "block_size": config.block_size,
            "kv_cache_memory": config.kv_cache_memory, "max_num_seqs": config.max_num_seqs,
            "load_format": config.load_format, "seed": config.seed, "check_finite": config.check_finite,
            "use_graphs": config.use_graphs}


# The command line a worker runs: a fresh interpreter, not multiprocessing's spawn, which re-runs the caller's
# __main__ module (an engine started again by a script without an `if __name__ == "__main__"` guard). Like spawn
# it takes the driver's sys.path (argv[2]), so every rank imports the same rollout_engine; it ignores Ctrl-C,
# which a terminal sends to its whole process group (the driver decides what an interrupt ends); and an import
# that fails is told to the driver, which raises it.
WORKER_MAIN = """
import json, signal, sys, traceback
from multiprocessing.connection import Connection
signal.signal(signal.SIGINT, signal.SIG_IGN)
sys.path[:] = json.loads(sys.argv[2])
try:
    from rollout_engine.parallel.worker import main
except BaseException:
    error = "importing rollout_engine failed: " + traceback.format_exc(limit=-2)
    Connection(int(sys.argv[1])).send_bytes(json.dumps({"error": error}).encode())
    sys.exit(1)
sys.exit(main(int(sys.argv[1])))
"""


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
