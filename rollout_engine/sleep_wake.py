"""SleepWake: the work of Engine.sleep and Engine.wake across the engine's parts.

The memory tenants ("weights": the WeightStore, "kv_cache": the KVCache) each hold whether they are asleep;
SleepWake puts the named ones to sleep (aborting the sequences that hold KV, dropping the prefix cache with the
pool) and wakes them (resetting the block manager to the pool's block count, re-capturing the graphs when an
address moved), and tells the worker processes (parallel/modes.py) each step, one tenant at a time: a tenant
sleeps (or wakes) on every rank or on none. Where the worker processes fail a tenant's step, or this rank fails
its own part after they did theirs, the ranks that did it put it back (a wake that fails leaves the tenant
asleep everywhere, as on one device), and where that cannot be done the engine is dead.
"""
from __future__ import annotations

import torch

from .capture_fence import CAPTURES
from .memory import parse_tags
from .sampling_params import is_int


class SleepWake:
    def __init__(self, weight_store, kv, block_manager, scheduler, parallel, device: torch.device, capture_graphs):
        """`capture_graphs()`: the Engine's (re-)capture of its graphs, which hold the current addresses."""
        self.weight_store, self.kv, self.block_manager, self.scheduler = weight_store, kv, block_manager, scheduler
        self.parallel, self.device, self.capture_graphs = parallel, device, capture_graphs
        # An address moved while another tenant still sleeps: the capture waits for the wake that ends the sleep
        # (which may move nothing itself: torch_memory_saver gives the weights their old addresses back).
        self.graphs_stale = False

    def asleep(self) -> set[str]:
        return {tag for tag, asleep in (("weights", self.weight_store.asleep), ("kv_cache", self.kv.asleep)) if asleep}

    def sleep(self, level, tags) -> None:
        if not is_int(level) or level not in (1, 2):
            raise ValueError(f"level={level!r} is not allowed; 1 (offload weights to host) or 2 (discard them)")
        # A tenant already asleep sleeps again only where level 2 deepens a level-1 sleep of the weights: the
        # host copy goes and the weights then need a full update, as after sleep(2) from awake.
        tags = parse_tags(tags) - (self.asleep() - ({"weights"} if level == 2 else set()))
        self.scheduler.abort_running()
        if "kv_cache" in tags:
            def kv_sleep():
                self.block_manager.flush()
                self.kv.sleep()

            self._sleep_tag("kv_cache", level, kv_sleep,
                            {"op": "wake", "tags": ["kv_cache"], "blocks": self.block_manager.num_blocks},
                            lambda: self.kv.wake(self.block_manager.num_blocks, False)[1])
        if "weights" in tags:
            store = self.weight_store
            try:  # weights asleep already (level 2 deepens a level-1 sleep) cannot be woken back
                self._sleep_tag("weights", level, lambda: store.sleep(level),
                                None if store.asleep else {"op": "wake", "tags": ["weights"]},
                                None if store.asleep else lambda: store.wake(self.device))
            except BaseException:
                if level == 2:  # some rank may have discarded its weights part way: they need a full update
                    store.stale = store.names()
                raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            CAPTURES.empty_cache()

    def wake(self, tags, allow_resize) -> set[str]:
        """Wakes the named tenants that are asleep; returns the tags it woke."""
        if not isinstance(allow_resize, bool):
            raise ValueError(f"allow_resize={allow_resize!r} is not allowed; a bool")
        tags = parse_tags(tags) & self.asleep()
        moved = False
        if "weights" in tags:
            moved |= self._wake_tag("weights", lambda: self.weight_store.wake(self.device),
                                    lambda: self.weight_store.sleep(1))
        if "kv_cache" in tags:
            def kv_wake():
                # every rank's pool takes the same count, or none wakes; a resizing wake asks for the configured
                # count, so a pool an earlier one shrank grows back where there is room
                asked = self.kv.configured_blocks if allow_resize else self.block_manager.num_blocks
                blocks = self.parallel.wake_blocks(self.kv, asked, allow_resize)
                # SPMD's count is agreed: binding here, or this rank's pool would differ from the others'
                return self.kv.wake(blocks, allow_resize and not self.parallel.blocks_agreed)

            # the workers' pools take the driver's block count
            blocks, kv_moved = self._wake_tag("kv_cache", kv_wake, self.kv.sleep, lambda woken: {"blocks": woken[0]})
            # fewer blocks in the same buffer (SPMD: another rank had less room) lay the pool out anew
            moved |= kv_moved or blocks != self.block_manager.num_blocks
            if blocks != self.block_manager.num_blocks:
                self.block_manager.reset(blocks)
        # a capture runs the model's collectives: every rank or none
        self.graphs_stale |= self.parallel.any("wake", moved, "an address moved")
        self._recapture()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return tags

    def _sleep_tag(self, tag: str, level: int, here, back, wake_back) -> None:
        """`tag` to sleep on the worker processes, then here (`here()`). `back`: the command that wakes a worker's
        `tag` again (None where it was asleep already), sent to those that slept where another fails, and to every
        worker where `here()` fails. SPMD ranks then learn how each fared; where any failed, those that slept wake
        `tag` again (`wake_back()`: whether an address moved; None where it was asleep before), so that `tag` sleeps
        on every rank or on none (a later wake pairs its collectives by the tags asleep), or, where a rank cannot
        wake it back, the engine is dead on every rank."""
        self.parallel.command({"op": "sleep", "level": level, "tags": [tag]}, undo=back)
        error = None
        try:
            here()
        except BaseException as err:
            if back is not None:
                self.parallel.restore(back)
            if not isinstance(err, Exception):
                raise
            error = err
        try:
            self.parallel.tenant_done("sleep", tag, error)  # raises where any rank failed
        except Exception:
            if self._put_back("sleep", tag, wake_back if error is None else None):
                self._recapture()
            raise

    def _wake_tag(self, tag: str, here, back, fields=lambda woken: {}):
        """`here()` wakes `tag` on this rank; then the worker processes wake it (their command's further
        `fields(what here() returned)`), or the SPMD ranks learn how each fared. Where any rank fails, the others
        put it back to sleep and so does this rank (`back()`), so `tag` stays asleep on every rank; returns what
        `here()` returned."""
        error = woken = None
        try:
            woken = here()
        except Exception as err:
            error = err
        try:
            self.parallel.tenant_done("wake", tag, error)  # raises where any rank failed
            self.parallel.command({"op": "wake", "tags": [tag]} | fields(woken),
                                  undo={"op": "sleep", "level": 1, "tags": [tag]})
        except Exception:
            self._put_back("wake", tag, None if error is not None else back)  # a sleep: None, nothing moved
            raise
        except BaseException:  # Ctrl-C: no agreement to take part in; put this rank's part back
            if error is None:
                back()
            raise
        return woken

    def _put_back(self, op: str, tag: str, undo) -> bool:
        """After `tag`'s `op` failed on some rank; every rank calls it, whatever its own outcome, so that the ranks'
        collectives pair. `undo()` puts back this rank's part (None: nothing to undo here; it returns whether an
        address moved). Then every rank learns whether any could not, and the engine is then dead on every rank;
        else returns whether an address moved on any rank (the graphs are stale)."""
        stuck = None
        try:
            moved = bool(undo()) if undo is not None else False
        except Exception as err:
            moved, stuck = False, f"{tag} could not be put back after a failed {op} ({type(err).__name__}: {err})"
        if self.parallel.any(op, stuck is not None, f"{tag} could not be put back"):
            self.parallel.out_of_step(stuck or f"{tag} could not be put back on another rank after a failed {op}")
            return False
        self.graphs_stale = self.parallel.any(op, moved, f"{tag} put back, an address moved") or self.graphs_stale
        return self.graphs_stale

    def _recapture(self) -> None:
        """Re-capture stale graphs once nothing sleeps (they hold old addresses), on every rank or none: where a
        rank's capture fails (a CUDA OOM on one GPU), every rank puts every tenant back to sleep (level 1), so no
        stale graph runs and the next wake captures again."""
        if not self.graphs_stale or self.asleep():
            return
        error = None
        try:
            self.capture_graphs()
        except Exception as err:
            error = err
        try:
            self.parallel.tenant_done("capture", "graphs", error)
        except Exception:
            self._put_back("capture", "graphs", lambda: self.sleep(1, None))
            raise
        self.graphs_stale = False
