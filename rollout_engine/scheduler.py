"""Continuous batching: which tokens of which sequences run in the next forward pass.

Each step spends a token budget: decodes first (one token each), then the next chunk
of every unfinished prefill, then new requests. When a decode finds no free block,
the most recently admitted sequence is preempted (its blocks freed, recomputed later).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .errors import NonFiniteLogitsError
from .sequence import Sequence, Status


@dataclass
class Batch:
    seqs: list[Sequence] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)   # tokens each sequence computes this step
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) before the forward

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_tokens.append(n)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_token_ids):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.max_model_len, self.eos_token_ids = max_model_len, set(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.pending_copies: list[tuple[int, int]] = []
        self.num_preemptions = 0

    @property
    def max_seq_len(self) -> int:
        """The longest a sequence may grow: max_model_len, or the whole pool if that holds fewer tokens
        (after a wake re-sized it): one sequence must always fit, or preemption could never make room."""
        return min(self.max_model_len, self.bm.num_blocks * self.bm.block_size)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def end_overgrown(self) -> list[Sequence]:
        """Waiting sequences the pool can no longer hold (a wake re-sized it smaller than they are long) end
        with "length", keeping their tokens, and with them the samples not yet split off a prompt that never
        ran: the caller reports them all, since no step will. Only the head of the queue is admitted, so only
        the head is looked at (O(1) per step however many wait); _schedule_once admits none past it."""
        ended = []
        while self.waiting and len(self.waiting[0]) > self.max_seq_len:
            seq = self.waiting[0]
            self.finish(seq, "length")
            ended += [seq, *seq.unsplit_ended("length")]
        return ended

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Batch:
        while True:
            batch = self._schedule_once()
            if batch.seqs or not self.running:
                break
            self._preempt(self.running[-1])  # every running prefill is stuck on blocks: make room
        batch.block_copies, self.pending_copies = self.pending_copies, []
        return batch

    def schedule_ahead(self, batch: Batch) -> Batch | None:
        """The decode step to launch while `batch`'s tokens are still being computed: its sequences that the
        pending token cannot finish by length, one token each. None when something else must run first
        (requests waiting, a sequence outside `batch`, no free block)."""
        if not self._runs_alone(batch):
            return None
        ahead, limit = Batch(), self.max_seq_len
        for seq in batch.seqs:
            if seq.status is not Status.RUNNING:
                continue
            after = len(seq) + 1  # its length once the pending token is in
            if after - seq.num_prompt_tokens >= seq.params.max_tokens or after >= limit:
                continue
            if not self.bm.grow(seq, 2):  # the pending token's slot and the next one's
                return None
            ahead.add(seq, 1)
        return ahead if ahead.seqs else None

    def speculate_ahead(self, batch: Batch, k: int) -> bool:
        """Whether the next speculative step over `batch` (k proposals) may be launched while this one's tokens
        are still being computed: nothing else must run first, this step cannot end a sequence by length, and
        each has positions and blocks for both steps (the blocks are taken: they are used later anyway)."""
        if not self._runs_alone(batch) or any(
                s.status is not Status.RUNNING or len(s) + 2 * k + 1 > self.max_seq_len
                or len(s) - s.num_prompt_tokens + k + 1 >= s.params.max_tokens for s in batch.seqs):
            return False
        return all(self.bm.grow(s, 2 * k + 2) for s in batch.seqs)

    def _runs_alone(self, batch: Batch) -> bool:
        """Nothing but `batch` could run next: no waiting request could be admitted (or ended) by the next
        synchronous step, no block copy is pending and no sequence outside `batch` runs. A request that waits
        for a seat does not count: a full running set decodes on, launched ahead, until a seat frees."""
        members = {id(s) for s in batch.seqs}
        return not (self._head_can_move() or self.pending_copies or any(id(s) not in members for s in self.running))

    def _head_can_move(self) -> bool:
        """Whether the next synchronous step would admit the head of the queue or end it (end_overgrown):
        the condition _schedule_once admits by, less the blocks (a step that finds none admits nothing)."""
        if not self.waiting:
            return False
        head = self.waiting[0]
        return len(head) > self.max_seq_len or self._has_seats_for(head)

    def _schedule_once(self) -> Batch:
        batch, budget = Batch(), self.max_num_batched_tokens
        for seq in [s for s in self.running if s.num_uncomputed == 1]:
            if budget == 0:
                break
            if seq.status is not Status.RUNNING:  # preempted earlier in this loop
                continue
            while not self.bm.grow(seq, 1):
                self._preempt(self.running[-1])
                if seq.status is not Status.RUNNING:
                    break
            else:
                batch.add(seq, 1)
                budget -= 1
        filling: dict[bytes, int] = {}  # blocks this step's prefills fill, shared with prompts admitted after them
        for seq in [s for s in self.running if s.num_uncomputed > 1]:
            n = min(seq.num_uncomputed, budget)
            if n and self.bm.grow(seq, n):
                self.bm.announce(seq, n, filling)
                batch.add(seq, n)
                budget -= n
        # One the pool cannot hold is never admitted (it would be preempted and re-admitted at every step): it
        # waits until it is the head, where end_overgrown ends it. One that fills it exactly (a prompt of
        # max_seq_len tokens) runs its prefill, whose token ends it by length: that token needs no KV slot.
        while (self.waiting and budget and len(self.waiting[0]) <= self.max_seq_len
               and self._has_seats_for(self.waiting[0])):
            seq = self.waiting[0]
            self.bm.match_prefix(seq, filling)
            n = min(seq.num_uncomputed, budget)
            if not self.bm.grow(seq, n):
                self.bm.free_seq(seq)  # let go of prefix hits; retry when blocks free up
                break
            self.bm.announce(seq, n, filling)
            self.waiting.popleft()
            seq.status, seq.admitted = Status.RUNNING, True
            seq.prompt_weight_version = None  # its KV is (re)computed from here, under the weights of that step
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n
        return batch

    def _has_seats_for(self, seq: Sequence) -> bool:
        """Room in the running set for the sequence and its siblings (all of them, up to max_num_seqs)."""
        taken = sum(s.num_samples for s in self.running)  # prompts still prefilling hold seats for their samples
        return taken + min(seq.num_samples, self.max_num_seqs) <= self.max_num_seqs

    def _free(self, seq: Sequence) -> None:
        """Free the sequence's blocks, and drop the block copies still pending into them: a freed block may go
        to another fork before the copies run, and two copies into one block in one launch race."""
        if self.pending_copies:
            held = set(seq.block_table)
            self.pending_copies = [(src, dst) for src, dst in self.pending_copies if dst not in held]
        self.bm.free_seq(seq)

    def _preempt(self, seq: Sequence) -> None:
        self._free(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def postprocess(self, batch: Batch, sampled: dict[int, list[tuple]], version: int) -> list[Sequence]:
        """Advance computed counts; append each sampled (token, logprob, top-k or None); fork n > 1 samples.

        `sampled` maps a position in `batch.seqs` to its draws (one per sample); `version`: the weight
        version that produced them. Returns the sequences that got a token, siblings included."""
        grown = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_tokens)):
            if seq.status is Status.FINISHED:  # it ended while this step, launched ahead, was running
                continue
            seq.num_computed += n
            if seq.prompt_weight_version is None:  # its first chunk since admission
                seq.prompt_weight_version = version
            self.bm.publish(seq)
            if i not in sampled:
                continue
            draws = sampled[i]
            siblings = [self._split_off(seq, k + 1, s) for k, s in enumerate(seq.sibling_seeds)]
            seq.sibling_seeds = ()
            for member, (token, logprob, top) in zip([seq] + siblings, draws):
                self.append(member, token, logprob, version, top)
                grown.append(member)
        return grown

    def postprocess_speculative(self, batch: Batch, results, k: int, version: int) -> list[Sequence]:
        """Append each sequence's emitted tokens (accepted drafts, then a correction or bonus token); `results`:
        per sequence (tokens, [(logprob, top-k or None)], drafts accepted).

        The target's KV now holds the last token and the accepted drafts; the draft's holds the
        last token and the proposals it was fed back, of which the accepted ones stay valid."""
        grown = []
        for seq, (tokens, scores, accepted) in zip(batch.seqs, results):
            if seq.status is Status.FINISHED:  # it ended while this step, launched ahead, was running
                continue
            grown.append(seq)
            length = len(seq)
            seq.num_computed = length + accepted
            seq.draft_computed = length + min(accepted, k - 1)
            seq.spec_proposed += k
            seq.spec_accepted += accepted
            for token, (logprob, top) in zip(tokens, scores):
                self.append(seq, token, logprob, version, top)
                if seq.finish_reason is not None:
                    break
            else:
                self.bm.publish(seq)
        return grown

    def _split_off(self, parent: Sequence, index: int, seed: int) -> Sequence:
        child = parent.fork(index, seed)
        if len(self.running) < self.max_num_seqs and self.bm.num_free >= self.bm.fork_cost(parent):
            copy = self.bm.fork(parent, child)
            if copy:
                self.pending_copies.append(copy)
            child.status = Status.RUNNING
            self.running.append(child)
        else:  # no room now: it recomputes its prompt later, mostly from the prefix cache
            child.num_computed = child.num_cached = child.draft_computed = 0
            child.block_hashes = []
            self.waiting.append(child)
        return child

    def append(self, seq: Sequence, token: int, logprob: float, version: int, top: dict | None = None) -> None:
        if logprob != logprob:  # NaN: the sampler had nothing finite to draw from
            raise NonFiniteLogitsError(
                f"request {seq.request_id} (sample {seq.index}): the logits at position {len(seq)} are not finite "
                "(NaN or inf), so no token can be drawn; the weights or the model's inputs are broken")
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        if seq.top_logprobs is not None:
            seq.top_logprobs.append(top)
        seq.weight_versions.append(version)
        p = seq.params
        eos = token in self.eos_token_ids and not p.ignore_eos
        if eos or token in p.stop_token_ids:
            seq.stop_reason = None if eos else token
            self.finish(seq, "stop")
        elif len(seq) - seq.num_prompt_tokens >= p.max_tokens or len(seq) >= self.max_seq_len:
            self.finish(seq, "length")

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is Status.FINISHED:
            return
        self._free(seq)
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def retract_all(self) -> list[Sequence]:
        """Free every running sequence's KV and queue it again with its tokens (first in line, in order):
        it is re-prefilled, under whatever weights serve then, when it runs again. A prompt scored part-way is
        scored again whole, so its prompt_logprobs are one set of weights': one preempted part-way, waiting, too
        (it is re-prefilled from position 0 as well)."""
        retracted = list(self.running)
        for seq in list(self.waiting) + retracted:
            if seq.scores_prompt:
                seq.prompt_logprobs = [None]
        for seq in reversed(retracted):
            self.bm.free_seq(seq)
            self.running.remove(seq)
            seq.status = Status.WAITING
            self.waiting.appendleft(seq)
        self.pending_copies = []  # their blocks are free: nothing is copied between them
        return retracted

    def abort_running(self) -> list[Sequence]:
        """Finish every sequence that holds KV with "abort" (waiting ones hold none and stay)."""
        seqs = list(self.running)
        for seq in seqs:
            self.finish(seq, "abort")
        self.pending_copies = []
        return seqs

    def abort_all(self) -> list[Sequence]:
        seqs = self.running + list(self.waiting)
        for seq in seqs:
            self.finish(seq, "abort")
        self.pending_copies = []
        return seqs
