"""SPMD tensor parallelism: every rank of the caller's torch.distributed job builds
`Engine(path, process_group=pg)` and makes the same calls; what could differ between the ranks is agreed here."""
from __future__ import annotations

import hashlib
from array import array

import torch

from ..errors import EngineDeadError, EngineError, NoRoomError
from .group import TPGroup


def digest(*parts) -> int:
    """A signed 64-bit digest of `parts` (bytes as they are, anything else by its repr), each after its length,
    so parts that concatenate to the same bytes ([1, 2], [3] and [1], [2, 3]) differ."""
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return int.from_bytes(h.digest(), "little", signed=True)


def ids_digest(sequences) -> int:
    """The digest of lists of token ids (as int64 bytes: a repr of every id costs more than the rest of a call)."""
    return digest(*(array("q", ids).tobytes() for ids in sequences))


def call_digest(prompts, params, resumed, budgets) -> int:
    """What a generate call's steps depend on (equal on every rank, or the ranks' steps differ): prompts as
    (text, ids) pairs, their params, the resumed outputs by index, the budget arguments."""
    return digest(ids_digest(ids for _, ids in prompts), params, sorted((i, repr(o)) for i, o in resumed.items()),
                  budgets)


def outputs_digest(outs) -> int:
    """Every sample's tokens and finish reason of a generate call's RequestOutputs."""
    samples = [c for out in outs for c in out.outputs]
    return digest(ids_digest(c.token_ids for c in samples), [c.finish_reason for c in samples])


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
        self.diverged: str | None = None  # why the ranks' states differ, where a call could not put one back
        self.failed: list[int] = []  # the ranks that reported a failure at the latest agreement
        self.failure_seen = False  # whether an agreement inside the current `together` call reported one

    def check(self) -> None:
        if self.diverged is not None:
            raise EngineDeadError(f"the tensor-parallel ranks are out of step ({self.diverged}); this engine "
                                  "cannot run any more: shut it down and build a new one on every rank")
        if self.group.failed:
            raise EngineDeadError(f"a tensor-parallel collective failed on rank {self.group.rank}; this engine cannot "
                                  "run any more: shut it down and build a new one on every rank")

    def exchange(self, op: str, error: BaseException | None, value: int, site: str | None = None) -> list[int]:
        """Every rank's `value`, in rank order; raises on every rank if any rank passes an `error` (its own
        error on that rank, EngineError naming it elsewhere). `site` names this agreement (default: `op`),
        distinct from every other a call may make: a rank that fails on its own skips its call's next agreements
        and meets the others at a later one, so the ranks learn there that their states differ (EngineDeadError
        from then on, at once: a dead engine runs no collective, which would pair with another call's)."""
        self.check()
        rows = self.group.gather(torch.tensor([error is not None, value, digest(site or op)], dtype=torch.int64,
                                              device=self.group.device)).tolist()
        self.failed = [rank for rank, (bad, _, _) in enumerate(rows) if bad]
        if len({at for _, _, at in rows}) > 1:
            self.out_of_step(f"{op}: the ranks met at different agreements, rank(s) {self.failed} having failed")
        self.failure_seen |= bool(self.failed)
        if error is not None:
            raise error
        if self.failed:
            raise EngineError(f"{op} failed on tensor-parallel rank(s) {self.failed} (their error says why), so "
                              f"it ends on rank {self.group.rank} too")
        return [value for _, value, _ in rows]

    def out_of_step(self, why: str) -> None:
        self.diverged = self.diverged or why

    def same(self, op: str, error: BaseException | None, value: int, what: str,
             advice: str = "every rank of the process_group must make the same call with the same arguments") -> None:
        """exchange, then EngineError on every rank unless every rank's `value` (a digest of `what`) is equal."""
        values = self.exchange(op, error, value, f"{op}: {what}")
        if len(set(values)) > 1:
            groups = {v: [r for r, w in enumerate(values) if w == v] for v in values}
            raise EngineError(f"{op}: the tensor-parallel ranks' {what} differ (ranks grouped by equal "
                              f"{what}: {sorted(groups.values())}); {advice}")

    def any(self, op: str, flag: bool, what: str) -> bool:
        """Whether `flag` (`what`, which names the agreement) holds on any rank."""
        return any(self.exchange(op, None, int(flag), f"{op}: {what}"))

    def together(self, op: str, args, run, undo=None, outcome=None):
        """`run()` on every rank, after checking that every rank passes the same `args`. Raises on every rank
        if it raises on any. A failure one of run()'s own agreements reported is every rank's already (run() puts
        back what it must); one reported at the closing agreement, where other ranks succeeded, is put back there
        by `undo(their result)`, which runs no collective (the failed ranks have left the call). Where there is
        no undo, or the ranks met at different agreements, their states differ: the engine is dead on every
        rank (EngineDeadError, now and at every later call), never out of step in silence. `outcome`: (what,
        digest_of(result)), compared at the closing agreement where every rank succeeded (what an update held:
        a generator's contents are no argument); where they differ, every rank raises and undoes its part."""
        self.same(op, None, digest(args), "arguments")
        self.failure_seen = False
        try:
            result, error = run(), None
        except Exception as err:
            result, error = None, err
        if not (self.failure_seen and error is not None):
            what, digest_of = outcome or ("outcome", None)
            try:
                self.same(op, error, digest_of(result) if digest_of is not None and error is None else 0, what)
            except Exception as err:
                # the agreement's verdict, not the collective's own failure (nor a dead engine's refusal)
                verdict = err is error or (isinstance(err, EngineError) and not isinstance(err, EngineDeadError))
                if verdict and len(self.failed) < self.group.size and undo is None:
                    self.out_of_step(f"{op} failed on rank(s) {self.failed} after the others had done it")
                if verdict and error is None and self.diverged is None:
                    undo(result)
                error = err
        if error is None:
            return result
        if self.diverged is not None:
            while isinstance(error, EngineDeadError) and (error.__cause__ or error.__context__) is not None:
                error = error.__cause__ or error.__context__  # what failed first, not a refusal made after it
            raise EngineDeadError(f"{op} failed ({type(error).__name__}: {error}) and the tensor-parallel ranks' "
                                  f"states now differ ({self.diverged}); this engine cannot run any more: shut it "
                                  "down and build a new one on every rank") from error
        raise error

    def wake_blocks(self, kv, blocks: int, allow_resize: bool) -> int:
        """The block count every rank's KV pool takes on wake: `blocks` where every rank has room for them,
        else with `allow_resize` the most every rank has room for. NoRoomError on every rank otherwise."""
        fits = self.exchange("wake", None, kv.blocks_fitting(blocks), "wake: the pool's block count")
        return agreed_blocks(fits, blocks, allow_resize)


def agreed_blocks(fits: list[int], blocks: int, allow_resize: bool) -> int:
    """The block count every rank's KV pool takes on wake, from how many of `blocks` fit on each rank (`fits`, in
    rank order): `blocks` where they fit everywhere, else with `allow_resize` the most that fit everywhere.
    NoRoomError naming the short ranks otherwise."""
    agreed = min(min(fits), blocks)
    if agreed < 1 or (agreed < blocks and not allow_resize):
        short = {rank: f for rank, f in enumerate(fits) if f < blocks}
        raise NoRoomError(f"waking the KV pool needs {blocks} blocks on every tensor-parallel rank; ranks "
                          f"{sorted(short)} have room for {[short[r] for r in sorted(short)]} (0: not one); free "
                          "memory there and wake again" + ("" if allow_resize else ", or wake(allow_resize=True)"))
    return agreed


class AgreedBudget:
    """A RolloutBudget with a time limit whose verdict every rank shares: each rank's clock is its own, so the
    ranks stop together at the first step after which any rank's budget is spent."""

    def __init__(self, budget, spmd: SPMD):
        self.budget, self.spmd = budget, spmd

    def start(self, seqs, num_samples: int) -> None:
        self.budget.start(seqs, num_samples)

    def spent(self, grown, running) -> bool:
        return self.spmd.any("generate", self.budget.spent(grown, running), "time budget spent")
