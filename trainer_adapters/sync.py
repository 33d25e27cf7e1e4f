"""Push a trainer's transformers model into the engine after an optimizer step."""
from __future__ import annotations

import torch

from rollout_engine import Engine


# The dotted name parts that wrappers insert: DDP and FSDP's `.module`, torch.compile, activation checkpointing's
# checkpoint_wrapper, FSDP1. Only a whole part is one of these: `my_module` or `submodule` is a name of the model.
WRAPPER_PARTS = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside DDP / FSDP-style `.module` and torch.compile `._orig_mod` wrappers."""
    while True:
        inner = getattr(model, "module", None)  # `is None`, not `or`: a wrapper's truth is its model's len()
        inner = getattr(model, "_orig_mod", None) if inner is None else inner
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


def hf_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter, object]]:
    """(Hugging Face name, parameter, LoRA layer or None) for every weight the engine holds of a (possibly wrapped)
    transformers model. A PEFT LoRA model's are its base model's: a LoRA layer's base weight comes with its layer
    (the sync adds the layer's active adapters: lora_merged), a modules_to_save module is the copy PEFT's forward
    uses (modules_to_copy), and the adapters' own parameters are not weights of the base model. What the sync
    cannot give as PEFT's forward computes is refused here, before anything is sent (check_peft)."""
    model = unwrap(model)
    if not (hasattr(model, "peft_config") and hasattr(model, "get_base_model")):
        return [(hf_name(name), param, None) for name, param in model.named_parameters()]
    base = model.get_base_model()
    check_peft(model, base)
    out = []
    for name, param in base.named_parameters():
        parts = name.split(".")
        if any(part.startswith("lora_") for part in parts):
            continue
        layer = None
        for wrapped in ("modules_to_save", "original_module"):
            if wrapped in parts:
                at = parts.index(wrapped)
                width = 2 if wrapped == "modules_to_save" else 1
                if ".".join(parts[at : at + width]) != module_in_use(base.get_submodule(".".join(parts[:at]))):
                    break
                parts = parts[:at] + parts[at + width :]
        else:
            if "base_layer" in parts:
                at = parts.index("base_layer")
                layer = base.get_submodule(".".join(parts[:at])) if parts[-1] == "weight" else None
                parts = parts[:at] + parts[at + 1 :]
            out.append((hf_name(".".join(parts)), param, layer))
    return out


def check_peft(model, base) -> None:
    """ValueError unless every adapter is plain LoRA on layers whose base weight is the layer's own: another PEFT
    method, a LoRA variant (DoRA, aLoRA, ...) or bias, trainable tokens, or a LoRA layer or a modules_to_save copy
    of a weight tied to another module (the engine holds one tensor for the two, PEFT trains one of them) would be
    served otherwise than trained."""
    for name, config in model.peft_config.items():
        kind = getattr(config.peft_type, "value", config.peft_type)
        if kind != "LORA" or getattr(config, "trainable_token_indices", None) or getattr(config, "use_dora", False):
            raise ValueError(f"adapter {name!r} ({kind}{', DoRA' if getattr(config, 'use_dora', False) else ''}) is "
                             "not plain LoRA, which is all the sync adds to base weights: merge it first "
                             "(model.merge_and_unload()) and sync that model")
    paths = {}
    for path, param in base.named_parameters(remove_duplicate=False):
        paths.setdefault(id(param), []).append(path)
    for path, module in base.named_modules():
        if hasattr(module, "original_module") and module_in_use(module) != "original_module":
            check_tied_copy(base, path, module, paths)
        if hasattr(module, "base_layer") and hasattr(module, "lora_A"):
            if any(a in getattr(module, "lora_variant", {}) for a in module.active_adapters):
                raise ValueError(f"{path} is a LoRA variant (DoRA, aLoRA, ...), whose forward is not the base weight "
                                 "plus B A: merge it first (model.merge_and_unload()) and sync that model")
            if any(getattr(module, "lora_bias", {}).get(a) for a in module.active_adapters):
                raise ValueError(f"{path} has a LoRA bias, which the sync does not add: merge it first")
            shared = paths.get(id(getattr(module.get_base_layer(), "weight", None)), [])
            if len(shared) > 1:
                raise ValueError(f"the LoRA layer {path} adapts a weight tied to {sorted(shared)}: the engine holds "
                                 "one tensor for them, PEFT adapts one; leave the tied modules out of target_modules")


def check_tied_copy(base, path: str, wrapper, paths: dict) -> None:
    """ValueError where a modules_to_save wrapper at `path` trains a copy of a weight tied to another module whose
    forward does not use that same copy (PEFT ties the copies only with ensure_weight_tying): the engine holds one
    tensor for the two. `paths`: every path of each parameter of `base`, by id."""
    copy = wrapper.get_submodule(module_in_use(wrapper))
    for name, weight in wrapper.original_module.named_parameters():
        for partner in paths.get(id(weight), []):
            parts = partner.split(".")
            if partner == f"{path}.original_module.{name}":
                continue
            if "original_module" in parts:  # the partner's wrapper: the module its forward runs
                at = parts.index("original_module")
                other = base.get_submodule(".".join(parts[:at]))
                used = other.get_submodule(module_in_use(other)).get_parameter(".".join(parts[at + 1 :]))
                if used is copy.get_parameter(name):
                    continue
            raise ValueError(f"modules_to_save trains a copy of {path}, whose weight is tied to {partner}, which "
                             "PEFT's forward runs on another tensor; the engine holds one for both: pass "
                             "ensure_weight_tying=True to the LoraConfig, or leave it out of modules_to_save")


def module_in_use(wrapper) -> str:
    """Which of a modules_to_save wrapper's modules PEFT's forward runs: "modules_to_save.<adapter>" of the active
    adapter, or "original_module" with adapters disabled or an active adapter that has no copy."""
    active = list(wrapper.active_adapters)
    if wrapper.disable_adapters or not active or any(a not in wrapper.modules_to_save for a in active):
        return "original_module"
    return f"modules_to_save.{active[0]}"


def lora_merged(weight: torch.Tensor, layer) -> torch.Tensor:
    """A LoRA layer's base `weight` (whole) plus its active adapters' deltas, as PEFT's forward adds them, in the
    weight's dtype: one new tensor (addmm, no full-size temporaries), the trainer's weight left as it is (a merge
    and unmerge would round it). The weight itself where the adapters are merged into it already, or disabled."""
    if layer.merged or layer.disable_adapters:
        return weight
    out = weight
    for adapter in layer.active_adapters:
        if adapter in layer.lora_A:  # Linear: W [out, in] (or [in, out] with fan_in_fan_out) + s B [out, r] A [r, in]
            a, b = (full_tensor(m[adapter].weight.detach()) for m in (layer.lora_A, layer.lora_B))
            first, second = (a.T, b.T) if layer.fan_in_fan_out else (b, a)
        elif adapter in layer.lora_embedding_A:  # Embedding: W [vocab, dim] + s A.T [vocab, r] B.T [r, dim]
            a, b = (full_tensor(m[adapter].detach()) for m in (layer.lora_embedding_A, layer.lora_embedding_B))
            first, second = a.T, b.T
        else:
            continue
        first, second, scale = first.to(weight.dtype), second.to(weight.dtype), layer.scaling[adapter]
        out = torch.addmm(out, first, second, alpha=scale) if out is weight else out.addmm_(first, second, alpha=scale)
    return out


def hf_named_parameters(model: torch.nn.Module):
    """(Hugging Face name, detached full tensor) for every parameter of a (possibly wrapped) transformers model.

    A sharded parameter (a DTensor: FSDP2's fully_shard, torch tensor parallelism) is gathered with its
    .full_tensor(), one parameter at a time. That is a collective over the parameter's device mesh: every rank of
    the mesh must iterate the same parameters in the same order (call sync_weights on each of them, or iterate this
    generator to the end on each), else the ranks that do wait for the others forever. A parameter of any other
    tensor subclass, which the engine cannot copy from, is refused here, before anything is gathered or yielded
    (so before sync_weights calls the engine)."""
    return gathered(hf_parameters(model))


def gathered(params: list):
    """hf_named_parameters of hf_parameters' list `params`."""
    for name, param, _ in params:
        if not callable(getattr(param, "full_tensor", None)) and type(param.detach()) is not torch.Tensor:
            raise ValueError(f"parameter {name!r} is of type {type(param.detach()).__name__}, not a torch.Tensor or a "
                             "DTensor; hand the engine full tensors (gather or convert the model's weights first)")
    return ((name, full_tensor(param.detach()) if layer is None else lora_merged(full_tensor(param.detach()), layer))
            for name, param, layer in params)


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's gathered whole (a collective over its mesh); any other tensor as it is."""
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor


def hf_name(name: str) -> str:
    """A parameter's name without the wrapper parts (WRAPPER_PARTS) anywhere in it: the Hugging Face name."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def check_model_fits(engine, model: torch.nn.Module) -> None:
    """ValueError unless the (possibly wrapped) model's parameters are the engine's weights: each name known and of
    the engine's shape, together every weight, lm_head tied to the embedding in both or in neither
    (WeightTable.check_model); and its config computes the same function (ModelConfig.check_same_function). What
    sync_weights would refuse (a value head, a resized vocabulary) or leave stale (a tied model sends no
    lm_head.weight, which an untied engine holds) is found before anything sleeps. Names and shapes only: a sharded
    parameter's shape is its whole tensor's, so nothing is gathered. `engine`: an Engine, or a Ray EnginePool (one
    of its engines checks)."""
    check_params_fit(engine, hf_parameters(model), model_config(model))


def check_params_fit(engine, params: list, config: dict | None) -> None:
    """check_model_fits of hf_parameters' list `params` and model_config's `config`."""
    shapes = {name: tuple(param.shape) for name, param, _ in params}  # a tied lm_head is the embedding: listed once
    if not isinstance(engine, Engine):
        if not callable(getattr(engine, "check_model", None)):  # an AsyncEngine's update is awaited: not here
            raise TypeError(f"engine must be an Engine or a ray_pool.EnginePool, got {type(engine).__name__}; an "
                            "AsyncEngine's weights go through trainer_adapters.async_rollouts.AsyncRollouts.push_weights")
        engine.check_model(shapes, config)  # an EnginePool: one of its engines runs the same rule
        return
    engine.weights.check_model(shapes, config)


def model_config(model: torch.nn.Module) -> dict | None:
    """The (possibly wrapped) model's transformers config as the dict config.json holds, or None without one."""
    config = getattr(unwrap(model), "config", None)
    return config.to_dict() if callable(getattr(config, "to_dict", None)) else None


def weights_sleep_level(engine) -> int:
    """The sleep level for a step whose weights come back from the trainer: 2 (discarded), unless the engine holds
    a speculative draft model, whose weights no trainer pushes back: then 1 (kept on the host)."""
    return 1 if "draft" in engine.models else 2


def sync_weights(engine, model: torch.nn.Module, version: int | None = None, sender=None) -> int:
    """Copy the model's current weights into the engine (in place, one tensor at a time) and return the new version.

    `engine`: an Engine, or a Ray EnginePool (every engine takes the update, through the object store). With
    `sender` (a rollout_engine.transport.WeightSender) the tensors go to an engine in another process, packed in
    buckets of bounded size. A sharded (DTensor) model is gathered one parameter at a time, a collective: every rank
    of its mesh calls sync_weights (hf_named_parameters says why). The model is first checked against the engine: a
    name the engine lacks found after the first groups were copied would leave it refusing to generate, and a tied
    model syncs no lm_head.weight into an untied engine, which would keep its old head. Into `engine`,
    check_model_fits does it; through `sender`, the engine's receiver, to which the update announces every tensor it
    sends (names, shapes and dtypes) as the whole model's weights, and the model config's rope and RMSNorm settings."""
    params, config = hf_parameters(model), model_config(model)
    named = gathered(params)  # refuses a parameter the engine cannot copy from, before the engine is used
    if sender is None:
        check_params_fit(engine, params, config)
    with torch.no_grad():
        if sender is not None:
            manifest = [(name, param) for name, param, _ in params]  # a LoRA merge keeps the dtype
            return sender.send(named, version, manifest=manifest, config=config)
        return engine.update_weights(named, version)
