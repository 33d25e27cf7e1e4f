"""Speculative decoding's arguments: what a seed promises, how long a proposal may be, how a bad draft path is
reported, and that a draft update carries no weight version."""
import ast
import re
from pathlib import Path

import pytest
import torch
from helpers import make_prompts

from rollout_engine import Engine, SamplingParams
from rollout_engine.config_checks import MAX_SPECULATIVE_TOKENS
from rollout_engine.spec import NGRAM, SPEC_MAX_BATCH
from rollout_engine.tiny_model import make_tiny_model

ROOT = Path(__file__).resolve().parents[1]
KV = 8 << 20
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def target(hf_checkpoint):
    return hf_checkpoint("qwen3", seed=0)[0]


def spec_engine(path, draft, k=3, **kw):
    return Engine(path, device="cpu", kv_cache_memory=KV, draft_model=draft, num_speculative_tokens=k, **kw)


# ---------------------------------------------------------------- a seed under speculative decoding


def test_greedy_sample_with_a_draft_is_the_same_whatever_else_is_in_the_batch(target):
    """Alone the request speculates; beside more than SPEC_MAX_BATCH others it starts on the plain path."""
    prompt, others = make_prompts((20,), seed=1)[0], make_prompts((8,) * (SPEC_MAX_BATCH + 4), seed=2)
    noisy = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    alone = spec_engine(target, target).generate([prompt], GREEDY)[0].outputs[0].token_ids
    crowded = spec_engine(target, target).generate([prompt] + others, [GREEDY] + [noisy] * len(others))
    assert crowded[0].outputs[0].token_ids == alone


def seed_sentences(text: str) -> list[str]:
    return [s for s in re.split(r"(?<=\.)\s", " ".join(text.split())) if "seed" in s]


def test_the_seed_guarantee_names_its_speculative_exception():
    """Where the docs promise that a seed fixes a sample whatever the batch, they say speculative decoding at
    temperature > 0 keeps only the distribution."""
    readme = (ROOT / "README.md").read_text()
    promise = next(s for s in seed_sentences(readme) if "whatever else is in the batch" in s)
    assert "speculative" in promise and "temperature > 0" in promise and "same distribution" in promise
    pool = ast.get_docstring(ast.parse((ROOT / "rollout_engine" / "ray_pool.py").read_text()))
    claim = " ".join(pool.split())
    assert "equal those of one fresh Engine" in claim
    after = claim.split("equal those of one fresh Engine", 1)[1]
    assert "speculative decoding" in after and "temperature > 0" in after and "same distribution" in after


# ---------------------------------------------------------------- num_speculative_tokens' range


@pytest.mark.parametrize("k", [MAX_SPECULATIVE_TOKENS + 1, 10 ** 6])
def test_num_speculative_tokens_above_the_maximum_is_refused(target, k):
    with pytest.raises(ValueError, match=rf"num_speculative_tokens={k} is not allowed; 1\.\.{MAX_SPECULATIVE_TOKENS}"):
        spec_engine(target, target, k)
    with pytest.raises(ValueError, match=rf"1\.\.{MAX_SPECULATIVE_TOKENS}"):
        spec_engine(target, NGRAM, k)


def test_num_speculative_tokens_must_leave_room_in_max_model_len(target):
    with pytest.raises(ValueError, match=r"num_speculative_tokens=16 is not allowed; 1\.\.15 .*max_model_len=16"):
        spec_engine(target, target, 16, max_model_len=16)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec_engine(target, target, 1, max_model_len=1)
    assert spec_engine(target, target, 15, max_model_len=16).num_speculative_tokens == 15


def test_the_largest_num_speculative_tokens_still_decodes_exactly(target):
    plain = Engine(target, device="cpu", kv_cache_memory=KV).generate(make_prompts((5,)), GREEDY)
    engine = spec_engine(target, target, MAX_SPECULATIVE_TOKENS)
    assert engine.generate(make_prompts((5,)), GREEDY)[0].outputs[0].token_ids == plain[0].outputs[0].token_ids


# ---------------------------------------------------------------- a bad draft path


def test_a_missing_draft_is_reported_as_draft_model(target, tmp_path):
    missing = tmp_path / "nonexistent"
    with pytest.raises(ValueError, match="draft_model") as err:
        spec_engine(target, str(missing))
    assert "model_path" not in str(err.value) and str(missing) in str(err.value)
    with pytest.raises(ValueError, match=r"^model_path .* has no config\.json"):  # the target keeps its name
        Engine(missing, device="cpu")


@pytest.mark.parametrize("spelling", ["ngram", "NGRAM", "[ngram", "n-gram"])
def test_prompt_lookup_misspelled_gets_the_right_spelling(target, tmp_path, monkeypatch, spelling):
    monkeypatch.chdir(tmp_path)  # no directory of that name here
    with pytest.raises(ValueError, match=r"draft_model .*; use '\[ngram\]' for prompt lookup"):
        spec_engine(target, spelling)
    assert spec_engine(target, NGRAM).generate(make_prompts((5,)), GREEDY)[0].outputs[0].token_ids


def test_a_draft_with_another_tokenizer_of_the_same_size_is_refused(tmp_path):
    """Same vocabulary size, other ids: refused by name; the same tokenizer in another checkpoint is taken."""
    letters = "abcdefghij"
    target = make_tiny_model(tmp_path / "target", alphabet=letters, vocab_size=32)
    shuffled = make_tiny_model(tmp_path / "shuffled", alphabet="klmnopqrst", vocab_size=32, seed=1)
    same = make_tiny_model(tmp_path / "same", alphabet=letters, vocab_size=32, seed=2)
    with pytest.raises(ValueError, match=r"^draft_model's tokenizer .*shuffled.* differs from the target's: 20 "):
        spec_engine(target, shuffled, k=2)
    engine = spec_engine(target, same, k=2)
    assert engine.generate(["abc"], GREEDY)[0].outputs[0].token_ids


# ---------------------------------------------------------------- a draft update carries no version


def test_a_draft_update_with_a_version_is_refused_before_any_copy(target, hf_checkpoint):
    other_path, other = hf_checkpoint("qwen3", seed=7)
    engine = spec_engine(target, target)
    engine.update_weights(list(other.named_parameters()), version=1)  # the target at version 1
    before = engine.generate(make_prompts((5,)), GREEDY)[0].outputs[0].token_ids
    draft_embedding = engine.weight_store.tables["draft"].destination("model.embed_tokens.weight")
    kept, history = draft_embedding.clone(), list(engine.weight_history)
    for version in (0, 1, 7, -3):
        with pytest.raises(ValueError, match=rf"version={version} is not allowed with model='draft'.*version=None"):
            engine.update_weights(list(other.named_parameters()), version=version, model="draft")
        with pytest.raises(ValueError, match="model='draft'"):
            engine.update_weights_from_disk(other_path, version=version, model="draft")
    assert torch.equal(draft_embedding, kept), "a refused update copied nothing"
    assert engine.weight_version == 1 and engine.weight_history == history
    assert engine.generate(make_prompts((5,)), GREEDY)[0].outputs[0].token_ids == before
    assert engine.update_weights(list(other.named_parameters()), model="draft") == 1  # version=None: accepted
    assert torch.equal(draft_embedding, other.get_parameter("model.embed_tokens.weight").detach())
