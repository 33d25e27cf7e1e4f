"""Shared test helpers: prompts, transformers' own greedy continuation, and a check against it."""
import torch
from conftest import VOCAB

from rollout_engine import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_prompts(lens=(5, 17, 40), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in lens]


def hf_logprobs(model, ids, tokens):
    """log_softmax of transformers' logits at each of `tokens`, continuing `ids`."""
    with torch.no_grad():
        logits = model(torch.tensor([ids + tokens])).logits[0].float()
    return logits.log_softmax(-1)[len(ids) - 1 : -1].gather(1, torch.tensor(tokens)[:, None])[:, 0]


def hf_greedy(model, ids, max_new_tokens):
    """Greedy tokens from transformers' forward (argmax each step; EOS not special, like ignore_eos)
    and their logprobs."""
    tokens = []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(model(torch.tensor([ids + tokens])).logits[0, -1].argmax()))
    return tokens, hf_logprobs(model, ids, tokens)


def assert_serves(engine, model, ids, version=None):
    """The engine's greedy tokens and logprobs for `ids` are transformers' with `model` (and, if given,
    its outputs carry weight_version `version`)."""
    got = engine.generate([ids], GREEDY)[0]
    tokens, logprobs = hf_greedy(model, ids, GREEDY.max_tokens)
    assert got.outputs[0].token_ids == tokens
    assert version is None or got.weight_version == version
    torch.testing.assert_close(torch.tensor(got.outputs[0].logprobs), logprobs, atol=1e-4, rtol=0)


def agreeing_runs(runs, reference_runs, atol=0.05) -> int:
    """How many of `runs` ((token_ids, logprobs) each) keep all their tokens equal to `reference_runs`', where the
    two differ only in the order of float32 sums: each pair's logprobs agree within `atol` up to their first
    differing token (a near-tie), after which the two continue different texts."""
    same = 0
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(runs, reference_runs, strict=True):
        agree = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), len(tokens))
        same += agree == len(tokens)
        torch.testing.assert_close(torch.tensor(logprobs[:agree]), torch.tensor(ref_logprobs[:agree]),
                                   atol=atol, rtol=0)
    return same


def cos_sin(max_pos, dim, base=10000.0):
    """A rotary table as rollout_kernels' rope_store takes it: [max_pos, dim] float32, the cos of each position's dim / 2
    angles, then their sin (computed in float64)."""
    inv = base ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv
    return torch.cat([angles.cos(), angles.sin()], -1).float()


def config_twin(model, **changes):
    """A model of `model`'s class and config with `changes` (new random weights)."""
    return type(model)(type(model.config)(**{**model.config.to_dict(), **changes}))


def tied_twin(model):
    """`model`'s config with lm_head tied to the embedding: its parameters hold no lm_head.weight."""
    twin = config_twin(model, tie_word_embeddings=True)
    assert "lm_head.weight" not in dict(twin.named_parameters())
    return twin
