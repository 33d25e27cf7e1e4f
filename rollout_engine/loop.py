"""The generation loop: requests in, steps run, finished samples out.

One step: the scheduler picks a batch; the model runner launches it (a pure decode step goes before
the previous one's tokens are read, so the host's bookkeeping overlaps the GPU); the scheduler appends
what was sampled; stop strings are checked; finished samples leave. Small batches for which speculation
pays and whose proposer has something to propose take speculative steps instead (spec/policy.py).
"""
from __future__ import annotations

import hashlib

from tqdm.auto import tqdm

from .model_runner import pure_decode
from .outputs import RequestOutput, request_output
from .partial import RolloutBudget, keeps_request_id, resumed_sequences
from .sequence import Sequence, Status
from .spec import SPEC_MAX_BATCH
from .stop_strings import StopStrings


def sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request, in [0, 2**63): a function of the request's seed only, never of the
    batch. A digest of the base seed whole (hash() of an int is taken modulo 2**61 - 1, so seeds that far apart
    would draw the same samples) gives the high 31 bits and a start for the low 32, to which `index` is added:
    the noise key is one-to-one in a seed's low 32 bits for fixed high ones, so a request's samples never share
    a noise stream."""
    digest = int.from_bytes(hashlib.blake2b(f"{base}".encode(), digest_size=8).digest(), "little")
    return (digest >> 33) << 32 | (digest + index) & 0xFFFFFFFF


class GenerationLoop:
    def __init__(self, scheduler, runner, kv, policy, tokenizer, seed: int, uses_draft: bool, version):
        self.scheduler, self.runner, self.kv, self.policy = scheduler, runner, kv, policy
        self.tokenizer, self.seed, self.uses_draft = tokenizer, seed, uses_draft
        self.version = version  # () -> the weight version that produces the tokens of the next step
        self.launched = None  # a decode step in flight
        self.spec_batch = self.spec_launched = None  # a speculative step in flight, and its batch
        self.stop_strings = StopStrings(tokenizer, scheduler) if tokenizer is not None else None
        self.next_request = 0
        # () -> whether whoever runs this call wants it stopped (a Ray pool's cancelled task), asked after each
        # step; True stops the call as a spent budget does. None: nobody asks.
        self.cancelled = None

    def submit(self, ids: list[int], params) -> Sequence:
        """Queue one request (its n samples split off when the prompt's logits arrive); returns its sequence."""
        rid = self.next_request
        self.next_request += 1
        seeds = self.seeds(params, rid)
        seq = Sequence(rid, 0, ids, params, seeds[0], tuple(seeds[1:]))
        seq.uses_draft = self.uses_draft
        self.scheduler.add(seq)
        return seq

    def seeds(self, params, request_id: int) -> list[int]:
        """The seed of each of a request's samples: from params.seed, else from the engine's seed and the id."""
        base = params.seed if params.seed is not None else sample_seed(self.seed, request_id)
        return [sample_seed(base, j) for j in range(params.n)]

    def resume(self, output: RequestOutput, params, keep_id: bool) -> list[Sequence]:
        """Queue the "abort" samples of an earlier call's output (checked by partial.check_resumable) to go on
        from their tokens; returns all n samples, in index order. With `keep_id` an int request id (an Engine's)
        is kept, so each sample keeps its seed (the caller makes sure no request in flight has that id); else the
        request gets a new id, and new seeds unless params.seed is set."""
        rid = int(output.request_id) if keep_id and keeps_request_id(output.request_id) else self.next_request
        self.next_request = max(self.next_request, rid + 1)  # no later request takes this id
        seqs = resumed_sequences(output, params, rid, self.seeds(params, rid))
        for seq in seqs:
            if seq.status is Status.WAITING:
                seq.uses_draft = self.uses_draft
                self.scheduler.add(seq)
        return seqs

    def abort_all(self) -> list[Sequence]:
        """Finish every request with "abort" and forget any step in flight (its results are not read; the
        device runs it before anything later, so the blocks it writes are free only afterwards)."""
        self.launched = self.spec_launched = self.spec_batch = None
        return self.scheduler.abort_all()

    def has_work(self) -> bool:
        return self.launched is not None or self.spec_launched is not None or self.scheduler.has_work()

    def run_to_completion(self, requests: list[tuple], use_tqdm: bool,
                          budget: RolloutBudget | None = None) -> list[RequestOutput]:
        """Run until every request has finished, or the budget is spent (the rest end with "abort"); their
        outputs, in order. A request is (text, its first sequence, its samples finished already): a new one's
        first sequence carries its n samples; a resumed one's samples are all queued or finished already."""
        finished: dict[int, list[Sequence]] = {first.request_id: list(done) for _, first, done in requests}
        queued = list(self.scheduler.waiting)  # the call's sequences: an Engine runs one call at a time
        total = sum(s.num_samples for s in queued)
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm or total < 64, unit="sample")
        if budget is not None:
            budget.start(queued, total)
        try:  # on an exception the caller (Engine.generate) aborts everything: nothing half-run survives
            for seq in self.run(budget):
                finished[seq.request_id].append(seq)
                bar.update(1)
        finally:
            bar.close()
        version = self.version()
        return [self.output(text, first, finished[first.request_id], version) for text, first, _ in requests]

    def run(self, budget: RolloutBudget | None = None):
        """Run steps until no work is left, yielding sequences as they finish. Once `budget` is spent (or the
        call is `cancelled`), the step in flight is collected and every sample not finished ends with "abort",
        keeping what it has."""
        while self.has_work():
            grown = self.step()
            yield from (seq for seq in grown if seq.finish_reason is not None)
            if ((budget is not None and budget.spent(grown, self.scheduler.running))
                    or (self.cancelled is not None and self.cancelled())):
                yield from (seq for seq in self.drain() if seq.finish_reason is not None)
                for seq in self.abort_all():
                    yield seq
                    yield from seq.unsplit_ended("abort")

    def step(self) -> list[Sequence]:
        """One step; returns the sequences that got tokens (those that finished have a finish_reason).

        A pure decode step is launched before the previous one's tokens are read (its newest tokens are
        copied on the device), so the host's bookkeeping between steps overlaps the GPU's step: between
        two calls one step may be in flight (`drain` collects it and launches nothing)."""
        if self.spec_launched is not None:
            return self._speculative_step()
        if self.launched is None:
            ended = self.scheduler.end_overgrown()
            if ended:
                return ended
            batch = self.scheduler.schedule()
            if batch.block_copies:
                src, dst = zip(*batch.block_copies)
                self.kv.planner.copy_blocks(list(src), list(dst))
            if not pure_decode(batch) or self.policy.speculates(batch):
                if self.policy.speculates(batch) and self.policy.make_room(batch):
                    return self._start_speculating(batch)
                return self._step(batch)
            self.launched = self.runner.launch(batch)
        launched = self.launched
        # Stop launching ahead once the batch is small enough to speculate (the draft catches up then).
        ahead = None if self.policy.speculates(launched.batch) else self.scheduler.schedule_ahead(launched.batch)
        self.launched = self.runner.launch(ahead, after=launched) if ahead is not None else None
        return self._grown(self.scheduler.postprocess(launched.batch, self.runner.collect(launched), self.version()))

    def drain(self) -> list[Sequence]:
        """Collect the step in flight, if any, and launch nothing: afterwards no step is running."""
        grown = []
        if self.launched is not None:
            launched, self.launched = self.launched, None
            grown = self.scheduler.postprocess(launched.batch, self.runner.collect(launched), self.version())
        if self.spec_launched is not None:
            launched, self.spec_launched = self.spec_launched, None
            grown = self._speculative_results(launched)
        return self._grown(grown)

    def _step(self, batch) -> list[Sequence]:
        """One synchronous step (prefill or mixed work)."""
        # The draft follows prefills only while speculation can come soon (a small running set).
        follows = self.uses_draft and len(self.scheduler.running) <= SPEC_MAX_BATCH
        sampled = self.runner.step(batch, draft_follows=follows)
        return self._grown(self.scheduler.postprocess(batch, sampled, self.version()))

    def _start_speculating(self, batch) -> list[Sequence]:
        self.policy.decoder.start(batch.seqs)
        self.spec_batch = batch
        self.spec_launched = self.policy.decoder.launch(batch.seqs)
        return self._speculative_step()

    def _speculative_step(self) -> list[Sequence]:
        """Speculative steps over one batch. While the batch stays the same and its proposer works on the
        device, each step is launched before the last one's tokens are read (SpecState carries the sequences
        forward on the device). A step launched for a sequence that the step before finished is dropped for it."""
        launched, batch = self.spec_launched, self.spec_batch
        following = self.policy.decoder.launch(batch.seqs) if self.policy.launch_ahead(batch) else None
        grown = self._speculative_results(launched)
        self.spec_launched = following
        return self._grown(grown)

    def _speculative_results(self, launched) -> list[Sequence]:
        batch = self.spec_batch
        results = self.policy.decoder.collect(launched)
        self.policy.record([(s, r) for s, r in zip(batch.seqs, results) if s.status is not Status.FINISHED])
        return self.scheduler.postprocess_speculative(batch, results, self.policy.k, self.version())

    def _grown(self, grown: list[Sequence]) -> list[Sequence]:
        stopping = [seq for seq in grown if seq.params.stop]  # a stop string may come before its end
        if stopping and self.stop_strings is not None:
            self.stop_strings.check_all(stopping)
        return grown

    def output(self, text, first: Sequence, seqs: list[Sequence], weight_version: int) -> RequestOutput:
        """The RequestOutput of a request whose samples `seqs` all finished."""
        return request_output(text, first, seqs, weight_version, self.tokenizer, self.policy.decoder is not None)
