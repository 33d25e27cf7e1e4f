"""WeightStore: the engine's weights and everything about their state.

It owns loading, in-place updates (checked a group at a time, then copied by one plan), the
weight version and its history, which tensors are stale (discarded by a level-2 sleep, or left
half-updated by a failed update), and the level-1 host copy that a sleep keeps.
"""
from __future__ import annotations

import torch

from .errors import EngineAsleepError, WeightsNotReadyError, add_note
from .memory import DeviceMemory, HostStash
from .shard_staging import ShardStage, incomplete_shards
from .checkpoint_files import iter_files, open_safetensors, read_tensor, safetensors_files, tensor_files
from .weights import (GROUP_BYTES, IGNORED, STAGE_BYTES, ReusableGroup, SteadyGroups, WeightTable, buckets,
                      pairs_signature, same_values, tied_error)

VERSION_LIMIT = 2 ** 63  # outputs carry a weight version as int64
# The safetensors format's dtype names (its header's "dtype"), as torch types.
SAFETENSORS_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
                      "I64": torch.int64, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
                      "F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}


class WeightStore:
    def __init__(self, models: dict, ops, memory: DeviceMemory, check_finite: bool = True):
        self.models, self.ops, self.memory, self.check_finite = models, ops, memory, check_finite
        self.tables = {kind: WeightTable(model) for kind, model in models.items()}
        self.version, self.history = 0, []
        self.stale = self.names()  # (model, name) not loaded yet; generate refuses while any remain
        self.copies = 0  # groups copied so far: an update that copied anything changed what KV the weights give
        self.held: frozenset[str] = frozenset()  # the names the last complete call copied (SPMD ranks compare them)
        self.epoch = 0  # counts moves of the weights' memory: copy plans hold addresses
        self.steady = SteadyGroups()  # update's copy plans, replayed while the same tensors come
        self.token = object()  # in a plan's key: a plan holds this store's addresses, never another's to replay
        self.asleep = False
        self.host: dict[str, torch.Tensor] | None = None  # level-1 copies while asleep
        self.host_buffers: dict[str, torch.Tensor] = {}
        self.shapes: dict[str, torch.Size] = {}
        self.weight_stash, self.buffer_stash = HostStash(), HostStash()

    def names(self, kinds=None) -> set[tuple[str, str]]:
        """(model, HF name) of every weight of the given models (all by default)."""
        return {(kind, n) for kind in (kinds or self.tables) for n in self.tables[kind].names()}

    def parameters(self) -> dict[str, torch.nn.Parameter]:
        return {f"{kind}.{n}": p for kind, m in self.models.items() for n, p in m.named_parameters()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return {f"{kind}.{n}": b for kind, m in self.models.items() for n, b in m.named_buffers()}

    @property
    def nbytes(self) -> int:
        return 0 if self.asleep else sum(p.numel() * p.element_size() for p in self.parameters().values())

    @property
    def host_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.host or {}).values())

    # ------------------------------------------------------------------ loading and updates

    def load(self, sources: dict) -> None:
        """First load: {model kind: iterable of (hf_name, tensor)}; every weight must arrive."""
        for kind, source in sources.items():
            self._copy(buckets(source, GROUP_BYTES), set(), kind)
        if self.stale:
            raise ValueError(f"the checkpoints lack weights: {sorted(self.stale)[:5]}")

    def random_weights(self, kind: str, seed: int):
        """(hf_name, tensor) pairs of random weights (load_format="dummy", for benchmarks): norms 1, else N(0, 0.02)."""
        table = self.tables[kind]
        g = None
        for name in sorted(table.names()):
            dst, shape = table.destination(name), table.full_shape(name)  # full: each rank slices the same tensor
            g = g or torch.Generator(dst.device).manual_seed(seed)
            like = dict(dtype=table.dtype, device=dst.device)  # an fp8 weight is quantized from these
            yield name, (torch.ones(shape, **like) if "norm" in name
                         else torch.empty(shape, **like).normal_(0.0, 0.02, generator=g))

    def _copy(self, groups, copied: set[str], kind: str, sharded: bool = False) -> None:
        """Copy groups of (hf_name, tensor) pairs into model `kind`; `copied` records progress. `sharded`: the
        tensors are this rank's slices (WeightTable.check); a plan checked under the other value is never reused.

        Every tensor of a group is checked before any of it is copied; then the group is copied, on CUDA
        in one launch (a launch per tensor would make the host, not the copies, set the pace). Shards of an
        fp8 layer that a group holds only some of are kept until their siblings come (ShardStage)."""
        key, table = (kind, self.epoch, sharded, self.token), self.tables[kind]
        landed: dict[str, frozenset] = {}  # tied tensors copied by this update's earlier groups: {table key: names}
        given: set[str] = set()  # every name of the update so far: a name twice is refused, in a group or across
        stage = ShardStage(table, self.ops, STAGE_BYTES)
        try:
            for group in groups:
                group = group if isinstance(group, ReusableGroup) else ReusableGroup(list(named_pairs(group)))
                for name, _ in group.pairs:
                    if name in given:
                        raise given_twice(name)
                    given.add(name)
                signature = pairs_signature(group.pairs)
                if group.key != key or signature is None or group.signature != signature:
                    # checked and planned once while the weights and the sources stay where they are
                    group.names, destinations, sources = table.resolve(group.pairs, sharded)
                    group.copy = table.copy_plan(self.ops, group.names, destinations, sources)
                    group.staged = incomplete_shards(table, group.names)
                    group.into, group.tied = table.cast_into(group.pairs), table.tied(group.pairs)
                    group.key, group.signature = key, signature
                # values change on every update: checked every time
                tied_now = table.check_tied(group.pairs, group.tied, landed, sharded)
                if self.check_finite:
                    self._check_finite(group)
                copied.update(group.names)  # before the copy: a copy that fails part way still counts as begun
                self.copies += 1
                with torch.no_grad():  # a trainer's parameters require grad: the engine's copies join no graph
                    group.copy()
                    stage.add(group, sharded)
                landed = tied_now
            with torch.no_grad():
                stage.finish()
        except BaseException:
            stage.drop()  # a caller that keeps the exception keeps this frame, but not the staged copies
            raise
        self.stale -= {(kind, n) for n in copied}

    def _check_finite(self, group: ReusableGroup) -> None:
        """NaN or inf in a source, or a finite value that becomes inf in the engine's dtype: the group is refused."""
        checked = [(n, t, d) for (n, t), d in zip(group.pairs, group.into) if isinstance(t, torch.Tensor)]
        flags = self.ops.nonfinite([t for _, t, _ in checked], [d for _, _, d in checked])
        names = [n for (n, _, _), flag in zip(checked, flags) if flag]
        if names:
            raise ValueError(f"weights {names[:5]} hold NaN or inf values, or values beyond the engine's dtype "
                             "(they would become inf); every weight must be finite. Nothing of their group was copied")

    def update(self, named_tensors, version: int | None, model: str, sharded: bool = False) -> int:
        """Copy (Hugging Face name, full tensor) pairs in place (sharded: this rank's slices); returns the new
        version.

        A group of the same tensors (names, memory, layout) as the last update's is not checked again
        (only its values are): its copy plan runs again (SteadyGroups). The groups are made lazily, so
        update_groups' checks come before any of them."""
        return self.update_groups(self.steady.groups(buckets(named_pairs(named_tensors), GROUP_BYTES), model),
                                  version, model, sharded)

    def check_update(self, version, model: str, sharded: bool = False) -> None:
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or
                                    version >= VERSION_LIMIT):
            raise ValueError(f"version must be None or an int below 2**63 (outputs carry it as int64), got {version!r}")
        if version is None and model == "target" and self.version + 1 >= VERSION_LIMIT:
            raise ValueError(f"version=None is not allowed: the next version, {self.version + 1}, is not below 2**63 "
                             "(outputs carry it as int64); weight_version can grow no further")
        if model not in self.models:
            raise ValueError(f"model={model!r} is not allowed; this engine has {sorted(self.models)}")
        if version is not None and model != "target":  # only the target's updates move weight_version
            raise ValueError(f"version={version} is not allowed with model={model!r}: the draft carries no weight "
                             f"version of its own (weight_version stays {self.version}); pass version=None")
        if version is not None and version <= self.version:
            raise ValueError(f"version={version} is not allowed: versions strictly increase, and the engine's "
                             f"weight_version is {self.version}; pass a larger version or None (next: "
                             f"{self.version + 1})")
        if not isinstance(sharded, bool):
            raise ValueError(f"sharded={sharded!r} is not allowed; a bool")
        if sharded and self.tables[model].ranks == 1:
            raise ValueError("sharded=True is not allowed: this engine has no tensor parallelism, so there is "
                             "nothing to shard; pass the full tensors with sharded=False")
        if self.asleep:
            raise EngineAsleepError("the weights are asleep: wake(tags=['weights']) before update_weights")

    def update_groups(self, groups, version: int | None, model: str, sharded: bool = False) -> int:
        """update() from groups of (name, tensor) pairs, each taken whole before the next is asked for
        (a transport's bucket buffer may be reused then). A failure before the first copy leaves the old
        weights serving; one after it marks the model's weights stale until a complete update."""
        self.check_update(version, model, sharded)
        copied: set[str] = set()
        try:
            self._copy(groups, copied, model, sharded)
        except BaseException as err:
            if copied:
                self._broken(model)  # old and new mixed: refuse to serve until complete
                add_note(err, f"{len(copied)} weight tensors were copied before this: the weights are partly "
                         "updated, and generate() is refused until an update completes them")
            raise
        if not copied:  # most often a generator of pairs already used up by an earlier update
            raise ValueError(f"the update copied nothing: it held no (name, tensor) pairs, or only names that carry "
                             f"nothing to load ({', '.join(IGNORED)} buffers), so weight_version stays "
                             f"{self.version}; a generator of pairs is used up after one update: pass a fresh "
                             "one (e.g. model.named_parameters()) or a list")
        self.held = frozenset(copied)
        if model == "target":
            self.version = self.version + 1 if version is None else version
        self.history.append({"version": self.version, "tensors": len(copied),
                             "complete": copied == self.tables[model].names()}
                            | ({"model": model} if model != "target" else {}))
        return self.version

    def mark(self) -> tuple[int, int]:
        """Where an update starts: the version and the history's length, for roll_back."""
        return self.version, len(self.history)

    def roll_back(self, mark: tuple[int, int], model: str) -> None:
        """An update that failed on another rank: `model`'s weights, copied here, are incomplete, and the version
        this rank took never served, so neither it nor its history entry stays."""
        self._broken(model)
        self.version, entries = mark
        del self.history[entries:]

    def update_from_disk(self, path, version: int | None, model: str) -> int:
        """update() from a checkpoint directory that holds every weight of `model`: the files' headers (names,
        shapes, dtypes) are checked against the engine's weights before any tensor is copied, so a checkpoint
        with a gap, a tensor of another shape or dtype (or a tied tensor given two values) is refused while the old
        weights serve at the old version."""
        self.check_update(version, model)
        files = safetensors_files(path)
        located, table = tensor_files(files), self.tables[model]  # {tensor name: its file}
        missing = table.uncovered(located)  # unknown names raise here
        if missing:
            raise ValueError(f"checkpoint {str(path)!r} lacks {len(missing)} of the engine's {len(table.names())} "
                             f"weights: {missing[:5]}; an update from disk replaces every weight, so a checkpoint "
                             "must hold them all. Nothing was copied")
        check_headers(files, table, path)
        for alias, target in table.aliases.items():  # in different files, they may come in different groups
            if alias in located and target in located and not same_values(read_tensor(located[target], target),
                                                                           read_tensor(located[alias], alias)):
                raise ValueError(tied_error(target, alias, f"checkpoint {str(path)!r}") + ". Nothing was copied")
        return self.update(iter_files(files), version, model)

    def check_ready(self) -> None:
        if self.stale:
            kinds = sorted({kind for kind, _ in self.stale})  # the model kinds ("target", "draft") that need it
            per_kind = " and ".join(f"model={kind!r}" for kind in kinds)
            raise WeightsNotReadyError(
                f"{len(self.stale)} weight tensors are discarded or partly updated (e.g. "
                f"{' '.join(sorted(self.stale)[0])!r}); call update_weights with a complete set or "
                f"update_weights_from_disk first, with {per_kind}")

    # ------------------------------------------------------------------ sleep and wake

    def reserve_host_copy(self) -> None:
        """Page-lock the level-1 host copy in the background (after graph capture: no allocation may overlap)."""
        self.weight_stash.reserve({n: p.data for n, p in self.parameters().items()})

    def sleep(self, level: int) -> None:
        if self.asleep:  # already released: level 2 discards what a level-1 sleep kept, level 1 changes nothing
            if level == 2:
                self.host = None
                self._discard()
            return
        params = self.parameters()
        if level == 1:
            self.host = self.weight_stash.save({n: p.data for n, p in params.items()})
        # Buffers (the rotary table) are derived, not loaded: they survive either level (but fp8 scales, which
        # a level-2 discard zeroes with their weights: _discard).
        self.host_buffers = self.buffer_stash.save(self.buffers())
        if self.memory.keeps_addresses:
            self.memory.pause("weights")
        else:
            self.shapes = {n: p.shape for n, p in params.items()}
            for p in params.values():
                p.data = p.data.new_empty(0)
            self.epoch += 1  # the weights move: copy plans made before no longer hold
        if level == 2:
            self._discard()
        self.asleep = True

    def _broken(self, model: str) -> None:
        """An update failed after its first copy: `model` serves nothing until every weight comes again, and its fp8
        scales (Fp8Linear.LOADED), a mix of old and failed, are zeroed: the next update quantizes as a fresh load."""
        self.stale |= self.names([model])
        for buffer in (getattr(m, b) for m in self.models[model].modules() for b in getattr(m, "LOADED", ())):
            buffer.zero_()

    def _discard(self) -> None:
        """Level 2: the weights are gone, and so is what describes them (an fp8 weight's scales, Fp8Linear.LOADED):
        the next update finds them as a fresh engine's first does, not steered by weights it no longer holds."""
        self.stale = self.names()
        if self.memory.device.type == "cuda":  # the stash's copies (non-blocking) land before the zeroing, not after
            torch.cuda.synchronize(self.memory.device)
        for kind, model in self.models.items():
            for name, module in model.named_modules():
                for buffer in getattr(module, "LOADED", ()):
                    self.host_buffers[f"{kind}.{name}.{buffer}"].zero_()

    def wake(self, device: torch.device) -> bool:
        """Bring the weights back; True if they moved to new addresses."""
        params = self.parameters()
        if self.memory.keeps_addresses:
            self.memory.resume("weights")
        else:
            with self.memory.region("weights"):
                for n, p in params.items():
                    p.data = torch.empty(self.shapes[n], dtype=p.dtype, device=device)
        if self.host is not None:
            for n, p in params.items():
                p.data.copy_(self.host[n], non_blocking=True)
        for n, b in self.buffers().items():
            b.copy_(self.host_buffers[n], non_blocking=True)
        # the host copies go only once every copy is in: a wake that fails part way can be tried again
        self.host, self.host_buffers = None, {}
        self.asleep = False
        return not self.memory.keeps_addresses


def check_headers(files, table: WeightTable, path) -> None:
    """Every tensor of `files` checked as an update checks it (WeightTable.check), from its header's shape and
    dtype alone: no tensor is read. Copies go a group at a time, so a tensor refused only in its own group
    would leave the groups before it copied and the engine refusing to serve."""
    for file in files:
        with open_safetensors(file) as f:
            for hf_name in f.keys():
                name = table.canonical(hf_name)
                if name is None:
                    continue
                header = f.get_slice(hf_name)
                dtype, shape = header.get_dtype(), header.get_shape()
                where = f"checkpoint {str(path)!r}, file {file.name}"
                if hf_name != name:  # an alias: the check names the engine's tensor
                    where += f", tensor {hf_name!r}"
                if dtype not in SAFETENSORS_DTYPES:
                    raise ValueError(f"{where}: weight {hf_name!r} has dtype {dtype}, which the engine cannot take; "
                                     "a weight must be a floating-point tensor. Nothing was copied")
                like = torch.empty((), dtype=SAFETENSORS_DTYPES[dtype]).expand(shape)  # its shape and dtype, no data
                try:
                    table.check(name, like)
                except ValueError as err:
                    raise ValueError(f"{where}: {err}. Nothing was copied") from None


def given_twice(name: str, arg: str = "named_tensors") -> ValueError:
    return ValueError(f"{arg} gives weight {name!r} twice; each name once")


def named_pairs(named_tensors, arg: str = "named_tensors"):
    """The (name, tensor) pairs of an update, each checked to be one: a bare tensor or a dict is refused, and so is
    a name given twice (which copy would serve would depend on how the update is cut into buckets)."""
    if isinstance(named_tensors, (torch.Tensor, str, bytes)):
        raise ValueError(f"{arg} must be an iterable of (name, tensor) pairs, got a "
                         f"{type(named_tensors).__name__}")
    if isinstance(named_tensors, dict):
        named_tensors = named_tensors.items()
    try:
        items = iter(named_tensors)
    except TypeError:
        raise ValueError(f"{arg} must be an iterable of (name, tensor) pairs, got "
                         f"{type(named_tensors).__name__}") from None
    names = set()
    for item in items:
        if not (isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str)):
            shown = f"a tensor of shape {tuple(item.shape)}" if isinstance(item, torch.Tensor) else repr(item)[:80]
            raise ValueError(f"{arg} must yield (name, tensor) pairs, got {shown}")
        if item[0] in names:
            raise given_twice(item[0], arg)
        names.add(item[0])
        yield item
