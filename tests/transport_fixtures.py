"""What the transport test files share: engine A (qwen2, seed 0) and the HF model B whose weights they send."""
import pytest
from helpers import GREEDY, hf_greedy, make_prompts

from rollout_engine import Engine

IDS = make_prompts()[0]


@pytest.fixture
def models(hf_checkpoint):
    path_a, model_a = hf_checkpoint("qwen2", seed=0)
    _, model_b = hf_checkpoint("qwen2", seed=1)
    return path_a, model_a, model_b


@pytest.fixture
def engine(models):
    return Engine(models[0], kv_cache_memory=1 << 22, max_num_seqs=4)


def serves(engine, model):
    assert engine.generate([IDS], GREEDY)[0].outputs[0].token_ids == hf_greedy(model, IDS, GREEDY.max_tokens)[0]
