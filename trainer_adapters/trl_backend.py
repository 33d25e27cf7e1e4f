"""The engine as the generation backend of TRL's GRPOTrainer, through its `rollout_func` hook.

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                          rollout_func=engine_rollout_func(engine, SamplingParams(max_tokens=64)))

TRL hands the hook each prompt `num_generations` times in a row; the engine generates each
prompt once with n = num_generations (the prompt is prefilled once and its blocks shared).
Before generating, the trainer's current weights are pushed into the engine whenever the
optimizer has stepped since the last push; after generating, the engine sleeps (level 2:
the next push brings every weight back), so the trainer has the memory while it trains.

Conversational prompts are rendered to token ids with the tokenizer's chat template (and the trainer's
`tools`, `chat_template` and `chat_template_kwargs`, as TRL renders them itself) and handed to the engine
as ids: rendering to text and letting the engine tokenize it again would add a second BOS to templates
that write their own (Llama 3, Mistral). Text prompts are tokenized by the engine, as TRL does.
"""
from __future__ import annotations

from dataclasses import replace

from rollout_engine.chat import render_chat

from .sync import sync_weights


def prompt_token_ids(prompt, trainer):
    """What the engine generates from: a text prompt as is, a conversation as its chat template's ids."""
    if isinstance(prompt, str):
        return prompt
    return {"prompt_token_ids": render_chat(
        trainer.processing_class, prompt, tools=getattr(trainer, "tools", None) or None,
        chat_template_kwargs=getattr(trainer, "chat_template_kwargs", None) or None,
        chat_template=getattr(trainer, "chat_template", None), name="prompt")}


def engine_rollout_func(engine, sampling_params, sleep_level: int = 2):
    synced_step = None

    def rollout(prompts, trainer):
        nonlocal synced_step
        group = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        inputs = [prompt_token_ids(p, trainer) for p in prompts[::group]]  # rendered before the engine changes
        if engine.is_sleeping:
            engine.wake(tags=["weights"])
        if synced_step != trainer.state.global_step:
            sync_weights(engine, trainer.accelerator.unwrap_model(trainer.model))
            synced_step = trainer.state.global_step
        engine.wake(tags=["kv_cache"])
        outputs = engine.generate(inputs, replace(sampling_params, n=group, logprobs=True), use_tqdm=False)
        engine.sleep(level=sleep_level)
        samples = [(o.prompt_token_ids, c) for o in outputs for c in o.outputs]
        return {"prompt_ids": [p for p, _ in samples], "completion_ids": [c.token_ids for _, c in samples],
                "logprobs": [c.logprobs for _, c in samples]}

    return rollout
