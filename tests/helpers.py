"""Shared test helpers: prompts and transformers' own greedy continuation."""
import torch
from conftest import VOCAB


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
