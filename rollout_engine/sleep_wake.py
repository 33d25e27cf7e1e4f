"""SleepWake: the work of Engine.sleep and Engine.wake across the engine's parts.

The memory tenants ("weights": the WeightStore, "kv_cache": the KVCache) each hold whether they are asleep;
SleepWake puts the named ones to sleep (aborting the sequences that hold KV, dropping the prefix cache with the
pool) and wakes them (resetting the block manager to the pool's block count, re-capturing the graphs when an
address moved), and tells the worker processes (parallel/modes.py) each step.
"""
from __future__ import annotations

import torch

from .memory import parse_tags


class SleepWake:
    def __init__(self, weight_store, kv, block_manager, scheduler, parallel, device: torch.device, capture_graphs):
        """`capture_graphs()`: the Engine's (re-)capture of its graphs, which hold the current addresses."""
        self.weight_store, self.kv, self.block_manager, self.scheduler = weight_store, kv, block_manager, scheduler
        self.parallel, self.device, self.capture_graphs = parallel, device, capture_graphs

    def asleep(self) -> set[str]:
        return {tag for tag, asleep in (("weights", self.weight_store.asleep), ("kv_cache", self.kv.asleep)) if asleep}

    def sleep(self, level, tags) -> None:
        if isinstance(level, bool) or level not in (1, 2):
            raise ValueError(f"level={level!r} is not allowed; 1 (offload weights to host) or 2 (discard them)")
        # A tenant already asleep sleeps again only where level 2 deepens a level-1 sleep of the weights: the
        # host copy goes and the weights then need a full update, as after sleep(2) from awake.
        tags = parse_tags(tags) - (self.asleep() - ({"weights"} if level == 2 else set()))
        self.parallel.command({"op": "sleep", "level": level, "tags": sorted(tags)})
        self.scheduler.abort_running()
        if "kv_cache" in tags:
            self.block_manager.flush()
            self.kv.sleep()
        if "weights" in tags:
            self.weight_store.sleep(level)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def wake(self, tags, allow_resize) -> set[str]:
        """Wakes the named tenants that are asleep; returns the tags it woke."""
        if not isinstance(allow_resize, bool):
            raise ValueError(f"allow_resize={allow_resize!r} is not allowed; a bool")
        tags = parse_tags(tags) & self.asleep()
        moved = False
        if "weights" in tags:
            moved |= self.weight_store.wake(self.device)
            self.parallel.command({"op": "wake", "tags": ["weights"]})
        if "kv_cache" in tags:
            # every rank's pool takes the same count, or none wakes
            blocks = self.parallel.wake_blocks(self.kv, self.block_manager.num_blocks, allow_resize)
            blocks, kv_moved = self.kv.wake(blocks, allow_resize)
            # fewer blocks in the same buffer (SPMD: another rank had less room) lay the pool out anew
            moved |= kv_moved or blocks != self.block_manager.num_blocks
            if blocks != self.block_manager.num_blocks:
                self.block_manager.reset(blocks)
            # the workers' pools take the driver's block count
            self.parallel.command({"op": "wake", "tags": ["kv_cache"], "blocks": blocks})
        moved = self.parallel.any("wake", moved)  # a capture runs the model's collectives: every rank or none
        if moved and not self.asleep():
            self.capture_graphs()  # the graphs hold the old addresses
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return tags
