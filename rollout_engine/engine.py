"""Engine: the public entry point. Loads a checkpoint, owns the single KV pool, generates."""
from __future__ import annotations

import weakref
from pathlib import Path

import torch
from tqdm.auto import tqdm

from kernels import get_ops
from pool_layout import aligned_empty, positive_int

from .block_manager import BlockManager
from .config import ModelConfig
from .errors import EngineAsleepError, NoRoomError, WeightsNotReadyError
from .kv_cache import KVCache, available_bytes, kv_budget
from .memory import TAGS, DeviceMemory, HostStash, default_dtype
from .model import CausalLM
from .model_runner import ModelRunner, pure_decode
from .outputs import CompletionOutput, RequestOutput
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence, Status
from .spec_decode import NGRAM, SPEC_MAX_BATCH, DraftModelProposer, NgramProposer, SpecState, SpeculativeDecoder
from .step_buffers import StepBuffers
from .weights import GROUP_BYTES, ReusableGroup, SteadyGroups, WeightTable, buckets, iter_safetensors


def _sample_seed(base: int, index: int) -> int:
    """Seed of sample `index` of a request: a function of the request's seed only, never of the batch."""
    return hash((base, index)) & 0x7FFFFFFF


class Engine:
    def __init__(self, model_path, device=None, dtype="auto", kv_cache_memory=0.3, max_num_seqs=256,
                 max_model_len=None, block_size=16, enable_prefix_caching=True, draft_model=None,
                 num_speculative_tokens=0, tensor_parallel_size=1, seed=0, max_num_batched_tokens=None,
                 kv_cache_dtype=None, enforce_eager=False, load_format="safetensors"):
        if tensor_parallel_size != 1:
            raise ValueError(f"tensor_parallel_size={tensor_parallel_size} is not supported yet; allowed: 1")
        if draft_model is None and num_speculative_tokens:
            raise ValueError("num_speculative_tokens needs a draft_model")
        if draft_model is not None:
            positive_int(num_speculative_tokens, "num_speculative_tokens (with a draft_model)")
        if load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format={load_format!r} is not allowed; 'safetensors' or 'dummy' (random weights)")
        self.model_path = Path(model_path)
        self.cfg = ModelConfig.from_dir(self.model_path, need_weights=load_format == "safetensors")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = self._resolve_dtype(dtype)
        self.block_size = positive_int(block_size, "block_size")
        self.max_num_seqs = positive_int(max_num_seqs, "max_num_seqs")
        limit = min(self.cfg.max_position_embeddings, self.cfg.sliding_window or self.cfg.max_position_embeddings)
        self.max_model_len = positive_int(max_model_len or limit, "max_model_len")
        if self.max_model_len > limit:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds what the model supports ({limit})")
        self.seed, self._next_request = seed, 0
        self.tokenizer = self._load_tokenizer()
        self.ops = get_ops(self.device)
        self.memory = DeviceMemory(self.device)
        weakref.finalize(self, self.memory.close)  # also at interpreter exit
        self._asleep: set[str] = set()
        self.graph_bytes = 0  # what the decode graphs' memory pool took when captured
        self._host_weights: dict[str, torch.Tensor] | None = None  # level-1 copies while asleep
        self._weight_stash, self._buffer_stash = HostStash(), HostStash()

        paths = {"target": self.model_path}
        configs = {"target": self.cfg}
        if draft_model is not None and draft_model != NGRAM:
            paths["draft"] = Path(draft_model)
            configs["draft"] = ModelConfig.from_dir(paths["draft"], need_weights=load_format == "safetensors")
            if configs["draft"].vocab_size != self.cfg.vocab_size:
                raise ValueError(f"draft_model vocabulary ({configs['draft'].vocab_size}) differs from the "
                                 f"target's ({self.cfg.vocab_size}); a draft must share the target's vocabulary")
        self.num_speculative_tokens = num_speculative_tokens
        with self.memory.region("weights"):
            self.models = {kind: self._build_model(cfg) for kind, cfg in configs.items()}
        self.model = self.models["target"]
        self.tables = {kind: WeightTable(model) for kind, model in self.models.items()}
        self.weights = self.tables["target"]
        self.weight_version, self.weight_history = 0, []
        self._stale = self._names()  # (model, name) not yet loaded; generate refuses while any remain
        self._weights_epoch = 0  # counts moves of the weights' memory (ReusableGroup plans hold addresses)
        self._steady = SteadyGroups()  # update_weights' copy plans, replayed while the same tensors come
        for kind, path in paths.items():
            source = iter_safetensors(path) if load_format == "safetensors" else self._random_weights(kind)
            self._load(buckets(source, GROUP_BYTES), set(), kind)
        if self._stale:
            raise ValueError(f"checkpoints {[str(p) for p in paths.values()]} lack weights: {sorted(self._stale)[:5]}")

        kv_dtype = self.dtype if kv_cache_dtype is None else kv_cache_dtype
        self.kv = KVCache(self.models, self.block_size, kv_dtype, self.device)
        self.enable_prefix_caching = enable_prefix_caching
        self.max_num_batched_tokens = positive_int(
            max_num_batched_tokens or (8192 if self.device.type == "cuda" else 2048), "max_num_batched_tokens")
        self._kv_buf = None
        self._carve(self.kv.blocks_for(kv_budget(kv_cache_memory, self.device), self.max_num_seqs, self.max_model_len))
        max_blocks = -(-(self.max_model_len + num_speculative_tokens + 1) // self.block_size)
        max_tokens = max(self.max_num_batched_tokens, self.max_num_seqs * (num_speculative_tokens + 1))
        self.step_buffers = StepBuffers(max_tokens, self.max_num_seqs, max_blocks, self.device)
        use_graphs = self.device.type == "cuda" and not enforce_eager
        self.runner = ModelRunner(self.model, self.ops, self.block_size, self.device, self.step_buffers, use_graphs,
                                  self.models.get("draft"))
        self.speculator = None
        if draft_model is not None:
            state, k, vocab = SpecState(self.runner), num_speculative_tokens, self.cfg.vocab_size
            proposer = (NgramProposer(self.runner, state, k, vocab) if draft_model == NGRAM
                        else DraftModelProposer(self.runner, state, k, vocab, use_graphs))
            self.speculator = SpeculativeDecoder(self.runner, state, proposer, k, use_graphs)
        self.spec_stats = {"steps": 0, "proposed": 0, "accepted": 0}
        self._capture_graphs()
        # Page-lock the level-1 host copy in the background; after capture, which no allocation may overlap.
        self._weight_stash.reserve({n: p.data for n, p in self._parameters().items()})

    def _capture_graphs(self) -> None:
        """(Re-)capture decode graphs; they hold the current addresses of the weights and the pool."""
        if self.runner.graphs is None:
            return
        before = torch.cuda.memory_reserved(self.device)
        self.runner.capture()
        if self.speculator is not None:
            self.speculator.capture()
        self.graph_bytes = max(self.graph_bytes, torch.cuda.memory_reserved(self.device) - before)

    def _random_weights(self, kind: str):
        """(hf_name, tensor) pairs of random weights (load_format="dummy", for benchmarks): norms 1, else N(0, 0.02)."""
        g = torch.Generator(self.device).manual_seed(self.seed)
        for name in sorted(self.tables[kind].names()):
            dst = self.tables[kind].destination(name)
            if "norm" in name:
                yield name, torch.ones_like(dst)
            else:
                yield name, torch.empty_like(dst).normal_(0.0, 0.02, generator=g)

    def _carve(self, blocks: int) -> None:
        """Carve the pool (in a fresh buffer unless a paused one is being resumed), bind it, size the scheduler."""
        if self._kv_buf is None:
            with self.memory.region("kv_cache"):
                self._kv_buf = aligned_empty(self.kv.planner.total_bytes(blocks), self.device)
        self.kv.allocate(blocks, buf=self._kv_buf)
        # One sequence must always fit, or preemption could never make room for it.
        self.max_model_len = min(self.max_model_len, blocks * self.block_size)
        self.block_manager = BlockManager(blocks, self.block_size, self.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, self.max_num_seqs, self.max_num_batched_tokens,
                                   self.max_model_len, self.cfg.eos_token_ids)

    # ------------------------------------------------------------------ construction

    def _resolve_dtype(self, dtype) -> torch.dtype:
        if dtype == "auto":
            return self.cfg.dtype if self.device.type == "cuda" else torch.float32
        allowed = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
        resolved = allowed.get(dtype, dtype) if isinstance(dtype, str) else dtype
        if resolved not in allowed.values():
            raise ValueError(f"dtype={dtype!r} is not supported; allowed: 'auto', {sorted(allowed)}")
        return resolved

    def _load_tokenizer(self):
        if not any((self.model_path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(str(self.model_path))

    def _build_model(self, cfg: ModelConfig) -> CausalLM:
        with default_dtype(self.dtype), torch.device(self.device):
            return CausalLM(cfg, self.ops, self.max_model_len)

    def _names(self, kinds=None) -> set[tuple[str, str]]:
        """(model, HF name) of every weight of the given models (all by default)."""
        return {(kind, n) for kind in (kinds or self.tables) for n in self.tables[kind].names()}

    def _parameters(self) -> dict[str, torch.nn.Parameter]:
        return {f"{kind}.{n}": p for kind, m in self.models.items() for n, p in m.named_parameters()}

    def _buffers(self) -> dict[str, torch.Tensor]:
        return {f"{kind}.{n}": b for kind, m in self.models.items() for n, b in m.named_buffers()}

    def _load(self, groups, copied: set[str], kind: str = "target") -> None:
        """Copy groups of (hf_name, tensor) pairs into model `kind`; `copied` records progress.

        Every tensor of a group is checked before any of it is copied; then the group is copied, on CUDA
        in one launch (a launch per tensor would make the host, not the copies, set the pace)."""
        key = (kind, self._weights_epoch)
        for group in groups:
            group = group if isinstance(group, ReusableGroup) else ReusableGroup(group)
            if group.key != key:  # checked and planned once while the weights stay where they are
                group.names, destinations, sources = self.tables[kind].resolve(group.pairs)
                group.copy, group.key = self.ops.copy_plan(destinations, sources), key
            copied.update(group.names)  # before the copy: a copy that fails part way still counts as begun
            group.copy()
        self._stale -= {(kind, n) for n in copied}

    # ------------------------------------------------------------------ weight sync

    def update_weights(self, named_tensors, version: int | None = None, model: str = "target") -> int:
        """Copy (Hugging Face name, full tensor) pairs into the engine's weights in place; returns the new version.

        Tensors move in groups of about GROUP_BYTES (a generator is never materialised whole): each
        tensor of a group is checked (name, shape, floating dtype) before any of the group is copied.
        A failure before the first copy leaves the old weights serving; a failure after it marks
        the weights incomplete, and generate() refuses until a complete update or reload.
        `model="draft"` updates the speculative draft (weight_version tracks the target only).
        A group of the same tensors (names, memory, layout) as the last update's is not checked again:
        its copy plan runs again (SteadyGroups)."""
        return self._update_groups(self._steady.groups(buckets(named_tensors, GROUP_BYTES), model), version, model)

    def _update_groups(self, groups, version: int | None, model: str) -> int:
        """update_weights from groups of (name, tensor) pairs; transports pass one group per received bucket,
        so a bucket's buffer is reused only after the whole group was copied."""
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be None or an int >= 0, got {version!r}")
        if model not in self.models:
            raise ValueError(f"model={model!r} is not allowed; this engine has {sorted(self.models)}")
        if "weights" in self._asleep:
            raise EngineAsleepError("the weights are asleep: wake(tags=['weights']) before update_weights")
        copied: set[str] = set()
        try:
            self._load(groups, copied, model)
        except BaseException:
            if copied:
                self._stale |= self._names([model])  # old and new mixed: refuse to serve until complete
            raise
        finally:
            if copied:
                self.flush_cache()  # KV computed with the old weights must not be served again
        if copied:
            if model == "target":
                self.weight_version = self.weight_version + 1 if version is None else version
            self.weight_history.append({"version": self.weight_version, "tensors": len(copied),
                                        "complete": copied == self.tables[model].names()}
                                       | ({"model": model} if model != "target" else {}))
        return self.weight_version

    def update_weights_from_disk(self, path, version: int | None = None, model: str = "target") -> int:
        """update_weights from a safetensors checkpoint directory (same name table)."""
        return self.update_weights(iter_safetensors(path), version, model)

    # ------------------------------------------------------------------ sleep and wake

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def _tags(self, tags) -> set[str]:
        tags = set(TAGS if tags is None else [tags] if isinstance(tags, str) else tags)
        if not tags or not tags <= set(TAGS):
            raise ValueError(f"tags={sorted(tags)} is not allowed; tags are a non-empty subset of {list(TAGS)}")
        return tags

    def sleep(self, level: int = 1, tags=None) -> None:
        """Release the KV pool and the weights (level 1 keeps a host copy of the weights, level 2 discards them).

        generate() is synchronous, so no request is in flight here; anything an interrupted
        call left behind is aborted. The prefix cache is dropped with the pool."""
        if level not in (1, 2):
            raise ValueError(f"level={level!r} is not allowed; 1 (offload weights to host) or 2 (discard them)")
        tags = self._tags(tags) - self._asleep
        self.scheduler.abort_all()
        if "kv_cache" in tags:
            self.block_manager.flush()
            self.kv.release()  # every module drops its views
            if self.memory.keeps_addresses:
                self.memory.pause("kv_cache")  # the buffer keeps its addresses for wake
            else:
                self._kv_buf = None
            self._asleep.add("kv_cache")
        if "weights" in tags:
            params = self._parameters()
            if level == 1:
                self._host_weights = self._weight_stash.save({n: p.data for n, p in params.items()})
            # Buffers (the rotary table) are derived, not loaded: they survive either level.
            self._host_buffers = self._buffer_stash.save(self._buffers())
            if self.memory.keeps_addresses:
                self.memory.pause("weights")
            else:
                self._weight_shapes = {n: p.shape for n, p in params.items()}
                for p in params.values():
                    p.data = p.data.new_empty(0)
                self._weights_epoch += 1  # the weights move: copy plans made before no longer hold
            if level == 2:
                self._stale = self._names()
            self._asleep.add("weights")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def wake(self, tags=None, allow_resize: bool = False) -> None:
        """Bring back the weights and/or the KV pool (re-carved and re-bound through pool_rows).

        If the device no longer holds the pool's block count, raise NoRoomError naming the bytes
        (the engine stays asleep and a later wake can succeed), or with allow_resize=True carve
        as many blocks as now fit."""
        tags = self._tags(tags) & self._asleep
        if "weights" in tags:
            params = self._parameters()
            if self.memory.keeps_addresses:
                self.memory.resume("weights")
            else:
                with self.memory.region("weights"):
                    for n, p in params.items():
                        p.data = torch.empty(self._weight_shapes[n], dtype=p.dtype, device=self.device)
            if self._host_weights is not None:
                for n, p in params.items():
                    p.data.copy_(self._host_weights[n], non_blocking=True)
                self._host_weights = None
            for n, b in self._buffers().items():
                b.copy_(self._host_buffers.pop(n), non_blocking=True)
            self._asleep.discard("weights")
        moved = bool(tags) and not self.memory.keeps_addresses
        if "kv_cache" in tags:
            moved |= self._wake_kv(allow_resize)
        if moved and not self._asleep:
            self._capture_graphs()  # the graphs hold the old addresses
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _wake_kv(self, allow_resize: bool) -> bool:
        """Re-carve and re-bind the pool; True if it moved to a new buffer."""
        blocks = self.block_manager.num_blocks
        need, free = self.kv.planner.total_bytes(blocks), available_bytes(self.device)
        if need > free:
            if not allow_resize:
                raise NoRoomError(f"waking the KV pool needs {need} bytes for {blocks} blocks but only {free} bytes "
                                  "are free; free memory and wake again, or wake(allow_resize=True)")
            if free < self.kv.planner.total_bytes(1):
                raise NoRoomError(f"even one KV block needs {self.kv.planner.total_bytes(1)} bytes; {free} are free")
            blocks = self.kv.planner.blocks_for_budget(free)
            self._kv_buf = None  # a smaller buffer, at new addresses
            self.memory.forget("kv_cache")
        elif self._kv_buf is not None:
            self.memory.resume("kv_cache")
        moved = self._kv_buf is None
        self._carve(blocks)
        self._asleep.discard("kv_cache")
        return moved

    def flush_cache(self) -> None:
        """Drop the prefix cache: no later request is served KV computed before this call."""
        self.block_manager.flush()

    def memory_stats(self) -> dict:
        """Bytes the engine holds, by tenant, as it is now (asleep tenants hold none on the device)."""
        weight_bytes = sum(p.numel() * p.element_size() for p in self._parameters().values())
        stats = {
            "kv_cache_bytes": 0 if "kv_cache" in self._asleep else self.kv.nbytes,
            "kv_blocks": 0 if "kv_cache" in self._asleep else self.kv.num_blocks,
            "weights_bytes": 0 if "weights" in self._asleep else weight_bytes,
            "cuda_graph_bytes": self.graph_bytes,
            "step_buffer_bytes": self.step_buffers.nbytes,
            "speculation_bytes": self.speculator.nbytes if self.speculator is not None else 0,
            "host_weights_bytes": sum(t.numel() * t.element_size() for t in (self._host_weights or {}).values()),
            "asleep": sorted(self._asleep),
        }
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            stats |= {"device_free_bytes": free, "device_total_bytes": total,
                      "torch_allocated_bytes": torch.cuda.memory_allocated(self.device)}
        return stats

    # ------------------------------------------------------------------ generation

    def _prompt_ids(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; this checkpoint has none: pass token ids")
            ids = self.tokenizer(prompt)["input_ids"]
            text = prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise ValueError("prompt is empty; every prompt needs at least one token")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside [0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves room "
                             f"for at most {self.max_model_len - 1} prompt tokens")
        return text, ids

    def _normalise(self, prompts, sampling_params):
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a str, a list of token ids, or a non-empty list of either")
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts) or not all(isinstance(p, SamplingParams) for p in params):
            raise ValueError("sampling_params must be one SamplingParams or a list with one per prompt")
        if self.tokenizer is None and any(p.stop for p in params):
            raise ValueError("stop strings need a tokenizer; this checkpoint has none: use stop_token_ids")
        return [self._prompt_ids(p) for p in prompts], params

    def _check_ready(self) -> None:
        if self._asleep:
            raise EngineAsleepError(f"the engine is asleep ({sorted(self._asleep)}); call wake() before generate()")
        if self._stale:
            raise WeightsNotReadyError(
                f"{len(self._stale)} weight tensors are discarded or partly updated (e.g. {' '.join(sorted(self._stale)[0])!r}); "
                "call update_weights with a complete set or update_weights_from_disk first")

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Sample `n` completions for each prompt; outputs come back in prompt order."""
        prompts, params = self._normalise(prompts, sampling_params)  # all validation before any state changes
        self._check_ready()
        requests = []
        for (text, ids), p in zip(prompts, params):
            base = p.seed if p.seed is not None else hash((self.seed, self._next_request)) & 0x7FFFFFFF
            seeds = [_sample_seed(base, j) for j in range(p.n)]
            seq = Sequence(self._next_request, 0, ids, p, seeds[0], tuple(seeds[1:]))
            seq.uses_draft = "draft" in self.models
            requests.append((text, seq))
            self.scheduler.add(seq)
            self._next_request += 1
        total = sum(p.n for p in params)
        finished: dict[int, list[Sequence]] = {seq.request_id: [] for _, seq in requests}
        bar = tqdm(total=total, desc="generate", disable=not use_tqdm or total < 64, unit="sample")
        try:
            for seq in self._run():
                finished[seq.request_id].append(seq)
                bar.update(1)
        except BaseException:
            self.scheduler.abort_all()  # nothing half-run survives into the next call
            raise
        finally:
            bar.close()
        return [self._output(text, seq, finished[seq.request_id]) for text, seq in requests]

    def _run(self):
        """Run steps until no work is left, yielding sequences as they finish.

        A pure decode step is launched before the previous one's tokens are read (its newest tokens are
        copied on the device), so the host's bookkeeping between steps overlaps the GPU's step."""
        launched = None
        while launched is not None or self.scheduler.has_work():
            if launched is None:
                batch = self.scheduler.schedule()
                if batch.block_copies:
                    src, dst = zip(*batch.block_copies)
                    self.kv.planner.copy_blocks(list(src), list(dst))
                if not pure_decode(batch) or self._may_speculate(batch):
                    yield from self._speculate(batch) if self._can_speculate(batch) else self._step(batch)
                    continue
                launched = self.runner.launch(batch)
            # Stop launching ahead once the batch is small enough to speculate (the draft catches up then).
            ahead = None if self._may_speculate(launched.batch) else self.scheduler.schedule_ahead(launched.batch)
            following = self.runner.launch(ahead, after=launched) if ahead is not None else None
            yield from self._finished(self.scheduler.postprocess(launched.batch, self.runner.collect(launched)))
            launched = following

    def _step(self, batch):
        """One synchronous step (prefill or mixed work); yields the sequences it finished."""
        # The draft follows prefills only while speculation can come soon (a small running set).
        follows = "draft" in self.models and len(self.scheduler.running) <= SPEC_MAX_BATCH
        yield from self._finished(self.scheduler.postprocess(batch, self.runner.step(batch, draft_follows=follows)))

    def _speculate(self, batch):
        """Speculative steps over one batch, yielding the sequences they finish. While the batch stays the
        same and its proposer works on the device, each step is launched before the last one's tokens are
        read (SpecState carries the sequences forward on the device): the host's bookkeeping overlaps the
        GPU's step. A step launched for a sequence that the step before finished is dropped for it."""
        spec, k = self.speculator, self.num_speculative_tokens
        spec.start(batch.seqs)
        launched = spec.launch(batch.seqs)
        while launched is not None:
            following = spec.launch(batch.seqs) if self._may_launch_ahead(batch) else None
            results = spec.collect(launched)
            live = [r for s, r in zip(batch.seqs, results) if s.status is not Status.FINISHED]
            self.spec_stats["steps"] += 1
            self.spec_stats["proposed"] += k * len(live)
            self.spec_stats["accepted"] += sum(accepted for _, _, accepted in live)
            yield from self._finished(self.scheduler.postprocess_speculative(batch, results, k))
            launched = following

    def _may_launch_ahead(self, batch) -> bool:
        """Whether the next speculative step over `batch` may go before this one's tokens are read: its
        proposer works on the device and the scheduler has nothing else to run (Scheduler.speculate_ahead)."""
        return self.speculator.proposer.on_device and self.scheduler.speculate_ahead(batch, self.num_speculative_tokens)

    def _finished(self, grown: list[Sequence]) -> list[Sequence]:
        for seq in grown:
            if seq.params.stop:  # also when the step finished it: a stop string may come before its end
                self._check_stop_strings(seq)
        return [seq for seq in grown if seq.finish_reason is not None]

    def _may_speculate(self, batch) -> bool:
        """Small batches whose proposer has something to propose. Asked also of a step launched ahead,
        whose newest tokens are not appended yet: its answer then lags one token, which only delays."""
        return (self.speculator is not None and len(batch.seqs) <= SPEC_MAX_BATCH
                and self.speculator.proposer.wants(batch.seqs))

    def _can_speculate(self, batch) -> bool:
        """Speculate on small, decode-only batches that have room for k more tokens."""
        k = self.num_speculative_tokens
        seqs = batch.seqs
        if not self._may_speculate(batch) or max(batch.num_tokens) > 1:
            return False
        if any(s.num_samples > 1 or len(s) + k > self.max_model_len for s in seqs):
            return False
        return all(self.block_manager.grow(s, k + 1) for s in seqs)  # blocks taken here are used later anyway

    def stats(self) -> dict:
        """Counters across calls: speculative steps, proposed and accepted draft tokens, mean acceptance length."""
        spec = self.spec_stats
        k = self.num_speculative_tokens
        # tokens a sequence emits per speculative step: its accepted drafts plus the correction or bonus token
        per_step = 1 + spec["accepted"] * k / spec["proposed"] if spec["proposed"] else 0.0
        return {"spec_steps": spec["steps"], "spec_proposed": spec["proposed"], "spec_accepted": spec["accepted"],
                "mean_acceptance_length": per_step, "preemptions": self.scheduler.num_preemptions}

    def _check_stop_strings(self, seq: Sequence) -> None:
        """End `seq` at its first stop string: the text before it, and the tokens up to the one that completed
        it (a speculative step emits several at once; the ones after it are dropped with their logprobs).

        A new match can only end in the newest text, so a step decodes a window: its new tokens and enough
        before them to hold the longest stop string (a character is at most 4 tokens, and 4 more cover a
        token split at the window's edge). The whole text is decoded only on a hit."""
        if self.tokenizer is None:
            return
        stops, out = seq.params.stop, seq.output_ids
        back = 4 * max(map(len, stops)) + 4
        first_new, seq.stop_checked = seq.stop_checked, len(out)
        if not self._holds_stop(out[max(0, first_new - back) :], stops):
            return
        end = next((e for e in range(first_new + 1, len(out) + 1)  # the token that completed the stop string
                    if self._holds_stop(out[max(0, e - back) : e], stops)), len(out))
        text = self.tokenizer.decode(out[:end], skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s in text]
        if not hits:  # the window's edge made a match the whole text does not have
            return
        seq.text = text[: min(hits)]
        del seq.token_ids[seq.num_prompt_tokens + end :], seq.logprobs[end:]
        if seq.finish_reason is None:
            self.scheduler.finish(seq, "stop")
        seq.finish_reason = "stop"

    def _holds_stop(self, tokens, stops) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in stops)

    def _output(self, text, first: Sequence, seqs: list[Sequence]) -> RequestOutput:
        completions = []
        for seq in sorted(seqs, key=lambda s: s.index):
            if seq.text is None and self.tokenizer is not None:
                seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            completions.append(CompletionOutput(seq.index, seq.output_ids, seq.logprobs if seq.params.logprobs else None,
                                                seq.text, seq.finish_reason))
        metrics = {"num_cached_tokens": first.num_cached}
        if self.speculator is not None:
            metrics |= {"spec_proposed": sum(s.spec_proposed for s in seqs),
                        "spec_accepted": sum(s.spec_accepted for s in seqs)}
        return RequestOutput(first.request_id, text, first.token_ids[: first.num_prompt_tokens], completions,
                             self.weight_version, metrics)
