"""The engine reads config.json as transformers does. Each checkpoint is saved by transformers, its config.json
edited as real checkpoints write it, and the engine's greedy tokens and logprobs are those of transformers' model
loaded back from the same directory in float32; a config.json that transformers would build no model from, or one
the engine cannot run exactly, is a ValueError that names the key."""
import json
import shutil

import pytest
import torch
import transformers
from conftest import FAMILIES, build_hf_model
from helpers import assert_serves, make_prompts

from rollout_engine import Engine

KV_BYTES = 16 << 20
PROMPT = make_prompts(lens=(40,))[0]


def engine(path, **kwargs):
    return Engine(path, device="cpu", kv_cache_memory=KV_BYTES, max_num_seqs=4, **kwargs)


def reference(path):
    """transformers' model of the checkpoint at `path`, in the float32 it is saved in."""
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def drop_set(*drop, **values):
    """A config.json edit: the keys `drop` removed, `values` set."""
    def edit(raw):
        for key in drop:
            raw.pop(key)
        raw.update(values)

    return edit


def edit_config(path, edit):
    raw = json.loads((path / "config.json").read_text())
    edit(raw)
    (path / "config.json").write_text(json.dumps(raw))
    return path


@pytest.fixture
def edited(hf_checkpoint, tmp_path):
    """(family, edit) -> a copy of the family's session checkpoint with `edit` applied to its config.json."""
    def copy(family, edit):
        return edit_config(shutil.copytree(hf_checkpoint(family)[0], tmp_path / family), edit)

    return copy


@pytest.fixture
def built(tmp_path, monkeypatch):
    """(family, edit, **config arguments) -> a checkpoint of the family (conftest.FAMILIES) built with those
    arguments on top of its own, then `edit` applied to its config.json."""
    def build(family, edit=drop_set(), **extra):
        config_cls, model_cls, own = FAMILIES[family]
        with monkeypatch.context() as patch:
            patch.setitem(FAMILIES, family, (config_cls, model_cls, {**own, **extra}))
            build_hf_model(family).save_pretrained(tmp_path / family, safe_serialization=True)
        return edit_config(tmp_path / family, edit)

    return build


def test_rope_scaling_wins_over_rope_parameters_with_the_top_level_rope_theta(edited):
    """Both dicts set: transformers runs rope_scaling's linear rope, with the top-level rope_theta (rope_scaling has
    none, and rope_parameters' is not read)."""
    path = edited("llama3", drop_set(rope_scaling={"rope_type": "linear", "factor": 2.0}, rope_theta=500.0))
    assert_serves(engine(path), reference(path), PROMPT)


def test_a_top_level_original_max_position_embeddings_wins_for_llama3_rope(edited):
    path = edited("llama3", drop_set(original_max_position_embeddings=128))
    assert_serves(engine(path), reference(path), PROMPT)


@pytest.mark.parametrize("drop", [(), ("max_position_embeddings",)], ids=["own", "class_default"])
def test_llama3_rope_without_original_max_position_embeddings_takes_max_position_embeddings(edited, drop):
    """It takes config.json's max_position_embeddings, or LlamaConfig's default (2048) where that is absent too."""
    def edit(raw):
        raw["rope_parameters"].pop("original_max_position_embeddings")
        drop_set(*drop)(raw)

    path = edited("llama3", edit)
    assert_serves(engine(path), reference(path), PROMPT)


def test_qwen_use_sliding_window_without_a_window_slides_at_4096(built):
    """transformers' default window (4096) applies: the engine caps sequences there, so attention stays exact."""
    path = built("qwen2", drop_set("sliding_window", max_position_embeddings=8192),
                 use_sliding_window=True, max_window_layers=0)
    assert reference(path).config.sliding_window == 4096
    assert engine(path).config.max_model_len == 4096
    with pytest.raises(ValueError, match="max_model_len=4097 exceeds"):
        engine(path, max_model_len=4097)


@pytest.mark.parametrize("drop", [(), ("layer_types",)], ids=["layer_types_saved", "layer_types_absent"])
def test_qwen_layers_below_max_window_layers_attend_in_full(built, drop):
    """Every layer is below max_window_layers, so none slides (as layer_types says, or as transformers derives it
    when config.json has none): the engine runs past the window and matches transformers."""
    path = built("qwen2", drop_set(*drop),
                 use_sliding_window=True, sliding_window=8, max_window_layers=2)
    assert_serves(engine(path), reference(path), PROMPT)


def test_qwen_all_sliding_layers_cap_sequences_at_the_window(built):
    path = built("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=0)
    assert reference(path).config.layer_types == ["sliding_attention"] * 2
    assert engine(path).config.max_model_len == 8


@pytest.mark.parametrize("drop", [(), ("layer_types",)], ids=["layer_types_saved", "layer_types_absent"])
def test_qwen_a_mix_of_sliding_and_full_layers_caps_sequences_at_the_window(built, drop):
    """Layer 0 attends in full, layer 1 slides: within the window the two are the same, so the cap keeps it exact."""
    path = built("qwen3", drop_set(*drop, max_position_embeddings=64),
                 use_sliding_window=True, sliding_window=16, max_window_layers=1)
    assert reference(path).config.layer_types == ["full_attention", "sliding_attention"]
    served = engine(path)
    assert served.config.max_model_len == 16  # a 4-token prompt and GREEDY's 12 tokens fill it
    assert_serves(served, reference(path), PROMPT[:4])


def test_qwen3_without_head_dim_takes_the_class_default_128(built):
    path = built("qwen3", drop_set("head_dim"), head_dim=128)
    model = reference(path)
    assert model.config.head_dim == 128
    assert_serves(engine(path), model, PROMPT)


def test_heads_not_a_multiple_of_kv_heads_are_refused_at_load(built):
    path = built("llama3", num_key_value_heads=3)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"):
        engine(path)


def _rope_factor(factor):
    return lambda raw: raw["rope_parameters"].update(factor=factor)


def _case(name, edit, match):
    return pytest.param(edit if callable(edit) else drop_set(**edit), match, id=name)


@pytest.mark.parametrize("edit, match", [
    _case("max_pos_str", dict(max_position_embeddings="4096"),
          "max_position_embeddings must be a positive int, got '4096'"),
    _case("max_pos_0", dict(max_position_embeddings=0), "max_position_embeddings must be a positive int, got 0"),
    _case("kv_float", dict(num_key_value_heads=2.0), "num_key_value_heads must be a positive int, got 2.0"),
    _case("head_dim_str", dict(head_dim="16"), "head_dim must be a positive int, got '16'"),
    _case("eps_str", dict(rms_norm_eps="1e-6"), "rms_norm_eps must be a finite number >= 0, got '1e-6'"),
    _case("eps_negative", dict(rms_norm_eps=-1), "rms_norm_eps must be a finite number >= 0, got -1"),
    _case("eos_str", dict(eos_token_id="x"), "config.json's eos_token_id must be an int or a list of ints, got 'x'"),
    _case("eos_list", dict(eos_token_id=[1, "x"]),
          r"config.json's eos_token_id must be an int or a list of ints, got \[1, 'x'\]"),
    # an id past the vocabulary is never sampled: its samples ran to max_tokens without a word
    _case("eos_past_vocab", dict(eos_token_id=[1, 10 ** 6]), r"eos_token_id \[1, 1000000\] is not a token of the model"),
    _case("eos_negative", dict(eos_token_id=-5), r"config.json's eos_token_id -5 is not a token of the model"),
    _case("tie_str", dict(tie_word_embeddings="false"), "config.json's tie_word_embeddings must be true or false"),
    _case("rope_factor_0", _rope_factor(0), r"rope_parameters\['factor'\] must be a finite number > 0, got 0"),
    _case("rope_factor_negative", _rope_factor(-2.0),
          r"rope_parameters\['factor'\] must be a finite number > 0, got -2.0"),
])
def test_a_malformed_config_value_is_a_value_error_naming_its_key(edited, edit, match):
    path = edited("llama3", edit)
    with pytest.raises(ValueError, match=match):
        engine(path)


def test_a_pre_quantized_checkpoint_is_refused(edited):
    path = edited("llama3", drop_set(quantization_config={"quant_method": "fp8"}))
    with pytest.raises(ValueError, match=r"quant_method='fp8'.*pre-quantized.*quantization='fp8'"):
        engine(path)
