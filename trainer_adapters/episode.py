"""A multi-turn trajectory (model turns and environment/tool turns) kept as token ids.

    ep = Episode(tokenizer, [{"role": "user", "content": "2+3*4?"}], tools=TOOLS)
    out = engine.generate(ep.prompt_ids(), params)[0]
    ep.add_model_turn(out.outputs[0])                      # the sampled ids, logprobs, weight versions
    ep.add_messages([{"role": "tool", "content": "14"}])   # only the new messages' ids are appended
    out = engine.generate(ep.prompt_ids(), params)[0]      # ...
    ep.token_ids, ep.loss_mask, ep.logprobs, ep.weight_versions, ep.messages

How the ids relate to the chat template. Let R(m) be the template's rendering of messages m to ids
(`render_chat`, no generation prompt) and G(m) = R(m + generation prompt) minus R(m).

1. The episode starts as R(initial messages).
2. `prompt_ids()` is the ids so far + G(messages): the template's header of an assistant turn.
3. `add_model_turn(S)` appends G(messages) (loss mask 0) and then exactly the sampled ids S (loss mask
   1, with their logprobs and weight versions), as the engine produced them: a turn that stopped on
   EOS/<|im_end|> ends with that token; a truncated turn ends where it was cut. Nothing is re-tokenized.
   The assistant message (the text) is added to `messages`; it is the template's view of the turn.
4. The turn is *closed* when the next turn starts (`prompt_ids()` shows the closing, the next
   `add_model_turn`/`add_messages` appends it), never at the end of the episode, which ends where
   the model stopped. The closing ids are what the template writes after the model's ids in its own
   rendering of the turn, B = R(messages) minus R(messages before the turn) minus G:
     - if B starts with S (the model's ids are the template's), the closing is the rest of B
       (ChatML: the "\\n" after <|im_end|>; Llama 3: nothing; a truncated turn: "<|im_end|>\\n");
     - otherwise (the model sampled a tokenization the template would not produce, or the message's
       text was replaced) the closing is B from its last special token on (the turn-end marker),
       without that token if S already ends with it (a turn that stopped on EOS where the template
       ends turns with <|im_end|> keeps its EOS, then gets "<|im_end|>\\n"). A turn whose rendering
       has no special token cannot be closed this way: ValueError. A turn whose rendering begins with G's
       text but not its ids (the tokenizer merged G's last ids with the reply's first: ChatML's "\\n" and
       a reply that opens with "\\n" are one "\\n\\n" token for Qwen's tokenizer) is closed this second way.
   The closing ids have loss mask 0.
5. `add_messages(new)` appends R(messages + new) minus R(messages), after checking that
   R(messages + new) starts with R(messages): adding turns must not re-render earlier ones. A template
   that rewrites history (one that strips <think>...</think> from earlier assistant turns, say) is a
   ValueError naming the first message whose rendering changed.

A refused call (any ValueError) changes nothing.

So the ids equal the template's single rendering of the whole conversation wherever the model's
sampled ids are the template's own tokenization of its messages, and otherwise differ only inside
model turns (which keep what was sampled: the ids the logprobs belong to).
"""
from __future__ import annotations

import numbers
import os

import torch

from rollout_engine.chat import check_conversation, render_chat
from rollout_engine.inputs import token_values
from rollout_engine.sampling_params import is_int
from rollout_engine.stop_strings import special_tokens

from .grpo import RolloutBatch
from .step_checks import check_logprob_values, check_pad_id, is_logprob, rewards_tensor

__all__ = ["Episode", "build_episode_batch"]


def _ints(x, name: str) -> list[int]:
    if hasattr(x, "tolist"):
        x = x.tolist()
    if not isinstance(x, (list, tuple)) or not x:
        raise ValueError(f"{name} must be a non-empty list of token ids")
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in x):
        raise ValueError(f"{name} must hold non-negative int token ids")
    return [int(t) for t in x]


class Episode:
    """One trajectory: `token_ids`, with `loss_mask` (1 on model-sampled tokens), `logprobs` and
    `weight_versions` (None on tokens the model did not sample), and the `messages` so far."""

    def __init__(self, tokenizer, messages, tools=None, chat_template_kwargs=None):
        if tokenizer is None:
            raise ValueError("Episode needs a tokenizer with a chat template")
        self.tokenizer, self.tools, self.chat_template_kwargs = tokenizer, tools, chat_template_kwargs
        self.messages: list[dict] = check_conversation(messages, "messages")
        self.token_ids: list[int] = []
        self.loss_mask: list[int] = []
        self.logprobs: list[float | None] = []
        self.weight_versions: list[int | None] = []
        self.turns: list[tuple[str, int, int]] = []  # (kind, start, end): "env" | "header" | "model" | "closing"
        self._rendered = self._render(self.messages)  # R(messages), as far as it has been checked
        self._open_turn = None  # (rendering before the turn, generation prompt ids, sampled ids)
        self._append("env", self._rendered)

    # ------------------------------------------------------------------ rendering

    def _render(self, messages, generation_prompt: bool = False) -> list[int]:
        return render_chat(self.tokenizer, messages, self.tools, self.chat_template_kwargs, generation_prompt,
                           name="messages")

    def _append(self, kind: str, ids, logprobs=None, versions=None) -> None:
        if not ids:
            return
        start = len(self.token_ids)
        self.token_ids += ids
        self.loss_mask += [1 if kind == "model" else 0] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [None] * len(ids)
        self.weight_versions += list(versions) if versions is not None else [None] * len(ids)
        self.turns.append((kind, start, len(self.token_ids)))

    def _diverging_message(self, old: list[int], new: list[int], messages) -> int:
        """The index of the first message whose rendering differs between `old` and `new`."""
        at = next((i for i, (a, b) in enumerate(zip(old, new)) if a != b), min(len(old), len(new)))
        for i in range(1, len(messages) + 1):
            try:
                if len(self._render(messages[:i])) > at:
                    return i - 1
            except ValueError:  # a prefix the template refuses (e.g. must start with a user turn)
                continue
        return len(messages) - 1

    def _extension(self, old: list[int], new: list[int], messages, what: str) -> list[int]:
        """new minus old, when new starts with old; else a ValueError naming the re-rendered turn."""
        if new[: len(old)] != old:
            i = self._diverging_message(old, new, messages)
            raise ValueError(f"the chat template re-renders messages[{i}] ({messages[i]['role']}) when {what}: the "
                             f"episode's ids would no longer be a prefix of the conversation's rendering "
                             f"({self._rerender_advice(i, messages)})")
        return new[len(old):]

    def _rerender_advice(self, i: int, messages) -> str:
        """Why the template re-renders messages[i], as far as the conversation tells, and what to do instead."""
        if messages[i]["role"] == "tool" and i + 1 < len(messages) and messages[i + 1]["role"] == "tool":
            return ("the template groups consecutive tool messages into one block, as Qwen 2.5's and Qwen 3's wrap "
                    "them in one user turn: add consecutive tool messages (parallel tool results) in one "
                    "add_messages call")
        preserving = ("a prefix-preserving template, one that renders every past turn as it did when the turn was "
                      "last (TRL ships one for Qwen 3, qwen3_training.jinja)")
        if messages[i]["role"] == "assistant" and (self.chat_template_kwargs or {}).get("enable_thinking") is False:
            return ("with enable_thinking=False the template writes an empty <think></think> into the last assistant "
                    "turn and drops it once the turn is no longer last, which no chat_template_kwargs changes: use "
                    f"{preserving}")
        return ("a template that rewrites earlier turns, e.g. stripping reasoning from past assistant turns, cannot be "
                f"extended turn by turn; render it with chat_template_kwargs that keep history, or use {preserving}")

    def _closing(self) -> tuple[list[int], list[int]]:
        """(closing ids of the last model turn, R(messages)): rule 4 of the module docstring. Nothing is
        appended here: the closing is committed with the next turn, so a refused turn changes nothing."""
        if self._open_turn is None:
            return [], self._rendered
        if len(self._open_turn) == 4:  # computed before
            return self._open_turn[3]
        before, header, sampled = self._open_turn
        i = len(self.messages) - 1
        rendered = self._render(self.messages)
        turn = self._extension(before, rendered, self.messages, f"messages[{i}] (assistant) is added")
        shared = len(os.path.commonprefix([header, turn]))
        if shared < len(header) and not self._decoded(turn).startswith(self._decoded(header)):
            gap = self.tokenizer.decode(header[shared:])
            raise ValueError(f"the chat template renders messages[{i}] (assistant) with a header other than its "
                             f"generation prompt, so the turn's ids cannot be kept as sampled (the generation "
                             f"prompt ends {gap!r}, which the message's rendering lacks: where that opens a block, "
                             f"as R1's '<think>\\n' does, add the turn with text={gap!r} + its text)")
        # The header's text with its ids merged into the reply's first token (ChatML's "\n" and a reply that opens
        # with "\n", as Qwen's tokenizer writes "\n\n"): the body starts inside the merged ids
        body = turn[shared:]
        if shared == len(header) and body[: len(sampled)] == sampled:
            closing = body[len(sampled):]
        else:
            special = special_tokens(self.tokenizer)
            last = max((j for j, t in enumerate(body) if t in special), default=None)
            if last is None:
                raise ValueError(f"messages[{i}] (assistant): the model's ids are not the template's tokenization of "
                                 f"the message and its rendering has no special token to close the turn with")
            closing = body[last + 1:] if sampled[-1] == body[last] else body[last:]
        self._open_turn = (before, header, sampled, (closing, rendered))
        return closing, rendered

    def _decoded(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _commit_closing(self, closing: list[int], rendered: list[int]) -> None:
        self._append("closing", closing)
        self._rendered, self._open_turn = rendered, None

    # ------------------------------------------------------------------ the public methods

    def prompt_ids(self) -> list[int]:
        """The ids to generate the next model turn from: the ids so far + the template's generation prompt."""
        closing, rendered = self._closing()
        full = self._render(self.messages, generation_prompt=True)
        header = self._extension(rendered, full, self.messages, "the generation prompt is added")
        return self.token_ids + closing + header

    def add_model_turn(self, completion, logprobs=None, weight_versions=None, text=None, message=None) -> None:
        """Append a model turn sampled from `prompt_ids()`: `completion` is a CompletionOutput (its token_ids,
        logprobs, weight_versions and text are used unless given here), a RequestOutput with one completion,
        or a list of token ids. `text` is the message content recorded in `messages` (default: the
        completion's text, else the ids decoded without special tokens); `message` replaces the whole
        assistant message (e.g. with parsed `tool_calls`). Either only changes the template's view of
        later turns: the ids appended are the sampled ones."""
        prompt = None
        if hasattr(completion, "outputs") and hasattr(completion, "prompt_token_ids"):  # a RequestOutput
            if len(completion.outputs) != 1:
                raise ValueError(f"completion is a RequestOutput with {len(completion.outputs)} completions; "
                                 f"pass one CompletionOutput (an episode is one trajectory)")
            prompt, completion = list(completion.prompt_token_ids), completion.outputs[0]
        if hasattr(completion, "token_ids"):  # a CompletionOutput
            reason = getattr(completion, "finish_reason", None)
            if reason == "abort":  # a partial rollout's: not a whole turn
                raise ValueError("completion ended 'abort' (an unfinished sample of a partial rollout): resume it "
                                 "(pass its RequestOutput back to generate) and add the finished turn")
            if reason not in ("stop", "length"):  # None: a stream's snapshot, its turn still going
                raise ValueError(f"completion has finish_reason={reason!r}: an unfinished turn (a stream's snapshot "
                                 "before its end); add the turn once it has finished ('stop' or 'length')")
            logprobs = completion.logprobs if logprobs is None else logprobs
            weight_versions = (completion.weight_versions or None) if weight_versions is None else weight_versions
            text = completion.text if text is None else text
            completion = completion.token_ids
        sampled = _ints(completion, "completion token ids")
        logprobs = None if logprobs is None else [x.item() if hasattr(x, "item") else x for x in logprobs]
        for name, values in (("logprobs", logprobs), ("weight_versions", weight_versions)):
            if values is not None and len(values) != len(sampled):
                raise ValueError(f"{name} has {len(values)} entries for {len(sampled)} sampled tokens")
        if logprobs is not None and not all(is_logprob(x) for x in logprobs):
            raise ValueError("logprobs must be finite numbers <= 0, one per sampled token")
        if weight_versions is not None:
            weight_versions = token_values(weight_versions)  # a tensor's entries as ints
            if not all(v is None or is_int(v) and v >= 0 for v in weight_versions):
                raise ValueError("weight_versions must be ints >= 0 (or None), one per sampled token")
        closing, rendered = self._closing()
        expected = self.prompt_ids()
        if prompt is not None and prompt != expected:
            raise ValueError("the RequestOutput's prompt_token_ids are not this episode's prompt_ids(): it was "
                             "sampled from another prompt")
        if message is None:
            if text is None:
                text = self.tokenizer.decode(sampled, skip_special_tokens=True)
            if not isinstance(text, str):
                raise ValueError(f"text must be a str, got {type(text).__name__}")
            message = {"role": "assistant", "content": text}
        message = check_conversation([message], "message")[0]
        if message["role"] != "assistant":
            raise ValueError(f"a model turn's message has role 'assistant', not {message['role']!r}")
        header = expected[len(self.token_ids) + len(closing):]
        self._commit_closing(closing, rendered)
        self._append("header", header)
        self._append("model", sampled, [float(x) for x in logprobs] if logprobs is not None else None,
                     [None if v is None else int(v) for v in weight_versions] if weight_versions is not None else None)
        self.messages.append(message)
        self._open_turn = (rendered, header, sampled)

    def add_messages(self, messages) -> None:
        """Append environment turns (tool results, user replies): only the ids the template adds for them."""
        if isinstance(messages, dict):
            messages = [messages]
        new = check_conversation(messages, "messages")
        closing, before = self._closing()
        conversation = self.messages + new
        rendered = self._render(conversation)
        first = len(self.messages)
        added = self._extension(before, rendered, conversation, f"messages[{first}:] are added")
        if not added:
            raise ValueError(f"the chat template renders nothing for messages[{first}:] "
                             f"(roles {[m['role'] for m in new]}); the model would never see them")
        self._commit_closing(closing, before)
        self._append("env", added)
        self.messages, self._rendered = conversation, rendered

    # ------------------------------------------------------------------ views

    @property
    def num_model_tokens(self) -> int:
        return sum(self.loss_mask)

    def model_turns(self) -> list[list[int]]:
        """The sampled ids of each model turn, in order."""
        return [self.token_ids[s:e] for kind, s, e in self.turns if kind == "model"]

    def __len__(self) -> int:
        return len(self.token_ids)

    def __repr__(self) -> str:
        return (f"Episode({len(self.messages)} messages, {len(self.token_ids)} tokens, "
                f"{self.num_model_tokens} sampled)")


def build_episode_batch(episodes, rewards, pad_id: int) -> RolloutBatch:
    """Episodes and one reward each as a grpo.RolloutBatch: the whole trajectory is the input, the loss
    mask is the completion mask (model-sampled tokens only), the sampling logprobs are the old ones."""
    episodes = list(episodes)
    if not episodes:
        raise ValueError("episodes is empty; build_episode_batch needs at least one Episode")
    check_pad_id(pad_id)
    if len(rewards) != len(episodes):
        raise ValueError(f"rewards has {len(rewards)} entries for {len(episodes)} episodes")
    if any(lp is None for ep in episodes for lp, m in zip(ep.logprobs, ep.loss_mask) if m):
        raise ValueError("every model turn needs its logprobs: generate with SamplingParams(logprobs=True)")
    width = max(len(ep.token_ids) for ep in episodes)
    ids = torch.full((len(episodes), width), pad_id, dtype=torch.long)
    attention = torch.zeros(len(episodes), width, dtype=torch.long)
    mask = torch.zeros(len(episodes), width)
    old = torch.zeros(len(episodes), width)
    for i, ep in enumerate(episodes):
        n = len(ep.token_ids)
        ids[i, :n] = torch.tensor(ep.token_ids)
        attention[i, :n] = 1
        mask[i, :n] = torch.tensor(ep.loss_mask, dtype=torch.float32)
        old[i, :n] = torch.tensor([lp if lp is not None else 0.0 for lp in ep.logprobs])
    check_logprob_values(old)
    return RolloutBatch(ids, attention, mask, old, rewards_tensor(rewards, len(episodes)))
