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
    with pytest.warns(UserWarning, match="applies it only with use_vllm=True") as caught:  # once, not per rollout
        trainer.train()
    assert sum("vllm_importance_sampling_correction" in str(w.message) for w in caught) == 1
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


# ---------------------------------------------------------------- a hand-made trainer: what the hook reads of one

def fake_trainer(model, tokenizer, args=None, step=0):
    """The attributes of a GRPOTrainer that engine_rollout_func reads; `args` None: a trainer without args."""
    from types import SimpleNamespace

    trainer = SimpleNamespace(num_generations=2, num_generations_eval=2, model=model,
                              state=SimpleNamespace(global_step=step), processing_class=tokenizer,
                              accelerator=SimpleNamespace(unwrap_model=lambda m: m))
    if args is not None:
        trainer.args = SimpleNamespace(**args)
    return trainer


class UntouchableEngine:
    """Fails the test on any use: a refused setting must be refused before the engine changes."""

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} was used before the trainer's settings were checked")


@pytest.fixture
def policy(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_a_second_rollout_at_the_same_step_finds_the_weights(tiny_checkpoint, policy, sleep_level):
    """A train rollout, then an eval rollout at the same global_step: after a level-2 sleep (weights discarded) the
    second rollout pushes the weights again (it was refused: WeightsNotReadyError); after a level-1 sleep (a host
    copy kept) it does not need to."""
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20)
    trainer = fake_trainer(policy.train(), engine.tokenizer)
    rollout = engine_rollout_func(engine, SamplingParams(max_tokens=2), sleep_level=sleep_level)
    rollout(["the model", "the model"], trainer)
    first = engine.weight_version
    trainer.model.eval()
    out = rollout(["wake up", "wake up"], trainer)
    assert len(out["completion_ids"]) == 2 and engine.is_sleeping
    assert engine.weight_version == first + (1 if sleep_level == 2 else 0)


@pytest.mark.parametrize("sleep_level", [1, 2])
def test_a_failed_rollout_still_puts_the_engine_to_sleep(tiny_checkpoint, policy, sleep_level):
    """A rollout whose generate() refuses a prompt (past max_model_len) left the engine awake, holding its KV pool
    (and at level 2 its weights) while the trainer went on; now it sleeps as after a rollout that succeeds, and the
    next rollout (after a level-2 sleep: weights pushed again) generates."""
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20, max_model_len=64)
    trainer = fake_trainer(policy.train(), engine.tokenizer)
    rollout = engine_rollout_func(engine, SamplingParams(max_tokens=2), sleep_level=sleep_level)
    with pytest.raises(ValueError, match="max_model_len"):
        rollout(["the model " * 40] * 2, trainer)
    assert engine.is_sleeping
    out = rollout(["wake up", "wake up"], trainer)
    assert [len(c) for c in out["completion_ids"]] == [2, 2] and engine.is_sleeping


@pytest.mark.parametrize("prompts", [["the model", "the model", "wake up"], ["wake up", "12+34=", "12+34="],
                                     ["12+34="], ["the model", "wake up", "the model", "the model"]])
def test_a_process_given_part_of_a_group_gets_one_completion_per_prompt(tiny_checkpoint, policy, prompts):
    """TRL's RepeatSampler keeps each prompt's num_generations copies whole across processes, not on each one: with
    2 copies on 2 processes, one gets [p0, p0, p1] and the other [p1, p2, p2]. Each process gets one completion per
    prompt it handed in, in order, on that prompt's ids (it got 4 for 3, the last on the wrong prompt)."""
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20)
    trainer = fake_trainer(policy.train(), engine.tokenizer)
    out = engine_rollout_func(engine, SamplingParams(max_tokens=3, ignore_eos=True))(prompts, trainer)
    assert [len(out[key]) for key in ("prompt_ids", "completion_ids", "logprobs")] == [len(prompts)] * 3
    assert [engine.tokenizer.decode(ids) for ids in out["prompt_ids"]] == prompts
    assert [len(c) for c in out["completion_ids"]] == [3] * len(prompts)
    assert all(len(c) == len(lp) for c, lp in zip(out["completion_ids"], out["logprobs"]))


def test_trl_gradient_accumulation_rolls_out_twice_per_step(tiny_checkpoint, tmp_path, monkeypatch):
    """gradient_accumulation_steps=2 with steps_per_generation=1: TRL rolls out at every micro-step, twice per
    global_step; the second finds the engine asleep at level 2 and pushes the weights again (train() raised
    WeightsNotReadyError)."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20)
    rollout = engine_rollout_func(engine, SamplingParams())
    steps = []

    def counted(prompts, trainer):
        steps.append(trainer.state.global_step)
        return rollout(prompts, trainer)

    args = trl.GRPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, num_generations=2,
                          gradient_accumulation_steps=2, steps_per_generation=1, max_completion_length=3,
                          max_steps=1, learning_rate=1e-3, report_to=[], use_cpu=True, bf16=False,
                          save_strategy="no", seed=0)
    data = datasets.Dataset.from_dict({"prompt": ["12+34=", "the model", "sum of", "wake up"] * 2})
    trainer = trl.GRPOTrainer(model=str(tiny_checkpoint), args=args,
                              reward_funcs=lambda completions, **kw: [1.0] * len(completions),
                              train_dataset=data, processing_class=engine.tokenizer, rollout_func=counted)
    trainer.train()
    assert steps == [0, 0] and engine.weight_version == 2


TRAINER_ARGS = dict(temperature=0.5, top_p=0.9, top_k=5, min_p=0.0, max_completion_length=4)


def test_the_trainers_sampling_settings_are_the_engines(tiny_checkpoint, policy):
    """trainer.args (temperature 0.5, top-p 0.9, top-k 5, at most 4 tokens) fill the fields the SamplingParams
    leaves at their defaults: the completions stop at 4 tokens and their logprobs are those of that distribution
    (the engine sampled at temperature 1 and up to the SamplingParams' 256 tokens)."""
    from trainer_adapters.grpo import RolloutBatch, token_logprobs

    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20)
    trainer = fake_trainer(policy.eval(), engine.tokenizer, TRAINER_ARGS)
    out = engine_rollout_func(engine, SamplingParams(ignore_eos=True))(["the model", "the model"], trainer)
    assert [len(c) for c in out["completion_ids"]] == [4, 4]
    prompt, completion = out["prompt_ids"][0], out["completion_ids"][0]
    ids = torch.tensor([prompt + completion])
    mask = torch.zeros(ids.shape)
    mask[0, len(prompt):] = 1
    expected = SamplingParams(temperature=0.5, top_p=0.9, top_k=5)
    with torch.no_grad():
        scored = token_logprobs(policy, RolloutBatch(ids, torch.ones_like(ids), mask, mask, torch.zeros(1)),
                                params=expected)
    torch.testing.assert_close(scored[0, len(prompt):], torch.tensor(out["logprobs"][0]), atol=1e-4, rtol=0)


def test_an_off_policy_mask_over_truncated_logprobs_is_warned_once(tiny_checkpoint, policy):
    """TRL feeds the hook's logprobs to its off-policy sequence mask whenever off_policy_mask_threshold is set, even
    without use_vllm, against its own over the whole vocabulary: with top-k/top-p on (TRAINER_ARGS) they differ
    though no weight changed, so a UserWarning says so, once per hook; with no truncation they agree: no warning."""
    import warnings

    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20)
    masked = TRAINER_ARGS | dict(off_policy_mask_threshold=0.5)
    rollout = engine_rollout_func(engine, SamplingParams())
    with pytest.warns(UserWarning, match=r"off_policy_mask_threshold=0.5 masks .* top_k, top_p or min_p on") as caught:
        for step in (0, 1):
            rollout(["the model", "the model"], fake_trainer(policy, engine.tokenizer, masked, step=step))
    assert sum("off_policy_mask_threshold" in str(w.message) for w in caught) == 1
    untruncated = masked | dict(top_k=0, top_p=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine_rollout_func(engine, SamplingParams())(
            ["the model", "the model"], fake_trainer(policy, engine.tokenizer, untruncated, step=2))
        # logprobs_mode "temperature": TRL's own distribution, truncation or not (the warning fired, its advice wrong)
        engine_rollout_func(engine, SamplingParams(logprobs_mode="temperature"))(
            ["the model", "the model"], fake_trainer(policy, engine.tokenizer, masked, step=3))
    # "raw" at temperature 0.5: logprobs at temperature 1 against TRL's at 0.5, which went unwarned
    with pytest.warns(UserWarning, match=r"logprobs_mode='raw' gives the engine's at temperature 1, not 0.5"):
        engine_rollout_func(engine, SamplingParams(logprobs_mode="raw"))(
            ["the model", "the model"], fake_trainer(policy, engine.tokenizer, untruncated, step=4))


@pytest.mark.parametrize("params, args, match", [
    (dict(max_tokens=12), {}, r"sampling_params.max_tokens=12 disagrees with trainer.args.max_completion_length=4"),
    (dict(temperature=0.8), {}, r"sampling_params.temperature=0.8 disagrees with trainer.args.temperature=0.5"),
    (dict(top_k=3), {}, r"sampling_params.top_k=3 disagrees with trainer.args.top_k=5"),
    (dict(top_k=3), dict(top_k=0), r"sampling_params.top_k=3 disagrees with trainer.args.top_k=0"),  # TRL's off
    (dict(top_p=0.5), {}, r"sampling_params.top_p=0.5 disagrees with trainer.args.top_p=0.9"),
    (dict(min_p=0.1), dict(min_p=None), r"sampling_params.min_p=0.1 disagrees with trainer.args.min_p=None"),
    ({}, dict(repetition_penalty=1.2), r"trainer.args.repetition_penalty=1.2 is not allowed"),
    ({}, dict(generation_kwargs={"top_k": 50}), r"trainer.args.generation_kwargs=.* is not allowed"),
    ({}, dict(top_p=0.0), r"trainer.args gives the engine .*top_p=0.0 is not allowed"),
    (dict(stop=["\n"]), dict(mask_truncated_completions=True), r"stop / stop_token_ids are not allowed with .*drop"),
    (dict(stop_token_ids=[7]), dict(mask_truncated_completions=True), r"stop / stop_token_ids are not allowed"),
])
def test_settings_that_disagree_with_the_trainers_are_refused_before_the_engine_changes(params, args, match):
    """A SamplingParams field set to another value than trainer.args' would sample from one distribution while TRL
    scores and trains on another (all were accepted without a word); the refusal names both fields."""
    trainer = fake_trainer(None, None, TRAINER_ARGS | args)
    rollout = engine_rollout_func(UntouchableEngine(), SamplingParams(**params))
    with pytest.raises(ValueError, match=match):
        rollout(["the model", "the model"], trainer)


@pytest.mark.parametrize("field", ["tools", "environment_factories"])
def test_trl_tool_loops_are_refused_before_the_engine_changes(field):
    """TRL's tool loop generates each turn after a tool call with the trainer's own model, not through
    rollout_func (and then fails adding its None logprobs to the engine's): refused, pointing to Episode."""
    trainer = fake_trainer(None, None, TRAINER_ARGS)
    setattr(trainer, field, [lambda x: x])
    with pytest.raises(ValueError, match="not supported with engine_rollout_func.*Episode"):
        engine_rollout_func(UntouchableEngine(), SamplingParams())(["the model"], trainer)


def test_engine_rollout_func_checks_its_arguments():
    for bad in (0, 3, True, "2"):
        with pytest.raises(ValueError, match=rf"sleep_level={bad!r} is not allowed; None or one of \(1, 2\)"):
            engine_rollout_func(UntouchableEngine(), SamplingParams(), sleep_level=bad)
    with pytest.raises(ValueError, match="sampling_params is a dict"):
        engine_rollout_func(UntouchableEngine(), {"max_tokens": 4})


def test_a_rollout_keeps_a_draft_model_and_refuses_what_would_discard_it(tiny_checkpoint, policy):
    """With a speculative draft model the default sleep keeps the weights on the host (the draft's come back from no
    trainer: a level-2 sleep left the engine refusing every later rollout); an explicit level 2 is refused before
    the engine changes. A model the engine cannot take is refused before the engine wakes or syncs."""
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=8 << 20, draft_model=tiny_checkpoint,
                    num_speculative_tokens=2)
    rollout = engine_rollout_func(engine, SamplingParams(max_tokens=2))
    for step in (0, 1):
        out = rollout(["the model", "the model"], fake_trainer(policy, engine.tokenizer, step=step))
        assert len(out["completion_ids"]) == 2 and engine.is_sleeping
    with pytest.raises(ValueError, match="sleep_level=2 is not allowed with a speculative draft model"):
        engine_rollout_func(engine, SamplingParams(max_tokens=2), sleep_level=2)(
            ["the model", "the model"], fake_trainer(policy, engine.tokenizer, step=2))
    policy.v_head = torch.nn.Linear(policy.config.hidden_size, 1)
    with pytest.raises(ValueError, match="v_head.weight"):
        rollout(["the model", "the model"], fake_trainer(policy, engine.tokenizer, step=3))
    assert engine.is_sleeping and engine.weight_version == 2
