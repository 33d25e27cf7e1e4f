"""The engine as the generation backend of TRL's GRPOTrainer, through its `rollout_func` hook.

    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(max_completion_length=64, temperature=0.9),
                          rollout_func=engine_rollout_func(engine, SamplingParams()))

TRL hands the hook each prompt `num_generations` times in a row, but a process may get only part of a
group (its RepeatSampler keeps groups whole across processes: with 2 of each on 2 processes, [p0, p0, p1]
and [p1, p2, p2]). The hook returns one completion per prompt handed in, in order: each run of consecutive
equal prompts is one request with n = the run's length (the prompt is prefilled once and its blocks shared).
The parts of a split group are sampled by different engines: seed each process's engine differently
(Engine(seed=rank)) and leave SamplingParams.seed None, else two parts can draw the same completions.
Before generating, the trainer's current weights are pushed into the engine whenever the
optimizer has stepped since the last push, or the engine's weights were discarded (a level-2
sleep) since then; after generating, the engine sleeps (level 2: the next rollout brings every
weight back, even at the same step: gradient accumulation, an evaluation), so the trainer has the
memory while it trains.

The sampling settings are the trainer's: TRL scores the completions at `args.temperature` and
treats them as samples of `args.temperature`, `top_p`, `top_k`, `min_p`, at most
`args.max_completion_length` tokens. The hook returns the engine's logprobs in SamplingParams.logprobs_mode:
by default of the distribution each token was drawn from (with top-k, top-p or min-p: renormalised over the
tokens they keep); "temperature" gives TRL's own distribution. TRL (1.x) reads them in
two places. Its importance-sampling correction, which it applies with `use_vllm=True` alone: here the rollout
is treated as on-policy (a UserWarning says so where `vllm_importance_sampling_correction` asks for it). And
its off-policy sequence mask, whenever `off_policy_mask_threshold` is set, whatever use_vllm: it compares
them with its own logprobs at `args.temperature` over the whole vocabulary, which differ from truncated ones
though no weight changed, so with top-k, top-p or min-p on (or logprobs_mode "raw" at a temperature other
than 1) the mask drops sequences for a drift that is not there (a UserWarning says so). A corrected loss
against the engine's logprobs: trainer_adapters.grpo's `policy_loss` with truncated IS.
A field the adapter's SamplingParams leaves at its default takes the trainer's value; one it sets
to another value is a ValueError naming both, as is a `repetition_penalty` other than 1 or any
`generation_kwargs` (the engine would ignore them).

Conversational prompts are rendered to token ids with the tokenizer's chat template (and the trainer's
`chat_template` and `chat_template_kwargs`, as TRL renders them itself) and handed to the engine
as ids: rendering to text and letting the engine tokenize it again would add a second BOS to templates
that write their own (Llama 3, Mistral). Text prompts are tokenized by the engine, as TRL does.
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import replace

from rollout_engine import SamplingParams
from rollout_engine.chat import render_chat

from .sync import check_model_fits, sync_weights, weights_sleep_level

# SamplingParams field -> the GRPOConfig field TRL samples and scores with (GRPOTrainer reads these from args)
TRAINER_ARGS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                "max_tokens": "max_completion_length"}
DEFAULTS = SamplingParams()
SLEEP_LEVELS = (1, 2)


def prompt_token_ids(prompt, trainer):
    """What the engine generates from: a text prompt as is, a conversation as its chat template's ids."""
    if isinstance(prompt, str):
        return prompt
    return {"prompt_token_ids": render_chat(
        trainer.processing_class, prompt, chat_template_kwargs=getattr(trainer, "chat_template_kwargs", None) or None,
        chat_template=getattr(trainer, "chat_template", None), name="prompt")}


def trainer_sampling_params(sampling_params: SamplingParams, trainer) -> SamplingParams:
    """`sampling_params` with the trainer's generation settings (trainer.args, a GRPOConfig; none: unchanged).

    Each field of TRAINER_ARGS that `sampling_params` leaves at its default takes the trainer's value (TRL's top_k
    0 and min_p None mean off: the engine's -1 and 0; max_completion_length None: the SamplingParams' max_tokens);
    a field set to another value than the trainer's is a ValueError naming both. So are a repetition_penalty other
    than 1 and any generation_kwargs (the engine has neither, and TRL would train as if they had applied), and stop
    strings or tokens with mask_truncated_completions (TRL would drop each completion they stop)."""
    args = getattr(trainer, "args", None)
    if args is None:
        return sampling_params
    penalty = getattr(args, "repetition_penalty", None)
    if penalty not in (None, 1, 1.0):
        raise ValueError(f"trainer.args.repetition_penalty={penalty!r} is not allowed with the engine backend; 1.0 "
                         "(the engine samples without a repetition penalty)")
    if getattr(args, "generation_kwargs", None):
        raise ValueError(f"trainer.args.generation_kwargs={args.generation_kwargs!r} is not allowed with the engine "
                         "backend; None (the engine reads no generation kwargs: set temperature, top_p, top_k, min_p "
                         "and max_completion_length on the GRPOConfig)")
    if getattr(args, "mask_truncated_completions", False) and (sampling_params.stop or sampling_params.stop_token_ids):
        raise ValueError("sampling_params.stop / stop_token_ids are not allowed with trainer.args."
                         "mask_truncated_completions=True: TRL reads a completion that does not end in EOS as "
                         "truncated and drops it from the loss, so every stopped one would be dropped")
    changes = {}
    for field, arg in TRAINER_ARGS.items():
        if not hasattr(args, arg):
            continue
        theirs = getattr(args, arg)
        if field == "top_k" and theirs in (0, None):
            theirs = -1
        elif field == "min_p" and theirs is None:
            theirs = 0.0
        elif theirs is None:
            continue
        ours = getattr(sampling_params, field)
        if ours == getattr(DEFAULTS, field):
            changes[field] = theirs
        elif ours != theirs:
            raise ValueError(f"sampling_params.{field}={ours!r} disagrees with trainer.args.{arg}="
                             f"{getattr(args, arg)!r}: TRL scores and trains on the completions as sampled with "
                             f"trainer.args; set {arg} on the GRPOConfig and leave {field} at its default "
                             f"({getattr(DEFAULTS, field)!r}) in the SamplingParams, or make them equal")
    try:
        return replace(sampling_params, **changes)
    except ValueError as err:
        raise ValueError(f"trainer.args gives the engine {changes}: {err}") from err


def prompt_runs(prompts) -> list[tuple[object, int]]:
    """(prompt, count) for each run of consecutive equal prompts, in order: the groups, or parts of groups, that
    TRL handed this process (a group split between processes starts or ends the list short)."""
    return [(prompt, sum(1 for _ in run)) for prompt, run in itertools.groupby(prompts)]


def logprob_warnings(trainer, params: SamplingParams) -> list[str]:
    """What the trainer's config makes of the logprobs the hook returns, where it is not what the config asks for:
    a correction TRL does not apply, or a mask that compares logprobs of two different distributions."""
    args, messages = getattr(trainer, "args", None), []
    if getattr(args, "vllm_importance_sampling_correction", False) and not getattr(trainer, "use_vllm", False):
        messages.append("GRPOConfig.vllm_importance_sampling_correction is on, but TRL applies it only with "
                        "use_vllm=True: with this rollout_func it reads none of the engine's logprobs for it and "
                        "trains as if on-policy (set it to False to silence this; trainer_adapters.grpo.policy_loss "
                        "corrects against the engine's logprobs)")
    if getattr(args, "off_policy_mask_threshold", None) is None:
        return messages
    mask = (f"GRPOConfig.off_policy_mask_threshold={args.off_policy_mask_threshold!r} masks sequences by the KL "
            "between the engine's logprobs and TRL's (over the whole vocabulary at the temperature), but ")
    if params.logprobs_mode == "processed" and params.truncates:
        messages.append(mask + f"with top_k, top_p or min_p on (here {params.top_k}, {params.top_p}, "
                        f"{params.min_p}) the engine's are renormalised over the tokens kept: they differ though no "
                        "weight changed, and the mask drops negative-advantage sequences for it (set "
                        "SamplingParams(logprobs_mode='temperature'), or turn the truncation or the mask off)")
    if params.logprobs_mode == "raw" and params.temperature != 1:
        messages.append(mask + f"logprobs_mode='raw' gives the engine's at temperature 1, not {params.temperature}: "
                        "they differ though no weight changed (set SamplingParams(logprobs_mode='temperature'))")
    return messages


def engine_rollout_func(engine, sampling_params: SamplingParams, sleep_level: int | None = None):
    """TRL's `rollout_func`: the engine generates, with the trainer's weights and generation settings, then sleeps
    at `sleep_level` (None: 2, or 1 where the engine holds a speculative draft model, whose weights the trainer
    does not push back: sync.weights_sleep_level). The trainer's model must fit the engine's weights
    (sync.check_model_fits), checked at the first rollout before the engine changes."""
    if not isinstance(sampling_params, SamplingParams):
        raise ValueError(f"sampling_params is a {type(sampling_params).__name__}; it must be a SamplingParams")
    if sleep_level is not None and (isinstance(sleep_level, bool) or sleep_level not in SLEEP_LEVELS):
        raise ValueError(f"sleep_level={sleep_level!r} is not allowed; None or one of {SLEEP_LEVELS} (engine.sleep's "
                         "levels)")
    synced_step = None  # the trainer's global_step whose weights the engine holds; None: none held
    warned = set()  # each warning once per hook, not once per rollout

    def rollout(prompts, trainer):
        nonlocal synced_step
        if getattr(trainer, "tools", None) or getattr(trainer, "environment_factories", None):
            raise ValueError("GRPOTrainer's tools / environment_factory are not supported with engine_rollout_func: "
                             "TRL generates each turn after a tool call itself, with the trainer's model and not "
                             "through rollout_func; run multi-turn rollouts on the engine with "
                             "trainer_adapters.Episode")
        params = trainer_sampling_params(sampling_params, trainer)  # refused before the engine changes
        for message in logprob_warnings(trainer, params):
            if message not in warned:
                warned.add(message)
                warnings.warn(message, UserWarning, stacklevel=2)
        groups = prompt_runs(prompts)
        inputs = [prompt_token_ids(p, trainer) for p, _ in groups]  # rendered before the engine changes
        per_prompt = [replace(params, n=count, logprobs=True) for _, count in groups]
        level = weights_sleep_level(engine) if sleep_level is None else sleep_level
        if level == 2 and weights_sleep_level(engine) == 1:
            raise ValueError("sleep_level=2 is not allowed with a speculative draft model: it would discard the "
                             "draft's weights, which no trainer pushes back; pass 1 or None")
        model = trainer.accelerator.unwrap_model(trainer.model)
        if synced_step != trainer.state.global_step:
            check_model_fits(engine, model)  # before the engine changes
        if engine.is_sleeping:
            engine.wake(tags=["weights"])
        try:
            if synced_step != trainer.state.global_step:
                sync_weights(engine, model)
                synced_step = trainer.state.global_step
        finally:  # a refused sync leaves the engine awake (its weights incomplete), not holding half its memory
            engine.wake(tags=["kv_cache"])
        try:
            outputs = engine.generate(inputs, per_prompt, use_tqdm=False)
        finally:  # a failed rollout (a prompt past max_model_len) hands the memory back too: the trainer runs next
            engine.sleep(level=level)
            if level == 2:  # the weights are discarded: the next rollout pushes them again, even at this step
                synced_step = None
        samples = [(o.prompt_token_ids, c) for o in outputs for c in o.outputs]
        return {"prompt_ids": [p for p, _ in samples], "completion_ids": [c.token_ids for _, c in samples],
                "logprobs": [c.logprobs for _, c in samples]}

    return rollout
