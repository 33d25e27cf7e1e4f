"""Sequence: one sample's tokens, where they sit in the pool, and how far they are computed."""
from __future__ import annotations

from enum import Enum, auto

from .logprobs import eager_logprobs
from .sampling_params import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    def __init__(self, request_id: int, index: int, token_ids: list[int], params: SamplingParams, seed: int,
                 sibling_seeds: tuple[int, ...] = ()):
        self.request_id, self.index = request_id, index  # index: which of the request's n samples
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.params, self.seed = params, seed
        # Seeds of the samples still to split off this one when the prompt's logits arrive (n > 1).
        self.sibling_seeds = sibling_seeds
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of the full, computed blocks, in order
        self.num_computed = 0   # tokens whose KV is in the pool
        self.uses_draft = False  # a speculative draft keeps its own KV for this sequence ...
        self.draft_computed = 0  # ... over this many tokens
        self.spec_proposed = self.spec_accepted = 0
        self.num_cached = 0     # of the prompt, tokens served by the prefix cache at its first admission
        self.admitted = False   # whether the scheduler has admitted it once (a preempted one is admitted again)
        self.cache_epoch = 0    # BlockManager.epoch at admission: it publishes blocks only while that lasts
        self.logprobs: list[float] = []
        self.top_logprobs: list[dict[int, float]] | None = [] if params.logprobs else None  # logprobs=k >= 1
        self.eager_logprobs = eager_logprobs(params)  # its steps run eagerly (logprobs.py)
        # The request's prompt logprobs, position 0 first (None), kept by its first sample only.
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None and index == 0 else None)
        self.weight_versions: list[int] = []  # the weight version that produced each output token
        self.prompt_weight_version: int | None = None  # CompletionOutput.prompt_weight_version; None: no KV yet
        self.stop_checked = 0   # output tokens already searched for stop strings
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None  # CompletionOutput.stop_reason
        self.text: str | None = None

    def __len__(self):
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_samples(self) -> int:
        """Tokens this sequence draws when its last token is computed: itself plus pending siblings."""
        return 1 + len(self.sibling_seeds)

    def unsplit_ended(self, reason: str) -> list["Sequence"]:
        """The samples still to split off this one, ended with `reason` and no tokens (its prompt's logits never
        came), so that its request's output holds all n of them (and each "abort" one can be resumed)."""
        ended = []
        for k, seed in enumerate(self.sibling_seeds):
            child = Sequence(self.request_id, k + 1, self.token_ids[: self.num_prompt_tokens], self.params, seed)
            child.status, child.finish_reason = Status.FINISHED, reason
            ended.append(child)
        self.sibling_seeds = ()
        return ended

    @property
    def kv_ready(self) -> int:
        """Tokens whose KV is complete in every pool (what the prefix cache may publish)."""
        return min(self.num_computed, self.draft_computed) if self.uses_draft else self.num_computed

    @property
    def scores_prompt(self) -> bool:
        """Prompt positions are still to be scored: every prompt token must be computed (no prefix-cache hit)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    def fork(self, index: int, seed: int) -> "Sequence":
        """A sibling sample sharing this one's prompt (blocks are shared by the block manager)."""
        child = Sequence(self.request_id, index, self.token_ids[: self.num_prompt_tokens], self.params, seed)
        child.num_computed, child.num_cached, child.cache_epoch = self.num_computed, self.num_cached, self.cache_epoch
        child.uses_draft, child.draft_computed = self.uses_draft, self.draft_computed
        child.prompt_weight_version = self.prompt_weight_version  # the prompt KV it shares
        child.block_hashes = list(self.block_hashes)
        return child
