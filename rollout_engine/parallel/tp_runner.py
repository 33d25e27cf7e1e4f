"""Rank 0's model runner under worker-process tensor parallelism: the same steps as ModelRunner's, each
announced to the workers (through the TPDriver) with its inputs, so every rank runs the same collectives."""
from __future__ import annotations

import torch

from ..model_runner import ModelRunner
from .driver import TPDriver


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

    def logits(self, hidden, rows=None):
        hidden = hidden.contiguous()
        self.runner.driver.step(["logits", hidden.shape[0]], hidden)
        with self.runner.driver.stepping():
            return self.model.logits(hidden, rows)


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

    def graph_step(self, size: int, shared: bool = False) -> torch.Tensor:
        # the unannounced model: this also runs inside graph captures, which the workers make alongside. No
        # shared prefixes (share_prefixes is off here): the workers would have to replay the same graphs.
        assert not shared
        input_ids, positions, meta = self.metadata(size, size, 1, self.buffers.max_blocks)
        return self.sample(self.plain.logits(self.plain(input_ids, positions, meta)), size)

    def decode(self, size: int, shared: bool = False) -> torch.Tensor:
        assert not shared
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
