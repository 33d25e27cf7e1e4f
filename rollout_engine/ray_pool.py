"""EnginePool: data parallelism on Ray. One Engine per Ray actor; a batch is spread over the engines.

    pool = EnginePool(2, {"model_path": path, "kv_cache_memory": 0.5})   # one GPU each
    outs = pool.generate(prompts, SamplingParams(n=8, max_tokens=512))   # in the caller's order
    pool.sleep(); ...train...; pool.wake(); sync_weights(pool, model)   # trainer_adapters; or pool.update_weights

Requests go to engines by expected tokens (prompt tokens + n x max_tokens), largest first, each to the
engine with the least so far. A request without a seed gets `sample_seed(pool seed, request index)`,
where the index counts the pool's requests from 0 across calls and the pool seed is engine_kwargs' "seed"
(default 0): the engine's own default, so a pool's outputs equal those of one fresh Engine given the same
calls, whichever engine ran each request, and request_id is that index (a resumed RequestOutput keeps its
own, and the next indices go past it, as in one Engine). Not with speculative decoding (a
draft_model or "[ngram]") at temperature > 0: whether a step speculates depends on the batch, which differs
between the pool's engines and one engine, and a speculative step draws its tokens differently, so a seeded
sample is drawn from the same distribution, not the same tokens (greedy samples keep theirs). Nor exactly with
fp8 weights: a step quantizes its activations over one scale for its whole batch, so logprobs (and tokens at
near-ties) move with the batch.

Weights from the driver go through Ray's object store: put once in buckets, read by every actor (host
memory of each node; across nodes Ray copies each bucket to every node that reads it).

An EnginePool serves one thread at a time, as an Engine does and by the same guard (exclusive.py): a public
call made while another thread's runs raises EngineBusyError at once and changes nothing, rather than waiting
on a lock. Each call takes the next request ids and the seeds derived from them, so two at once would share
them; refused, a caller that shares the pool among threads learns it on the first overlap.

If Ray is not initialised, the pool starts a single-node Ray whose servers listen on loopback only (see
`init_local_ray`); to use a cluster, call ray.init(address=...) first. A dead engine actor makes the call
that meets it raise EngineDeadError naming the engine; shut the pool down and build a new one.
"""
from __future__ import annotations

import os
import threading

import torch

try:
    import ray
    from ray.exceptions import RayActorError, RayTaskError
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
except ImportError as err:  # the optional extra
    raise ImportError("rollout_engine.ray_pool needs Ray: pip install 'rollout-engine[ray]'") from err

from .errors import EngineDeadError, EngineError
from .exclusive import exclusive
from .partial import RolloutBudget
from .pool_plan import balance, engine_budgets, expected_tokens, numbered, requests, update_version
from .ray_cluster import (absolute_paths, check_placed, check_pool_args, check_room, check_scheduled,  # noqa: F401
                          init_local_ray)
from .sampling_params import SamplingParams
from .weight_store import named_pairs

BUCKET_BYTES = 256 << 20  # one object-store object per bucket of weights
ROOM_WAIT_S = 5  # how long a new pool waits for resources (its bundles' too) held by killed actors (a pool shut down)
PLACEMENT_WAIT_S = 30  # how long a new pool waits for its placement_group to be placed (raise it for a slow autoscaler)
SCHEDULE_WAIT_S = 300  # how long a new pool waits for Ray to place its actors (raise it for a slow autoscaler)
CANCEL_WAIT_S = 30  # how long an interrupted call waits for its engines to stop their parts (one step each)


class EngineActor:
    """The Engine in one Ray actor's process. It is built by start() rather than __init__, so that a bad
    argument comes back as the Engine's own exception rather than as a dead actor."""

    def start(self, engine_kwargs: dict) -> int:
        from .engine import Engine

        self.engine = Engine(**engine_kwargs)
        return self.engine.weight_version

    def generate(self, prompts: list, params: list, budget: tuple) -> list:
        """The engine's generate; the call stops after the step in which the pool cancels this task (a Ray
        with RuntimeContext.is_canceled, from late 2025, flags a running sync actor task; an older one runs
        the task to its end)."""
        self.engine.loop.cancelled = getattr(ray.get_runtime_context(), "is_canceled", None)
        try:
            return self.engine.generate(prompts, params, False, *budget)
        finally:
            self.engine.loop.cancelled = None

    def call(self, name: str, *args, **kwargs):
        """An Engine method's result, or a property's value."""
        attr = getattr(self.engine, name)
        return attr(*args, **kwargs) if callable(attr) else attr

    def update_weights(self, bucket_refs: list, version: int | None, model: str) -> int:
        """Each bucket is fetched when the engine asks for it, so the actor holds about one at a time."""
        return self.engine.update_weights((pair for ref in bucket_refs for pair in ray.get(ref)), version, model)

    def check_update(self, version: int | None, model: str) -> None:
        self.engine.weight_store.check_update(version, model)  # awake, the version, the model: before any bytes

    def check_model(self, shapes: dict, config: dict | None) -> None:
        self.engine.weights.check_model(shapes, config)


class EnginePool:
    def __init__(self, num_engines: int, engine_kwargs: dict, num_gpus_per_engine: float = 1,
                 placement_group=None):
        """`num_engines` Ray actors, each an `Engine(**engine_kwargs)` (model_path required, readable on every node).
        Each takes 1 CPU and `num_gpus_per_engine` GPUs (0: a CPU engine; a fraction shares a GPU with a trainer
        worker; tensor_parallel_size=N needs N). With `placement_group`, engine i runs on its bundle i (each holds
        {"CPU": 1, "GPU": num_gpus_per_engine} or more, that much free); else Ray's scheduler places them."""
        check_pool_args(num_engines, engine_kwargs, num_gpus_per_engine, placement_group)
        if not ray.is_initialized():
            init_local_ray()
        if placement_group is not None:
            check_placed(placement_group, PLACEMENT_WAIT_S)
        check_room(num_engines, num_gpus_per_engine, ROOM_WAIT_S, placement_group)
        self.seed = engine_kwargs.get("seed", 0)
        self.next_request = 0
        self._lock, self._running = threading.RLock(), None  # what exclusive() reads (a call from inside a call too)
        self.actors = [self._actor(i, num_gpus_per_engine, placement_group) for i in range(num_engines)]
        try:
            check_scheduled(self.actors, num_gpus_per_engine, SCHEDULE_WAIT_S)
            self._gather([actor.start.remote(absolute_paths(engine_kwargs)) for actor in self.actors])
        except BaseException:
            self.shutdown()
            raise

    @staticmethod
    def _actor(index: int, num_gpus: float, placement_group):
        options = dict(num_cpus=1, num_gpus=num_gpus, max_restarts=0)
        if placement_group is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(placement_group, index)
        return ray.remote(EngineActor).options(**options).remote()

    def __len__(self) -> int:
        return len(self.actors)

    def __enter__(self) -> EnginePool:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _check_open(self) -> None:
        if not self.actors:
            raise EngineError("the pool is shut down; build a new EnginePool")

    def shutdown(self) -> None:
        """Kill every engine actor (their GPUs are free afterwards). Ray itself keeps running. Not one call at a
        time: it may come from another thread or a signal handler while a call runs (that call then raises
        EngineDeadError), and a second shutdown does nothing."""
        actors, self.actors = self.actors, []
        for actor in actors:
            ray.kill(actor, no_restart=True)

    # ------------------------------------------------------------------ fan-out

    def _gather(self, refs: list, engines: list[int] | None = None, cancel_on_error: bool = False) -> list:
        """The results of one call on each of `engines` (default: all; refs in the same order), in that order.
        A dead actor raises EngineDeadError at once; an error raised by an engine is re-raised (its own
        class, its message prefixed with the engine) once every engine has answered, or with
        `cancel_on_error` (their results would be thrown away) once the others are cancelled (`_cancel`: stopped
        after their current step, on a Ray with RuntimeContext.is_canceled)."""
        self._check_open()
        engines, size = list(range(len(refs))) if engines is None else engines, len(self.actors)
        name = lambda i: f"engine {engines[i]} of the pool's {size}"  # noqa: E731
        results, errors, pending = {}, {}, list(refs)
        while pending:
            (ref,), pending = ray.wait(pending, num_returns=1)
            i = refs.index(ref)
            try:
                results[i] = ray.get(ref)
            except RayActorError as err:
                if not self.actors:  # shutdown() ran while this call waited
                    raise EngineDeadError("the pool was shut down while this call ran; build a new one") from err
                raise EngineDeadError(f"{name(i)} is dead (its Ray actor is gone); shut the pool down and build "
                                      f"a new one. Ray says: {err}") from err
            except RayTaskError as err:
                errors[i] = err
                if cancel_on_error:
                    _cancel(pending)
                    pending = []
        if errors:
            i, err = min(errors.items())
            cause, others = err.cause, [engines[j] for j in sorted(results)]
            prefix = name(i) + (f" (engines {others} succeeded)" if others else "")
            if cause.args and isinstance(cause.args[0], str):
                cause.args = (f"{prefix}: {cause.args[0]}", *cause.args[1:])
            raise cause from None
        return [results[i] for i in range(len(refs))]

    def _fan_out(self, name: str, *args, **kwargs) -> list:
        return self._gather([actor.call.remote(name, *args, **kwargs) for actor in self.actors])

    @exclusive
    def sleep(self, level: int = 1, tags=None) -> None:
        self._fan_out("sleep", level, tags)

    @exclusive
    def wake(self, tags=None, allow_resize: bool = False) -> None:
        self._fan_out("wake", tags, allow_resize)

    @exclusive
    def flush_cache(self) -> None:
        self._fan_out("flush_cache")

    @property
    @exclusive  # it asks every actor, whose calls queue behind a running one: refused at once, as the others
    def weight_version(self) -> int:
        """The engines' common weight version; EngineError if they differ (an update failed on some)."""
        return self._common("weight_version", "update the pool's weights again (a version of None goes past every "
                                              "engine's)")

    @property
    @exclusive
    def is_sleeping(self) -> bool:
        """Whether the engines sleep, as Engine.is_sleeping; EngineError if some do and some do not (a sleep or
        wake failed on some)."""
        return self._common("is_sleeping", "call sleep() or wake() on the pool again")

    def _common(self, name: str, remedy: str):
        """The one value of an Engine property on every engine: a pool reads as one engine or not at all."""
        values = self._fan_out(name)
        if len(set(values)) != 1:
            raise EngineError(f"the engines' {name} differ: {dict(enumerate(values))}; {remedy}")
        return values[0]

    @exclusive
    def memory_stats(self) -> list[dict]:
        return self._fan_out("memory_stats")

    @exclusive
    def check_model(self, shapes: dict, config: dict | None = None) -> None:
        """ValueError unless a model's parameters, {Hugging Face name: whole shape}, are the engines' weights and its
        config (a transformers config's dict) computes their function, as trainer_adapters.sync.check_model_fits checks
        an Engine. The engines are built alike: the first checks."""
        self._check_open()
        self._gather([self.actors[0].check_model.remote(shapes, config)], engines=[0])

    def _next_version(self, version: int | None, model: str) -> int | None:
        """The version every engine is given (pool_plan.update_version); a draft's update carries none."""
        return update_version(self._fan_out("weight_version"), version) if model == "target" else version

    @exclusive
    def update_weights(self, named_tensors, version: int | None = None, model: str = "target") -> int:
        """Engine.update_weights on every engine with the same version (None: the highest engine's + 1); returns it.
        named_tensors as Engine takes them (pairs or a dict), refused with its ValueErrors; `model="draft"`
        updates the speculative draft (no version, as Engine's). Tensors are copied to host memory in buckets of
        about BUCKET_BYTES and each bucket is put into the object store once; every engine reads every bucket (the
        whole update is in the object store at once: host memory for one copy of the weights, spilled past it)."""
        version = self._next_version(version, model)
        self._gather([actor.check_update.remote(version, model) for actor in self.actors])  # asleep: nothing is put
        refs = [ray.put(bucket) for bucket in _host_buckets(named_pairs(named_tensors))]
        return self._agreed(self._gather([actor.update_weights.remote(refs, version, model)
                                          for actor in self.actors]))

    @exclusive
    def update_weights_from_disk(self, path, version: int | None = None, model: str = "target") -> int:
        """Engine.update_weights_from_disk on every engine (the path must be readable on every node)."""
        path = os.path.abspath(path) if isinstance(path, (str, os.PathLike)) else path  # the actors' cwd is Ray's
        return self._agreed(self._fan_out("update_weights_from_disk", path, self._next_version(version, model),
                                          model))

    @staticmethod
    def _agreed(versions: list[int]) -> int:
        if len(set(versions)) != 1:  # every engine was given the same explicit version: not an assert, which -O drops
            raise EngineError(f"the engines' weight versions differ after the update: {dict(enumerate(versions))}")
        return versions[0]

    # ------------------------------------------------------------------ generation

    @exclusive
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 token_budget: int | None = None, time_budget: float | None = None,
                 finish_fraction: float | None = None) -> list:
        """Engine.generate over the pool: outputs in prompt order, request_id = the pool's request index.

        A prompt may be a RequestOutput with "abort" samples (from this pool, or from one Engine built with the
        same seed): as with Engine.generate it continues them with its own sampling params and request_id, so
        each sample keeps its seed; the pool's later request ids go past every resumed id, as an Engine's do.

        The budgets mean what they mean for Engine.generate, spent per engine on its share of the requests:
        `token_budget` (tokens generated in this call, over the pool) is split over the engines that run
        requests, in proportion to their shares' expected tokens (prompt + n x max_tokens), each engine getting
        at least 1; each engine stops on its own part, so the pool may stop with tokens left in one engine's
        part, and exceeds the budget by up to two steps of every engine. `time_budget` applies to every engine
        from when it starts the call. `finish_fraction` applies to every engine's own samples, so at least
        that fraction of the call's samples finishes. Every sample still running then ends with "abort".

        Refused (EngineError naming each engine's version) when the engines' weight versions differ, as one
        call's outputs would mix them. Interrupted (Ctrl-C), the call cancels its engines' parts: each stops
        after its current step and drops the call's samples (with a Ray that has RuntimeContext.is_canceled; an older
        one lets them run to their end, and the pool's next call waits for that), and the call raises, having
        changed nothing."""
        self._check_open()
        actors = self.actors  # a shutdown from another thread rebinds self.actors: this call's stay as they were
        prompts, params = requests(prompts, sampling_params)
        budget = RolloutBudget.from_args(token_budget, time_budget, finish_fraction)
        self._common("weight_version", "generate() does not mix them in one call; send a complete update with a "
                                       "higher version to all of them")
        ids, params, next_request = numbered(prompts, params, self.seed, self.next_request)
        loads = [expected_tokens(q, p) for q, p in zip(prompts, params)]
        busy = [(engine, share) for engine, share in enumerate(balance(loads, len(actors))) if share]
        budgets = engine_budgets(budget, [sum(loads[i] for i in share) for _, share in busy])
        refs = [actors[e].generate.remote([prompts[i] for i in share], [params[i] for i in share], part)
                for (e, share), part in zip(busy, budgets)]
        try:
            per_engine = self._gather(refs, [e for e, _ in busy], cancel_on_error=True)
        except BaseException:
            _cancel(refs)  # a Ctrl-C, or an engine gone: nobody reads the others' work
            raise
        self.next_request = next_request
        outputs = [None] * len(prompts)
        for (_, share), outs in zip(busy, per_engine):
            for i, out in zip(share, outs):
                out.request_id = out.request_id if ids[i] is None else ids[i]
                outputs[i] = out
        return outputs


def _cancel(refs: list) -> None:
    """Cancel a call's tasks and wait (at most CANCEL_WAIT_S) for those already running to stop, so the engines
    are free for the pool's next call."""
    for ref in refs:
        try:
            ray.cancel(ref)
        except Exception:  # noqa: BLE001 - a task of an actor that is gone: nothing to stop
            pass
    ray.wait(refs, num_returns=len(refs), timeout=CANCEL_WAIT_S)


def _host_buckets(pairs):
    """(name, host tensor) lists of about BUCKET_BYTES each, counted in the bytes that go to the object store.
    A value that is not a tensor goes as it is: the engines refuse it with their own ValueError."""
    bucket, size = [], 0
    for name, tensor in pairs:
        if isinstance(tensor, torch.Tensor):
            tensor = _own_storage(tensor.detach().to("cpu"))
            size += tensor.numel() * tensor.element_size()
        bucket.append((name, tensor))
        if size >= BUCKET_BYTES:
            yield bucket
            bucket, size = [], 0
    if bucket:
        yield bucket


def _own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor in a storage of exactly its own bytes. Pickling a tensor pickles its whole storage, so a view
    of a larger buffer (FSDP flat parameters, a fused qkv split by chunk()) would send that whole buffer once
    per view; contiguous() alone keeps such a view when it is contiguous."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size():
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)
