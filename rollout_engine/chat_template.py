"""What a chat template does with a message's content, read off its jinja syntax tree (chat.render_chat asks)."""
from __future__ import annotations

import functools


@functools.lru_cache(maxsize=32)
def iterates_content(template: str) -> bool:
    """Whether `template` loops over a message's content as a list of parts (`{% for part in message['content']
    %}`), as the templates of Llama 3.2 Vision and 4, Mistral, Gemma 3 and Qwen2-VL do. render_chat hands such
    a template text parts as they came, and any other template their texts joined (vLLM's "openai" and
    "string" content formats, told apart the same way).

    A message variable is `messages` or a name that a `for` or `set` binds from an expression using one
    (`{% set loop_messages = messages[1:] %}`). Content read without a loop (`message['content'][0].text`)
    does not count, nor does a loop over another variable's content; a template jinja cannot parse counts as
    taking a string (the rendering then reports its error)."""
    from jinja2 import nodes

    try:
        tree = _parsed(template)
    except Exception:  # noqa: BLE001 - TemplateSyntaxError; a transformers without its jinja helper
        return False
    message_names = {"messages"}
    for node in tree.find_all((nodes.For, nodes.Assign)):  # in the template's order
        source = node.iter if isinstance(node, nodes.For) else node.node
        if isinstance(node.target, nodes.Name) and _names(source) & message_names:
            message_names.add(node.target.name)
    return any(_is_content_of(loop.iter, message_names) for loop in tree.find_all(nodes.For))


def _parsed(template: str):
    """The jinja syntax tree of `template`, parsed with the environment transformers renders it in (its
    extensions: loop controls, `{% generation %}`)."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template(template).environment.parse(template)


def _names(expr) -> set[str]:
    from jinja2 import nodes

    found = {n.name for n in expr.find_all(nodes.Name)}
    return found | {expr.name} if isinstance(expr, nodes.Name) else found


def _is_content_of(expr, message_names: set[str]) -> bool:
    """Whether `expr` is `<message>.content` or `<message>['content']`, filters allowed on it
    (`message['content'] | selectattr('type', 'equalto', 'text')`)."""
    from jinja2 import nodes

    while isinstance(expr, nodes.Filter) and expr.node is not None:
        expr = expr.node
    if isinstance(expr, nodes.Getattr):
        key = expr.attr
    elif isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Const):
        key = expr.arg.value
    else:
        return False
    return key == "content" and bool(_names(expr.node) & message_names)
