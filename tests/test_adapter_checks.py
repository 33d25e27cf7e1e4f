"""trainer_adapters.sync hands the engine full tensors: an FSDP2 (fully_shard) model's DTensor parameters are gathered
on every rank, a parameter of any other tensor subclass is refused before the engine is called, and the names that
wrappers (DDP, torch.compile, activation checkpointing, FSDP1) insert are dropped as whole parts.

The FSDP2 test starts two processes (gloo, CPU); each shards a model over both, syncs it into its own engine and
pickles what it saw, and the test compares with the unsharded model."""
import copy
import os
import pickle
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from conftest import build_hf_model
from helpers import assert_serves, make_prompts, tied_twin
from test_tensor_parallel_spmd import COLLECTIVE_S, _spawn, outcome

from rollout_engine import AsyncEngine, Engine, SamplingParams
from trainer_adapters import hf_named_parameters, sync_weights
from trainer_adapters.sync import check_model_fits


def _fsdp_rank_main(rank: int, work: str, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{work}/rendezvous", rank=rank, world_size=2,
                            timeout=timedelta(seconds=COLLECTIVE_S))
    try:
        model = build_hf_model("llama3", seed=1)  # the engine below holds the seed-0 checkpoint
        full = {name: p.detach().clone() for name, p in model.named_parameters()}
        mesh = init_device_mesh("cpu", (2,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        seen = {"sharded": sum(type(p).__name__ == "DTensor" for p in model.parameters())}
        engine = Engine(path, device="cpu", kv_cache_memory=4 << 20)
        seen["sync"] = outcome(lambda: sync_weights(engine, model))
        weights = engine.weights
        seen["equal"] = {name: torch.equal(weights.destination(name), full[name])
                         for name in weights.names() if name in full}
        seen["serves"] = outcome(lambda: len(engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2),
                                                             use_tqdm=False)[0].outputs[0].token_ids))
        with open(os.path.join(work, f"rank{rank}.pkl"), "wb") as f:
            pickle.dump(seen, f)
    finally:
        dist.destroy_process_group()


def test_sync_weights_gathers_an_fsdp2_models_dtensors_on_every_rank(hf_checkpoint, tmp_path):
    """Each rank holds half of every weight (DTensors of the global shape): sync_weights gathers each with
    full_tensor() on both ranks, and both engines then hold exactly the unsharded model's weights and serve them
    (the DTensors went to the engine as they were: its shape check passed and the copy failed part way with a
    torch-internal error, leaving the engine refusing to generate)."""
    path, _ = hf_checkpoint("llama3")
    _spawn(_fsdp_rank_main, (str(tmp_path), str(path)))
    for rank in range(2):
        with open(tmp_path / f"rank{rank}.pkl", "rb") as f:
            seen = pickle.load(f)
        assert seen["sharded"] > 0, "fully_shard made no DTensor parameters: the test tests nothing"
        assert seen["sync"] == ("ok", 1), (rank, seen["sync"])
        assert seen["equal"] and all(seen["equal"].values()), (rank, seen["equal"])
        assert seen["serves"] == ("ok", 2), (rank, seen["serves"])


class Untouchable:
    """Fails the test on any use: a refused model must be refused before the engine is called."""

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} was used before the model's parameters were checked")


class OddTensor(torch.Tensor):
    """A tensor subclass the engine cannot copy from (neither a plain tensor nor a DTensor)."""


def test_a_parameter_of_another_tensor_subclass_is_refused_before_the_engine_is_called():
    model = build_hf_model("llama3")
    norm = model.model.norm
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone().as_subclass(OddTensor))
    with pytest.raises(ValueError, match=r"parameter 'model.norm.weight' is of type OddTensor, not a torch.Tensor or a "
                                         r"DTensor"):
        sync_weights(Untouchable(), model)
    with pytest.raises(ValueError, match="model.norm.weight"):
        hf_named_parameters(model)  # at the call, not at the first next()


def test_plain_parameters_pass_through_unchanged():
    model = build_hf_model("llama3")
    named = dict(hf_named_parameters(model))
    assert named.keys() == dict(model.named_parameters()).keys()
    for name, p in model.named_parameters():
        assert type(named[name]) is torch.Tensor and named[name].data_ptr() == p.data_ptr()


def test_wrapper_parts_are_dropped_whole_and_other_names_kept():
    """Each part a wrapper inserts (DDP's `module`, torch.compile's `_orig_mod`, checkpoint_wrapper's
    `_checkpoint_wrapped_module`, FSDP1's `_fsdp_wrapped_module`) is dropped wherever it sits; a part that only
    contains such a word (`my_module`, `submodule`) is the model's own name and stays."""
    inner = torch.nn.Module()
    inner.add_module("my_module", torch.nn.Linear(2, 2))
    inner.add_module("submodule", torch.nn.Linear(2, 2))
    layer = torch.nn.Module()
    layer.add_module("_checkpoint_wrapped_module", torch.nn.Linear(2, 2))
    inner.add_module("layers", torch.nn.ModuleList([layer]))
    compiled = torch.nn.Module()
    compiled.add_module("_orig_mod", inner)
    sharded = torch.nn.Module()
    sharded.add_module("_fsdp_wrapped_module", compiled)
    outer = torch.nn.Module()
    outer.add_module("head", sharded)
    outer.add_module("module_list", torch.nn.ModuleList([torch.nn.Linear(2, 2)]))
    assert [name for name, _ in hf_named_parameters(outer)] == [
        "head.my_module.weight", "head.my_module.bias", "head.submodule.weight", "head.submodule.bias",
        "head.layers.0.weight", "head.layers.0.bias", "module_list.0.weight", "module_list.0.bias"]


def test_a_model_with_activation_checkpointing_syncs_into_the_engine(hf_checkpoint):
    """checkpoint_wrapper (activation checkpointing, common under FSDP) puts `_checkpoint_wrapped_module` inside
    every layer's names; the engine still gets the Hugging Face names and serves the model's weights."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from transformers import AutoModelForCausalLM

    engine = Engine(hf_checkpoint("llama3")[0], device="cpu", kv_cache_memory=8 << 20)
    model = AutoModelForCausalLM.from_pretrained(hf_checkpoint("llama3", seed=1)[0], dtype=torch.float32).eval()
    layer = type(model.model.layers[0])
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer))
    assert sync_weights(engine, model) == 1
    assert_serves(engine, model, make_prompts((7,), seed=3)[0], version=1)


def lora(peft, family_path, **config):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(family_path, dtype=torch.float32).eval()
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **config)).eval()


def synced(model) -> dict:
    return {name: t.clone() for name, t in hf_named_parameters(model)}


def as_merged(model) -> dict:
    """What PEFT's own merge gives (with its forward's choice of modules_to_save copy)."""
    return dict(copy.deepcopy(model).merge_and_unload().named_parameters())


def test_a_peft_lora_model_syncs_its_merged_weights_and_keeps_its_own(hf_checkpoint):
    """A PEFT LoRA model (the trainer of a LoRA GRPO run, as TRL hands it) syncs under its base model's names: each
    LoRA layer's base weight plus its active adapter's delta (Linear, Embedding), a modules_to_save module as
    PEFT's forward uses it; the adapters' own parameters are not sent, and the trainer's weights are left bit for
    bit (no merge and unmerge)."""
    peft = pytest.importorskip("peft")
    path = hf_checkpoint("llama3", seed=1)[0]
    engine = Engine(hf_checkpoint("llama3")[0], device="cpu", kv_cache_memory=8 << 20)
    model = lora(peft, path, target_modules=["q_proj", "v_proj", "down_proj", "embed_tokens"],
                 modules_to_save=["lm_head"])
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # the trained copy differs
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    check_model_fits(engine, model)
    assert sync_weights(engine, model) == 1
    want = as_merged(model)
    got = synced(model)
    assert got.keys() == want.keys()
    assert all(torch.allclose(got[n], want[n], atol=1e-6, rtol=0) for n in got)
    assert_serves(engine, copy.deepcopy(model).merge_and_unload(), make_prompts((7,), seed=3)[0], version=1)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    # inside disable_adapter(): the base model, the original lm_head (PEFT's forward)
    with model.disable_adapter():
        got = synced(model)
    plain = dict(model.get_base_model().named_parameters())
    assert torch.equal(got["lm_head.weight"], plain["lm_head.original_module.weight"])
    q, v = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"
    assert torch.equal(got[f"{q}.weight"], plain[f"{q}.base_layer.weight"])
    # a second adapter, active, that has no lm_head copy: the original lm_head, and the second adapter's deltas only
    model.add_adapter("other", peft.LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.set_adapter("other")
    got, want = synced(model), as_merged(model)
    assert torch.equal(got["lm_head.weight"], plain["lm_head.original_module.weight"])
    assert torch.allclose(got[f"{q}.weight"], want[f"{q}.weight"], atol=1e-6, rtol=0)
    assert torch.equal(got[f"{v}.weight"], plain[f"{v}.base_layer.weight"])
    # merged by the user: its delta is in the base weight already
    model.set_adapter("default")
    layer = model.get_base_model().model.layers[0].self_attn.q_proj
    layer.merge()
    assert torch.equal(synced(model)[f"{q}.weight"], layer.base_layer.weight)


def test_what_the_peft_sync_cannot_give_as_peft_computes_is_refused_before_anything_is_sent(hf_checkpoint):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    tied = hf_checkpoint("qwen2")[0]  # lm_head tied to the embedding
    for target in (["lm_head"], ["embed_tokens"]):
        with pytest.raises(ValueError, match="adapts a weight tied to"):
            hf_named_parameters(lora(peft, tied, target_modules=target))
    with pytest.raises(ValueError, match="not plain LoRA"):
        hf_named_parameters(lora(peft, tied, target_modules=["q_proj"], use_dora=True))
    ia3 = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tied), peft.IA3Config(
        target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]))
    with pytest.raises(ValueError, match="IA3.*not plain LoRA"):
        hf_named_parameters(ia3)
    # a trained copy of one of two tied modules: PEFT's forward keeps the original for the other (the sync sent the
    # copy for both, and the engine's head drifted from the trainer's)
    for saved, partner in (("embed_tokens", "lm_head.weight"), ("lm_head", "model.embed_tokens.weight")):
        with pytest.raises(ValueError, match=f"modules_to_save trains a copy of .*tied to {partner}"):
            hf_named_parameters(lora(peft, tied, target_modules=["q_proj"], modules_to_save=[saved]))
    if "alora_invocation_tokens" in peft.LoraConfig.__dataclass_fields__:  # a variant but DoRA, flagged per layer
        with pytest.raises(ValueError, match="is a LoRA variant"):
            hf_named_parameters(lora(peft, tied, target_modules=["q_proj"], alora_invocation_tokens=[5, 6]))


def test_a_tied_modules_to_save_copy_that_peft_ties_too_syncs_what_peft_computes(hf_checkpoint):
    """With ensure_weight_tying PEFT's forward runs the one trained copy for the embedding and the head: the engine,
    tied, serves it."""
    peft = pytest.importorskip("peft")
    if "ensure_weight_tying" not in peft.LoraConfig.__dataclass_fields__:
        pytest.skip("this PEFT has no ensure_weight_tying")
    tied = hf_checkpoint("qwen2")[0]
    engine = Engine(tied, device="cpu", kv_cache_memory=8 << 20)
    model = lora(peft, tied, target_modules=["q_proj"], modules_to_save=["embed_tokens"], ensure_weight_tying=True)
    with torch.no_grad():
        model.get_base_model().model.embed_tokens.modules_to_save["default"].weight.mul_(1.5)  # the trained copy
    assert sync_weights(engine, model) == 1
    assert_serves(engine, model, make_prompts((7,), seed=3)[0], version=1)


@pytest.mark.parametrize("change", ["rms_norm_eps", "rope_theta"])
def test_a_model_whose_config_computes_another_function_from_the_same_shapes_is_refused(hf_checkpoint, change):
    """Weights of the same names and shapes under another rotary base or RMSNorm epsilon: the engine would serve
    another policy than the trainer's, silently. Refused before anything is copied, naming what differs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = hf_checkpoint("llama3")[0]
    engine = Engine(path, device="cpu", kv_cache_memory=8 << 20)
    config = AutoConfig.from_pretrained(path)
    if change == "rms_norm_eps":
        config.rms_norm_eps = 1e-2
    elif getattr(config, "rope_parameters", None):
        config.rope_parameters = {**config.rope_parameters, "rope_theta": 5000.0}
    else:
        config.rope_theta = 5000.0
    model = AutoModelForCausalLM.from_pretrained(path, config=config)
    check_model_fits(engine, AutoModelForCausalLM.from_pretrained(path))  # the checkpoint's own config fits
    with pytest.raises(ValueError, match="rms_norm_eps" if change == "rms_norm_eps" else "rope"):
        sync_weights(engine, model)
    assert engine.weight_version == 0


@pytest.mark.parametrize("scaling", [{"type": "linear", "factor": 2.0},
                                     {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64}], ids=["linear", "llama3"])
def test_a_legacy_rope_scaling_spelling_is_the_same_function(hf_checkpoint, tmp_path, scaling):
    """A checkpoint that spells its rope scaling with the legacy "type" key (Llama-2 long-context fine-tunes do):
    transformers' config adds "rope_type" beside it, so the dicts differ while the frequencies are the same. The
    model loaded from that checkpoint fits the engine loaded from it; another factor does not."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    path = shutil.copytree(hf_checkpoint("llama3")[0], tmp_path / "legacy")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "rope_scaling": scaling}))
    engine = Engine(path, device="cpu", kv_cache_memory=8 << 20)
    check_model_fits(engine, AutoModelForCausalLM.from_pretrained(path))
    config = AutoConfig.from_pretrained(path)
    config.rope_scaling = {**config.rope_scaling, "factor": 4.0}
    with pytest.raises(ValueError, match="rope_theta and rope scaling"):
        check_model_fits(engine, AutoModelForCausalLM.from_pretrained(path, config=config))


def test_a_compiled_model_inside_ddp_style_wrappers_is_unwrapped():
    """torch.compile's wrapper takes its model's len(), which a transformers model does not have: the unwrapping
    asks `is None`, not `or`."""
    model = build_hf_model("llama3")
    outer = torch.nn.Module()
    outer.module = torch.compile(model)
    assert dict(hf_named_parameters(outer)).keys() == dict(model.named_parameters()).keys()


def test_sync_weights_refuses_a_model_the_engine_cannot_take_before_copying_anything(hf_checkpoint, monkeypatch):
    """sync_weights straight into an engine checks the model first: a value head (a name the engine lacks) found
    only after the first groups were copied left the engine refusing to generate, and no retry could complete it;
    a tied model into an untied engine sent no lm_head.weight and left the old head serving as a new version.
    Both are refused with the old weights serving at the old version."""
    import rollout_engine.weight_store as weight_store

    monkeypatch.setattr(weight_store, "GROUP_BYTES", 40_000)  # several groups even for the tiny model
    path, model = hf_checkpoint("llama3")
    engine = Engine(path, device="cpu", kv_cache_memory=8 << 20)
    ids = make_prompts((7,), seed=3)[0]
    critic = copy.deepcopy(model)
    critic.v_head = torch.nn.Linear(model.config.hidden_size, 1)  # added last: named last
    with pytest.raises(ValueError, match="v_head.weight"):
        sync_weights(engine, critic)
    tied = tied_twin(model)
    with pytest.raises(ValueError, match="tie_word_embeddings differs"):
        sync_weights(engine, tied)
    assert engine.weight_version == 0
    assert_serves(engine, model, ids, version=0)


def test_a_tied_model_whose_wrapper_lists_the_head_first_syncs(hf_checkpoint):
    """A trainer's wrapper that registers the tied lm_head before the model lists their one tensor as
    lm_head.weight: it is the tied engine's embedding, and the sync serves what the plain model's sync serves."""
    path, _ = hf_checkpoint("qwen2")  # tied
    model = build_hf_model("qwen2", seed=1)

    class Policy(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.lm_head, self.model, self.config = inner.lm_head, inner.model, inner.config

    policy = Policy(model)
    assert next(iter(dict(policy.named_parameters()))) == "lm_head.weight"
    engine = Engine(path, device="cpu", kv_cache_memory=8 << 20)
    assert sync_weights(engine, policy) == 1
    assert_serves(engine, model, make_prompts((7,), seed=3)[0], version=1)


def test_sync_weights_into_an_async_engine_says_what_to_use(hf_checkpoint):
    """An AsyncEngine's update_weights is a coroutine, which sync_weights would create and never await: the call
    is refused by name, pointing at the way an AsyncEngine takes a trainer's weights."""
    path, model = hf_checkpoint("llama3")
    engine = AsyncEngine(path, device="cpu", kv_cache_memory=8 << 20)
    try:
        with pytest.raises(TypeError, match="Engine or a ray_pool.EnginePool, got AsyncEngine.*push_weights"):
            sync_weights(engine, model)
    finally:
        engine.shutdown()


def test_an_update_refused_after_some_groups_copied_says_so(hf_checkpoint, monkeypatch):
    """update_weights checks names a group at a time: a bad name in a later group leaves the weights partly
    updated, and the error says that generate() is refused until an update completes them."""
    import sys

    import rollout_engine.weight_store as weight_store

    monkeypatch.setattr(weight_store, "GROUP_BYTES", 40_000)
    path, model = hf_checkpoint("llama3")
    engine = Engine(path, device="cpu", kv_cache_memory=8 << 20)
    named = list(model.named_parameters()) + [("v_head.weight", torch.zeros(1, model.config.hidden_size))]
    with pytest.raises(ValueError, match="v_head.weight") as refused:
        engine.update_weights(named)
    if sys.version_info >= (3, 11):
        assert any("partly updated" in note for note in refused.value.__notes__)
    engine.update_weights(model.named_parameters())
    assert_serves(engine, model, make_prompts((7,), seed=3)[0], version=1)
