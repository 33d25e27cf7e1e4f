"""The engine as TRL's GRPO generation backend: a few GRPOTrainer steps on the CPU with a tiny model."""
import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

from rollout_engine import Engine, SamplingParams  # noqa: E402
from trainer_adapters.trl_backend import engine_rollout_func  # noqa: E402


def test_trl_grpo_steps_use_the_engine(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=32 << 20)
    calls = []
    rollout = engine_rollout_func(engine, SamplingParams(max_tokens=6, temperature=1.0))

    def counted(prompts, trainer):
        out = rollout(prompts, trainer)
        calls.append((len(prompts), engine.weight_version))
        assert len(out["completion_ids"]) == len(prompts)
        assert all(len(c) == len(lp) for c, lp in zip(out["completion_ids"], out["logprobs"]))
        return out

    def reward(completions, **kwargs):
        return [float(len(c)) for c in completions]

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=3, learning_rate=1e-3, logging_steps=1,
                          report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0)
    data = datasets.Dataset.from_dict({"prompt": ["12+34=", "the model", "sum of", "wake up"] * 4})
    trainer = trl.GRPOTrainer(model=str(tiny_checkpoint), reward_funcs=reward, args=args, train_dataset=data,
                              processing_class=engine.tokenizer, rollout_func=counted)
    trainer.train()
    assert len(calls) == 3 and all(n == 4 for n, _ in calls)
    # The first rollout pushes the initial weights; each later one pushes the weights of the step before.
    assert [v for _, v in calls] == [1, 2, 3]
    assert engine.is_sleeping  # asleep between rollouts, as in a colocated run
    engine.wake(tags=["weights"])
    trained = dict(trainer.model.named_parameters())
    changed = any(not torch.equal(engine.weights.destination(n), trained[n].detach())
                  for n in engine.weights.names() if n in trained)
    assert changed, "the last optimizer step happened after the last rollout, so the engine lags by one step"


def test_trl_conversational_prompts_are_rendered_to_ids_once(tiny_checkpoint, tmp_path, monkeypatch):
    """Chat prompts reach the engine as the template's ids: one BOS with a Llama-3-style template whose
    tokenizer also adds a BOS to plain text (text re-tokenized by the engine would start with two), and
    the prompt ids TRL trains on are exactly what TRL's own apply_chat_template gives."""
    from test_chat import LLAMA3, with_template

    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    path = with_template(tiny_checkpoint, tmp_path / "llama3", LLAMA3, bos=True)
    engine = Engine(path, device="cpu", kv_cache_memory=32 << 20)
    tok, bos = engine.tokenizer, engine.tokenizer.bos_token_id
    rollout = engine_rollout_func(engine, SamplingParams(max_tokens=6, temperature=1.0))
    seen = []

    def counted(prompts, trainer):
        out = rollout(prompts, trainer)
        seen.extend(zip(prompts, out["prompt_ids"]))
        return out

    args = trl.GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                          max_completion_length=6, max_steps=2, learning_rate=1e-3, logging_steps=1,
                          report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0)
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
             for text in ("12+34=", "the model", "sum of", "wake up")]
    data = datasets.Dataset.from_dict({"prompt": chats * 4})
    trainer = trl.GRPOTrainer(model=str(path), reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                              args=args, train_dataset=data, processing_class=tok, rollout_func=counted)
    trainer.train()
    assert len(seen) == 8
    for prompt, ids in seen:
        assert ids[0] == bos and ids[1] != bos, "a second BOS: the chat template's text was tokenized again"
        assert ids == tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=False)
    text = tok.apply_chat_template(chats[0], tokenize=False, add_generation_prompt=True)
    assert tok(text)["input_ids"][:2] == [bos, bos]  # what the old text path gave
