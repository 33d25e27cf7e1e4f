"""Conversations to prompt token ids, with the checkpoint's own chat template.

    ids = render_chat(tokenizer, [{"role": "user", "content": "2+2?"}])       # list[int]
    prompts, batched = chat_prompts(tokenizer, conversation_or_list)           # one id list per conversation

Rendering goes through `tokenizer.apply_chat_template(..., tokenize=True)`: the template's text is
tokenized with special tokens off, so a template that writes its own BOS gets exactly one. Rendering
to text and handing the text to generate() would tokenize it again with special tokens on: two BOS
for Llama-3 and Mistral templates. Every error here is a ValueError that names the argument at fault.
"""
from __future__ import annotations

import json
import numbers
from collections.abc import Mapping

from .chat_template import iterates_content
from .inputs import check_characters
from .sampling_params import check_unicode

# Roles every chat template renders. A message of any other role ("tool", "developer", ...: Qwen's templates
# drop "developer") is accepted only if the template renders it (a template that silently drops a message would
# train on a conversation nobody wrote).
RENDERED_ROLES = ("system", "user", "assistant")
# apply_chat_template's own parameters: not template variables.
_RESERVED = frozenset({"conversation", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                       "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                       "sanitize_control_tokens", "messages"})


def _is_message(x) -> bool:
    return isinstance(x, Mapping)


def conversations_of(x, name: str = "conversation") -> tuple[list[list[dict]], bool]:
    """(conversations, batched): `x` is one conversation (a non-empty list of messages) -> ([x], False),
    or a non-empty list of conversations -> (list(x), True). Shapes only; messages are checked by
    `check_conversation`."""
    if isinstance(x, (str, bytes)) or not isinstance(x, (list, tuple)):
        raise ValueError(f"{name} must be a conversation (a list of {{'role', 'content'}} messages) or a list of "
                         f"conversations, got {type(x).__name__}")
    if not x:
        raise ValueError(f"{name} is empty; a conversation needs at least one message")
    if all(_is_message(m) for m in x):
        return [list(x)], False
    if all(isinstance(c, (list, tuple)) for c in x):
        for i, c in enumerate(x):
            if not c:
                raise ValueError(f"{name}[{i}] is an empty conversation; a conversation needs at least one message")
        return [list(c) for c in x], True
    kinds = sorted({type(m).__name__ for m in x})
    raise ValueError(f"{name} mixes or contains non-messages ({', '.join(kinds)}); pass one conversation (a list of "
                     f"{{'role', 'content'}} dicts) or a list of conversations")


def _checked_text_parts(parts, where: str) -> list[dict]:
    """OpenAI content parts, each a {'type': 'text', 'text': str} dict, as a list of plain dicts. Other part types
    (images, audio) have no text to render here and are refused."""
    bad = [j for j, part in enumerate(parts) if not _is_message(part)]
    if bad:
        raise ValueError(f"{where}['content'] is a list whose items {bad[:5]} are not content-part dicts "
                         f"(e.g. {{'type': 'text', 'text': ...}})")
    for j, part in enumerate(parts):
        if part.get("type") != "text":
            raise ValueError(f"{where}['content'][{j}] has type {part.get('type')!r}; only text parts "
                             f"({{'type': 'text', 'text': ...}}) are supported")
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}['content'][{j}] is a text part whose 'text' is a "
                             f"{type(part.get('text')).__name__}; it must be a str")
        check_unicode(part["text"], f"{where}['content'][{j}]['text']")
    return [dict(part) for part in parts]


def _joined_text_parts(messages: list[dict]) -> list[dict]:
    """`messages` with each list of text parts as the one string a template that takes a string needs: the
    texts joined by "\n", as vLLM joins them for such a template. Handed the list, it would render the list's
    Python repr or fail."""
    return [{**m, "content": "\n".join(part["text"] for part in m["content"])}
            if isinstance(m.get("content"), list) else m for m in messages]


def tool_call_arguments(call, where: str):
    """`call` (an assistant's tool call) with its `function.arguments` as the value templates take: OpenAI sends
    a JSON string, which a template's `| tojson` would encode a second time, so it is parsed. vLLM's rules:
    None (or absent), "" and "null" are {}; any other JSON (an object, an array, a number) is its value; text
    that is not JSON is a ValueError naming `where` (the field). Arguments that are not a string (a dict) pass
    through. `call` is not changed."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:  # NaN and Infinity are Python's, not JSON: the parsers refuse what a template would then teach
            arguments = json.loads(arguments, parse_constant=_not_json) if arguments.strip() else None
        except (ValueError, RecursionError) as err:  # JSONDecodeError, _not_json; nested past Python's stack
            raise ValueError(f"{where} is not valid JSON ({err}); OpenAI's tool-call arguments are a JSON object "
                             "encoded as a string") from None
    elif arguments is not None:
        return call
    return {**call, "function": {**function, "arguments": {} if arguments is None else arguments}}


def check_conversation(conversation, name: str = "conversation") -> list[dict]:
    """A list of plain-dict messages, each with a str `role` and a `content` (str, a list of text content parts,
    or None/absent on an assistant message that carries `tool_calls`). Text parts come back as a list of plain
    dicts (render_chat joins them for a template that takes a string), and tool-call arguments given as a JSON
    string as the value it encodes (`tool_call_arguments`: the one rule chat() and /v1/chat/completions
    share); the caller's messages are not changed."""
    if not isinstance(conversation, (list, tuple)) or not conversation:
        raise ValueError(f"{name} must be a non-empty list of {{'role', 'content'}} messages, "
                         f"got {type(conversation).__name__ if conversation else conversation!r}")
    out = []
    for i, m in enumerate(conversation):
        where = f"{name}[{i}]"
        if not _is_message(m):
            raise ValueError(f"{where} is a {type(m).__name__}; every message is a dict with 'role' and 'content'")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"{where} has role {role!r}; a role is a non-empty str such as 'user' or 'tool'")
        content = m.get("content")
        if content is None:
            reasoning = isinstance(m.get("reasoning_content", m.get("reasoning")), str)
            if role != "assistant" or not (reasoning or m.get("tool_calls")):
                raise ValueError(f"{where} ({role}) has no 'content'; only an assistant message with 'tool_calls' "
                                 f"or 'reasoning_content' may omit it")
            if reasoning:  # a reply that was all reasoning (cut short); templates join content as text
                m = {**m, "content": ""}
        elif isinstance(content, (list, tuple)):
            m = {**m, "content": _checked_text_parts(content, where)}
        elif not isinstance(content, str):
            raise ValueError(f"{where}['content'] is a {type(content).__name__}; content is a str, a list of "
                             f"text content parts, or None on an assistant message with tool_calls")
        if isinstance(m.get("content"), str):
            check_unicode(m["content"], f"{where}['content']")
        tool_calls = m.get("tool_calls")
        if tool_calls is not None and not (isinstance(tool_calls, (list, tuple))
                                           and all(_is_message(c) for c in tool_calls)):
            raise ValueError(f"{where}['tool_calls'] must be a list of dicts")
        if tool_calls is not None:
            m = {**m, "tool_calls": [tool_call_arguments(c, f"{name}[{i}].tool_calls[{j}].function.arguments")
                                     for j, c in enumerate(tool_calls)]}
            check_json_text(m["tool_calls"], f"{where}['tool_calls']")
        out.append(dict(m))
    return out


def check_tools(tools, name: str = "tools"):
    """`tools` as JSON-schema dicts (None for none): a documented function becomes its schema here, as
    apply_chat_template would make it, so what measures, renders and checks a call sees one form."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) or callable(t) for t in tools):
        raise ValueError(f"{name} must be None or a list of JSON-schema dicts (or documented functions), "
                         f"got {type(tools).__name__}")
    schemas = [t if isinstance(t, Mapping) else _function_schema(t, f"{name}[{i}]") for i, t in enumerate(tools)]
    check_json_text(schemas, name)
    return schemas or None  # tools=[] renders tool boilerplate in some templates (Llama 3)


def _not_json(constant: str):
    raise ValueError(f"{constant} is not JSON")


def check_json_text(value, name: str) -> None:
    """`value` is what a template renders as JSON: serializable (no NaN or infinity: not JSON), and Unicode text (a
    lone surrogate, which JSON's "\\ud800" gives, fails inside the tokenizer with a message that names nothing)."""
    try:
        text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as err:
        raise ValueError(f"{name} must be JSON-serializable: {err}") from None
    check_unicode(text, name)


def _function_schema(function, name: str) -> dict:
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(function)
    except Exception as err:  # noqa: BLE001 - DocstringParsingException, TypeError for an untyped argument, ...
        raise ValueError(f"{name} ({getattr(function, '__name__', function)!r}) has no JSON schema that "
                         f"transformers can read off it: {err}") from None


def check_template_kwargs(kwargs, name: str = "chat_template_kwargs") -> dict:
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"{name} must be None or a dict of template variables with str keys, "
                         f"got {type(kwargs).__name__}")
    clash = sorted(_RESERVED & set(kwargs))
    if clash:
        raise ValueError(f"{name} may not set {clash}: those are apply_chat_template's own arguments")
    return dict(kwargs)


def _ids_of(result, name: str) -> list[int]:
    """apply_chat_template's tokenized result as a flat list of ints: transformers 5 returns a BatchEncoding
    (a dict) by default, 4.x a list; tensors and a batch dimension of one are unwrapped."""
    if isinstance(result, Mapping):  # BatchEncoding is a UserDict
        result = result["input_ids"]
    if hasattr(result, "tolist"):
        result = result.tolist()
    if isinstance(result, (list, tuple)) and len(result) == 1 and isinstance(result[0], (list, tuple)):
        result = result[0]
    if isinstance(result, str):
        raise ValueError(f"the chat template of {name} rendered text, not token ids")
    ids = list(result)
    if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"the chat template of {name} did not give a flat list of token ids")
    return [int(t) for t in ids]


def render_chat(tokenizer, conversation, tools=None, chat_template_kwargs=None, add_generation_prompt: bool = True,
                *, chat_template: str | None = None, name: str = "conversation", max_seq_len: int | None = None,
                continue_final_message: bool = False) -> list[int]:
    """The token ids of one conversation under the tokenizer's chat template (or `chat_template`).

    `tools`: JSON schemas the template may render; `chat_template_kwargs`: extra template variables
    (e.g. {"enable_thinking": False}); `add_generation_prompt`: end with the header of an assistant turn;
    `continue_final_message`: end inside the last message, left open for the model to continue (a prefilled
    assistant turn; then add_generation_prompt must be False, as transformers and vLLM require);
    `max_seq_len`: refuse, before the template runs, a conversation whose text no sequence can hold (rendering
    megabytes takes seconds and gigabytes)."""
    if tokenizer is None:
        raise ValueError(f"rendering {name} needs a tokenizer; this checkpoint ships none: pass token ids instead")
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError(f"tokenizer {type(tokenizer).__name__} has no apply_chat_template; cannot render {name}")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(f"the tokenizer has no chat template, so {name} cannot be rendered: set "
                         f"tokenizer.chat_template (chat_template.jinja in the checkpoint) or pass token ids")
    messages = check_conversation(conversation, name)
    if not (isinstance(template, str) and iterates_content(template)):  # a dict of named templates: unsure
        messages = _joined_text_parts(messages)
    tools = check_tools(tools)
    kwargs = check_template_kwargs(chat_template_kwargs)
    for arg, value in (("add_generation_prompt", add_generation_prompt),
                       ("continue_final_message", continue_final_message)):
        if not isinstance(value, bool):
            raise ValueError(f"{arg}={value!r} is not allowed; a bool")
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message=True is not allowed with add_generation_prompt=True: the reply either "
                         "opens a new assistant turn or continues the last message; pass add_generation_prompt=False")
    if max_seq_len is not None:
        tools_text = len(json.dumps(tools, ensure_ascii=False)) if tools else 0
        check_characters(_characters(_joined_text_parts(messages)) + tools_text, tokenizer, max_seq_len, name)

    def apply(msgs, tokenize=True):
        try:
            result = tokenizer.apply_chat_template(
                msgs, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=False,
                continue_final_message=continue_final_message,
                **({"chat_template": chat_template} if chat_template is not None else {}), **kwargs)
        except Exception as err:  # noqa: BLE001 - jinja's TemplateError (raise_exception), TypeError, KeyError, ...
            raise ValueError(f"the chat template rejected {name}: {type(err).__name__}: {err}") from err
        return _ids_of(result, name) if tokenize else result

    ids = apply(messages)
    _check_unusual_roles(messages, lambda msgs: apply(msgs, tokenize=False), name)
    if not ids:
        raise ValueError(f"the chat template rendered {name} as no tokens at all")
    return ids


def _characters(value) -> int:
    """Characters in every string of a checked conversation (contents, tool-call arguments, names), walked
    without recursion: a caller's nesting may be deeper than Python's stack."""
    total, stack = 0, [value]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            total += len(value)
        elif isinstance(value, (Mapping, list, tuple)):
            stack.extend(value.values() if isinstance(value, Mapping) else value)
    return total


def _check_unusual_roles(messages, render_text, name: str) -> None:
    """A message whose role is not among RENDERED_ROLES must show in the rendering, or the template dropped it (a
    conversation nobody wrote would be trained on). One rendering checks them all: each such message's content
    becomes a probe of its own, and every probe must appear in the text."""
    unusual = [i for i, m in enumerate(messages) if m["role"] not in RENDERED_ROLES]
    if not unusual:
        return
    probes = {i: f"\u2063{i}\u2063" for i in unusual}  # invisible separators around the index: no template's words
    # each in its content's shape: a template that loops over parts would take a string's characters for parts
    text = render_text([{**m, "content": [{"type": "text", "text": probes[i]}] if isinstance(m["content"], list)
                         else probes[i]} if i in probes else m for i, m in enumerate(messages)])
    dropped = [i for i in unusual if probes[i] not in (text if isinstance(text, str) else "")]
    if dropped:
        raise ValueError(f"{name}[{dropped[0]}] has role {messages[dropped[0]]['role']!r}, which this chat template "
                         f"does not render (the message would be dropped); give its content another role, e.g. "
                         f"'system' for a 'developer' message")


def chat_prompts(tokenizer, conversations, tools=None, chat_template_kwargs=None,
                 add_generation_prompt: bool = True, name: str = "conversations",
                 max_seq_len: int | None = None, continue_final_message: bool = False) -> tuple[list[list[int]], bool]:
    """(one id list per conversation, batched): what `chat()` hands to `generate()`. `batched` says whether
    `conversations` was a list of conversations (else it was one conversation)."""
    convs, batched = conversations_of(conversations, name)
    tools = check_tools(tools)  # once: a documented function's schema is read off it here, not per conversation
    return [render_chat(tokenizer, c, tools, chat_template_kwargs, add_generation_prompt,
                        name=f"{name}[{i}]" if batched else name, max_seq_len=max_seq_len,
                        continue_final_message=continue_final_message)
            for i, c in enumerate(convs)], batched
