"""Weight sync: the engine serves exactly the weights it was given, or refuses."""
import copy
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from helpers import GREEDY, assert_serves, hf_greedy, make_prompts

import rollout_engine.weight_store
from rollout_kernels import copies
from rollout_engine import Engine, WeightsNotReadyError
from rollout_engine.weights import ReusableGroup


@pytest.fixture
def models(hf_checkpoint):
    """An engine built from random model A, and random model B (another seed) to update it with."""
    path_a, model_a = hf_checkpoint("llama3", seed=0)
    path_b, model_b = hf_checkpoint("llama3", seed=1)
    return Engine(path_a, device="cpu", kv_cache_memory=32 << 20), model_a, model_b, path_b


@pytest.mark.parametrize("source", ["named_parameters", "state_dict_fp16", "disk"])
def test_update_then_equals_transformers_with_the_new_weights(models, source):
    engine, model_a, model_b, path_b = models
    ids = make_prompts()[2]
    assert_serves(engine, model_a, ids)
    if source == "named_parameters":
        version = engine.update_weights((n, p.detach()) for n, p in model_b.named_parameters())
    elif source == "state_dict_fp16":  # cast on the way in; compare against B rounded the same way
        half = {n: t.half() for n, t in model_b.state_dict().items()}
        version = engine.update_weights(half.items())
        model_b = type(model_b)(model_b.config).eval()
        model_b.load_state_dict({n: t.float() for n, t in half.items()})
    else:
        version = engine.update_weights_from_disk(path_b)
    assert version == 1 == engine.weight_version
    assert engine.weight_history[-1] == {"version": 1, "tensors": len(engine.weights.names()), "complete": True}
    history = engine.weight_history  # the caller's copy: editing it leaves the engine's record as it was
    history[-1]["complete"] = False
    history.append({"version": 7})
    assert engine.weight_history == [{"version": 1, "tensors": len(engine.weights.names()), "complete": True}]
    assert_serves(engine, model_b, ids)
    assert engine.generate([ids], GREEDY)[0].weight_version == 1


def test_rejected_before_any_copy_keeps_the_old_weights(models):
    engine, model_a, model_b, _ = models
    ids = make_prompts()[0]
    named = list(model_b.state_dict().items())
    with pytest.raises(ValueError, match=r"unknown weight name 'model.layers.0.self_attn.q_prj.weight'.*q_proj"):
        engine.update_weights([("model.layers.0.self_attn.q_prj.weight", named[0][1])] + named)
    with pytest.raises(ValueError, match=r"unknown weight name 'nope'.*nearest known names: \['lm_head\.weight'"):
        engine.update_weights([("nope", named[0][1])])  # nothing near: some names there are
    with pytest.raises(ValueError, match=r"shape \(3, 3\), expected"):
        engine.update_weights([(named[1][0], torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="floating-point"):
        engine.update_weights([(named[1][0], named[1][1].long())])
    with pytest.raises(ValueError, match="shape"):  # late in the (one) group: checked before any of it is copied
        engine.update_weights(named[:5] + [(named[5][0], torch.zeros(2))] + named[6:])
    assert engine.weight_version == 0
    assert_serves(engine, model_a, ids)


def test_failure_part_way_refuses_until_a_complete_update(models, monkeypatch):
    engine, model_a, model_b, _ = models
    monkeypatch.setattr(rollout_engine.weight_store, "GROUP_BYTES", 64 << 10)  # groups: [embed], [q k v o], [gate up] ...
    ids = make_prompts()[1]
    named = list(model_b.state_dict().items())
    assert named[3][0] == "model.layers.0.self_attn.v_proj.weight"
    broken = named[:3] + [(named[3][0], torch.zeros(2))] + named[4:]
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(broken)
    weights = engine.weights
    assert torch.equal(weights.destination("model.embed_tokens.weight"), named[0][1])  # the first group landed
    q_proj = "model.layers.0.self_attn.q_proj.weight"  # the second group was checked whole, so never copied
    assert torch.equal(weights.destination(q_proj), model_a.state_dict()[q_proj])
    with pytest.raises(WeightsNotReadyError):
        engine.generate([ids], GREEDY)
    engine.update_weights(named[:10])  # a partial update does not make a mix servable
    with pytest.raises(WeightsNotReadyError):
        engine.generate([ids], GREEDY)
    engine.update_weights(named)
    assert_serves(engine, model_b, ids)


def test_a_name_given_twice_is_refused(models):
    """Which copy would serve would depend on how the update is cut into groups or buckets (a transport's bucket
    refuses a name twice): refused, naming it, with nothing copied when both copies come in the first group."""
    engine, _, model_b, _ = models
    norm = model_b.state_dict()["model.norm.weight"]
    before = engine.weights.destination("model.norm.weight").clone()
    with pytest.raises(ValueError, match="gives weight 'model.norm.weight' twice"):
        engine.update_weights([("model.norm.weight", norm * 2), ("model.norm.weight", norm)])
    assert torch.equal(engine.weights.destination("model.norm.weight"), before) and engine.weight_version == 0
    with pytest.raises(ValueError, match="gives weight 'model.norm.weight' twice"):  # in two buckets, as a peer may
        engine.update_weights_from_buckets([[("model.norm.weight", norm * 2)], [("model.norm.weight", norm)]])


def test_partial_update_is_recorded_and_served(models):
    engine, model_a, model_b, _ = models
    ids = make_prompts()[0]
    norm = {n: t for n, t in model_b.state_dict().items() if n == "model.norm.weight"}
    engine.update_weights(norm.items(), version=7)
    assert engine.weight_history[-1] == {"version": 7, "tensors": 1, "complete": False}
    expected = copy.deepcopy(model_a)  # A with B's final norm
    expected.load_state_dict(norm, strict=False)
    assert_serves(engine, expected, ids)


def test_prefix_cache_never_serves_old_kv(models):
    engine, model_a, model_b, _ = models
    ids = make_prompts([48], seed=9)[0]
    engine.generate([ids], GREEDY)
    assert engine.generate([ids], GREEDY)[0].metrics["num_cached_tokens"] == 32  # cached under A
    engine.update_weights(model_b.state_dict().items())
    out = engine.generate([ids], GREEDY)[0]
    assert out.metrics["num_cached_tokens"] == 0
    assert out.outputs[0].token_ids == hf_greedy(model_b, ids, GREEDY.max_tokens)[0]


def test_steady_updates_replay_their_copy_plans(models, monkeypatch):
    """A trainer sends the same parameters after every step, updated in place: from the second update on
    each group's copy plan runs again unchecked and copies what the tensors hold now. A tensor at a new
    address, or a sleep that moves the engine's weights, plans that group afresh; a cast is never planned
    ahead (the reference's plan would keep the caller's tensors alive)."""
    engine, _, model_b, _ = models
    monkeypatch.setattr(engine.ops, "copy_plan", copies.copy_plan_triton)  # CUDA's plan, in Triton's interpreter
    checked = []
    resolve = engine.weights.resolve
    monkeypatch.setattr(engine.weights, "resolve", lambda group, *rest: (checked.extend(group), resolve(group, *rest))[1])
    trainer = {n: t.clone() for n, t in model_b.state_dict().items()}

    def update_and_check(tensors):
        engine.update_weights(tensors.items())
        for name, tensor in tensors.items():
            assert torch.equal(engine.weights.destination(engine.weights.canonical(name)), tensor.float()), name

    update_and_check(trainer)
    assert len(checked) == len(trainer)
    for t in trainer.values():
        t.neg_()  # an optimizer step, in place
    update_and_check(trainer)
    assert len(checked) == len(trainer)  # replayed, not checked again
    first = next(iter(trainer))
    trainer[first] = trainer[first] * 2  # a new tensor: its group is checked and planned again
    update_and_check(trainer)
    assert len(checked) > len(trainer)
    engine.sleep(level=1)
    engine.wake()  # on the CPU the weights now live elsewhere
    before = len(checked)
    update_and_check(trainer)
    assert len(checked) == before + len(trainer)
    half = {n: t.half() for n, t in trainer.items()}  # cast on the way in: checked every time
    update_and_check(half)
    update_and_check(half)
    assert len(checked) == before + 3 * len(trainer)


def test_a_group_replays_its_plan_only_for_its_engine_and_its_tensors(models, hf_checkpoint):
    """update_weights_from_buckets takes a weights.ReusableGroup, whose copy plan replays while its key holds. The
    key named no engine and no tensors: the group passed to a second engine copied into the first, and passed
    again with other tensors in .pairs copied the old ones (checking only the new); either way the version
    moved on while the old weights served."""
    engine, model_a, model_b, _ = models
    other = Engine(hf_checkpoint("llama3", seed=0)[0], device="cpu", kv_cache_memory=32 << 20)
    ids = make_prompts()[2]
    group = ReusableGroup([(n, p.detach()) for n, p in model_b.named_parameters()])
    assert engine.update_weights_from_buckets([group]) == 1
    assert other.update_weights_from_buckets([group]) == 1
    assert_serves(engine, model_b, ids)
    assert_serves(other, model_b, ids)
    group.pairs = [(n, p.detach().clone()) for n, p in model_a.named_parameters()]
    assert other.update_weights_from_buckets([group]) == 2
    assert_serves(other, model_a, ids)
    assert_serves(engine, model_b, ids)


def save_checkpoint(tensors: dict, config_from, path):
    """A one-file checkpoint of `tensors` beside a copy of `config_from`'s config.json."""
    path.mkdir()
    shutil.copy(config_from / "config.json", path)
    save_file({n: t.detach().clone().contiguous() for n, t in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def test_disk_update_reads_the_files_its_index_lists_and_refuses_one_missing(models, tmp_path):
    """A sharded checkpoint with a shard missing (a save still being written, a failed copy) is refused by the
    missing file's name, and the old weights serve on at the old version; the files the index lists are
    read, and no other."""
    engine, model_a, model_b, _ = models
    ids = make_prompts()[1]
    sharded = tmp_path / "sharded"
    model_b.save_pretrained(sharded, safe_serialization=True, max_shard_size="200KB")
    shards = sorted(f.name for f in sharded.glob("*.safetensors"))
    assert len(shards) == 3 and (sharded / "model.safetensors.index.json").exists()
    partial = shutil.copytree(sharded, tmp_path / "partial")
    (partial / shards[-1]).unlink()
    history = list(engine.weight_history)
    with pytest.raises(ValueError, match=rf"index\.json.*{shards[-1]}"):
        engine.update_weights_from_disk(partial)
    assert engine.weight_version == 0 and engine.weight_history == history
    assert_serves(engine, model_a, ids, version=0)
    (sharded / "stray.safetensors").write_bytes(b"not a safetensors file")  # not in the index: not read
    assert engine.update_weights_from_disk(sharded) == 1
    assert_serves(engine, model_b, ids, version=1)


@pytest.mark.parametrize("missing", ["model.norm.weight", "lm_head.weight"], ids=["norm", "tied-checkpoint"])
def test_disk_update_lacking_a_weight_is_refused_before_any_copy(models, tmp_path, missing):
    """A checkpoint must hold every weight the engine does: a from-disk update is a reload, and a gap would
    serve old and new weights mixed. "tied-checkpoint": a checkpoint that ties lm_head to the embedding
    carries no lm_head.weight, which this (untied) engine holds."""
    engine, model_a, model_b, path_b = models
    ids = make_prompts()[0]
    tensors = {n: t for n, t in model_b.state_dict().items() if n != missing}
    path = save_checkpoint(tensors, path_b, tmp_path / "lacking")
    with pytest.raises(ValueError, match=rf"lacks.*{missing}"):
        engine.update_weights_from_disk(path)
    assert engine.weight_version == 0 and len(engine.weight_history) == 0
    assert_serves(engine, model_a, ids, version=0)


@pytest.mark.parametrize("bad", ["shape", "dtype"])
def test_disk_update_with_a_late_tensor_of_another_shape_or_dtype_is_refused_before_any_copy(models, tmp_path,
                                                                                             monkeypatch, bad):
    """Every tensor's shape and dtype come from the files' headers and are checked before the first copy: a
    wrong one last in the file (past GROUP_BYTES in a real model: earlier groups would already be copied) is
    refused by name, and the old weights serve on at the old version."""
    monkeypatch.setattr(rollout_engine.weight_store, "GROUP_BYTES", 64 << 10)  # many groups: norm's is the last
    engine, model_a, model_b, path_b = models
    ids = make_prompts()[1]
    before = engine.generate([ids], GREEDY)[0].outputs[0].token_ids
    tensors = dict(model_b.state_dict())
    tensors["model.norm.weight"] = torch.ones(63) if bad == "shape" else torch.ones(64, dtype=torch.int64)
    path = save_checkpoint(tensors, path_b, tmp_path / f"bad-{bad}")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert list(f.keys())[-1] == "model.norm.weight"  # read (and copied) last
    history = list(engine.weight_history)
    wrong = r"shape \(63,\), expected \(64,\)" if bad == "shape" else "floating-point tensor of .*, got torch.int64"
    with pytest.raises(ValueError, match=rf"'model\.norm\.weight' (has|must).*{wrong}") as refused:
        engine.update_weights_from_disk(path)
    assert engine.weight_version == 0 and engine.weight_history == history
    assert engine.generate([ids], GREEDY)[0].outputs[0].token_ids == before
    assert_serves(engine, model_a, ids, version=0)
    assert "Nothing was copied" in str(refused.value)


@pytest.fixture
def tied(hf_checkpoint, tmp_path):
    """An engine that ties lm_head to its embedding (qwen3), the next model's weights, and a checkpoint of
    those weights with an lm_head of its own."""
    path, model = hf_checkpoint("qwen3", seed=0)
    path_b, model_b = hf_checkpoint("qwen3", seed=1)
    tensors = dict(model_b.state_dict())
    tensors["lm_head.weight"] = tensors["lm_head.weight"].flip(0)
    untied = save_checkpoint(tensors, path_b, tmp_path / "untied")
    return Engine(path, device="cpu", kv_cache_memory=32 << 20), model, tensors, untied


def test_tied_engine_refuses_a_checkpoint_whose_lm_head_differs_from_its_embedding(tied):
    engine, model, _, untied = tied
    ids = make_prompts()[2]
    with pytest.raises(ValueError, match="ties.*differ"):
        engine.update_weights_from_disk(untied)
    assert engine.weight_version == 0
    assert_serves(engine, model, ids, version=0)


def test_tied_engine_refuses_an_update_whose_lm_head_differs_from_its_embedding(tied, monkeypatch):
    """In one group nothing is copied; where the embedding went in an earlier group, the engine refuses to
    serve until a complete update (as for any failure after a copy)."""
    engine, model, tensors, _ = tied
    ids = make_prompts()[2]
    with pytest.raises(ValueError, match="ties.*differ"):
        engine.update_weights(tensors.items())
    assert engine.weight_version == 0
    assert_serves(engine, model, ids, version=0)
    monkeypatch.setattr(rollout_engine.weight_store, "GROUP_BYTES", 64 << 10)  # the embedding alone, first
    with pytest.raises(ValueError, match="ties.*differ"):
        engine.update_weights(tensors.items())
    assert engine.weight_version == 0
    with pytest.raises(WeightsNotReadyError):
        engine.generate([ids], GREEDY)
    engine.update_weights(model.state_dict().items())  # lm_head.weight is the embedding itself: accepted
    assert_serves(engine, model, ids, version=1)


def test_tied_names_that_differ_are_refused_in_one_group_or_across_groups(tied, monkeypatch):
    """[embed = E, lm_head = E + 1] into a tied engine is refused, in one group or across groups; a name given
    twice is refused before any tie is compared; a state dict (lm_head the embedding itself) is taken."""
    engine, model, _, _ = tied
    embed, head = "model.embed_tokens.weight", "lm_head.weight"
    e = model.model.embed_tokens.weight.detach().clone()
    for pairs in ([(embed, e), (head, e + 1)], [(head, e), (embed, e + 1)]):
        with pytest.raises(ValueError, match="ties.*differ"):
            engine.update_weights(pairs)
    with pytest.raises(ValueError, match="gives weight 'lm_head.weight' twice"):
        engine.update_weights([(embed, e), (head, e), (head, e + 1)])
    monkeypatch.setattr(rollout_engine.weight_store, "GROUP_BYTES", e.nbytes)  # [embed], [lm_head]
    with pytest.raises(ValueError, match="ties.*differ"):
        engine.update_weights([(embed, e), (head, e + 1)])
    monkeypatch.undo()
    complete = list(model.state_dict().items())  # lm_head.weight is the embedding itself
    assert engine.update_weights(complete) == 1
    assert_serves(engine, model, make_prompts()[2], version=1)
