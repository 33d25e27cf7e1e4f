"""The RL loop end to end on the CPU: GRPO pieces, and a shortened demo whose reward must rise."""
import pytest
import torch

from rollout_engine.outputs import CompletionOutput, RequestOutput
from trainer_adapters.demo import run_demo
from trainer_adapters.grpo import build_batch, group_advantages, policy_loss


def test_build_batch_and_advantages():
    outs = [RequestOutput(0, None, [5, 6], [CompletionOutput(0, [7], [-0.5], None, "length"),
                                            CompletionOutput(1, [8, 9], [-1.0, -2.0], None, "stop")], 0)]
    batch = build_batch(outs, [1.0, 0.0], pad_id=0)
    assert batch.input_ids.tolist() == [[5, 6, 7, 0], [5, 6, 8, 9]]
    assert batch.completion_mask.tolist() == [[0, 0, 1, 0], [0, 0, 1, 1]]
    assert batch.old_logprobs.tolist() == [[0, 0, -0.5, 0], [0, 0, -1.0, -2.0]]
    adv = group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=2)
    assert adv[0] > 0 > adv[1] and adv[2] == adv[3] == 0  # a group with equal rewards teaches nothing
    with pytest.raises(ValueError, match="rewards"):
        build_batch(outs, [1.0], pad_id=0)
    for size in (1, 0, 3):  # one sample per group has no spread (NaN advantages); 3 does not divide 4 rewards
        with pytest.raises(ValueError, match="group_size"):
            group_advantages(torch.tensor([1.0, 0.0, 3.0, 3.0]), group_size=size)


def test_build_batch_refuses_unfinished_samples_and_names_them():
    """A partial rollout's "abort" samples are cut off, meant to be resumed: trained on, a cut-off completion would
    be rewarded as a whole one. build_batch names them (prompt-major, sample-minor, as rewards) and says what to do."""
    def sample(i, reason):
        return CompletionOutput(i, [7, 8], [-0.5, -1.0], None, reason)

    outs = [RequestOutput(0, None, [5, 6], [sample(0, "length"), sample(1, "abort")], 0),
            RequestOutput(1, None, [5, 9], [sample(0, "abort"), sample(1, "stop")], 0)]
    with pytest.raises(ValueError, match=r"outputs has 2 unfinished sample\(s\) \(finish_reason 'abort'\) at "
                                         r"indices \[1, 2\] .*resume them \(pass their RequestOutputs back to "
                                         r"generate as prompts\) or drop them"):
        build_batch(outs, [1.0, 0.0, 1.0, 0.0], pad_id=0)
    finished = [RequestOutput(0, None, [5, 6], [sample(0, "length"), sample(1, "stop")], 0)]
    assert build_batch(finished, [1.0, 0.0], pad_id=0).completion_mask.sum() == 4


def test_policy_loss_is_the_policy_gradient_on_policy():
    outs = [RequestOutput(0, None, [1], [CompletionOutput(0, [2, 3], [-1.0, -2.0], None, "length")], 0)]
    batch = build_batch(outs, [1.0], pad_id=0)
    new = batch.old_logprobs.clone().requires_grad_(True)
    advantages = torch.tensor([2.0], requires_grad=True)  # a critic's output, say: a constant of the policy step
    loss = policy_loss(new, batch, advantages)
    loss.backward()
    # ratio = 1 on policy: d loss / d logprob = -advantage / (number of completion tokens), on completion tokens only
    assert torch.allclose(new.grad, torch.tensor([[0.0, -1.0, -1.0]]))
    assert advantages.grad is None


@pytest.mark.parametrize("logprobs, match", [([float("nan"), -1.0], r"samples \[1\] have logprobs that are NaN"),
                                             ([0.7, -1.0], r"samples \[1\] have logprobs .*above 0"),
                                             ([-1.0], r"sample 1 has 2 tokens but 1 logprobs")])
def test_build_batch_refuses_what_is_no_logprob_and_names_the_sample(logprobs, match):
    """A NaN logprob made the loss NaN, a positive one a wrong ratio, with nothing said; a short list a
    RuntimeError naming no sample. The values an engine reports (finite, <= 0) pass."""
    good = CompletionOutput(0, [7, 8], [-0.5, 0.0], None, "length")
    outs = [RequestOutput(0, None, [5, 6], [good, CompletionOutput(1, [8, 9], logprobs, None, "stop")], 0)]
    with pytest.raises(ValueError, match=match):
        build_batch(outs, [1.0, 0.0], pad_id=0)
    with pytest.raises(ValueError, match="rewards must be numbers"):
        build_batch([RequestOutput(0, None, [5, 6], [good], 0)], [None], pad_id=0)
    with pytest.raises(ValueError, match=r"rewards has shape \(1, 2\); it must be \(1,\)"):  # broadcast otherwise
        build_batch([RequestOutput(0, None, [5, 6], [good], 0)], [[1.0, 0.0]], pad_id=0)
    assert build_batch([RequestOutput(0, None, [5, 6], [good], 0)], [True], pad_id=0).rewards.tolist() == [1.0]


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf"), "1e-4", True])
def test_group_advantages_refuses_an_eps_that_is_no_small_non_negative_number(eps):
    """eps=-1 flipped the advantages' sign (reward-minimising), NaN made them NaN, inf zero."""
    with pytest.raises(ValueError, match=r"^eps=.* is not allowed; a finite number >= 0"):
        group_advantages(torch.tensor([0.0, 1.0, 0.0, 1.0]), 2, eps=eps)
    assert group_advantages(torch.tensor([0.0, 1.0]), 2, eps=0).tolist() == pytest.approx([-0.5 ** 0.5, 0.5 ** 0.5])


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_a_token_the_trainers_filter_dropped_teaches_nothing_under_tis(advantage):
    """trainer_old at the floor (token_logprobs' probability 0) gives that token a TIS weight of 0; its ratio against
    the floor is inf, and with a negative advantage inf x 0 made the whole loss NaN. Now the loss and gradient are
    the other tokens' alone: the same as with the dropped token masked out."""
    from trainer_adapters.grpo import RolloutBatch

    floor = torch.finfo(torch.float32).min
    rollout = torch.tensor([[0.0, -1.0, -2.0]])
    batch = RolloutBatch(torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 3, dtype=torch.long),
                         torch.tensor([[0.0, 1.0, 1.0]]), rollout, torch.zeros(1))
    trainer_old = torch.tensor([[0.0, -1.0, floor]])
    new = torch.tensor([[0.0, -1.0, -2.0]], requires_grad=True)
    loss = policy_loss(new, batch, torch.tensor([advantage]), trainer_old_logprobs=trainer_old)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(new.grad).all()
    # the kept token: ratio 1, weight 1, over the two completion tokens; the dropped one: nothing
    torch.testing.assert_close(loss, torch.tensor(-advantage / 2))
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, -advantage / 2, 0.0]]))


def test_short_demo_reward_rises(tmp_path):
    log = run_demo(tmp_path, steps=40, progress=False, eval_every=40)
    rewards = [s["reward"] for s in log["steps"]]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # 800 samples a step: the standard error of a 5-step mean reward is below 0.01, so a rise of
    # 0.25 is far beyond chance.
    assert last - first > 0.25, (first, last)
    assert log["final_greedy_accuracy"] > 0.5 > log["eval"][0][1]
    assert (tmp_path / "reward_curve.png").stat().st_size > 0 and (tmp_path / "demo_log.json").exists()
    timings = log["steps"][-1]["timings"]
    assert set(timings) == {"generate", "sleep", "train", "sync", "wake"}


def test_trainer_logprobs_warn_when_rotary_buffers_were_cast(hf_checkpoint):
    """model.to(bfloat16) also casts the rotary inv_freq buffer: the helpers that compute trainer logprobs say so,
    naming the buffer; a model loaded in its dtype (inv_freq float32) gets no warning."""
    import warnings

    from transformers import AutoModelForCausalLM

    from trainer_adapters.grpo import check_rotary_buffers

    path, _ = hf_checkpoint("llama3")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert check_rotary_buffers(loaded) == []
    cast = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(torch.bfloat16)
    with pytest.warns(UserWarning, match="inv_freq"):
        bad = check_rotary_buffers(cast)
    assert bad and all(name.endswith("inv_freq") for name in bad)


@pytest.mark.parametrize("filters", [dict(), dict(top_k=5), dict(top_p=0.7), dict(top_k=8, top_p=0.9, min_p=0.05)])
def test_trainer_side_processed_logprobs_equal_the_engines_under_filters(hf_checkpoint, filters):
    """An importance ratio compares the trainer's logprob of each sampled token with the engine's: under top-k /
    top-p / min-p the engine reports the filtered, renormalised distribution, and token_logprobs(params=...)
    computes the same from the trainer's own forward (fp32: float32 rounding only); a full-vocabulary softmax
    does not."""
    from helpers import make_prompts

    from rollout_engine import Engine, SamplingParams
    from trainer_adapters.grpo import token_logprobs

    path, model = hf_checkpoint("qwen3")
    params = SamplingParams(n=2, temperature=0.7, max_tokens=12, seed=5, ignore_eos=True, **filters)
    outs = Engine(path, device="cpu", kv_cache_memory=1 << 24).generate(make_prompts((6, 11)), params, use_tqdm=False)
    batch = build_batch(outs, [0.0] * 4, pad_id=0)
    with torch.no_grad():
        trainer = token_logprobs(model, batch, params=params)  # the rollout's temperature comes with its params
        unfiltered = token_logprobs(model, batch, params.temperature)
    mask = batch.completion_mask.bool()
    torch.testing.assert_close(trainer[mask], batch.old_logprobs[mask], atol=1e-4, rtol=0)
    if filters:
        assert (unfiltered[mask] - batch.old_logprobs[mask]).abs().max() > 1e-2  # what the ratio was biased by


def test_build_batch_refuses_outputs_without_samples():
    with pytest.raises(ValueError, match="outputs holds no samples"):
        build_batch([], [], 0)
    with pytest.raises(ValueError, match="outputs holds no samples"):
        build_batch([RequestOutput(0, None, [5, 6], [], 0)], [], 0)


def test_sampled_tokens_the_trainers_filter_drops_are_counted_and_warned_about(hf_checkpoint):
    """At a filter's edge the trainer (bf16, say) can drop a token the engine sampled: its probability is 0, so its
    ratio is 0 and it teaches nothing. token_logprobs warns, the loss statistics count it (off_policy_loss, and
    hybrid_step's through train_step), and every other token keeps its logprob. Here top_k=1 keeps only the
    trainer's argmax, and one sample holds another token."""
    import warnings

    from transformers import AutoModelForCausalLM

    from rollout_engine import SamplingParams, processed_logprobs
    from trainer_adapters.async_grpo import off_policy_loss
    from trainer_adapters.grpo import token_logprobs, train_step

    path, _ = hf_checkpoint("qwen3")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt, params = [3, 4, 5], SamplingParams(n=2, top_k=1)
    with torch.no_grad():
        first = int(model(torch.tensor([prompt])).logits[0, -1].argmax())
        second = int(model(torch.tensor([prompt + [first]])).logits[0, -1].argmax())
    kept = CompletionOutput(0, [first, second], [0.0, 0.0], None, "length")
    cut = CompletionOutput(1, [first, (second + 1) % model.config.vocab_size], [0.0, -1.0], None, "length")
    outs = [RequestOutput(0, None, prompt, [kept, cut], 0)]
    batch, sampled = build_batch(outs, [1.0, 0.0], pad_id=0), torch.tensor([[0, 0, 0, 1, 1]] * 2).bool()
    with pytest.warns(UserWarning, match="drops tokens the engine sampled"):
        new = token_logprobs(model, batch, params=params)
    with torch.no_grad():
        reference = torch.nn.functional.pad(processed_logprobs(
            model(input_ids=batch.input_ids).logits.float()[:, :-1], batch.input_ids[:, 1:], params), (1, 0))
    torch.testing.assert_close(new[sampled][:3], reference[sampled][:3], rtol=0, atol=0)
    _, stats = off_policy_loss(new, batch, torch.tensor([1.0, -1.0]), sampled)
    assert stats["dropped_tokens"] == 1
    with pytest.warns(UserWarning, match="drops tokens the engine sampled"):
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), outs, lambda i, c: float(c.index),
                           params, 0, 1, 2.0)
    assert stats["dropped_tokens"] == 1
    greedy = build_batch([RequestOutput(0, None, prompt, [kept, kept], 0)], [1.0, 0.0], pad_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing dropped: no warning
        _, stats = off_policy_loss(token_logprobs(model, greedy, params=params), greedy, torch.tensor([1.0, -1.0]),
                                   sampled)
    assert stats["dropped_tokens"] == 0
