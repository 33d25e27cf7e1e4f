"""Engine: the public facade. It builds the parts from a validated EngineConfig and orchestrates them.

The parts each own their state: WeightStore (weights, versions, staleness), KVCache (the single pool), BlockManager
+ Scheduler (which tokens run), ModelRunner (tensors in, tokens out), GenerationLoop (the steps of a generate call),
and, with a draft, the speculative decoder and its policy. SleepWake does the work of sleep and wake across them.
"""
from __future__ import annotations

import threading
import weakref

import torch

from rollout_kernels import get_ops

from .block_manager import BlockManager
from .chat import chat_prompts
from .config import EngineConfig
from .errors import EngineAsleepError, EngineError
from .exclusive import exclusive
from .inputs import check_draft_tokenizer, load_tokenizer, normalise
from .kv_cache import KVCache, kv_budget
from .loop import GenerationLoop
from .memory import DeviceMemory, default_dtype, tags_key
from .model import CausalLM
from .model_runner import capture_graphs
from .outputs import RequestOutput
from .partial import RolloutBudget, check_resumable, keeps_request_id, resumed_prompts
from .sampling_params import SamplingParams, is_int
from .scheduler import Scheduler
from .sleep_wake import SleepWake
from .spec import SpeculationPolicy, speculative_decoder
from .step_buffers import StepBuffers
from .parallel import call_digest, digest, outputs_digest, parallel_mode
from .weight_store import WeightStore
from .checkpoint_files import iter_safetensors


class Engine:
    """RL rollouts on one device or a tensor-parallel group: generate / chat with per-token logprobs, sleep / wake to
    lend the memory to a trainer, update_weights in place. One thread at a time; AsyncEngine shares one."""

    def __init__(self, model_path, device=None, dtype="auto", kv_cache_memory=0.3, max_num_seqs=256,
                 max_model_len=None, block_size=16, enable_prefix_caching=True, draft_model=None,
                 num_speculative_tokens=0, tensor_parallel_size=None, seed=0, max_num_batched_tokens=None,
                 kv_cache_dtype=None, enforce_eager=False, load_format="safetensors", check_finite=True,
                 batch_invariant=False, quantization=None, draft_quantization="auto", process_group=None):
        """`kv_cache_memory`: the KV pool's share of free device memory (a float in (0, 1]) or its bytes (an int).
        `check_finite=False` skips the NaN/inf check of every weight update (one read of the update's bytes on the
        device): non-finite weights are then served, and sampling fails on them. `quantization="fp8"` stores the
        projections as float8_e4m3fn, re-quantized on every weight path ("fp8_lm_head": an untied LM head too);
        `draft_quantization` does the same for a speculative draft ("auto": as `quantization`). `kv_cache_dtype`
        None or "auto" keeps the KV cache in the model's dtype; "fp8" (or "fp8_e4m3", "float8_e4m3fn") stores it
        as e4m3 with per-(token, kv head) scales: half the bytes per token of bf16.

        Tensor parallelism, two ways in (parallel/):
        - `tensor_parallel_size=N` (no process_group): this process drives N-1 worker processes on the next devices.
        - `process_group=pg` (SPMD): every rank of `pg`, a group of the caller's initialised torch.distributed
          job (NCCL with a CUDA `device`, this rank's; gloo on the CPU), builds an Engine with the same
          arguments and makes every later call (generate, chat, sleep, wake, update_weights*, flush_cache)
          with the same arguments, together; each rank's outputs are the same (tensor_parallel_size: None or the
          group's size). A call whose arguments differ between ranks, or that fails on any rank, raises on every
          rank; generate checks that every rank sampled the same tokens. update_weights takes full Hugging Face
          tensors on every rank (each keeps its slice), or with sharded=True each rank's own slice. A rank that
          leaves a collective hangs the others until the group's timeout, then EngineDeadError. Not AsyncEngine."""
        self._lock, self._running, self._holder = threading.RLock(), None, None  # an AsyncEngine's loop holds it
        self.config = config = EngineConfig.from_args(
            model_path, device, dtype, kv_cache_memory, max_num_seqs, max_model_len, block_size,
            enable_prefix_caching, draft_model, num_speculative_tokens, tensor_parallel_size, seed,
            max_num_batched_tokens, kv_cache_dtype, enforce_eager, load_format, check_finite, batch_invariant, quantization,
            draft_quantization, process_group)
        self.cfg, self.device, self.dtype, self.block_size = config.model, config.device, config.dtype, config.block_size
        self.num_speculative_tokens = config.num_speculative_tokens
        self.tokenizer = load_tokenizer(config.model_path)
        check_draft_tokenizer(self.tokenizer, config.draft_path)
        self.ops = get_ops(self.device, config.batch_invariant)
        self.memory = DeviceMemory(self.device)
        weakref.finalize(self, self.memory.close)  # also at interpreter exit
        self.parallel = parallel_mode(config)  # what each call does on the other ranks (parallel/modes.py)
        try:  # a half-built engine lives on in a kept traceback: its worker processes stop now
            # SPMD: a rank whose build fails meets the others at the build's closing agreement, not at another
            # call's collective: every rank raises at once
            self.parallel.together("Engine()", (), lambda: self._build(config))
        except BaseException:
            self.parallel.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.parallel.same("Engine()", lambda: digest(config.rank_settings()), "Engine arguments",
                           "every rank builds its Engine with the same arguments (its own device aside)")
        self.tp = self.parallel.driver  # the worker processes' TPDriver, or None
        weakref.finalize(self, self.parallel.close)
        with self.memory.region("weights"), default_dtype(self.dtype), torch.device(self.device):
            self.models = {kind: CausalLM(cfg, self.ops, config.max_model_len, self.parallel.group)
                           for kind, cfg in config.model_configs().items()}
        self.model = self.models["target"]
        self.weight_store = WeightStore(self.models, self.ops, self.memory, config.check_finite)
        self.weights = self.weight_store.tables["target"]  # the target's HF name table
        self.weight_store.load({kind: iter_safetensors(path) if config.load_format == "safetensors"
                                else self.weight_store.random_weights(kind, config.seed)
                                for kind, path in config.checkpoints().items()})
        self.kv = KVCache(self.models, self.block_size, config.kv_dtype, self.device, self.memory)
        blocks = self._blocks()
        self.kv.start(blocks)
        self.max_model_len = config.pool_max_model_len(blocks * self.block_size)  # set once, here
        self.block_manager = BlockManager(blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
                                   self.max_model_len, self.cfg.eos_token_ids)
        self._build_runner()
        this = weakref.ref(self)  # the parts hold no reference to the engine: dropped, it is freed at once
        self.sleep_wake = SleepWake(self.weight_store, self.kv, self.block_manager, self.scheduler, self.parallel,
                                    self.device, lambda: this()._capture_graphs())
        self.parallel.start(blocks, self.step_buffers)
        self.graph_bytes = 0  # what the decode graphs' memory pool took when captured
        self._capture_graphs()
        self.weight_store.reserve_host_copy()

    def _blocks(self) -> int:
        """The KV pool's block count: what the budget buys here (tensor parallel: the least any rank's buys)."""
        c = self.config
        return self.parallel.agree_blocks(
            lambda: self.kv.blocks_for(kv_budget(c.kv_cache_memory, self.device), c.max_num_seqs, c.max_model_len))

    def _build_runner(self) -> None:
        c, k = self.config, self.config.num_speculative_tokens
        max_blocks = -(-(self.max_model_len + k + 1) // self.block_size)
        max_tokens = max(c.max_num_batched_tokens, c.max_num_seqs * (k + 1))
        self.step_buffers = StepBuffers(max_tokens, c.max_num_seqs, max_blocks, self.device)
        self.runner = self.parallel.runner(self.model, self.ops, self.block_size, self.device, self.step_buffers,
                                           c.use_graphs, self.models.get("draft"), not c.batch_invariant)
        self.speculator = speculative_decoder(self.runner, c.speculation, k, self.cfg.vocab_size, c.use_graphs)
        self.spec_policy = SpeculationPolicy(self.speculator, self.scheduler, k)
        self.loop = GenerationLoop(self.scheduler, self.runner, self.kv, self.spec_policy, self.tokenizer, c.seed,
                                   uses_draft="draft" in self.models, version=lambda store=self.weight_store: store.version)

    def _capture_graphs(self) -> None:
        """(Re-)capture decode graphs; they hold the current addresses of the weights and the pool."""
        self.graph_bytes = max(self.graph_bytes, capture_graphs(self.runner, self.speculator, self.device))

    # ------------------------------------------------------------------ weight sync

    @property
    def weight_version(self) -> int:
        return self.weight_store.version

    @property
    def weight_history(self) -> list[dict]:
        return [dict(update) for update in self.weight_store.history]  # copies: the record is the engine's

    @exclusive
    def update_weights(self, named_tensors, version: int | None = None, model: str = "target",
                       sharded: bool = False) -> int:
        """Copy (Hugging Face name, full tensor) pairs into the engine's weights in place; returns the new version.

        Tensors move in groups of about GROUP_BYTES (a generator is never materialised whole): each tensor of a
        group is checked (name, shape, floating dtype, finite values) before any of the group is copied, so a
        tensor must keep its values until its group is copied (a generator that gathers into one reused buffer
        yields copies). A failure before the first copy leaves the old weights serving; a failure after it marks
        the weights incomplete, and generate() refuses until a complete update or reload. `version` must exceed
        the current one (None: the next). `model="draft"` updates the speculative draft, which carries no version
        (pass None). An update that holds no pairs is refused. With tensor parallelism each rank copies its slice
        of every full tensor (the tensors go to the workers as they arrive).

        `sharded=True` (process_group engines only) skips the slicing: each rank passes its OWN slice of every
        split tensor, the one the engine would cut from the full tensor. Rank r of R holds the r-th of R equal
        contiguous parts, along dimension 0 (rows) for q_proj, k_proj, v_proj, gate_proj, up_proj (weights and
        biases) and an untied lm_head.weight, along dimension 1 (columns) for o_proj.weight and down_proj.weight.
        Every other tensor is passed whole: norms, the embedding, o_proj and down_proj biases. Each tensor's shape
        must be the slice's; a full tensor is refused. A trainer's local shard (FSDP, another TP layout) has the
        slice's shape yet may hold other rows: pass sharded=True only for tensors cut by this rule. With worker
        processes (tensor_parallel_size alone) the caller holds no other rank's slice, and without tensor
        parallelism there is nothing to shard: both refuse it."""
        update = self.parallel.weight_update("update", self.weight_store, sharded=sharded)
        return self._updating(update, named_tensors, version, model, op="update_weights", shown=("sharded", sharded))

    @exclusive
    def update_weights_from_buckets(self, buckets, version: int | None = None, model: str = "target",
                                    sharded: bool = False) -> int:
        """update_weights for transports: each item of `buckets` is one group (a list of (name, tensor) pairs
        or a weights.ReusableGroup), checked whole before any of it is copied and copied before the next
        is asked for, so the transport may then reuse its buffer. `sharded`: as update_weights'."""
        update = self.parallel.weight_update("update_groups", self.weight_store, sharded=sharded)
        return self._updating(update, buckets, version, model, op="update_weights_from_buckets", shown=("sharded", sharded))

    @exclusive
    def update_weights_from_disk(self, path, version: int | None = None, model: str = "target") -> int:
        """update_weights from a safetensors checkpoint directory (same name table); with tensor parallelism every rank
        reads its slices from the directory itself (SPMD: each rank may name its own copy, as for Engine())."""
        update = self.parallel.weight_update("update_from_disk", self.weight_store)
        return self._updating(update, path, version, model, op="update_weights_from_disk", shown=())

    def _updating(self, update, source, version, model, op: str, shown) -> int:
        """update(source, version, model) on every rank (`shown`: the call's other arguments, which every SPMD
        rank must pass alike). KV computed with the old weights is not served again. SPMD: every rank's prefix
        cache is flushed first, inside the agreement; an update that fails on any rank, or whose ranks copied
        different weights, leaves every rank's weights incomplete (where copied) at the version they had."""
        store, flush_first = self.weight_store, self.parallel.flush_every_update
        mark, copies = store.mark(), store.copies
        version = int(version) if is_int(version) else version  # numpy's integers too, as SamplingParams takes

        def run():
            if flush_first:
                self.block_manager.flush()
            return update(source, version, model)
        try:
            return self.parallel.together(op, (version, model, shown), run, lambda _: store.roll_back(mark, model),
                                          ("weight names the update held", lambda _: digest(sorted(store.held))))
        finally:
            if store.copies != copies and not flush_first:
                self.block_manager.flush()

    # ------------------------------------------------------------------ sleep and wake

    @property
    def is_sleeping(self) -> bool:
        return self.kv.asleep or self.weight_store.asleep

    @exclusive
    def sleep(self, level: int = 1, tags=None) -> None:
        """Release the KV pool and the weights (level 1 keeps a host copy of the weights, level 2 discards them).

        Sequences that hold KV are aborted (generate() is synchronous, so none does here; an AsyncEngine
        pauses first); retracted ones, which hold none, wait. The prefix cache is dropped with the pool."""
        self.parallel.together("sleep", (level, tags_key(tags)), lambda: self.sleep_wake.sleep(level, tags))

    @exclusive
    def wake(self, tags=None, allow_resize: bool = False) -> None:
        """Bring back the weights and/or the KV pool (re-carved and re-bound through pool_rows).

        If the device no longer holds the pool's block count, raise NoRoomError naming the bytes (the pool
        stays asleep and a later wake can succeed), or with allow_resize=True carve as many blocks as now
        fit, up to the engine's first count (so a pool an earlier resizing wake shrank grows back): blocks change,
        max_model_len never does (a sequence that fills a smaller pool ends with "length")."""
        # each tenant's wake is agreed inside (where any rank fails, every rank puts it back to sleep); no undo,
        # which would run the sleep's collectives on the ranks that did the wake alone
        self.parallel.together("wake", (tags_key(tags), allow_resize), lambda: self.sleep_wake.wake(tags, allow_resize))

    @exclusive
    def shutdown(self) -> None:
        """Stop the tensor-parallel worker processes (nothing to stop on one device, nor with a process_group, which is
        the caller's); the engine cannot run after (generate, update_weights*, sleep, wake and flush_cache raise
        EngineDeadError). Its memory goes with the last reference to it (`del engine`), as it does when the engine is
        dropped without shutdown()."""
        self.parallel.close()

    @exclusive
    def flush_cache(self) -> None:
        """Drop the prefix cache: no later request is served KV computed before this call."""
        self.parallel.together("flush_cache", (), self.block_manager.flush)

    @exclusive
    def memory_stats(self) -> dict:
        """Bytes the engine holds, by tenant, as it is now (asleep tenants hold none on the device); KV blocks in
        the pool, held by sequences, and prefix-cached (held or free: a cached block no sequence holds is free)."""
        stats = {"kv_cache_bytes": self.kv.nbytes, "kv_blocks": 0 if self.kv.asleep else self.kv.num_blocks,
                 "kv_blocks_used": self.block_manager.num_used, "kv_blocks_cached": self.block_manager.num_cached,
                 "weights_bytes": self.weight_store.nbytes, "cuda_graph_bytes": self.graph_bytes,
                 "step_buffer_bytes": self.step_buffers.nbytes, "host_weights_bytes": self.weight_store.host_nbytes,
                 "speculation_bytes": self.speculator.nbytes if self.speculator is not None else 0,
                 "asleep": sorted(self.sleep_wake.asleep())}
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            stats |= {"device_free_bytes": free, "device_total_bytes": total,
                      "torch_allocated_bytes": torch.cuda.memory_allocated(self.device)}
        return stats

    @exclusive
    def stats(self) -> dict:
        """Counters across calls (they survive sleep and wake): speculative steps, proposed and accepted draft
        tokens, mean acceptance length, preemptions."""
        return self.spec_policy.stats() | {"preemptions": self.scheduler.num_preemptions}

    # ------------------------------------------------------------------ generation

    @exclusive
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, token_budget: int | None = None, time_budget: float | None = None,
                 finish_fraction: float | None = None) -> list[RequestOutput]:
        """Sample `n` completions for each prompt; outputs come back in prompt order.

        A partial rollout: the call stops early once `token_budget` tokens have been generated in it (over all
        samples), `time_budget` seconds have passed (prefill time too), or `finish_fraction` of its samples have
        finished, whichever comes first (each None: no such limit). The step in flight is collected, so the call may
        generate up to two steps' tokens past a budget (a speculative step: up to k + 1 a sample), and a time budget
        waits for the samples being prefilled at its end to get a token (a resume loop whose updates empty the prefix
        cache advances); every sample not finished then ends "abort", keeping its tokens, logprobs and versions.

        A prompt may be such a RequestOutput (from this engine): its "abort" samples continue from their tokens,
        in the same batch as the call's new prompts (queued ahead of them), with its sampling params (pass the
        ones of its first call); its other samples come back as they were, and so does its request_id. Old tokens
        keep their logprobs and versions, max_tokens and the stop conditions count over the whole sample, and
        each sample keeps its seed: under unchanged weights it draws the tokens of an uninterrupted run
        (speculation, by a draft or prompt lookup, at temperature > 0: from the same distribution; fp8 weights:
        up to their activation scales' batch dependence). New weights recompute the old tokens' KV."""
        return self._generate(prompts, sampling_params, use_tqdm, token_budget, time_budget, finish_fraction)

    def _generate(self, prompts, sampling_params, use_tqdm, token_budget, time_budget, finish_fraction):
        call = (token_budget, time_budget, finish_fraction)  # generate's body, chat's too (one exclusive call each)
        prompts, params, resumed, budget = self.parallel.agree(
            "generate", lambda: self._checked_call(prompts, sampling_params, *call),
            lambda checked: call_digest(*checked[:3], call), "prompts, sampling params and budgets")
        if time_budget is not None:  # each rank's clock is its own: the ranks stop at the same step
            budget = self.parallel.agreed_budget(budget)
        requests = {}
        try:
            # Resumed requests whose ids are kept first, so no request given a new id takes one of theirs.
            for i, out in sorted(resumed.items(), key=lambda item: not keeps_request_id(item[1].request_id)):
                seqs = self.loop.resume(out, params[i], keep_id=True)
                waiting = [s for s in seqs if s.finish_reason is None]
                requests[i] = (out.prompt, (waiting or seqs)[0], [s for s in seqs if s.finish_reason is not None])
            for i, ((text, ids), p) in enumerate(zip(prompts, params)):
                if i not in resumed:
                    requests[i] = (text, self.loop.submit(ids, p), [])
            outs = self.loop.run_to_completion([requests[i] for i in range(len(prompts))], use_tqdm, budget)
        except BaseException as err:
            self.loop.abort_all()  # nothing queued or half-run before a Ctrl-C or an error survives the call
            self.parallel.generate_failed(err)
            raise
        for i, out in resumed.items():
            outs[i].request_id = out.request_id
        try:  # the ranks' tokens feed their next steps: a divergence must not pass unseen
            self.parallel.same("generate", lambda: outputs_digest(outs), "sampled tokens", "the same inputs gave "
                               "different tokens: the ranks' devices, kernels or library versions differ")
        except EngineError:
            self.block_manager.flush()  # cached blocks of different tokens would schedule the ranks apart
            raise
        return outs

    def _checked_call(self, prompts, sampling_params, token_budget, time_budget, finish_fraction):
        """generate's arguments, every check made before any state changes: (prompts, params, resumed, budget)."""
        prompts, resumed = resumed_prompts(prompts)
        prompts, params = normalise(prompts, sampling_params, self.tokenizer, self.cfg.vocab_size,
                                    self.scheduler.max_seq_len)
        for i, out in resumed.items():
            check_resumable(out, params[i], self.cfg.vocab_size, self.scheduler.max_seq_len, self.cfg.eos_token_ids)
        budget = RolloutBudget.from_args(token_budget, time_budget, finish_fraction)
        self.parallel.check_alive()  # a dead engine says so first: no update or wake can bring it back
        if asleep := self.sleep_wake.asleep():
            raise EngineAsleepError(f"the engine is asleep ({sorted(asleep)}); call wake() before generate()")
        self.weight_store.check_ready()
        return prompts, params, resumed, budget

    @exclusive  # refused before rendering: a second thread's call touches nothing of the engine's
    def chat(self, conversations, sampling_params=None, tools=None, chat_template_kwargs=None,
             use_tqdm: bool = True, token_budget: int | None = None, time_budget: float | None = None,
             finish_fraction: float | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """generate() over conversations rendered by the chat template straight to token ids (no second BOS), one
        output each, in order; the budgets: generate()'s; the last two: render_chat's (continue a prefilled turn)."""
        prompts, _ = chat_prompts(self.tokenizer, conversations, tools, chat_template_kwargs, add_generation_prompt,
                                  max_seq_len=self.scheduler.max_seq_len, continue_final_message=continue_final_message)
        return self._generate([{"prompt_token_ids": ids} for ids in prompts], sampling_params, use_tqdm,
                              token_budget, time_budget, finish_fraction)

