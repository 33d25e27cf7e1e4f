"""Write a small random Hugging Face checkpoint with a real tokenizer, so nothing needs a download."""
from __future__ import annotations

import random
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ("the a of to and in is it that for on with as was at by this be are from or an have not which one "
         "all their there when up out what so about who would more if has time two been into them some can "
         "model token sample reward policy engine memory block cache train step sleep wake weight rollout "
         "sum sort digit number answer question add first last next even odd yes no").split()


def _corpus(rng: random.Random, lines: int = 4000):
    for _ in range(lines):
        a, b = rng.randrange(1000), rng.randrange(1000)
        yield f"{a}+{b}={a + b} " + " ".join(rng.choice(WORDS) for _ in range(rng.randrange(4, 16))) + "."


def train_tokenizer(vocab_size: int = 512, seed: int = 0):
    """A byte-level BPE (digits kept one per token) trained on a built-in corpus; a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_corpus(random.Random(seed)), trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0])


def char_tokenizer(alphabet: str):
    """One token per character of `alphabet` (plus the special tokens): small vocabularies for toy tasks."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0], pad_token=SPECIAL_TOKENS[0])


def make_tiny_model(path, *, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                    intermediate_size: int = 128, vocab_size: int = 512, max_position_embeddings: int = 2048,
                    seed: int = 0, dtype: torch.dtype = torch.float32, alphabet: str | None = None) -> Path:
    """A random Qwen3-architecture checkpoint (config.json, model.safetensors, tokenizer) in `path`.

    The tokenizer is a byte-level BPE trained on a built-in corpus, or with `alphabet` one token per character."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = char_tokenizer(alphabet) if alphabet else train_tokenizer(vocab_size, seed)
    eos = tokenizer.convert_tokens_to_ids(SPECIAL_TOKENS[0])
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True, eos_token_id=eos, bos_token_id=eos, pad_token_id=eos,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
