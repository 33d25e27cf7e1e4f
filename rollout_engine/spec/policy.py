"""When a step speculates, and what speculation has done so far.

A speculative step costs `break_even` plain decode steps (the cost model below, fixed at engine start) and
emits, per sequence, its accepted drafts plus one token. Each sequence keeps a record of its acceptance: its
first speculative steps are a probe, whatever the model says; after it, a sequence whose expected tokens per
step fall below `break_even` is off for good, and counts as accepting nothing. A batch speculates (`speculates`)
while one of its sequences is probing or its expected tokens per step beat `break_even` per sequence. The
decisions read counts only, never clocks, so seeded outputs repeat from run to run. Two questions follow: whether
there is room for k more tokens right now (`make_room`), and whether the next speculative step may be launched
before this one is read (`launch_ahead`).
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from rollout_kernels import gemv

from .state import SPEC_MAX_BATCH

# The cost model, in plain decode steps of the target at batch 1. A pass takes time as if it streamed its weights
# plus this many bytes per layer (the layer's kernel latency): the fit to both passes as profiled on the H200
# (8B: 16.06 GB, 32 layers; the 1.7B shape with the 8B vocabulary: 3.34 GB, 28 layers). It puts that draft's pass
# at 0.398 of an 8B plain step in bf16 and 0.335 in fp8; the two drafts' measured k = 2 steps differ by 0.115
# plain steps, 0.126 by this model.
LAYER_LATENCY_BYTES = 200e6
# The verify pass over k + 1 positions, in plain steps: the measured speculative step less k draft passes by the
# model above (H200, docs/benchmarks.md, "The speculation cost model with the few-row kernel"). Positions the GEMV
# takes (k + 1 <= GEMV_ROWS) read each weight once, as the plain step does. More, up to skinny.SKINNY_ROWS, take
# the few-row tensor-core kernel on a float target (1.10-1.19 at k = 2 and 3 over both drafts; past SKINNY_ROWS,
# k >= 16, cuBLAS, which this model does not tell apart) and cuBLASLt on an fp8 target, whose plain step is
# weight-only on the GEMV and whose verify also runs the kernels that quantize activations. The fp8 entries are the
# fp8 draft's: a bf16 draft on an fp8 target costs about 0.3 plain steps more than this model says, a pairing slower
# than the fp8 draft on the same target.
VERIFY_COST = {("float", "gemv"): 1.09, ("float", "few_rows"): 1.14, ("fp8", "gemv"): 1.39, ("fp8", "few_rows"): 1.61}
# A sequence's probe: this many proposals (ceil(4 / k) steps). A random draft at k = 2 then costs 2 steps at
# 1.94 plain steps for 1 token each: 1.9 plain steps, 0.9% of a 210-token sample by this model; on the H200
# a step's switches (draft catch-up, no launch-ahead while a verdict is pending) cost about as much again.
PROBE_PROPOSALS = 4
DECAY = 15 / 16  # a record weighs its latest ~16 steps: a sequence whose text stops matching its draft turns off
# A sequence's record counts as if it also held this many fully accepted steps: only evidence that outweighs
# one good step turns it off (or keeps its batch from speculating). A draft that accepts nothing turns off at its
# probe's end at k = 2 and 3, one step later at k >= 4 with the measured pair (1 + k / 2 tokens after one empty
# step, break-even 1.14 + 0.40 k); one accepting 80% of proposals at k = 2 (2.44 tokens a step, break-even 1.94)
# is lost to an unlucky 2-step probe 4% of the time (10% without this optimism).
OPTIMISM = 1.0


def pass_cost(model) -> float:
    """A forward pass of `model` at batch 1, in bytes: its weights plus its layers' latency."""
    return sum(p.nbytes for p in model.parameters()) + model.cfg.num_layers * LAYER_LATENCY_BYTES


def verify_cost(model, k: int) -> float:
    """The verify pass over k + 1 positions, in plain decode steps of `model` (VERIFY_COST)."""
    weights = "fp8" if any(p.dtype == torch.float8_e4m3fn for p in model.parameters()) else "float"
    return VERIFY_COST[weights, "gemv" if k + 1 <= gemv.GEMV_ROWS else "few_rows"]


def step_cost(runner, k: int) -> float:
    """A speculative step in plain decode steps: a verify pass over k+1 positions and k draft passes (prompt
    lookup's proposals cost no pass)."""
    draft = pass_cost(runner.draft) / pass_cost(runner.model) if runner.draft is not None else 0.0
    return verify_cost(runner.model, k) + k * draft


@dataclass
class Acceptance:
    """One sequence's speculative steps: how many, and its accepted drafts per step weighted toward the latest."""
    steps: int = 0
    weight: float = 0.0
    accepted: float = 0.0
    off: bool = False

    def add(self, accepted: int) -> None:
        self.steps += 1
        self.weight = self.weight * DECAY + 1
        self.accepted = self.accepted * DECAY + accepted

    def tokens_per_step(self, k: int) -> float:
        """What a speculative step is expected to emit for this sequence: 1 once it is off, else its record
        with OPTIMISM fully accepted steps (k drafts each) added."""
        return 1.0 if self.off else 1 + (self.accepted + OPTIMISM * k) / (self.weight + OPTIMISM)


@dataclass
class SpecCounters:
    steps: int = 0
    proposed: int = 0
    accepted: int = 0
    turned_off: int = 0


class SpeculationPolicy:
    def __init__(self, decoder, scheduler, k: int):
        self.decoder, self.scheduler, self.k = decoder, scheduler, k
        self.counters = SpecCounters()
        self.break_even = step_cost(decoder.runner, k) if decoder is not None else 0.0
        self.probe_steps = math.ceil(PROBE_PROPOSALS / k) if k else 0
        self.records: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Sequence -> Acceptance

    def _record(self, seq) -> Acceptance:
        return self.records.setdefault(seq, Acceptance())

    def _probing(self, record: Acceptance) -> bool:
        return not record.off and record.steps < self.probe_steps

    def pays(self, seqs) -> bool:
        """Whether a speculative step is worth taking for these sequences: one is probing, or together they are
        expected to emit more than `break_even` tokens per sequence."""
        records = [self._record(s) for s in seqs]
        return (any(self._probing(r) for r in records)
                or sum(r.tokens_per_step(self.k) for r in records) > self.break_even * len(records))

    def speculates(self, batch) -> bool:
        """Small batches for which speculation pays and whose proposer has something to propose. Asked also of
        a step launched ahead, whose newest tokens are not appended yet: its answer then lags one step."""
        return (self.decoder is not None and len(batch.seqs) <= SPEC_MAX_BATCH and self.pays(batch.seqs)
                and self.decoder.proposer.wants(batch.seqs))

    def make_room(self, batch) -> bool:
        """A batch that speculates runs a speculative step now if it is decode-only, one sample each, every
        sequence holds two tokens at least (a pass feeds the draft its two newest: a one-token prompt's own
        step is plain), and every sequence has positions and blocks for k more tokens (blocks taken here are
        used later anyway). A one-token chunk of a prompt (a small max_num_batched_tokens) is prefill, not
        decode: its prompt is not all in the KV pool yet."""
        if max(batch.num_tokens) > 1 or any(s.num_uncomputed != 1 for s in batch.seqs):
            return False
        if any(s.num_samples > 1 or len(s) < 2 or len(s) + self.k > self.scheduler.max_seq_len for s in batch.seqs):
            return False
        return all(self.scheduler.bm.grow(s, self.k + 1) for s in batch.seqs)

    def _stays_on_whatever(self, record: Acceptance) -> bool:
        """Whether no result of the step in flight can turn this sequence off: it stays on even if that step
        accepts nothing (more acceptance only raises its record)."""
        worst = Acceptance(record.steps, record.weight, record.accepted)
        worst.add(0)
        return record.off or not self._rules_out(worst)

    def _rules_out(self, record: Acceptance) -> bool:
        """The verdict: past its probe, a record whose expected tokens per step fall below `break_even`."""
        return record.steps >= self.probe_steps and record.tokens_per_step(self.k) < self.break_even

    def launch_ahead(self, batch) -> bool:
        """Whether the next speculative step over `batch` may go before this one's tokens are read: its
        proposer works on the device, no verdict of the step in flight can turn a sequence off (else a draft
        that accepts nothing pays for a step its verdict already ruled out), speculation still pays, and the
        scheduler has nothing else to run."""
        return (self.decoder.proposer.on_device
                and all(self._stays_on_whatever(self._record(s)) for s in batch.seqs)
                and self.speculates(batch) and self.scheduler.speculate_ahead(batch, self.k))

    def record(self, live) -> None:
        """Count one speculative step over the sequences still live in it, [(sequence, its result)]; a sequence
        past its probe whose expected tokens per step fall below `break_even` turns off."""
        c = self.counters
        c.steps += 1
        c.proposed += self.k * len(live)
        for seq, (_, _, accepted) in live:
            c.accepted += accepted
            r = self._record(seq)
            r.add(accepted)
            if not r.off and self._rules_out(r):
                r.off = True
                c.turned_off += 1

    def stats(self) -> dict:
        c = self.counters
        # tokens a sequence emits per speculative step: its accepted drafts plus the correction or bonus token
        per_step = 1 + c.accepted * self.k / c.proposed if c.proposed else 0.0
        return {"spec_steps": c.steps, "spec_proposed": c.proposed, "spec_accepted": c.accepted,
                "mean_acceptance_length": per_step, "spec_sequences_turned_off": c.turned_off,
                "spec_break_even": self.break_even}
