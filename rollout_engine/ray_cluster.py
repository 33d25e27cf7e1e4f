"""Where a pool's actors go on Ray: a self-started Ray on loopback only, and the checks that refuse a pool
Ray could never place (on a one-node Ray no autoscaler adds what is missing)."""
from __future__ import annotations

import math
import numbers
import os
import time

import ray
from ray.util.placement_group import PlacementGroup, placement_group_table

from .errors import EngineError


def check_pool_args(num_engines, engine_kwargs, num_gpus_per_engine, placement_group) -> None:
    """EnginePool's arguments, each refused by name before Ray is asked for anything."""
    if not isinstance(num_engines, int) or isinstance(num_engines, bool) or num_engines < 1:
        raise ValueError(f"num_engines={num_engines!r} is not allowed; an int >= 1")
    if not isinstance(engine_kwargs, dict) or "model_path" not in engine_kwargs:
        raise ValueError(f"engine_kwargs={engine_kwargs!r} is not allowed; a dict of Engine arguments with "
                         f"'model_path'")
    if (not isinstance(num_gpus_per_engine, numbers.Real) or isinstance(num_gpus_per_engine, bool)
            or not math.isfinite(num_gpus_per_engine) or num_gpus_per_engine < 0):  # NaN fails no "< 0"
        raise ValueError(f"num_gpus_per_engine={num_gpus_per_engine!r} is not allowed; a finite number >= 0")
    tp = engine_kwargs.get("tensor_parallel_size") or 1
    if num_gpus_per_engine and isinstance(tp, int) and tp > num_gpus_per_engine:  # a GPU for each rank
        raise ValueError(f"tensor_parallel_size={tp} needs num_gpus_per_engine={tp}, not {num_gpus_per_engine!r}")
    if placement_group is not None and not isinstance(placement_group, PlacementGroup):
        raise ValueError(f"placement_group={placement_group!r} is not allowed; a Ray PlacementGroup "
                         "(ray.util.placement_group(...)) with a bundle per engine, or None")
    if placement_group is not None and placement_group.bundle_count < num_engines:
        raise ValueError(f"placement_group has {placement_group.bundle_count} bundles; one per engine "
                         f"({num_engines}) is needed")


def init_local_ray(**kwargs) -> None:
    """Start a single-node Ray in this process whose servers (GCS, raylet, workers, object manager) listen on
    127.0.0.1 only. On Linux Ray otherwise binds every interface at the node's routable address; its
    loopback mode (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, the default on macOS and Windows) is read when ray is
    imported, so it is switched on here for the call. Refuses (and stops Ray) if Ray came up elsewhere."""
    from ray._private import ray_constants

    cluster_mode, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(address="local", include_dashboard=False, _node_ip_address="127.0.0.1", **kwargs)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = cluster_mode
    if not _on_loopback():
        address = ray.get_runtime_context().gcs_address
        ray.shutdown()
        raise EngineError(f"Ray started at {address}, not on loopback; start it yourself with ray.init(...)")


def absolute_paths(engine_kwargs: dict) -> dict:
    """engine_kwargs with model_path and draft_model ("[ngram]" aside) made absolute: an actor's directory is Ray's."""
    out = dict(engine_kwargs)
    for key in ("model_path", "draft_model"):
        value = out.get(key)
        if isinstance(value, (str, os.PathLike)) and not str(value).startswith("["):
            out[key] = os.path.abspath(value)
    return out


def _on_loopback() -> bool:
    """Whether this Ray's servers listen on loopback: one node, as init_local_ray starts it (no autoscaler can
    add one, so what does not fit now never will)."""
    return ray.get_runtime_context().gcs_address.startswith("127.0.0.1:")


def check_room(num_engines: int, num_gpus: float, wait_s: float,
               placement_group: PlacementGroup | None = None) -> None:
    """On a Ray whose servers listen on loopback (one node, as init_local_ray starts it: no autoscaler can add
    one), actors that do not all fit would wait for resources forever: refused, naming what is short. What
    other actors hold counts too; resources of actors being killed may come free within `wait_s` seconds.
    With `placement_group` (placed), on any Ray: the same for engine i in bundle i (check_bundles)."""
    if placement_group is not None:
        return check_bundles(placement_group, num_engines, num_gpus, wait_s)
    if not _on_loopback():
        return  # a cluster: its autoscaler may add nodes
    needs = (("CPU", num_engines, f"num_engines={num_engines}"),
             ("GPU", num_engines * num_gpus, f"num_gpus_per_engine={num_gpus}"))
    have = ray.cluster_resources()
    for resource, need, arg in needs:
        if _short(need, have, resource):
            cpu = " (num_gpus_per_engine=0: engines on the CPU)" if resource == "GPU" else ""
            raise ValueError(f"{arg} is not allowed here: {num_engines} engine(s) need {need} {resource} (1 CPU and "
                             f"num_gpus_per_engine GPUs each) and this node's Ray has {have.get(resource, 0)}{cpu}")
    deadline = time.monotonic() + wait_s
    while short := [n for n in needs if _short(n[1], ray.available_resources(), n[0])]:
        if time.monotonic() >= deadline:
            resource, need, arg = short[0]
            raise ValueError(f"{arg} is not allowed now: {num_engines} engines need {need} {resource} and only "
                             f"{ray.available_resources().get(resource, 0)} of this node's {have.get(resource, 0)} "
                             f"are free (other actors hold the rest); shut down what holds them, or ask for less")
        time.sleep(0.1)


def check_scheduled(actors: list, num_gpus: float, wait_s: float) -> None:
    """Actors that Ray has not placed within `wait_s` seconds are refused rather than waited for forever: on a Ray
    that is not this module's loopback one (ray.init() at the host's address, or a cluster), check_room leaves what
    does not fit to an autoscaler, which may not exist. Placing takes a worker process, not the model's load."""
    ready = [actor.__ray_ready__.remote() for actor in actors]
    _, pending = ray.wait(ready, num_returns=len(ready), timeout=wait_s)
    if pending:
        raise ValueError(f"num_engines={len(actors)} is not allowed here: {len(pending)} engine(s) were not placed "
                         f"within {wait_s:g} s; each needs 1 CPU and num_gpus_per_engine={num_gpus} GPUs, and this Ray "
                         f"has {ray.cluster_resources()} in all, {ray.available_resources()} free (for an autoscaler "
                         f"that adds nodes slowly, raise rollout_engine.ray_pool.SCHEDULE_WAIT_S)")


def _short(need: float, have: dict, resource: str) -> bool:
    return need > have.get(resource, 0) + 1e-6  # Ray counts GPU fractions to 1e-4: 3 x 0.1 is 0.3


def check_placed(placement_group: PlacementGroup, wait_s: float) -> None:
    """On a Ray whose servers listen on loopback (one node: no autoscaler can add one), a placement group that is
    not placed (its bundles fit on no node) would hold the pool's actors back forever: refused after
    `wait_s` seconds. On a cluster an autoscaler may take longer to place it."""
    if not _on_loopback():
        return
    if not placement_group.wait(wait_s):
        raise ValueError(f"placement_group is not allowed: it was not placed within {wait_s} s (bundles "
                         f"{placement_group.bundle_specs}); pass one whose bundles the cluster can hold, or None")


def check_bundles(placement_group: PlacementGroup, num_engines: int, num_gpus: float, wait_s: float) -> None:
    """Engine i takes 1 CPU and `num_gpus` GPUs of bundle i. A bundle that holds less never takes it, and one whose
    resources other actors hold (a trainer colocated in it) keeps it waiting until they leave, which no autoscaler
    hastens: refused, the second after `wait_s` seconds. Only scheduling is bounded this way, before any engine
    exists; an engine's start (loading its model) may take minutes. A group not placed yet (a cluster's autoscaler
    at work) has no bundle resources to read: unchecked. Its state is read from the GCS table: wait() with a
    timeout under a second may answer False for a placed group."""
    if placement_group_table(placement_group).get("state") != "CREATED":
        return
    needs = {"CPU": 1, "GPU": num_gpus} if num_gpus else {"CPU": 1}
    for i, spec in enumerate(placement_group.bundle_specs[:num_engines]):
        if any(_short(need, spec, resource) for resource, need in needs.items()):
            raise ValueError(f"placement_group is not allowed: bundle {i} holds {spec} and engine {i} needs {needs} "
                             f"(1 CPU and num_gpus_per_engine GPUs of its bundle)")
    deadline = time.monotonic() + wait_s
    while taken := _taken_bundles(placement_group, needs, num_engines):
        if time.monotonic() >= deadline:
            raise ValueError(f"placement_group is not allowed now: each engine needs {needs} of its bundle (engine i "
                             f"in bundle i) and bundle(s) {sorted(taken)} have only {taken} free after {wait_s} s "
                             f"(other actors in the group hold the rest); shut down what holds them, or pass a "
                             f"group with a free bundle per engine")
        time.sleep(0.1)


def _taken_bundles(placement_group: PlacementGroup, needs: dict, count: int) -> dict[int, dict]:
    """Bundle index -> its free resources, for each of the first `count` bundles without room for `needs`. Ray
    counts a placed bundle's resources as "{resource}_group_{index}_{group id}"; one fully taken is absent."""
    free, group = ray.available_resources(), placement_group.id.hex()
    have = [{r: free.get(f"{r}_group_{i}_{group}", 0) for r in needs} for i in range(count)]
    return {i: h for i, h in enumerate(have) if any(_short(need, h, r) for r, need in needs.items())}
