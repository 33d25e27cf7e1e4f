"""Hugging Face parameter names -> the engine's (fused) parameters: ONE table for loading and weight sync.

An fp8 weight (model.Fp8Linear) is a destination like any other, but its plan quantizes the group's tensors for it
with the one scale its shards share (ops.quantize_shards_plan, all the group's fp8 layers at once): the shards that
arrive in one group are quantized once, with a scale computed over all of them first (a layer an update brings in
several groups is quantized again once whole: shard_staging.ShardStage)."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch

from rollout_kernels.copies import CopyPlan, in_turn

from .model import CausalLM, Fp8Linear

# (engine module, shard) that each Hugging Face projection fills.
FUSED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
HF_NAME_OF_SHARD = {dst: hf for hf, dst in FUSED.items()}
IGNORED = ("rotary_emb.inv_freq",)
IGNORED_MAX_BYTES = 1 << 20  # a bucket's ignored buffers (rotary inv_freq: head_dim / 2 values a layer) at most
QUANTIZABLE_SOURCES = (torch.float32, torch.float16, torch.bfloat16)  # what an fp8 weight is quantized from
UPDATE_SOURCES = (torch.float64, *QUANTIZABLE_SOURCES)  # what any other weight is cast from
GROUP_BYTES = 1 << 30  # update_weights checks, then copies, this much at a time (one launch each on CUDA)
STAGE_BYTES = GROUP_BYTES  # at most this much of an update's fp8 shards kept for their siblings (ShardStage)
ALIGN = 256  # bytes; where each tensor of a packed bucket starts


def padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def buckets(named_tensors, bucket_bytes: int):
    """Group (name, tensor) pairs into lists of at most `bucket_bytes` (a larger tensor goes alone)."""
    group, size = [], 0
    for name, tensor in named_tensors:
        # numel x itemsize, not nbytes: a sparse tensor has none, and reaches the check that refuses it
        nbytes = tensor.numel() * tensor.element_size() if isinstance(tensor, torch.Tensor) else 0
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += padded(nbytes)
    if group:
        yield group


@dataclass(eq=False)
class ReusableGroup:
    """A group of (name, tensor) pairs that a transport may pass again unchanged: same names, same source
    memory. The engine keeps the group's checked names and copy plan on it, and uses them again while `key`
    (model kind, weights epoch, sharded, the store) and `signature` (the pairs' names, addresses and layouts)
    still hold, so a steady update skips the checks and table building."""

    pairs: list
    names: list[str] = field(default_factory=list)
    copy: CopyPlan | None = None
    key: tuple | None = None
    signature: tuple | None = None
    into: list = field(default_factory=list)  # WeightTable.cast_into of the planned pairs
    tied: list[tuple[int, str]] = field(default_factory=list)  # WeightTable.tied of the planned pairs
    staged: list[str] = field(default_factory=list)  # shard_staging.incomplete_shards of the planned names

    @property
    def keepable(self) -> bool:
        """Planned, and the plan holds no tensor: keeping it between updates keeps nobody's memory alive."""
        return self.copy is not None and self.copy.rest is None


def pairs_signature(pairs) -> tuple | None:
    """What a copy plan depends on: names, and each tensor's address and layout (None: not all tensors)."""
    try:
        return tuple((name, t.data_ptr(), t.get_device(), t.dtype, t.shape, t.stride()) for name, t in pairs)
    except (AttributeError, TypeError, RuntimeError):  # not all tensors, or one without storage (sparse)
        return None


class SteadyGroups:
    """update_weights' groups by position. A trainer sends the same parameters after every step, updated in place:
    a group whose names and tensors (address and layout) are the last update's at its position comes back as that
    ReusableGroup, whose plan copies what those addresses hold now. Only plans that hold no tensor are kept (not
    those with a cast or a strided tensor, which reference it), so the caller's tensors never stay alive here."""

    def __init__(self):
        self.last: dict[tuple[str, int], ReusableGroup] = {}

    def groups(self, groups, kind: str):
        for position, pairs in enumerate(groups):
            group = self.last.pop((kind, position), None) or ReusableGroup([])
            group.pairs = pairs  # planned again by the store unless its signature is the plan's
            try:
                yield group
            finally:
                group.pairs = []
            if group.keepable and group.signature is not None:
                self.last[kind, position] = group


class WeightTable:
    """Every Hugging Face name the model takes, and the engine tensor view it lands in."""

    def __init__(self, model: CausalLM):
        modules = dict(model.named_modules())
        tp = model.tp
        self.rank, self.ranks = (0, 1) if tp is None else (tp.rank, tp.size)
        # Tensor parallel: name -> the dimension of the full Hugging Face tensor this rank takes its slice of
        # (absent: the tensor is replicated whole). Column-parallel weights and biases split rows; row-parallel
        # weights split columns and keep their bias whole.
        self.splits: dict[str, int] = {}
        # name -> (parameter, the rows it fills or None for all). Parameters are re-pointed by sleep/wake
        # (param.data = ...), never replaced, so holding them spares a module attribute lookup per tensor;
        # rows are a slice because basic indexing makes a view faster than narrow().
        self.slots: dict[str, tuple[torch.nn.Parameter, slice | None]] = {}
        self.fp8: dict[str, tuple[Fp8Linear, object]] = {}  # fp8 weights: (their layer, their shard)
        for param_name, param in model.named_parameters():
            module_name, _, attr = param_name.rpartition(".")
            module = modules[module_name]
            head, _, leaf = module_name.rpartition(".")
            for shard, rows in getattr(module, "shards", {None: None}).items():
                hf_leaf = HF_NAME_OF_SHARD.get((leaf, shard), leaf)
                name = f"{head}.{hf_leaf}.{attr}" if head else f"{hf_leaf}.{attr}"
                whole = rows is None or rows == (0, param.shape[0])
                self.slots[name] = (param, None if whole else slice(rows[0], rows[0] + rows[1]))
                split = getattr(module, "split", None)
                if split == 0 or (split == 1 and attr == "weight"):
                    self.splits[name] = split
                if attr == "weight" and isinstance(module, Fp8Linear):
                    self.fp8[name] = (module, shard)
        self.shapes = {name: torch.Size([size * (self.ranks if self.splits.get(name) == dim else 1) for dim, size
                                         in enumerate(self.destination(name).shape)]) for name in self.slots}
        self.dtype = model.model.embed_tokens.weight.dtype  # the engine's dtype: what updates arrive in
        # Tied embeddings: a trainer's state dict may carry lm_head.weight as well; it is the same tensor.
        self.aliases = {"lm_head.weight": "model.embed_tokens.weight"} if model.cfg.tie_word_embeddings else {}
        self.config = model.cfg  # what a model's config is compared with (check_model)

    def names(self) -> set[str]:
        return set(self.slots)

    def canonical(self, hf_name: str) -> str | None:
        """The table key for `hf_name`, or None for names that carry nothing to load."""
        if hf_name in self.slots:
            return hf_name
        if hf_name.endswith(IGNORED):
            return None
        name = self.aliases.get(hf_name, hf_name)
        if name not in self.slots:
            near = difflib.get_close_matches(name, list(self.slots), n=3, cutoff=0.6) or sorted(self.slots)[:3]
            raise ValueError(f"unknown weight name {hf_name!r}; nearest known names: {near}")
        return name

    def uncovered(self, hf_names) -> list[str]:
        """The table keys none of `hf_names` fills (an alias fills its tensor), sorted: what a whole update that
        names only these would leave old. An unknown name raises, as canonical."""
        return sorted(self.names() - {self.canonical(name) for name in hf_names})

    def check_whole(self, hf_names, what: str) -> None:
        """ValueError unless `hf_names` fill every weight (uncovered): `what` ("the update", "the model") is then
        a whole model's weights. A model that ties lm_head to its embedding has no lm_head.weight, which an
        untied engine holds: its old head would serve with the new model."""
        missing = self.uncovered(hf_names)
        if missing:
            tied = (" A model that ties lm_head to its embedding has no lm_head.weight, which this engine holds of its "
                    "own (tie_word_embeddings differs): load the engine from a checkpoint of the model's config."
                    if "lm_head.weight" in missing else "")
            raise ValueError(f"{what} has {len(set(hf_names))} tensors but none for {len(missing)} of the engine's "
                             f"weights (e.g. {missing[:3]}), which would stay old.{tied}")

    def check_model(self, shapes: dict, config: dict | None = None) -> None:
        """ValueError unless a model's parameters, {Hugging Face name: whole shape}, are the engine's weights: each
        name known and of the engine's shape, every weight filled (check_whole), and an lm_head.weight beside the
        embedding only where the engine holds one (an untied model's head would overwrite the tied embedding; a tied
        model lists their one tensor once, under either name); and that its `config` (a transformers config's dict,
        if given) computes the same function (ModelConfig.check_same_function)."""
        for name, shape in shapes.items():
            slot = self.canonical(name)  # an unknown name: ValueError
            if slot is not None and tuple(shape) != tuple(self.full_shape(slot)):
                raise ValueError(f"the model's parameter {name!r} has shape {tuple(shape)}; the engine's weight is "
                                 f"{tuple(self.full_shape(slot))}")
        if {"lm_head.weight", "model.embed_tokens.weight"} <= shapes.keys() and "lm_head.weight" in self.aliases:
            raise ValueError("the model has an lm_head.weight of its own, which the engine ties to its embedding "
                             "(tie_word_embeddings differs): load the engine from a checkpoint of the model's config")
        self.check_whole(shapes, "the model")
        if config is not None:
            self.config.check_same_function(config)

    def cast_into(self, pairs) -> list:
        """Per pair, the dtype its floating source is copied into (the finite check flags a value that becomes
        inf there: float32 past 3.3961e38 into bfloat16, float64 past float32's range, anything past 65504 into
        float16), or None: fp8 destinations are scaled by their quantizer, other sources are refused anyway."""
        into = []
        for hf_name, source in pairs:
            name = self.canonical(hf_name)
            dtype = self.slots[name][0].dtype if name is not None else None
            floating = isinstance(source, torch.Tensor) and source.is_floating_point()
            into.append(dtype if floating and dtype is not None and dtype.itemsize > 1 else None)
        return into

    def tied(self, pairs) -> list[tuple[int, str]]:
        """(index, table key) of the pairs that name a tied tensor, under its own name or its alias."""
        targets = set(self.aliases.values())
        return [(i, self.aliases.get(n, n)) for i, (n, _) in enumerate(pairs) if self.aliases.get(n, n) in targets]

    def check_tied(self, pairs, tied, landed: dict[str, frozenset], sharded: bool = False) -> dict[str, frozenset]:
        """Refuse an update whose names of one tied tensor end with different values (one would silently be lost).
        `landed`: {table key: the names whose latest value the destination holds}; returned updated."""
        agreeing, latest = dict(landed), {}
        for i, name in tied:
            latest.setdefault(name, {})[pairs[i][0]] = pairs[i][1]  # a name given twice keeps its last value
        for name, values in latest.items():
            (first, value), *rest = values.items()
            for other, tensor in rest:  # both names in this group
                if not same_values(value, tensor):
                    raise ValueError(tied_error(first, other, "this update"))
            others = agreeing.get(name, frozenset()) - values.keys()  # theirs is an earlier group's copy
            if others and not same_values(self.destination(name), value if sharded else self.rank_slice(name, value)):
                raise ValueError(tied_error(min(others), first, "this update"))
            agreeing[name] = others | values.keys()
        return agreeing

    def destination(self, name: str) -> torch.Tensor:
        param, rows = self.slots[name]
        return param if rows is None else param[rows]

    def full_shape(self, name: str) -> torch.Size:
        """The Hugging Face tensor's shape, recorded at load (asleep, the destination holds nothing)."""
        return self.shapes[name]

    def rank_slice(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full Hugging Face tensor (the tensor itself where it is replicated): rank r of
        R takes the r-th of R equal contiguous parts along dimension `splits[name]`."""
        dim = self.splits.get(name)
        if dim is None:
            return tensor
        size = tensor.shape[dim] // self.ranks
        return tensor.narrow(dim, self.rank * size, size)

    def check(self, name: str, tensor: torch.Tensor, sharded: bool = False) -> torch.Tensor:
        """Validate one incoming tensor against its destination, which is returned. `sharded`: the tensor is
        this rank's slice (rank_slice's), not the full Hugging Face tensor."""
        dst = self.destination(name)
        fp8 = name in self.fp8
        allowed = QUANTIZABLE_SOURCES if fp8 else UPDATE_SOURCES
        if not isinstance(tensor, torch.Tensor) or tensor.dtype not in allowed:
            kind = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            stored = "is stored in fp8 and quantized from the incoming tensor, which " if fp8 else ""
            raise ValueError(f"weight {name!r} {stored}must be a floating-point tensor of {[str(d) for d in allowed]}, "
                             f"got {kind}")
        if tensor.layout != torch.strided:
            raise ValueError(f"weight {name!r} is a {tensor.layout} tensor; pass a dense one (tensor.to_dense())")
        if tensor.is_meta:
            raise ValueError(f"weight {name!r} is a meta tensor (no data); pass a materialised tensor")
        if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
            raise ValueError(f"weight {name!r} is a {type(tensor).__name__}, a torch.Tensor subclass whose copy the "
                             "engine cannot take; pass a plain tensor (a DTensor: tensor.full_tensor())")
        if tensor.numel() and tensor.untyped_storage().nbytes() < _span_bytes(tensor):  # reading it would crash
            raise ValueError(f"weight {name!r} has {tensor.untyped_storage().nbytes()} bytes of storage behind a "
                             f"shape that spans {_span_bytes(tensor)}: its data was freed (FSDP frees gathered "
                             "parameters after use); pass it while it holds its values")
        expected = dst.shape if sharded or not self.splits else self.full_shape(name)
        if tensor.shape != expected:
            raise ValueError(self._shape_error(name, tensor.shape, sharded))
        return dst

    def _shape_error(self, name: str, shape: torch.Size, sharded: bool) -> str:
        full, part = self.full_shape(name), self.destination(name).shape
        said = f"weight {name!r} has shape {tuple(shape)}, expected {tuple(part if sharded else full)}"
        if name not in self.splits:
            return said
        if sharded and shape == full:
            return (f"{said}: with sharded=True each rank passes its own slice, and this is the full tensor; pass "
                    f"rank {self.rank}'s part {self.rank} of {self.ranks} along dimension {self.splits[name]}, or "
                    "the full tensors with sharded=False")
        if not sharded and shape == part:
            return (f"{said}: this is one rank's slice, and update_weights takes full Hugging Face tensors; pass "
                    "sharded=True (process_group engines) to give each rank its own slice")
        return said

    def copy_plan(self, ops, names: list[str], destinations: list, sources: list) -> CopyPlan:
        """ops.copy_plan for the plain tensors, and ops.quantize_shards_plan for the group's shards of fp8
        layers (on CUDA a constant number of launches for all of them, holding addresses only)."""
        quantized = [i for i, name in enumerate(names) if name in self.fp8]
        if not quantized:
            return ops.copy_plan(destinations, sources)
        plain = sorted(set(range(len(names))) - set(quantized))
        copy = ops.copy_plan([destinations[i] for i in plain], [sources[i] for i in plain])
        arriving: dict[Fp8Linear, dict] = {}
        for i in quantized:
            layer, shard = self.fp8[names[i]]
            arriving.setdefault(layer, {})[shard] = sources[i]
        quantize = ops.quantize_shards_plan([layer.loading(shards) for layer, shards in arriving.items()])
        return CopyPlan(launch=in_turn(copy.launch, quantize.launch), rest=in_turn(copy.rest, quantize.rest))

    def resolve(self, group, sharded: bool = False) -> tuple[list[str], list[torch.Tensor], list[torch.Tensor]]:
        """Check every (hf_name, tensor) pair of a group; return their names, destinations and sources.
        `sharded`: the tensors are this rank's slices, copied as they are.

        A name given twice is copied once, the last tensor winning as if copied in order: one batched copy
        must not write a destination twice (lm_head.weight beside the embedding it is tied to: check_tied)."""
        picked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for hf_name, tensor in group:
            name = self.canonical(hf_name)
            if name is not None:
                source = tensor if sharded or not self.splits else self.rank_slice(name, tensor)
                picked[name] = (self.check(name, tensor, sharded), source)
        return list(picked), [dst for dst, _ in picked.values()], [src for _, src in picked.values()]


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `b` holds `a`'s values once in `a`'s dtype (the copy casts it so)."""
    return a.shape == b.shape and torch.equal(a, b.to(a.device, a.dtype))


def _span_bytes(tensor: torch.Tensor) -> int:
    """The bytes of storage a non-empty tensor's shape, strides and offset reach."""
    last = tensor.storage_offset() + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))
    return (last + 1) * tensor.element_size()


def tied_error(first: str, second: str, where: str) -> str:
    return (f"the engine ties {first!r} and {second!r} (tie_word_embeddings: one tensor for both), and "
            f"{where} gives the two different values, so one would be dropped; pass equal tensors or only one")
