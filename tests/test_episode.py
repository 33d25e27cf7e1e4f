"""Multi-turn episodes kept as token ids (trainer_adapters.episode.Episode)."""
import pytest
import torch
from test_chat import CHATML, LLAMA3, SKIPPING

from rollout_engine import Engine, SamplingParams
from rollout_engine.chat import render_chat
from rollout_engine.outputs import CompletionOutput
from trainer_adapters.episode import Episode, build_episode_batch
from trainer_adapters.grpo import token_logprobs

# ChatML that drops <think>...</think> from every assistant turn but the last (as Qwen 3's and
# DeepSeek-R1's templates do with past reasoning): earlier turns are re-rendered as turns are added.
THINK_STRIPPING = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1].lstrip() + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

START = [{"role": "system", "content": "you add numbers"}, {"role": "user", "content": "12+34 and then 5+6"}]
REPLIES = ["<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 12, \"b\": 34}}</tool_call>",
           "the first sum is 46. <tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 5, \"b\": 6}}</tool_call>",
           "46 and 11"]
TOOL_ANSWERS = ["46", "11"]


@pytest.fixture(scope="module")
def tokenizers(tiny_checkpoint):
    from transformers import AutoTokenizer

    def get(template, bos=False):
        tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
        tok.chat_template = template
        if bos:
            tok.bos_token = "<|endoftext|>"
            tok.add_bos_token = True
        return tok

    return get


def end_of_turn(tok, template):
    return tok.convert_tokens_to_ids("<|endoftext|>" if template is LLAMA3 else "<|im_end|>")


def spelled_out(tok, text):
    """One token per character: the same text, but not the tokenizer's tokenization of it."""
    return [t for c in text for t in tok(c, add_special_tokens=False)["input_ids"]]


def canonical(tok, template, text, stop=True):
    """The ids a model would sample for `text` if it sampled the tokenizer's own tokenization (and stopped)."""
    return tok(text, add_special_tokens=False)["input_ids"] + ([end_of_turn(tok, template)] if stop else [])


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_three_turns_equal_one_rendering(tokenizers, template):
    tok = tokenizers(template, bos=template is LLAMA3)
    ep = Episode(tok, START)
    assert ep.token_ids == render_chat(tok, START, add_generation_prompt=False)
    sampled_turns = []
    for turn, reply in enumerate(REPLIES):
        assert ep.prompt_ids() == render_chat(tok, ep.messages), "the prompt is the template's own"
        sampled = canonical(tok, template, reply)
        ep.add_model_turn(sampled, logprobs=[-0.25 * turn] * len(sampled), weight_versions=[turn] * len(sampled))
        sampled_turns.append(sampled)
        assert ep.messages[-1] == {"role": "assistant", "content": reply}  # decoded without special tokens
        assert ep.token_ids[-len(sampled):] == sampled
        if turn < len(TOOL_ANSWERS):
            ep.add_messages([{"role": "tool", "content": TOOL_ANSWERS[turn]}])
    whole = render_chat(tok, ep.messages, add_generation_prompt=False)
    assert whole[: len(ep.token_ids)] == ep.token_ids
    # the episode ends where the model stopped: the template's closing of the last turn is not appended
    closing = whole[len(ep.token_ids):]
    assert tok.decode(closing) == ("\n" if template is CHATML else "")
    assert ep.model_turns() == sampled_turns
    assert sum(ep.loss_mask) == sum(map(len, sampled_turns))
    assert [lp is None for lp in ep.logprobs] == [m == 0 for m in ep.loss_mask]
    assert [v is None for v in ep.weight_versions] == [m == 0 for m in ep.loss_mask]
    assert [v for v in ep.weight_versions if v is not None] == [t for t, s in enumerate(sampled_turns) for _ in s]
    assert len(ep.token_ids) == len(ep.loss_mask) == len(ep.logprobs) == len(ep.weight_versions)
    if template is LLAMA3:
        assert ep.token_ids[0] == tok.bos_token_id and ep.token_ids[1] != tok.bos_token_id


def test_sampled_ids_are_kept_when_they_are_not_the_templates_tokenization(tokenizers):
    tok = tokenizers(CHATML)
    im_end, newline = tok.convert_tokens_to_ids("<|im_end|>"), tok("\n", add_special_tokens=False)["input_ids"]
    ep = Episode(tok, START)
    prompt = ep.prompt_ids()
    spelled = spelled_out(tok, "the model") + [im_end]
    assert spelled[:-1] != tok("the model", add_special_tokens=False)["input_ids"]
    ep.add_model_turn(spelled, logprobs=[-1.0] * len(spelled))
    assert ep.token_ids == prompt + spelled
    ep.add_messages([{"role": "user", "content": "and?"}])
    expected_new = render_chat(tok, ep.messages, add_generation_prompt=False)[
        len(render_chat(tok, ep.messages[:-1], add_generation_prompt=False)):]
    assert ep.token_ids == prompt + spelled + newline + expected_new  # closing: the "\n" after <|im_end|>
    # a truncated turn (no <|im_end|> sampled) is closed by the template's marker
    before = list(ep.token_ids)
    header = ep.prompt_ids()[len(before):]
    cut = spelled_out(tok, "sum")
    ep.add_model_turn(cut)
    ep.add_messages({"role": "user", "content": "go on"})
    assert ep.token_ids[: len(before) + len(header) + len(cut) + 2] == before + header + cut + [im_end] + newline
    assert ep.model_turns() == [spelled, cut]


def test_a_truncated_turn_in_the_templates_own_tokens_is_closed_by_it(tokenizers):
    tok = tokenizers(CHATML)
    ep = Episode(tok, START)
    cut = canonical(tok, CHATML, "the first sum", stop=False)
    ep.add_model_turn(cut)
    ep.add_messages([{"role": "user", "content": "finish"}])
    assert ep.token_ids == render_chat(tok, ep.messages, add_generation_prompt=False)
    assert ep.model_turns() == [cut]


def test_a_template_that_rewrites_earlier_turns_is_refused(tokenizers):
    tok = tokenizers(THINK_STRIPPING)
    plain = Episode(tok, START)  # without reasoning the rewrite changes nothing: a pure extension
    plain.add_model_turn(canonical(tok, CHATML, "46"))
    plain.add_messages([{"role": "user", "content": "and 5+6?"}])
    assert plain.token_ids == render_chat(tok, plain.messages, add_generation_prompt=False)

    ep = Episode(tok, START)
    ep.add_model_turn(canonical(tok, CHATML, "<think>12+34 is 46</think>46"))
    assert ep.messages[-1]["content"] == "<think>12+34 is 46</think>46"
    ids = list(ep.token_ids)
    with pytest.raises(ValueError, match=r"re-renders messages\[2\] \(assistant\)"):
        ep.add_messages([{"role": "user", "content": "and 5+6?"}])
    assert ep.token_ids == ids and len(ep.messages) == 3  # nothing was appended


def test_bad_turns_are_refused_by_name(tokenizers):
    tok = tokenizers(CHATML)
    ep = Episode(tok, START)
    with pytest.raises(ValueError, match="logprobs has 1 entries for 2"):
        ep.add_model_turn([5, 6], logprobs=[0.0])
    with pytest.raises(ValueError, match="weight_versions"):
        ep.add_model_turn([5, 6], weight_versions=[0, 0, 0])
    with pytest.raises(ValueError, match="completion token ids"):
        ep.add_model_turn([])
    with pytest.raises(ValueError, match="completion token ids"):
        ep.add_model_turn([5, -1])
    with pytest.raises(ValueError, match=r"messages\[0\]"):
        ep.add_messages([{"role": "tool"}])
    with pytest.raises(ValueError, match="messages"):
        ep.add_messages([])
    with pytest.raises(ValueError, match="'assistant'"):
        ep.add_model_turn([5, 6], message={"role": "user", "content": "x"})
    with pytest.raises(ValueError, match="'abort'"):  # an unfinished sample is not a whole turn
        ep.add_model_turn(CompletionOutput(0, [5, 6], None, None, "abort", [0, 0]))
    with pytest.raises(ValueError, match="finish_reason=None: an unfinished turn"):  # a stream's snapshot neither
        ep.add_model_turn(CompletionOutput(0, [5, 6], None, None, None, [0, 0]))
    for logprobs in ([float("nan"), -1.0], [0.7, -1.0], [-float("inf"), -1.0], [True, False]):  # a NaN loss, else
        with pytest.raises(ValueError, match="logprobs must be finite numbers <= 0"):
            ep.add_model_turn([5, 6], logprobs=logprobs)
    for versions in (["v1", "v1"], [None, 1.9], [0, -1], [True, 0]):  # refused whole, before the header is added
        with pytest.raises(ValueError, match="weight_versions must be ints >= 0"):
            ep.add_model_turn([5, 6], weight_versions=versions)
    taken = Episode(tok, START)  # tensors of versions and logprobs, as a trainer may hold them
    taken.add_model_turn([5, 6], weight_versions=torch.tensor([0, 1]), logprobs=torch.tensor([-0.5, -1.0]))
    assert taken.weight_versions[-2:] == [0, 1] and all(type(v) is int for v in taken.weight_versions[-2:])
    assert taken.logprobs[-2:] == [-0.5, -1.0]
    assert ep.token_ids == render_chat(tok, START, add_generation_prompt=False)  # nothing changed
    skipping = Episode(tokenizers(SKIPPING), [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match=r"messages\[1\] has role 'tool', which this chat template does not render"):
        skipping.add_messages([{"role": "tool", "content": "46"}])
    with pytest.raises(ValueError, match="renders nothing"):  # a role render_chat takes on trust, dropped all the same
        skipping.add_messages([{"role": "system", "content": "be brief"}])
    with pytest.raises(ValueError, match="tokenizer"):
        Episode(None, START)
    with pytest.raises(ValueError, match="messages"):
        Episode(tok, [{"role": "user", "content": 3}])


def test_episodes_on_the_engine(tiny_checkpoint, tokenizers):
    """Three model turns sampled by the engine from prompt_ids(): the ids, logprobs and versions are the engine's."""
    tok = tokenizers(CHATML)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    engine = Engine(tiny_checkpoint, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=4)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop_token_ids=[im_end])
    ep = Episode(tok, START, tools=[{"type": "function", "function": {"name": "add", "parameters": {}}}])
    outs = []
    for turn in range(3):
        out = engine.generate({"prompt_token_ids": ep.prompt_ids()}, params, use_tqdm=False)[0]
        ep.add_model_turn(out)  # a RequestOutput: its prompt must be prompt_ids()
        outs.append(out.outputs[0])
        if turn < 2:
            ep.add_messages([{"role": "tool", "content": str(turn)}])
    assert ep.model_turns() == [c.token_ids for c in outs]
    assert [lp for lp in ep.logprobs if lp is not None] == [x for c in outs for x in c.logprobs]
    assert [v for v in ep.weight_versions if v is not None] == [0] * sum(len(c.token_ids) for c in outs)
    assert [m["content"] for m in ep.messages if m["role"] == "assistant"] == [c.text for c in outs]
    # the engine scores the whole episode as one sequence: its prompt logprobs at the sampled positions
    # are the sampling logprobs (what a trainer's forward over token_ids sees)
    assert ep.prompt_ids()[: len(ep.token_ids)] == ep.token_ids
    stale = engine.generate({"prompt_token_ids": ep.prompt_ids()[:-1]}, params, use_tqdm=False)[0]
    with pytest.raises(ValueError, match="another prompt"):
        ep.add_model_turn(stale)


@pytest.mark.skipif(not hasattr(Engine, "chat"), reason="Engine.chat (a wrapper over rollout_engine.chat) not yet added")
def test_engine_chat_prompt_is_the_episodes_first_prompt(tiny_checkpoint, tokenizers, tmp_path):
    from test_chat import with_template

    path = with_template(tiny_checkpoint, tmp_path / "chatml", CHATML)
    engine = Engine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=4)
    out = engine.chat(START, SamplingParams(temperature=0, max_tokens=3))[0]
    assert out.prompt_token_ids == Episode(engine.tokenizer, START).prompt_ids()


def test_episode_batch_trains_on_the_loss_mask_only(tokenizers, tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    tok = tokenizers(CHATML)
    eps = []
    for reply in REPLIES[:2]:
        ep = Episode(tok, START)
        sampled = canonical(tok, CHATML, reply)
        ep.add_model_turn(sampled, logprobs=[-1.0] * len(sampled))
        ep.add_messages([{"role": "tool", "content": "46"}])
        ep.add_model_turn(sampled[:3], logprobs=[-2.0] * 3)
        eps.append(ep)
    batch = build_episode_batch(eps, [1.0, 0.0], pad_id=tok.pad_token_id)
    for i, ep in enumerate(eps):
        n = len(ep)
        assert batch.input_ids[i, :n].tolist() == ep.token_ids and batch.attention_mask[i, n:].sum() == 0
        assert batch.completion_mask[i, :n].tolist() == ep.loss_mask and batch.completion_mask[i, n:].sum() == 0
        assert batch.old_logprobs[i].sum().item() == sum(lp for lp in ep.logprobs if lp is not None)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    logprobs = token_logprobs(model, batch)
    loss = -(logprobs * batch.completion_mask).sum()
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(ValueError, match="rewards has 1 entries for 2"):
        build_episode_batch(eps, [1.0], pad_id=0)
    for rewards, match in ((["x", "y"], "rewards must be numbers"), ([[1.0, 2.0], [0.0, 1.0]], r"shape \(2, 2\)")):
        with pytest.raises(ValueError, match=match):
            build_episode_batch(eps, rewards, pad_id=0)
    no_logprobs = Episode(tok, START)
    no_logprobs.add_model_turn(canonical(tok, CHATML, "46"))
    with pytest.raises(ValueError, match="logprobs"):
        build_episode_batch([no_logprobs], [1.0], pad_id=0)
    with pytest.raises(ValueError, match="episodes is empty"):
        build_episode_batch([], [], pad_id=0)
    with pytest.raises(ValueError, match=r"pad_id=-1 is not allowed; a token id \(an int >= 0\)"):
        build_episode_batch(eps, [1.0, 0.0], pad_id=-1)


def test_the_tool_agent_example_runs(capsys):
    """examples/tool_agent.py end to end, made small: episodes, tool calls, GRPO on the loss mask."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "tool_agent", Path(__file__).resolve().parents[1] / "examples" / "tool_agent.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main(["--steps", "2", "--questions", "2", "--group", "2", "--warmup-steps", "3", "--max-tokens", "16"])
    out = capsys.readouterr().out
    assert "step 2: reward" in out and "8 episodes" in out and "trained on (loss mask" in out
    assert example.calculate("2*(3+4)") == "14" and example.calculate("__import__('os')").startswith("error")
    parser = example.HermesToolCallParser(tools=example.TOOLS)
    env = example.CalculatorEnv(17, parser)
    assert env.step('<tool_call>{"name": "calculator", "arguments": {"expression": "2*7+3"}}</tool_call>') == [
        {"role": "tool", "content": "17"}]
    assert env.step("<tool_call>{").pop()["content"].startswith("error:")
    assert env.step("The answer is 17.") == [] and env.done and env.reward() == pytest.approx(1.0)


QWEN_TOOLS = [{"type": "function", "function": {"name": "add", "description": "add two numbers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
QWEN_CALL = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"


def trl_template(tokenizers, name):
    """A tokenizer with one of the chat templates TRL ships (the stock Qwen ones, and its training variants)."""
    from pathlib import Path

    trl = pytest.importorskip("trl")
    path = Path(trl.__file__).parent / "chat_templates" / name
    if not path.exists():
        pytest.skip(f"this TRL has no {name}")
    return tokenizers(path.read_text())


def qwen_episode(tok, replies, kwargs=None):
    ep = Episode(tok, [{"role": "user", "content": "1+2?"}], tools=QWEN_TOOLS, chat_template_kwargs=kwargs)
    ep.add_model_turn(canonical(tok, CHATML, "".join(replies)))
    return ep


def test_qwen3_without_thinking_is_pointed_to_a_prefix_preserving_template(tokenizers):
    """Qwen 3's stock template with enable_thinking=False writes an empty <think></think> into the last assistant
    turn and drops it once a tool turn follows: no chat_template_kwargs help, so the refusal names a prefix-preserving
    template, and TRL's qwen3_training.jinja takes the same turns."""
    off = {"enable_thinking": False}
    ep = qwen_episode(trl_template(tokenizers, "qwen3.jinja"), [QWEN_CALL], off)
    with pytest.raises(ValueError, match=r"messages\[1\] \(assistant\).*enable_thinking=False.*no "
                                         r"chat_template_kwargs changes.*prefix-preserving template.*"
                                         r"qwen3_training\.jinja"):
        ep.add_messages([{"role": "tool", "content": "3"}])
    ep = qwen_episode(trl_template(tokenizers, "qwen3_training.jinja"), [QWEN_CALL], off)
    ep.add_messages([{"role": "tool", "content": "3"}])
    assert ep.messages[-1] == {"role": "tool", "content": "3"}


def test_parallel_tool_results_added_one_by_one_are_told_to_go_in_one_call(tokenizers):
    """Qwen 2.5's template wraps consecutive tool messages in one user block, so a second tool result re-renders
    the first: the refusal says to add them in one add_messages call, which works."""
    tok = trl_template(tokenizers, "qwen2_5.jinja")
    ep = qwen_episode(tok, [QWEN_CALL, QWEN_CALL])
    ep.add_messages([{"role": "tool", "content": "3"}])
    with pytest.raises(ValueError, match=r"messages\[2\] \(tool\).*groups consecutive tool messages.*add "
                                         r"consecutive tool messages .*in one add_messages call"):
        ep.add_messages([{"role": "tool", "content": "3"}])
    ep = qwen_episode(tok, [QWEN_CALL, QWEN_CALL])
    ep.add_messages([{"role": "tool", "content": "3"}, {"role": "tool", "content": "3"}])
    assert ep.token_ids == render_chat(tok, ep.messages, QWEN_TOOLS, None, False)


# ChatML whose generation prompt opens the reasoning block, as DeepSeek-R1's does: the model's text starts inside it
OPENS_THINK = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")


def newline_merging(tok):
    """`tok` with Qwen 2's pre-tokenizer (a run of newlines is one piece) and a "\\n\\n" token (in the slot of its
    last merge): ChatML's header "<|im_start|>assistant\\n" then a reply that opens with "\\n" render as one
    token at the boundary."""
    import json

    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tok.backend_tokenizer.to_str())
    model = spec["model"]
    last = model["merges"].pop()
    model["vocab"]["ĊĊ"] = model["vocab"].pop("".join(last) if isinstance(last, list) else last.replace(" ", ""))
    model["merges"].insert(0, ["Ċ", "Ċ"] if isinstance(last, list) else "Ċ Ċ")
    qwen = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
            r"\s+(?!\S)|\s+")
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": qwen}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
    from tokenizers import Tokenizer

    merged = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                     **{k: getattr(tok, k) for k in ("eos_token", "pad_token", "unk_token")})
    merged.chat_template = tok.chat_template
    return merged


def test_a_reply_that_opens_with_a_newline_is_closed_after_a_header_whose_newline_it_merged(tokenizers):
    """With Qwen's tokenizer the header's "\\n" and a reply's opening "\\n" render as one "\\n\\n" token, so the
    rendering of the turn no longer began with the header's ids and the next turn was refused ("a header other
    than its generation prompt"): any reply opening with a newline ended a ChatML episode. The turn is kept as
    sampled and closed by "\\n" after its <|im_end|>, and the episode goes on."""
    tok = newline_merging(tokenizers(CHATML))
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    header = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert tok("<|im_start|>assistant\n\n46", add_special_tokens=False)["input_ids"][: len(header)] != header
    ep = Episode(tok, START)
    prompt = ep.prompt_ids()
    sampled = tok("\n46", add_special_tokens=False)["input_ids"] + [im_end]
    ep.add_model_turn(sampled, logprobs=[-1.0] * len(sampled))
    ep.add_messages([{"role": "user", "content": "thanks"}])
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    rest = render_chat(tok, ep.messages, add_generation_prompt=False)
    user = rest[len(render_chat(tok, ep.messages[:-1], add_generation_prompt=False)):]
    assert ep.token_ids == prompt + sampled + newline + user
    assert ep.model_turns() == [sampled]
    assert ep.loss_mask == [0] * len(prompt) + [1] * len(sampled) + [0] * len(newline + user)


def test_a_generation_prompt_that_opens_a_block_is_named_with_the_way_out(tokenizers):
    """The rendering of a model turn lacks the '<think>\\n' its generation prompt held: the refusal says so and
    how to add the turn (text= that tail + the reply), which then keeps the sampled ids."""
    tok = tokenizers(OPENS_THINK)
    sampled = canonical(tok, CHATML, "46</think>\nthe sum is 46")
    ep = Episode(tok, START)
    ep.add_model_turn(sampled)
    with pytest.raises(ValueError, match=r"generation prompt ends '<think>\\n', .* add the turn with "
                                         r"text='<think>\\n' \+ its text"):
        ep.add_messages([{"role": "user", "content": "and 5+6?"}])
    fixed = Episode(tok, START)
    fixed.add_model_turn(sampled, text="<think>\n" + tok.decode(sampled, skip_special_tokens=True))
    fixed.add_messages([{"role": "user", "content": "and 5+6?"}])
    assert fixed.model_turns() == [sampled]
