"""Conversations rendered with the checkpoint's chat template, straight to ids (rollout_engine.chat)."""
import asyncio
import shutil

import pytest
import torch

from rollout_engine import AsyncEngine, Engine, SamplingParams
from rollout_engine.chat import chat_prompts, conversations_of, iterates_content, render_chat

# Llama-3's layout built from the tiny tokenizer's special tokens: <|endoftext|> is BOS (<|begin_of_text|>)
# and the end of a turn (<|eot_id|>, Llama 3's EOS at generation), <|im_start|>/<|im_end|> stand for
# <|start_header_id|>/<|end_header_id|>. Like Llama 3's, the template writes the BOS itself.
LLAMA3 = (
    "{{ bos_token }}"
    "{% if tools %}{{ '<|im_start|>system<|im_end|>\\n\\nTools: ' + tools | tojson + '<|endoftext|>' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool', 'ipython'] %}"
    "{{ raise_exception('Unknown role: ' + m['role']) }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '<|im_end|>\\n\\n' + m['content'] | trim + '<|endoftext|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant<|im_end|>\\n\\n' }}{% endif %}")

# Qwen 2.5 / ChatML: no BOS, turns end with <|im_end|> and a newline, tools listed in the system turn,
# tool results go back inside <tool_response> in a user turn.
CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + '\\n\\n' }}{% endif %}"
    "{{ '# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + t | tojson }}{% endfor %}"
    "{{ '\\n</tools>\\nCall a tool with <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0]['role'] == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

TEMPLATES = {"llama3": LLAMA3, "chatml": CHATML}
CONVERSATIONS = [
    [{"role": "user", "content": "12+34="}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the model"},
     {"role": "assistant", "content": "a token"}, {"role": "user", "content": "sum of 3 and 4?"}],
    [{"role": "user", "content": "add 2 and 3"}, {"role": "assistant", "content": "<tool_call>{}</tool_call>"},
     {"role": "tool", "content": "5"}],
]


def with_template(checkpoint, dest, template, bos: bool = False):
    """A copy of `checkpoint` whose tokenizer has `template` (and, with `bos`, <|endoftext|> as a BOS that
    plain tokenization adds, like Llama 3's and Mistral's tokenizers)."""
    from transformers import AutoTokenizer

    shutil.copytree(checkpoint, dest, dirs_exist_ok=True)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = template
    if bos:
        tok.bos_token = "<|endoftext|>"
        tok.add_bos_token = True
    tok.save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint, tmp_path_factory):
    """name -> (path, Engine): the tiny checkpoint with each template; llama3's tokenizer adds a BOS."""
    made = {}

    def get(name):
        if name not in made:
            path = with_template(tiny_checkpoint, tmp_path_factory.mktemp(name), TEMPLATES[name], bos=name == "llama3")
            made[name] = (path, Engine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8))
        return made[name]

    return get


GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_prompt_ids_are_apply_chat_template_tokenized(checkpoints, name, conv, generation_prompt):
    _, engine = checkpoints(name)
    tok, conversation = engine.tokenizer, CONVERSATIONS[conv]
    ids = render_chat(tok, conversation, add_generation_prompt=generation_prompt)
    expected = tok.apply_chat_template(conversation, tokenize=True, add_generation_prompt=generation_prompt)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected  # transformers 5: a BatchEncoding
    assert ids == list(expected)
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    with_tools = render_chat(tok, conversation, tools=tools, add_generation_prompt=generation_prompt)
    assert with_tools == list(tok.apply_chat_template(conversation, tools=tools, tokenize=True, return_dict=False,
                                                      add_generation_prompt=generation_prompt))
    assert with_tools != ids and "calculator" in tok.decode(with_tools)


def test_no_double_bos(checkpoints):
    """The Llama-3-style template writes its BOS; text re-tokenized with special tokens adds another."""
    _, engine = checkpoints("llama3")
    tok, bos = engine.tokenizer, engine.tokenizer.bos_token_id
    conversation = CONVERSATIONS[1]
    # the old path: render to text, let generate() tokenize it (special tokens on)
    text = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    old = engine.generate(text, GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert old[:2] == [bos, bos]
    # the new path: ids from the template, handed over as ids
    ids = render_chat(tok, conversation)
    assert ids[0] == bos and ids[1] != bos and ids.count(bos) == old.count(bos) - 1
    assert old[1:] == ids
    out = engine.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids


def test_chat_prompts_one_or_many(checkpoints):
    _, engine = checkpoints("chatml")
    tok = engine.tokenizer
    one, batched = chat_prompts(tok, CONVERSATIONS[0])
    assert not batched and one == [render_chat(tok, CONVERSATIONS[0])]
    many, batched = chat_prompts(tok, CONVERSATIONS)
    assert batched and many == [render_chat(tok, c) for c in CONVERSATIONS]
    assert conversations_of(CONVERSATIONS[1]) == ([CONVERSATIONS[1]], False)
    assert conversations_of(tuple(CONVERSATIONS)) == (CONVERSATIONS, True)
    # the ids generate the same greedy tokens as the engine's own chat (when it exists)
    outs = engine.generate([{"prompt_token_ids": p} for p in many], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == many


@pytest.mark.skipif(not hasattr(Engine, "chat"), reason="Engine.chat (a wrapper over rollout_engine.chat) not yet added")
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_engine_chat(checkpoints, name):
    _, engine = checkpoints(name)
    tok = engine.tokenizer
    one = engine.chat(CONVERSATIONS[1], GREEDY)
    assert len(one) == 1 and one[0].prompt_token_ids == render_chat(tok, CONVERSATIONS[1])
    direct = engine.generate({"prompt_token_ids": render_chat(tok, CONVERSATIONS[1])}, GREEDY, use_tqdm=False)
    assert one[0].outputs[0].token_ids == direct[0].outputs[0].token_ids
    many = engine.chat(CONVERSATIONS, GREEDY)
    assert [o.prompt_token_ids for o in many] == [render_chat(tok, c) for c in CONVERSATIONS]
    tools = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    with_tools = engine.chat(CONVERSATIONS[0], GREEDY, tools=tools, chat_template_kwargs={"unused": 1})
    assert with_tools[0].prompt_token_ids == render_chat(tok, CONVERSATIONS[0], tools=tools)
    if name == "llama3":
        assert one[0].prompt_token_ids.count(tok.bos_token_id) == len(CONVERSATIONS[1]) + 1  # BOS + turn ends
    with pytest.raises(ValueError, match="content"):
        engine.chat([{"role": "user"}], GREEDY)
    if name == "llama3":  # its template refuses unknown roles; ChatML renders any role
        with pytest.raises(ValueError, match="narrator"):
            engine.chat([{"role": "narrator", "content": "x"}], GREEDY)
    assert engine.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY, use_tqdm=False)  # still works


PREFILLED = [{"role": "user", "content": "12+34="}, {"role": "assistant", "content": "The sum is"}]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_a_prefilled_assistant_turn_is_continued(checkpoints, name):
    """continue_final_message (transformers' and vLLM's): the prompt ends inside the last message, so the model
    continues "The sum is" rather than answering after it; through render_chat, Engine.chat and AsyncEngine.chat."""
    path, engine = checkpoints(name)
    tok = engine.tokenizer
    ids = render_chat(tok, PREFILLED, add_generation_prompt=False, continue_final_message=True)
    assert ids == list(tok.apply_chat_template(PREFILLED, tokenize=True, return_dict=False,
                                               add_generation_prompt=False, continue_final_message=True))
    assert tok.decode(ids).endswith("The sum is") and ids != render_chat(tok, PREFILLED, add_generation_prompt=False)
    out = engine.chat(PREFILLED, GREEDY, add_generation_prompt=False, continue_final_message=True)[0]
    assert out.prompt_token_ids == ids
    with pytest.raises(ValueError, match="continue_final_message=True is not allowed with add_generation_prompt"):
        engine.chat(PREFILLED, GREEDY, continue_final_message=True)
    with pytest.raises(ValueError, match="continue_final_message=1 is not allowed; a bool"):
        render_chat(tok, PREFILLED, add_generation_prompt=False, continue_final_message=1)

    async def main(async_engine):
        return await async_engine.chat(PREFILLED, GREEDY, add_generation_prompt=False, continue_final_message=True)

    if name == "chatml":
        with AsyncEngine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8) as async_engine:
            assert asyncio.run(main(async_engine)).prompt_token_ids == ids


def weather(city: str) -> str:
    """Get the weather.

    Args:
        city: The city.
    """
    return "sunny"


def test_a_documented_function_is_a_tool_as_its_json_schema(checkpoints):
    """tools=[a function] (apply_chat_template's own convenience) renders as the schema transformers reads off
    its signature and docstring, through Engine.chat too, whose length check measures that schema."""
    from transformers.utils import get_json_schema

    _, engine = checkpoints("chatml")
    schema_ids = render_chat(engine.tokenizer, CONVERSATIONS[0], tools=[get_json_schema(weather)])
    assert render_chat(engine.tokenizer, CONVERSATIONS[0], tools=[weather]) == schema_ids
    assert engine.chat(CONVERSATIONS[0], GREEDY, tools=[weather])[0].prompt_token_ids == schema_ids


def test_async_engine_chat(checkpoints):
    """AsyncEngine.chat renders the conversation at the call: one edited before the coroutine runs (a task made
    in a loop over one list of messages) still runs as called; a refusal surfaces at the await."""
    path, engine = checkpoints("chatml")
    expected = engine.generate({"prompt_token_ids": render_chat(engine.tokenizer, CONVERSATIONS[2])}, GREEDY,
                               use_tqdm=False)[0]

    async def main(async_engine):
        conversation = [dict(message) for message in CONVERSATIONS[2]]
        called = async_engine.chat(conversation, GREEDY)
        conversation[-1]["content"] = "something else"
        out = await called
        with pytest.raises(ValueError):
            await async_engine.chat([{"role": "user"}], GREEDY)
        parts = await async_engine.chat(as_content_parts(CONVERSATIONS[2]), GREEDY)
        with pytest.raises(ValueError, match=r"conversation\[0\].*'image_url'"):
            await async_engine.chat([{"role": "user", "content": [IMAGE_PART]}], GREEDY)
        return out, parts

    with AsyncEngine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8) as async_engine:
        out, parts = asyncio.run(main(async_engine))
    assert out.prompt_token_ids == expected.prompt_token_ids
    assert out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert parts.prompt_token_ids == render_chat(engine.tokenizer, as_joined_parts(CONVERSATIONS[2]))


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}


def as_content_parts(conversation):
    """The conversation with each message's text split over OpenAI content parts (two where it has two
    characters or more), as a client of the chat API sends it."""
    return [{**m, "content": [{"type": "text", "text": m["content"][:1]}, {"type": "text", "text": m["content"][1:]}]}
            for m in conversation]


def as_joined_parts(conversation):
    """What as_content_parts' messages render as: their two texts joined by "\n"."""
    return [{**m, "content": m["content"][:1] + "\n" + m["content"][1:]} for m in conversation]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_content_parts_render_as_their_joined_text(checkpoints, name):
    """A list of text parts renders as its texts joined by "\n" (vLLM's rule for a template that takes a string,
    which /v1/chat/completions applies too), never as the list's Python repr; Engine.chat and render_chat
    agree."""
    _, engine = checkpoints(name)
    tok = engine.tokenizer
    expected = render_chat(tok, as_joined_parts(CONVERSATIONS[1]))
    assert render_chat(tok, as_content_parts(CONVERSATIONS[1])) == expected
    assert "'type'" not in tok.decode(render_chat(tok, as_content_parts(CONVERSATIONS[1])))
    out = engine.chat(as_content_parts(CONVERSATIONS[1]), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == expected
    empty = [{"role": "user", "content": []}]
    assert render_chat(tok, empty) == render_chat(tok, [{"role": "user", "content": ""}])


# Loops over a message's content when it is a list of parts, as Llama 3.2 Vision / 4, Mistral, Gemma 3 and Qwen2-VL
# templates do; a string content renders as it is.
PARTS = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.content is string %}{{ m.content }}{% else %}"
         "{% for c in m.content %}{% if c.type == 'text' %}{{ c.text }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n"
         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Reads a list content's first part without a loop: taken as a template of string content.
FIRST_PART = ("{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}{% else %}"
              "{{ m.content[0].text }}{% endif %}{{ '\\n' }}{% endfor %}")
TWO_PARTS = [{"role": "system", "content": "be brief"},
             {"role": "user", "content": [{"type": "text", "text": "2+2="}, {"type": "text", "text": "answer"}]}]


def test_a_template_that_iterates_content_is_handed_the_parts(tiny_checkpoint, tmp_path):
    """A template that loops over a message's content parts gets them as they came (vLLM's "openai" content
    format): the ids are apply_chat_template's for the same conversation, "2+2=" and "answer" side by side rather
    than joined by "\n", through render_chat and Engine.chat alike. Parts are checked as for any template."""
    path = with_template(tiny_checkpoint, tmp_path / "parts", PARTS)
    engine = Engine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8)
    tok = engine.tokenizer
    expected = list(tok.apply_chat_template(TWO_PARTS, tokenize=True, add_generation_prompt=True, return_dict=False))
    assert render_chat(tok, TWO_PARTS) == expected
    assert "2+2=answer<|im_end|>" in tok.decode(expected)
    assert engine.chat(TWO_PARTS, GREEDY, use_tqdm=False)[0].prompt_token_ids == expected
    assert TWO_PARTS[1]["content"][0] == {"type": "text", "text": "2+2="}  # the caller's messages are not changed
    with pytest.raises(ValueError, match=r"conversation\[0\]\['content'\]\[0\] has type 'image_url'"):
        render_chat(tok, [{"role": "user", "content": [IMAGE_PART]}])
    with pytest.raises(ValueError, match="Unicode"):
        render_chat(tok, [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}])


def test_a_template_that_only_indexes_content_gets_the_joined_text(tiny_checkpoint):
    """FIRST_PART has no loop over content, so it takes a string: handed the list it would render the first
    part alone and drop the rest; the joined text keeps every part (vLLM decides the same)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tok.chat_template = FIRST_PART
    text = tok.decode(render_chat(tok, TWO_PARTS, add_generation_prompt=False))
    assert text == "system:be brief\nuser:2+2=\nanswer\n"


@pytest.mark.parametrize("template, iterates", [
    (PARTS, True),
    # another loop variable, the subscript form, an alias of messages and a filter on the parts
    ("{% set turns = messages[1:] %}{% for turn in turns %}"
     "{% for p in turn['content'] | selectattr('type', 'equalto', 'text') %}{{ p['text'] }}{% endfor %}{% endfor %}",
     True),
    ("{% for c in messages[0].content %}{{ c.text }}{% endfor %}", True),
    ("{% for m in messages %}{% generation %}{% for c in m.content %}{{ c.text }}{% endfor %}{% endgeneration %}"
     "{% endfor %}", True),  # transformers' own tag parses
    (FIRST_PART, False),
    (LLAMA3, False),
    (CHATML, False),
    ("{% for d in documents %}{% for c in d.content %}{{ c }}{% endfor %}{% endfor %}"
     "{% for m in messages %}{{ m.content }}{% endfor %}", False),  # a document's content is not a message's
    ("{% for m in messages %}{% for c in m.tool_calls %}{{ c.content }}{% endfor %}{% endfor %}", False),
    ("{% for m in messages %}{{ m.content }}", False),  # jinja cannot parse it: taken as a string
])
def test_which_templates_iterate_content(template, iterates):
    assert iterates_content(template) is iterates
    hits = iterates_content.cache_info().hits
    assert iterates_content(template) is iterates and iterates_content.cache_info().hits == hits + 1


# ---------------------------------------------------------------------------------------------- bad input

# A template that renders only the roles it knows and silently skips the rest.
SKIPPING = ("{% for m in messages %}{% if m['role'] in ['user', 'assistant'] %}"
            "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CALL_ADD = {"type": "function", "function": {"name": "add", "arguments": "{}"}}

BAD = [
    # (conversation, kwargs, words the error must contain)
    ("hello", {}, ["conversation", "str"]),
    ([], {}, ["conversation", "empty"]),
    ([{"role": "user", "content": "hi"}, "hi"], {}, ["conversation"]),
    ([["not a message"]], {}, ["conversation[0]"]),
    ([[]], {}, ["conversation[0]", "empty"]),
    ([{"content": "hi"}], {}, ["conversation[0]", "role"]),
    ([{"role": 3, "content": "hi"}], {}, ["conversation[0]", "role"]),
    ([{"role": "", "content": "hi"}], {}, ["conversation[0]", "role"]),
    ([{"role": "user"}], {}, ["conversation[0]", "content"]),
    ([{"role": "user", "content": 5}], {}, ["conversation[0]['content']"]),
    ([{"role": "user", "content": ["text"]}], {}, ["conversation[0]['content']"]),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": [IMAGE_PART]}], {},
     ["conversation[1]", "'image_url'", "text parts"]),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"text": "b"}]}], {}, ["conversation[0]", "None"]),
    ([{"role": "user", "content": [{"type": "text", "text": 3}]}], {}, ["conversation[0]", "text"]),
    ([{"role": "user", "content": "a\ud800b"}], {}, ["conversation[0]['content']", "Unicode", "character 1"]),
    ([{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}], {}, ["conversation[0]['content']",
                                                                                "Unicode"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None}], {}, ["conversation[1]"]),
    ([{"role": "assistant", "content": None, "tool_calls": "x"}], {}, ["tool_calls"]),
    # only an assistant may leave content out (a user's rendered as "user: ")
    ([{"role": "user", "content": None, "tool_calls": [CALL_ADD]}], {}, ["conversation[0] (user)", "no 'content'"]),
    ([{"role": "user", "content": None, "reasoning_content": "r"}], {}, ["conversation[0] (user)", "no 'content'"]),
    # a lone surrogate in a tool call or a tool failed in the tokenizer with a message naming nothing
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {**CALL_ADD, "function": {"name": "add", "arguments": '{"a": "\\ud800"}'}}]}], {},
     ["conversation[1]['tool_calls']", "Unicode"]),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": [
        {**CALL_ADD, "function": {"name": "a\ud800", "arguments": "{}"}}]}], {},
     ["conversation[1]['tool_calls']", "Unicode"]),
    (CONVERSATIONS[0], {"tools": [{"type": "function", "function": {"name": "f\udc00"}}]}, ["tools", "Unicode"]),
    ([{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}], {}, ["conversation", "Unknown role"]),
    (CONVERSATIONS[0], {"tools": "calculator"}, ["tools"]),
    (CONVERSATIONS[0], {"tools": [3]}, ["tools"]),
    (CONVERSATIONS[0], {"tools": [lambda city: city]}, ["tools[0]", "'<lambda>'", "JSON schema"]),
    (CONVERSATIONS[0], {"tools": [{"type": "function", "function": {"name": "f", "tags": {1, 2}}}]},
     ["tools", "JSON-serializable"]),
    (CONVERSATIONS[0], {"chat_template_kwargs": ["x"]}, ["chat_template_kwargs"]),
    (CONVERSATIONS[0], {"chat_template_kwargs": {"tokenize": False}}, ["chat_template_kwargs", "tokenize"]),
    (CONVERSATIONS[0], {"chat_template_kwargs": {1: 2}}, ["chat_template_kwargs"]),
    (CONVERSATIONS[0], {"add_generation_prompt": "yes"}, ["add_generation_prompt"]),
]


@pytest.mark.parametrize("conversation, kwargs, words", BAD)
def test_bad_conversations_are_value_errors_naming_the_argument(checkpoints, conversation, kwargs, words):
    _, engine = checkpoints("llama3")
    with pytest.raises(ValueError) as err:
        chat_prompts(engine.tokenizer, conversation, name="conversation", **kwargs)
    for word in words:
        assert word in str(err.value), err.value
    assert engine.generate({"prompt_token_ids": render_chat(engine.tokenizer, CONVERSATIONS[0])}, GREEDY,
                           use_tqdm=False)  # the engine is unaffected


def test_no_tokenizer_no_template_and_ignored_roles(checkpoints, tiny_checkpoint):
    from transformers import AutoTokenizer

    with pytest.raises(ValueError, match="needs a tokenizer"):
        render_chat(None, CONVERSATIONS[0])
    bare = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert not bare.chat_template
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(bare, CONVERSATIONS[0])
    with pytest.raises(ValueError, match="no chat template"):
        render_chat(bare, CONVERSATIONS[0], chat_template="")
    # a role the template skips silently is refused; one it renders is fine
    conv = [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}]
    with pytest.raises(ValueError, match=r"conversation\[1\] has role 'narrator'"):
        render_chat(bare, conv, chat_template=SKIPPING)
    assert render_chat(bare, conv, chat_template=CHATML) == bare.apply_chat_template(
        conv, chat_template=CHATML, tokenize=True, return_dict=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match=r"conversation\[0\] has role 'narrator'"):
        render_chat(bare, conv[1:], chat_template=SKIPPING)


@pytest.mark.parametrize("role", ["developer", "function", "ipython", "tool"])
def test_a_common_role_the_template_drops_is_refused(tiny_checkpoint, role):
    """Qwen's templates render system, user, assistant and tool, and skip a "developer" message (what OpenAI
    clients send for instructions): a common role is checked like any other, so the instruction is not lost."""
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_checkpoint)
    conv = [{"role": role, "content": "answer in French"}, {"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=rf"conversation\[0\] has role '{role}', which this chat template does not"):
        render_chat(bare, conv, chat_template=SKIPPING)
    assert render_chat(bare, conv, chat_template=CHATML) == bare.apply_chat_template(
        conv, chat_template=CHATML, tokenize=True, return_dict=False, add_generation_prompt=True)


# Loops over every message's content parts, with no case for a string.
LOOPS_ONLY = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% for c in m.content %}{% if c.type == 'text' %}"
              "{{ c.text }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_role_check_probes_content_parts_as_parts(tiny_checkpoint):
    """The dropped-role check renders a probe in each such message's place: as a text part where the content is
    a list, since a template that loops over parts would take a string probe's characters for parts and render
    nothing (refusing a tool result it renders)."""
    from transformers import AutoTokenizer

    bare = AutoTokenizer.from_pretrained(tiny_checkpoint)
    conv = [{"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "tool", "content": [{"type": "text", "text": "sunny"}]}]
    assert render_chat(bare, conv, chat_template=LOOPS_ONLY) == bare.apply_chat_template(
        conv, chat_template=LOOPS_ONLY, tokenize=True, return_dict=False, add_generation_prompt=True)


def _nested(depth: int, leaf="x"):
    for _ in range(depth):
        leaf = {"k": leaf}
    return leaf


DEEP = [  # (conversation, tools): nesting deeper than Python's recursion limit, each a ValueError
    ([{"role": "user", "content": "hi", "metadata": _nested(5000)}], None),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": _nested(5000)}}]}], None),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}], None),
    ([{"role": "user", "content": "hi"}], [{"type": "function", "function": {"name": "f", "parameters": _nested(5000)}}]),
]


@pytest.mark.parametrize("conversation, tools", DEEP)
def test_nesting_deeper_than_the_stack_is_a_value_error(checkpoints, conversation, tools):
    """A request's JSON may nest deeper than Python's stack (a server's parser takes about 1,000 levels): a
    ValueError (the server's 400), not a RecursionError (its 500), and the engine serves on."""
    _, engine = checkpoints("chatml")
    with pytest.raises(ValueError):
        chat_prompts(engine.tokenizer, conversation, tools=tools, name="conversation", max_seq_len=4096)
    assert engine.chat(CONVERSATIONS[0], GREEDY)[0].outputs[0].token_ids


class StubTokenizer:
    """apply_chat_template answering in each of the shapes tokenizers and processors use."""

    chat_template = "stub"

    def __init__(self, shape):
        self.shape = shape

    def apply_chat_template(self, conversation, **kwargs):
        from transformers import BatchEncoding

        ids = [5, 6, 7]
        return {"list": ids, "nested": [ids], "dict": {"input_ids": ids, "attention_mask": [1, 1, 1]},
                "batch_encoding": BatchEncoding({"input_ids": ids}), "tensor": torch.tensor([ids]),
                "text": "5 6 7", "floats": [5.0, 6.0]}[self.shape]


@pytest.mark.parametrize("shape", ["list", "nested", "dict", "batch_encoding", "tensor"])
def test_every_tokenized_shape_becomes_a_flat_id_list(shape):
    assert render_chat(StubTokenizer(shape), CONVERSATIONS[0]) == [5, 6, 7]


@pytest.mark.parametrize("shape", ["text", "floats"])
def test_a_rendering_that_is_not_ids_is_refused(shape):
    with pytest.raises(ValueError, match="token ids"):
        render_chat(StubTokenizer(shape), CONVERSATIONS[0])


# ---------------------------------------------------------------------------------------------- tool calls

# Writes each tool call's arguments with `| tojson`, as Qwen 2.5's and Llama 3.1's templates do.
TOJSON = ("{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}{% else %}{{ m.content }}"
          "{% endif %}{{ '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")


def tool_conversation(arguments):
    call = {"id": "1", "type": "function", "function": {"name": "get", "arguments": arguments}}
    return [{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "content": "sunny"}]


def test_tool_call_arguments_render_once_through_chat_and_the_server(tiny_checkpoint, tmp_path):
    """OpenAI's tool-call arguments are a JSON string: chat() renders the value it encodes (the template's
    `| tojson` writes the JSON once), as /v1/chat/completions does. As in vLLM: None, "" and "null" are {};
    other JSON (an array, a number) passes through; only text that is not JSON is a ValueError naming the
    field. The caller's conversation is not changed."""
    import copy

    path = with_template(tiny_checkpoint, tmp_path / "tojson", TOJSON)
    engine = Engine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8)
    tok = engine.tokenizer
    for arguments, shown in [('{"city": "Paris"}', '{"city": "Paris"}'), ({"city": "Paris"}, '{"city": "Paris"}'),
                             ("{}", "{}"), ("", "{}"), (None, "{}"), ("null", "{}"), (" null ", "{}"),
                             ("[1, 2]", "[1, 2]"), ("3", "3")]:
        conv = tool_conversation(arguments)
        before = copy.deepcopy(conv)
        expected = f"user:weather?\nassistant:get{shown}\ntool:sunny\nassistant:"
        assert tok.decode(render_chat(tok, conv)) == expected, arguments
        assert conv == before
    out = engine.chat(tool_conversation('{"city": "Paris"}'), GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == render_chat(tok, tool_conversation({"city": "Paris"}))
    with pytest.raises(ValueError, match=r"conversations?\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        engine.chat(tool_conversation('{"city": '), GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]\.function\.arguments is not valid JSON"):
        render_chat(tok, tool_conversation("nope"), name="messages")
    # NaN and Infinity: Python's json takes them, a template wrote them, and no tool-call parser reads them back
    for arguments, why in (('{"x": NaN}', r"\.tool_calls\[0\]\.function\.arguments is not valid JSON \(NaN is not JSON\)"),
                           ('{"x": -Infinity}', r"\.tool_calls\[0\]\.function\.arguments is not valid JSON \(-Infinity is not"),
                           ({"x": float("nan")}, r"\['tool_calls'\] must be JSON-serializable: Out of range float"),
                           ({"x": float("inf")}, r"\['tool_calls'\] must be JSON-serializable: Out of range float")):
        with pytest.raises(ValueError, match=r"messages\[1\]" + why):
            render_chat(tok, tool_conversation(arguments), name="messages")


def test_unusual_roles_are_checked_in_one_rendering(checkpoints, monkeypatch):
    """Roles outside the common ones are accepted when the template renders them, refused when it drops them;
    the check renders the conversation once more in all (a re-rendering per message made a 2,000-message body
    hold the server's event loop for 54 s)."""
    _, engine = checkpoints("llama3")
    tok = engine.tokenizer
    calls = []
    apply = tok.apply_chat_template
    monkeypatch.setattr(tok, "apply_chat_template", lambda *a, **kw: calls.append(1) or apply(*a, **kw))
    many = [{"role": "user", "content": "hi"}] + [{"role": f"agent{i}", "content": f"x{i}"} for i in range(50)]
    assert render_chat(tok, many, chat_template=CHATML)
    assert len(calls) == 2
    with pytest.raises(ValueError, match=r"conversation\[1\] has role 'narrator'"):
        render_chat(tok, [{"role": "user", "content": "a"}, {"role": "narrator", "content": "b"}],
                    chat_template=SKIPPING)


def test_an_assistant_message_that_is_all_reasoning_renders(tiny_checkpoint):
    """A reply cut short while thinking comes back from the server (`--reasoning-parser`) with content None and
    its reasoning; sent back in the next turn it renders, its content "" (templates join content as text)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    tok.chat_template = ("{% for m in messages %}{{ m.role }}:{% if m.reasoning_content %}<think>"
                         "{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}\n{% endfor %}")
    conversation = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "reasoning_content": "b"},
                    {"role": "user", "content": "c"}]
    assert tok.decode(render_chat(tok, conversation)) == "user:a\nassistant:<think>b</think>\nuser:c\n"
    assert conversation[1]["content"] is None  # the caller's messages are not changed
    with pytest.raises(ValueError, match="conversation\\[1\\] \\(assistant\\) has no 'content'"):
        render_chat(tok, [{"role": "user", "content": "a"}, {"role": "assistant", "content": None,
                                                             "reasoning_content": None}], name="conversation")


def test_a_conversation_too_long_to_fit_is_refused_before_rendering(checkpoints, monkeypatch):
    """A conversation whose strings (contents, tool-call arguments, the tools' JSON) hold more characters than the
    longest sequence can take is refused before the template runs: rendering megabytes took the server's
    front seconds and a gigabyte, holding every other request. Within the bound it renders and the token count
    decides."""
    from rollout_engine.inputs import NORMALIZER_SLACK, longest_piece

    path, engine = checkpoints("chatml")
    tok = engine.tokenizer
    limit = engine.scheduler.max_seq_len
    bound = NORMALIZER_SLACK * limit * longest_piece(tok)
    rendered = []
    apply = type(tok).apply_chat_template
    monkeypatch.setattr(type(tok), "apply_chat_template",
                        lambda self, msgs, **kw: rendered.append(len(msgs)) or apply(self, msgs, **kw))
    half = "1" * (bound // 2)
    split = [{"role": "user", "content": half}, {"role": "assistant", "content": half[:-9],
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": "1" * 9}}}]},
             {"role": "user", "content": "2" * (bound - 2 * (bound // 2) + 1)}]
    names = len("user" + "assistant" + "user" + "function" + "f")  # the roles and names render too
    assert sum(len(m["content"]) for m in split) + 9 == bound + 1
    with pytest.raises(ValueError, match=f"conversations has {bound + 1 + names} characters"):
        engine.chat(split, GREEDY)
    tools = [{"type": "function", "function": {"name": "f", "description": "1" * bound}}]
    with pytest.raises(ValueError, match="characters, more than"):
        engine.chat(CONVERSATIONS[0], GREEDY, tools=tools)

    async def refused():
        with pytest.raises(ValueError, match=f"conversation has {bound + 1} characters"):
            await async_engine.chat([{"role": "user", "content": "1" * (bound + 1 - len("user"))}], GREEDY)

    with AsyncEngine(path, device="cpu", kv_cache_memory=16 << 20, max_num_seqs=8) as async_engine:
        asyncio.run(refused())
    assert rendered == []
    with pytest.raises(ValueError, match="tokens; sequences hold at most"):
        engine.chat([{"role": "user", "content": "1" * (bound - 40)}], GREEDY)
    assert rendered  # within the bound: rendered, then its tokens counted
    assert render_chat(tok, [{"role": "user", "content": "1" * (bound + 1)}])  # no limit given: no bound
    assert engine.chat(CONVERSATIONS[0], GREEDY)[0].outputs[0].token_ids
