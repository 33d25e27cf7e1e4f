"""The engine as the generation backend of TRL's GRPOTrainer, through its `rollout_func` hook.

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                          rollout_func=engine_rollout_func(engine, SamplingParams(max_tokens=64)))

TRL hands the hook each prompt `num_generations` times in a row; the engine generates each
prompt once with n = num_generations (the prompt is prefilled once and its blocks shared).
Before generating, the trainer's current weights are pushed into the engine whenever the
optimizer has stepped since the last push; after generating, the engine sleeps (level 2:
the next push brings every weight back), so the trainer has the memory while it trains.
"""
from __future__ import annotations

from dataclasses import replace

from .sync import sync_weights


def engine_rollout_func(engine, sampling_params, sleep_level: int = 2):
    synced_step = None

    def rollout(prompts, trainer):
        nonlocal synced_step
        group = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        if engine.is_sleeping:
            engine.wake(tags=["weights"])
        if synced_step != trainer.state.global_step:
            sync_weights(engine, trainer.accelerator.unwrap_model(trainer.model))
            synced_step = trainer.state.global_step
        engine.wake(tags=["kv_cache"])
        unique = prompts[::group]
        texts = [p if isinstance(p, str) else trainer.processing_class.apply_chat_template(
            p, tokenize=False, add_generation_prompt=True) for p in unique]
        outputs = engine.generate(texts, replace(sampling_params, n=group, logprobs=True), use_tqdm=False)
        engine.sleep(level=sleep_level)
        samples = [(o.prompt_token_ids, c) for o in outputs for c in o.outputs]
        return {"prompt_ids": [p for p, _ in samples], "completion_ids": [c.token_ids for _, c in samples],
                "logprobs": [c.logprobs for _, c in samples]}

    return rollout
