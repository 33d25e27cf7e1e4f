"""The benchmarks' model shapes are checkpoints the engine takes: a device call that finds its config refused has
spent its start for nothing, and the CPU smoke runs (`--quick`) use other shapes."""
import pytest

from rollout_engine.config import ModelConfig
from test_benchmark_records import load


@pytest.mark.parametrize("name", sorted(load("common").SHAPES))
def test_every_benchmark_shape_is_a_config_the_engine_takes(tmp_path, name):
    common = load("common")
    config = ModelConfig.from_dir(common.shaped_checkpoint(name, tmp_path), need_weights=False)
    assert config.vocab_size == common.SHAPES[name]["vocab_size"]


def test_the_speculative_draft_takes_the_targets_vocabulary_and_eos(tmp_path):
    """The 1.7B-shaped draft of spec_decode.py and profile_spec.py kept Qwen's EOS id (151645) with the 8B target's
    vocabulary of 128256, which the config check refuses as no token of the model."""
    spec_decode = load("spec_decode")
    target, draft = spec_decode.checkpoints(tmp_path, "llama-3.1-8b", "qwen3-1.7b")
    target, draft = (ModelConfig.from_dir(path, need_weights=False) for path in (target, draft))
    assert (draft.vocab_size, draft.eos_token_ids) == (target.vocab_size, target.eos_token_ids)
    assert draft.hidden_size != target.hidden_size
