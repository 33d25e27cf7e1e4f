"""When a step speculates, and what speculation has done so far.

One rule decides whether a batch speculates (`speculates`): a small batch whose proposer has something
to propose. Two questions follow from it: whether there is room for k more tokens right now
(`make_room`), and whether the next speculative step may be launched before this one is read
(`launch_ahead`).
"""
from __future__ import annotations

from dataclasses import dataclass

from .state import SPEC_MAX_BATCH


@dataclass
class SpecCounters:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0


class SpeculationPolicy:
    def __init__(self, decoder, scheduler, k: int):
        self.decoder, self.scheduler, self.k = decoder, scheduler, k
        self.counters = SpecCounters()

    def speculates(self, batch) -> bool:
        """Small batches whose proposer has something to propose. Asked also of a step launched ahead,
        whose newest tokens are not appended yet: its answer then lags one token, which only delays."""
        return (self.decoder is not None and len(batch.seqs) <= SPEC_MAX_BATCH
                and self.decoder.proposer.wants(batch.seqs))

    def make_room(self, batch) -> bool:
        """A batch that speculates runs a speculative step now if it is decode-only, one sample each, and
        every sequence has positions and blocks for k more tokens (blocks taken here are used later anyway)."""
        if max(batch.num_tokens) > 1:
            return False
        if any(s.num_samples > 1 or len(s) + self.k > self.scheduler.max_seq_len for s in batch.seqs):
            return False
        return all(self.scheduler.bm.grow(s, self.k + 1) for s in batch.seqs)

    def launch_ahead(self, batch) -> bool:
        """Whether the next speculative step over `batch` may go before this one's tokens are read: its
        proposer works on the device and the scheduler has nothing else to run."""
        return self.decoder.proposer.on_device and self.scheduler.speculate_ahead(batch, self.k)

    def record(self, live_results) -> None:
        """Count one speculative step over the sequences still live in it."""
        self.counters.steps += 1
        self.counters.proposed += self.k * len(live_results)
        self.counters.accepted += sum(accepted for _, _, accepted in live_results)

    def stats(self) -> dict:
        c = self.counters
        # tokens a sequence emits per speculative step: its accepted drafts plus the correction or bonus token
        per_step = 1 + c.accepted * self.k / c.proposed if c.proposed else 0.0
        return {"spec_steps": c.steps, "spec_proposed": c.proposed, "spec_accepted": c.accepted,
                "mean_acceptance_length": per_step}
