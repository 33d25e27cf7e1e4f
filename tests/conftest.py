"""Small random Hugging Face checkpoints of every supported family, built with transformers and saved."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels then run in Triton's interpreter; the flag is read when triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

VOCAB = 256

FAMILIES = {
    # GQA 4:2 with Llama-3 rope scaling, untied head.
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=2, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 64})),
    # Llama 2 style MHA with linear rope scaling, biases everywhere, tied embeddings.
    "llama-linear-bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True, mlp_bias=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=1, sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2, tie_word_embeddings=True)),
    # q/k norm, and head_dim (32) unequal to hidden_size / heads (16).
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)),
}


def build_hf_model(family: str, seed: int = 0):
    import transformers

    config_cls, model_cls, extra = FAMILIES[family]
    config = getattr(transformers, config_cls)(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=512, rms_norm_eps=1e-6, eos_token_id=VOCAB - 1, bos_token_id=0,
        initializer_range=0.2,  # logits spread well apart, so greedy ties are not a coin flip of rounding
        **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float().eval()
    with torch.no_grad():  # random norm weights too, so a mis-loaded norm cannot hide behind ones
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def hf_checkpoint(tmp_path_factory):
    """family -> (path, HF model), built once per session."""
    cache = {}

    def get(family: str, seed: int = 0):
        if (family, seed) not in cache:
            model = build_hf_model(family, seed)
            path = tmp_path_factory.mktemp(f"{family}-{seed}")
            model.save_pretrained(path, safe_serialization=True)
            cache[family, seed] = (path, model)
        return cache[family, seed]

    return get


TAME = 0.25  # projection weights N(0, 0.05): layers update the residual stream by a fraction of it


@pytest.fixture(scope="session")
def tame_checkpoint(tmp_path_factory):
    """family -> (path, HF model): build_hf_model's with the projections scaled by TAME, for fp8. The plain ones
    (N(0, 0.2)) give attention logits with a spread of ~10, where a 3% error of q or k moves which key wins;
    trained models, and these, are not that sensitive."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = build_hf_model(family)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if "proj" in name:
                        p.mul_(TAME)
            path = tmp_path_factory.mktemp(f"tame-{family}")
            model.save_pretrained(path, safe_serialization=True)
            cache[family] = (path, model)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The CLI's own tiny Qwen3 checkpoint with a real tokenizer."""
    from rollout_engine.tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny"))
