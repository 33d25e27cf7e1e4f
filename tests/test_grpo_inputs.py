"""The GRPO glue refuses what would train silently wrong: mis-shaped loss inputs, non-finite rewards, bad TIS caps
and temperatures, arguments hybrid_step could only trip over with the engine asleep; and it scores the trainer's
side in the rollout's logprobs_mode."""
import math

import pytest
import torch
from helpers import assert_serves, make_prompts

from rollout_engine import Engine, SamplingParams
from trainer_adapters import on_policy_logprobs
from trainer_adapters.async_grpo import off_policy_loss
from trainer_adapters.grpo import RolloutBatch, build_batch, group_advantages, hybrid_step, policy_loss, token_logprobs

KV = 1 << 24
MASK = torch.tensor([[0, 0, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 1, 0, 0, 0]],
                    dtype=torch.float32)
ADVANTAGES = torch.tensor([1.0, -1.0, 0.5, -0.5])


def hand_batch():
    """Four samples of 3, 2, 4 and 1 completion tokens; engine logprobs -0.5 on each."""
    return RolloutBatch(torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long), MASK, -0.5 * MASK,
                        torch.tensor([1.0, 0.0, 1.0, 0.0]))


# ---------------------------------------------------------------- 1. shapes of the loss inputs

def test_policy_loss_takes_one_advantage_per_sample_and_refuses_other_shapes():
    """On policy (ratio 1) the loss is -sum_i A_i * tokens_i / tokens = -(3 - 2 + 2 - 0.5) / 10. An [N, 1] advantage
    would broadcast to a loss of exactly 0 (GRPO advantages sum to 0), a [1] one to every sample's being A_0."""
    batch = hand_batch()
    new = batch.old_logprobs.clone().requires_grad_(True)
    assert policy_loss(new, batch, ADVANTAGES).item() == pytest.approx(-0.25, abs=1e-7)
    for bad in (ADVANTAGES[:, None], ADVANTAGES[:1], ADVANTAGES[:3], ADVANTAGES.tolist()):
        with pytest.raises(ValueError, match=r"advantages .*\(4,\)"):
            policy_loss(new, batch, bad)


def test_policy_loss_refuses_logprobs_not_of_the_completion_masks_shape():
    batch = hand_batch()
    new = batch.old_logprobs.clone()
    with pytest.raises(ValueError, match=r"new_logprobs .*\(4, 6\)"):
        policy_loss(new[:, 1:], batch, ADVANTAGES)  # unpadded trainer logits: one position short
    with pytest.raises(ValueError, match=r"trainer_old_logprobs .*\(4, 6\)"):
        policy_loss(new, batch, ADVANTAGES, trainer_old_logprobs=new[:1])  # [1, L] would broadcast


def test_off_policy_loss_refuses_mis_shaped_inputs():
    batch = hand_batch()
    new, on_policy = batch.old_logprobs.clone(), torch.zeros(4, 6, dtype=torch.bool)
    loss, _ = off_policy_loss(new, batch, ADVANTAGES, on_policy)
    assert loss.item() == pytest.approx(-0.25, abs=1e-7)
    with pytest.raises(ValueError, match=r"advantages .*\(4,\)"):
        off_policy_loss(new, batch, ADVANTAGES[:, None], on_policy)
    with pytest.raises(ValueError, match=r"new_logprobs .*\(4, 6\)"):
        off_policy_loss(new[:1], batch, ADVANTAGES, on_policy)
    with pytest.raises(ValueError, match=r"on_policy .*\(4, 6\)"):
        off_policy_loss(new, batch, ADVANTAGES, on_policy[:, 1:])


# ---------------------------------------------------------------- 3. rewards

def test_group_advantages_name_non_finite_rewards():
    for bad in (float("nan"), float("inf"), -float("inf")):
        rewards = torch.tensor([1.0, bad, 0.0, 1.0, 0.0, bad])
        with pytest.raises(ValueError, match=r"rewards .*indices \[1, 5\]"):
            group_advantages(rewards, 2)


def test_group_advantages_take_integer_and_bool_rewards_as_floats():
    expected = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    assert torch.equal(group_advantages(torch.tensor([1, 0, 0, 1]), 2), expected)
    assert torch.equal(group_advantages(torch.tensor([True, False, False, True]), 2), expected)


@pytest.mark.parametrize("reward, size", [(3000.3, 7), (-1.6239, 15), (-52.1, 16), (100.1, 8), (0.7, 3)])
def test_a_group_of_equal_rewards_teaches_nothing(reward, size):
    """Equal rewards have no spread: their advantages are exactly 0 (a float32 mean rounded off them gave each
    sample the same non-zero advantage, e.g. -0.67 for 3000.3 x 7, and a step pushed all of them one way), so
    the loss has no gradient; a varied group beside it keeps its advantages, the float64 reference's."""
    rewards = torch.tensor([reward] * size + [float(i % 3) for i in range(size)])
    advantages = group_advantages(rewards, size)
    assert advantages.dtype == torch.float32 and torch.equal(advantages[:size], torch.zeros(size))
    varied = rewards[size:].double()
    expected = (varied - varied.mean()) / (varied.std() + 1e-4)
    torch.testing.assert_close(advantages[size:], expected.float(), atol=1e-6, rtol=0)
    batch = RolloutBatch(torch.zeros(size, 3, dtype=torch.long), torch.ones(size, 3, dtype=torch.long),
                         torch.ones(size, 3), torch.full((size, 3), -0.5), rewards[:size])
    new = batch.old_logprobs.clone().requires_grad_(True)
    policy_loss(new, batch, advantages[:size]).backward()
    assert torch.equal(new.grad, torch.zeros(size, 3))


# ---------------------------------------------------------------- 4. the TIS cap

def test_policy_loss_checks_is_cap_and_takes_inf_as_no_truncation():
    """Weights exp(trainer_old - rollout) of 5, 0.5, 1 on the three tokens: with is_cap=inf nothing is truncated, so
    d loss / d new = -A * weight / tokens."""
    rollout = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    batch = RolloutBatch(torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 4, dtype=torch.long), mask, rollout,
                         torch.zeros(1))
    trainer_old = rollout + torch.log(torch.tensor([[1.0, 5.0, 0.5, 1.0]]))
    new = trainer_old.clone().requires_grad_(True)
    policy_loss(new, batch, torch.tensor([1.5]), trainer_old_logprobs=trainer_old, is_cap=math.inf).backward()
    torch.testing.assert_close(new.grad, -1.5 * torch.tensor([[0.0, 5.0, 0.5, 1.0]]) / 3)
    for bad in (0.0, -1.0, math.nan, None, True, "2"):
        with pytest.raises(ValueError, match="is_cap="):
            policy_loss(new, batch, torch.tensor([1.5]), trainer_old_logprobs=trainer_old, is_cap=bad)


def test_trainer_old_logprobs_that_carry_a_graph_still_give_the_policy_gradient():
    """The trainer's logprobs computed once with grad enabled and handed in as both `new` and `trainer_old` (one
    update per batch): the ratio's reference is a constant, so the gradient is the one a detached copy gives (it
    was 0: new - trainer_old cancelled in the backward)."""
    theta = torch.randn(4, 6, generator=torch.Generator().manual_seed(0), requires_grad=True)
    new = theta.log_softmax(-1)
    batch = RolloutBatch(torch.zeros(4, 6, dtype=torch.long), torch.ones(4, 6, dtype=torch.long), MASK,
                         (new.detach() - 0.05) * MASK, torch.zeros(4))
    detached, = torch.autograd.grad(policy_loss(new, batch, ADVANTAGES, trainer_old_logprobs=new.detach()), theta,
                                    retain_graph=True)
    with_graph, = torch.autograd.grad(policy_loss(new, batch, ADVANTAGES, trainer_old_logprobs=new), theta)
    assert detached.abs().sum() > 0
    torch.testing.assert_close(with_graph, detached, atol=0, rtol=0)


# ---------------------------------------------------------------- 2. hybrid_step's arguments, before the engine

class UntouchableEngine:
    """Fails the test on any use: a refused argument must be refused before the engine generates or sleeps."""

    def __getattr__(self, name):
        raise AssertionError(f"engine.{name} was used before the arguments were checked")


@pytest.mark.parametrize("bad, match", [
    (dict(params=SamplingParams(n=1, max_tokens=2)), "params.n=1"),
    (dict(params=SamplingParams(n=4, max_tokens=2, logprobs=None)), "params.logprobs=None"),
    (dict(params=None), "params"),
    (dict(micro_batch=-1), "micro_batch=-1"),
    (dict(micro_batch=0), "micro_batch=0"),
    (dict(micro_batch=2.0), "micro_batch=2.0"),
    (dict(micro_batch=True), "micro_batch=True"),
    (dict(tis_cap=math.nan), "tis_cap=nan"),
    (dict(pad_id=None), "pad_id=None"),
    (dict(pad_id=-1), "pad_id=-1"),
    # past the model's vocabulary: its forward would fail later
    (dict(pad_id=512), "pad_id=512 .*below its 512 embedding rows"),
    (dict(reward_fn=None), "reward_fn"),
])
def test_hybrid_step_refuses_bad_arguments_before_touching_the_engine(bad, match):
    args = dict(params=SamplingParams(n=4, max_tokens=2), reward_fn=lambda i, c: 1.0, pad_id=0) | bad
    with pytest.raises(ValueError, match=match):
        hybrid_step(UntouchableEngine(), VocabOnly(), None, [[1, 2]], **args)


class VocabOnly:
    """What hybrid_step reads of the trainer's model before the engine generates: its embedding rows."""

    def get_input_embeddings(self):
        return torch.nn.Embedding(512, 2)


# ---------------------------------------------------------------- 2, 3. a failure after the sleep

@pytest.fixture
def trainer_and_engine(hf_checkpoint):
    """A fresh transformers model (its own copy: the steps change it), an optimizer, and an engine on its weights."""
    from transformers import AutoModelForCausalLM

    path, _ = hf_checkpoint("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, optimizer, Engine(path, device="cpu", kv_cache_memory=KV)


def nan_logits(module, inputs, output):
    output.logits = output.logits * math.nan
    return output


@pytest.mark.parametrize("failure", ["reward_fn raises", "NaN reward", "non-finite loss", "non-finite gradient"])
def test_a_failed_hybrid_step_leaves_the_model_unchanged_and_the_engine_serving_it(trainer_and_engine, failure):
    """The rollout happened and the engine slept; then the step fails. The error propagates (ValueError for a NaN
    reward, FloatingPointError for a NaN loss, before any backward), the model's weights are bitwise what they
    were with no gradient left, and the engine is awake with exactly those weights (one version on)."""
    model, optimizer, engine = trainer_and_engine
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    version = engine.weight_version

    def reward(i, c):
        if failure == "reward_fn raises":
            raise RuntimeError("the reward server is down")
        return math.nan if failure == "NaN reward" and i == 1 else float(c.token_ids[0] % 2)

    hook = model.register_forward_hook(nan_logits) if failure == "non-finite loss" else None
    if failure == "non-finite gradient":  # the loss stays finite; one parameter's gradient turns NaN
        hook = model.model.norm.weight.register_hook(lambda grad: grad * math.nan)
    expected = {"reward_fn raises": (RuntimeError, "reward server"), "NaN reward": (ValueError, r"rewards .*\[2, 3\]"),
                "non-finite loss": (FloatingPointError, "non-finite loss"),
                "non-finite gradient": (FloatingPointError, "gradients in 1 parameters .*model.norm.weight")}[failure]
    with pytest.raises(expected[0], match=expected[1]):
        hybrid_step(engine, model, optimizer, make_prompts((5, 9)), reward,
                    SamplingParams(n=2, max_tokens=3, ignore_eos=True), pad_id=0, micro_batch=2)
    if hook is not None:
        hook.remove()
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]) and p.grad is None, name
    assert not model.training
    assert not engine.is_sleeping and engine.weight_version == version + 1
    assert_serves(engine, model, make_prompts((7,), seed=3)[0])


def test_hybrid_step_still_trains_and_syncs(trainer_and_engine):
    """The checks leave a good step alone: the model moves, finitely, and the engine serves its new weights."""
    model, optimizer, engine = trainer_and_engine
    before = [p.detach().clone() for p in model.parameters()]
    result = hybrid_step(engine, model, optimizer, make_prompts((5, 9)), lambda i, c: float(c.token_ids[0] % 2),
                         SamplingParams(n=4, max_tokens=3, ignore_eos=True), pad_id=0, micro_batch=3, tis_cap=2.0)
    assert math.isfinite(result["loss"]) and set(result["timings"]) == {"generate", "sleep", "train", "sync", "wake"}
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_serves(engine, model, make_prompts((7,), seed=3)[0], version=1)


def test_a_model_the_engine_cannot_take_is_refused_before_the_engine_sleeps(trainer_and_engine):
    """A parameter the engine has no weight for (a value head) or of another shape (a resized vocabulary) would
    fail the sync after training, with the optimizer stepped and the engine asleep: refused before anything runs."""
    model, optimizer, engine = trainer_and_engine
    args = (optimizer, make_prompts((5, 9)), lambda i, c: 1.0, SamplingParams(n=2, max_tokens=3, ignore_eos=True))
    model.v_head = torch.nn.Linear(model.config.hidden_size, 1)
    with pytest.raises(ValueError, match="v_head.weight"):
        hybrid_step(engine, model, *args, pad_id=0)
    del model.v_head
    vocab = model.config.vocab_size
    model.resize_token_embeddings(vocab + 8)
    with pytest.raises(ValueError, match=rf"embed_tokens.weight' has shape \({vocab + 8}, "):
        hybrid_step(engine, model, *args, pad_id=0)
    assert not engine.is_sleeping and engine.weight_version == 0


@pytest.mark.parametrize("family", ["qwen2", "llama3"])
def test_a_model_whose_embedding_tie_differs_from_the_engines_is_refused(hf_checkpoint, family):
    """The engine's checkpoint ties lm_head to the embedding (qwen2) or not (llama3), the trainer's model the other
    way. An untied model into a tied engine: its sync would be refused after training (two values for one tensor).
    A tied model into an untied engine: no lm_head.weight is ever sent, so the engine would keep serving its old
    head after every sync (a level-1 sleep keeps it). Both refused before anything runs."""
    from trainer_adapters.sync import check_model_fits

    path, model = hf_checkpoint(family)
    engine = Engine(path, device="cpu", kv_cache_memory=KV)
    tied = model.config.tie_word_embeddings
    other = type(model)(type(model.config)(**{**model.config.to_dict(), "tie_word_embeddings": not tied}))
    assert ("lm_head.weight" in dict(other.named_parameters())) == tied
    with pytest.raises(ValueError, match="tie_word_embeddings differs"):
        check_model_fits(engine, other)
    check_model_fits(engine, model)


def test_hybrid_step_takes_a_ddp_wrapped_model(trainer_and_engine):
    """The pad_id check reads the embedding of the model inside DDP's `.module`, as sync_weights does."""
    model, optimizer, engine = trainer_and_engine
    wrapped = torch.nn.parallel.DistributedDataParallel.__new__(torch.nn.parallel.DistributedDataParallel)
    torch.nn.Module.__init__(wrapped)
    wrapped.module = model  # what DDP looks like from outside, without a process group
    wrapped.forward = model.forward
    result = hybrid_step(engine, wrapped, optimizer, make_prompts((5, 9)), lambda i, c: float(c.token_ids[0] % 2),
                         SamplingParams(n=2, max_tokens=3, ignore_eos=True), pad_id=0)
    assert math.isfinite(result["loss"]) and engine.weight_version == 1


def test_hybrid_step_keeps_a_draft_model_serving(hf_checkpoint):
    """A level-2 sleep would discard the draft's weights, which no trainer pushes: with a draft model hybrid_step
    sleeps at level 1, and the engine serves, speculating, after each step."""
    from transformers import AutoModelForCausalLM

    path, _ = hf_checkpoint("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine = Engine(path, device="cpu", kv_cache_memory=KV, draft_model=path, num_speculative_tokens=2)
    for step in (1, 2):
        hybrid_step(engine, model, optimizer, make_prompts((5, 9)), lambda i, c: float(c.token_ids[0] % 2),
                    SamplingParams(n=2, max_tokens=3, ignore_eos=True), pad_id=0)
        assert engine.weight_version == step
        assert_serves(engine, model, make_prompts((7,), seed=3)[0], version=step)


# ---------------------------------------------------------------- 5, 6. the trainer's logprobs: mode and temperature

@pytest.mark.parametrize("mode", ["processed", "temperature", "raw"])
def test_trainer_logprobs_are_in_the_rollouts_logprobs_mode(hf_checkpoint, mode):
    """Rollouts at temperature 0.5 with top-k 3: whatever logprobs_mode they were sampled with, token_logprobs(...,
    params=params) gives the engine's logprobs (fp32 on both sides: rounding only), so every importance ratio is
    1 before an update. (Scored as "processed", raw or temperature rollouts gave ratios of 1.7-4.7.)"""
    path, model = hf_checkpoint("qwen3")
    params = SamplingParams(n=2, temperature=0.5, top_k=3, max_tokens=8, seed=2, ignore_eos=True, logprobs_mode=mode)
    outs = Engine(path, device="cpu", kv_cache_memory=KV).generate(make_prompts((6, 11)), params, use_tqdm=False)
    batch = build_batch(outs, [0.0] * 4, pad_id=0)
    with torch.no_grad():
        trainer = token_logprobs(model, batch, params=params)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(trainer[mask], batch.old_logprobs[mask], atol=1e-4, rtol=0)


def test_token_logprobs_at_temperature_0_are_the_greedy_rollouts_logprobs(hf_checkpoint):
    """Temperature 0 (greedy): the engine reports the distribution at temperature 1, and so does token_logprobs;
    a negative, NaN or infinite temperature is refused."""
    path, model = hf_checkpoint("qwen3")
    outs = Engine(path, device="cpu", kv_cache_memory=KV).generate(
        make_prompts((6, 11)), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    batch = build_batch(outs, [0.0] * 2, pad_id=0)
    with torch.no_grad():
        greedy = token_logprobs(model, batch, temperature=0)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(greedy[mask], batch.old_logprobs[mask], atol=1e-4, rtol=0)
    assert torch.isfinite(greedy).all()
    for bad in (-1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature="):
            token_logprobs(model, batch, temperature=bad)


def test_on_policy_logprobs_default_to_the_params_logprobs_mode(hf_checkpoint):
    """on_policy_logprobs(..., params) scores in params.logprobs_mode unless told otherwise: "raw" params give
    exactly the raw logprobs, which differ from the processed ones at temperature 0.5; "temperature" params are
    refused as an explicit "temperature" is."""
    _, model = hf_checkpoint("qwen3")
    ids = torch.randint(0, 255, (2, 12), generator=torch.Generator().manual_seed(1))
    raw_params = SamplingParams(temperature=0.5, logprobs_mode="raw")
    with torch.no_grad():
        default = on_policy_logprobs(model, ids, None, raw_params)
        raw = on_policy_logprobs(model, ids, None, raw_params, logprobs_mode="raw")
        processed = on_policy_logprobs(model, ids, None, raw_params, logprobs_mode="processed")
    assert torch.equal(default, raw)
    assert (default - processed)[:, 1:].abs().max() > 1e-2
    with pytest.raises(ValueError, match="logprobs_mode='temperature'"):
        on_policy_logprobs(model, ids, None, SamplingParams(logprobs_mode="temperature"))


# ---------------------------------------------------------------- 7. non-finite logprobs outside the completion

@pytest.mark.parametrize("outside", [-math.inf, math.nan])
def test_losses_ignore_non_finite_logprobs_outside_the_completion(outside):
    """A prompt token that top-k / top-p / min-p drop has logprob -inf (and padding may hold anything): the losses
    select the completion's tokens, so the loss and its gradient equal those of finite logprobs there ((-inf) * 0
    was NaN: a NaN loss and NaN gradients)."""
    batch = hand_batch()
    clean = batch.old_logprobs + 0.1 * MASK
    dirty = torch.where(MASK.bool(), clean, outside)
    on_policy = torch.zeros(4, 6, dtype=torch.bool)
    losses = {
        "policy_loss": lambda new: policy_loss(new, batch, ADVANTAGES),
        "policy_loss with TIS": lambda new: policy_loss(new, batch, ADVANTAGES, trainer_old_logprobs=new.detach()),
        "off_policy_loss": lambda new: off_policy_loss(new, batch, ADVANTAGES, on_policy)[0],
    }
    for name, loss_of in losses.items():
        expected, got = clean.clone().requires_grad_(True), dirty.clone().requires_grad_(True)
        loss_of(expected).backward()
        loss = loss_of(got)
        loss.backward()
        assert torch.isfinite(loss), name
        torch.testing.assert_close(loss, loss_of(clean), msg=name)
        torch.testing.assert_close(got.grad, expected.grad, msg=name)


def test_on_policy_logprobs_are_finite_where_a_filter_drops_a_prompt_token(hf_checkpoint):
    """With top-k 5, most random prompt tokens are outside the top 5: on_policy_logprobs gives them a finite floor
    (probability 0), as grpo.token_logprobs does, and keeps the kept tokens' values; policy_loss over the kept
    positions then has a finite value and finite gradients (it had -inf there, so a NaN loss and NaN gradients)."""
    from transformers import AutoModelForCausalLM

    path, _ = hf_checkpoint("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ids = torch.randint(0, 255, (2, 12), generator=torch.Generator().manual_seed(1))
    params = SamplingParams(top_k=5)
    new = on_policy_logprobs(model, ids, None, params)
    floor = torch.finfo(torch.float32).min
    dropped = new == floor
    assert torch.isfinite(new).all() and dropped.any() and (~dropped[:, 1:]).any()
    kept = (~dropped).float()
    kept[:, 0] = 0
    with torch.no_grad():
        unfiltered = on_policy_logprobs(model, ids, None, SamplingParams())
    assert (new[kept.bool()] >= unfiltered[kept.bool()]).all()  # renormalised over the 5 kept tokens
    batch = RolloutBatch(ids, torch.ones_like(ids), kept, (new * kept).detach(), torch.zeros(2))
    loss = policy_loss(new, batch, torch.tensor([1.0, -1.0]))
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# ---------------------------------------------------------------- 8. the clip range and the dual clip

BAD_CLIP_EPS = [0.0, -0.2, 1.0, 1.5, math.nan, math.inf, True, "0.2", None]
BAD_DUAL_CLIP = [1.0, 0.5, 0.0, -1.0, math.nan, math.inf, True, "3"]


@pytest.mark.parametrize("clip_eps", BAD_CLIP_EPS)
def test_losses_refuse_a_clip_eps_outside_0_1(clip_eps):
    """clip_eps < 0 pinned every ratio at 1 - clip_eps (the A > 0 samples got no gradient), NaN gave a NaN loss."""
    batch = hand_batch()
    new = batch.old_logprobs.clone()
    with pytest.raises(ValueError, match=rf"clip_eps={clip_eps!r} is not allowed; a number in \(0, 1\)"):
        policy_loss(new, batch, ADVANTAGES, clip_eps=clip_eps)
    with pytest.raises(ValueError, match=rf"clip_eps={clip_eps!r} is not allowed"):
        off_policy_loss(new, batch, ADVANTAGES, torch.zeros(4, 6, dtype=torch.bool), clip_eps=clip_eps)


@pytest.mark.parametrize("dual_clip", BAD_DUAL_CLIP)
def test_off_policy_loss_refuses_a_dual_clip_not_above_1(dual_clip):
    """dual_clip <= 1 bounded a negative-advantage token's surrogate at or above its value at ratio 1: on-policy
    tokens (ratio exactly 1) with A < 0 got no gradient at all."""
    batch = hand_batch()
    with pytest.raises(ValueError, match=rf"dual_clip={dual_clip!r} is not allowed; None \(no dual clip\) or a finite"):
        off_policy_loss(batch.old_logprobs.clone(), batch, ADVANTAGES, MASK.bool(), dual_clip=dual_clip)


def test_good_clips_still_pass():
    batch = hand_batch()
    new = batch.old_logprobs.clone().requires_grad_(True)
    for clip_eps in (0.1, 0.2, 0.999):
        policy_loss(new, batch, ADVANTAGES, clip_eps=clip_eps)
    for dual_clip in (None, 1.5, 3, 10.0):
        loss, _ = off_policy_loss(new, batch, ADVANTAGES, MASK.bool(), dual_clip=dual_clip)
    loss.backward()  # on-policy, ratio 1: every A < 0 token keeps its gradient -A / tokens
    torch.testing.assert_close(new.grad, -(ADVANTAGES[:, None] * MASK) / MASK.sum())
