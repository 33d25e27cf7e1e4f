"""The engine's parallel mode, chosen once at construction: what each Engine call does on the other ranks.

OneDevice: no other rank. WorkerProcesses: rank 0 of `tensor_parallel_size=N`, which tells its worker
processes (driver.py). SPMDRanks: one rank of the caller's process group, which agrees with the others
(spmd.py). The facade calls the same seams in every mode; each mode does nothing where it has nothing to do.
"""
from __future__ import annotations

import functools

from ..errors import EngineDeadError, EngineError
from ..model_runner import ModelRunner
from .driver import TPDriver
from .spmd import SPMD, AgreedBudget, agreed_blocks
from .tp_runner import TPModelRunner


def parallel_mode(config) -> "OneDevice":
    if config.process_group is not None:  # every rank of the caller's group is in here
        return SPMDRanks(SPMD(config.process_group, config.device))
    if config.tensor_parallel_size > 1:  # this process is rank 0 and drives one worker process per other rank
        return WorkerProcesses(TPDriver(config))
    return OneDevice()


class OneDevice:
    """No tensor parallelism: every call runs here alone."""

    group = None   # the model's TPGroup
    driver = None  # the TPDriver of worker processes
    flush_every_update = False  # SPMD: every rank flushes its prefix cache at every update (inside its agreement),
    # so they schedule alike
    shut = False  # Engine.shutdown() ran (close): generate refuses from then on

    def agree_blocks(self, count) -> int:
        """The KV pool's block count: `count()` here (tensor parallel: the least any rank's buys)."""
        return count()

    def runner(self, model, ops, block_size, device, buffers, use_graphs: bool, draft,
               share_prefixes: bool = False) -> ModelRunner:
        return ModelRunner(model, ops, block_size, device, buffers, use_graphs, draft, share_prefixes)

    def start(self, blocks: int, buffers) -> None:
        """The other ranks carve their KV pools and step buffers like this rank's."""

    def weight_update(self, kind: str, store, **sharded):
        """The update `store.<kind>` names, run on every rank (`sharded`: the call's flag, absent for a
        checkpoint directory)."""
        return functools.partial(getattr(store, kind), **sharded)

    def together(self, op: str, args, run, undo=None, outcome=None):
        """`run()` on every rank (SPMD: `args` checked equal first, `outcome` compared after; `undo` where another
        rank failed or the outcomes differ). A dead engine refuses first: an update or a sleep it took would
        report success for an engine that cannot run."""
        self.check_alive()
        return run()

    def agree(self, op: str, checked, digest_of, what: str):
        """`checked()`, raising on every rank if it raises on any (SPMD: `digest_of` its result, equal on every
        rank, names `what`)."""
        return checked()

    def same(self, op: str, digest, what: str, advice: str) -> None:
        """EngineError on every rank unless every rank's `digest()` is equal (SPMD)."""

    def any(self, op: str, flag: bool, what: str) -> bool:
        """Whether `flag` holds on any rank (SPMD: `what` names the agreement)."""
        return flag

    def check_alive(self) -> None:
        """EngineDeadError if the engine was shut down, or the other ranks can no longer follow this one (then
        every later call raises it)."""
        if self.shut:
            raise EngineDeadError("Engine.shutdown() was called; this engine cannot run any more: build a new one")

    def agreed_budget(self, budget):
        """A time budget whose verdict every rank shares."""
        return budget

    blocks_agreed = False  # whether wake_blocks' count is the ranks' agreement, which a rank may not shrink alone

    def wake_blocks(self, kv, blocks: int, allow_resize: bool) -> int:
        """The block count every rank's KV pool takes on wake."""
        return blocks

    def tenant_done(self, op: str, tag: str, error: BaseException | None) -> None:
        """How putting `tag` to sleep or waking it (`op`) went on this rank (`error`: it failed), before the ranks go
        on: raises `error` (SPMD: also EngineError on every other rank, at the same collective, whatever its own
        outcome)."""
        if error is not None:
            raise error

    def command(self, message: dict, undo: dict | None = None) -> None:
        """A lifecycle command every worker process runs too; where any fails (EngineError), `undo` first puts
        back what it did on the others."""

    def restore(self, message: dict) -> None:
        """A lifecycle command that puts back on every worker process what an earlier one did, after this rank
        failed to follow it; where a worker cannot, the engine is dead (never raises)."""

    def out_of_step(self, why: str) -> None:
        """This rank could not put back its part of a call the others did not make: every later call raises
        EngineDeadError (nothing to do without worker processes)."""

    def generate_failed(self, error: BaseException) -> None:
        """generate raised `error` part-way through its steps (SPMD: the other ranks may wait in a collective of a
        step this rank left; worker processes: TPDriver.stepping sees to it)."""

    def close(self) -> None:
        """Stop what this mode started (nothing but worker processes)."""
        self.shut = True


class WorkerProcesses(OneDevice):
    """Rank 0 of worker-process tensor parallelism: every call that changes a rank's state is told to each worker.

    The workers' part of a call runs inside its `run()` (TPDriver's updates, SleepWake's commands), which puts
    back what it must where a worker fails, so `together`'s `undo` (for a rank that succeeded where another
    failed after it) has nothing left to do here."""

    UPDATES = {"update": "update_weights", "update_groups": "update_groups", "update_from_disk": "update_from_disk"}

    def __init__(self, driver: TPDriver):
        self.driver, self.group = driver, driver.group

    def runner(self, model, ops, block_size, device, buffers, use_graphs: bool, draft,
               share_prefixes: bool = False) -> ModelRunner:
        return TPModelRunner(model, ops, block_size, device, buffers, use_graphs, self.driver)

    def agree_blocks(self, count) -> int:
        # each rank's budget is a share of its own device's free memory: the pool is the least any rank's buys
        return min(self.driver.counts({"op": "kv_blocks"}, count))

    def start(self, blocks: int, buffers) -> None:
        self.driver.start(blocks, buffers)

    def weight_update(self, kind: str, store, **sharded):
        # the driver cannot hold the other ranks' slices; every other refusal of `sharded` is the store's
        if sharded.get("sharded", False) is not False:
            raise ValueError(f"sharded={sharded['sharded']!r} is not allowed with tensor_parallel_size and no "
                             "process_group: this process drives the other ranks and cannot hold their slices; pass "
                             "the full tensors (sharded=False), or run SPMD with a process_group to pass each "
                             "rank's own")
        return functools.partial(getattr(self.driver, self.UPDATES[kind]), store)

    blocks_agreed = True

    def wake_blocks(self, kv, blocks: int, allow_resize: bool) -> int:
        # every rank's room, not the driver's alone: a trainer may hold memory on one rank's device
        room = self.driver.counts({"op": "kv_room", "blocks": blocks}, lambda: kv.blocks_fitting(blocks))
        return agreed_blocks(room, blocks, allow_resize)

    def command(self, message: dict, undo: dict | None = None) -> None:
        self.driver.command(message, undo)

    def restore(self, message: dict) -> None:
        self.driver.restore(message)

    def out_of_step(self, why: str) -> None:
        self.driver.dead = self.driver.dead or why

    def check_alive(self) -> None:
        super().check_alive()
        self.driver.check()

    def close(self) -> None:
        self.driver.close()
        super().close()


class SPMDRanks(OneDevice):
    """One rank of the caller's process group: every call agrees with the other ranks' (SPMD)."""

    flush_every_update = True

    def __init__(self, spmd: SPMD):
        self.spmd, self.group = spmd, spmd.group

    def check_alive(self) -> None:
        super().check_alive()
        self.spmd.check()

    def agree_blocks(self, count) -> int:
        error, blocks = None, 0
        try:
            blocks = count()
        except ValueError as err:
            error = err
        return min(self.spmd.exchange("Engine()", error, blocks, "Engine(): the pool's block count"))

    def together(self, op: str, args, run, undo=None, outcome=None):
        self.check_alive()
        return self.spmd.together(op, args, run, undo, outcome)

    def agree(self, op: str, checked, digest_of, what: str):
        try:
            result = checked()
        except Exception as err:
            self.spmd.exchange(op, err, 0, f"{op}: {what}")  # raises err here, EngineError on the other ranks
        self.spmd.same(op, None, digest_of(result), what)
        return result

    def same(self, op: str, digest, what: str, advice: str) -> None:
        self.spmd.same(op, None, digest(), what, advice)

    def any(self, op: str, flag: bool, what: str) -> bool:
        return self.spmd.any(op, flag, what)

    def agreed_budget(self, budget):
        return AgreedBudget(budget, self.spmd)

    blocks_agreed = True

    def wake_blocks(self, kv, blocks: int, allow_resize: bool) -> int:
        return self.spmd.wake_blocks(kv, blocks, allow_resize)

    def tenant_done(self, op: str, tag: str, error: BaseException | None) -> None:
        self.spmd.exchange(f"{op}({tag!r})", error, 0)

    def out_of_step(self, why: str) -> None:
        self.spmd.out_of_step(why)

    def generate_failed(self, error: BaseException) -> None:
        # The engine's own refusals (non-finite logits) come on every rank at the same step, from the same logits;
        # anything else (a device error, Ctrl-C) may be this rank's alone, and its next collective would pair with
        # one the others' step left waiting: dead at once here, rather than at the group's timeout. An error every
        # rank meets at once (out of memory on every device) ends the engine too: a rank cannot tell the two apart.
        if not isinstance(error, EngineError):
            self.out_of_step(f"generate stopped part-way on this rank ({type(error).__name__}: {error}), while the "
                             "other ranks may wait in its step's collectives")
